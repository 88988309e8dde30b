"""``dgt plot REPORT|RUN_DIR``: PNG figures of one training run, with matplotlib.

From a ``dgt train`` report (``--report``) or a run directory (``--run-dir``: the
per-iteration traces ``trace-<rank>.jsonl`` and ``trainer-<rank>.json``) it writes:

- ``accuracy_time.png``: test accuracy against wall time (s);
- ``accuracy_iteration.png``: test accuracy against iteration;
- ``comm_time.png``: comm time per iteration (ms; rank 0, or every rank from traces);
- ``channel_bytes.png``: bytes sent per channel (MB), the job's totals.

Every number it reads must be a finite number within the range of its field (``LIMIT``,
``_checked``); a report that holds another is refused in one line naming the field.
matplotlib is imported only when the command runs.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import sys

from . import outpath
from .atomic import write_atomic
from .run_files import job_world, read_json
from .trace import channel_totals, comm_times_ms, read_run, skipped_note


def load(source: str) -> dict:
    """{history, comm_ms: {rank: [ms]}, channels: {name: {field: n}}, notes: [what was
    skipped]} from a report file or a run directory; a trace's unreadable lines, a
    trace, ``pids.json`` or ``trainer-0.json`` that is not a regular file (a FIFO, a
    device, a directory: dgt.run_files.open_regular), and an unreadable trainer-0.json
    are skipped and named in ``notes``. A report or trainer-0.json over
    dgt.run_files.MAX_RECORD bytes is not read. Raises ValueError saying what is
    missing."""
    if os.path.isdir(source):
        skipped: dict[str, int] = {}
        refused: dict[str, str] = {}
        notes: list[str] = []
        world = job_world(source, notes)   # this job's ranks
        traces = read_run(source, skipped, world, refused)
        notes += skipped_note(skipped, refused)
        history = []
        path = os.path.join(source, "trainer-0.json")
        if os.path.exists(path):
            try:
                history = read_json(path)["history"]
                _checked({"history": history, "channels": {}, "comm_ms": {}}, path)
            except NotAReport as e:
                history = []
                notes.append(f"{path}: unreadable ({e.what}), no accuracy curve")
            except OSError as e:   # RefusedFile: a FIFO, a device, too large
                history = []
                notes.append(f"{path}: unreadable ({e.strerror or e}), no accuracy curve")
            except (ValueError, KeyError, TypeError):
                history = []
                notes.append(f"{path}: unreadable, no accuracy curve")
        if not traces and not history:
            why = f" ({'; '.join(notes)})" if notes else ""
            raise ValueError(f"{source} holds no {'readable ' if notes else ''}"
                             f"trace-<rank>.jsonl nor trainer-0.json{why}; give a dgt "
                             f"train --run-dir or --report")
        channels: dict = {}
        for lines in traces.values():
            for name, ch in channel_totals(lines).items():
                acc = channels.setdefault(name, {})
                for k, v in ch.items():
                    acc[k] = acc.get(k, 0) + v
        return _checked({"history": history, "channels": channels, "notes": notes,
                         "comm_ms": {r: comm_times_ms(lines)
                                     for r, lines in traces.items()}}, source,
                        from_traces=True)
    try:
        r = read_json(source)
    except OSError as e:   # RefusedFile: a FIFO, a device, too large
        raise ValueError(f"cannot read {source}: {e.strerror}") from None
    except ValueError:
        raise ValueError(f"{source} is not a JSON report; give a dgt train --report file "
                         f"or a --run-dir") from None
    if not isinstance(r, dict) or "channels" not in r or "history" not in r:
        raise ValueError(f"{source} is not a dgt train report (no 'history'/'channels')")
    return _checked({"history": r["history"], "channels": r["channels"],
                     "comm_ms": {0: r.get("comm_ms", [])}}, source)


#: the largest count, byte total, iteration, second or millisecond plot() accepts: far
#: beyond any run (a petabyte; 31 million years), below 2**53 (every whole number up to
#: it is exact as a float), and an axis matplotlib lays out (a report edited to hold
#: 10**400, no float, or 1e308 and -1e308, whose span overflows its tick arithmetic,
#: was a traceback). Nothing plot() reads is negative.
LIMIT = 1e15


class NotAReport(ValueError):
    """A file plot() cannot draw: ``what`` names the first field that is wrong."""

    def __init__(self, source: str, what: str):
        super().__init__(f"{source} is not a dgt train report: {what}")
        self.what = what


class DrawError(Exception):
    """matplotlib failed to draw a figure of data that passed ``_checked``."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _shown(v) -> str:
    """``v`` for an error line: an integer of more than 16 digits is cut short."""
    s = repr(v)
    if isinstance(v, int) and len(s) > 16:
        return f"{s[:10]}… ({len(s.lstrip('-'))} digits)"
    return s


