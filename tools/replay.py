"""``dgt replay``: re-send the dgt messages of a capture.

UDP datagrams are re-sent as datagrams (a GSO super-packet seen on the tap becomes its
segments); TCP frames of each captured connection are re-sent, in order, over one fresh
TCP connection per captured connection. Only the client-to-server direction of a TCP
connection is replayed (worker -> shard: HELLO, BLOCKS, END); the captured answers
(PULL) are counted as ``skipped_reverse``, and the receiver's live answers are read and
discarded. Destinations are rewritten with ``to_host`` and a port map.

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

from dgt.transport import wire
from dgt.transport.channels import channel_name
from dgt.tools.dissect import Dissector, dissect_files
from dgt.tools.ports import PortSpec, PortSpecError

_CONTROL = {wire.MsgType.HELLO, wire.MsgType.BYE}


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


@dataclass(frozen=True, slots=True)
class Item:
    """One message to send. ``conn``: the captured TCP connection (client, server)
    endpoints, or None for UDP. ``dst``/``dport``: rewritten destination."""

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
            r = (int(a), int(b))
        else:
            r = (int(text), int(text))
    except ValueError:
        raise PortSpecError(f"bad --iterations {text!r}; use A-B or N") from None
    if r[0] < 0 or r[1] < r[0]:
        raise PortSpecError(f"bad --iterations {text!r}; need 0 <= A <= B")
    return r


def plan(cfg: ReplayConfig) -> tuple[list[Item], dict]:
    """Read the capture(s) and pick, filter and re-address the messages to send.

    Returns (items in capture order, counters). Raises PcapError for a bad file.
    """
    d = Dissector(cfg.ports)
    raw = []
    skipped = Counter()
    truncated, records = dissect_files(d, cfg.files, raw.append)
    from dgt.tools.summary import check_truncated
    check_truncated(truncated, records)
    server_ports = []
    chosen = []
    for m in raw:
        conn = None
        if m.proto == "tcp":
            server = d.server_endpoint(m)
            if (m.dst, m.dport) != server:
                skipped["reverse"] += 1
                continue
            conn = ((m.src, m.sport), server)
            server_ports.append(m.dport)
        else:
            server_ports.append(m.dport)
        h = m.header
        if h.type == wire.MsgType.BLOCKS:
            if cfg.channels is not None and h.channel not in cfg.channels:
                skipped["channel"] += 1
                continue
        elif not cfg.control:
            skipped["control"] += 1
            continue
        if cfg.iterations is not None and h.type not in _CONTROL:
            a, b = cfg.iterations
            if not a <= h.iteration <= b:
                skipped["iteration"] += 1
                continue
        chosen.append((m, conn))
    old_base = cfg.from_base_port
    if cfg.base_port is not None and old_base is None and server_ports:
        old_base = min(server_ports)
    items = []
    for m, conn in chosen:
        port = m.dport
        if port in cfg.port_map:
            port = cfg.port_map[port]
        elif cfg.base_port is not None and old_base is not None:
            port = cfg.base_port + (port - old_base)
        if not 1 <= port <= 65535:
            raise ReplayError(f"port {m.dport} maps to {port}, outside 1..65535; "
                              f"check --base-port/--from-base-port")
        items.append(Item(m.ts_ns, m.proto, conn, (m.src, m.sport),
                          cfg.to_host or m.dst, port, m.dport, m.dscp, m.header, m.data))
    info = {"captured_messages": len(raw), "skipped": dict(skipped),
            "undecodable": d.undecodable, "from_base_port": old_base,
            "truncated": truncated}
    return items, info


def schedule(items: list[Item], *, speed: float = 1.0, rate_pps: float | None = None,
             rate_mbit: float | None = None) -> list[float]:
    """Send offsets in seconds from the replay start, one per item.

    Original timing: ``(ts_i - ts_0) / speed``; ``rate_pps``: ``i / pps``;
    ``rate_mbit``: bits of the messages before i / rate. Raises ValueError for
    a non-positive speed or rate.
    """
    if not items:
        return []
    if rate_pps is not None:
        if not (math.isfinite(rate_pps) and rate_pps > 0):
            raise ValueError("rate_pps must be finite and > 0")
        return [i / rate_pps for i in range(len(items))]
    if rate_mbit is not None:
        if not (math.isfinite(rate_mbit) and rate_mbit > 0):
            raise ValueError("rate_mbit must be finite and > 0")
        out, bits = [], 0
        for it in items:
            out.append(bits / (rate_mbit * 1e6))
            bits += len(it.data) * 8
        return out
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"--speed must be a finite number > 0, got {speed}")
    t0 = items[0].ts_ns
    return [(it.ts_ns - t0) / 1e9 / speed for it in items]


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


def _send_tcp(sock: socket.socket, data: bytes) -> int:
    """Send all of ``data`` on a non-blocking socket, draining replies meanwhile."""
    view = memoryview(data)
    got = 0
    while view:
        try:
            n = sock.send(view)
            view = view[n:]
        except BlockingIOError:
            r, _, _ = select.select([sock], [sock], [], 1.0)
            if r:
                got += _drain(sock)
    return got


def replay(cfg: ReplayConfig, items: list[Item] | None = None, progress=None) -> dict:
    """Send the planned messages on schedule; returns the report dict (see
    :func:`format_report`). A TCP connection that is refused, or that breaks mid-way
    (the receiver ended), does not stop the replay: its messages are counted under
    ``send_errors`` and ``send_errors_by_destination`` and the others go on. Raises
    ReplayError for a schedule over :data:`MAX_SCHEDULE_S`."""
    info = {}
    if items is None:
        items, info = plan(cfg)
    offs = schedule(items, speed=cfg.speed, rate_pps=cfg.rate_pps, rate_mbit=cfg.rate_mbit)
    check_schedule(offs)
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
        for i, (it, off) in enumerate(zip(items, offs)):
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
                        ent[0].setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
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
                            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
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
                    reply_bytes += _send_tcp(s, it.data)
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
                progress(i, len(items))
        end = time.monotonic()
    finally:
        for s in tcp_socks.values():
            try:
                s.setblocking(True)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(0.5)
                while s.recv(1 << 20):
                    pass
            except OSError:
                pass
            s.close()
        for ent in udp_socks.values():
            ent[0].close()
    orig = (items[-1].ts_ns - items[0].ts_ns) / 1e9 if items else 0.0
    dur = (end - start) if items else 0.0
    sched = offs[-1] if offs else 0.0
    return {
        **info,
        "messages": len(items),
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
    from dgt.tools.summary import truncation_text
    for t in rep.get("truncated", ()):
        lines.append(truncation_text(t) + "; replayed the records before it")
    return "\n".join(lines)
