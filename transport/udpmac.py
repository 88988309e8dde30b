"""The UDP MAC (docs/wire.md, "UDP MAC"): what a datagram on a UDP channel carries
with ``--secret``, in place of the keyed BLAKE2b-128 of the TCP frames.

A flood of forged datagrams is paid for per datagram, and one keyed BLAKE2b call per
datagram costs about as much as the whole receive path without a secret
(docs/security.md, "Receive path: the cost of the MAC"). This MAC hashes the payload
with NH under four Toeplitz-shifted keys, the hash of UMAC (Black, Halevi, Krawczyk,
Krovetz, Rogaway, CRYPTO '99; RFC 4418), then takes SipHash-2-4-128 of the header and
the four hash values:

    NH_j(P) = sum_i ((m[2i] + k[2i+4j]) mod 2^32) * ((m[2i+1] + k[2i+1+4j]) mod 2^32)
              mod 2^64, j = 0..3
    tag     = SipHash-2-4-128(k_prf, header[0:34] || LE64(NH_0) || ... || LE64(NH_3))

(m: the payload's little-endian 32-bit words, zero-padded to a multiple of 8 bytes; k:
the NH key's words), with ``k_prf`` and the NH key derived once from the secret
(:func:`derive_keys`). A whole GRO run (or GSO batch) of equal-size datagrams is
verified (signed) in one call of native code, ``dgt.transport._udpmac`` (C, built by
``pip install``). Without it (no C compiler at install) the same MAC is computed with
numpy, slower; ``dgt train`` warns (:data:`NATIVE`).

Forgery: a datagram whose header the key has never tagged must guess a SipHash output;
one that reuses a tagged header with another payload of the same length verifies with
probability at most 2^-128 per try (NH is 2^-32-almost-universal on equal-length inputs,
and four Toeplitz-shifted passes multiply: UMAC's analysis), plus SipHash's own bound.
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np

try:   # the C helper (setup.py builds it; optional: the Python below is the fallback)
    from . import _udpmac as _native
except ImportError:   # pragma: no cover - only where no compiler was at install
    _native = None

#: True when the native helper is built (the fast path)
NATIVE = _native is not None
#: what a job with --secret says (stderr and the report's warnings) when it is not
NOT_NATIVE = ("the UDP MAC's native helper (dgt.transport._udpmac) is not built, so "
              "--secret checks every datagram in Python, several times slower; reinstall "
              "dgt where a C compiler and the Python headers are (Debian: gcc, python3-dev)")

HEADER_BYTES = 34
TAG_BYTES = 16
#: the largest payload a UDP datagram can carry (65,507 - header - tag), padded to 8
MAX_PAYLOAD = (65507 - HEADER_BYTES - TAG_BYTES + 7) // 8 * 8
#: NH key bytes: the largest padded payload, plus 48 for the fourth pass's shift
NH_KEY_BYTES = MAX_PAYLOAD + 48
_M64 = (1 << 64) - 1


@functools.lru_cache(maxsize=8)
def derive_keys(key: bytes) -> bytes:
    """``k_prf`` (16 bytes, SipHash's key) || the NH key (:data:`NH_KEY_BYTES`), from
    the secret's UTF-8 bytes ``key`` (1 to 64 bytes): ``k_prf`` = keyed BLAKE2b-128 of
    ``b"dgt udp mac: prf"``, the NH key = SHAKE128(``b"dgt udp mac: nh\\0"`` || key)."""
    k = hashlib.blake2b(b"dgt udp mac: prf", key=key, digest_size=16).digest()
    return k + hashlib.shake_128(b"dgt udp mac: nh\0" + key).digest(NH_KEY_BYTES)


def sign_rows(keys: bytes, rows: np.ndarray) -> None:
    """``keys``: :func:`derive_keys` of the secret (so in every function below; a
    receiver derives them once). Write the tag into the last 16 bytes of each row of
    ``rows`` ((n, size) uint8, C-contiguous, writable; size >= 50: header, payload,
    tag)."""
    n, size = rows.shape
    if not n:
        return
    if _native is not None:
        _native.sign(keys, rows, n, size)
        return
    for row in rows:   # pragma: no cover - the fallback
        row[size - TAG_BYTES:] = np.frombuffer(_py_tag(keys, row[:size - TAG_BYTES].tobytes()),
                                               np.uint8)


def match(keys: bytes, rows: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """Verify the tags of ``rows`` ((n, size) uint8, C-contiguous, each row one datagram
    ending in its tag), or of rows ``idx`` only ((m,) int64; no copy of the rows).
    Returns (n,) or (m,) bool. Every byte of every tag is compared (no early exit)."""
    n, size = rows.shape
    which = range(n) if idx is None else idx
    out = np.zeros(len(which), np.uint8)
    if not out.size:
        return out.view(bool)
    if _native is not None:
        _native.verify(keys, rows, size,
                       None if idx is None else np.ascontiguousarray(idx, np.int64), out)
        return out.view(bool)
    for j, i in enumerate(which):   # pragma: no cover - the fallback
        row = rows[i]
        out[j] = _py_tag(keys, row[:size - TAG_BYTES].tobytes()) == row[size - TAG_BYTES:].tobytes()
    return out.view(bool)


def match_one(keys: bytes, datagram) -> bool:
    """One datagram (bytes-like, ending in its tag): does its tag verify?"""
    if _native is not None:
        return _native.verify_one(keys, datagram)
    mv = memoryview(datagram).cast("B")   # pragma: no cover - the fallback
    return len(mv) >= HEADER_BYTES + TAG_BYTES and \
        _py_tag(keys, bytes(mv[:-TAG_BYTES])) == bytes(mv[-TAG_BYTES:])


def tag(keys: bytes, message) -> bytes:
    """The 16-byte tag of ``message`` (bytes-like: a 34-byte header, then the payload)."""
    row = np.zeros((1, len(message) + TAG_BYTES), np.uint8)
    row[0, :len(message)] = np.frombuffer(message, np.uint8)
    sign_rows(keys, row)
    return row[0, len(message):].tobytes()


# -- the same in Python: the fallback, and what docs/wire.md says, line by line --------

def nh4(payload: bytes, nh_key: bytes) -> list[int]:
    """NH_0..NH_3 of ``payload`` (zero-padded to a multiple of 8 bytes) under
    ``nh_key``: four 64-bit integers."""
    padded = payload + bytes(-len(payload) % 8)
    m = np.frombuffer(padded, "<u4")
    k = np.frombuffer(nh_key[:len(padded) + 48], "<u4")
    out = []
    for j in range(4):
        kj = k[4 * j:4 * j + m.size]
        a = (m[0::2] + kj[0::2]).astype(np.uint64)   # uint32 sums wrap mod 2^32
        b = (m[1::2] + kj[1::2]).astype(np.uint64)
        out.append(int((a * b).sum(dtype=np.uint64)))   # wraps mod 2^64
    return out


def siphash128(key: bytes, data: bytes) -> bytes:
    """SipHash-2-4 with a 128-bit output (the reference ``siphash`` with outlen 16):
    16 bytes, the two 64-bit halves little-endian."""
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")
    v = [0x736F6D6570736575 ^ k0, 0x646F72616E646F6D ^ k1 ^ 0xEE,
         0x6C7967656E657261 ^ k0, 0x7465646279746573 ^ k1]

    def rotl(x, b):
        return ((x << b) | (x >> (64 - b))) & _M64

    def rounds(k):
        for _ in range(k):
            v[0] = (v[0] + v[1]) & _M64; v[1] = rotl(v[1], 13) ^ v[0]; v[0] = rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & _M64; v[3] = rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & _M64; v[3] = rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & _M64; v[1] = rotl(v[1], 17) ^ v[2]; v[2] = rotl(v[2], 32)

    n = len(data)
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, n - n % 8, 8)]
    words.append(int.from_bytes(data[n - n % 8:], "little") | ((n & 0xFF) << 56))
    for m in words:
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    v[2] ^= 0xEE
    rounds(4)
    out = (v[0] ^ v[1] ^ v[2] ^ v[3]).to_bytes(8, "little")
    v[1] ^= 0xDD
    rounds(4)
    return out + (v[0] ^ v[1] ^ v[2] ^ v[3]).to_bytes(8, "little")


def _py_tag(keys: bytes, message: bytes) -> bytes:
    hashes = nh4(message[HEADER_BYTES:], keys[16:])
    return siphash128(keys[:16], message[:HEADER_BYTES]
                      + b"".join(h.to_bytes(8, "little") for h in hashes))
