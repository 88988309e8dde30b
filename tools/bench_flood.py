"""Receive-path benchmark under a forged flood: how many datagrams per second a shard's
``transport.session.ShardSession`` sustains, with and without a MAC key, when real
blocks arrive mixed with forged datagrams (``docs/security.md``).

Real datagrams are what a worker sends (``wire.encode_block_datagrams``); forged ones
are, per ``--forged``:

- ``stray``: a stranger's (random session id): refused at the header;
- ``onpath``: an attacker who sniffed the session id: this job's session, shard, a real
  sender and the current iteration, random payload (with a key: no valid MAC);
- ``replay``: real datagrams of an earlier iteration (``stale``).

Every measurement interleaves ``--flood`` forged datagrams per real one, fed one by one
(a socket without GRO) or as GRO runs of 45 (``--gro``), and repeats plain and keyed
side by side ``--repeat`` times (the median is reported). It prints one JSON line per
configuration: datagrams/s overall, real blocks/s, the cost of one real and one forged
datagram, and keyed/plain ratios. The rates (and the ratio) count the process's CPU time
in the receive path (``--clock cpu``, the default: on a shared machine wall time also
counts the slices other processes take) or wall time (``--clock wall``); the per-datagram
costs are wall time.

``python -m dgt.tools.bench_flood --forged stray,onpath,replay --flood 1``
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import numpy as np

from ..transport import wire
from ..transport.session import ShardSession

SESSION = 0x5EED_0000_0000_0001
KEY = b"bench-secret-of-32-bytes........"
GRO_RUN = 45


def _session(key, n_blocks: int, workers: int) -> ShardSession:
    return ShardSession(session=SESSION, shard=0, lo=0, hi=n_blocks, block_elems=352,
                        n_workers=workers, deadline_s=1.0, key=key)


def _real(key, it: int, n_blocks: int, workers: int, rng) -> list[np.ndarray]:
    """Per sender, (n_blocks, size) uint8 datagrams of iteration ``it`` on channel 1."""
    out = []
    for w in range(1, workers):
        blocks = rng.standard_normal((n_blocks, 352)).astype(np.float32)
        out.append(wire.encode_block_datagrams(
            session=SESSION, sender=w, shard=0, iteration=it, channel=1,
            indices=np.arange(n_blocks), blocks=blocks, key=key))
    return out


def _forged(kind: str, key, it: int, n: int, n_blocks: int, workers: int, rng,
            size: int) -> np.ndarray:
    if kind == "replay":
        return np.concatenate(_real(key, it - 2, n_blocks, workers, rng))[:n]
    d = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    hdr = np.empty(n, wire.HEADER_DTYPE)
    hdr["magic"], hdr["version"], hdr["type"] = wire.MAGIC, wire.VERSION, wire.MsgType.BLOCKS
    hdr["channel"], hdr["flags"] = 1, (wire.Flag.MAC if key else 0)
    hdr["session"] = SESSION if kind != "stray" else rng.integers(0, 2**63, n)
    hdr["sender"] = rng.integers(1, workers, n)
    hdr["shard"], hdr["iteration"] = 0, it
    hdr["block"] = rng.integers(0, n_blocks, n)
    hdr["count"], hdr["length"] = 1, 352 * 4
    d[:, :wire.HEADER_BYTES] = hdr.view(np.uint8).reshape(n, wire.HEADER_BYTES)
    return d


def measure(key, kind: str, flood: int, gro: bool, iterations: int, n_blocks: int,
            workers: int, seed: int) -> dict:
    """Feed ``iterations`` iterations of real blocks with ``flood`` forged datagrams per
    real one; return the timings (seconds) and the session's counters."""
    rng = np.random.default_rng(seed)
    s = _session(key, n_blocks, workers)
    first = 2 if kind == "replay" else 0   # a replay needs iterations to replay
    for _ in range(first):
        s.advance()
    t_real = t_forged = t_cpu = 0.0
    n_real = n_forged = 0
    for it in range(first, first + iterations):
        real = np.concatenate(_real(key, it, n_blocks, workers, rng))
        forged = _forged(kind, key, it, flood * len(real), n_blocks, workers, rng,
                         real.shape[1]) if flood else real[:0]
        step = GRO_RUN if gro else 1
        c0 = time.process_time()
        for i in range(0, len(real), step):   # time forged and real apart
            f = forged[i * flood:(i + step) * flood]
            t0 = time.perf_counter()
            if len(f):
                if gro:
                    for j in range(0, len(f), GRO_RUN):
                        s.receive_datagram(f[j:j + GRO_RUN].tobytes(), 0.0)
                else:
                    for row in f:
                        s.receive_datagram(row.tobytes(), 0.0)
            t1 = time.perf_counter()
            r = real[i:i + step]
            if gro:
                s.receive_datagram(r.tobytes(), 0.0)
            else:
                for row in r:
                    s.receive_datagram(row.tobytes(), 0.0)
            t2 = time.perf_counter()
            t_forged += t1 - t0
            t_real += t2 - t1
            n_forged += len(f)
            n_real += len(r)
        t_cpu += time.process_time() - c0
        delivered = sum(c.blocks_delivered for c in s.counters.channels)
        s.advance()
    return {"t_real": t_real, "t_forged": t_forged, "t_cpu": t_cpu, "n_real": n_real,
            "n_forged": n_forged, "delivered": delivered,
            "rejected": dict(s.counters.rejected)}


