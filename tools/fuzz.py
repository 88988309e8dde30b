"""Send random and mutated dgt messages at a sidecar's ports (robustness testing).

Only for addresses you own (loopback or your own test namespaces). Every message is one
of: random bytes; a valid-looking message (random session, so it is a stranger's) with
random field mutations, truncations or extensions; or, for TCP, a connection that sends
such frames, a stalled partial header, or a huge length field.

``python -m dgt.tools.fuzz --host 127.0.0.1 --tcp-port P --udp-ports A,B,C -n 10000``

At scale, at every sidecar of a job (``--base-port``, ``--world``; root): with
``--sniff`` the job's session id, current iteration and each shard's block range are
read off ``lo`` (``tools.flood.IterationSniffer``), and half the mutants start from a
message of this job (its session, the receiving shard, a real sender, the current
iteration, a block of the shard's range: what passes the kernel filter and every check
before the MAC) before one mutation; with ``--spoof`` every datagram is sent from a peer's
own channel socket (a raw socket), so it reaches the receive path:

``python -m dgt.tools.fuzz --base-port B --world 3 --sniff --spoof -n 1100000 --tcp-share 0.1``
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field


from ..transport import wire
from ..transport.wire import MsgType


def _valid(rng: random.Random) -> bytes:
    mtype = rng.choice(list(MsgType))
    n = rng.choice([0, 4, 32, 1408])
    return wire.encode(mtype, session=rng.getrandbits(64), sender=rng.randrange(8),
                       shard=rng.randrange(8), iteration=rng.randrange(100),
                       channel=rng.randrange(wire.MAX_CHANNELS), block=rng.randrange(5000),
                       count=rng.randrange(3), payload=rng.randbytes(n))


def _wrong_field(rng: random.Random, valid=_valid) -> bytes:
    """A well-formed message (from ``valid``) with one field set to an edge or random
    value (type, channel, flags, sender, shard, iteration, block, count)."""
    buf = bytearray(valid(rng))
    name, code = rng.choice([f for f in wire.HEADER_FIELDS[2:] if f[0] not in
                             ("session", "length")])
    off = wire.HEADER_DTYPE.fields[name][1]
    size = wire.HEADER_DTYPE.fields[name][0].itemsize
    top = (1 << (8 * size)) - 1
    value = rng.choice([0, 1, top, top - 1, rng.randrange(top + 1)])
    buf[off:off + size] = value.to_bytes(size, "big")
    return bytes(buf)


def _in_job(rng: random.Random, job: dict) -> bytes:
    """A well-formed message of the job ``job`` (``session``, ``iteration``, ``shard``,
    ``world``, ``lo``, ``hi``, ``mac``): mostly a one-block BLOCKS datagram, else a tail
    marker or another type; with ``mac`` it carries the flag and a junk tag."""
    r, world = job["shard"], job["world"]
    w = rng.choice([x for x in range(world) if x != r] or [0])
    kind = rng.random()
    mtype, count, n = MsgType.BLOCKS, 1, 1408
    if kind > 0.8:
        mtype, count, n = MsgType.END, rng.randrange(job["hi"] - job["lo"] + 1), 0
    elif kind > 0.7:
        mtype, n = rng.choice(list(MsgType)), rng.choice([0, 4, 8 * world])
    buf = wire.encode(mtype, session=job["session"], sender=w, shard=r,
                      iteration=(job["iteration"] - rng.choice([0, 0, 0, 1, 2, -1])) & 0xFFFFFFFF,
                      channel=rng.randrange(1, 4),
                      block=rng.randrange(job["lo"], max(job["hi"], job["lo"] + 1))
                      & 0xFFFFFFFF,
                      count=count & 0xFFFFFFFF, payload=rng.randbytes(n),
                      flags=wire.Flag.MAC if job["mac"] else 0)
    return buf + rng.randbytes(wire.MAC_BYTES) if job["mac"] else buf


def mutant(rng: random.Random, job: dict | None = None, valid=None) -> bytes:
    """One malformed or stray message: random bytes, flipped bytes, truncated, extended,
    a lying length, a wrong field in a valid header, or several messages concatenated
    (whole or cut). With ``job`` (see :func:`_in_job`) half start from a message of
    that job. ``valid``: where the well-formed messages come from (default: made
    afresh, :func:`_valid`, or :func:`_in_job` for ``job``)."""
    if valid is None:
        valid = _valid
        if job is not None and rng.random() < 0.5:
            valid = lambda rng: _in_job(rng, job)   # noqa: E731
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 1500))
    if kind == 5:
        return _wrong_field(rng, valid)
    if kind == 6:
        parts = [valid(rng) if rng.random() < 0.5 else _wrong_field(rng, valid)
                 for _ in range(rng.randrange(2, 5))]
        cat = b"".join(parts)
        return cat if rng.random() < 0.5 else cat[: rng.randrange(1, len(cat))]
    buf = bytearray(valid(rng))
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


class Pool:
    """Well-formed messages made ahead (``size`` of them), so a mutant costs a copy and
    a mutation, not a whole encode: a stranger's (:func:`_valid`) and, per job state,
    the job's (:func:`_in_job`, rebuilt when the session or the shard's range changes;
    the iteration is written into each copy)."""

    def __init__(self, rng: random.Random, size: int = 512):
        self.rng, self.size = rng, size
        self.stranger = [_valid(rng) for _ in range(size)]
        self.job_key = None
        self.job: list[bytes] = []

    def valid(self, job: dict | None):
        rng = self.rng
        if job is None or rng.random() < 0.5:
            return lambda rng: rng.choice(self.stranger)
        key = (job["session"], job["shard"], job["lo"], job["hi"], job["mac"])
        if key != self.job_key:
            self.job_key, self.job = key, [_in_job(rng, job) for _ in range(self.size)]

        def in_job(rng):
            b = bytearray(rng.choice(self.job))
            t = job["iteration"] - rng.choice((0, 0, 0, 1, 2, -1))
            b[18:22] = (t & 0xFFFFFFFF).to_bytes(4, "big")
            return bytes(b)
        return in_job


@dataclass
class Target:
    """One sidecar: its TCP port, its UDP channel ports, its shard (= rank), and per
    channel the peers' source ports (for ``spoof``)."""

    tcp_port: int
    udp_ports: list[int]
    shard: int = 0
    sources: list[list[int]] = field(default_factory=list)


