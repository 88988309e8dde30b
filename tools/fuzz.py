"""Send random and mutated dgt messages at a sidecar's ports (robustness testing).

Only for addresses you own (loopback or your own test namespaces). Every message is one
of: random bytes; a valid-looking message (random session, so it is a stranger's) with
random field mutations, truncations or extensions; or, for TCP, a connection that sends
such frames, a stalled partial header, or a huge length field.

``python -m dgt.tools.fuzz --host 127.0.0.1 --tcp-port P --udp-ports A,B,C -n 10000``
"""
from __future__ import annotations

import argparse
import random
import socket
import sys
import time


from ..transport import wire
from ..transport.wire import MsgType


def _valid(rng: random.Random) -> bytes:
    mtype = rng.choice(list(MsgType))
    n = rng.choice([0, 4, 32, 1408])
    return wire.encode(mtype, session=rng.getrandbits(64), sender=rng.randrange(8),
                       shard=rng.randrange(8), iteration=rng.randrange(100),
                       channel=rng.randrange(wire.MAX_CHANNELS), block=rng.randrange(5000),
                       count=rng.randrange(3), payload=rng.randbytes(n))


def _wrong_field(rng: random.Random) -> bytes:
    """A well-formed message with one field set to an edge or random value (type,
    channel, flags, sender, shard, iteration, block, count)."""
    buf = bytearray(_valid(rng))
    name, code = rng.choice([f for f in wire.HEADER_FIELDS[2:] if f[0] not in
                             ("session", "length")])
    off = wire.HEADER_DTYPE.fields[name][1]
    size = wire.HEADER_DTYPE.fields[name][0].itemsize
    top = (1 << (8 * size)) - 1
    value = rng.choice([0, 1, top, top - 1, rng.randrange(top + 1)])
    buf[off:off + size] = value.to_bytes(size, "big")
    return bytes(buf)


def mutant(rng: random.Random) -> bytes:
    """One malformed or stray message: random bytes, flipped bytes, truncated, extended,
    a lying length, a wrong field in a valid header, or several messages concatenated
    (whole or cut)."""
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 1500))
    if kind == 5:
        return _wrong_field(rng)
    if kind == 6:
        parts = [_valid(rng) if rng.random() < 0.5 else _wrong_field(rng)
                 for _ in range(rng.randrange(2, 5))]
        cat = b"".join(parts)
        return cat if rng.random() < 0.5 else cat[: rng.randrange(1, len(cat))]
    buf = bytearray(_valid(rng))
    if kind == 1:  # flip bytes anywhere, header included
        for _ in range(rng.randrange(1, 6)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 2:  # truncate
        buf = buf[: rng.randrange(len(buf))]
    elif kind == 3:  # extend
        buf += rng.randbytes(rng.randrange(1, 64))
    else:  # lie about the length
        buf[30:34] = rng.randrange(1 << 32).to_bytes(4, "big")
    return bytes(buf)


def fuzz(host: str, tcp_port: int, udp_ports: list[int], n: int, seed: int = 0,
         tcp_share: float = 0.2) -> dict:
    """Send ``n`` messages; return counts per kind of delivery."""
    rng = random.Random(seed)
    sent = {"udp": 0, "tcp_frames": 0, "tcp_connections": 0, "tcp_refused": 0}
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    conns: list[socket.socket] = []
    try:
        i = 0
        while i < n:
            if udp_ports and rng.random() >= tcp_share:
                u.sendto(mutant(rng), (host, rng.choice(udp_ports)))
                sent["udp"] += 1
                i += 1
                if i % 200 == 0:
                    time.sleep(0.002)  # stay below what a busy receiver can count
                continue
            burst = min(n - i, rng.randrange(1, 50))
            try:
                c = socket.create_connection((host, tcp_port), timeout=2)
            except OSError:
                sent["tcp_refused"] += 1
                i += burst
                continue
            sent["tcp_connections"] += 1
            try:
                if rng.random() < 0.1:  # a stalled partial header, left open a while
                    c.sendall(_valid(rng)[:20])
                    conns.append(c)
                    if len(conns) > 20:
                        conns.pop(0).close()
                    i += 1
                    sent["tcp_frames"] += 1
                    continue
                c.sendall(b"".join(mutant(rng) for _ in range(burst)))
                sent["tcp_frames"] += burst
            except OSError:
                pass  # the sidecar closed on us, as it should
            finally:
                if c not in conns:
                    c.close()
            i += burst
    finally:
        for c in conns:
            c.close()
        u.close()
    return sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tcp-port", type=int, required=True)
    p.add_argument("--udp-ports", default="", help="comma-separated UDP channel ports")
    p.add_argument("-n", type=int, default=10000, help="messages to send")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    ports = [int(x) for x in ns.udp_ports.split(",") if x]
    print(fuzz(ns.host, ns.tcp_port, ports, ns.n, ns.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
