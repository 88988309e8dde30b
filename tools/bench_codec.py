"""Benchmark: the block codecs of the unreliable bands (``--band-codec``, dgt.codec).

Two parts, each a table with the load average (``os.getloadavg``) before and after:

``speed``: encode and decode of each reduced form on one CPU thread
(``torch.set_num_threads(1)``), GB/s of float32 input (the gradient bytes a band
carries before coding), median of ``--repeat`` rounds over a ``--mb`` MB gradient cut
into ``--block-elems`` blocks. Decode is timed twice: from the encoder's rows, and from
the rows as a shard sees them, payloads inside datagrams (a 34-byte header before each,
as a GRO receive buffer holds them). ``--against REV`` times dgt/codec.py as it was at
git revision REV of this checkout too, round by round in turn with today's, and gives
the ratio of the two (today's speed / REV's, median of the rounds' ratios)::

    python -m dgt.tools.bench_codec speed [--mb 25] [--repeat 20] [--against REV] \
        [--json out.json]

``train``: the same ``dgt train`` job once per band codec, one after the other in one
invocation (same seed, same iterations), on loopback: push bytes each node sends per
iteration (BLOCKS frames and datagrams, headers included, as its sidecar counted them
on every channel: the report's ``bytes_per_round`` / workers; PULLs are not in it), the
UDP share of it, the final test accuracy, whether the replicas stayed identical,
and the parameter SHA-256::

    python -m dgt.tools.bench_codec train [--codecs fp32,bf16,int8] [--json out.json] \\
        -- --iterations 110 [any other dgt train flag]

Timing belongs here, never in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch

from dgt import codec
from dgt.atomic import write_json
from dgt.child_argv import module_argv
from dgt.transport import wire
from dgt.transport.wire import Coding


def speed(mb: float = 25.0, block_elems: int = 352, repeat: int = 20, seed: int = 0,
          against: str = "") -> dict:
    """GB/s of float32 input per coding, one thread: {name: {encode_gbps, decode_gbps,
    decode_datagrams_gbps}}, and with ``against`` (a git revision) the same for
    dgt/codec.py at that revision (``against_*_gbps``) and today's speed over its
    (``*_ratio``). Raises ValueError when git cannot show that revision."""
    torch.set_num_threads(1)
    n = -(-int(mb * 1e6 / 4) // block_elems)
    x = torch.randn(n, block_elems, generator=torch.Generator().manual_seed(seed))
    gb = x.numel() * 4 / 1e9
    impls = {"": codec, "against_": _codec_at(against)} if against else {"": codec}
    out = {}
    for c in list(Coding)[1:]:   # every reduced form
        rows = codec.encode(c, x)
        dgrams = np.zeros((n, wire.HEADER_BYTES + rows.shape[1]), np.uint8)
        dgrams[:, wire.HEADER_BYTES:] = rows
        t = {f"{p}{k}": [] for p in impls for k in ("encode", "decode", "decode_datagrams")}
        for _ in range(repeat + 2):   # two warm-up rounds
            for p, impl in impls.items():
                a = time.perf_counter()
                rows = impl.encode(c, x)
                b = time.perf_counter()
                impl.decode(c, rows, block_elems)
                d = time.perf_counter()
                impl.decode(c, dgrams[:, wire.HEADER_BYTES:], block_elems)
                for k, s in (("encode", b - a), ("decode", d - b),
                             ("decode_datagrams", time.perf_counter() - d)):
                    t[f"{p}{k}"].append(s)
        res = {f"{k}_gbps": gb / float(np.median(v[2:])) for k, v in t.items()}
        for k in ("encode", "decode", "decode_datagrams") if against else ():
            res[f"{k}_ratio"] = float(np.median(np.divide(t[f"against_{k}"][2:],
                                                          t[k][2:])))
        out[c.name.lower()] = {**res, "coded_bytes_per_block": rows.shape[1],
                               "f32_bytes_per_block": block_elems * 4}
    return {"mb": mb, "block_elems": block_elems, "repeat": repeat, "threads": 1,
            "against": against, "codings": out}


def _codec_at(rev: str) -> types.ModuleType:
    """dgt/codec.py as it is at git revision ``rev`` of this checkout, as a module (it
    imports today's dgt.transport.wire). Raises ValueError when git cannot show it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(["git", "-C", root, "show", f"{rev}:dgt/codec.py"],
                       capture_output=True, text=True)
    if p.returncode:
        raise ValueError(f"--against {rev}: git cannot show dgt/codec.py there "
                         f"({p.stderr.strip()}); give a revision of this checkout")
    mod = types.ModuleType(f"dgt.codec@{rev}")
    mod.__package__ = "dgt"   # its relative imports resolve in today's dgt
    exec(compile(p.stdout, f"{rev}:dgt/codec.py", "exec"), mod.__dict__)
    return mod


