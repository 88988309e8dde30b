"""Block codecs of the unreliable bands: fewer bytes for low-contribution blocks.

Each UDP band may carry its blocks in a reduced form (``--band-codec``): fp16, bf16,
or int8 or int4 with one float32 scale per block. The sender codes (:func:`encode`), every
shard decodes to float32 (:func:`decode`) before its rank-ordered sum, so the
aggregate's bits do not depend on who decoded; the worker keeps ``g - decode(encode(g))``
of each delivered coded block in its residual (dgt.feedback), as it keeps a lost block
whole. The byte layouts are the wire's (``dgt.transport.wire.Coding``, docs/wire.md,
"Block codings").

Speed: int8, the default reduced form, is coded and decoded by a C helper
(``dgt/_int8codec.c``) in one pass per block: the block's max |x|, then its q, its
payload and its decoded value while the block is in cache; the same IEEE steps as the
torch path below, so the same bits (tests/test_int8codec.py). Without a C compiler at
install, or with ``DGT_INT8_CODEC=torch`` in the environment, torch's kernels do it.
On the torch path every pass is one of torch's vectorised kernels; decode and the
int8/int4 encoder write into arrays numpy allocates (numpy asks for huge pages: few page
faults), and int8/int4 go through the blocks one L2-sized chunk at a time, so the input
is read from memory once. One core codes and decodes 2 GB/s of float32 or more:
``python -m dgt.tools.bench_codec speed`` (tools/bench_codec.py), figures in
docs/bench/codecs.md.

Sources: fp16 gradient compression as in PyTorch's ``fp16_compress_hook`` and GeoMX;
per-block symmetric int8 as in QSGD-style quantisers (Alistarh et al., NeurIPS 2017)
with error feedback (EF-SGD, Karimireddy et al., ICML 2019).

Example::

    rows = encode(Coding.INT8, torch.randn(10, 352))   # (10, 356) uint8
    dec = decode(Coding.INT8, rows, 352)                # (10, 352) float32
"""
from __future__ import annotations

import numbers
import os

import numpy as np
import torch

from .transport.wire import Coding, check_coding, coded_payload_bytes

try:   # optional (setup.py): without it, torch's kernels give the same bits, slower
    from . import _int8codec as _native
except ImportError:   # pragma: no cover - depends on the install
    _native = None
if os.environ.get("DGT_INT8_CODEC") == "torch":   # A/B benchmarks of the two paths
    _native = None

_HALF = {Coding.FP16: torch.float16, Coding.BF16: torch.bfloat16}
_LEVELS = {Coding.INT8: 127.0, Coding.INT4: 7.0}
#: float32 bytes of one chunk of the int8/int4 passes: the chunk and its scratch stay
#: in a core's L2 cache
_CHUNK_BYTES = 1 << 19
_F32_MAX = float(np.finfo(np.float32).max)
_HIGH_NIBBLES = -0x0F10   # 0xF0F0 as an int16


