"""``dgt plot REPORT|RUN_DIR``: PNG figures of one training run, with matplotlib.

From a ``dgt train`` report (``--report``) or a run directory (``--run-dir``: the
per-iteration traces ``trace-<rank>.jsonl`` and ``trainer-<rank>.json``) it writes:

- ``accuracy_time.png``: test accuracy against wall time (s);
- ``accuracy_iteration.png``: test accuracy against iteration;
- ``comm_time.png``: comm time per iteration (ms; rank 0, or every rank from traces);
- ``channel_bytes.png``: bytes sent per channel (MB), the job's totals.

matplotlib is imported only when the command runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .run_files import job_world
from .trace import channel_totals, comm_times_ms, read_run, skipped_note


def load(source: str) -> dict:
    """{history, comm_ms: {rank: [ms]}, channels: {name: {field: n}}, notes: [what was
    skipped]} from a report file or a run directory; a trace's unreadable lines and an
    unreadable trainer-0.json are skipped and named in ``notes``. Raises ValueError
    saying what is missing."""
    if os.path.isdir(source):
        skipped: dict[str, int] = {}
        traces = read_run(source, skipped, job_world(source))   # this job's ranks
        notes = skipped_note(skipped)
        history = []
        path = os.path.join(source, "trainer-0.json")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    history = json.loads(f.read())["history"]
                _checked({"history": history, "channels": {}, "comm_ms": {}}, path)
            except (OSError, ValueError, KeyError, TypeError):
                history = []
                notes.append(f"{path}: unreadable, no accuracy curve")
        if not traces and not history:
            raise ValueError(f"{source} holds no trace-<rank>.jsonl nor trainer-0.json; "
                             f"give a dgt train --run-dir or --report")
        channels: dict = {}
        for lines in traces.values():
            for name, ch in channel_totals(lines).items():
                acc = channels.setdefault(name, {})
                for k, v in ch.items():
                    acc[k] = acc.get(k, 0) + v
        return _checked({"history": history, "channels": channels, "notes": notes,
                         "comm_ms": {r: comm_times_ms(lines)
                                     for r, lines in traces.items()}}, source)
    try:
        with open(source) as f:
            r = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {source}: {e.strerror}") from None
    except ValueError:
        raise ValueError(f"{source} is not a JSON report; give a dgt train --report file "
                         f"or a --run-dir") from None
    if not isinstance(r, dict) or "channels" not in r or "history" not in r:
        raise ValueError(f"{source} is not a dgt train report (no 'history'/'channels')")
    return _checked({"history": r["history"], "channels": r["channels"],
                     "comm_ms": {0: r.get("comm_ms", [])}}, source)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _checked(data: dict, source: str) -> dict:
    """``data`` if every field plot() reads has the type a report gives it; else
    ValueError naming the first field that does not (a hand-edited or foreign file)."""
    def bad(what: str):
        return ValueError(f"{source} is not a dgt train report: {what}")
    if not isinstance(data["history"], list):
        raise bad("'history' is not a list")
    for i, h in enumerate(data["history"]):
        if not isinstance(h, dict) or not all(_number(h.get(k)) for k in (
                "seconds", "iteration")) or not (h.get("test_accuracy") is None or
                                                 _number(h["test_accuracy"])):
            raise bad(f"history[{i}] lacks numeric 'seconds', 'iteration' and "
                      f"'test_accuracy'")
    if not isinstance(data["channels"], dict):
        raise bad("'channels' is not an object")
    for name, ch in data["channels"].items():
        if not isinstance(ch, dict) or not all(_number(ch.get(k)) for k in (
                "bytes_sent", "bytes_delivered")):
            raise bad(f"channels[{name!r}] lacks numeric 'bytes_sent' and "
                      f"'bytes_delivered'")
    for rank, ms in data["comm_ms"].items():
        if not isinstance(ms, list) or not all(_number(v) for v in ms):
            raise bad("'comm_ms' is not a list of numbers")
    return data


def plot(data: dict, out_dir: str, title: str = "") -> list[str]:
    """Write the PNGs into ``out_dir`` (created when missing, but never its parents: a
    mistyped path is an error, not a new tree); returns their paths. Raises OSError."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    try:
        os.mkdir(out_dir)
    except FileExistsError:
        pass
    paths = []

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    hist = [h for h in data["history"] if h.get("test_accuracy") is not None]
    for key, xlabel, name in (("seconds", "wall time (s)", "accuracy_time.png"),
                              ("iteration", "iteration", "accuracy_iteration.png")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([h[key] for h in hist], [h["test_accuracy"] for h in hist], marker="o")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{title}test accuracy".strip())
        ax.grid(alpha=0.3)
        save(fig, name)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rank, ms in sorted(data["comm_ms"].items()):
        ax.plot(range(len(ms)), ms, label=f"rank {rank}", lw=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("comm time (ms)")
    ax.set_title(f"{title}comm time per iteration".strip())
    ax.grid(alpha=0.3)
    if len(data["comm_ms"]) > 1:
        ax.legend(fontsize=8)
    save(fig, "comm_time.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
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
    save(fig, "channel_bytes.png")
    return paths


def main(ns: argparse.Namespace) -> int:
    try:
        data = load(ns.source)
    except ValueError as e:
        ns.parser.error(str(e))
    for note in data.get("notes", []):
        print(f"dgt plot: {note}", file=sys.stderr)
    out = ns.out or (ns.source if os.path.isdir(ns.source)
                     else os.path.dirname(os.path.abspath(ns.source)))
    try:
        paths = plot(data, out, ns.title + ": " if ns.title else "")
    except OSError as e:
        ns.parser.error(f"--out {out}: {e.strerror or e}")
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
    p.add_argument("--out", default="", help="folder for the PNGs, created if its parent "
                   "exists (default: beside the report, or in the run dir)")
    p.add_argument("--title", default="", help="prefix for the figure titles")
    p.set_defaults(func=main, parser=p)
