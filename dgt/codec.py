"""Block codecs of the unreliable bands: fewer bytes for low-contribution blocks.

Each UDP band may carry its blocks in a reduced form (``--band-codec``): fp16, bf16,
or int8 or int4 with one float32 scale per block. The sender codes (:func:`encode`), every
shard decodes to float32 (:func:`decode`) before its rank-ordered sum, so the
aggregate's bits do not depend on who decoded; the worker keeps ``g - decode(encode(g))``
of each delivered coded block in its residual (dgt.feedback), as it keeps a lost block
whole. The byte layouts are the wire's (``dgt.transport.wire.Coding``, docs/wire.md,
"Block codings"); the conversions are torch's vectorised ones (one core: several GB/s
for fp16/bf16, see ``tools/codec_bench.py``).

Sources: fp16 gradient compression as in PyTorch's ``fp16_compress_hook`` and GeoMX;
per-block symmetric int8 as in QSGD-style quantisers (Alistarh et al., NeurIPS 2017)
with error feedback (EF-SGD, Karimireddy et al., ICML 2019).

Example::

    rows = encode(Coding.INT8, torch.randn(10, 352))   # (10, 356) uint8
    dec = decode(Coding.INT8, rows, 352)                # (10, 352) float32
"""
from __future__ import annotations

import numpy as np
import torch

from .transport.wire import Coding, coded_payload_bytes

#: 1.5 x 2^23: x + MAGIC rounds x (|x| <= 2^22) to an integer, half to even, in the
#: low mantissa bits of the float32 (the classic float-to-int rounding trick)
_ROUND_MAGIC = 12582912.0


def encode(coding: int, blocks: torch.Tensor) -> np.ndarray:
    """Code ``blocks`` ((m, E) float32, C-contiguous) as ``coding``; returns the payloads,
    (m, coded_payload_bytes(coding, E)) uint8, one row per block (docs/wire.md, "Block
    codings"). fp16/bf16: IEEE round to nearest even (fp16 overflows to inf above
    65504). int8: ``a = max|x|``, ``s = a / 127`` (f32, sent),
    ``q = round_half_even(x * (127 / a))`` in -127..127 (q = 0 when a = 0); int4 the
    same with 7 for 127, two q a byte (the even value in the low nibble). A block with a
    NaN or inf gets a non-finite s, so it decodes non-finite and the shard keeps it out of the sum as any non-finite block.
    Raises ValueError for FP32 or an unknown coding."""
    m, e = blocks.shape
    if coding in (Coding.FP16, Coding.BF16):
        half = blocks.to(torch.float16 if coding == Coding.FP16 else torch.bfloat16)
        return half.view(torch.uint8).numpy()
    if coding not in (Coding.INT8, Coding.INT4):
        raise ValueError(f"no block codec for coding {coding}")
    levels = 127.0 if coding == Coding.INT8 else 7.0
    out = np.empty((m, coded_payload_bytes(coding, e)), np.uint8)
    amax = torch.maximum(blocks.amax(dim=1, keepdim=True),
                         -blocks.amin(dim=1, keepdim=True)).abs_()   # +0, never -0
    c127 = torch.full_like(amax, levels)  # tensor / tensor: one correctly rounded f32
    scale = torch.div(amax, c127)         # division (scalar / tensor is 127 * (1 / a))
    # y = x * (127 / max|x|): |y| <= 127; 0 * inf = NaN for a zero block, hence 0 there
    y = torch.mul(blocks, torch.where(amax > 0, torch.div(c127, amax),
                                      torch.zeros_like(amax)))
    y.add_(_ROUND_MAGIC)   # the low byte of y's bits is now q, two's complement
    q = y.view(torch.uint8).view(m, e, 4)[:, :, 0]   # little-endian: byte 0 is the low
    out[:, :4] = scale.numpy().view(np.uint8)
    if coding == Coding.INT8:
        out[:, 4:] = q.numpy()
    else:   # two values a byte: value 2j in the low nibble, 2j + 1 in the high one
        q = q.numpy()
        out[:, 4:] = q[:, 0::2] & 0x0F
        out[:, 4:4 + e // 2] |= q[:, 1::2] << 4
    return out


def decode(coding: int, rows: np.ndarray, block_elems: int) -> np.ndarray:
    """Inverse of :func:`encode`: ``rows`` ((m, coded_payload_bytes) uint8, rows may be
    strided views into datagrams) to (m, block_elems) float32, deterministic (int8: one
    f32 multiply ``q * s`` per value; int4 too). Raises ValueError for FP32, an unknown coding, or
    rows of the wrong width."""
    p = coded_payload_bytes(coding, block_elems)
    if coding == Coding.FP32 or p is None:
        raise ValueError(f"no block codec for coding {coding}")
    m = rows.shape[0]
    if rows.shape[1:] != (p,):
        raise ValueError(f"coding {coding} rows must be {p} B wide, got {rows.shape}")
    if coding in (Coding.FP16, Coding.BF16):
        half = _tensor_ready(rows).view(np.int16)
        t = torch.from_numpy(half).view(torch.float16 if coding == Coding.FP16
                                        else torch.bfloat16)
        return t.float().numpy()
    scale = torch.from_numpy(np.array(rows[:, :4]).view("<f4"))   # (m, 1), aligned copy
    if coding == Coding.INT8:
        q = torch.from_numpy(_tensor_ready(rows[:, 4:]).view(np.int8))
    else:   # the nibbles, sign-extended by arithmetic shifts
        b = rows[:, 4:]
        pair = np.empty((m, b.shape[1], 2), np.int8)
        pair[:, :, 0] = (b << 4).view(np.int8) >> 4
        pair[:, :, 1] = b.view(np.int8) >> 4
        q = torch.from_numpy(pair.reshape(m, -1)[:, :block_elems])
    out = q.to(torch.float32)
    out.mul_(scale)
    return out.numpy().reshape(m, block_elems)


def _tensor_ready(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous, writable array (torch.from_numpy wants one): itself when
    it is one already (a receive buffer), else a copy (a view of read-only bytes)."""
    a = np.ascontiguousarray(a)
    return a if a.flags.writeable else a.copy()