def encode(coding: int, blocks: torch.Tensor, decoded: torch.Tensor | None = None,
           error: torch.Tensor | None = None) -> np.ndarray:
    """Code ``blocks`` ((m, E) float32) as ``coding``; returns the payloads,
    (m, coded_payload_bytes(coding, E)) uint8, one row per block (docs/wire.md, "Block
    codings"). With ``decoded`` ((m, E) float32, may be ``blocks`` itself) it also
    receives ``decode(coding, payloads, E)`` computed in the same pass, bitwise what
    :func:`decode` gives for every block that decodes finite (a sender's own copy of
    what the receivers will apply, without a second pass over the payloads). With
    ``error`` ((m, E) float32, may be ``blocks`` itself; then ``decoded`` must be another
    array or None) it receives the
    coding error ``blocks - decode(...)``, one f32 subtraction per value (what error
    feedback keeps). fp16/bf16: IEEE round to nearest even (fp16: 65520 and above is
    inf). int8: ``a = max|x|``, ``s = a / 127`` (f32, sent),
    ``r = min(127 / a, FLT_MAX)``, ``q = round_half_even(x * r)`` in -127..127 (so
    q = 0 for a zero block); int4 the same with 7 for 127, two q a byte (the even value
    in the low nibble). A block with a NaN or inf gets a non-finite s (its q are
    unspecified), so it decodes non-finite and the shard keeps it out of the sum as any
    non-finite block.

    Every coding takes the same inputs: ``blocks`` that is not contiguous is coded as
    its contiguous copy, and one that requires grad from its values (detached; so are
    ``decoded`` and ``error``, written in place). The checks are O(1), no pass over the
    data. Raises TypeError for ``blocks`` that is not a float32 torch tensor (float64,
    float16, a numpy array: the message names the dtype or type); ValueError for
    ``blocks`` not of shape (m, E) with E > 0 or not on the CPU, ``decoded`` or
    ``error`` that is not a float32 CPU tensor of ``blocks``' shape, FP32, an unknown
    coding, or ``decoded`` and ``error`` in one array; TypeError for a coding that is
    not an int (a bool)."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.float32:
        got = blocks.dtype if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise TypeError(f"blocks must be a float32 tensor of shape (m, E), got {got}")
    if blocks.dim() != 2:
        raise ValueError(f"blocks must have shape (m, E) with E > 0, got "
                         f"{tuple(blocks.shape)}")
    m, e = blocks.shape
    if e == 0:
        raise ValueError(f"blocks must have shape (m, E) with E > 0, got {(m, e)}")
    if not blocks.is_cpu:
        raise ValueError(f"blocks must be on the CPU, got {blocks.device}")
    check_coding(coding)
    p = coded_payload_bytes(coding, e)
    if coding == Coding.FP32 or p is None:
        raise ValueError(f"no block codec for coding {coding}")
    if error is not None and (error is decoded or decoded is blocks):
        raise ValueError("decoded and error must be two arrays, and decoded not blocks "
                         "when error is asked for")
    if decoded is not None:
        decoded = _output("decoded", decoded, m, e)
    if error is not None:
        error = _output("error", error, m, e)
    if blocks.requires_grad:
        blocks = blocks.detach()
    if not blocks.is_contiguous():   # (fp16/bf16 view their rows as bytes)
        blocks = blocks.contiguous()
    if coding == Coding.INT8 and _native is not None and _plain_cpu(blocks, decoded,
                                                                      error):
        out = np.empty((m, p), np.uint8)
        _native.encode(blocks.numpy(), out, *(None if t is None else t.numpy()
                                              for t in (decoded, error)))
        return out
    dec = decoded if error is None or decoded is not None else torch.empty_like(blocks)
    if coding in _HALF:
        half = blocks.to(_HALF[coding])
        if dec is not None:
            dec.copy_(half)
        out = half.view(torch.uint8).numpy()
    else:
        out = np.empty((m, p), np.uint8)
        _quantise(blocks, _LEVELS[coding], out, dec)
    if error is not None:
        torch.sub(blocks, dec, out=error)
    return out


def _output(name: str, t: torch.Tensor, m: int, e: int) -> torch.Tensor:
    """``t``, encode's ``decoded`` or ``error`` (``name``), detached. Raises ValueError
    unless it is a float32 CPU tensor of shape (m, e)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 \
            or t.shape != (m, e) or not t.is_cpu:
        got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name} must be a float32 tensor of blocks' shape {(m, e)}, "
                         f"on the CPU, got {got}")
    return t.detach() if t.requires_grad else t


def native() -> bool:
    """True when int8 goes through the C helper (``dgt/_int8codec.c``)."""
    return _native is not None