def train(codecs: list[str], flags: list[str]) -> list[dict]:
    """Run ``dgt train --pull-codec fp32 FLAGS --band-codec C`` for each C (the bands
    alone: PULLs in f32 unless FLAGS give --pull-codec); one row per run."""
    rows = []
    for c in codecs:
        with tempfile.TemporaryDirectory(prefix="dgt-bench-codec-") as d:
            report = os.path.join(d, "r.json")
            a = time.monotonic()
            p = subprocess.run([*module_argv("dgt.cli"), "train",
                                "--pull-codec", "fp32", *flags,
                                "--band-codec", c, "--report", report],
                               capture_output=True, text=True)
            wall = time.monotonic() - a
            if p.returncode:
                raise SystemExit(f"dgt train --band-codec {c} failed ({p.returncode}): "
                                 f"{p.stderr.strip()[-2000:]}")
            with open(report) as f:
                r = json.load(f)
        ch = r["channels"]
        its, n = r["iterations"], r["workers"]
        udp = sum(v["bytes_sent"] for k, v in ch.items() if k != "tcp")
        rows.append({
            "band_codec": c, "iterations": its, "workers": n,
            "mb_per_it_node": r["bytes_per_round"] / n / 1e6,
            "udp_mb_per_it_node": udp / its / n / 1e6,
            "final_test_accuracy": r["final_test_accuracy"],
            "replicas_identical": r["replicas_identical"],
            "comm_ms_median": r["comm_ms_median"],
            "param_sha256": r["param_sha256"][0][:16], "wall_s": wall})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_codec",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("speed", "train"))
    p.add_argument("--mb", type=float, default=25.0)
    p.add_argument("--block-elems", type=int, default=352)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--against", default="",
                   help="speed: also time dgt/codec.py at this git revision, in turn")
    p.add_argument("--codecs", default="fp32,fp16,bf16,int8",
                   help="train: the --band-codec values to run, ';'-separated when one "
                        "holds commas (e.g. 'fp32;2:bf16,3:int8')")
    p.add_argument("--json", default="")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.flags = argv[cut + 1:]   # train: flags for dgt train, after --
    load0 = os.getloadavg()
    if a.part == "speed":
        try:
            res = speed(a.mb, a.block_elems, a.repeat, against=a.against)
        except ValueError as e:
            p.error(str(e))
        cols = {"encode_gbps": "encode GB/s", "decode_gbps": "decode GB/s",
                "decode_datagrams_gbps": "decode from datagrams GB/s"}
        if a.against:
            cols.update({f"against_{k}": f"{a.against}: {v}" for k, v in cols.items()})
            cols.update({f"{k}_ratio": f"{k.replace('_', ' ')}: today / {a.against}"
                         for k in ("encode", "decode", "decode_datagrams")})
        print("| coding | B/block | " + " | ".join(cols.values()) + " |")
        print("|---" * (len(cols) + 2) + "|")
        for name, v in res["codings"].items():
            print(f"| {name} | {v['coded_bytes_per_block']} | "
                  + " | ".join(f"{v[c]:.2f}" for c in cols) + " |")
    else:
        sep = ";" if ";" in a.codecs else ","
        rows = train([c for c in a.codecs.split(sep) if c], a.flags)
        res = {"flags": a.flags, "runs": rows}
        print("| --band-codec | iterations | MB/it/node | UDP MB/it/node | final acc | "
              "replicas identical | comm median ms | param SHA-256 |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['band_codec']} | {r['iterations']} | {r['mb_per_it_node']:.3f} | "
                  f"{r['udp_mb_per_it_node']:.3f} | {r['final_test_accuracy']:.4f} | "
                  f"{r['replicas_identical']} | {r['comm_ms_median']:.1f} | "
                  f"`{r['param_sha256']}` |")
    res["loadavg_before"], res["loadavg_after"] = load0, os.getloadavg()
    print(f"load average before {load0}, after {res['loadavg_after']}")
    if a.json:
        write_json(a.json, res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
