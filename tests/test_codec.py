"""dgt.codec against the formulas of docs/wire.md ("Block codings"), written again here
in plain numpy: what an independent implementation would compute, bit for bit."""
import numpy as np
import pytest
import torch

from dgt import codec
from dgt.transport.wire import Coding, coded_payload_bytes

E = 352


def _blocks(m=64, seed=0):
    g = np.random.default_rng(seed).standard_normal((m, E)).astype(np.float32)
    g *= np.logspace(-6, 3, m, dtype=np.float32)[:, None]   # blocks of every magnitude
    return g


def _reference(coding, g):
    """(payload rows, decoded) per docs/wire.md, numpy only."""
    if coding == Coding.FP16:
        h = g.astype("<f2")
        return h.view(np.uint8), h.astype(np.float32)
    if coding == Coding.BF16:
        u = g.view(np.uint32)
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")   # round to nearest even
        return b.view(np.uint8), (b.astype(np.uint32) << 16).view(np.float32)
    levels = np.float32(127 if coding == Coding.INT8 else 7)
    a = np.abs(g).max(axis=1, keepdims=True)
    s = a / levels
    with np.errstate(divide="ignore"):
        r = np.where(a > 0, levels / a, np.float32(0))
    q = np.rint(g * r).astype(np.int8)
    packed = q.view(np.uint8)
    if coding == Coding.INT4:   # byte j: value 2j low nibble, 2j + 1 high nibble
        nib = np.zeros((q.shape[0], (q.shape[1] + 1) // 2 * 2), np.uint8)
        nib[:, :q.shape[1]] = packed & 0x0F
        packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    rows = np.concatenate([s.astype("<f4").view(np.uint8), packed], axis=1)
    return rows, q.astype(np.float32) * s


@pytest.mark.parametrize("coding", [Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4])
def test_encode_and_decode_are_the_spec_s_formulas_bit_for_bit(coding):
    g = _blocks()
    g[5] = 0.0   # a zero block: int8 scale 0, q 0
    rows = codec.encode(coding, torch.from_numpy(g))
    ref_rows, ref_dec = _reference(coding, g)
    assert rows.shape == (g.shape[0], coded_payload_bytes(coding, E))
    assert np.array_equal(rows, ref_rows)
    dec = codec.decode(coding, rows, E)
    assert dec.dtype == np.float32 and np.array_equal(dec, ref_dec)
    assert not dec[5].any()
    if coding == Coding.INT8:
        q = rows[:, 4:].view(np.int8)
        assert q.min() >= -127 and q.max() <= 127 and np.abs(q).max(axis=1)[6] == 127


def test_int4_packs_two_values_a_byte_also_for_an_odd_block():
    g = np.array([[1.0, -1.0, 0.5, -0.25, 3.5]], np.float32)   # a = 3.5, s = 0.5
    rows = codec.encode(Coding.INT4, torch.from_numpy(g))
    assert rows[0, :4].view("<f4")[0] == np.float32(0.5)
    # q = 2, -2, 1, -0 (-0.5 rounds to even 0), 7: bytes 0xE2, 0x01, 0x07
    assert rows[0, 4:].tolist() == [0xE2, 0x01, 0x07]
    assert codec.decode(Coding.INT4, rows, 5).tolist() == [[1.0, -1.0, 0.5, 0.0, 3.5]]
    assert np.array_equal(rows, _reference(Coding.INT4, g)[0])


@pytest.mark.parametrize("coding", [Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4])
def test_decode_reads_rows_straight_out_of_datagrams(coding):
    """Rows as the shard sees them: strided, read-only views into received bytes."""
    g = _blocks(8)
    rows = codec.encode(coding, torch.from_numpy(g))
    p = rows.shape[1]
    buf = np.zeros((8, 34 + p + 16), np.uint8)
    buf[:, 34:34 + p] = rows
    view = np.frombuffer(buf.tobytes(), np.uint8).reshape(buf.shape)[:, 34:34 + p]
    assert np.array_equal(codec.decode(coding, view, E), codec.decode(coding, rows, E))


@pytest.mark.parametrize("coding", [Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_block_decodes_non_finite_and_its_neighbours_do_not(coding, bad):
    g = _blocks(3)
    g[1, 7] = bad
    dec = codec.decode(coding, codec.encode(coding, torch.from_numpy(g)), E)
    assert not np.isfinite(dec[1].sum())
    assert np.isfinite(dec[[0, 2]]).all()


def test_fp32_and_unknown_codings_and_wrong_widths_are_refused():
    x = torch.zeros(2, E)
    for c in (Coding.FP32, 5):
        with pytest.raises(ValueError):
            codec.encode(c, x)
        with pytest.raises(ValueError):
            codec.decode(c, np.zeros((2, 4 * E), np.uint8), E)
    with pytest.raises(ValueError):
        codec.decode(Coding.INT8, np.zeros((2, E), np.uint8), E)
