"""The dgt wire format: one fixed header for TCP frames and UDP datagrams.

Declared once, as one ``struct`` format with named fields (``HEADER_FIELDS``); the scapy
layer in ``dgt.tools.dissect`` mirrors it field by field, and ``docs/wire.md`` documents
it byte by byte.

Layout (network byte order, 34 bytes)::

    off size field        meaning
    0   2    magic        0x4447 ("DG")
    2   1    version      1
    3   1    type         MsgType
    4   1    channel      0 = reliable (TCP), 1..7 = unreliable UDP channel
    5   1    flags        Flag bits
    6   8    session      64 random bits per run; strays and replays are rejected
    14  2    sender       sender rank
    16  2    shard        shard index (= owner rank)
    18  4    iteration    BSP iteration t
    22  4    block        first block index (global)
    26  4    count        number of blocks (BLOCKS/PULL), total blocks sent (END)
    30  4    length       payload length in bytes
    34  ...  payload
    ..  16   mac          keyed BLAKE2b-128 over header+payload, iff flags & MAC

Block payloads are IEEE-754 binary32, little-endian (the layout of every CPU and GPU
that trains models, so a block is a view, never a byte swap).

Decoding never trusts a length: every check failure raises :class:`WireError`, whose
``reason`` is a short counter key; callers count and drop, they never let it escape.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import numbers
import operator
import struct
from dataclasses import dataclass

import numpy as np

from . import udpmac
from .channels import MAX_UDP_CHANNELS

MAGIC = 0x4447
VERSION = 1
MAC_BYTES = 16
MAX_CHANNELS = 1 + MAX_UDP_CHANNELS  # channel 0 (reliable) + the UDP channels
#: Upper bound on one TCP frame's payload; a larger length is a protocol error, not an
#: allocation. 256 MiB covers a PULL of a 64M-parameter shard.
MAX_FRAME_PAYLOAD = 256 << 20
#: The largest UDP datagram payload over IPv4 (65,535 - 8 - 20): a block datagram
#: (header, block, MAC) over it cannot be sent (EMSGSIZE)
MAX_UDP_PAYLOAD = 65507

HEADER_FIELDS = (
    ("magic", "H"),
    ("version", "B"),
    ("type", "B"),
    ("channel", "B"),
    ("flags", "B"),
    ("session", "Q"),
    ("sender", "H"),
    ("shard", "H"),
    ("iteration", "I"),
    ("block", "I"),
    ("count", "I"),
    ("length", "I"),
)
HEADER_FORMAT = "!" + "".join(code for _, code in HEADER_FIELDS)
HEADER = struct.Struct(HEADER_FORMAT)
HEADER_BYTES = HEADER.size  # 34

#: The same header as a numpy dtype, for vectorised encode/decode of datagram batches.
HEADER_DTYPE = np.dtype([(name, ">" + code) for name, code in HEADER_FIELDS])
assert HEADER_DTYPE.itemsize == HEADER_BYTES


class MsgType(enum.IntEnum):
    """Message types. Source: docs/wire.md."""

    HELLO = 1   # worker -> shard, TCP: opens a connection (payload empty)
    BLOCKS = 2  # worker -> shard: gradient blocks (TCP: indexed; UDP: one block)
    END = 3     # worker -> shard, TCP: per-channel block counts for iteration t
    PULL = 4    # shard -> worker, TCP: aggregate of the shard range + received bitmap
    ERROR = 5   # any, TCP: a peer failed; payload is UTF-8 text, block = failed rank
    BYE = 6     # any, TCP: orderly shutdown


class Flag(enum.IntFlag):
    MAC = 0x01      # a 16-byte keyed BLAKE2b tag follows the payload
    INDEXED = 0x02  # BLOCKS payload = count x u32 block indices, then count blocks


#: the flags as plain ints, for the per-message paths (``int & IntFlag`` builds a Flag
#: in Python each time)
MAC_BIT, INDEXED_BIT = int(Flag.MAC), int(Flag.INDEXED)


class Coding(enum.IntEnum):
    """How a UDP BLOCKS payload codes its block, and a PULL its coded blocks: flags
    bits 2-4 (``CODING_MASK``).
    Source: docs/wire.md, "Block codings". The name in lower case is the
    ``--band-codec`` and ``--pull-codec`` word (``fp32``, ``fp16``, ``bf16``, ``int8``,
    ``int4``)."""

    FP32 = 0   # E x f32 LE: the block as it is (all but coded UDP BLOCKS and PULL)
    FP16 = 1   # E x IEEE-754 binary16 LE, round to nearest even
    BF16 = 2   # E x bfloat16 LE (the top 16 bits of the f32), round to nearest even
    INT8 = 3   # f32 LE scale s, then E x int8 q: value = q * s (symmetric, per block)
    INT4 = 4   # f32 LE scale s, then ceil(E/2) bytes of two 4-bit q (-7..7): q * s


#: flags bits 2-4 carry the coding of a UDP BLOCKS payload, and of a PULL's coded blocks
#: (``Coding``)
CODING_SHIFT = 2
CODING_MASK = 0x07 << CODING_SHIFT


def udp_shape_problem(h: "Header") -> str | None:
    """What a receiver says of a UDP datagram with header ``h``, by its shape alone:
    None for a one-block BLOCKS or a tail marker (END) on a UDP channel (1..7), without
    INDEXED; else ``"bad_udp_message"`` (a PULL, HELLO, ERROR or BYE over UDP, a TCP
    BLOCKS frame). ``transport.session`` and ``dgt pcap summary`` both go by it."""
    if h.channel == 0 or h.flags & INDEXED_BIT:
        return "bad_udp_message"
    if h.type == MsgType.BLOCKS:
        return None if h.count == 1 else "bad_udp_message"
    return None if h.type == MsgType.END else "bad_udp_message"


def coding_of(flags: int) -> int:
    """The coding number in header ``flags`` (0..7; not all are a :class:`Coding`)."""
    return (flags & CODING_MASK) >> CODING_SHIFT


def coded_payload_bytes(coding: int, block_elems: int) -> int | None:
    """Payload bytes of one block of ``block_elems`` values coded as ``coding``; None
    for a coding this version does not know (the datagram is ``bad_coding``)."""
    if coding == Coding.FP32:
        return 4 * block_elems
    if coding in (Coding.FP16, Coding.BF16):
        return 2 * block_elems
    if coding == Coding.INT8:
        return 4 + block_elems
    if coding == Coding.INT4:
        return 4 + (block_elems + 1) // 2
    return None


def block_payload_problem(h: "Header") -> str | None:
    """What every receiver says of a one-block BLOCKS datagram with header ``h`` by its
    coding and ``length``, whatever the job's block size: ``"bad_coding"`` for a coding
    this version does not know, ``"bad_length"`` for a length that no block of one or
    more values has in that coding (:func:`coded_payload_bytes`); else None. A receiver
    also checks the length against its own block size; ``dgt pcap summary``, which does
    not know it, goes by this alone (re-check of breaker round 12)."""
    coding = coding_of(h.flags)
    if coded_payload_bytes(coding, 1) is None:
        return "bad_coding"
    n = h.length
    if coding == Coding.FP32:
        return None if n >= 4 and n % 4 == 0 else "bad_length"
    if coding in (Coding.FP16, Coding.BF16):
        return None if n >= 2 and n % 2 == 0 else "bad_length"
    return None if n >= coded_payload_bytes(coding, 1) else "bad_length"


def block_datagram_bytes(coding: int, block_elems: int, mac: bool) -> int:
    """Bytes of one UDP block datagram: header, the block's payload coded as ``coding``
    (:func:`coded_payload_bytes`), and the MAC when ``mac``. Raises ValueError for an
    unknown coding."""
    p = coded_payload_bytes(coding, block_elems)
    if p is None:
        raise ValueError(f"unknown block coding {coding}")
    return HEADER_BYTES + p + (MAC_BYTES if mac else 0)


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded header. Field meanings are in the module docstring."""

    type: int
    channel: int
    flags: int
    session: int
    sender: int
    shard: int
    iteration: int
    block: int
    count: int
    length: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.type, self.channel, self.flags,
                           self.session, self.sender, self.shard, self.iteration,
                           self.block, self.count, self.length)


