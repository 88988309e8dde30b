"""Synthetic dgt traffic over real loopback sockets, for tests and benchmarks.

Workers (threads) push BSP iterations to shards through the sidecar's own push sender
(``dgt.transport.sender.PushSender``, unpaced): per (worker, shard, iteration) a TCP
``BLOCKS`` frame (INDEXED) on channel 0, one UDP datagram per block on each unreliable
channel (each UDP socket marked with its channel's DSCP), each channel followed by its
tail marker (``END`` on that channel, twice), then ``END`` with the per-channel counts.
The shard answers ``PULL`` on the same TCP connection once every worker's END is in.
No message is encoded here: they come from the sender and ``dgt.transport.messages``. Ports follow the
``--base-port`` layout (rank r: TCP ``B+10r``, UDP channel c ``B+10r+c``).

``omit`` drops chosen datagrams before they are sent (they still count in END, as a
network loss would); ``late`` holds chosen datagrams back until after the PULL.
:func:`run` returns the sender-side counters in the train report's shape:
``{"channels": {"tcp": {"blocks_sent", "bytes_sent", ...}, "udp1": ...}}``.

Example::

    from dgt.tools import synth
    sent = synth.run(synth.SynthConfig(base_port=46000, iterations=3))
    print(sent["channels"]["udp1"]["blocks_sent"])
"""
from __future__ import annotations

import random
import selectors
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dgt.transport import messages, wire
from dgt.transport.channels import channel_dscp, channel_name
from dgt.transport.counters import Counters
from dgt.transport.framing import Deframer, split_frames
from dgt.transport.sender import PushSender, TcpFrame, UdpBatch, Unpaced
from dgt.tools.ports import RANK_STRIDE, PortSpec


@dataclass
class SynthConfig:
    """``blocks``: blocks per (worker, shard, iteration) on each channel, channel 0
    first (length = 1 + udp channels). ``omit``/``late``: sets of
    ``(worker, shard, iteration, channel, nth)`` naming datagrams (nth within that
    channel's send list) to drop / to send after the PULL."""

    base_port: int = 46000
    host: str = "127.0.0.1"
    ranks: int = 2
    iterations: int = 3
    first_iteration: int = 0
    blocks: tuple[int, ...] = (4, 6, 4, 2)
    block_elems: int = 16
    dscp: tuple[int, ...] | None = None  # per channel; default channel_dscp(C)
    session: int = 0x5EED_D67_0000_0001
    key: bytes | None = None
    omit: set = field(default_factory=set)
    late: set = field(default_factory=set)
    timeout_s: float = 20.0

    @property
    def udp_channels(self) -> int:
        return len(self.blocks) - 1

    def tcp_port(self, rank: int) -> int:
        return self.base_port + RANK_STRIDE * rank

    def udp_port(self, rank: int, channel: int) -> int:
        return self.base_port + RANK_STRIDE * rank + channel

    def sidecars(self) -> list[dict]:
        """The train report's ``sidecars`` table for this layout."""
        return [{"rank": r, "host": self.host, "tcp_port": self.tcp_port(r),
                 "udp_ports": [self.udp_port(r, c) for c in range(1, self.udp_channels + 1)]}
                for r in range(self.ranks)]


class _Shards:
    """Every rank's shard: TCP listener + one UDP socket per channel, in one thread."""

    def __init__(self, cfg: SynthConfig):
        self.cfg = cfg
        self.sel = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        self.ends: dict[tuple[int, int], dict[int, socket.socket]] = defaultdict(dict)
        self.udp_received = defaultdict(int)
        self.stop = threading.Event()
        for r in range(cfg.ranks):
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((cfg.host, cfg.tcp_port(r)))
            ls.listen(64)
            ls.setblocking(False)
            self.sel.register(ls, selectors.EVENT_READ, ("listen", r))
            self.socks.append(ls)
            for c in range(1, cfg.udp_channels + 1):
                us = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                us.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
                us.bind((cfg.host, cfg.udp_port(r, c)))
                us.setblocking(False)
                self.sel.register(us, selectors.EVENT_READ, ("udp", r))
                self.socks.append(us)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="synth-shards")
        self.thread.start()

    def _loop(self) -> None:
        bufs: dict[socket.socket, Deframer] = {}
        dscp = self.cfg.dscp or channel_dscp(self.cfg.udp_channels)
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.05):
                kind, rank = key.data
                s = key.fileobj
                if kind == "listen":
                    c, _ = s.accept()
                    c.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp[0] << 2)
                    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    c.setblocking(False)
                    bufs[c] = Deframer(self.cfg.key)
                    self.sel.register(c, selectors.EVENT_READ, ("tcp", rank))
                elif kind == "udp":
                    while True:
                        try:
                            s.recv(65536)
                            self.udp_received[rank] += 1
                        except BlockingIOError:
                            break
                else:
                    try:
                        data = s.recv(1 << 20)
                    except (BlockingIOError, ConnectionError):
                        data = None
                    if not data:
                        if data == b"" or data is None:
                            self.sel.unregister(s)
                            s.close()
                        continue
                    for h, _ in bufs[s].feed(data):
                        if h.type == wire.MsgType.END:
                            self._on_end(rank, h, s)

    def _on_end(self, shard: int, h: wire.Header, conn: socket.socket) -> None:
        cfg = self.cfg
        got = self.ends[(shard, h.iteration)]
        got[h.sender] = conn
        if len(got) < cfg.ranks:
            return
        n_blocks = 4
        agg = np.zeros(n_blocks * cfg.block_elems, np.float32)
        for worker, c in sorted(got.items()):
            pull = messages.pull(cfg.session, shard, h.iteration, 0, agg,
                                 np.ones(n_blocks, bool), cfg.key)
            c.setblocking(True)
            c.sendall(b"".join(bytes(p) for p in pull))
            c.setblocking(False)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


