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
    ..  16   mac          iff flags & MAC: over header+payload, keyed BLAKE2b-128 on
                          TCP, the Carter-Wegman UDP MAC on UDP (:class:`UdpMac`)

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
import struct
from dataclasses import dataclass

import numpy as np

from .channels import MAX_UDP_CHANNELS

MAGIC = 0x4447
VERSION = 1
MAC_BYTES = 16
MAX_CHANNELS = 1 + MAX_UDP_CHANNELS  # channel 0 (reliable) + the UDP channels
#: Upper bound on one TCP frame's payload; a larger length is a protocol error, not an
#: allocation. 256 MiB covers a PULL of a 64M-parameter shard.
MAX_FRAME_PAYLOAD = 256 << 20

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


class Coding(enum.IntEnum):
    """How a UDP BLOCKS payload codes its block: flags bits 2-4 (``CODING_MASK``).
    Source: docs/wire.md, "Block codings". The name in lower case is the
    ``--band-codec`` word (``fp32``, ``fp16``, ``bf16``, ``int8``, ``int4``)."""

    FP32 = 0   # E x f32 LE: the block as it is (every message but coded UDP BLOCKS)
    FP16 = 1   # E x IEEE-754 binary16 LE, round to nearest even
    BF16 = 2   # E x bfloat16 LE (the top 16 bits of the f32), round to nearest even
    INT8 = 3   # f32 LE scale s, then E x int8 q: value = q * s (symmetric, per block)
    INT4 = 4   # f32 LE scale s, then ceil(E/2) bytes of two 4-bit q (-7..7): q * s


#: flags bits 2-4 carry the coding of a UDP BLOCKS payload (``Coding``)
CODING_SHIFT = 2
CODING_MASK = 0x07 << CODING_SHIFT


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


# ---------------------------------------------------------------------------------------
# The UDP MAC: a Carter-Wegman MAC (docs/wire.md, "The UDP MAC")
# ---------------------------------------------------------------------------------------

#: the prime of the linear hash; the hash of a message is 4 values mod p (a 16-byte tag)
UDP_MAC_PRIME = (1 << 26) - 5
UDP_MAC_ROWS = 4
#: blocks per pad keystream (one PRF call serves this many block indices)
UDP_MAC_CHUNK = 256
#: the longest message the UDP MAC covers (header + payload, bytes)
UDP_MAC_MAX_BYTES = 65535
#: columns of the hash key: the length, then one per 16-bit word
UDP_MAC_COLUMNS = 1 + (UDP_MAC_MAX_BYTES + 1) // 2
#: products a float64 sum may hold and stay exact: 2048 * (2^16 - 1) * (p - 1) < 2^53
_EXACT_TERMS = 2048
_NONCE = struct.Struct("!QHHIBBI")   # session sender shard iteration channel type chunk
_TAG = struct.Struct("<4I")


def _uniform_mod_p(xof, n: int) -> np.ndarray:
    """The first ``n`` values of ``xof`` (a SHAKE object) read as u32 LE words, each
    masked to its low 26 bits and kept only when below ``UDP_MAC_PRIME`` (rejection
    sampling: uniform in [0, p)). Returns (n,) uint32."""
    m = n + 64
    while True:   # a shortfall needs over 64 rejections (p = 2^26 - 5): never seen
        v = np.frombuffer(xof.digest(4 * m), "<u4") & np.uint32((1 << 26) - 1)
        v = v[v < UDP_MAC_PRIME]
        if v.size >= n:
            return v[:n]
        m *= 2