class WireError(ValueError):
    """A message broke a wire rule. ``reason`` is the counter key (e.g. ``bad_magic``)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


#: the range of each header field an encoder takes (docs/wire.md, "Header"): its bits
_FIELD_BITS = {"session": 64, "sender": 16, "shard": 16, "iteration": 32, "block": 32,
               "count": 32, "flags": 8}


def _field(name: str, value, bits: int) -> int:
    """``value`` as an int in 0 .. 2**bits - 1. Raises TypeError for a value that is not
    an integer (a bool is not), ValueError (naming the field and its range) for one
    outside it: an encoder never wraps a value nor writes one a decoder refuses."""
    if type(value) is not int:
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer, got "
                            f"{type(value).__name__} {value!r}") from None
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name} {value} is out of range: a u{bits} header field "
                         f"holds 0..{(1 << bits) - 1} (docs/wire.md, Header)")
    return value


def check_key(key) -> None:
    """Refuse a MAC key that no job has: ``None`` (no key) or 1 to 64 bytes (the UTF-8
    bytes of ``--secret``, docs/wire.md "Session id and key"). Raises ValueError for an
    empty or longer key (an empty key is refused, never read as "no key"), TypeError for
    one that is not bytes (a bytearray or memoryview too: the MAC states are cached by
    key, so it must be hashable; pass ``bytes(key)``)."""
    if key is None:
        return
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes or None, got {type(key).__name__}")
    if not 1 <= len(key) <= 64:
        raise ValueError(f"key must be 1 to 64 bytes (None for no key), got "
                         f"{len(key)} B")


def _check_header(msg_type, channel, flags, session, sender, shard, iteration, block,
                  count) -> None:
    """The O(1) checks of :func:`encode_parts`'s header fields (see :func:`_field`)."""
    if (type(channel) is type(flags) is type(session) is type(sender) is type(shard)
            is type(iteration) is type(block) is type(count) is int
            and isinstance(msg_type, int) and msg_type in _TYPES
            and 0 <= channel < MAX_CHANNELS and 0 <= flags <= 0xFF
            and 0 <= session <= 0xFFFFFFFFFFFFFFFF and 0 <= sender <= 0xFFFF
            and 0 <= shard <= 0xFFFF and 0 <= iteration <= 0xFFFFFFFF
            and 0 <= block <= 0xFFFFFFFF and 0 <= count <= 0xFFFFFFFF):
        return   # the common case in one expression; else find the field to name
    if _field("type", msg_type, 8) not in _TYPES:
        raise ValueError(f"type {msg_type!r} is not a MsgType "
                         f"({min(_TYPES)}..{max(_TYPES)}; decoders refuse it: bad_type)")
    if _field("channel", channel, 8) >= MAX_CHANNELS:
        raise ValueError(f"channel {channel} is out of range: 0..{MAX_CHANNELS - 1} "
                         f"(decoders refuse it: bad_channel)")
    _field("flags", flags, 8)
    _field("session", session, 64)
    _field("sender", sender, 16)
    _field("shard", shard, 16)
    _field("iteration", iteration, 32)
    _field("block", block, 32)
    _field("count", count, 32)


