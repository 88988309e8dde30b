"""``dgt replay``: re-send the dgt messages of a capture.

UDP datagrams are re-sent as datagrams (a GSO super-packet seen on the tap becomes its
segments); TCP frames of each captured connection are re-sent, in order, over one fresh
TCP connection per captured connection. Only the worker -> shard direction of a TCP
connection is replayed (HELLO, BLOCKS, END, and the ERROR/BYE that go that way); the
captured answers (PULL) are counted as ``skipped["reverse"]``, and the receiver's live
answers are read and discarded. Which end of a connection is the shard is decided from
the message types it carries (:func:`directions`, a first pass over the TCP packets),
not from its ports or its first packet: a capture started mid-job has no SYN, and a
shard's port may be above or below its workers' ephemeral ones. Destinations are
rewritten with ``to_host`` and a port map.

Timing: every message gets an absolute send time on the monotonic clock, computed up
front from the capture (original timing, optionally ``speed`` x faster) or from a fixed
rate (packets/s or Mbit/s); the sender sleeps until each deadline, so sleep overshoot
never accumulates. ``tools/bench_replay.py`` measures how close a replay comes.

Example::

    from dgt.tools import replay
    cfg = replay.ReplayConfig(files=["run.pcap"], to_host="127.0.0.1",
                              port_map={47000: 48000})
    rep = replay.replay(cfg)
    print(rep["totals"]["messages"], rep["duration_s"], rep["original_duration_s"])
"""
from __future__ import annotations

import errno
import math
import select
import socket
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from dgt.config import whole
from dgt.deadline import bounded
from dgt.transport import wire
from dgt.transport.channels import channel_name
from dgt.transport.sockopts import set_dscp
from dgt.tools.dissect import L4, Dissector, Message, parse_packet, read_pcap
from dgt.tools.ports import PortSpec, PortSpecError

_CONTROL = {wire.MsgType.HELLO, wire.MsgType.BYE}
#: what each end of a dgt TCP connection sends (docs/wire.md, "Message types" and
#: "Connections"): the worker, which dialled it, HELLO, BLOCKS and END; the shard, which
#: accepted it, PULL. ERROR and BYE name no direction: dgt's sidecar sends them on the
#: connections it accepted, tools/synth.py's workers send BYE on the ones they dialled,
#: tools/attack.py sends forged ones as a client.
_FROM_WORKER = frozenset({wire.MsgType.HELLO, wire.MsgType.BLOCKS, wire.MsgType.END})
_FROM_SHARD = frozenset({wire.MsgType.PULL})
_SYN, _ACK = 0x02, 0x10   # TCP flags
#: at the end, the most time given to each TCP connection's receiver to close it
DRAIN_S = 0.5
#: the longest a TCP send may make no progress (the receiver stopped reading) before
#: that connection is dropped and its messages counted under ETIMEDOUT
STALL_S = 10.0


class ReplayError(RuntimeError):
    """Replay cannot go on; the message says what to do (one line)."""


@dataclass
class ReplayConfig:
    """One replay. ``iterations``: inclusive (first, last) of BLOCKS/END/PULL messages
    (HELLO and BYE always pass, so a receiver sees whole sessions). ``channels``: the
    BLOCKS channels to send (0 = tcp); ``control=False`` drops non-BLOCKS messages.
    ``base_port``/``from_base_port``: map port p to ``base_port + (p - from_base_port)``
    (``from_base_port`` defaults to the lowest captured server port). ``port_map`` wins
    over the base mapping. Timing: ``rate_pps`` or ``rate_mbit`` if set, else the
    capture's own timing divided by ``speed``."""

    files: list[str]
    to_host: str | None = None
    port_map: dict[int, int] = field(default_factory=dict)
    base_port: int | None = None
    from_base_port: int | None = None
    ports: PortSpec | None = None
    iterations: tuple[int, int] | None = None
    channels: set[int] | None = None
    control: bool = True
    speed: float = 1.0
    rate_pps: float | None = None
    rate_mbit: float | None = None
    keep_dscp: bool = True
    connect_timeout_s: float = 5.0
    stall_s: float = STALL_S   # see _send_tcp


@dataclass(frozen=True, slots=True)
class Item:
    """One message to send. ``conn``: the captured TCP connection, (client endpoint,
    server endpoint, connection number of :class:`_Conns`: a 4-tuple used again after a
    new SYN is another connection), or None for UDP. ``dst``/``dport``: rewritten
    destination."""

    ts_ns: int
    proto: str
    conn: tuple | None
    src: tuple[str, int]
    dst: str
    dport: int
    orig_dport: int
    dscp: int
    header: wire.Header
    data: bytes


