"""Progress bars for ``dgt train`` and ``dgt bench``, with rich, on a terminal only.

On a terminal (stdout is a TTY) a rich progress bar shows iterations (``dgt train``:
rank 0's per-iteration trace, ``trace-0.jsonl``) or cells (``dgt bench``) with the rate
and the ETA; the lines the job prints (rank 0's epoch lines, the bench's cell lines)
still appear, above the bar. When stdout is not a terminal (pipes, CI, tests) nothing
changes: the same plain lines and no bar. rich is imported only on a terminal.
"""
from __future__ import annotations

import os
import sys
import time


def on_terminal() -> bool:
    return sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


def _bar():
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    transient=False)


class TrainProgress:
    """``dgt train``'s bar on a terminal: follows ``trace-0.jsonl`` (one line per
    iteration) and prints the new lines of ``trainer-0.log`` (rank 0's stdout goes
    there while the bar runs) above the bar. ``total``: iterations, None if unknown."""

    PERIOD_S = 0.25

    def __init__(self, run_dir: str, total: int | None):
        self.trace = os.path.join(run_dir, "trace-0.jsonl")
        self.log = os.path.join(run_dir, "trainer-0.log")
        self.total = total
        self.done = 0
        self.offsets = {self.trace: 0, self.log: 0}
        self.partial = ""
        self.first: tuple[float, int] | None = None
        self.next_at = 0.0
        self.bar = _bar()
        self.task = self.bar.add_task("train", total=total, rate="")
        self.bar.start()

    def _read_new(self, path: str) -> str:
        try:
            with open(path, errors="replace") as f:
                f.seek(self.offsets[path])
                text = f.read()
                self.offsets[path] = f.tell()
            return text
        except OSError:
            return ""

    def update(self) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.PERIOD_S
        self.done += self._read_new(self.trace).count('"kind":"iteration"')
        text = self.partial + self._read_new(self.log)
        *lines, self.partial = text.split("\n")
        for ln in lines:
            if ln.strip():
                self.bar.console.print(ln, markup=False, highlight=False)
        if self.done and self.first is None:   # the rate counts from the first iteration
            self.first = (now, self.done)
        rate = ""
        if self.first is not None and now > self.first[0]:
            rate = f"{(self.done - self.first[1]) / (now - self.first[0]):5.1f} it/s"
        self.bar.update(self.task, completed=self.done, rate=rate)

    def close(self) -> None:
        self.next_at = 0.0
        self.update()
        if self.partial.strip():
            self.bar.console.print(self.partial, markup=False, highlight=False)
        self.bar.stop()


class CellProgress:
    """``dgt bench``'s bar over its cells (terminal only; else does nothing)."""

    def __init__(self, n_cells: int):
        self.bar = None
        if on_terminal():
            self.bar = _bar()
            self.task = self.bar.add_task("bench", total=n_cells, rate="")
            self.t0 = time.monotonic()
            self.done = 0

    def start(self) -> "CellProgress":
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self) -> None:
        if self.bar is not None:
            self.done += 1
            per = (time.monotonic() - self.t0) / self.done
            self.bar.update(self.task, advance=1, rate=f"{per / 60:.1f} min/cell")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
