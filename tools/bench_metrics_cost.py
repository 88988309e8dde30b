"""Benchmark: what the Prometheus endpoint costs a training job, on the testbed.

Runs ``dgt train --testbed`` over a testbed that is already up (``dgt testbed up``,
root), in interleaved pairs: A with ``--metrics-port`` on and every rank scraped every
``--scrape-s`` seconds over real HTTP (one scraper process per testbed host, inside its
network namespace), B with the endpoint off. Per run it takes the report's median comm
time and the training time per iteration; per pair the ratio A/B; prints the medians of
the ratios and the load average before and after::

    python -m dgt.tools.bench_metrics_cost --prefix i18tb [--pairs 4] [--iterations 80]
        [--hidden 1024] [--scrape-s 1] [--json out.json]

``--micro`` instead times, in this process and without a testbed, one trace line
(``Trace.end``: counter snapshot, deltas, one JSON line; paid every iteration whether the
endpoint is on or not) and one scrape's collect + exposition (with a residual of
``--hidden``'s model size; paid in the HTTP thread per scrape).

Timing belongs here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from dgt.child_argv import module_argv

SCRAPER = """
import sys
if sys.path and sys.path[0] == "":   # -c puts the current folder first: not ours
    del sys.path[0]
import time, urllib.request
url, n = sys.argv[1], 0
while True:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            r.read()
        n += 1
    except OSError:
        pass
    print(n, flush=True)
    time.sleep(float(sys.argv[2]))
"""


def run_once(args, metrics: bool, work: str, tag: str) -> dict:
    report = os.path.join(work, f"{tag}.json")
    cmd = module_argv("dgt.cli") + [
        "train", "--testbed", "--testbed-prefix", args.prefix, "--workers",
        str(args.workers), "--hidden", str(args.hidden), "--iterations",
        str(args.iterations), "--report", report]
    if metrics:
        cmd += ["--metrics-port", str(args.port)]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    scrapers = []
    if metrics:
        for r in range(args.workers):
            out = open(os.path.join(work, f"{tag}-scrape-{r}.txt"), "w")
            scrapers.append((subprocess.Popen(
                ["ip", "netns", "exec", f"{args.prefix}-h{r}", sys.executable, "-c", SCRAPER,
                 f"http://127.0.0.1:{args.port + r}/metrics", str(args.scrape_s)],
                stdout=out, stderr=subprocess.DEVNULL), out))
    try:
        code = job.wait(timeout=600)
    finally:
        for p, out in scrapers:
            p.terminate()
            p.wait()
            out.close()
    if code != 0:
        raise RuntimeError(f"dgt train exited {code} ({tag})")
    with open(report) as f:
        r = json.load(f)
    scrapes = 0
    for i in range(len(scrapers)):
        with open(os.path.join(work, f"{tag}-scrape-{i}.txt")) as f:
            lines = f.read().split()
            scrapes += int(lines[-1]) if lines else 0
    return {"comm_ms_median": r["comm_ms_median"],
            "train_s_per_iteration": r["train_seconds"] / r["iterations"],
            "scrapes": scrapes}


def micro(hidden: int, repeat: int = 2000) -> dict:
    """Median seconds of one ``Trace.end`` and of one scrape (collect + exposition)."""
    import statistics
    import time as _t

    import torch

    from dgt.config import JobConfig, TransmissionConfig
    from dgt.metrics import exposition, make_registry
    from dgt.sidecar import NodeConfig, Sidecar

    class Agent:   # what Trace.end and the collector read from a WorkerAgent
        marks = {"reliable_sent_s": 1.0, "end_s": 1.1}
        pull_at = {0: 1.2, 1: 1.3, 2: 1.3, 3: 1.4}
        not_arrived = 3
        k_history = [0.5]

        class residual:
            residual = torch.randn(JobConfig(hidden=hidden).n_params())

    sc = Sidecar(TransmissionConfig(), NodeConfig(rank=0, world=4,
                                                  run_dir=tempfile.mkdtemp()))
    ts = []
    for i in range(repeat):
        sc.trace.begin(i, None)
        t0 = _t.perf_counter()
        sc.trace.end(Agent, 0.5)
        ts.append(_t.perf_counter() - t0)
    reg = make_registry(sc)
    sc.agent = Agent
    ss = []
    for _ in range(max(1, repeat // 10)):
        t0 = _t.perf_counter()
        exposition(reg)
        ss.append(_t.perf_counter() - t0)
    return {"trace_end_s": statistics.median(ts), "scrape_s": statistics.median(ss)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_metrics_cost")
    p.add_argument("--prefix", default="dgt", help="the testbed's prefix (dgt testbed up)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=80)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--scrape-s", type=float, default=1.0)
    p.add_argument("--port", type=int, default=9400)
    p.add_argument("--json", default="")
    p.add_argument("--micro", action="store_true", help="time one trace line and one "
                   "scrape in-process (no testbed)")
    args = p.parse_args(argv)
    if args.micro:
        m = micro(args.hidden)
        print(f"trace line (Trace.end) median {m['trace_end_s'] * 1e6:.1f} us; scrape "
              f"(collect + exposition, --hidden {args.hidden}) median "
              f"{m['scrape_s'] * 1e3:.3f} ms; load average {os.getloadavg()}")
        return 0
    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="dgt-metrics-cost-")
    rows = []
    for i in range(args.pairs):
        a = run_once(args, True, work, f"on-{i}")
        b = run_once(args, False, work, f"off-{i}")
        rows.append({"on": a, "off": b})
        print(f"pair {i + 1}: comm median {a['comm_ms_median']:.2f} / "
              f"{b['comm_ms_median']:.2f} ms, train/iteration "
              f"{1e3 * a['train_s_per_iteration']:.2f} / "
              f"{1e3 * b['train_s_per_iteration']:.2f} ms (on/off), {a['scrapes']} scrapes",
              flush=True)
    comm = [r["on"]["comm_ms_median"] / r["off"]["comm_ms_median"] for r in rows]
    it = [r["on"]["train_s_per_iteration"] / r["off"]["train_s_per_iteration"] for r in rows]
    out = {"pairs": rows, "comm_ratio_median": float(np.median(comm)),
           "iteration_ratio_median": float(np.median(it)), "comm_ratios": comm,
           "iteration_ratios": it, "load_before": load_before,
           "load_after": os.getloadavg(), "args": vars(args)}
    print(f"on/off ratio, median of {len(rows)} pairs: comm time {out['comm_ratio_median']:.4f}"
          f" (pairs {', '.join(f'{x:.3f}' for x in comm)}), time per iteration "
          f"{out['iteration_ratio_median']:.4f} (pairs {', '.join(f'{x:.3f}' for x in it)})")
    print(f"load average before {load_before}, after {out['load_after']}")
    if args.json:
        from dgt.launch import write_report
        write_report(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