def _check_indices(indices, n: int | None = None) -> np.ndarray:
    """``indices`` as a 1-D integer array of block indices, each a u32 (0..2**32-1),
    ``n`` of them when given; one vectorised check. Raises TypeError / ValueError."""
    indices = np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got dtype {indices.dtype}")
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
    if n is not None and indices.size != n:
        raise ValueError(f"{indices.size} indices for {n} blocks: one index per block")
    if indices.size and (   # one pass: a negative int64 viewed as u64 is >= 2**63
            int(indices.view(np.uint64).max()) > 0xFFFFFFFF if indices.itemsize == 8
            else indices.dtype.kind == "i" and int(indices.min()) < 0):
        raise ValueError("indices out of range: a block index is a u32, 0..4294967295 "
                         f"(got {int(indices.min())}..{int(indices.max())})")
    return indices


def _check_rows(name: str, a) -> None:
    if getattr(a, "ndim", None) != 2:
        raise ValueError(f"{name} must be a 2-D numpy array (one row per block), got "
                         f"{getattr(a, 'shape', type(a).__name__)}")


def _check_f4(name: str, a) -> None:
    """Refuse ``a`` unless it is a numpy float32 array (either byte order: made <f4 by
    the caller): nothing is cast, a float64 or int64 array is the caller's bug (O(1))."""
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f" or a.dtype.itemsize != 4:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"{name} must be a float32 numpy array, got {got}")


def mac_tag(key: bytes, data) -> bytes:
    """Keyed BLAKE2b-128 of ``data`` (RFC 7693). ``key``: up to 64 bytes."""
    h = keyed_state(key).copy()   # the key block is hashed once per key, not per message
    h.update(data)
    return h.digest()


@functools.lru_cache(maxsize=8)
def keyed_state(key: bytes):
    """The BLAKE2b-128 state after ``key``'s block: ``.copy()`` it, never update it.
    A receiver keeps it, so a message's tag costs a copy, an update and a digest."""
    return hashlib.blake2b(digest_size=MAC_BYTES, key=key)


def encode_parts(msg_type: int, *, session: int, sender: int, shard: int = 0,
                 iteration: int = 0, channel: int = 0, block: int = 0, count: int = 0,
                 parts=(), flags: int = 0, key: bytes | None = None) -> list:
    """Encode one message as a list of buffers (header, payload parts [, MAC]) for
    scatter-gather output (``transport.writelines``, ``sendmsg``): the payload parts are
    not copied. The caller must not modify them until the transport has sent them.

    ``parts``: bytes-like objects (numpy arrays included) whose concatenation is the
    payload. With ``key`` (1 to 64 bytes) the MAC flag is set and a tag is appended.
    ``flags`` is the header's flags byte as given (a forger's MAC flag without a key
    included: the caller then appends its own 16 bytes).

    Raises :class:`WireError` (``too_long``) for a payload over ``MAX_FRAME_PAYLOAD``;
    ValueError, naming the field and its range (docs/wire.md, "Header"), for a
    ``msg_type`` that is not a :class:`MsgType`, a ``channel`` over 7, or a ``session``
    (u64), ``sender``, ``shard`` (u16), ``iteration``, ``block``, ``count`` (u32) or
    ``flags`` (u8) out of its field's range, and for an empty ``key``; TypeError for a
    field that is not an integer, and for a part that is not bytes-like or not
    C-contiguous (e.g. an array sliced with a step: it is never copied here), naming it.
    """
    _check_header(msg_type, channel, flags, session, sender, shard, iteration, block,
                  count)
    check_key(key)
    try:
        views = [memoryview(p).cast("B") for p in parts]
    except TypeError:
        raise TypeError(_parts_problem(parts)) from None
    n = sum(v.nbytes for v in views)
    if n > MAX_FRAME_PAYLOAD:
        raise WireError("too_long", f"payload {n} B > {MAX_FRAME_PAYLOAD} B")
    if key is not None:
        flags |= MAC_BIT
    head = HEADER.pack(MAGIC, VERSION, msg_type, channel, flags, session, sender, shard,
                       iteration, block, count, n)
    if key is None:
        return [head, *views]
    if channel != 0:   # a UDP datagram (a tail marker): the UDP MAC
        return [head, *views, udpmac.tag(udpmac.derive_keys(key), b"".join([head, *views]))]
    h = keyed_state(key).copy()
    h.update(head)
    for v in views:
        h.update(v)
    return [head, *views, h.digest()]


