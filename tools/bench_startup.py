"""Benchmark: the start-up of a job, dgt against the gloo baseline, side by side.

The clean-link time to target of ``dgt bench`` is reached in 4 iterations, so start-up
weighs on it: each trainer's ``register()`` (the sidecars' agreement and connections;
gloo's ``init_process_group``) and the first push, whose buffers are fresh memory. This
runs the same short job on loopback, round by round in turn::

    python -m dgt.tools.bench_startup [--rounds 3] [--workers 4] [--hidden 2500] [--json out.json]

with three systems: ``dgt train --mode dgt``; the same with numpy's huge-page advice
forced on (``NUMPY_MADVISE_HUGEPAGE=1``, what the sidecars had before dgt.hugepages);
and ``python -m dgt.tools.gloo_train``. Each prints ``register_seconds`` (the slowest
rank's), the first ``push_pull`` (``comm_ms[0]``: rank 0's first push to the applied
aggregate, the optimiser steps of pipelined PULLs included) and the time to iterations
2 and 4 (the report's ``history``); the table gives each one's median over the rounds.
Timing belongs here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from dgt.child_argv import module_argv, typed_command

SYSTEMS = {
    "dgt": (module_argv("dgt.cli") + ["train", "--mode", "dgt"], {}),
    "dgt, numpy huge-page advice": (module_argv("dgt.cli") + ["train", "--mode", "dgt"],
                                    {"NUMPY_MADVISE_HUGEPAGE": "1"}),
    "gloo all_reduce": (module_argv("dgt.tools.gloo_train"), {}),
}
FIELDS = ("register_s", "first_push_pull_ms", "to_iteration_2_s", "to_iteration_4_s")


def one(argv: list[str], env: dict, common: list[str], timeout_s: float) -> dict:
    """Run one job; returns its start-up figures. Raises RuntimeError when it fails."""
    with tempfile.TemporaryDirectory(prefix="dgt-startup-") as d:
        report = os.path.join(d, "report.json")
        p = subprocess.run(argv + common + ["--report", report], capture_output=True,
                           text=True, env=dict(os.environ, **env), timeout=timeout_s)
        if p.returncode or not os.path.exists(report):
            tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"{' '.join(typed_command(argv))} exited {p.returncode}: "
                               f"{tail[0]}")
        with open(report) as f:
            r = json.load(f)
    at = {h["iteration"]: h["seconds"] for h in r["history"]}
    return {"register_s": r["register_seconds"], "first_push_pull_ms": r["comm_ms"][0],
            "to_iteration_2_s": at.get(2), "to_iteration_4_s": at.get(4),
            "replicas_identical": r["replicas_identical"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_startup",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of every system (default 3)")
    p.add_argument("--workers", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--hidden", type=int, default=2500,
                   help="MLP hidden width (default 2500, dgt bench's)")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="seconds one job may take (default 300)")
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.workers < 2 or args.hidden < 1 or args.timeout_s <= 0:
        p.error("--rounds >= 1, --workers >= 2, --hidden >= 1 and --timeout-s > 0")
    from dgt.tools.cli import check_output
    try:
        check_output("--json", args.json or None)   # before the work, not after it
    except ValueError as e:
        p.error(str(e))
    common = ["--workers", str(args.workers), "--hidden", str(args.hidden), "--epochs", "8",
              "--iterations", "5", "--eval-every", "2", "--seed", "0"]
    load = [os.getloadavg()]
    rows: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    try:
        for rnd in range(args.rounds):
            for name, (cmd, env) in SYSTEMS.items():
                r = one(cmd, env, common, args.timeout_s)
                rows[name].append(r)
                print(f"round {rnd + 1}/{args.rounds} {name}: register {r['register_s']:.3f} s, "
                      f"first push_pull {r['first_push_pull_ms']:.0f} ms, iteration 2 at "
                      f"{r['to_iteration_2_s']:.2f} s", file=sys.stderr, flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    load.append(os.getloadavg())
    print(f"MLP hidden {args.hidden}, {args.workers} workers on loopback, {args.rounds} "
          f"rounds; load average {load[0][0]:.2f} before, {load[1][0]:.2f} after; medians")
    print("| system | register s | first push_pull ms | to iteration 2 s | "
          "to iteration 4 s |")
    print("|---|---|---|---|---|")
    out = {"workers": args.workers, "hidden": args.hidden, "rounds": args.rounds,
           "load_avg_before": load[0], "load_avg_after": load[1], "systems": {}}
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in FIELDS}
        out["systems"][name] = {"runs": runs, "median": med}
        print(f"| {name} | {med['register_s']:.3f} | {med['first_push_pull_ms']:.0f} | "
              f"{med['to_iteration_2_s']:.2f} | {med['to_iteration_4_s']:.2f} |")
    if args.json:
        from dgt.atomic import write_json
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