def job_targets(base_port: int, world: int, channels: int = 3) -> list[Target]:
    """Every sidecar of a job on ``base_port`` (rank r: TCP ``base + 10 r``, UDP
    channel c ``base + 10 r + c``)."""
    def port(r, c):
        return base_port + 10 * r + c
    return [Target(port(r, 0), [port(r, c) for c in range(1, channels + 1)], r,
                   [[port(w, c) for w in range(world) if w != r]
                    for c in range(1, channels + 1)]) for r in range(world)]


def fuzz(host: str, tcp_port: int, udp_ports: list[int], n: int, seed: int = 0,
         tcp_share: float = 0.2, *, targets: list[Target] | None = None,
         sniffer=None, world: int = 0, spoof: bool = False, keyed: bool = False,
         stop: threading.Event | None = None) -> dict:
    """Send ``n`` messages; return counts per kind of delivery. ``targets`` (default:
    the one sidecar at ``tcp_port``/``udp_ports``) are chosen at random per message.
    With ``sniffer`` (``tools.flood.IterationSniffer``) half the mutants start from a
    message of the job (:func:`_in_job`), once its session and the shard's range are
    known; with ``spoof`` (root) datagrams come from the peers' ports."""
    from .flood import _raw_udp
    rng = random.Random(seed)
    targets = targets or [Target(tcp_port, udp_ports)]
    sent = {"udp": 0, "udp_in_job": 0, "tcp_frames": 0, "tcp_connections": 0,
            "tcp_refused": 0}
    u = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) if spoof \
        else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    conns: list[socket.socket] = []
    pools: dict[int, Pool] = {}

    def job_of(t: Target) -> dict | None:
        if sniffer is None or sniffer.session is None or t.shard not in sniffer.ranges:
            return None
        lo, hi = sniffer.ranges[t.shard]
        return {"session": sniffer.session, "iteration": sniffer.iteration,
                "shard": t.shard, "world": world, "lo": lo, "hi": hi, "mac": keyed}
    try:
        i = 0
        while i < n and not (stop is not None and stop.is_set()):
            t = rng.choice(targets)
            job = job_of(t)
            pool = pools.get(t.shard) or pools.setdefault(t.shard, Pool(random.Random(rng.random())))
            valid = pool.valid(job)
            if t.udp_ports and rng.random() >= tcp_share:
                c = rng.randrange(len(t.udp_ports))
                m = mutant(rng, valid=valid)
                if spoof and t.sources and t.sources[c]:
                    src = (host, rng.choice(t.sources[c]))
                    u.sendto(_raw_udp(src, (host, t.udp_ports[c]), m), (host, 0))
                else:
                    u.sendto(m, (host, t.udp_ports[c]))
                sent["udp"] += 1
                sent["udp_in_job"] += job is not None and valid.__name__ == "in_job"
                i += 1
                if i % 200 == 0:
                    time.sleep(0.002)  # stay below what a busy receiver can count
                continue
            burst = min(n - i, rng.randrange(1, 50))
            try:
                c = socket.create_connection((host, t.tcp_port), timeout=2)
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
                c.sendall(b"".join(mutant(rng, valid=valid) for _ in range(burst)))
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
    p.add_argument("--tcp-port", type=int, help="one sidecar's TCP port")
    p.add_argument("--udp-ports", default="", help="comma-separated UDP channel ports")
    p.add_argument("--base-port", type=int, help="every sidecar of the job on this base port")
    p.add_argument("--world", type=int, default=0, help="with --base-port: the job's ranks")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--sniff", action="store_true",
                   help="with --base-port (root): mutate messages of the job itself")
    p.add_argument("--spoof", action="store_true",
                   help="with --base-port (root): send datagrams from the peers' ports")
    p.add_argument("--keyed", action="store_true", help="the job runs with --secret")
    p.add_argument("--tcp-share", type=float, default=0.2,
                   help="share of messages that open a TCP connection with a burst")
    p.add_argument("-n", type=int, default=10000, help="messages to send")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    if (ns.base_port is None) == (ns.tcp_port is None):
        p.error("give --tcp-port (one sidecar) or --base-port with --world (a whole job)")
    if ns.base_port is not None and ns.world < 1:
        p.error("--base-port needs --world (the job's number of ranks)")
    if (ns.sniff or ns.spoof) and ns.base_port is None:
        p.error("--sniff and --spoof need --base-port and --world")
    targets = job_targets(ns.base_port, ns.world, ns.channels) if ns.base_port else None
    ports = [int(x) for x in ns.udp_ports.split(",") if x]
    stop = threading.Event()   # SIGTERM ends it early, with its counts printed
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sniffer = None
    try:
        if ns.sniff:
            from .flood import IterationSniffer
            sniffer = IterationSniffer({t.tcp_port for t in targets})
            sniffer.start()
        t0 = time.monotonic()
        out = fuzz(ns.host, ns.tcp_port or 0, ports, ns.n, ns.seed, ns.tcp_share,
                   targets=targets, sniffer=sniffer, world=ns.world, spoof=ns.spoof,
                   keyed=ns.keyed, stop=stop)
        out["seconds"] = round(time.monotonic() - t0, 1)
    except PermissionError as e:
        print(f"fuzz: error: {e} (--sniff and --spoof need root)", file=sys.stderr)
        return 2
    finally:
        if sniffer is not None:
            sniffer.stop = True
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