def _checked(data: dict, source: str, from_traces: bool = False) -> dict:
    """``data`` if every field plot() reads has the type a report gives it and a value
    in its range (a fraction for test_accuracy, 0 to ``LIMIT`` for the rest); else
    NotAReport naming the first field that does not (a hand-edited or foreign file).
    ``from_traces``: channels and comm_ms come from a run dir's traces, not a report."""
    def bad(what: str):
        return NotAReport(source, what)

    def in_range(v, where: str, hi: float = LIMIT) -> None:
        try:
            x = float(v)
        except OverflowError:   # an int beyond float's range
            x = math.inf
        if not 0 <= x <= hi:
            raise bad(f"{where} = {_shown(v)} is outside 0 to {hi:g}")
    if not isinstance(data["history"], list):
        raise bad("'history' is not a list")
    for i, h in enumerate(data["history"]):
        if not isinstance(h, dict) or not all(_number(h.get(k)) for k in (
                "seconds", "iteration")) or not (h.get("test_accuracy") is None or
                                                 _number(h["test_accuracy"])):
            raise bad(f"history[{i}] lacks numeric 'seconds', 'iteration' and "
                      f"'test_accuracy'")
        for k in ("seconds", "iteration"):
            in_range(h[k], f"history[{i}][{k!r}]")
        if h.get("test_accuracy") is not None:
            in_range(h["test_accuracy"], f"history[{i}]['test_accuracy']", 1)
    if not isinstance(data["channels"], dict):
        raise bad("'channels' is not an object")
    summed = " (summed over the traces)" if from_traces else ""
    for name, ch in data["channels"].items():
        if not isinstance(ch, dict) or not all(_number(ch.get(k)) for k in (
                "bytes_sent", "bytes_delivered")):
            raise bad(f"channels[{name!r}] lacks numeric 'bytes_sent' and "
                      f"'bytes_delivered'")
        for k in ("bytes_sent", "bytes_delivered"):
            in_range(ch[k], f"channels[{name!r}][{k!r}]{summed}")
    for rank, ms in data["comm_ms"].items():
        if not isinstance(ms, list) or not all(_number(v) for v in ms):
            raise bad("'comm_ms' is not a list of numbers")
        for j, v in enumerate(ms):
            in_range(v, f"trace-{rank}.jsonl comm_s (ms) of iteration line {j}"
                     if from_traces else f"comm_ms[{j}]")
    return data


@contextlib.contextmanager
def _drawing(name: str):
    """Turn matplotlib's failure to draw ``name`` (data it cannot lay out, a label it
    cannot parse as mathtext) into one DrawError line."""
    try:
        yield
    except (ValueError, ArithmeticError) as e:   # mathtext's errors are ValueErrors
        said = " ".join(x.strip() for x in str(e).splitlines() if x.strip())
        said = said if len(said) <= 200 else said[:199] + "…"
        raise DrawError(f"matplotlib cannot draw {name}: "
                        f"{said or type(e).__name__}") from None


#: what matplotlib logs on its first run in a new home (building its font cache): a
#: notice, no error, that came on stderr before a command's own output
FIRST_RUN_NOTICES = ("generated new fontManager", "Matplotlib is building the font cache")


