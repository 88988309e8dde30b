"""Forged UDP flood at a job's sidecars during training (``docs/security.md``).

Only for loopback. With ``--base-port`` the job's UDP ports are known (rank r, channel c
at ``base + 10 r + c``). Every datagram is a full-size BLOCKS datagram of this job's
shape: with ``--sniff`` (root) the session id and the newest iteration are read off
``lo``, so the forgeries carry the real session, a real sender, the receiving shard and
the current iteration; their block index is random (most lie outside the receiving
shard's range, ``bad_block``) unless ``--in-range``: then it lies in the shard's range
(read off the shard's PULLs), and they pass every check a receiver can make before the
MAC.
With ``--iteration-lag L`` they carry the sniffed iteration minus L: a replay of the
job's datagrams of L iterations ago (the sidecar's kernel filter drops those more than
16 behind: transport/sockfilter.py).
With ``--spoof`` (root, raw socket) each one is sent from a peer's own channel socket
address (127.0.0.1, the peer's port), so it is not refused as ``unknown_source``:
the worst a host on the path can send. Paced to ``--rate`` datagrams/s per sidecar.

Its own cost is kept low, so that on a loaded host it holds its rate (the report's
``rate_per_sidecar`` says what it reached): the datagrams go out 64 per sendmmsg(2) call,
and the sniffer's packet socket carries a kernel filter that passes only TCP segments
from the job's ports (without it, the sniffer read every datagram the flood itself
sent, and took the tool to 1.6 cores and 15,200/s per sidecar on an idle 2-core host;
now 0.6 cores at 20,000/s).

``python -m dgt.tools.flood --base-port B --world 3 --rate 20000 --duration-s 60 --sniff --spoof``
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import random
import signal
import socket
import struct
import sys
import threading
import time

from ..transport import sockfilter, wire
from .attack import STRANGER_ADDRESS


def tcp_from_ports_filter(lo: int, hi: int) -> bytes:
    """A classic BPF filter for a packet socket on ``lo``: keep only IPv4 TCP segments
    whose source port is in ``[lo, hi]``. Without it every packet on ``lo`` (the
    flood's own datagrams among them, 60,000/s and more) is copied to the sniffer and
    read by a Python call each, which takes the CPU and the GIL the flood needs."""
    f = sockfilter
    p = f.Program()
    p.ld(f.H, 12)                              # the Ethernet type
    p.jump(f.JEQ, 0x0800, 0, "drop")           # IPv4
    p.ld(f.B, 14 + 9)                          # the IP protocol
    p.jump(f.JEQ, socket.IPPROTO_TCP, 0, "drop")
    p.ldx_ip_header_len(14)
    p.ld_ind(f.H, 14)                          # the TCP source port
    p.jump(f.JGE, lo, 0, "drop")
    p.jump(f.JGE, hi + 1, "drop", 0)
    p.ret(f.ACCEPT)
    p.label("drop")
    p.ret(f.DROP)
    return p.assemble()


class IterationSniffer(threading.Thread):
    """Keeps the session id, the newest iteration and each shard's block range of the
    dgt TCP frames to or from ``ports`` (the job's TCP ports: never our own datagrams)."""

    def __init__(self, ports: set[int]):
        super().__init__(daemon=True)
        self.ports = ports
        self.session: int | None = None
        self.iteration = 0
        self.ranges: dict[int, tuple[int, int]] = {}   # shard -> [lo, hi), from PULLs
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        sockfilter.attach(self.sock, tcp_from_ports_filter(min(ports), max(ports)))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.stop = False

    def run(self) -> None:
        me = socket.inet_aton(STRANGER_ADDRESS)
        while not self.stop:
            try:
                pkt = self.sock.recv(65535)
            except OSError:
                continue
            if len(pkt) < 14 + 40 + wire.HEADER_BYTES or pkt[12:14] != b"\x08\x00" \
                    or pkt[14 + 9] != 6 or pkt[14 + 12:14 + 16] == me:
                continue
            ihl = (pkt[14] & 0x0F) * 4
            tcp = pkt[14 + ihl:]
            src, dst = struct.unpack_from("!HH", tcp, 0)
            # only what a sidecar's port sends (PULLs, on the worker's connection):
            # frames *to* those ports may be other attackers' forgeries (fuzz.py runs
            # several sniffers at once), and their garbage ranges would be believed
            if src not in self.ports:
                continue
            d = tcp[(tcp[12] >> 4) * 4:]
            if d[:3] == b"DG\x01" and len(d) >= wire.HEADER_BYTES:
                self.session = struct.unpack_from("!Q", d, 6)[0]
                self.iteration = max(self.iteration, struct.unpack_from("!I", d, 18)[0])
                if d[3] == wire.MsgType.PULL:   # shard -> worker: block, count = its range
                    shard, _, lo, n = struct.unpack_from("!HIII", d, 16)
                    if n:   # (an empty PULL says nothing of the range)
                        self.ranges[shard] = (lo, lo + n)
        self.sock.close()


def _checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def _raw_udp(src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 + UDP packet (UDP checksum 0: none, allowed on IPv4)."""
    ulen = 8 + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + ulen, 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    return ip + struct.pack("!HHHH", src[1], dst[1], ulen, 0) + payload


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(_Iovec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _Mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", _Msghdr), ("len", ctypes.c_uint)]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
BATCH = 64   # datagrams per sendmmsg(2)


class BatchSender:
    """A ring of ready packets sent ``BATCH`` at a time with sendmmsg(2) (one syscall,
    not one Python call, per 64 datagrams: the tool's own CPU per datagram is then
    mostly the kernel's, so the flood keeps its rate on a loaded host)."""

    def __init__(self, sock: socket.socket, pool: list[tuple[bytes, tuple[str, int]]]):
        self.fd = sock.fileno()
        self.n = len(pool)
        self._keep = [ctypes.create_string_buffer(pkt, len(pkt)) for pkt, _ in pool]
        self._iov = (_Iovec * self.n)()
        self._addr = []
        self._msgs = (_Mmsghdr * self.n)()
        for i, ((pkt, dst), buf) in enumerate(zip(pool, self._keep)):
            self._iov[i].base, self._iov[i].len = ctypes.addressof(buf), len(pkt)
            a = ctypes.create_string_buffer(struct.pack("=H", socket.AF_INET)
                                            + struct.pack("!H", dst[1])
                                            + socket.inet_aton(dst[0]) + bytes(8), 16)
            self._addr.append(a)
            h = self._msgs[i].hdr
            h.name, h.namelen = ctypes.addressof(a), 16
            h.iov, h.iovlen = ctypes.pointer(self._iov[i]), 1
        self.at = 0

    def send(self, count: int) -> tuple[int, int]:
        """Send ``count`` datagrams from the ring; return (sent, errors)."""
        sent = errors = 0
        while count > 0:
            k = min(count, BATCH, self.n - self.at)
            r = _LIBC.sendmmsg(self.fd, ctypes.byref(self._msgs, self.at
                                                    * ctypes.sizeof(_Mmsghdr)), k, 0)
            if r <= 0:   # the first datagram failed (ENOBUFS, ...): count it, skip it
                errors += 1
                r = 1
            else:
                sent += r
            count -= r
            self.at = (self.at + r) % self.n
        return sent, errors


def flood(host: str, base_port: int, world: int, channels: int, rate: float,
          duration_s: float, sniff: bool, spoof: bool, keyed: bool = False,
          in_range: bool = False,
          block_bytes: int = 1408, seed: int = 0,
          stop: threading.Event | None = None, iteration_lag: int = 0,
          sniffer: IterationSniffer | None = None) -> dict:
    """Send forged BLOCKS datagrams at ``rate`` per second to every sidecar; return
    counts (``iteration``: the last forged iteration). ``sniffer``: a running
    :class:`IterationSniffer` to read (then ``sniff`` is not needed; the caller stops
    it). Raises PermissionError for ``sniff``/``spoof`` without root."""
    if not host.startswith("127."):
        raise ValueError(f"{host} is not a loopback address: flood only your own host")
    rng = random.Random(seed)
    udp_ports = {r: [base_port + 10 * r + c for c in range(1, channels + 1)]
                 for r in range(world)}
    own_sniffer = sniff and sniffer is None
    if own_sniffer:
        sniffer = IterationSniffer({base_port + 10 * r for r in range(world)})
        sniffer.start()
    if spoof:
        out = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    else:
        out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        out.bind((STRANGER_ADDRESS, 0))
    payload = bytes(block_bytes)
    sent = {"datagrams": 0, "errors": 0, "session_sniffed": False}
    pool: list = []   # (packet, destination) ready to send, rebuilt per (session, t)
    pool_key = None
    batch: BatchSender | None = None
    stranger_session = rng.getrandbits(64)
    t0 = time.monotonic()
    t_end = t0 + duration_s
    try:
        while time.monotonic() < t_end and not (stop is not None and stop.is_set()):
            due = int((time.monotonic() - t0) * rate)
            session = sniffer.session if sniffer and sniffer.session is not None \
                else stranger_session
            it = max(sniffer.iteration - iteration_lag, 0) if sniffer else 0
            sent["session_sniffed"] = bool(sniffer and sniffer.session is not None)
            ranges = dict(sniffer.ranges) if sniffer and in_range else {}
            if pool_key != (session, it, len(ranges)):   # ready packets per round
                pool_key, pool = (session, it, len(ranges)), []
                for _ in range(64):
                    for r in range(world):
                        w = rng.choice([x for x in range(world) if x != r] or [0])
                        c = rng.randrange(1, channels + 1)
                        d = wire.encode(wire.MsgType.BLOCKS, session=session, sender=w,
                                        shard=r, iteration=it, channel=c,
                                        block=rng.randrange(*ranges.get(r, (0, 1 << 16))),
                                        count=1,
                                        payload=payload,
                                        flags=wire.Flag.MAC if keyed else 0)
                        if keyed:   # a MAC flag and a junk tag: the receiver hashes it
                            d += rng.randbytes(wire.MAC_BYTES)
                        dst = (host, udp_ports[r][c - 1])
                        pool.append((_raw_udp((host, udp_ports[w][c - 1]), dst, d), (host, 0))
                                    if spoof else (d, dst))
                batch = BatchSender(out, pool)
            n = min(due * world - sent["datagrams"] - sent["errors"], 4000)
            if n > 0:
                ok, bad = batch.send(n)
                sent["datagrams"] += ok
                sent["errors"] += bad
            time.sleep(0.002)
    finally:
        out.close()
        if own_sniffer:
            sniffer.stop = True
    sent["iteration"] = pool_key[1] if pool_key else None
    sent["shard_ranges_sniffed"] = len(sniffer.ranges) if sniffer else 0
    sent["seconds"] = round(time.monotonic() - t0, 1)
    sent["rate_per_sidecar"] = round(sent["datagrams"] / world / max(sent["seconds"], 1e-9))
    return sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.flood",
                                description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--rate", type=float, default=20000, help="datagrams/s per sidecar")
    p.add_argument("--duration-s", type=float, default=60)
    p.add_argument("--sniff", action="store_true", help="learn session/iteration on lo")
    p.add_argument("--spoof", action="store_true", help="send from the peers' ports (raw)")
    p.add_argument("--in-range", action="store_true",
                   help="with --sniff: forge only blocks of the receiving shard's range "
                        "(read off its PULLs), so nothing before the MAC refuses them")
    p.add_argument("--keyed", action="store_true",
                   help="the job runs with --secret: forge a MAC flag and a junk tag, so "
                        "the datagrams have the real ones' size")
    p.add_argument("--iteration-lag", type=int, default=0, metavar="L",
                   help="with --sniff: forge the iteration L before the newest seen (a "
                        "replay of an earlier iteration's datagrams)")
    ns = p.parse_args(argv)
    if ns.iteration_lag < 0:
        p.error("--iteration-lag must be 0 or more")
    stop = threading.Event()   # SIGTERM ends the flood early, with its counts printed
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        out = flood(ns.host, ns.base_port, ns.world, ns.channels, ns.rate, ns.duration_s,
                    ns.sniff, ns.spoof, ns.keyed, ns.in_range, stop=stop,
                    iteration_lag=ns.iteration_lag)
    except (ValueError, PermissionError) as e:
        print(f"flood: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