def _parts_problem(parts) -> str:
    """Which payload part a scatter-gather encoder cannot send as it is, and why."""
    if isinstance(parts, (bytes, bytearray, memoryview)):
        return ("parts: give a sequence of bytes-like objects (e.g. (payload,)), not "
                "one object")
    for i, p in enumerate(parts):
        try:
            memoryview(p)
        except TypeError:
            return f"payload part {i}: a {type(p).__name__} is not bytes-like"
        if not memoryview(p).c_contiguous:
            return (f"payload part {i} is not C-contiguous (a slice with a step or a "
                    f"negative stride): give np.ascontiguousarray(part)")
    return "the payload parts are not bytes-like"


def encode(msg_type: int, *, session: int, sender: int, shard: int = 0, iteration: int = 0,
           channel: int = 0, block: int = 0, count: int = 0, payload=b"",
           flags: int = 0, key: bytes | None = None) -> bytes:
    """Encode one message (header + payload [+ MAC]) to bytes.

    ``payload`` is any bytes-like object. With ``key`` the MAC flag is set and a tag is
    appended. Raises as :func:`encode_parts`: :class:`WireError` (``too_long``) for a
    payload over ``MAX_FRAME_PAYLOAD``, ValueError or TypeError for a field out of its
    range or of the wrong type, or an empty ``key``.
    """
    return b"".join(encode_parts(msg_type, session=session, sender=sender, shard=shard,
                                 iteration=iteration, channel=channel, block=block,
                                 count=count, parts=(payload,), flags=flags, key=key))


def decode_header(buf) -> Header:
    """Decode and check the fixed header at the start of ``buf``.

    Raises :class:`WireError` with reason ``short``, ``bad_magic``, ``bad_version``,
    ``bad_type``, ``bad_channel`` or ``too_long``; TypeError, in one line, for a ``buf``
    that is not bytes-like.
    """
    try:
        n = len(buf)
    except TypeError:
        raise TypeError(f"decode_header(buf): give a bytes-like object, not a "
                        f"{type(buf).__name__}") from None
    if n < HEADER_BYTES:
        raise WireError("short", f"{n} B < header {HEADER_BYTES} B")
    (magic, version, mtype, channel, flags, session, sender, shard, iteration, block,
     count, length) = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError("bad_magic", f"0x{magic:04x}")
    if version != VERSION:
        raise WireError("bad_version", str(version))
    if mtype not in _TYPES:
        raise WireError("bad_type", str(mtype))
    if channel >= MAX_CHANNELS:
        raise WireError("bad_channel", str(channel))
    if length > MAX_FRAME_PAYLOAD:
        raise WireError("too_long", str(length))
    return Header(mtype, channel, flags, session, sender, shard, iteration, block, count,
                  length)


_TYPES = frozenset(int(t) for t in MsgType)
_CODINGS = frozenset(int(c) for c in Coding)


def frame_size(h: Header) -> int:
    """Total bytes of the message whose header is ``h`` (header + payload + MAC)."""
    return HEADER_BYTES + h.length + (MAC_BYTES if h.flags & MAC_BIT else 0)


def decode(buf, key: bytes | None = None) -> tuple[Header, memoryview]:
    """Decode one whole message; return (header, payload view). Never copies the payload.

    ``buf`` must hold exactly one message. With ``key`` (1 to 64 bytes) a valid MAC is
    required. Raises :class:`WireError` (header reasons, plus ``bad_length``,
    ``no_mac``, ``bad_mac``); ValueError for an empty ``key`` (never read as no key),
    TypeError for one that is not bytes (:func:`check_key`), and for a ``buf`` that is
    not a C-contiguous bytes-like object.
    """
    try:
        mv = memoryview(buf).cast("B")
    except TypeError:
        raise TypeError(f"decode(buf): give one whole message as a C-contiguous "
                        f"bytes-like object, not a {type(buf).__name__}") from None
    h = decode_header(mv)
    if len(mv) != frame_size(h):
        raise WireError("bad_length", f"have {len(mv)} B, header says {frame_size(h)} B")
    end = HEADER_BYTES + h.length
    if key is not None:
        if type(key) is not bytes or not key:   # O(1): decode runs per datagram
            check_key(key)
        check_mac(mv, h, key)
    return h, mv[HEADER_BYTES:end]