def bench(kinds: list[str], flood: int, gro: bool, repeat: int, iterations: int,
          n_blocks: int, workers: int, clock: str = "cpu") -> list[dict]:
    out = []
    for kind in kinds:
        runs: dict = {"plain": [], "keyed": []}
        for rep in range(repeat):   # plain and keyed side by side, alternating
            for name, key in (("plain", None), ("keyed", KEY)):
                runs[name].append(measure(key, kind, flood, gro, iterations, n_blocks,
                                          workers, seed=rep))
        row: dict = {"forged": kind, "flood_per_real": flood, "gro": gro,
                     "repeat": repeat, "clock": clock}
        for name, rs in runs.items():
            total = [(r["n_real"] + r["n_forged"])
                     / (r["t_cpu"] if clock == "cpu" else r["t_real"] + r["t_forged"])
                     for r in rs]
            row[f"{name}_datagrams_per_s"] = round(statistics.median(total))
            row[f"{name}_real_us"] = round(statistics.median(
                1e6 * r["t_real"] / r["n_real"] for r in rs), 3)
            row[f"{name}_forged_us"] = round(statistics.median(
                1e6 * r["t_forged"] / r["n_forged"] for r in rs), 3) if flood else None
            row[f"{name}_rejected"] = rs[-1]["rejected"]
        row["keyed_over_plain"] = round(row["keyed_datagrams_per_s"]
                                        / row["plain_datagrams_per_s"], 3)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_flood",
                                description=__doc__.split("\n")[0])
    p.add_argument("--forged", default="stray,onpath,replay",
                   help="comma-separated kinds: stray, onpath, replay")
    p.add_argument("--flood", type=int, default=1, help="forged datagrams per real one")
    p.add_argument("--gro", action="store_true", help="feed GRO runs of 45 datagrams")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--blocks", type=int, default=1000, help="blocks per sender")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="rates from the process's CPU time (default) or wall time")
    ns = p.parse_args(argv)
    kinds = [k for k in ns.forged.split(",") if k]
    bad = set(kinds) - {"stray", "onpath", "replay"}
    if bad:
        p.error(f"--forged: unknown kind(s) {sorted(bad)}; use stray, onpath, replay")
    random.seed(0)
    for row in bench(kinds, ns.flood, ns.gro, ns.repeat, ns.iterations, ns.blocks,
                     ns.workers, ns.clock):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