def parse_port_map(text: str) -> dict[int, int]:
    """``"47000:48000,47001:48001"`` -> {47000: 48000, ...}; raises PortSpecError."""
    out: dict[int, int] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        try:
            a, b = item.split(":")
            old, new = int(a), int(b)
        except ValueError:
            raise PortSpecError(f"bad --port-map item {item!r}; use OLD:NEW,OLD:NEW") from None
        if not (1 <= old <= 65535 and 1 <= new <= 65535):
            raise PortSpecError(f"bad --port-map item {item!r}; ports are 1..65535")
        out[old] = new
    return out


_RATE_UNITS = {"pps": None, "bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
MAX_SCHEDULE_S = 24 * 3600.0  # a replay scheduled longer than this is refused


def parse_rate(text: str) -> tuple[float | None, float | None]:
    """``"1000pps"`` -> (1000, None); ``"50Mbit"`` -> (None, 50.0); ``"1Gbit"`` ->
    (None, 1000.0). A unit is required (pps, bit, kbit, Mbit, Gbit; case-insensitive,
    optional ``/s``); the number must be finite and > 0. Raises PortSpecError."""
    t = str(text).strip().lower().replace(" ", "")
    if t.endswith("/s"):
        t = t[:-2]
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if t.endswith(unit) and t[:-len(unit)]:
            try:
                v = float(t[:-len(unit)])
            except ValueError:
                break
            if not (math.isfinite(v) and v > 0):
                break
            mult = _RATE_UNITS[unit]
            return (v, None) if mult is None else (None, v * mult)
        if t.endswith(unit):
            break
    else:
        try:
            float(t)
            unitless = True
        except ValueError:
            unitless = False
        if unitless:
            raise PortSpecError(f"bad --rate {text!r}: give a unit, e.g. {t}pps or "
                                f"{t}Mbit")
    raise PortSpecError(f"bad --rate {text!r}; use a positive number with a unit, "
                        f"e.g. 1000pps or 50Mbit (units: pps, bit, kbit, Mbit, Gbit)")


def check_schedule(offsets: list[float]) -> None:
    """Refuse a schedule longer than :data:`MAX_SCHEDULE_S` (a typo in --rate/--speed)."""
    if offsets and not offsets[-1] <= MAX_SCHEDULE_S:
        raise ReplayError(f"the replay would take {offsets[-1]:.6g} s "
                          f"({offsets[-1] / 3600:.3g} h), over the {MAX_SCHEDULE_S / 3600:g} h "
                          f"limit; raise --rate or --speed")


def parse_iterations(text: str) -> tuple[int, int]:
    """``"3-7"`` -> (3, 7); ``"5"`` -> (5, 5)."""
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            r = (whole(a), whole(b))
        else:
            r = (whole(text), whole(text))
    except ValueError:   # dgt.config.NotPlainNumber included
        raise PortSpecError(f"bad --iterations {text!r}; use A-B or N") from None
    if r[0] < 0 or r[1] < r[0]:
        raise PortSpecError(f"bad --iterations {text!r}; need 0 <= A <= B")
    return r


@dataclass
class Scan:
    """What the first streaming passes over the capture(s) found, without keeping any
    message: which end of each TCP connection is the shard (``directions``), how many
    messages will be sent, the timing facts the schedule needs, the port base, and the
    counters for the report."""

    messages: int = 0
    directions: "Directions | None" = None
    first_ts_ns: int | None = None
    last_ts_ns: int | None = None
    bits_before_last: int = 0
    from_base_port: int | None = None
    info: dict = field(default_factory=dict)

    def last_offset(self, speed: float = 1.0, rate_pps: float | None = None,
                    rate_mbit: float | None = None) -> float:
        """The last message's send offset (s), as :class:`Offsets` would give it."""
        if not self.messages:
            return 0.0
        if rate_pps is not None:
            return (self.messages - 1) / rate_pps
        if rate_mbit is not None:
            return self.bits_before_last / (rate_mbit * 1e6)
        return (self.last_ts_ns - self.first_ts_ns) / 1e9 / speed


class _Conns:
    """The captured TCP connections, in capture order, and the evidence of which end of
    each is the server (the shard, which accepted it). A connection is a 4-tuple from
    its first message or SYN on; a SYN after messages (or naming the other end as the
    server) starts another connection on the same 4-tuple, so each gets a number, the
    same in every pass over the same packets."""

    def __init__(self):
        self.current: dict[tuple, int] = {}   # 4-tuple (sorted ends) -> its number now
        self.syn: dict[int, tuple] = {}       # number -> server end its SYN/SYN-ACK names
        self.typed: dict[int, tuple] = {}     # number -> server end its messages name
        self.busy: set[int] = set()           # numbers that carried a message
        self.count = 0

    def _new(self, key: tuple) -> int:
        n = self.current[key] = self.count
        self.count += 1
        return n

    def packet(self, pkt: L4 | None) -> None:
        """Note ``pkt``'s SYN (the client's: the server is its destination) or SYN-ACK
        (the server's: its source). Call before the dissector sees ``pkt``."""
        if pkt is None or pkt.proto != "tcp" or not pkt.tcp_flags & _SYN:
            return
        key = tuple(sorted([(pkt.src, pkt.sport), (pkt.dst, pkt.dport)]))
        server = (pkt.src, pkt.sport) if pkt.tcp_flags & _ACK else (pkt.dst, pkt.dport)
        n = self.current.get(key)
        if n is None or n in self.busy or self.syn.get(n, server) != server:
            n = self._new(key)
        self.syn.setdefault(n, server)

    def message(self, m: Message) -> int:
        """Note TCP message ``m``; returns its connection's number. Its type names the
        server end when it is one a worker sends (the destination) or a shard sends (the
        source); the first such message of a connection is its evidence."""
        key = tuple(sorted([(m.src, m.sport), (m.dst, m.dport)]))
        n = self.current.get(key)
        if n is None:
            n = self._new(key)
        self.busy.add(n)
        if n not in self.typed:
            if m.header.type in _FROM_WORKER:
                self.typed[n] = (m.dst, m.dport)
            elif m.header.type in _FROM_SHARD:
                self.typed[n] = (m.src, m.sport)
        return n


@dataclass
class Directions:
    """Which end of each captured TCP connection is the server (the shard): ``server``
    maps a connection number (:class:`_Conns`) to that (host, port). ``counts``: how
    many connections were decided by their message types (``types``), by their SYN
    alone (``syn``: no message a worker or a shard alone sends), or are left to the
    ports (``ports``: neither; :meth:`Dissector.server_endpoint`, the end on a dgt TCP
    port, else the lower port); ``syn_disagreed``: decided by types against their SYN."""

    server: dict[int, tuple[str, int]]
    counts: dict[str, int]


def _messages(files: list[str], d: Dissector, conns: _Conns, tcp_only: bool = False,
              status: list | None = None) -> Iterator[tuple[Message, int | None]]:
    """(message, its TCP connection's number or None for UDP) of the capture(s), in
    capture order, streamed. ``status`` receives each file's :func:`read_pcap` status.
    Raises PcapError for a bad file."""
    for f in files:
        st: dict = {}
        for linktype, rec in read_pcap(f, st):
            pkt = parse_packet(linktype, rec)
            if tcp_only and (pkt is None or pkt.proto != "tcp"):
                continue
            conns.packet(pkt)
            for m in d.feed(pkt):
                yield m, (conns.message(m) if m.proto == "tcp" else None)
        if status is not None:
            status.append(st)


def directions(cfg: ReplayConfig) -> Directions:
    """A first pass over the capture(s)' TCP packets, streamed: which end of each TCP
    connection is the shard. The message types decide (docs/wire.md: a worker sends
    HELLO, BLOCKS and END, a shard PULL; ERROR and BYE go either way), whatever the
    ports and whichever packet came first; the SYN (or SYN-ACK) decides a connection
    whose types do not, and one that has neither is left to the ports, as
    :meth:`Dissector.server_endpoint` guesses. Memory grows with the connections, not
    the messages. Raises PcapError for a bad file."""
    conns = _Conns()
    for _ in _messages(cfg.files, Dissector(cfg.ports), conns, tcp_only=True):
        pass
    server: dict[int, tuple[str, int]] = {}
    counts = Counter(types=0, syn=0, ports=0, syn_disagreed=0)
    for n in sorted(conns.busy):
        if n in conns.typed:
            server[n] = conns.typed[n]
            counts["types"] += 1
            counts["syn_disagreed"] += conns.syn.get(n, server[n]) != server[n]
        elif n in conns.syn:
            server[n] = conns.syn[n]
            counts["syn"] += 1
        else:
            counts["ports"] += 1
    return Directions(server, dict(counts))


def iter_items(cfg: ReplayConfig, old_base: int | None = None,
               info: dict | None = None, ports: "_Ports | None" = None,
               dirs: Directions | None = None) -> Iterator[Item]:
    """Yield the messages to send, filtered and re-addressed, in capture order, reading
    the capture(s) as a stream (memory does not grow with the file). ``old_base``: the
    captured port base for ``cfg.base_port`` (see :func:`scan`). ``dirs``: the TCP
    connections' directions from :func:`directions` of the same ``cfg`` (``Scan.
    directions``); None runs that pass first. ``info``, when given, receives the
    counters (captured_messages, skipped, undecodable, truncated, tcp_direction) at the
    end; ``ports`` the captured server ports seen. Raises PcapError for a bad file,
    ReplayError for a port mapped out of range."""
    if dirs is None:
        dirs = directions(cfg)
    d = Dissector(cfg.ports)
    skipped = Counter()
    captured = 0
    status: list[dict] = []
    for m, n in _messages(cfg.files, d, _Conns(), status=status):
        captured += 1
        server = None if n is None else dirs.server.get(n) or d.server_endpoint(m)
        it = _item(cfg, m, server, n, old_base, skipped, ports)
        if it is not None:
            yield it
    d.finish()
    truncated = [st["truncated"] for st in status if "truncated" in st]
    from dgt.tools.summary import check_truncated
    check_truncated(truncated, sum(st.get("records", 0) for st in status))
    if info is not None:
        info.update({"captured_messages": captured, "skipped": dict(skipped),
                     "undecodable": d.undecodable, "from_base_port": old_base,
                     "truncated": truncated, "tcp_direction": dirs.counts})


class _Ports:
    """The lowest and highest captured server port seen (the base of --base-port)."""

    lo: int | None = None
    hi: int | None = None

    def add(self, port: int) -> None:
        self.lo = port if self.lo is None else min(self.lo, port)
        self.hi = port if self.hi is None else max(self.hi, port)


def _item(cfg: ReplayConfig, m: Message, server: tuple[str, int] | None, n: int | None,
          old_base, skipped: Counter, ports: _Ports | None = None) -> Item | None:
    """The :class:`Item` for message ``m``, or None when a filter drops it (counted in
    ``skipped``; a TCP message not sent to ``server``, its connection's shard end, as
    ``reverse``). ``n``: its TCP connection's number. With ``old_base`` None and a
    ``base_port``, the port is left as captured (the first pass of :func:`scan`).
    Raises ReplayError for a port mapped out of 1..65535."""
    conn = None
    if m.proto == "tcp":
        if (m.dst, m.dport) != server:
            skipped["reverse"] += 1
            return None
        conn = ((m.src, m.sport), server, n)
    if ports is not None:
        ports.add(m.dport)
    h = m.header
    if h.type == wire.MsgType.BLOCKS:
        if cfg.channels is not None and h.channel not in cfg.channels:
            skipped["channel"] += 1
            return None
    elif not cfg.control:
        skipped["control"] += 1
        return None
    if cfg.iterations is not None and h.type not in _CONTROL:
        a, b = cfg.iterations
        if not a <= h.iteration <= b:
            skipped["iteration"] += 1
            return None
    port = m.dport
    if port in cfg.port_map:
        port = cfg.port_map[port]
    elif cfg.base_port is not None and old_base is not None:
        port = cfg.base_port + (port - old_base)
    if not 1 <= port <= 65535:
        raise ReplayError(f"port {m.dport} maps to {port}, outside 1..65535; "
                          f"check --base-port/--from-base-port")
    return Item(m.ts_ns, m.proto, conn, (m.src, m.sport), cfg.to_host or m.dst, port,
                m.dport, m.dscp, m.header, m.data)


def scan(cfg: ReplayConfig) -> Scan:
    """The first passes over the capture(s), streamed: the TCP connections' directions
    (:func:`directions`), then count what will be sent and find what the schedule and
    the port mapping need, keeping no message. Raises PcapError for a bad file,
    ReplayError for a port mapped out of range."""
    sc = Scan(directions=directions(cfg))
    old_base = cfg.from_base_port
    find_base = cfg.base_port is not None and old_base is None
    seen, mapped = _Ports(), _Ports()
    size = 0
    for it in iter_items(cfg, old_base, sc.info, seen, sc.directions):
        sc.messages += 1
        if sc.first_ts_ns is None:
            sc.first_ts_ns = it.ts_ns
        sc.last_ts_ns = it.ts_ns
        sc.bits_before_last += size
        size = len(it.data) * 8
        if find_base and it.orig_dport not in cfg.port_map:
            mapped.add(it.orig_dport)
    if find_base and seen.lo is not None:
        old_base = sc.info["from_base_port"] = seen.lo  # the lowest captured server port
        for port in (mapped.lo, mapped.hi):
            if port is not None and not 1 <= cfg.base_port + (port - old_base) <= 65535:
                raise ReplayError(f"port {port} maps to {cfg.base_port + port - old_base}, "
                                  f"outside 1..65535; check --base-port/--from-base-port")
    sc.from_base_port = old_base
    return sc


def plan(cfg: ReplayConfig) -> tuple[list[Item], dict]:
    """Every message to send, as a list (small captures and tests; :func:`replay`
    streams instead). Returns (items in capture order, counters). Raises PcapError for
    a bad file."""
    sc = scan(cfg)
    info: dict = {}
    items = list(iter_items(cfg, sc.from_base_port, info, dirs=sc.directions))
    return items, info


class Offsets:
    """Send offsets in seconds from the replay start, one item at a time (streaming).

    Original timing: ``(ts_i - ts_0) / speed``; ``rate_pps``: ``i / pps``;
    ``rate_mbit``: bits of the messages before i / rate. Raises ValueError for
    a non-positive speed or rate."""

    def __init__(self, *, speed: float = 1.0, rate_pps: float | None = None,
                 rate_mbit: float | None = None):
        if rate_pps is not None and not (math.isfinite(rate_pps) and rate_pps > 0):
            raise ValueError("rate_pps must be finite and > 0")
        if rate_mbit is not None and not (math.isfinite(rate_mbit) and rate_mbit > 0):
            raise ValueError("rate_mbit must be finite and > 0")
        if rate_pps is None and rate_mbit is None and not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"--speed must be a finite number > 0, got {speed}")
        self.speed, self.rate_pps, self.rate_mbit = speed, rate_pps, rate_mbit
        self.i = 0
        self.bits = 0
        self.t0: int | None = None

    def next(self, it: Item) -> float:
        if self.rate_pps is not None:
            off = self.i / self.rate_pps
        elif self.rate_mbit is not None:
            off = self.bits / (self.rate_mbit * 1e6)
            self.bits += len(it.data) * 8
        else:
            if self.t0 is None:
                self.t0 = it.ts_ns
            off = (it.ts_ns - self.t0) / 1e9 / self.speed
        self.i += 1
        return off


