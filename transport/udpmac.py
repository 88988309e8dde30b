"""The UDP MAC (docs/wire.md, "UDP MAC"): what a datagram on a UDP channel carries
with ``--secret``, in place of the keyed BLAKE2b-128 of the TCP frames.

A flood of forged datagrams is paid for per datagram, and one keyed BLAKE2b call per
datagram costs more than the whole receive path without a secret (docs/security.md,
"Receive path: the cost of the MAC"). This MAC is a polynomial hash of the payload
over GF(2^61 - 1) under two secret points, then SipHash-2-4-128 of the header and
the two hash values:

    H_r(P) = sum_{i=1..n} c_i * r^(n+1-i) mod (2^61 - 1)
             (c_i: P's 7-byte little-endian chunks, the last one zero-padded)
    tag    = SipHash-2-4-128(k, header[0:34] || LE64(H_r1(P)) || LE64(H_r2(P)))

with ``k``, ``r1``, ``r2`` derived once from the secret (:func:`derive_keys`). A whole
GRO run (or GSO batch) of equal-size datagrams is verified (signed) in one call of
native code, ``dgt.transport._udpmac`` (C, built by ``pip install``). Without it
(no C compiler at install) the same MAC is computed in Python, slowly; the sidecar
warns once (:data:`NATIVE`).

Forgery: a datagram that differs from every datagram of the same header the key has
tagged verifies with probability at most (ceil(L/7) / (2^61 - 1))^2 per try for a
payload of L bytes (two independent points; 2^-106 for a 1,408-byte block), plus
SipHash's own bound; a stranger without the secret learns nothing about ``k``,
``r1``, ``r2`` from the tags (a PRF of the header and the hashes).
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

HEADER_BYTES = 34
TAG_BYTES = 16
P61 = (1 << 61) - 1
_M64 = (1 << 64) - 1


@functools.lru_cache(maxsize=8)
def derive_keys(key: bytes) -> bytes:
    """32 bytes: ``k`` (16, SipHash's key) || LE64(r1) || LE64(r2), from the secret's
    UTF-8 bytes ``key`` (1 to 64 bytes): keyed BLAKE2b-128 of two fixed labels;
    r = 1 + (LE64 value mod (2^61 - 2)), so r is in [1, 2^61 - 2]."""
    k = hashlib.blake2b(b"dgt udp mac: prf", key=key, digest_size=16).digest()
    a = hashlib.blake2b(b"dgt udp mac: poly", key=key, digest_size=16).digest()
    r1 = 1 + int.from_bytes(a[:8], "little") % (P61 - 1)
    r2 = 1 + int.from_bytes(a[8:], "little") % (P61 - 1)
    return k + r1.to_bytes(8, "little") + r2.to_bytes(8, "little")


def sign_rows(key: bytes, rows: np.ndarray) -> None:
    """Write the tag into the last 16 bytes of each row of ``rows`` ((n, size) uint8,
    C-contiguous, writable; size >= 50: header, payload, tag)."""
    n, size = rows.shape
    if not n:
        return
    keys = derive_keys(key)
    if _native is not None:
        _native.sign(keys, rows, n, size)
        return
    for row in rows:   # pragma: no cover - the fallback
        row[size - TAG_BYTES:] = np.frombuffer(_py_tag(keys, row[:size - TAG_BYTES].tobytes()),
                                               np.uint8)


def match(key: bytes, rows: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """Verify the tags of ``rows`` ((n, size) uint8, C-contiguous, each row one datagram
    ending in its tag), or of rows ``idx`` only ((m,) int64; no copy of the rows).
    Returns (n,) or (m,) bool. Every byte of every tag is compared (no early exit)."""
    n, size = rows.shape
    which = range(n) if idx is None else idx
    out = np.zeros(len(which), np.uint8)
    if not out.size:
        return out.view(bool)
    keys = derive_keys(key)
    if _native is not None:
        at = np.arange(n, dtype=np.int64) if idx is None else np.ascontiguousarray(idx, np.int64)
        _native.verify_at(keys, rows, size, at, out)
        return out.view(bool)
    for j, i in enumerate(which):   # pragma: no cover - the fallback
        row = rows[i]
        out[j] = _py_tag(keys, row[:size - TAG_BYTES].tobytes()) == row[size - TAG_BYTES:].tobytes()
    return out.view(bool)


def match_one(key: bytes, datagram) -> bool:
    """One datagram (bytes-like, ending in its tag): does its tag verify?"""
    keys = derive_keys(key)
    if _native is not None:
        return _native.verify_one(keys, datagram)
    mv = memoryview(datagram).cast("B")   # pragma: no cover - the fallback
    return len(mv) >= HEADER_BYTES + TAG_BYTES and \
        _py_tag(keys, bytes(mv[:-TAG_BYTES])) == bytes(mv[-TAG_BYTES:])


def tag(key: bytes, message) -> bytes:
    """The 16-byte tag of ``message`` (bytes-like: a 34-byte header, then the payload)."""
    row = np.zeros((1, len(message) + TAG_BYTES), np.uint8)
    row[0, :len(message)] = np.frombuffer(message, np.uint8)
    sign_rows(key, row)
    return row[0, len(message):].tobytes()


# -- the same in Python: the fallback, and what docs/wire.md says, line by line --------

def poly61(payload: bytes, r: int) -> int:
    """H_r(payload): Horner's rule over the 7-byte little-endian chunks (the last one
    zero-padded) modulo 2^61 - 1."""
    h = 0
    for i in range(0, len(payload), 7):
        h = (h + int.from_bytes(payload[i:i + 7], "little")) * r % P61
    return h


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
    k = keys[:16]
    r1, r2 = int.from_bytes(keys[16:24], "little"), int.from_bytes(keys[24:32], "little")
    payload = message[HEADER_BYTES:]
    return siphash128(k, message[:HEADER_BYTES] + poly61(payload, r1).to_bytes(8, "little")
                      + poly61(payload, r2).to_bytes(8, "little"))