class _NoFirstRunNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(FIRST_RUN_NOTICES)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, for every dgt command that draws: its
    first-run notices (:data:`FIRST_RUN_NOTICES`) are dropped, its other warnings and
    errors pass."""
    log = logging.getLogger("matplotlib.font_manager")   # matplotlib's, made before it
    if not any(isinstance(f, _NoFirstRunNotices) for f in log.filters):
        log.addFilter(_NoFirstRunNotices())
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


#: the PNGs :func:`plot` writes, in this order
FIGURES = ("accuracy_time.png", "accuracy_iteration.png", "comm_time.png",
           "channel_bytes.png")


def save_png(fig, path: str, dpi: int) -> None:
    """Write matplotlib figure ``fig`` to ``path`` as a PNG the way every dgt output is
    written (dgt.outpath, dgt.atomic): never over a file that is not a PNG, nor another
    user's in a sticky folder (:func:`check_png`), and through a temporary file renamed
    into place, so a symbolic link there is replaced, never written through (breaker
    round 9: ``dgt plot`` and ``dgt bench`` wrote their PNGs through a link that another
    user had put beside the report, over a root file). Raises OSError."""
    check_png(path)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi), fsync=False)


def check_png(path: str) -> None:
    """Raise FileExistsError when ``path`` may not be replaced by a PNG
    (dgt.outpath.refusal); its strerror names the file."""
    why = outpath.refusal(path, "png")
    if why is not None:
        raise FileExistsError(errno.EEXIST, f"{os.path.basename(path)}: {why}", path)


def plot(data: dict, out_dir: str, title: str = "") -> list[str]:
    """Write the PNGs (:data:`FIGURES`) into ``out_dir`` (created when missing, but
    never its parents: a mistyped path is an error, not a new tree), each by
    :func:`save_png`, every name checked before the first is drawn; returns their
    paths. Raises OSError, DrawError (matplotlib could not draw one: neither it nor
    those after it are written)."""
    plt = pyplot()
    try:
        os.mkdir(out_dir)
    except FileExistsError:
        pass
    for name in FIGURES:
        check_png(os.path.join(out_dir, name))
    paths = []

    def figure(name, draw):
        """One PNG: ``draw(ax)`` fills its axes; matplotlib's failure is a DrawError."""
        fig, ax = plt.subplots(figsize=(6, 3.5))
        try:
            with _drawing(name):
                draw(ax)
                fig.tight_layout()
                path = os.path.join(out_dir, name)
                save_png(fig, path, 100)
        finally:
            plt.close(fig)
        paths.append(path)

    hist = [h for h in data["history"] if h.get("test_accuracy") is not None]

    def accuracy(key, xlabel):
        def draw(ax):
            ax.plot([h[key] for h in hist], [h["test_accuracy"] for h in hist], marker="o")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test accuracy")
            ax.set_title(f"{title}test accuracy".strip())
            ax.grid(alpha=0.3)
        return draw

    def comm_time(ax):
        for rank, ms in sorted(data["comm_ms"].items()):
            ax.plot(range(len(ms)), ms, label=f"rank {rank}", lw=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel("comm time (ms)")
        ax.set_title(f"{title}comm time per iteration".strip())
        ax.grid(alpha=0.3)
        if len(data["comm_ms"]) > 1:
            ax.legend(fontsize=8)

    def channel_bytes(ax):
        names = list(data["channels"])
        sent = [data["channels"][n]["bytes_sent"] / 1e6 for n in names]
        got = [data["channels"][n]["bytes_delivered"] / 1e6 for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], sent, width=0.4, label="sent")
        ax.bar([i + 0.2 for i in x], got, width=0.4, label="delivered")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("MB")
        ax.set_title(f"{title}bytes per channel".strip())
        ax.legend(fontsize=8)

    for name, draw in zip(FIGURES, (accuracy("seconds", "wall time (s)"),
                                    accuracy("iteration", "iteration"), comm_time,
                                    channel_bytes)):
        figure(name, draw)
    return paths


def main(ns: argparse.Namespace) -> int:
    if ns.out is not None and not ns.out.strip():
        ns.parser.error("--out is empty; give a folder for the PNGs, or leave --out out "
                        "to write them beside the report (in the run dir)")
    try:
        data = load(ns.source)
    except ValueError as e:
        ns.parser.error(str(e))
    for note in data.get("notes", []):
        print(f"dgt plot: {note}", file=sys.stderr)
    out = ns.out or (ns.source if os.path.isdir(ns.source)
                     else os.path.dirname(os.path.abspath(ns.source)))
    from .outpath import folder_problem
    why = folder_problem(out)   # breaker round 11: a file on the path, /proc
    if why is not None:
        ns.parser.error(f"--out {out}: {why}; give another folder")
    try:
        paths = plot(data, out, ns.title + ": " if ns.title else "")
    except OSError as e:
        ns.parser.error(f"--out {out}: {e.strerror or e}")
    except DrawError as e:
        ns.parser.error(f"{ns.source}: {e}")
    for p in paths:
        print(p)
    return 0


def register(sub) -> None:
    """Add ``dgt plot`` to the CLI."""
    p = sub.add_parser("plot", help="PNG figures of a run (report or run dir)",
                       description="Plot accuracy against wall time and iteration, comm "
                       "time per iteration and bytes per channel from a dgt train "
                       "--report file or --run-dir.")
    p.add_argument("source", metavar="REPORT|RUN_DIR", help="report JSON or run directory")
    p.add_argument("--out", default=None, help="folder for the PNGs, created if its parent "
                   "exists (default: beside the report, or in the run dir)")
    p.add_argument("--title", default="", help="prefix for the figure titles")
    p.set_defaults(func=main, parser=p)