def check_mac(mv: memoryview, h: Header, key: bytes) -> None:
    """Verify the MAC of the one whole message ``mv`` (header ``h``, length checked).

    Raises :class:`WireError` (``no_mac``, ``bad_mac``), ValueError for an empty
    ``key``. Receivers call it after the
    cheap checks (session, shard, sender, iteration window), so a stranger's message
    costs a header decode, not a keyed hash."""
    if not key:
        check_key(key)
    if not h.flags & MAC_BIT:
        raise WireError("no_mac")
    end = HEADER_BYTES + h.length
    if h.channel != 0:   # a UDP channel's datagram: the UDP MAC
        if not udpmac.match_one(udpmac.derive_keys(key), mv[:end + MAC_BYTES]):
            raise WireError("bad_mac")
    elif not hmac.compare_digest(mac_tag(key, mv[:end]), mv[end:]):
        raise WireError("bad_mac")


# ---------------------------------------------------------------------------------------
# Payload layouts
# ---------------------------------------------------------------------------------------

def pack_indexed_blocks(indices: np.ndarray, blocks: np.ndarray) -> bytes:
    """INDEXED BLOCKS payload: ``count`` big-endian u32 indices, then the blocks.

    ``indices``: (count,) integer numpy array; ``blocks``: (count, block_elems) float32.
    Raises as :func:`indexed_blocks_parts`.
    """
    return b"".join(indexed_blocks_parts(indices, blocks))


def indexed_blocks_parts(indices: np.ndarray, blocks: np.ndarray) -> tuple:
    """:func:`pack_indexed_blocks` as (indices bytes, blocks array) for
    :func:`encode_parts`: the blocks are not copied when already C-contiguous
    little-endian float32. Raises TypeError for ``indices`` that are not an integer
    numpy array, or ``blocks`` that is not a float32 numpy array (float64, int64,
    complex: nothing is cast); ValueError when ``blocks`` is not 2-D, when there is not
    one index per block, or for an index outside a u32 (0..2**32-1)."""
    _check_f4("blocks", blocks)
    _check_rows("blocks", blocks)
    indices = _check_indices(indices, blocks.shape[0])
    return indices.astype(">u4").tobytes(), np.ascontiguousarray(blocks, "<f4")


def coded_indexed_blocks_parts(indices: np.ndarray, payloads: np.ndarray) -> tuple:
    """A coded INDEXED BLOCKS payload (``--reliable-codec``; the header's ``coding``
    flags name the coding) as parts for :func:`encode_parts`: ``count`` big-endian u32
    indices, then the ``count`` coded blocks, ``payloads`` ((count, P) uint8, P =
    :func:`coded_payload_bytes`), not copied when C-contiguous. (A flat view: a
    memoryview cannot cast an empty 2-D array.) Raises as
    :func:`indexed_blocks_parts`, TypeError for ``payloads`` that is not a uint8 numpy
    array (nothing is cast: the bytes must be the coded payloads)."""
    if not isinstance(payloads, np.ndarray) or payloads.dtype != np.uint8:
        got = payloads.dtype if isinstance(payloads, np.ndarray) else type(payloads).__name__
        raise TypeError(f"payloads must be a uint8 numpy array (the coded blocks), got "
                        f"{got}")
    _check_rows("payloads", payloads)
    indices = _check_indices(indices, payloads.shape[0])
    return (indices.astype(">u4").tobytes(),
            np.ascontiguousarray(payloads, np.uint8).reshape(-1))


