"""Benchmark: PULLs pipelined per shard range against one optimiser step after the last
PULL, side by side. Runs ``dgt train FLAGS`` (pipelined, the default) and ``dgt train
FLAGS --no-pipeline-pulls`` in turn, ``--pairs`` times (A B, B A, A B, ...: a drift of
the machine's speed hits both alike)::

    python -m dgt.tools.bench_pipeline [--pairs 5] [--json out.json] -- FLAGS

Per run, from trainer rank 0's own clock (CLOCK_MONOTONIC, ``comm_at`` of its result):

- ``period_ms``: the median time between two consecutive pushes (batch, forward,
  backward, push, PULLs, optimiser step: the whole iteration), iterations 2 on;
- ``tail_ms``: the median time from the push to the end of the optimiser step, i.e.
  ``push_pull`` plus, without pipelining, the ``optimizer.step()`` after it (the part
  of the iteration that pipelining can shorten);
- the parameters' SHA-256: both ways must end at the same bits when neither run lost or
  got late a UDP block (``lost``: those blocks, from the report; a loaded host can drop
  some over loopback, and a lost block changes the aggregate's bits).

Prints one row per pair, with the ratio pipelined / not, the median ratio, and the load
average before each run. Exits 1 when a pair that lost nothing ended at different bits.
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

from dgt.child_argv import module_argv
from dgt.config import OneLineParser

WAYS = {"pipelined": [], "whole": ["--no-pipeline-pulls"]}


def run_once(flags: list[str], way: str, out: str) -> dict:
    """One ``dgt train`` with ``flags`` and ``way``'s flag; its figures (see above)."""
    os.makedirs(out, exist_ok=True)
    report, run_dir = os.path.join(out, "report.json"), os.path.join(out, "run")
    load = os.getloadavg()[0]
    p = subprocess.run([*module_argv("dgt.cli"), "train", *flags, *WAYS[way],
                        "--report", report, "--run-dir", run_dir],
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"bench_pipeline: dgt train ({way}) failed with status "
                         f"{p.returncode}: {' '.join(p.stderr.split()[-80:])}")
    with open(report) as f:
        r = json.load(f)
    with open(os.path.join(run_dir, "trainer-0.json")) as f:
        t = json.load(f)
    return figures(way, t, r, load)


def figures(way: str, trainer: dict, report: dict, load: float) -> dict:
    """One run's row from trainer rank 0's result and the job's report."""
    pushes = [a for a, _ in trainer["comm_at"]]
    period = [b - a for a, b in zip(pushes[1:], pushes[2:])]
    tail = [e - a for (a, _), e in zip(trainer["comm_at"][1:], trainer["stepped_at"][1:])]
    return {"way": way, "load": load, "iterations": trainer["iterations"],
            "period_ms": 1000 * statistics.median(period) if period else None,
            "tail_ms": 1000 * statistics.median(tail) if tail else None,
            "steps_per_iteration": trainer.get("steps_per_iteration"),
            "param_sha256": report["param_sha256"][0],
            "lost": sum(ch.get("blocks_lost", 0) + ch.get("blocks_late", 0)
                        for ch in report["channels"].values()),
            "replicas_identical": report["replicas_identical"]}


def pair_rows(runs: list[dict]) -> list[dict]:
    """Runs in pairs (one of each way, either order) -> one row per pair with the
    ratios pipelined / whole."""
    rows = []
    for i in range(0, len(runs) - 1, 2):
        by = {r["way"]: r for r in runs[i:i + 2]}
        a, b = by["pipelined"], by["whole"]
        rows.append({"pair": i // 2 + 1, "pipelined": a, "whole": b,
                     "period_ratio": a["period_ms"] / b["period_ms"],
                     "tail_ratio": (a["tail_ms"] / b["tail_ms"]
                                    if a["tail_ms"] and b["tail_ms"] else None),
                     "same_bits": a["param_sha256"] == b["param_sha256"],
                     # bits are comparable only when both runs got every block
                     "comparable": not a.get("lost") and not b.get("lost")})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m dgt.tools.bench_pipeline",
                      description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=5, help="pairs of runs (default 5)")
    p.add_argument("--json", default="", help="also write every run and row here")
    p.add_argument("flags", nargs=argparse.REMAINDER,
                   help="after --: the dgt train flags of both ways")
    a = p.parse_args(argv)
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    if a.pairs < 1:
        p.error(f"--pairs must be at least 1, got {a.pairs}")
    if any(f in ("--pipeline-pulls", "--no-pipeline-pulls", "--report", "--run-dir")
           for f in flags):
        p.error("leave --pipeline-pulls, --report and --run-dir out of FLAGS: the "
                "benchmark sets them")
    runs = []
    with tempfile.TemporaryDirectory(prefix="dgt-bench-pipeline-") as tmp:
        for i in range(a.pairs):
            order = ("pipelined", "whole") if i % 2 == 0 else ("whole", "pipelined")
            for way in order:
                r = run_once(flags, way, os.path.join(tmp, f"{i}-{way}"))
                runs.append(r)
                print(f"pair {i + 1} {way:9s}: period {r['period_ms']:.1f} ms, tail "
                      f"{r['tail_ms']:.1f} ms, {r['steps_per_iteration']:.2f} steps/it, "
                      f"load {r['load']:.2f}", flush=True)
    rows = pair_rows(runs)
    print("| pair | period ms (pipelined / whole) | ratio | tail ms (pipelined / whole) "
          "| ratio | same bits | UDP blocks lost or late (pipelined / whole) |")
    print("|---|---|---|---|---|---|---|")
    for w in rows:
        a_, b_ = w["pipelined"], w["whole"]
        print(f"| {w['pair']} | {a_['period_ms']:.1f} / {b_['period_ms']:.1f} | "
              f"{w['period_ratio']:.3f} | {a_['tail_ms']:.1f} / {b_['tail_ms']:.1f} | "
              f"{w['tail_ratio']:.3f} | {w['same_bits']} | {a_['lost']} / {b_['lost']} |")
    med = statistics.median(w["period_ratio"] for w in rows)
    tmed = statistics.median(w["tail_ratio"] for w in rows)
    print(f"median ratio pipelined / whole: period {med:.3f}, tail {tmed:.3f}; "
          f"load average now {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": ["dgt", "train", *flags], "runs": runs, "rows": rows,
                       "median_period_ratio": med, "median_tail_ratio": tmed}, f,
                      indent=1)
    return 0 if all(w["same_bits"] or not w["comparable"] for w in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