class UdpMac:
    """The MAC of UDP datagrams for one job key: a Carter-Wegman MAC (Wegman and
    Carter, JCSS 1981): tag = (H_K(m) + pad(nonce)) mod p, row by row.

    - H_K: the linear hash over GF(p), p = 2^26 - 5, of the message's 16-bit LE words
      and its length, with a secret 4 x ``UDP_MAC_COLUMNS`` matrix K: for two different
      messages of at most 65,535 bytes, H_K(m) - H_K(m') is uniform in GF(p)^4, so a
      forgery succeeds with probability at most p^-4 < 2^-103 per try.
    - pad: 4 values uniform in [0, p), from SHAKE128 keyed with the pad key over the
      nonce (session, sender, shard, iteration, channel, type, block >> 8): one PRF
      call gives the pads of 256 block indices.

    The hash is computed exactly in float64 BLAS (every partial sum is an integer below
    2^53), for a whole GRO run at once. Keys: BLAKE2b-256 of the job key with
    personalisation ``dgt-udp-mac-hash`` (K, expanded by SHAKE128) and
    ``dgt-udp-mac-pads`` (the pad key). Every byte layout is in docs/wire.md, "The UDP
    MAC". Not thread-safe (a chunk cache): one per key, from :func:`udp_mac`."""

    #: pad chunks kept (4 KiB each), so the parts of one push share their pads
    CACHE_CHUNKS = 4096

    def __init__(self, key: bytes):
        hash_key = hashlib.blake2b(digest_size=32, key=key,
                                   person=b"dgt-udp-mac-hash").digest()
        self.pad_key = hashlib.blake2b(digest_size=32, key=key,
                                       person=b"dgt-udp-mac-pads").digest()
        k = _uniform_mod_p(hashlib.shake_128(hash_key), UDP_MAC_ROWS * UDP_MAC_COLUMNS)
        #: (UDP_MAC_COLUMNS, 4) float64: row j is column j of K (j = 0: the length)
        self.matrix = k.reshape(UDP_MAC_COLUMNS, UDP_MAC_ROWS).astype(np.float64)
        self._chunks: dict[bytes, np.ndarray] = {}

    # -- pads ---------------------------------------------------------------------------
    def pad_chunk(self, session: int, sender: int, shard: int, iteration: int,
                  channel: int, msg_type: int, chunk: int) -> np.ndarray:
        """(UDP_MAC_CHUNK, 4) uint32: the pads of blocks ``chunk * 256 + i``, values in
        [0, p). Read-only (cached)."""
        nonce = _NONCE.pack(session, sender, shard, iteration, channel, msg_type, chunk)
        pads = self._chunks.get(nonce)
        if pads is None:
            pads = _uniform_mod_p(hashlib.shake_128(self.pad_key + nonce),
                                  UDP_MAC_CHUNK * UDP_MAC_ROWS).reshape(UDP_MAC_CHUNK,
                                                                        UDP_MAC_ROWS)
            pads.flags.writeable = False
            if len(self._chunks) >= self.CACHE_CHUNKS:
                del self._chunks[next(iter(self._chunks))]   # the oldest
            self._chunks[nonce] = pads
        return pads

    def pad_range(self, session: int, sender: int, shard: int, iteration: int,
                  channel: int, msg_type: int, lo: int, hi: int) -> np.ndarray:
        """(hi - lo, 4) uint32: the pads of blocks ``lo .. hi - 1``."""
        c0, c1 = lo // UDP_MAC_CHUNK, (hi - 1) // UDP_MAC_CHUNK
        parts = [self.pad_chunk(session, sender, shard, iteration, channel, msg_type, c)
                 for c in range(c0, c1 + 1)]
        pads = parts[0] if len(parts) == 1 else np.concatenate(parts)
        off = lo - c0 * UDP_MAC_CHUNK
        return pads[off:off + hi - lo]

    # -- the hash -----------------------------------------------------------------------
    #: scratch columns before the words: a constant 1 (times the length's term) and the
    #: 4 pads (times the identity), so one matrix product adds them
    HEAD = 1 + UDP_MAC_ROWS

    @staticmethod
    def scratch(rows: int, words: int) -> np.ndarray:
        """A float64 buffer for :meth:`sums` of up to ``rows`` messages of up to
        ``words`` 16-bit words (+ an odd byte): column 0 holds 1, never written again."""
        out = np.empty((rows, UdpMac.HEAD + words + 1))
        out[:, 0] = 1.0
        return out

    @functools.lru_cache(maxsize=16)
    def _operand(self, length: int) -> np.ndarray:
        """(HEAD + ceil(L/2), 4) float64, contiguous: the length's term, the identity
        (for the pads), then K's word columns, for a message of ``length`` bytes."""
        words = (length + 1) // 2
        return np.concatenate([self.matrix[0:1] * length, np.eye(UDP_MAC_ROWS),
                               self.matrix[1:1 + words]])

    def sums(self, msgs: np.ndarray, pads=None, scratch: np.ndarray | None = None
             ) -> np.ndarray:
        """(n, 4) float64 integers below 2^53, congruent mod p to H_K of each message
        plus its pad. ``msgs``: (n, L) uint8, L <= ``UDP_MAC_MAX_BYTES``, last axis
        contiguous (rows of a GRO run, a view). ``pads``: (n, 4) values in [0, p), or a
        callable that writes them into the (n, 4) float64 view it is given, or None (no
        pad). ``scratch``: from :meth:`scratch`, large enough, else one is allocated.
        Raises ValueError for L too long."""
        n, length = msgs.shape
        if length > UDP_MAC_MAX_BYTES:
            raise ValueError(f"UDP MAC: message of {length} B > {UDP_MAC_MAX_BYTES} B")
        w, odd = length // 2, length % 2
        words = msgs[:, :2 * w].view("<u2")
        head = self.HEAD
        if head + w + odd > _EXACT_TERMS:   # long: a sum mod p per 2,046 words
            h = np.zeros((n, UDP_MAC_ROWS))
            seg = _EXACT_TERMS - 2
            for a in range(0, w, seg):
                b = min(a + seg, w)
                part = words[:, a:b].astype(np.float64) @ self.matrix[1 + a:1 + b]
                h += np.fmod(part, UDP_MAC_PRIME)
            h += self.matrix[0] * length
            if odd:
                h += msgs[:, -1:] * self.matrix[1 + w]
            if pads is not None:
                add = np.empty((n, UDP_MAC_ROWS))
                pads(add) if callable(pads) else np.copyto(add, pads, casting="unsafe")
                h += add
            return h
        if scratch is None or scratch.shape[0] < n or scratch.shape[1] < head + w + odd:
            scratch = self.scratch(n, w)
        part = scratch[:n, :head + w + odd]
        if pads is None:
            part[:, 1:head] = 0.0
        elif callable(pads):
            pads(part[:, 1:head])
        else:
            np.copyto(part[:, 1:head], pads, casting="unsafe")
        np.copyto(part[:, head:head + w], words, casting="unsafe")
        if odd:   # the last byte is a word of its own (a zero high byte)
            part[:, head + w] = msgs[:, -1]
        return part @ self._operand(length)

    def tags(self, msgs: np.ndarray, pads: np.ndarray) -> np.ndarray:
        """(n, 16) uint8: the tags of ``msgs`` ((n, L) uint8) with ``pads`` ((n, 4)
        values in [0, p)): 4 x u32 LE, (H_K(m) + pad) mod p."""
        h = self.sums(msgs, pads).astype(np.int64) % UDP_MAC_PRIME
        return h.astype("<u4").view(np.uint8)

    def match(self, rows: np.ndarray, pads, scratch: np.ndarray | None = None
              ) -> np.ndarray:
        """(n,) bool: which of ``rows`` ((n, L + 16) uint8, last axis contiguous: whole
        messages ending in their tags) carry the tag of their message and ``pads``
        ((n, 4), or a callable: see :meth:`sums`). Every value of every tag is compared
        (no early exit); a tag value >= p never matches."""
        good = self.match_all(rows, pads, scratch)
        return np.ones(rows.shape[0], bool) if good is None else good

    def match_all(self, rows: np.ndarray, pads, scratch: np.ndarray | None = None):
        """:meth:`match`, but None when every row matches (the usual case: one
        reduction less)."""
        end = rows.shape[1] - MAC_BYTES
        if end > UDP_MAC_MAX_BYTES:
            return np.zeros(rows.shape[0], bool)
        h = self.sums(rows[:, :end], pads, scratch).astype(np.int64)
        h %= UDP_MAC_PRIME   # (an integer remainder: libm's fmod is slower)
        eq = h == rows[:, end:].view("<u4")
        return None if eq.all() else eq.all(axis=1)

    def match_one(self, buf, pad) -> bool:
        """:meth:`match` for one message ``buf`` (bytes-like: the message and its tag)
        and ``pad`` (4 ints or a (4,) array), without per-row array work."""
        end = len(buf) - MAC_BYTES
        if end % 2 or not 0 < end // 2 <= _EXACT_TERMS - 2:
            return bool(self.match(np.frombuffer(buf, np.uint8).reshape(1, -1),
                                   np.asarray(pad).reshape(1, UDP_MAC_ROWS))[0])
        w = end // 2
        # exact: the sum of 2046 products, the length's and the pad stay below 2^53
        s0, s1, s2, s3 = (self._columns(w) @ np.frombuffer(buf, "<u2", w)).tolist()
        k0, k1, k2, k3 = self._length_terms(end)
        r0, r1, r2, r3 = pad if type(pad) is tuple else pad.tolist()
        t0, t1, t2, t3 = _TAG.unpack_from(buf, end)
        p = float(UDP_MAC_PRIME)
        return not (abs((s0 + k0 + r0) % p - t0) + abs((s1 + k1 + r1) % p - t1)
                    + abs((s2 + k2 + r2) % p - t2) + abs((s3 + k3 + r3) % p - t3))

    @functools.lru_cache(maxsize=16)
    def _columns(self, words: int) -> np.ndarray:
        """(4, words) float64, contiguous: K's word columns for one message."""
        return np.ascontiguousarray(self.matrix[1:1 + words].T)

    @functools.lru_cache(maxsize=16)
    def _length_terms(self, length: int) -> tuple:
        return tuple(float(k * length) for k in self.matrix[0])