def _worker(cfg: SynthConfig, rank: int, sent: dict, lock: threading.Lock,
            errors: list) -> None:
    try:
        dscp = cfg.dscp or channel_dscp(cfg.udp_channels)
        rng = np.random.default_rng(rank)
        conns, deframers = [], []
        for s in range(cfg.ranks):
            c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            c.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp[0] << 2)  # before connect
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.settimeout(cfg.timeout_s)
            c.connect((cfg.host, cfg.tcp_port(s)))
            c.sendall(messages.hello(cfg.session, rank, s, cfg.key))
            conns.append(c)
            deframers.append(Deframer(cfg.key))
        udps = []
        for ch in range(1, cfg.udp_channels + 1):
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp[ch] << 2)
            udps.append(u)
        total = sum(cfg.blocks)
        # each shard's block space: cfg.blocks[c] blocks on channel c, channel 0 first
        ranges = [(s * total, (s + 1) * total) for s in range(cfg.ranks)]
        chan = np.tile(np.repeat(np.arange(len(cfg.blocks), dtype=np.int8), cfg.blocks),
                       cfg.ranks)
        sender = PushSender(session=cfg.session, rank=rank, key=cfg.key,
                            counters=Counters(), pacing=Unpaced())
        for t in range(cfg.first_iteration, cfg.first_iteration + cfg.iterations):
            blocks = rng.standard_normal((cfg.ranks * total, cfg.block_elems)).astype(np.float32)
            held = []
            nth: dict[tuple[int, int], int] = defaultdict(int)   # (shard, channel) -> rows
            for f in sender.start(t, chan, blocks, ranges, local=None, now=time.monotonic()):
                conns[f.shard].sendall(b"".join(bytes(p) for p in f.frame))
                _count(sent, lock, "tcp", blocks=cfg.blocks[0],
                       nbytes=sum(memoryview(p).nbytes for p in f.frame))
            while not sender.done:
                for out in sender.datagrams_to_send(time.monotonic(), lambda s: 0):
                    if isinstance(out, TcpFrame):   # END
                        conns[out.shard].sendall(out.frame)
                        continue
                    addr = (cfg.host, cfg.udp_port(out.shard, out.channel))
                    name = channel_name(out.channel)
                    for row in out.rows:
                        k = (rank, out.shard, t, out.channel, nth[out.shard, out.channel])
                        if out.tail:
                            udps[out.channel - 1].sendto(row.tobytes(), addr)
                            continue
                        nth[out.shard, out.channel] += 1
                        if k in cfg.omit:   # a network loss: still counted in END
                            with lock:
                                sent[name]["omitted"] += 1
                        elif k in cfg.late:
                            held.append((out.channel, row.tobytes(), addr))
                        else:
                            udps[out.channel - 1].sendto(row.tobytes(), addr)
                            _count(sent, lock, name, blocks=1, nbytes=row.size)
                    if out.tail:
                        with lock:
                            sent[name]["tail_markers"] += len(out.rows)
                    sender.sent(out, len(out.rows), time.monotonic())
            for s, conn in enumerate(conns):  # BSP: wait for every shard's PULL
                _wait_pull(conn, deframers[s], t)
            for ch, dg, addr in held:
                udps[ch - 1].sendto(dg, addr)
                _count(sent, lock, channel_name(ch), blocks=1, nbytes=len(dg), late=1)
        for conn in conns:
            conn.sendall(messages.bye(cfg.session, rank, cfg.first_iteration + cfg.iterations,
                                      cfg.key))
            conn.close()
        for u in udps:
            u.close()
    except BaseException as e:  # reported by run()
        errors.append(e)