def _plain_cpu(*ts) -> bool:
    """Every tensor given is a CPU float32 one whose rows hold contiguous elements (what
    the C helper takes as a numpy view); None counts as fine."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                             and t.dim() == 2 and t.stride(1) == 1
                             and not t.requires_grad) for t in ts)


def _quantise(blocks: torch.Tensor, levels: float, out: np.ndarray,
              decoded: torch.Tensor | None = None) -> None:
    """int8 (``levels`` 127) or int4 (7) payloads of ``blocks`` ((m, E) float32) into
    ``out`` ((m, 4 + E) or (m, 4 + ceil(E/2)) uint8), one chunk of rows at a time; with
    ``decoded``, each chunk's ``float(q) * s`` there too, as :func:`decode` computes it,
    while the chunk is in cache."""
    m, e = blocks.shape
    n = _chunk_rows(e, m)
    y, r = torch.empty(n, e), torch.empty(n, 1)
    a = torch.empty(m, 1)
    s = torch.empty(m, 1) if decoded is not None else None
    lv = torch.full((max(m, 1), 1), levels)   # tensor / tensor: one correctly rounded
    packed = torch.from_numpy(out)[:, 4:]     # division (scalar / tensor is not)
    if levels == 7.0:   # a chunk's q as int8, an odd E padded with a 0
        q = torch.zeros(n, e + e % 2, dtype=torch.int8)
        pairs = q.view(torch.int16)   # little-endian: value 2j in the low byte
        shifted = torch.empty_like(pairs)
    for i in range(0, m, n):
        k, x, ak = min(n, m - i), blocks[i:i + n], a[i:i + n]
        torch.amax(torch.abs(x, out=y[:k]), 1, True, out=ak)   # +0, never -0
        torch.div(lv[:k], ak, out=r[:k]).clamp_(max=_F32_MAX)   # a = 0: r = FLT_MAX
        torch.mul(x, r[:k], out=y[:k]).round_()                 # half to even
        if s is not None:
            torch.div(ak, lv[:k], out=s[i:i + k])
        if levels == 127.0:   # the conversions below are exact: integral, in range
            packed[i:i + k].view(torch.int8).copy_(y[:k])
            if s is not None:   # decode's own steps on q (a -0.0 in y is +0 there)
                decoded[i:i + k].copy_(packed[i:i + k].view(torch.int8)).mul_(s[i:i + k])
            continue
        q[:k, :e].copy_(y[:k])   # q of values 2j, 2j + 1 = u, v: int16 0xvvuu
        if s is not None:
            decoded[i:i + k].copy_(q[:k, :e]).mul_(s[i:i + k])
        w = pairs[:k].bitwise_and_(0x0F0F)                               # 0x0V0U
        w.bitwise_or_(torch.bitwise_right_shift(w, 4, out=shifted[:k]))  # 0x0VVU
        packed[i:i + k].copy_(w.bitwise_and_(0xFF))   # 0x00VU (an odd E's pad: 0 again)
    out[:, :4] = (s if s is not None else torch.div(a, lv[:m])).numpy().view(np.uint8)


def decode(coding: int, rows: np.ndarray, block_elems: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`encode`: ``rows`` ((m, coded_payload_bytes) uint8, rows may be
    strided views into datagrams) to (m, block_elems) float32, deterministic (int8: one
    f32 multiply ``q * s`` per value; int4 too). Written into ``out`` when given ((m,
    block_elems) float32, C-contiguous, e.g. a shard's receive rows), else into a new
    array; returns it. The checks are O(1). Raises TypeError for ``rows`` that is not a
    numpy uint8 array (a torch tensor, int8 bytes); ValueError for ``rows`` not 2-D,
    ``block_elems`` that is not an int > 0, FP32, an unknown coding, rows of the wrong
    width, or an ``out`` that does not fit or is read-only (fp16, bf16 and int4 wrote
    into a read-only one: breaker round 20); TypeError for a coding that is not an int
    (a bool). Every coding decodes rows of any strides
    (a Fortran-order array, every other byte of a buffer, read-only memory) to the
    same values: rows whose last axis is not contiguous, or with a negative stride
    (``rows[::-1]``), are copied first, the others are read in place."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8:
        got = rows.dtype if isinstance(rows, np.ndarray) else type(rows).__name__
        raise TypeError(f"rows must be a numpy uint8 array of shape (m, payload bytes), "
                        f"got {got}")
    if rows.ndim != 2:
        raise ValueError(f"rows must have shape (m, payload bytes), got {rows.shape}")
    if isinstance(block_elems, bool) or not isinstance(block_elems, numbers.Integral) \
            or block_elems < 1:
        raise ValueError(f"block_elems must be an int > 0, got {block_elems!r}")
    m, e = rows.shape[0], int(block_elems)
    check_coding(coding)
    p = coded_payload_bytes(coding, e)
    if coding == Coding.FP32 or p is None:
        raise ValueError(f"no block codec for coding {coding}")
    if rows.shape[1] != p:
        raise ValueError(f"coding {coding} rows must be {p} B wide, got {rows.shape}")
    if out is None:
        out = np.empty((m, e), np.float32)
    elif not isinstance(out, np.ndarray) or out.shape != (m, e) \
            or out.dtype != np.float32 or not out.flags.c_contiguous \
            or not out.flags.writeable:
        got = (f"{'read-only ' if not out.flags.writeable else ''}{out.dtype} "
               f"{out.shape}" if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"out must be a writable C-contiguous float32 array of "
                         f"{(m, e)}, got {got}")
    if m == 0:   # numpy may give an empty array any strides; torch cannot view those
        return out
    if coding == Coding.INT8 and _native is not None and rows.strides[-1] == 1:
        _native.decode(rows, out)
        return out
    dec = torch.from_numpy(out)
    if coding in _HALF:
        dec.copy_(_tensor(rows).view(_HALF[coding]))
        return out
    # (m, 1), an aligned C-order copy (np.array keeps a Fortran-order input's order,
    # which a view as f4 refuses)
    scale = torch.from_numpy(np.array(rows[:, :4], order="C").view("<f4"))
    b = _tensor(rows[:, 4:])
    n = _chunk_rows(e, m)
    if coding == Coding.INT4:   # a chunk's bytes, one int16 each, then its int8 pairs
        pairs = torch.empty(n, (e + 1) // 2, dtype=torch.int16)
        shifted = torch.empty_like(pairs)
    for i in range(0, m, n):
        k = min(n, m - i)
        if coding == Coding.INT8:
            q = b[i:i + k].view(torch.int8)
        else:   # byte hl (nibbles h, l) -> int16 0xh0l0 (bytes l0, h0) -> int8 l, h
            w = pairs[:k].copy_(b[i:i + k])   # 0x00hl
            w.bitwise_or_(torch.bitwise_left_shift(w, 4, out=shifted[:k]))   # 0x0h?l
            w.bitwise_left_shift_(4).bitwise_and_(_HIGH_NIBBLES)            # 0xh0l0
            q = w.view(torch.int8).bitwise_right_shift_(4)[:, :e]   # sign-extended
        dec[i:i + k].copy_(q).mul_(scale[i:i + k])
    return out


def _chunk_rows(block_elems: int, m: int) -> int:
    """Blocks per chunk of the int8/int4 loops: about ``_CHUNK_BYTES`` of float32."""
    return max(1, min(m, _CHUNK_BYTES // (4 * block_elems)))


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` (uint8, rows may be strided) as a tensor: a view when it is writable (a
    receive buffer) with unit-stride rows and no negative stride, else a copy
    (torch.from_numpy wants writable memory and no negative stride, ``rows[::-1]``; a
    byte view as another dtype wants stride 1 in the last dimension)."""
    ok = a.flags.writeable and min(a.strides, default=0) >= 0 and (
        a.ndim == 0 or a.shape[-1] <= 1 or a.strides[-1] == 1)
    return torch.from_numpy(a if ok else np.ascontiguousarray(a).copy())