def unpack_indexed_blocks(payload: memoryview, count: int, block_elems: int,
                          coding: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_indexed_blocks` (``coding`` FP32) and of
    :func:`coded_indexed_blocks_parts` (a reduced ``coding``); returns views (indices
    (count,) >u4, blocks): (count, block_elems) float32, or (count, P) uint8 coded
    payloads for a reduced coding.

    Raises :class:`WireError`: ``bad_coding`` for a coding this version does not know,
    ``bad_length`` when the payload does not hold exactly ``count`` indices and blocks;
    TypeError for a ``count`` that is not an int (a bool, a str), ValueError for one
    that no header's u32 ``count`` holds (a negative one).
    """
    count = _field("count", count, 32)
    size = coded_payload_bytes(coding, block_elems)
    if size is None:
        raise WireError("bad_coding", f"BLOCKS coding {coding}")
    need = count * 4 + count * size
    if len(payload) != need:
        raise WireError("bad_length", f"BLOCKS payload {len(payload)} B, need {need} B")
    idx = np.frombuffer(payload, ">u4", count)
    if coding == Coding.FP32:
        data = np.frombuffer(payload, "<f4", count * block_elems, offset=count * 4)
        return idx, data.reshape(count, block_elems)
    data = np.frombuffer(payload, np.uint8, count * size, offset=count * 4)
    return idx, data.reshape(count, size)


def pack_end(counts) -> bytes:
    """END payload: MAX_CHANNELS big-endian u32 block counts, channel 0 first (the
    channels not given are 0).

    Raises TypeError for a count that is not an integer (1.5 is not truncated),
    ValueError for more than ``MAX_CHANNELS`` counts or a count outside a u32."""
    counts = list(counts)
    if len(counts) > MAX_CHANNELS:
        raise ValueError(f"{len(counts)} END counts: at most {MAX_CHANNELS}, one per channel")
    c = np.zeros(MAX_CHANNELS, ">u4")
    c[: len(counts)] = [_field(f"END count of channel {i}", v, 32)
                        for i, v in enumerate(counts)]
    return c.tobytes()


def unpack_end(payload: memoryview) -> np.ndarray:
    """Inverse of :func:`pack_end`; raises :class:`WireError` (``bad_length``)."""
    if len(payload) != MAX_CHANNELS * 4:
        raise WireError("bad_length", f"END payload {len(payload)} B")
    return np.frombuffer(payload, ">u4").astype(np.int64)


def pack_pull(aggregate: np.ndarray, received: np.ndarray) -> bytes:
    """PULL payload: the shard's aggregate (float32 LE), then the received bitmap
    (``np.packbits``, big bit order, one bit per block of the shard).

    ``aggregate``: the shard's n blocks, (n, E) or flat (n * E,); ``received``: (n,)
    bool, one per block (the header's ``count`` is its length, docs/wire.md "PULL").
    Raises TypeError for an ``aggregate`` that is not a float32 numpy array (float64,
    int64, complex: nothing is cast); ValueError, naming both shapes, for a
    ``received`` that is not 1-D or not one per block: of (n, E) rows, n of them; of a
    flat aggregate (whose E is not known here), a length that its size is not a whole
    multiple of (n * E with E >= 1; 0 values for 0 blocks)."""
    return b"".join(pull_parts(aggregate, received))


def _check_received(aggregate, received) -> None:
    """:func:`pack_pull`'s O(1) check of ``received`` against ``aggregate``."""
    n = received.size
    if received.ndim == 1 and (
            aggregate.shape[0] == n if aggregate.ndim == 2
            else (aggregate.size % n == 0 and aggregate.size >= n) if n
            else aggregate.size == 0):
        return
    raise ValueError(f"received must be one bool per block of the aggregate, (n,) for "
                     f"(n, E) or (n * E,) values, got received {received.shape} for "
                     f"aggregate {aggregate.shape}")


def pull_parts(aggregate: np.ndarray, received: np.ndarray) -> tuple:
    """:func:`pack_pull` as (aggregate array, bitmap bytes) for :func:`encode_parts`;
    the aggregate is not copied when already C-contiguous little-endian float32.
    Raises as :func:`pack_pull`."""
    _check_f4("aggregate", aggregate)
    agg = np.ascontiguousarray(aggregate, "<f4")
    received = np.asarray(received)
    _check_received(agg, received)
    return agg, np.packbits(received.astype(bool)).tobytes()


def unpack_pull(payload: memoryview, n_blocks: int, block_elems: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_pull`: (aggregate (n_blocks*elems,) f32, received (n_blocks,) bool)."""
    n_vals = n_blocks * block_elems
    need = n_vals * 4 + (n_blocks + 7) // 8
    if len(payload) != need:
        raise WireError("bad_length", f"PULL payload {len(payload)} B, need {need} B")
    agg = np.frombuffer(payload, "<f4", n_vals)
    bits = np.unpackbits(np.frombuffer(payload, np.uint8, offset=n_vals * 4))[:n_blocks]
    return agg, bits.astype(bool)


def check_coding(coding) -> None:
    """Raise TypeError for a ``coding`` that is not an int (a bool, a float: ``True``
    was taken as FP16) and ValueError for an int that is no :class:`Coding`, each in
    one line naming it; O(1)."""
    if type(coding) is not int and type(coding) is not Coding and (
            isinstance(coding, bool) or not isinstance(coding, numbers.Integral)):
        raise TypeError(f"coding must be a Coding (an int), got {type(coding).__name__} "
                        f"{coding!r}")
    if coding not in _CODINGS:
        raise ValueError(f"coding {coding!r} is not a Coding (0..{max(_CODINGS)}; "
                         "receivers refuse it: bad_coding)")


def coded_pull_parts(plain: np.ndarray, payloads: np.ndarray, received: np.ndarray,
                     coded: np.ndarray) -> tuple:
    """A coded PULL's payload (docs/wire.md, "PULL"; the header's ``coding`` flags name
    the coding of the coded blocks) as parts for :func:`encode_parts`: ``plain``
    ((n - m, E) float32: the blocks not coded, in block order), ``payloads`` ((m, P)
    uint8: the coded ones, in block order, P = ``coded_payload_bytes``), then the
    worker's ``received`` bitmap and the ``coded`` bitmap ((n,) bool each, packed as
    :func:`pack_pull`'s). Nothing is copied but the bitmaps. (Flat views: a memoryview
    cannot cast an empty 2-D array, which is what all blocks coded, or none, give.)

    Raises ValueError, naming the argument and both numbers, for a ``coded`` that is
    not 1-D, a ``received`` not of its shape, ``plain`` or ``payloads`` not 2-D, or
    row counts that are not what ``coded`` says: m rows of ``payloads`` for its m set
    bits, n - m of ``plain`` (a receiver refuses such a PULL as ``bad_length``)."""
    _check_coded_pull(plain, payloads, received, coded)
    return (np.ascontiguousarray(plain, "<f4").reshape(-1),
            np.ascontiguousarray(payloads, np.uint8).reshape(-1),
            np.packbits(received.astype(bool)).tobytes(),
            np.packbits(coded.astype(bool)).tobytes())


def _check_coded_pull(plain, payloads, received, coded) -> None:
    """:func:`coded_pull_parts`' checks: O(1) but one count of ``coded``'s set bits."""
    coded, received = np.asarray(coded), np.asarray(received)
    plain, payloads = np.asarray(plain), np.asarray(payloads)   # no copy of an array
    if coded.ndim != 1:
        raise ValueError(f"coded must be (n,) bool, one per block, got coded {coded.shape}")
    if received.shape != coded.shape:
        raise ValueError(f"received must be one bool per block as coded is, got received "
                         f"{received.shape} for coded {coded.shape}")
    if plain.ndim != 2 or payloads.ndim != 2:
        name, a = ("plain", plain) if plain.ndim != 2 else ("payloads", payloads)
        raise ValueError(f"{name} must be 2-D, one row per block, got {name} "
                         f"{a.shape}")
    m, n = int(np.count_nonzero(coded)), coded.size
    if payloads.shape[0] != m:
        raise ValueError(f"payloads must be one row per coded block, got "
                         f"{payloads.shape[0]} rows for {m} set bits of coded")
    if plain.shape[0] != n - m:
        raise ValueError(f"plain must be one row per block not coded, got "
                         f"{plain.shape[0]} rows for {n - m} of coded's {n} blocks "
                         f"(plain + payloads rows must be len(coded) {n})")


def unpack_coded_pull(payload: memoryview, n_blocks: int, block_elems: int, coding: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`coded_pull_parts`: (plain ((n - m) * E,) f32 view, payloads
    (m, P) uint8 view, received (n,) bool, coded (n,) bool), m = the coded bitmap's
    count of set bits among its first n (padding bits are ignored, as the received
    bitmap's). Raises :class:`WireError`: ``bad_coding`` for a coding that is FP32 or
    unknown, ``bad_length`` when the payload is not exactly what the coded bitmap
    (the last ceil(n/8) bytes) announces."""
    size = coded_payload_bytes(coding, block_elems)
    if coding == Coding.FP32 or size is None:
        raise WireError("bad_coding", f"PULL coding {coding}")
    nbits = (n_blocks + 7) // 8
    if len(payload) < 2 * nbits:
        raise WireError("bad_length", f"coded PULL payload {len(payload)} B")
    tail = np.frombuffer(payload, np.uint8, 2 * nbits, len(payload) - 2 * nbits)
    bits = np.unpackbits(tail).reshape(2, -1)[:, :n_blocks].astype(bool)
    m = int(np.count_nonzero(bits[1]))
    plain_vals = (n_blocks - m) * block_elems
    need = 4 * plain_vals + m * size + 2 * nbits
    if len(payload) != need:
        raise WireError("bad_length", f"coded PULL payload {len(payload)} B, its coded "
                        f"bitmap says {need} B")
    plain = np.frombuffer(payload, "<f4", plain_vals)
    coded_rows = np.frombuffer(payload, np.uint8, m * size, 4 * plain_vals)
    return plain, coded_rows.reshape(m, size), bits[0], bits[1]