def _count(sent: dict, lock: threading.Lock, name: str, blocks: int, nbytes: int,
           late: int = 0) -> None:
    """One message sent on channel ``name``: ``blocks`` blocks in ``nbytes`` bytes."""
    with lock:
        d = sent[name]
        d["blocks_sent"] += blocks
        d["bytes_sent"] += nbytes
        d["messages_sent"] += 1
        d["late"] += late


def _wait_pull(conn: socket.socket, deframer: Deframer, t: int) -> None:
    """Read ``conn`` until the shard's PULL for iteration ``t`` is in. Raises
    ConnectionError when the shard closes first."""
    while True:
        data = conn.recv(1 << 20)
        if not data:
            raise ConnectionError("peer closed")
        if any(h.type == wire.MsgType.PULL and h.iteration == t
               for h, _ in deframer.feed(data)):
            return


def run(cfg: SynthConfig) -> dict:
    """Run the synthetic job to completion; returns the sender-side report.

    Raises the first worker error (e.g. ``OSError`` when a port is taken).
    """
    names = [channel_name(c) for c in range(len(cfg.blocks))]
    sent = {n: {"blocks_sent": 0, "bytes_sent": 0, "messages_sent": 0, "omitted": 0,
                "late": 0, "tail_markers": 0} for n in names}
    shards = _Shards(cfg)
    lock = threading.Lock()
    errors: list = []
    try:
        threads = [threading.Thread(target=_worker, args=(cfg, r, sent, lock, errors))
                   for r in range(cfg.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(cfg.timeout_s * 3)
    finally:
        shards.close()
    if errors:
        raise errors[0]
    dscp = cfg.dscp or channel_dscp(cfg.udp_channels)
    for c, n in enumerate(names):
        sent[n]["dscp"] = dscp[c]
    return {"channels": sent, "sidecars": cfg.sidecars(), "session": cfg.session}


def free_base_port(ranks: int = 2, lo: int = 20000, hi: int = 60000) -> int:
    """A base port whose ``ranks`` x 10 TCP and UDP ports are all free right now."""
    for _ in range(200):
        base = random.randrange(lo, hi - RANK_STRIDE * ranks) // 10 * 10
        try:
            socks = []
            for p in range(base, base + RANK_STRIDE * ranks):
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    s = socket.socket(socket.AF_INET, kind)
                    socks.append(s)
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range found")


class Recorder:
    """A receiver that records every message it gets: UDP datagrams as they are, TCP
    streams split into messages. ``messages``: list of (proto, local port, bytes)."""

    def __init__(self, host: str, tcp_ports=(), udp_ports=()):
        self.sel = selectors.DefaultSelector()
        self.messages: list[tuple[str, int, bytes]] = []
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        for p in tcp_ports:
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, p))
            ls.listen(64)
            ls.setblocking(False)
            self.sel.register(ls, selectors.EVENT_READ, ("listen", p))
        for p in udp_ports:
            us = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            us.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            us.bind((host, p))
            us.setblocking(False)
            self.sel.register(us, selectors.EVENT_READ, ("udp", p))
        self.thread = threading.Thread(target=self._loop, daemon=True, name="recorder")
        self.thread.start()

    def _loop(self) -> None:
        bufs: dict = {}
        while not self.stop_ev.is_set():
            for key, _ in self.sel.select(0.05):
                kind, port = key.data
                s = key.fileobj
                if kind == "listen":
                    c, _ = s.accept()
                    c.setblocking(False)
                    bufs[c] = bytearray()
                    self.sel.register(c, selectors.EVENT_READ, ("tcp", port))
                elif kind == "udp":
                    while True:
                        try:
                            d = s.recv(65536)
                        except BlockingIOError:
                            break
                        with self.lock:
                            self.messages.append(("udp", port, d))
                else:
                    try:
                        d = s.recv(1 << 20)
                    except (BlockingIOError, ConnectionError):
                        d = b""
                    if not d:
                        self.sel.unregister(s)
                        s.close()
                        continue
                    buf = bufs[s]
                    buf += d
                    try:
                        frames, used, _ = split_frames(memoryview(bytes(buf)))
                        sizes = [wire.frame_size(h) for h, _ in frames]
                    except wire.WireError:   # not ours: kept whole, as one message
                        used, sizes = len(buf), [len(buf)]
                    pos = 0
                    with self.lock:
                        for n in sizes:
                            self.messages.append(("tcp", port, bytes(buf[pos:pos + n])))
                            pos += n
                    del buf[:used]

    def close(self) -> list[tuple[str, int, bytes]]:
        self.stop_ev.set()
        self.thread.join(5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
        return self.messages


def captured_run(cfg: SynthConfig, out: str, **capture_kw) -> tuple[dict, "PortSpec"]:
    """Run the synthetic job while capturing its ports on lo to ``out`` (root).

    Returns (sender report, PortSpec). Raises CaptureError when not root.
    """
    import time as _time
    from dgt.tools.capture import Capture, CaptureConfig
    from dgt.tools.ports import from_sidecars, sidecars_from_doc
    spec = from_sidecars(sidecars_from_doc(cfg.sidecars()))
    cap = Capture(CaptureConfig(out=out, ports=spec, **capture_kw)).start()
    try:
        sent = run(cfg)
        _time.sleep(0.3)  # let the tap catch up with the last packets
    finally:
        cap.stop()
        cap.join(10)
    sent["capture"] = cap.stats.as_dict()
    return sent, spec


def block_datagrams(sender: int, shard: int, iteration: int, channel: int,
                    blocks: np.ndarray, session: int = 0x5EED) -> np.ndarray:
    """The BLOCKS datagrams ((n, size) uint8) that the push sender makes of ``blocks``
    ((n, block elements) float32, indices 0..n-1) on UDP ``channel`` to ``shard``; its
    tail markers and END are left out."""
    n = len(blocks)
    ranges = [(0, n) if r == shard else (0, 0) for r in range(shard + 1)]
    ps = PushSender(session=session, rank=sender, key=None, counters=Counters(),
                    pacing=Unpaced())
    ps.start(iteration, np.full(n, channel, np.int8), blocks, ranges, local=None, now=0.0)
    rows = []
    while not ps.done:
        for out in ps.datagrams_to_send(0.0, lambda s: 0):
            if isinstance(out, UdpBatch):
                if not out.tail:
                    rows.append(out.rows)
                ps.sent(out, len(out.rows), 0.0)
    return np.concatenate(rows)


def write_pcap(path: str, size_mb: float, *, base_port: int = 46000, ranks: int = 2,
               udp_channels: int = 3, block_elems: int = 352, gap_ns: int = 10_000,
               ipv6: bool = False) -> int:
    """Write a large capture of dgt UDP block datagrams straight to ``path`` (no sockets,
    no root): nanosecond pcap, Ethernet, IPv4 (or IPv6) + UDP, one BLOCKS datagram per
    block, ranks pushing to each other in turn over channels 1..C with each channel's
    DSCP, ``gap_ns`` apart. Stops past ``size_mb`` (10^6 bytes). For memory and speed
    benchmarks of ``dgt replay``/``dgt pcap summary``. Returns the packets written."""
    import struct
    dscp = channel_dscp(udp_channels)
    blocks = np.zeros((512, block_elems), np.float32)
    limit = int(size_mb * 1e6)
    n = 0
    ts = 1_700_000_000 * 10**9
    with open(path, "wb", buffering=1 << 20) as f:
        f.write(struct.pack("<IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 262144, 1))
        size = 24
        it = 0
        while size < limit:
            for w in range(ranks):
                s = (w + 1) % ranks
                for c in range(1, udp_channels + 1):
                    dgs = block_datagrams(w, s, it, c, blocks)
                    sport, dport = 40000 + w, base_port + RANK_STRIDE * s + c
                    udp_len = 8 + dgs.shape[1]
                    if ipv6:
                        ip = struct.pack("!IHBB16s16s", (6 << 28) | (dscp[c] << 22),
                                         udp_len, 17, 64, (w + 1).to_bytes(16, "big"),
                                         (s + 1).to_bytes(16, "big"))
                        eth = b"\x02" * 12 + b"\x86\xdd"
                    else:
                        ip = struct.pack("!BBHHHBBH4s4s", 0x45, dscp[c] << 2, 20 + udp_len,
                                         0, 0x4000, 64, 17, 0, bytes([10, 0, 0, w + 1]),
                                         bytes([10, 0, 0, s + 1]))
                        eth = b"\x02" * 12 + b"\x08\x00"
                    head = eth + ip + struct.pack("!HHHH", sport, dport, udp_len, 0)
                    frame_len = len(head) + dgs.shape[1]
                    for row in dgs:
                        ts += gap_ns
                        sec, ns = divmod(ts, 10**9)
                        f.write(struct.pack("<IIII", sec, ns, frame_len, frame_len))
                        f.write(head)
                        f.write(row.data)
                        size += 16 + frame_len
                        n += 1
            it += 1
    return n