@functools.lru_cache(maxsize=8)
def udp_mac(key: bytes) -> UdpMac:
    """The :class:`UdpMac` of job key ``key`` (the UTF-8 bytes of ``--secret``), made once
    per key (the hash matrix: about 1 MiB, derived in a few ms).

    The first one also makes this process's BLAS single-threaded (threadpoolctl): the
    hash's matrix products are one GRO run each, too small to share, and a BLAS that
    hands them to a second thread leaves that thread spinning after each call, which on
    a loaded host slowed the whole keyed receive path by half (docs/security.md)."""
    _single_threaded_blas()
    return UdpMac(key)


@functools.lru_cache(maxsize=1)
def _single_threaded_blas() -> None:
    from threadpoolctl import threadpool_limits
    threadpool_limits(1, user_api="blas")


def encode_datagram(msg_type: int, *, session: int, sender: int, shard: int = 0,
                    iteration: int = 0, channel: int = 0, block: int = 0, count: int = 0,
                    payload=b"", flags: int = 0, key: bytes | None = None) -> bytes:
    """:func:`encode` for a UDP datagram: with ``key`` the MAC is the UDP MAC
    (:class:`UdpMac`), not BLAKE2b. Raises :class:`WireError` (``too_long``) for a
    message over ``UDP_MAC_MAX_BYTES``."""
    if key is None:
        return encode(msg_type, session=session, sender=sender, shard=shard,
                      iteration=iteration, channel=channel, block=block, count=count,
                      payload=payload, flags=flags)
    n = memoryview(payload).nbytes
    if HEADER_BYTES + n > UDP_MAC_MAX_BYTES:
        raise WireError("too_long", f"datagram {HEADER_BYTES + n} B > {UDP_MAC_MAX_BYTES} B")
    msg = HEADER.pack(MAGIC, VERSION, msg_type, channel, flags | Flag.MAC, session, sender,
                      shard, iteration, block, count, n) + bytes(payload)
    mac = udp_mac(key)
    pads = mac.pad_chunk(session, sender, shard, iteration, channel, msg_type,
                         block // UDP_MAC_CHUNK)[block % UDP_MAC_CHUNK]
    return msg + mac.tags(np.frombuffer(msg, np.uint8)[None], pads[None]).tobytes()


def check_datagram_mac(buf, h: Header, key: bytes) -> None:
    """Verify the UDP MAC of the one whole datagram ``buf`` (header ``h``, length
    checked). Raises :class:`WireError` (``no_mac``, ``bad_mac``)."""
    if not h.flags & Flag.MAC:
        raise WireError("no_mac")
    mac = udp_mac(key)
    pad = mac.pad_chunk(h.session, h.sender, h.shard, h.iteration, h.channel, h.type,
                        h.block // UDP_MAC_CHUNK)[h.block % UDP_MAC_CHUNK]
    if not mac.match_one(memoryview(buf).cast("B"), pad):
        raise WireError("bad_mac")


def decode_datagram(buf, key: bytes | None = None) -> tuple[Header, memoryview]:
    """:func:`decode` for a UDP datagram: with ``key`` a valid UDP MAC is required."""
    h, payload = decode(buf)
    if key is not None:
        check_datagram_mac(buf, h, key)
    return h, payload


def encode_parts(msg_type: int, *, session: int, sender: int, shard: int = 0,
                 iteration: int = 0, channel: int = 0, block: int = 0, count: int = 0,
                 parts=(), flags: int = 0, key: bytes | None = None) -> list:
    """Encode one message as a list of buffers (header, payload parts [, MAC]) for
    scatter-gather output (``transport.writelines``, ``sendmsg``): the payload parts are
    not copied. The caller must not modify them until the transport has sent them.

    ``parts``: bytes-like objects (numpy arrays included) whose concatenation is the
    payload. With ``key`` the MAC flag is set and a tag is appended. Raises
    :class:`WireError` (``too_long``) for a payload over ``MAX_FRAME_PAYLOAD``.
    """
    views = [memoryview(p).cast("B") for p in parts]
    n = sum(v.nbytes for v in views)
    if n > MAX_FRAME_PAYLOAD:
        raise WireError("too_long", f"payload {n} B > {MAX_FRAME_PAYLOAD} B")
    if key is not None:
        flags |= Flag.MAC
    head = HEADER.pack(MAGIC, VERSION, msg_type, channel, flags, session, sender, shard,
                       iteration, block, count, n)
    if key is None:
        return [head, *views]
    h = keyed_state(key).copy()
    h.update(head)
    for v in views:
        h.update(v)
    return [head, *views, h.digest()]


def encode(msg_type: int, *, session: int, sender: int, shard: int = 0, iteration: int = 0,
           channel: int = 0, block: int = 0, count: int = 0, payload=b"",
           flags: int = 0, key: bytes | None = None) -> bytes:
    """Encode one message (header + payload [+ MAC]) to bytes.

    ``payload`` is any bytes-like object. With ``key`` the MAC flag is set and a tag is
    appended. Raises :class:`WireError` (``too_long``) for a payload over
    ``MAX_FRAME_PAYLOAD``.
    """
    return b"".join(encode_parts(msg_type, session=session, sender=sender, shard=shard,
                                 iteration=iteration, channel=channel, block=block,
                                 count=count, parts=(payload,), flags=flags, key=key))


def decode_header(buf) -> Header:
    """Decode and check the fixed header at the start of ``buf``.

    Raises :class:`WireError` with reason ``short``, ``bad_magic``, ``bad_version``,
    ``bad_type``, ``bad_channel`` or ``too_long``.
    """
    if len(buf) < HEADER_BYTES:
        raise WireError("short", f"{len(buf)} B < header {HEADER_BYTES} B")
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


def frame_size(h: Header) -> int:
    """Total bytes of the message whose header is ``h`` (header + payload + MAC)."""
    return HEADER_BYTES + h.length + (MAC_BYTES if h.flags & Flag.MAC else 0)


def decode(buf, key: bytes | None = None) -> tuple[Header, memoryview]:
    """Decode one whole message; return (header, payload view). Never copies the payload.

    ``buf`` must hold exactly one message. With ``key`` a valid MAC is required.
    Raises :class:`WireError` (header reasons, plus ``bad_length``, ``no_mac``,
    ``bad_mac``).
    """
    mv = memoryview(buf).cast("B")
    h = decode_header(mv)
    if len(mv) != frame_size(h):
        raise WireError("bad_length", f"have {len(mv)} B, header says {frame_size(h)} B")
    end = HEADER_BYTES + h.length
    if key is not None:
        check_mac(mv, h, key)
    return h, mv[HEADER_BYTES:end]


def check_mac(mv: memoryview, h: Header, key: bytes) -> None:
    """Verify the MAC of the one whole message ``mv`` (header ``h``, length checked).

    Raises :class:`WireError` (``no_mac``, ``bad_mac``). Receivers call it after the
    cheap checks (session, shard, sender, iteration window), so a stranger's message
    costs a header decode, not a keyed hash."""
    if not h.flags & Flag.MAC:
        raise WireError("no_mac")
    end = HEADER_BYTES + h.length
    if not hmac.compare_digest(mac_tag(key, mv[:end]), mv[end:]):
        raise WireError("bad_mac")


# ---------------------------------------------------------------------------------------
# Payload layouts
# ---------------------------------------------------------------------------------------

def pack_indexed_blocks(indices: np.ndarray, blocks: np.ndarray) -> bytes:
    """INDEXED BLOCKS payload: ``count`` big-endian u32 indices, then the blocks.

    ``indices``: (count,) integer; ``blocks``: (count, block_elems) float32.
    """
    return b"".join(indexed_blocks_parts(indices, blocks))


def indexed_blocks_parts(indices: np.ndarray, blocks: np.ndarray) -> tuple:
    """:func:`pack_indexed_blocks` as (indices bytes, blocks array) for
    :func:`encode_parts`: the blocks are not copied when already C-contiguous
    little-endian float32."""
    return indices.astype(">u4").tobytes(), np.ascontiguousarray(blocks, "<f4")


def unpack_indexed_blocks(payload: memoryview, count: int, block_elems: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_indexed_blocks`; returns views (indices, (count, elems)).

    Raises :class:`WireError` (``bad_length``) when the payload does not hold exactly
    ``count`` indices and blocks.
    """
    need = count * 4 + count * block_elems * 4
    if len(payload) != need:
        raise WireError("bad_length", f"BLOCKS payload {len(payload)} B, need {need} B")
    idx = np.frombuffer(payload, ">u4", count)
    data = np.frombuffer(payload, "<f4", count * block_elems, offset=count * 4)
    return idx, data.reshape(count, block_elems)


def pack_end(counts) -> bytes:
    """END payload: MAX_CHANNELS big-endian u32 block counts, channel 0 first."""
    c = np.zeros(MAX_CHANNELS, ">u4")
    c[: len(counts)] = counts
    return c.tobytes()


def unpack_end(payload: memoryview) -> np.ndarray:
    """Inverse of :func:`pack_end`; raises :class:`WireError` (``bad_length``)."""
    if len(payload) != MAX_CHANNELS * 4:
        raise WireError("bad_length", f"END payload {len(payload)} B")
    return np.frombuffer(payload, ">u4").astype(np.int64)


def pack_pull(aggregate: np.ndarray, received: np.ndarray) -> bytes:
    """PULL payload: the shard's aggregate (float32 LE), then the received bitmap
    (``np.packbits``, big bit order, one bit per block of the shard)."""
    return b"".join(pull_parts(aggregate, received))


def pull_parts(aggregate: np.ndarray, received: np.ndarray) -> tuple:
    """:func:`pack_pull` as (aggregate array, bitmap bytes) for :func:`encode_parts`;
    the aggregate is not copied when already C-contiguous little-endian float32."""
    return (np.ascontiguousarray(aggregate, "<f4"),
            np.packbits(received.astype(bool)).tobytes())


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


def encode_block_datagrams(*, session: int, sender: int, shard: int, iteration: int,
                           channel: int, indices: np.ndarray, blocks: np.ndarray,
                           key: bytes | None = None, coding: int = Coding.FP32
                           ) -> np.ndarray:
    """Encode one UDP datagram per block, vectorised.

    ``indices``: (n,) int; ``blocks``: (n, block_elems) float32, or with a ``coding``
    other than FP32 the coded payloads, (n, coded_payload_bytes) uint8 (dgt.codec).
    Returns a (n, size) uint8 array; row i is the datagram for block ``indices[i]``. All
    rows have one size, which is what UDP GSO needs.
    """
    if coding == Coding.FP32:
        n, elems = blocks.shape
        plen = elems * 4
        payload = np.ascontiguousarray(blocks, "<f4").view(np.uint8).reshape(n, plen)
    else:
        n, plen = blocks.shape
        payload = blocks
    size = HEADER_BYTES + plen + (MAC_BYTES if key else 0)
    out = np.empty((n, size), np.uint8)
    hdr = np.empty(n, HEADER_DTYPE)
    hdr["magic"] = MAGIC
    hdr["version"] = VERSION
    hdr["type"] = MsgType.BLOCKS
    hdr["channel"] = channel
    hdr["flags"] = (Flag.MAC if key else 0) | (int(coding) << CODING_SHIFT)
    hdr["session"] = session
    hdr["sender"] = sender
    hdr["shard"] = shard
    hdr["iteration"] = iteration
    hdr["block"] = indices
    hdr["count"] = 1
    hdr["length"] = plen
    out[:, :HEADER_BYTES] = hdr.view(np.uint8).reshape(n, HEADER_BYTES)
    out[:, HEADER_BYTES:HEADER_BYTES + plen] = payload
    if key:   # the UDP MAC, for all of them at once
        if HEADER_BYTES + plen > UDP_MAC_MAX_BYTES:
            raise WireError("too_long", f"datagram {HEADER_BYTES + plen} B > "
                            f"{UDP_MAC_MAX_BYTES} B")
        mac = udp_mac(key)
        idx = np.asarray(indices, np.int64)
        if n:
            lo, hi = int(idx.min()), int(idx.max()) + 1
            pads = mac.pad_range(session, sender, shard, iteration, channel,
                                 MsgType.BLOCKS, lo, hi)[idx - lo]
            out[:, HEADER_BYTES + plen:] = mac.tags(out[:, :HEADER_BYTES + plen], pads)
    return out
