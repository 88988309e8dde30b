"""``python -m dgt.tools.pull_lag RUN_DIR``: how late each PULL lands behind its shard's
first PULL to a remote worker, from a job's per-rank traces (``trace-<rank>.jsonl``,
docs/metrics.md).

A shard sends the same iteration's PULL to every worker at once, so their arrival
times should be close; a PULL that lands 200 ms behind the others is a stalled TCP
connection (docs/tc_profiles.md, "The TCP bands' queue"), and in BSP that stall
is every worker's. For each iteration seen by every rank and each shard s, the lag of
worker w's PULL is ``pull_s[s]`` at w minus the earliest ``pull_s[s]`` among the
workers other than s (the colocated PULL is in-process and left out).

It also splits each iteration's communication in two (:func:`phases`): the **push
skew**, from the first worker's push to the last one's (compute and CPU contention:
no shard can finish before the last push), and the **network phase**, from the last
worker's END to each remote PULL's arrival (the last blocks' transit, the shard's
aggregation and the PULL's transit).

Output: a histogram of the lags in 25 ms buckets, the iterations with a lag above
``--stall-ms``, the two phases (median, p90, max in ms), and (``--json``) all of it as
JSON. Exit status 2 with one line for a run
directory without traces.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

from dgt.run_files import job_world, of_job
from dgt.trace import read_trace


def load(run_dir: str) -> dict[int, dict[int, dict]]:
    """{iteration: {rank: that rank's iteration record}} from ``trace-*.jsonl``, of the
    ranks of the job in ``run_dir``'s ``pids.json`` when it has one
    (dgt.run_files.job_world: a previous job's traces of more ranks are not this job's).
    Raises FileNotFoundError when there is no trace, dgt.run_files.RefusedFile (an
    OSError) for one that is not a regular file (a FIFO, /dev/zero); skips lines that are not an
    iteration record (not JSON, not an object, or without an int ``t`` and ``rank`` and
    a ``pull_s`` object)."""
    paths = of_job(os.path.join(run_dir, "trace-*.jsonl"), job_world(run_dir))
    if not paths:
        raise FileNotFoundError(f"no trace-<rank>.jsonl in {run_dir} (a run dir of dgt "
                                f"train --run-dir)")
    out: dict[int, dict[int, dict]] = {}
    for p in paths:
        for x in read_trace(p):   # a FIFO or a device: RefusedFile, never read
            if x.get("kind") == "iteration" and isinstance(x.get("t"), int) and \
                    isinstance(x.get("rank"), int) and isinstance(x.get("pull_s"), dict):
                out.setdefault(x["t"], {})[x["rank"]] = x
    return out


def _num(v) -> bool:
    """A time in a trace record: an int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def complete(traces: dict[int, dict[int, dict]]):
    """(t, {rank: record}) of each iteration every rank traced (at least 2 ranks), in
    order."""
    ranks = max((len(rs) for rs in traces.values()), default=0)
    return [(t, rs) for t, rs in sorted(traces.items()) if len(rs) == ranks >= 2]


def lags(traces: dict[int, dict[int, dict]], bucket_ms: float = 25.0,
         stall_ms: float = 150.0) -> dict:
    """Histogram {bucket start ms: PULLs} of the lags, ``pulls`` counted, and
    ``stalled``: the iterations (sorted) with a lag above ``stall_ms``; ``iterations``:
    those every rank traced."""
    hist: Counter = Counter()
    stalled, full = [], complete(traces)
    for t, rs in full:
        worst = 0.0
        for s in range(len(rs)):
            at = [rs[w]["pull_s"].get(str(s)) for w in rs if w != s]
            at = [a for a in at if _num(a)]
            if not at:
                continue
            first = min(at)
            for a in at:
                lag = 1000.0 * (a - first)
                hist[int(lag // bucket_ms * bucket_ms)] += 1
                worst = max(worst, lag)
        if worst > stall_ms:
            stalled.append(t)
    return {"bucket_ms": bucket_ms, "stall_ms": stall_ms, "iterations": len(full),
            "pulls": sum(hist.values()), "histogram": dict(sorted(hist.items())),
            "stalled": stalled}


def _stats(xs: list[float]) -> dict:
    """Median, p90 and max of ``xs`` (ms, rounded to 0.1); all None when empty."""
    if not xs:
        return {"median": None, "p90": None, "max": None}
    xs = sorted(xs)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 1)  # noqa: E731
    return {"median": pick(0.5), "p90": pick(0.9), "max": round(xs[-1], 1)}


def phases(traces: dict[int, dict[int, dict]]) -> dict:
    """Per iteration every rank traced: ``push_skew_ms``, the last worker's
    ``push_start_s`` minus the first's; and ``after_last_end_ms``, each remote PULL's
    arrival (``pull_s[s]`` at worker w, s != w) minus the iteration's last ``end_s``.
    Each as {median, p90, max} in ms. Records without numeric times are left out."""
    skew, after = [], []
    for t, rs in complete(traces):
        starts = [x.get("push_start_s") for x in rs.values()]
        ends = [x.get("end_s") for x in rs.values()]
        if all(_num(v) for v in starts):
            skew.append(1000.0 * (max(starts) - min(starts)))
        if not all(_num(v) for v in ends):
            continue
        last_end = max(ends)
        for w, x in rs.items():
            for s, a in x["pull_s"].items():
                if s != str(w) and _num(a):
                    after.append(1000.0 * (a - last_end))
    return {"push_skew_ms": _stats(skew), "after_last_end_ms": _stats(after)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgt.tools.pull_lag",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a job's run directory (dgt train --run-dir)")
    ap.add_argument("--stall-ms", type=float, default=150.0,
                    help="a lag above this counts its iteration as stalled (default 150)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    try:
        traces = load(args.run_dir)
        r = lags(traces, stall_ms=args.stall_ms)
        r["phases"] = phases(traces)
    except OSError as e:   # no trace; one that is not a regular file (RefusedFile)
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['pulls']} PULLs over {r['iterations']} iterations; lag behind the shard's "
          f"first remote PULL, {r['bucket_ms']:g} ms buckets:")
    for b, n in r["histogram"].items():
        print(f"  {b:6.0f} ms  {n}")
    print(f"iterations with a PULL more than {r['stall_ms']:g} ms late: "
          f"{len(r['stalled'])} of {r['iterations']}")
    for key, what in (("push_skew_ms", "push skew (first to last worker's push)"),
                      ("after_last_end_ms", "network phase (last END to a remote PULL)")):
        st = r["phases"][key]
        if st["median"] is not None:
            print(f"{what}: median {st['median']:g} ms, p90 {st['p90']:g}, "
                  f"max {st['max']:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