def schedule(items: list[Item], *, speed: float = 1.0, rate_pps: float | None = None,
             rate_mbit: float | None = None) -> list[float]:
    """:class:`Offsets` for a list of items (one per item)."""
    offs = Offsets(speed=speed, rate_pps=rate_pps, rate_mbit=rate_mbit)
    return [offs.next(it) for it in items]


def _drain(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            d = sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return n
        except OSError:
            return n
        if not d:
            return n
        n += len(d)


def _send_tcp(sock: socket.socket, data: bytes, stall_s: float = STALL_S) -> int:
    """Send all of ``data`` on a non-blocking socket, draining replies meanwhile.
    Raises TimeoutError (ETIMEDOUT) when no byte goes out for ``stall_s``: a receiver
    that stopped reading (a frozen job) is not waited on for ever."""
    view = memoryview(data)
    got = 0
    stalled_since = time.monotonic()
    while view:
        try:
            n = sock.send(view)
            view = view[n:]
            stalled_since = time.monotonic()
        except BlockingIOError:
            if time.monotonic() - stalled_since > stall_s:
                raise TimeoutError(errno.ETIMEDOUT, f"the receiver read nothing for "
                                   f"{stall_s:g} s") from None
            r, _, _ = select.select([sock], [sock], [], 1.0)
            if r:
                got += _drain(sock)
    return got


def replay(cfg: ReplayConfig, items: Iterable[Item] | None = None, progress=None,
           scanned: Scan | None = None) -> dict:
    """Send the messages on schedule; returns the report dict (see
    :func:`format_report`). Without ``items`` it streams the capture: a first pass
    (:func:`scan`, or ``scanned`` when the caller already ran it) checks the schedule,
    the second reads and sends one message at a time, so memory does not grow with the
    file. ``progress(i, n)`` is called every 10 000 messages. A TCP connection that is
    refused, or that breaks mid-way (the receiver ended), does not stop the replay: its
    messages are counted under ``send_errors`` and ``send_errors_by_destination`` and
    the others go on. Raises ReplayError for a schedule over :data:`MAX_SCHEDULE_S`,
    PcapError for a bad file."""
    info: dict = {}
    if items is None:
        sc = scanned or scan(cfg)
        check_schedule([sc.last_offset(cfg.speed, cfg.rate_pps, cfg.rate_mbit)])
        total = sc.messages
        items = iter_items(cfg, sc.from_base_port, info, dirs=sc.directions)
    else:
        items = list(items)
        total = len(items)
        check_schedule(schedule(items, speed=cfg.speed, rate_pps=cfg.rate_pps,
                                rate_mbit=cfg.rate_mbit)[-1:])
    offsets = Offsets(speed=cfg.speed, rate_pps=cfg.rate_pps, rate_mbit=cfg.rate_mbit)
    sent = 0
    first_ts = last_ts = None
    off = 0.0
    udp_socks: dict[tuple, list] = {}
    tcp_socks: dict[tuple, socket.socket] = {}
    per_ch = defaultdict(Counter)
    per_dst = Counter()
    send_errors = Counter()
    dst_errors: dict[str, Counter] = defaultdict(Counter)
    refused: dict[tuple, str] = {}   # captured conn -> why its connect failed
    connect_failures: list[str] = []
    opened = 0
    lateness_max = 0.0
    reply_bytes = 0
    start = time.monotonic() + 0.01
    try:
        for i, it in enumerate(items):
            off = offsets.next(it)
            sent += 1
            if first_ts is None:
                first_ts = it.ts_ns
            last_ts = it.ts_ns
            target = start + off
            now = time.monotonic()
            if target > now:
                time.sleep(target - now)
            else:
                lateness_max = max(lateness_max, now - target)
            tos = it.dscp << 2
            try:
                if it.proto == "udp":
                    ent = udp_socks.get(it.src)
                    if ent is None:
                        s = socket.socket(socket.AF_INET6 if ":" in it.dst else socket.AF_INET,
                                          socket.SOCK_DGRAM)
                        ent = udp_socks[it.src] = [s, None]
                    if cfg.keep_dscp and ent[1] != tos:
                        set_dscp(ent[0], it.dscp)   # IPV6_TCLASS on an IPv6 socket
                        ent[1] = tos
                    ent[0].sendto(it.data, (it.dst, it.dport))
                else:
                    if it.conn in refused:  # its connection was refused: count, go on
                        send_errors[refused[it.conn]] += 1
                        dst_errors[f"{it.proto}:{it.dst}:{it.dport}"][refused[it.conn]] += 1
                        continue
                    s = tcp_socks.get(it.conn)
                    if s is None:
                        s = socket.socket(socket.AF_INET6 if ":" in it.dst else socket.AF_INET,
                                          socket.SOCK_STREAM)
                        if cfg.keep_dscp:  # before connect, so the SYN carries it too
                            set_dscp(s, it.dscp)
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        s.settimeout(cfg.connect_timeout_s)
                        try:
                            s.connect((it.dst, it.dport))
                        except OSError as e:
                            s.close()
                            code = errno.errorcode.get(e.errno, "") or type(e).__name__
                            refused[it.conn] = code
                            connect_failures.append(
                                f"cannot connect to {it.dst}:{it.dport} (captured port "
                                f"{it.orig_dport}): {e.strerror or e}")
                            send_errors[code] += 1
                            dst_errors[f"{it.proto}:{it.dst}:{it.dport}"][code] += 1
                            continue
                        s.setblocking(False)
                        tcp_socks[it.conn] = s
                        opened += 1
                    reply_bytes += _send_tcp(s, it.data, cfg.stall_s)
            except OSError as e:
                code = errno.errorcode.get(e.errno, str(e.errno))
                send_errors[code] += 1
                dst_errors[f"{it.proto}:{it.dst}:{it.dport}"][code] += 1
                if it.proto == "tcp" and it.conn in tcp_socks:
                    # the receiver went away (job ended): drop this connection, count
                    # the rest of its messages, go on with the others
                    try:
                        tcp_socks.pop(it.conn).close()
                    except OSError:
                        pass
                    refused[it.conn] = code
                continue
            name = channel_name(it.header.channel)
            c = per_ch[name]
            c["messages"] += 1
            c[wire.MsgType(it.header.type).name] += 1
            if it.header.type == wire.MsgType.BLOCKS:
                c["blocks"] += it.header.count
                c["bytes"] += len(it.data)
            per_dst[f"{it.proto}:{it.dst}:{it.dport}"] += 1
            if progress and i and i % 10000 == 0:
                progress(i, total)
        end = time.monotonic()
    finally:
        for s in tcp_socks.values():
            # what the receiver still sends is read until it closes, so that closing
            # does not reset the connection under data it has yet to read; for at most
            # DRAIN_S in all (a receiver sending a little now and then is not waited on)
            try:
                s.setblocking(True)
                s.shutdown(socket.SHUT_WR)
                s = bounded(s, time.monotonic() + DRAIN_S, "drained long enough")
                while s.recv(1 << 20):
                    pass
            except OSError:   # TimeoutError too
                pass
            s.close()
        for ent in udp_socks.values():
            ent[0].close()
    orig = (last_ts - first_ts) / 1e9 if sent else 0.0
    dur = (end - start) if sent else 0.0
    sched = off if sent else 0.0
    return {
        **info,
        "messages": sent,
        "channels": {k: dict(v) for k, v in sorted(per_ch.items())},
        "destinations": dict(sorted(per_dst.items())),
        "totals": {"messages": sum(v["messages"] for v in per_ch.values()),
                   "blocks": sum(v["blocks"] for v in per_ch.values()),
                   "bytes": sum(v["bytes"] for v in per_ch.values())},
        "tcp_connections": opened,
        "udp_sockets": len(udp_socks),
        "send_errors": dict(send_errors),
        "send_errors_by_destination": {k: dict(v) for k, v in sorted(dst_errors.items())},
        "tcp_connect_failures": connect_failures,
        "tcp_connections_refused": len(connect_failures),
        "reply_bytes_discarded": reply_bytes,
        "original_duration_s": orig,
        "scheduled_duration_s": sched,
        "duration_s": dur,
        "duration_ratio": (dur / sched) if sched > 0 else None,
        "max_lateness_s": lateness_max,
    }


def format_report(rep: dict) -> str:
    """The replay report as a table: one row per channel, then totals and timing."""
    rows = [["channel", "messages", "blocks", "bytes"]]
    for name, c in rep["channels"].items():
        rows.append([name, c.get("messages", 0), c.get("blocks", 0), c.get("bytes", 0)])
    t = rep["totals"]
    rows.append(["total", t["messages"], t["blocks"], t["bytes"]])
    w = [max(len(str(r[i])) for r in rows) for i in range(4)]
    lines = ["  ".join(str(v).rjust(w[i]) if i else str(v).ljust(w[i])
                       for i, v in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    ratio = rep["duration_ratio"]
    lines += ["",
              f"destinations: {rep['destinations']}",
              f"skipped: {rep.get('skipped', {})}, send errors: {rep['send_errors']}, "
              f"tcp connections: {rep['tcp_connections']}"
              + (f" ({rep['tcp_connections_refused']} refused)"
                 if rep.get("tcp_connections_refused") else ""),
              f"duration {rep['duration_s']:.3f} s (scheduled {rep['scheduled_duration_s']:.3f} s,"
              f" captured {rep['original_duration_s']:.3f} s"
              + (f", ratio {ratio:.3f})" if ratio else ")")]
    if rep.get("send_errors_by_destination"):
        lines.append(f"send errors by destination: {rep['send_errors_by_destination']}")
    tcp = rep.get("tcp_direction") or {}
    if tcp.get("ports"):
        lines.append(f"tcp direction: {tcp['ports']} connection(s) with no SYN and no "
                     f"HELLO/BLOCKS/END/PULL: their shard end guessed from the ports")
    if tcp.get("syn_disagreed"):
        lines.append(f"tcp direction: {tcp['syn_disagreed']} connection(s) whose message "
                     f"types name the other end than their SYN: the types decided")
    from dgt.tools.summary import truncation_text
    for t in rep.get("truncated", ()):
        lines.append(truncation_text(t) + "; replayed the records before it")
    return "\n".join(lines)
