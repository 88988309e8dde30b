"""Dissect dgt traffic: a scapy layer for the wire header, a pcap packet parser and a
TCP stream reassembler that splits streams into dgt messages.

The scapy layer :class:`DGT` declares the header as data (``fields_desc``), derived
field by field from :data:`dgt.transport.wire.HEADER_FIELDS`, so the two cannot drift.
UDP: one datagram is one message (a UDP GSO super-packet seen on a capture tap is
split into its equal-sized segments). TCP: segments are ordered by sequence number per
flow, concatenated, and cut into messages with :func:`wire.decode_header` and
:func:`wire.frame_size`.

Decoding never raises out of this module: a malformed datagram or stream chunk is
counted under ``Dissector.undecodable`` (with the :class:`wire.WireError` reason) and
dropped. Source: docs/wire.md.

Example::

    from dgt.tools import dissect
    d = dissect.Dissector(ports=None)          # any port, recognise by magic number
    for msg in d.read_pcap("run.pcap"):
        print(msg.frame, msg.header.type, msg.header.iteration, len(msg.data))
    print(d.undecodable, dict(d.reasons))
"""
from __future__ import annotations

import collections
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Iterator

from scapy.fields import (ByteEnumField, ByteField, ConditionalField, FlagsField,
                          IntField, LongField, ShortField, StrLenField, XLongField,
                          XShortField, XStrFixedLenField)
from scapy.error import log_runtime
from scapy.layers.inet import TCP, UDP
from scapy.packet import Packet, bind_layers, split_layers

from dgt.transport import wire
from dgt.tools.ports import PortSpec

# scapy's readers log "packet has been truncated" themselves; read_pcap reports the cut
# once, in its status, so their warning would be a second line
log_runtime.setLevel(logging.ERROR)

# ---------------------------------------------------------------------------------------
# scapy layer
# ---------------------------------------------------------------------------------------

_FIELD_BY_CODE = {"B": ByteField, "H": ShortField, "I": IntField, "Q": LongField}
_SIZE_BY_CODE = {"B": 1, "H": 2, "I": 4, "Q": 8}
_FLAG_NAMES = [f.name for f in sorted(wire.Flag, key=int)]  # bit 0 = MAC, bit 1 = INDEXED


def _header_field(name: str, code: str):
    """The scapy field for one ``(name, struct code)`` of ``wire.HEADER_FIELDS``."""
    if name == "magic":
        return XShortField(name, wire.MAGIC)
    if name == "version":
        return ByteField(name, wire.VERSION)
    if name == "type":
        return ByteEnumField(name, int(wire.MsgType.BLOCKS),
                             {int(t): t.name for t in wire.MsgType})
    if name == "flags":
        return FlagsField(name, 0, 8, _FLAG_NAMES)
    if name == "session":
        return XLongField(name, 0)
    if name == "length":
        return IntField(name, None)  # filled in by post_build
    return _FIELD_BY_CODE[code](name, 0)


def _mac_flag(pkt) -> bool:
    return bool(int(pkt.flags or 0) & int(wire.Flag.MAC))