def encode_block_datagrams(*, session: int, sender: int, shard: int, iteration: int,
                           channel: int, indices: np.ndarray, blocks: np.ndarray,
                           key: bytes | None = None, coding: int = Coding.FP32
                           ) -> np.ndarray:
    """Encode one UDP datagram per block, vectorised.

    ``indices``: (n,) int; ``blocks``: (n, block_elems) float32, or with a ``coding``
    other than FP32 the coded payloads, (n, coded_payload_bytes) uint8 (dgt.codec).
    Returns a (n, size) uint8 array; row i is the datagram for block ``indices[i]``. All
    rows have one size, which is what UDP GSO needs. With ``key`` (1 to 64 bytes) every
    row carries the UDP MAC.

    Raises (O(1) checks and one vectorised pass over ``indices``, before any byte is
    written) ValueError, naming the field and its range: ``channel`` 0 (the reliable
    channel: receivers refuse a UDP datagram on it, ``bad_udp_message``) or over 7 (a
    shard takes 1..7), ``coding`` not a :class:`Coding`, ``session``, ``sender``,
    ``shard`` or ``iteration`` out of its header field's range, an index outside a u32,
    not one index per block, ``blocks`` not 2-D or with no value (a coded row of a size
    no block has in that coding), a datagram over :data:`MAX_UDP_PAYLOAD` (naming both
    sizes), or an empty ``key``; TypeError for a field or ``indices`` that is not an
    integer (array), a ``coding`` that is a bool or not an int, a ``key`` that is not
    bytes, ``blocks`` that is not a numpy array (a torch tensor) or of a dtype other
    than the coding's (float32 for FP32, uint8 for a reduced coding: nothing is cast),
    naming the dtype it needs.
    """
    if not (type(channel) is type(session) is type(sender) is type(shard)
            is type(iteration) is int and 0 < channel < MAX_CHANNELS
            and 0 <= session <= 0xFFFFFFFFFFFFFFFF and 0 <= sender <= 0xFFFF
            and 0 <= shard <= 0xFFFF and 0 <= iteration <= 0xFFFFFFFF):
        if _field("channel", channel, 8) >= MAX_CHANNELS:   # name the field
            raise ValueError(f"channel {channel} is out of range: 0..{MAX_CHANNELS - 1} "
                             "(decoders refuse it: bad_channel; a shard takes 1..7 only)")
        if channel == 0:
            raise ValueError("channel 0 is the reliable (TCP) channel: a UDP block "
                             f"datagram goes on 1..{MAX_CHANNELS - 1} (receivers refuse "
                             "it: bad_udp_message)")
        _field("session", session, 64)
        _field("sender", sender, 16)
        _field("shard", shard, 16)
        _field("iteration", iteration, 32)
    check_coding(coding)
    check_key(key)
    if not isinstance(blocks, np.ndarray):
        raise TypeError(f"blocks must be a numpy array, (n, E) float32 or (n, P) uint8 "
                        f"coded payloads, got {type(blocks).__name__}")
    _check_rows("blocks", blocks)
    if coding == Coding.FP32:   # f4 of either byte order (made <f4 below)
        if blocks.dtype.kind != "f" or blocks.dtype.itemsize != 4:
            raise TypeError(f"blocks must be float32 for coding FP32, got {blocks.dtype}")
    elif blocks.dtype != np.uint8:   # never cast: the bytes must be the coded payloads
        raise TypeError(f"blocks must be uint8 for coding {Coding(coding).name}, got "
                        f"{blocks.dtype}")
    indices = _check_indices(indices, blocks.shape[0])
    if coding == Coding.FP32:
        n, elems = blocks.shape
        plen = elems * 4
        payload = np.ascontiguousarray(blocks, "<f4").view(np.uint8).reshape(n, plen)
    else:
        n, plen = blocks.shape
        payload = blocks
    if plen < coded_payload_bytes(coding, 1) or (
            coding in (Coding.FP16, Coding.BF16) and plen % 2):   # block_payload_problem
        raise ValueError(f"blocks: a row of {plen} B is no block coded as "
                         f"{Coding(coding).name} (docs/wire.md, Block codings)")
    size = HEADER_BYTES + plen + (MAC_BYTES if key is not None else 0)
    if size > MAX_UDP_PAYLOAD:
        raise ValueError(f"blocks: a datagram of {size} B ({plen} B of block) is over the "
                         f"UDP maximum of {MAX_UDP_PAYLOAD} B")
    out = np.empty((n, size), np.uint8)
    hdr = np.empty(n, HEADER_DTYPE)
    hdr["magic"] = MAGIC
    hdr["version"] = VERSION
    hdr["type"] = MsgType.BLOCKS
    hdr["channel"] = channel
    hdr["flags"] = (MAC_BIT if key is not None else 0) | (int(coding) << CODING_SHIFT)
    hdr["session"] = session
    hdr["sender"] = sender
    hdr["shard"] = shard
    hdr["iteration"] = iteration
    hdr["block"] = indices
    hdr["count"] = 1
    hdr["length"] = plen
    out[:, :HEADER_BYTES] = hdr.view(np.uint8).reshape(n, HEADER_BYTES)
    out[:, HEADER_BYTES:HEADER_BYTES + plen] = payload
    if key is not None:
        udpmac.sign_rows(udpmac.derive_keys(key), out)   # the whole batch in one call (docs/wire.md, "UDP MAC")
    return out
