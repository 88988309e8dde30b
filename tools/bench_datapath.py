"""Benchmark: CPU time of the sidecars' data path per push, in one process, no sockets.

N worker agents (dgt.agent) and N server shards (dgt.shard over
transport.session.ShardSession) of a model's block layout, wired through memory the
way the sidecars are wired through the network: every BLOCKS frame, END and datagram
is the real wire bytes, read back by the shard's session (UDP datagrams as GRO runs of
up to 64 equal-size datagrams, as the sidecars' sockets receive them); every remote
PULL is encoded (transport.messages.pull), decoded (transport.wire, then
dgt.pull_codec.decode_pull when coded) and handed to the worker, as
transport.control and dgt.sidecar do. What is left out is what every mode pays alike:
the event loop, the syscalls, the trainer's Unix socket.

CPU time is ``time.process_time`` of this process (one torch thread) over
``--iterations`` pushes after ``--warmup`` ones, divided by the pushes and by N: the
numeric and Python work one sidecar does per push of its node, its shard's part of
everyone's push included. The first push is also given alone (``first push``): it
touches every buffer of the data path for the first time, so it shows what fresh
memory costs on the host (page faults). Each system is a set of ``dgt train``
transmission flags; ``--against REV`` runs the same systems on git revision REV of this checkout too (a
temporary ``git worktree``), round by round in turn with today's, and gives today's
CPU over REV's (median of the rounds' ratios)::

    python -m dgt.tools.bench_datapath --model vgg11:0.25 --workers 4 \\
        --systems 'tcp;dgt --band-codec int8 --pull-codec int8' [--against REV] \\
        [--rounds 5] [--iterations 30] [--json out.json]

The fabric is dgt.tools.inprocess's (the tests' own), always today's file, also when
``dgt`` is REV's. The gradients are seeded Gaussian noise of the model's size (the model
is built only for its parameter count), drawn before the timing; only the pushes are
timed. Timing belongs here, never in tests.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def measure(flags: str, n_params: int, world: int, iterations: int, warmup: int,
            seed: int = 0) -> dict:
    """CPU ms per push per node of ``flags`` (dgt train transmission flags), and whether
    the replicas stayed identical."""
    import torch
    from dgt.config import TransmissionConfig, add_arguments, from_args
    Fabric = _todays_fabric()
    torch.set_num_threads(1)
    # numpy's huge-page advice as that revision's sidecar has it (dgt.hugepages); a
    # revision before the module keeps it on, as its sidecar did (the editable install
    # would answer the import from this checkout, so look in that revision's folder)
    import dgt
    if os.path.exists(os.path.join(os.path.dirname(dgt.__file__), "hugepages.py")):
        from dgt.hugepages import keep_small_pages
        keep_small_pages()
    p = argparse.ArgumentParser()
    add_arguments(p, TransmissionConfig)
    ns = p.parse_args(shlex.split(flags))
    # as across a link (auto codecs resolved so), unpaced: no timers run here
    cfg = dataclasses.replace(from_args(TransmissionConfig, ns).resolve_codecs(False),
                              pace_mbit=0.0)
    fab = Fabric(cfg, n_params, world, seed=seed, gro=True, pull_codecs=True,
                 wire_pulls=True)
    rng = np.random.default_rng(seed)
    # a few pushes' gradients made up front (drawing them costs more than a push),
    # each scaled by its step as a gradient that changes from push to push
    pool = [[rng.standard_normal(n_params, dtype=np.float32) for _ in range(world)]
            for _ in range(3)]

    def push(t: int) -> float:
        grads = [g * np.float32(1.0 + 0.01 * t) for g in pool[t % len(pool)]]
        t0 = time.process_time()   # the push alone: not the trainers' writing
        asyncio.run(fab.step(t, grads))
        return time.process_time() - t0
    cpu = [push(t) for t in range(warmup + iterations)]
    same = len({a.tobytes() for a in fab.aggs}) == 1
    return {"flags": flags, "cpu_ms_per_push": 1000.0 * sum(cpu[warmup:]) / iterations / world,
            # the first push also touches every buffer for the first time
            "first_push_cpu_ms": 1000.0 * cpu[0] / world,
            "replicas_identical": same}


def _todays_fabric():
    """dgt.tools.inprocess.Fabric from the file beside this one (a revision under
    ``--against`` may not have it; its ``dgt`` imports resolve to that revision)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inprocess.py")
    spec = importlib.util.spec_from_file_location("_dgt_inprocess_today", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Fabric


def _params(model: str) -> int:
    """Parameters of one ``--models`` item of dgt bench tta. Raises BenchError."""
    from dgt.tools.bench import BenchError
    from dgt.tools.bench_tta import parse_workloads
    try:   # (its signature as in older revisions: --against runs them through here)
        w = parse_workloads(model)
    except BenchError as e:   # its text names bench tta's flag, not ours
        raise BenchError(str(e).removeprefix("--models: ")) from None
    if len(w) != 1:
        raise BenchError(f"--model takes one workload, got {model!r}")
    return w[0].n_params()


def _worktree(rev: str) -> str:
    """A detached git worktree of ``rev`` with this checkout's built extensions copied
    in. Raises ValueError when git cannot make it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tempfile.mkdtemp(prefix="dgt-against-")
    r = subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-f", path, rev],
                       capture_output=True, text=True)
    if r.returncode:
        shutil.rmtree(path, ignore_errors=True)
        raise ValueError(f"git worktree add {rev}: {r.stderr.strip()}")
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build",)]
        for f in files:
            if f.endswith(".so"):
                rel = os.path.relpath(os.path.join(dirpath, f), root)
                if os.path.isdir(os.path.dirname(os.path.join(path, rel))):
                    shutil.copy2(os.path.join(root, rel), os.path.join(path, rel))
    return path


def _shim(tree: str) -> str:
    """A folder for PYTHONPATH in which ``dgt`` is ``tree``'s, its subpackages included:
    ``tree/dgt``'s entries and ``tree``'s transport, scheduler, tc_profiles and tools
    linked into one ``dgt`` (setup.cfg's package_dir, which an editable install of this
    checkout would otherwise answer from here)."""
    shim = os.path.join(tree, ".shim", "dgt")
    os.makedirs(shim)
    for name in os.listdir(os.path.join(tree, "dgt")):
        os.symlink(os.path.join(tree, "dgt", name), os.path.join(shim, name))
    for sub in ("transport", "scheduler", "tc_profiles", "tools"):
        if os.path.isdir(os.path.join(tree, sub)):
            os.symlink(os.path.join(tree, sub), os.path.join(shim, sub))
    return os.path.dirname(shim)


def _remove_worktree(path: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["git", "-C", root, "worktree", "remove", "--force", path],
                   capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def _one(args, flags: str, tree: str | None) -> dict:
    """One measurement in a fresh interpreter (today's code, or ``tree``'s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree:
        env["PYTHONPATH"] = os.path.join(tree, ".shim") + os.pathsep + \
            env.get("PYTHONPATH", "")
    # this file runs as a script, so the harness is today's and ``dgt`` the tree's
    cmd = [sys.executable, os.path.abspath(__file__), "--one", flags,
           "--model", args.model, "--workers", str(args.workers),
           "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       cwd=tempfile.gettempdir())
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        raise RuntimeError(f"{flags!r}{' at ' + tree if tree else ''}: "
                           f"{last.split(': error: ', 1)[-1]}")
    return json.loads(r.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_datapath",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vgg11:0.25",
                   help="NAME[:WIDTH] of dgt.workloads (its parameter count sets the "
                        "layout; default vgg11:0.25)")
    p.add_argument("--workers", type=int, default=4, help="nodes (default 4)")
    p.add_argument("--systems", default="tcp;dgt --band-codec int8 --pull-codec int8",
                   help="';'-separated dgt train transmission flag sets "
                        "(default 'tcp;dgt --band-codec int8 --pull-codec int8'); "
                        "a set that does not start with a flag is --mode's word")
    p.add_argument("--iterations", type=int, default=30, help="timed pushes (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed pushes first (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every system (default 3)")
    p.add_argument("--against", default="", help="git revision to compare with")
    p.add_argument("--json", default="", help="also write the result here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from dgt.tools.bench import BenchError
    if args.workers < 2 or args.iterations < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--workers >= 2, --iterations >= 1, --warmup >= 0, --rounds >= 1")
    try:
        n_params = _params(args.model)
    except (BenchError, ValueError) as e:
        p.error(f"--model {args.model}: {e}")
    if args.one is not None:
        print(json.dumps(measure(args.one, n_params, args.workers, args.iterations,
                                 args.warmup)))
        return 0
    systems = [_flags(s) for s in args.systems.split(";") if s.strip()]
    if not systems:
        p.error("--systems names no system: give ';'-separated flag sets, e.g. 'tcp;dgt'")
    from dgt.tools.cli import check_output
    try:
        check_output("--json", args.json or None)   # before the work, not after it
    except ValueError as e:
        p.error(str(e))
    tree = None
    try:
        if args.against:
            tree = _worktree(args.against)
            _shim(tree)
        load = [os.getloadavg()]
        rows: dict[str, dict] = {s: {"today": [], "against": []} for s in systems}
        for rnd in range(args.rounds):
            for s in systems:
                for which, t in (("today", None), ("against", tree)) if tree else \
                        (("today", None),):
                    r = _one(args, s, t)
                    rows[s][which].append(r)
                    print(f"round {rnd + 1}/{args.rounds} {which:7s} {s}: "
                          f"{r['cpu_ms_per_push']:.2f} ms", file=sys.stderr, flush=True)
        load.append(os.getloadavg())
    except (ValueError, RuntimeError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if tree:
            _remove_worktree(tree)
    out = {"model": args.model, "params": n_params, "workers": args.workers,
           "iterations": args.iterations, "rounds": args.rounds, "against": args.against,
           "load_avg_before": load[0], "load_avg_after": load[1], "systems": []}
    print(f"{args.model} ({n_params:,} parameters), {args.workers} nodes, "
          f"{args.iterations} pushes x {args.rounds} rounds; load average "
          f"{load[0][0]:.2f} before, {load[1][0]:.2f} after")
    head = "| system | CPU ms per push per node (median) | first push (median) |"
    head += (f" at {args.against} | today / {args.against} | first push at "
             f"{args.against} |") if tree else ""
    print(head)
    print("|---" * (6 if tree else 3) + "|")
    for s in systems:
        today = [r["cpu_ms_per_push"] for r in rows[s]["today"]]
        first = [r["first_push_cpu_ms"] for r in rows[s]["today"]]
        e = {"flags": s, "cpu_ms_per_push": today, "median": statistics.median(today),
             "first_push_cpu_ms": first, "first_push_median": statistics.median(first),
             "replicas_identical": all(r["replicas_identical"]
                                       for r in rows[s]["today"] + rows[s]["against"])}
        line = f"| `{s}` | {e['median']:.2f} | {e['first_push_median']:.2f} |"
        if tree:
            was = [r["cpu_ms_per_push"] for r in rows[s]["against"]]
            e["against_cpu_ms_per_push"] = was
            e["against_median"] = statistics.median(was)
            e["ratio"] = statistics.median(a / b for a, b in zip(today, was))
            # a revision before the column had no first push: None there
            was_first = [r.get("first_push_cpu_ms") for r in rows[s]["against"]]
            e["against_first_push_cpu_ms"] = was_first
            e["against_first_push_median"] = statistics.median(was_first) \
                if None not in was_first else None
            line += (f" {e['against_median']:.2f} | {e['ratio']:.2f} | "
                     + (f"{e['against_first_push_median']:.2f} |"
                        if e["against_first_push_median"] is not None else "– |"))
        out["systems"].append(e)
        print(line)
    if args.json:
        from dgt.atomic import write_json
        write_json(args.json, out)
    return 0


def _flags(s: str) -> str:
    s = s.strip()
    return s if s.startswith("-") else "--mode " + s


if __name__ == "__main__":
    sys.exit(main())
