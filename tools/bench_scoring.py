"""Benchmark: contribution scoring + channel assignment speed, GB/s of gradient per core.

One push's decision work in the worker agent, on one CPU thread
(``torch.set_num_threads(1)``): :meth:`dgt.contribution.ContributionScores.update`
(mean |g| per block, EMA), :func:`dgt.scheduler.assign.rank_blocks` (stable sort of the
block scores) and :func:`dgt.scheduler.assign.assign_channels` (top k to TCP, rank bands
to the UDP channels), on a ``--mb`` MB float32 gradient cut into ``--block-elems``
element blocks::

    python -m dgt.tools.bench_scoring [--mb 25] [--block-elems 352] [--repeat 20] [--json out.json]

Prints the median time of each step and of the whole, and gradient GB/s per core
(gradient bytes / median time of the whole). Timing belongs here, never in tests.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from dgt.launch import write_report
from dgt.contribution import ContributionScores
from dgt.scheduler.assign import assign_channels, rank_blocks, reliable_count


def bench(mb: float = 25.0, block_elems: int = 352, repeat: int = 20, k: float = 0.5,
          channels: int = 3, seed: int = 0, threads: int = 1) -> dict:
    """Time scoring + assignment on a random gradient; returns medians (s) and GB/s.

    ``mb``: gradient size in MB (1e6 bytes), rounded up to whole blocks.
    """
    torch.set_num_threads(threads)
    n_blocks = -(-int(mb * 1e6 / 4) // block_elems)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n_blocks * block_elems, generator=gen) for _ in range(2)]
    scores = ContributionScores(n_blocks)
    n_rel = reliable_count(n_blocks, k)
    t_score, t_rank, t_assign, t_all = [], [], [], []
    for i in range(repeat + 2):        # two warm-up rounds
        g = grads[i % 2]
        a = time.perf_counter()
        s = scores.update(g, block_elems)
        b = time.perf_counter()
        order = rank_blocks(s, n_reliable=n_rel)
        c = time.perf_counter()
        chan = assign_channels(order, n_rel, channels)
        d = time.perf_counter()
        if i >= 2:
            t_score.append(b - a), t_rank.append(c - b), t_assign.append(d - c)
            t_all.append(d - a)
    assert int((chan == 0).sum()) == n_rel
    nbytes = n_blocks * block_elems * 4
    med = {k_: float(np.median(v)) for k_, v in
           (("score_s", t_score), ("rank_s", t_rank), ("assign_s", t_assign),
            ("total_s", t_all))}
    return dict(gradient_bytes=nbytes, n_blocks=n_blocks, block_elems=block_elems,
                threads=threads, repeat=repeat, **med,
                total_p95_s=float(np.percentile(t_all, 95)),
                gb_per_s_per_core=nbytes / med["total_s"] / 1e9 / threads,
                score_gb_per_s=nbytes / med["score_s"] / 1e9,
                torch=torch.__version__)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_scoring",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=25.0, help="gradient size, MB")
    p.add_argument("--block-elems", type=int, default=352, help="fp32 elements per block")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = per core)")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    r = bench(a.mb, a.block_elems, a.repeat, threads=a.threads)
    try:
        import os
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    r["load"] = load
    print(f"gradient {r['gradient_bytes'] / 1e6:.1f} MB, {r['n_blocks']} blocks of "
          f"{r['block_elems']} fp32, {r['threads']} thread(s), {r['repeat']} repeats, "
          f"load {load}")
    print(f"  score  (update)           {r['score_s'] * 1e3:8.2f} ms")
    print(f"  rank   (rank_blocks)      {r['rank_s'] * 1e3:8.2f} ms")
    print(f"  assign (assign_channels)  {r['assign_s'] * 1e3:8.2f} ms")
    print(f"  total  median / p95       {r['total_s'] * 1e3:8.2f} / "
          f"{r['total_p95_s'] * 1e3:.2f} ms")
    print(f"  {r['gb_per_s_per_core']:.2f} GB/s of gradient per core "
          f"(scoring alone {r['score_gb_per_s']:.2f} GB/s)")
    if a.json:
        write_report(a.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
