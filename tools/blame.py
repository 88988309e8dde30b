"""Blame matrix: kill (SIGKILL) or freeze (SIGSTOP) each process of a ``dgt train`` job in
turn, and check that the launcher's headline names the rank it happened to.

For every rank r < ``--workers``, every kind (sidecar, trainer) and every signal, one
job is started on loopback (``--epochs 200 --peer-timeout-s P``, so it is still training
when the signal comes); once rank 0 prints its first progress line, the process found in
the run dir's ``pids.json`` gets the signal (a frozen one gets SIGCONT after the job
ends). The cell passes when the job fails, its first ``dgt train: failed:`` line starts
with ``rank(s) [r]`` or ``<kind> of rank r``, and no process of the job is left alive.
The launcher learns the rank from the failure records (``dgt.failure``), never from log
text.

``python -m dgt.tools.blame --workers 4`` prints one line per cell and a summary; exit 1
when a cell fails.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from dgt.child_argv import module_argv
from dgt.config import OneLineParser

SIGNALS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}


def _alive(pid: int) -> bool:
    """True for a process that exists and is no zombie."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def run_cell(workers: int, kind: str, rank: int, how: str, peer_timeout_s: float,
             timeout_s: float) -> tuple[bool, str]:
    """One job, one signal: (passed, the headline or why it failed)."""
    with tempfile.TemporaryDirectory(prefix="dgt-blame-") as tmp:
        run = os.path.join(tmp, "run")
        p = subprocess.Popen([*module_argv("dgt.cli"), "train", "--workers",
                              str(workers), "--epochs", "200", "--hidden", "64",
                              "--peer-timeout-s", str(peer_timeout_s), "--run-dir", run],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        victim = None
        try:
            for line in p.stdout:   # rank 0's progress: every process is training
                if line.startswith("epoch"):
                    break
            with open(os.path.join(run, "pids.json")) as f:
                pids = json.load(f)
            victim = next(x["pid"] for x in pids if (x["kind"], x["rank"]) == (kind, rank))
            os.kill(victim, SIGNALS[how])
            out, err = p.communicate(timeout=timeout_s)
        except (subprocess.TimeoutExpired, OSError, StopIteration, ValueError) as e:
            p.kill()
            p.wait()
            return False, f"no end within {timeout_s:.0f} s or no pids.json ({e!r})"
        finally:
            if victim is not None and how == "freeze":
                try:
                    os.kill(victim, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        failed = [ln.split("dgt train: failed: ", 1)[1] for ln in (out + err).splitlines()
                  if "dgt train: failed: " in ln]
        left = [x["pid"] for x in pids if _alive(x["pid"])]
        if p.returncode == 0 or not failed:
            return False, f"exit {p.returncode}, no failure headline"
        ok = failed[0].startswith((f"rank(s) [{rank}] ", f"{kind} of rank {rank} "))
        if left:
            return False, f"left alive: {left}; headline: {failed[0][:120]}"
        return ok, failed[0][:140]


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m dgt.tools.blame",
                      description="Kill or freeze each rank's sidecar and trainer in turn "
                                  "and check the launcher's headline names that rank.")
    p.add_argument("--workers", type=int, default=4, help="ranks of each job (default 4)")
    p.add_argument("--kinds", default="sidecar,trainer",
                   help="process kinds to hit, comma-separated (default sidecar,trainer)")
    p.add_argument("--signals", default="kill,freeze",
                   help="kill (SIGKILL) and/or freeze (SIGSTOP) (default kill,freeze)")
    p.add_argument("--peer-timeout-s", type=float, default=5.0,
                   help="the jobs' --peer-timeout-s (default 5)")
    p.add_argument("--timeout-s", type=float, default=180.0,
                   help="bound on each job's end after the signal (default 180)")
    ns = p.parse_args(argv)
    kinds = ns.kinds.split(",")
    hows = ns.signals.split(",")
    if ns.workers < 2 or set(kinds) - {"sidecar", "trainer"} or set(hows) - set(SIGNALS):
        p.error("--workers must be >= 2, --kinds of sidecar,trainer, --signals of "
                "kill,freeze")
    passed = total = 0
    t0 = time.monotonic()
    for rank in range(ns.workers):
        for kind in kinds:
            for how in hows:
                ok, what = run_cell(ns.workers, kind, rank, how, ns.peer_timeout_s,
                                    ns.timeout_s)
                total += 1
                passed += ok
                print(f"{'ok  ' if ok else 'FAIL'} {how:6s} {kind:7s} of rank {rank}: {what}",
                      flush=True)
    print(f"blame: {passed}/{total} cells name the right rank "
          f"({time.monotonic() - t0:.0f} s)")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
