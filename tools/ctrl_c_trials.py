"""Measurement: what a Ctrl-C in the first second of ``dgt train`` does, over many tries.

A Ctrl-C at some moments of start-up lands where Python cannot raise it cleanly: inside
a weakref callback of the import system (Python prints ``Exception ignored in …`` and
goes on), or inside Python code that torch's C++ import calls back (pybind11 aborts the
process). Those are rare moments, so this counts outcomes rather than asserting one::

    python -m dgt.tools.ctrl_c_trials [--rounds 20] [--delays 0.5,0.7,0.85,1.0,1.2] [--json]

Each round starts ``dgt train --workers 2 --epochs 3`` once per delay, in a session of
its own, sends SIGINT to its process group after the delay (the terminal's Ctrl-C),
and classifies the launcher's end: ``ok`` (no text but its own line), ``ignored``
(``Exception ignored`` on stderr), ``abort`` (``terminate called``), ``traceback``
(any other ``Traceback``), each with its exit status (130: the command's own handling;
-2: died of SIGINT before any handler; -6: SIGABRT). Set ``PYTHONPATH`` to measure
another checkout's code. Timing plays no part in the result; the load decides which
moments are hit, so note it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys

from dgt.child_argv import module_argv


def classify(stderr: str) -> str:
    """The kind of end that ``stderr`` (the launcher's) shows."""
    if "terminate called" in stderr:
        return "abort"
    if "Exception ignored" in stderr:
        return "ignored"
    return "traceback" if "Traceback" in stderr else "ok"


def trial(delay_s: float) -> tuple[str, int]:
    """One start, Ctrl-C after ``delay_s`` seconds: (kind, exit status)."""
    p = subprocess.Popen(module_argv("dgt.cli") + ["train", "--workers", "2", "--epochs",
                                                   "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        p.communicate(timeout=delay_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    return classify(err), p.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgt.tools.ctrl_c_trials",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    ap.add_argument("--delays", default="0.5,0.7,0.85,1.0,1.2",
                    help="seconds after the start, comma-separated")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    try:
        delays = [float(x) for x in args.delays.split(",")]
    except ValueError:
        ap.error(f"--delays {args.delays!r}: give seconds separated by commas, e.g. 0.5,1")
    if args.rounds < 1 or not delays or min(delays) <= 0:
        ap.error("--rounds must be at least 1 and every delay above 0")
    counts: collections.Counter = collections.Counter()
    for r in range(args.rounds):
        for d in delays:
            counts[trial(d)] += 1
        print(f"round {r + 1}/{args.rounds}: {dict(counts)}", file=sys.stderr, flush=True)
    rows = {f"{kind} {code}": n for (kind, code), n in sorted(counts.items())}
    if args.json:
        print(json.dumps({"load_average": os.getloadavg(), "outcomes": rows}))
    else:
        for k, n in rows.items():
            print(f"{k:>16}  {n}")
        print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