class DGT(Packet):
    """One dgt message: the 34-byte header, ``length`` payload bytes, and the 16-byte
    MAC when ``flags`` has MAC. Fields mirror ``wire.HEADER_FIELDS`` (big-endian).

    Building: ``length`` defaults to the payload size. Dissecting a buffer that holds
    several messages (a reassembled TCP stream) stacks them: ``DGT/DGT/...``.
    """

    name = "DGT"
    fields_desc = [_header_field(n, c) for n, c in wire.HEADER_FIELDS] + [
        StrLenField("data", b"", length_from=lambda p: p.length or 0),
        ConditionalField(XStrFixedLenField("mac", b"\x00" * wire.MAC_BYTES,
                                           wire.MAC_BYTES), _mac_flag),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.length is None:
            off = wire.HEADER_BYTES - 4
            pkt = pkt[:off] + struct.pack("!I", len(self.data or b"")) + pkt[off + 4:]
        return pkt + pay

    def guess_payload_class(self, payload: bytes):
        if len(payload) >= wire.HEADER_BYTES and payload[:2] == _MAGIC_BYTES:
            return DGT
        return Packet.guess_payload_class(self, payload)

    def mysummary(self) -> str:
        return self.sprintf("DGT %type% ch=%channel% sender=%sender% shard=%shard% "
                            "it=%iteration% block=%block% count=%count%")


_MAGIC_BYTES = struct.pack("!H", wire.MAGIC)
assert sum(_SIZE_BY_CODE[c] for _, c in wire.HEADER_FIELDS) == wire.HEADER_BYTES
assert [f.name for f in DGT.fields_desc[:len(wire.HEADER_FIELDS)]] == [
    n for n, _ in wire.HEADER_FIELDS]

_bound: set[tuple[str, int]] = set()


def bind_ports(udp_ports=(), tcp_ports=()) -> None:
    """Make scapy dissect ``udp_ports`` (either direction) as :class:`DGT`.

    ``tcp_ports`` binds TCP too, which decodes only messages that start a segment; use
    :class:`Dissector` for streams. Idempotent; undo with :func:`unbind_ports`.
    """
    for proto, ports in ((UDP, udp_ports), (TCP, tcp_ports)):
        for p in ports:
            key = (proto.__name__, int(p))
            if key in _bound:
                continue
            bind_layers(proto, DGT, dport=int(p))
            bind_layers(proto, DGT, sport=int(p))
            _bound.add(key)


def unbind_ports() -> None:
    """Undo every :func:`bind_ports`."""
    for proto_name, p in list(_bound):
        proto = UDP if proto_name == "UDP" else TCP
        split_layers(proto, DGT, dport=p)
        split_layers(proto, DGT, sport=p)
    _bound.clear()


def scapy_messages(buf: bytes) -> list[DGT]:
    """Dissect ``buf`` (one datagram or a stream chunk) with the scapy layer; never raises.

    Returns the stacked :class:`DGT` layers (empty when ``buf`` does not start with one).
    """
    try:
        pkt = DGT(bytes(buf))
    except Exception:  # scapy dissection of hostile bytes: count, never raise
        return []
    out = []
    layer = pkt
    while isinstance(layer, DGT):
        out.append(layer)
        layer = layer.payload
    return out


def describe_payload(h: wire.Header, payload) -> dict:
    """A JSON-able view of a message payload (what the Lua dissector shows too).

    BLOCKS (UDP): ``{"blocks": [block]}``; BLOCKS (INDEXED): the ``count`` indices;
    END: the 8 per-channel counts; END on a UDP channel (a tail marker, empty):
    ``{"tail_count": count}``; ERROR: the text; others: the payload size. Never raises.
    """
    try:
        mv = memoryview(payload).cast("B")
        if h.type == wire.MsgType.END and h.channel and not len(mv):
            return {"tail_count": h.count}
        if h.type == wire.MsgType.BLOCKS:
            if h.flags & wire.Flag.INDEXED:
                n = min(h.count, len(mv) // 4)
                return {"blocks": list(struct.unpack_from(f"!{n}I", mv, 0))}
            return {"blocks": list(range(h.block, h.block + h.count))}
        if h.type == wire.MsgType.END:
            return {"end_counts": [int(x) for x in wire.unpack_end(mv)]}
        if h.type == wire.MsgType.ERROR:
            return {"error": bytes(mv).decode("utf-8", "replace")}
    except (wire.WireError, struct.error, ValueError, TypeError):
        return {"payload_bytes": len(payload), "malformed": True}
    return {"payload_bytes": len(payload)}


# ---------------------------------------------------------------------------------------
# pcap reading and packet parsing (fast path: struct, no scapy objects per packet)
# ---------------------------------------------------------------------------------------

DLT_EN10MB = 1
DLT_RAW = 101
DLT_LINUX_SLL = 113
DLT_RAW_ALT = 12
DLT_IPV4 = 228
DLT_IPV6 = 229
DLT_LINUX_SLL2 = 276


class PcapError(ValueError):
    """A file is not a readable pcap; the message says which file and why."""


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One pcap record: frame number (1-based), time (ns since epoch), link bytes."""

    frame: int
    ts_ns: int
    data: bytes


SUPPORTED_LINKTYPES = {DLT_EN10MB: "EN10MB (Ethernet)", DLT_RAW_ALT: "RAW", DLT_RAW: "RAW",
                       DLT_LINUX_SLL: "LINUX_SLL", DLT_IPV4: "IPV4", DLT_IPV6: "IPV6",
                       DLT_LINUX_SLL2: "LINUX_SLL2"}
_MAX_RECORD = 1 << 18  # no link layer we read has frames above 256 KiB
#: the first 4 bytes of a pcap file (µs or ns timestamps, either byte order), of a
#: pcapng file, and of a gzip file (scapy reads a gzip-compressed capture)
PCAP_MAGICS = (b"\xa1\xb2\xc3\xd4", b"\xd4\xc3\xb2\xa1", b"\xa1\xb2\x3c\x4d",
               b"\x4d\x3c\xb2\xa1")
PCAPNG_MAGIC, GZIP_MAGIC = b"\x0a\x0d\x0d\x0a", b"\x1f\x8b"
PCAP_HEADER_BYTES = 24   # a pcap file's global header


def _not_pcap_why(path, err: Exception) -> str:
    """Why scapy could not open ``path`` as a capture (``err``: its exception), in a
    few words that are true of the file: "too short" only when it is shorter than a pcap
    header (24 bytes), else the magic number it starts with; for a gzip file, the same
    of what it holds."""
    import gzip
    how = ""
    try:
        with open(path, "rb") as f:
            head = f.read(PCAP_HEADER_BYTES)
        if head[:2] == GZIP_MAGIC:
            how = "gzip-compressed, "
            with gzip.open(path, "rb") as f:
                head = f.read(PCAP_HEADER_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        return f"{how}unreadable: {e}"
    if len(head) < PCAP_HEADER_BYTES:
        return (f"{how}too short: {len(head)} bytes, a pcap header is "
                f"{PCAP_HEADER_BYTES}")
    if head[:4] not in PCAP_MAGICS + (PCAPNG_MAGIC,):
        return (f"{how}magic {head[:4].hex()}; a pcap starts with a1b2c3d4 or a1b23c4d, "
                f"in either byte order, a pcapng with 0a0d0d0a")
    return f"{how}{err}"


def read_pcap(path, status: dict | None = None) -> Iterator[tuple[int, RawRecord]]:
    """Yield ``(linktype, RawRecord)`` from a classic pcap file (µs or ns, either byte
    order; scapy's ``RawPcapReader``) or a pcapng file (scapy's ``RawPcapNgReader``).
    Streams; memory stays bounded. Raises :class:`PcapError` for a missing file, a bad
    global header or a link type :func:`parse_packet` cannot read.

    A record that is cut off (end of file mid-record) or not a plausible record
    (captured length above the snap length or 256 KiB, above the original length, or a
    sub-second field out of range: garbage) ends the iteration; when ``status`` is
    given, ``status["truncated"]`` is then set to ``{"file", "record", "offset",
    "reason"}`` (record: 1-based number of the bad record; offset: its byte offset).
    ``status["records"]`` counts the records read.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise PcapError(f"cannot open {path}: {e.strerror}") from None
    if status is not None:
        status.setdefault("records", 0)
    if magic == b"\x0a\x0d\x0d\x0a":
        yield from _read_pcapng(path, status)
        return
    from scapy.error import Scapy_Exception
    from scapy.utils import RawPcapReader
    try:
        reader = RawPcapReader(str(path))
    except Scapy_Exception as e:   # bad magic, short global header
        raise PcapError(f"{path}: not a pcap file ({_not_pcap_why(path, e)})") from None
    linktype = reader.linktype & 0x0FFFFFFF
    if linktype not in SUPPORTED_LINKTYPES:
        reader.close()
        names = ", ".join(f"{k} ({v})" for k, v in sorted(SUPPORTED_LINKTYPES.items()))
        raise PcapError(f"{path}: link type {linktype} is not supported; supported: "
                        f"{names}")
    max_incl = max(reader.snaplen, _MAX_RECORD) if reader.snaplen else _MAX_RECORD
    frac_max, frac_ns = (1_000_000_000, 1) if reader.nano else (1_000_000, 1000)
    size = os.fstat(reader.f.fileno()).st_size
    frame = 0
    with reader:
        while True:
            offset = reader.f.tell()
            try:   # scapy bounds each read (256 KiB) and skips a record's excess
                data, meta = reader._read_packet(size=_MAX_RECORD)
            except EOFError:
                if offset < size and status is not None:
                    status["truncated"] = {"file": str(path), "record": frame + 1,
                                           "offset": offset,
                                           "reason": "record header cut off"}
                return
            incl, orig, frac = meta.caplen, meta.wirelen, meta.usec
            reason = None
            if incl > max_incl or frac >= frac_max or (orig and incl > orig):
                reason = (f"not a pcap record (captured length {incl}, original length "
                          f"{orig}, sub-second field {frac})")
            elif len(data) < incl:
                reason = f"record data cut off ({len(data)} of {incl} bytes)"
            if reason is not None:
                if status is not None:
                    status["truncated"] = {"file": str(path), "record": frame + 1,
                                           "offset": offset, "reason": reason}
                return
            frame += 1
            if status is not None:
                status["records"] += 1
            yield linktype, RawRecord(frame, meta.sec * 1_000_000_000 + frac * frac_ns, data)


#: pcapng block types that carry a packet: enhanced, simple, and the obsolete packet block
_PCAPNG_PACKET_BLOCKS = (6, 3, 2)


def _read_pcapng(path, status: dict | None) -> Iterator[tuple[int, RawRecord]]:
    """:func:`read_pcap` for pcapng, one block at a time with scapy's
    ``RawPcapNgReader``. Each packet carries its interface's link type; one that
    :func:`parse_packet` cannot read raises :class:`PcapError`. A block that is cut off
    or garbled (a length past the end of the file), an enhanced packet block whose
    captured length does not fit in it, and a packet block that scapy drops (one with
    no interface description before it in its section) end the iteration, with
    ``status["truncated"]`` set as for a pcap record (breaker round 25: scapy ended
    such a file at its first bad block as if it were the file's end, and a capture of
    nothing but bad blocks read as an empty one, exit 0). A simple packet block, which
    has no time stamp, takes the time of the packet before it (0 for the first)."""
    from scapy.utils import RawPcapNgReader
    try:
        reader = RawPcapNgReader(str(path))
    except Exception as e:  # scapy raises Scapy_Exception for a bad section header
        raise PcapError(f"{path}: not a readable pcapng file ({e})") from None
    size = os.fstat(reader.f.fileno()).st_size
    frame = ts_ns = 0

    def cut(offset: int, reason: str) -> None:
        if status is not None:
            status["truncated"] = {"file": str(path), "record": frame + 1,
                                   "offset": offset, "reason": reason}
    with reader:
        while True:
            offset = reader.f.tell()
            head = reader.f.read(28)   # type, length, and an EPB's five fields
            reader.f.seek(offset)
            kind = length = None
            if len(head) >= 8:
                kind, length = struct.unpack(reader.endian + "2I", head[:8])
            try:
                res = reader._read_block(size=_MAX_RECORD)
            except (EOFError, OSError, OverflowError, zlib.error, struct.error):
                if offset < size:
                    cut(offset, f"pcapng block cut off or garbled (type {kind}, length "
                                f"{length}, {size - offset} bytes left in the file)")
                return
            if kind == 6 and len(head) == 28:
                caplen = struct.unpack(reader.endian + "I", head[20:24])[0]
                if caplen > length - 32:
                    cut(offset, f"not a pcapng packet block (captured length {caplen} "
                                f"in a block of {length} bytes)")
                    return
            if kind == 0x0A0D0D0A and offset > 0:
                # a new section: its interfaces are its own (scapy keeps the old ones)
                reader.interfaces = []
            if res is None:
                if kind in _PCAPNG_PACKET_BLOCKS:
                    cut(offset, f"a packet block (type {kind}) that cannot be read: no "
                                f"interface description before it, or garbled")
                    return
                continue
            data, meta = res
            if meta.linktype not in SUPPORTED_LINKTYPES:
                names = ", ".join(f"{k} ({v})" for k, v in sorted(SUPPORTED_LINKTYPES.items()))
                raise PcapError(f"{path}: link type {meta.linktype} is not supported; "
                                f"supported: {names}")
            frame += 1
            if status is not None:
                status["records"] += 1
            if meta.tshigh is not None:   # a simple packet block has no time stamp:
                ts_ns = ((meta.tshigh << 32) + meta.tslow) * 1_000_000_000 // meta.tsresol
            yield meta.linktype, RawRecord(frame, ts_ns, data)   # the one before it


@dataclass(frozen=True, slots=True)
class L4:
    """The transport view of one captured packet."""

    frame: int
    ts_ns: int
    proto: str          # 'udp' or 'tcp'
    src: str
    sport: int
    dst: str
    dport: int
    dscp: int           # IP TOS >> 2 (IPv6: traffic class >> 2)
    payload: bytes
    seq: int = 0        # TCP only
    tcp_flags: int = 0  # TCP only
    truncated: bool = False


def _ip4(b: bytes) -> str:
    return f"{b[0]}.{b[1]}.{b[2]}.{b[3]}"


def _ip6(b: bytes) -> str:
    import ipaddress
    return str(ipaddress.IPv6Address(b))


def parse_packet(linktype: int, rec: RawRecord) -> L4 | None:
    """Parse link/IP/UDP-or-TCP headers; ``None`` for anything else. Never raises."""
    try:
        d = rec.data
        if linktype == DLT_EN10MB:
            off, etype = 14, struct.unpack_from("!H", d, 12)[0]
            while etype in (0x8100, 0x88A8):
                etype = struct.unpack_from("!H", d, off + 2)[0]
                off += 4
        elif linktype == DLT_LINUX_SLL:
            off, etype = 16, struct.unpack_from("!H", d, 14)[0]
        elif linktype == DLT_LINUX_SLL2:
            off, etype = 20, struct.unpack_from("!H", d, 0)[0]
        elif linktype in (DLT_RAW, DLT_RAW_ALT, DLT_IPV4, DLT_IPV6):
            off = 0
            etype = 0x0800 if d[0] >> 4 == 4 else 0x86DD
        else:
            return None
        if etype == 0x0800:
            vihl, tos, total = struct.unpack_from("!BBH", d, off)
            ihl = (vihl & 0x0F) * 4
            frag = struct.unpack_from("!H", d, off + 6)[0]
            if frag & 0x3FFF:  # dgt never fragments (docs/architecture.md, kernel facts)
                return None
            proto = d[off + 9]
            src, dst = _ip4(d[off + 12:off + 16]), _ip4(d[off + 16:off + 20])
            end = off + total if total else len(d)
            l4 = off + ihl
            dscp = tos >> 2
        elif etype == 0x86DD:
            vtc, plen, proto = struct.unpack_from("!IHB", d, off)
            dscp = ((vtc >> 20) & 0xFF) >> 2
            src, dst = _ip6(d[off + 8:off + 24]), _ip6(d[off + 24:off + 40])
            l4 = off + 40
            end = l4 + plen if plen else len(d)
        else:
            return None
        truncated = end > len(d)
        end = min(end, len(d))
        if proto == 17:
            sport, dport = struct.unpack_from("!HH", d, l4)
            return L4(rec.frame, rec.ts_ns, "udp", src, sport, dst, dport, dscp,
                      d[l4 + 8:end], truncated=truncated)
        if proto == 6:
            sport, dport, seq, _ack, offfl = struct.unpack_from("!HHIIH", d, l4)
            hl = (offfl >> 12) * 4
            return L4(rec.frame, rec.ts_ns, "tcp", src, sport, dst, dport, dscp,
                      d[l4 + hl:end], seq, offfl & 0x1FF, truncated)
    except (struct.error, IndexError, ValueError):
        return None
    return None


# ---------------------------------------------------------------------------------------
# messages, TCP reassembly, the dissector
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Message:
    """One decoded dgt message as captured.

    ``frame``: pcap frame number (1-based) of the packet that completed it; ``ts_ns``:
    its capture time; ``data``: the whole message (header + payload + MAC), so
    ``len(data)`` is the message bytes the sidecar counts. ``flow``: (src, sport, dst,
    dport). ``gso``: segment of a UDP GSO super-packet.
    """

    frame: int
    ts_ns: int
    proto: str
    src: str
    sport: int
    dst: str
    dport: int
    dscp: int
    header: wire.Header
    data: bytes
    gso: bool = False

    @property
    def flow(self) -> tuple[str, int, str, int]:
        return (self.src, self.sport, self.dst, self.dport)

    @property
    def payload(self) -> memoryview:
        return memoryview(self.data)[wire.HEADER_BYTES:wire.HEADER_BYTES + self.header.length]


_SYN, _FIN, _RST = 0x02, 0x01, 0x04
_MAX_PENDING = 64 << 20  # out-of-order bytes held per flow before a gap is declared
_RESYNC = struct.pack("!HB", wire.MAGIC, wire.VERSION)
#: bytes of a stream that starts with no dgt magic (picked up mid-frame, no --ports)
#: searched for a decodable dgt header before it is taken for another protocol's
PROBE_BYTES = 64 * 1024


def _probe(buf: bytearray) -> bool | None:
    """Is a stream whose first bytes are not dgt's magic a dgt stream picked up
    mid-frame? True when a full header that decodes (``wire.decode_header``: magic,
    version, a known type, a sane length) lies in ``buf``; False when none does in
    its first PROBE_BYTES; None while fewer have come."""
    i = buf.find(_RESYNC)
    while 0 <= i <= len(buf) - wire.HEADER_BYTES:
        try:
            wire.decode_header(buf[i:i + wire.HEADER_BYTES])
            return True
        except wire.WireError:
            i = buf.find(_RESYNC, i + 1)
    if len(buf) >= PROBE_BYTES:
        return False
    return None


class TcpStream:
    """Sans-IO reassembly of one TCP direction into dgt messages.

    Feed segments in capture order with :meth:`feed`; it returns the messages they
    complete. Retransmitted and overlapping bytes are trimmed; out-of-order segments
    wait for the gap to fill. A stream picked up mid-way, or one with a gap that never
    fills, resynchronises on the next valid header; skipped bytes count as undecodable.
    Without ports, a stream that does not start with dgt's magic is a dgt stream when a
    header that decodes comes in its first PROBE_BYTES (:func:`_probe`).
    """

    def __init__(self, dissector: "Dissector"):
        self.d = dissector
        self.next_seq: int | None = None
        self.pending: dict[int, bytes] = {}
        self.pending_bytes = 0
        self.buf = bytearray()
        self.synced = False
        self.is_dgt: bool | None = None  # decided on first bytes in any-port mode
        self.bytes_in = 0

    def feed(self, pkt: L4) -> list[Message]:
        if pkt.tcp_flags & _SYN:
            self.__init__(self.d)
            self.next_seq = (pkt.seq + 1) & 0xFFFFFFFF
            self.synced = True
            return []
        data = pkt.payload
        if not data:
            return []
        if self.next_seq is None:
            self.next_seq = pkt.seq  # picked up mid-stream: resynchronise on a header
        rel = (pkt.seq - self.next_seq) & 0xFFFFFFFF
        if rel >= 0x80000000:  # before next_seq: a retransmission, maybe partly new
            back = 0x100000000 - rel
            if back >= len(data):
                return []
            data, rel = data[back:], 0
        if rel > 0:
            seq = pkt.seq if len(data) == len(pkt.payload) else self.next_seq + rel
            if seq not in self.pending or len(self.pending[seq]) < len(data):
                self.pending_bytes += len(data) - len(self.pending.get(seq, b""))
                self.pending[seq] = data
            if self.pending_bytes > _MAX_PENDING:
                return self._skip_gap(pkt)
            return []
        self._append(data)
        self._drain_pending()
        return self._frames(pkt)

    def _append(self, data: bytes) -> None:
        self.buf += data
        self.bytes_in += len(data)
        self.next_seq = (self.next_seq + len(data)) & 0xFFFFFFFF

    def _drain_pending(self) -> None:
        while self.pending:
            progressed = False
            for seq in list(self.pending):
                rel = (seq - self.next_seq) & 0xFFFFFFFF
                if rel == 0 or rel >= 0x80000000:
                    data = self.pending.pop(seq)
                    self.pending_bytes -= len(data)
                    back = 0 if rel == 0 else 0x100000000 - rel
                    if back < len(data):
                        self._append(data[back:])
                    progressed = True
            if not progressed:
                return

    def _skip_gap(self, pkt: L4) -> list[Message]:
        if not self.pending:
            return []
        first = min(self.pending, key=lambda s: (s - self.next_seq) & 0xFFFFFFFF)
        self.d._bad("tcp_gap")
        self.buf.clear()
        self.synced = False
        self.next_seq = first
        self._drain_pending()
        return self._frames(pkt)

    def _frames(self, pkt: L4) -> list[Message]:
        out: list[Message] = []
        buf = self.buf
        if self.is_dgt is None:
            if len(buf) < 2:
                return out
            self.is_dgt = True if self.d.ports is not None or buf[:2] == _MAGIC_BYTES \
                else _probe(buf)
            if self.is_dgt is None:   # not yet known: wait for more of the stream
                return out
            if not self.is_dgt:
                buf.clear()
                return out
        if not self.is_dgt:
            buf.clear()
            return out
        while len(buf) >= wire.HEADER_BYTES:
            if not self.synced:
                i = buf.find(_RESYNC)
                if i != 0:
                    self.d._bad("tcp_resync")
                    if i < 0:
                        del buf[:len(buf) - 2]
                        return out
                    del buf[:i]
                    continue
            try:
                h = wire.decode_header(buf)
            except wire.WireError as e:
                self.d._bad(e.reason)
                self.synced = False
                del buf[:1]
                continue
            size = wire.frame_size(h)
            if len(buf) < size:
                break
            self.synced = True
            data = bytes(buf[:size])
            del buf[:size]
            out.append(Message(pkt.frame, pkt.ts_ns, "tcp", pkt.src, pkt.sport, pkt.dst,
                               pkt.dport, pkt.dscp, h, data))
        return out

    def close(self) -> None:
        """End of stream: leftover bytes (a cut-off message) count as undecodable."""
        if self.pending:
            self.d._bad("tcp_gap")
        if self.buf and self.is_dgt:
            self.d._bad("truncated")
        self.buf.clear()
        self.pending.clear()
        self.pending_bytes = 0


class Dissector:
    """Turns captured packets into dgt :class:`Message` records, in capture order.

    ``ports``: a :class:`PortSpec`; ``None`` (or a spec with ``any_port``) decodes any
    UDP/TCP payload that starts with the magic number. Counters: ``packets`` (parsed
    IP packets), ``dgt_packets`` (packets on dgt ports or with the magic), ``messages``,
    ``undecodable`` and ``reasons`` (``wire.WireError`` reasons, ``tcp_gap``,
    ``tcp_resync``, ``truncated``, ``gso_tail``).
    """

    def __init__(self, ports: PortSpec | None = None):
        self.ports = None if ports is None or ports.any_port else ports
        self.streams: dict[tuple, TcpStream] = {}
        self.tcp_server: dict[tuple, tuple[str, int]] = {}  # canonical conn -> server end
        self.packets = 0
        self.dgt_packets = 0
        self.messages = 0
        self.undecodable = 0
        self.reasons: collections.Counter = collections.Counter()
        self.first_ts_ns: int | None = None
        self.last_ts_ns: int | None = None

    def _bad(self, reason: str) -> None:
        self.undecodable += 1
        self.reasons[reason] += 1

    def _wanted(self, pkt: L4) -> bool:
        if self.ports is None:
            return True
        ports = self.ports.udp if pkt.proto == "udp" else self.ports.tcp
        return ports is None or pkt.sport in ports or pkt.dport in ports

    def feed(self, pkt: L4 | None) -> list[Message]:
        """Dissect one parsed packet; returns the messages it completes. Never raises."""
        if pkt is None:
            return []
        self.packets += 1
        if self.first_ts_ns is None:
            self.first_ts_ns = pkt.ts_ns
        self.last_ts_ns = pkt.ts_ns
        if not self._wanted(pkt):
            return []
        try:
            out = self._udp(pkt) if pkt.proto == "udp" else self._tcp(pkt)
        except Exception as e:  # defence in depth: decoding never raises out
            self._bad(f"internal:{type(e).__name__}")
            return []
        self.messages += len(out)
        return out

    def _udp(self, pkt: L4) -> list[Message]:
        p = pkt.payload
        if self.ports is None and p[:2] != _MAGIC_BYTES:
            return []
        self.dgt_packets += 1
        if pkt.truncated:
            self._bad("truncated")
            return []
        return self._udp_datagram(pkt, p)

    def _udp_datagram(self, pkt: L4, p, tail: bool = False) -> list[Message]:
        """The messages of one datagram's payload ``p``; ``tail``: the short last piece
        of a payload that held several messages, read as a datagram of its own (a piece
        too short is ``gso_tail``)."""
        try:
            h = wire.decode_header(p)
        except wire.WireError as e:
            self._bad("gso_tail" if tail and e.reason == "short" else e.reason)
            return []
        size = wire.frame_size(h)
        if size == len(p):
            return [self._udp_message(pkt, h, p, tail)]
        if size > len(p):
            self._bad("gso_tail" if tail else "bad_length")
            return []
        return self._udp_run(pkt, p, h, size)

    def _udp_message(self, pkt: L4, h: wire.Header, seg, gso: bool = False) -> Message:
        return Message(pkt.frame, pkt.ts_ns, "udp", pkt.src, pkt.sport, pkt.dst,
                       pkt.dport, pkt.dscp, h, bytes(seg), gso)

    def _udp_run(self, pkt: L4, p, h: wire.Header, size: int) -> list[Message]:
        """A datagram holding more than its first message, split as a receiver splits
        it (``transport.session``, a UDP GRO run): after blocks, rows of the first
        message's size, each taken or refused on its own, then the shorter tail as a
        datagram of its own (a GSO super-packet seen on the tap, or its tail marker);
        after any other first message, equal rows only, else the datagram is refused
        whole (``bad_length``)."""
        if h.type != wire.MsgType.BLOCKS or size <= wire.HEADER_BYTES:
            if len(p) % size:
                self._bad("bad_length")
                return []
            rows, tail = len(p) // size, None
        else:
            rows = len(p) // size
            tail = p[rows * size:] if rows * size < len(p) else None
        out = []
        for off in range(0, rows * size, size):
            seg = p[off:off + size]
            try:
                hs, _ = wire.decode(seg)
            except wire.WireError as e:
                self._bad(e.reason)
                continue
            out.append(self._udp_message(pkt, hs, seg, True))
        if tail is not None:
            out += self._udp_datagram(pkt, tail, tail=True)
        return out

    def _tcp(self, pkt: L4) -> list[Message]:
        key = (pkt.src, pkt.sport, pkt.dst, pkt.dport)
        conn = tuple(sorted([(pkt.src, pkt.sport), (pkt.dst, pkt.dport)]))
        if pkt.tcp_flags & _SYN:
            ack = pkt.tcp_flags & 0x10
            # SYN from the client, SYN-ACK from the server
            self.tcp_server[conn] = (pkt.src, pkt.sport) if ack else (pkt.dst, pkt.dport)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = TcpStream(self)
        if pkt.payload or pkt.tcp_flags & _SYN:
            if pkt.payload:
                self.dgt_packets += 1
            if pkt.truncated:
                self._bad("truncated")
                st.synced = False
                st.next_seq = None
                st.buf.clear()
                return []
            out = st.feed(pkt)
        else:
            out = []
        if pkt.tcp_flags & (_FIN | _RST):
            st.close()
            del self.streams[key]
        return out

    def server_endpoint(self, msg: Message) -> tuple[str, int]:
        """The listening (server) end of the TCP connection carrying ``msg``: known
        from the SYN; otherwise the end on a dgt TCP port, else the lower port."""
        conn = tuple(sorted([(msg.src, msg.sport), (msg.dst, msg.dport)]))
        if conn in self.tcp_server:
            return self.tcp_server[conn]
        if self.ports is not None and self.ports.tcp is not None:
            if msg.dport in self.ports.tcp:
                return (msg.dst, msg.dport)
            if msg.sport in self.ports.tcp:
                return (msg.src, msg.sport)
        return min(conn, key=lambda e: e[1])

    def finish(self) -> list[Message]:
        """End of capture: close every open stream (cut-off data counts as undecodable)."""
        for st in self.streams.values():
            st.close()
        self.streams.clear()
        return []

    def read_pcap(self, path) -> Iterator[Message]:
        """Yield the messages of a pcap file in capture order (streams; bounded memory).

        Raises :class:`PcapError` only for a missing file or bad global header.
        """
        for linktype, rec in read_pcap(path):
            yield from self.feed(parse_packet(linktype, rec))
        yield from self.finish()

    def counters(self) -> dict:
        return {"packets": self.packets, "dgt_packets": self.dgt_packets,
                "messages": self.messages, "undecodable": self.undecodable,
                "undecodable_reasons": dict(sorted(self.reasons.items()))}


def messages_from_pcap(path, ports: PortSpec | None = None) -> tuple[list[Message], Dissector]:
    """All messages of ``path`` and the dissector that counted them (small files)."""
    d = Dissector(ports)
    return list(d.read_pcap(path)), d


def lua_script_path() -> str:
    """Path of the Wireshark Lua dissector shipped as package data (``dgt.lua``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "dgt.lua")


def dissect_files(d, files, sink) -> tuple[list, int]:
    """Feed every record of ``files`` (pcap paths, in order) through dissector ``d``,
    calling ``sink(message)`` per decoded message, then ``d.finish()``.

    Returns (truncation notes, records read) for the caller to report."""
    truncated, records = [], 0
    for f in files:
        st: dict = {}
        for linktype, rec in read_pcap(f, st):
            for m in d.feed(parse_packet(linktype, rec)):
                sink(m)
        records += st.get("records", 0)
        if "truncated" in st:
            truncated.append(st["truncated"])
    d.finish()
    return truncated, records
