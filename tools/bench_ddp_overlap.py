"""Benchmark: comm time per iteration of a DDP job on the 1 Gbit/s netns testbed, three
ways side by side: the dgt hook pushing each bucket as DDP hands it over (wait-free
backpropagation), the dgt hook pushing the whole vector after backward (the
``dgt.Client`` way: ``--no-overlap``), and plain DDP's gloo all-reduce (through torch's
``allreduce_hook``, timed: ``--comm gloo-timed``). As root::

    python -m dgt.tools.bench_ddp_overlap [--hosts 2] [--nproc 1] [--hidden 1024] \\
        [--iterations 100] [--batch-size 32] [--rounds 1] [--json out.json]

Brings up ``dgt testbed``'s hosts (prefix ``dgtov``, htb-prio at ``--rate``), runs
``examples/ddp_train.py`` with one torchrun per host (c10d rendezvous, as
tests/test_ddp_testbed.py does) for each variant in turn, ``--rounds`` times, and
takes down the testbed. Per run, from rank 0's last 50 iterations (one clock,
CLOCK_MONOTONIC):

- ``exposed_ms``: the median of (``backward()`` returned) - (the last bucket handed
  over to the comm hook): the communication backward waits for after its last
  gradient, i.e. what the overlap did not hide;
- ``iteration_ms``: the median time between two consecutive ends of ``backward()``
  (forward, backward, communication, optimiser step: the whole iteration);
- ``after_first_bucket_ms``: the median of (last bucket handed over) - (first bucket
  handed over): the backward left after the first bucket, the most a push in parts
  can hide;
- ``lead_ms`` (hook with parts): the median of (last bucket handed over) - (first
  block sent by the sidecar): how long before the end of backward its push began
  (negative: after).

Prints one line per run and the load average before and after. Timing belongs here,
never in tests.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "ddp_train.py")
VARIANTS = {"hook, per-bucket push": ["--comm", "dgt"],
            "hook, whole push after backward": ["--comm", "dgt", "--no-overlap"],
            "DDP + gloo all-reduce": ["--comm", "gloo-timed"]}


def run_once(bed, out: str, args: list[str], a) -> dict:
    """One job: one torchrun per testbed host; rank 0's result."""
    endpoint = f"{bed.host_addr(0)}:29400"
    procs = []
    for h in range(a.hosts):
        env = dict(os.environ, DGT_RUN_DIR=os.path.join(out, f"h{h}"),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        log = open(os.path.join(out, f"torchrun-{h}.log"), "w")
        procs.append(bed.popen_in(h, [
            *module_argv("torch.distributed.run"), "--nnodes", str(a.hosts),
            "--nproc-per-node", str(a.nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", os.path.basename(out),
            "--rdzv-conf", f"is_host={int(h == 0)}", "--local-addr", bed.host_addr(h),
            EXAMPLE, *args, "--dataset", "digits", "--hidden", str(a.hidden),
            "--iterations", str(a.iterations), "--bucket-cap-mb", str(a.bucket_cap_mb),
            "--batch-size", str(a.batch_size), "--report", os.path.join(out, "rep")],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    try:
        for p in procs:
            p.wait(timeout=900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        with open(os.path.join(out, "torchrun-0.log")) as f:
            raise SystemExit("a torchrun failed; host 0's log ends:\n" + f.read()[-3000:])
    with open(os.path.join(out, "rep", "rank-0.json")) as f:
        return json.load(f)


def summarise(res: dict) -> dict:
    timings, ends = res["timings"], res["backward_end_s"]
    n = min(len(timings), len(ends))
    timings, ends = timings[-n:], ends[-n:]
    last = [t["buckets"][-1][1] for t in timings]
    out = {"exposed_ms": statistics.median(1e3 * (e - b) for e, b in zip(ends, last)),
           "iteration_ms": statistics.median(1e3 * (b - a) for a, b in zip(ends, ends[1:])),
           "after_first_bucket_ms": statistics.median(
               1e3 * (t["buckets"][-1][1] - t["buckets"][0][1]) for t in timings),
           "buckets": len(timings[-1]["buckets"]), "test_accuracy": res["test_accuracy"],
           "param_sha256": res["param_sha256"][:16]}
    leads = [1e3 * (b - t["first_sent_s"]) for t, b in zip(timings, last)
             if t.get("first_sent_s") is not None and "part_s" in t]
    if leads:
        out["lead_ms"] = statistics.median(leads)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_ddp_overlap",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="trainers per host")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (digits)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32, help="per trainer")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("the testbed needs root (network namespaces); run as root")
    from dgt.tc_profiles import testbed
    testbed.down("dgtov")
    bed = testbed.up(a.hosts, rate=a.rate, profile="htb-prio", prefix="dgtov")
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="dgt-overlap-") as tmp:
            load_before = os.getloadavg()
            for r in range(a.rounds):
                for name, args in VARIANTS.items():
                    out = os.path.join(tmp, f"r{r}-{len(rows)}")
                    os.makedirs(out)
                    row = {"variant": name, "round": r,
                           **summarise(run_once(bed, out, args, a))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            load_after = os.getloadavg()
    finally:
        testbed.down("dgtov")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "load_before": load_before,
                       "load_after": load_after}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
