"""dgt.codec against the formulas of docs/wire.md ("Block codings"), written again here
in plain numpy: what an independent implementation would compute, bit for bit."""
import numpy as np
import pytest
import torch
from conftest import requires_tool

from dgt import codec
from dgt.transport.wire import Coding, coded_payload_bytes

E = 352
F32_MAX = np.finfo(np.float32).max


def _blocks(m=64, seed=0):
    g = np.random.default_rng(seed).standard_normal((m, E)).astype(np.float32)
    g *= np.logspace(-6, 3, m, dtype=np.float32)[:, None]   # blocks of every magnitude
    return g


def _reference(coding, g):
    """(payload rows, decoded) per docs/wire.md, numpy only."""
    if coding == Coding.FP16:
        with np.errstate(over="ignore"):   # above 65504: inf, as the spec says
            h = g.astype("<f2")
        return h.view(np.uint8), h.astype(np.float32)
    if coding == Coding.BF16:
        u = g.view(np.uint32)
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")   # round to nearest even
        return b.view(np.uint8), (b.astype(np.uint32) << 16).view(np.float32)
    levels = np.float32(127 if coding == Coding.INT8 else 7)
    a = np.abs(g).max(axis=1, keepdims=True)
    s = a / levels
    with np.errstate(divide="ignore", over="ignore"):
        r = np.minimum(levels / a, F32_MAX)   # finite: a zero block, a < 127 / FLT_MAX
    q = np.rint(g * r).astype(np.int8)
    packed = q.view(np.uint8)
    if coding == Coding.INT4:   # byte j: value 2j low nibble, 2j + 1 high nibble
        nib = np.zeros((q.shape[0], (q.shape[1] + 1) // 2 * 2), np.uint8)
        nib[:, :q.shape[1]] = packed & 0x0F
        packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    rows = np.concatenate([s.astype("<f4").view(np.uint8), packed], axis=1)
    with np.errstate(over="ignore"):   # 127 * (FLT_MAX / 127) may round up to inf
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


def _edge_blocks(e, levels):
    """One block per corner of the spec's formulas, ``e`` values each, float32."""
    g = np.zeros((9, e), np.float32)
    ties = [levels, .5, 1.5, 2.5, -.5, -1.5, -2.5, levels - .5, .5 - levels]
    g[0, :9] = ties                              # a = levels: r = 1, x * r = x exactly
    g[1] = -0.0                                  # a = +0: s = +0, q = 0
    # g[2]: the zero block
    g[3, :4] = [F32_MAX, -F32_MAX, F32_MAX / 3, 1.0]   # the largest magnitudes
    t = np.float32(0.3 * levels / float(F32_MAX))   # levels / a overflows: r = FLT_MAX
    g[4, :3] = [t, -t / 2, t / 3]
    g[5, :3] = [1e-45, -3e-45, 2e-44]            # subnormal
    g[6, :5] = [1 + 2 ** -11, 1 + 3 * 2 ** -11, 65519.0, 65520.0, -65520.0]  # fp16 ties
    g[6, 5:7] = np.array([0x3F808000, 0x3F818000], np.uint32).view(np.float32)  # bf16
    g[7] = np.random.default_rng(1).standard_normal(e)
    g[8, -1] = -3.0                              # the last value alone: an odd E's nibble
    return g


@pytest.mark.parametrize("coding", [Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4])
@pytest.mark.parametrize("e", [E, E - 1])
def test_edge_blocks_are_coded_exactly_as_the_spec_says(coding, e):
    """Ties at .5, +-0 and zero blocks, the largest and the tiniest magnitudes, an odd
    E: bytes and decoded values both as docs/wire.md's formulas give them."""
    levels = 127 if coding == Coding.INT8 else 7
    g = _edge_blocks(e, levels)
    rows = codec.encode(coding, torch.from_numpy(g))
    ref_rows, ref_dec = _reference(coding, g)
    assert np.array_equal(rows, ref_rows)
    assert np.array_equal(codec.decode(coding, rows, e), ref_dec)
    if coding in (Coding.INT8, Coding.INT4):
        q = _q(coding, rows, e)
        assert q[0, :9].tolist() == [levels, 0, 2, 2, 0, -2, -2, levels - 1, 1 - levels]
        assert not rows[1:3].any()                 # +0 scale, q 0: all bytes zero
        assert q[3, :4].tolist() == [levels, -levels, round(levels / 3), 0]
        assert q[4, :3].tolist() == [round(0.3 * levels), -round(0.15 * levels),
                                     round(0.1 * levels)]   # t * FLT_MAX, not 0
        assert q[8, -1] == -levels
    if coding == Coding.INT4 and e % 2:            # the pad nibble of the last byte is 0
        assert not (rows[:, -1] >> 4).any()


def _q(coding, rows, e):
    """The q values in int8/int4 payload ``rows``, (m, e) int8."""
    b = rows[:, 4:].view(np.int8)
    if coding == Coding.INT8:
        return b
    return np.stack([(b << 4) >> 4, b >> 4], axis=2).reshape(len(b), -1)[:, :e]


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
@pytest.mark.parametrize("e", [E, 5])
def test_encode_s_decoded_values_are_decode_s_bit_for_bit(coding, e):
    """encode(..., decoded) gives what decode gives the receivers, signed zeros included
    (a small negative value rounds to q = 0, which decodes to +0.0): over several
    chunks, an odd block size, a zero block and blocks of every magnitude, into a
    separate array and in place."""
    m = 2 * codec._chunk_rows(e, 10**6) + 3   # the last chunk a short one
    g = np.random.default_rng(1).standard_normal((m, e)).astype(np.float32)
    g *= np.logspace(-8, 3, m, dtype=np.float32)[:, None]
    g[0] = 0.0
    g[1, :] = -1e-9
    g[1, 0] = 1.0   # -1e-9 * 127 rounds to -0.0
    dec = torch.empty(m, e)
    rows = codec.encode(coding, torch.from_numpy(g), dec)
    want = codec.decode(coding, rows, e)
    assert dec.numpy().tobytes() == want.tobytes()
    assert np.array_equal(rows, codec.encode(coding, torch.from_numpy(g)))
    same = torch.from_numpy(g.copy())
    assert np.array_equal(codec.encode(coding, same, same), rows)
    assert same.numpy().tobytes() == want.tobytes()


@pytest.mark.parametrize("coding", [Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_block_decodes_non_finite_and_its_neighbours_do_not(coding, bad):
    g = _blocks(3)
    g[1, 7] = bad
    rows = codec.encode(coding, torch.from_numpy(g))
    dec = codec.decode(coding, rows, E)
    assert not np.isfinite(dec[1].sum())
    assert np.isfinite(dec[[0, 2]]).all()
    ref_rows, ref_dec = _reference(coding, g[[0, 2]])
    assert np.array_equal(rows[[0, 2]], ref_rows) and np.array_equal(dec[[0, 2]], ref_dec)
    if coding in (Coding.INT8, Coding.INT4):      # the scale says so; q is unspecified
        assert not np.isfinite(rows[1, :4].copy().view("<f4")).any()


def test_fp32_and_unknown_codings_and_wrong_widths_are_refused():
    x = torch.zeros(2, E)
    for c in (Coding.FP32, 5):
        with pytest.raises(ValueError):
            codec.encode(c, x)
        with pytest.raises(ValueError):
            codec.decode(c, np.zeros((2, 4 * E), np.uint8), E)
    with pytest.raises(ValueError):
        codec.decode(Coding.INT8, np.zeros((2, E), np.uint8), E)


@requires_tool("git", "bench_codec --against (reads dgt/codec.py at a revision)")
def test_the_speed_benchmark_times_every_coding_against_a_revision():
    """tools/bench_codec.py speed: every reduced form, each way, and the same code at a
    git revision in turn (no timing asserted: the figures are the benchmark's)."""
    from dgt.tools import bench_codec
    threads = torch.get_num_threads()
    try:
        res = bench_codec.speed(mb=0.05, repeat=1, against="HEAD")
    finally:
        torch.set_num_threads(threads)
    assert set(res["codings"]) == {"fp16", "bf16", "int8", "int4"}
    for v in res["codings"].values():
        for k in ("encode", "decode", "decode_datagrams"):
            assert v[f"{k}_gbps"] > 0 and v[f"against_{k}_gbps"] > 0 and v[f"{k}_ratio"] > 0
    with pytest.raises(ValueError, match="give a revision of this checkout"):
        bench_codec.speed(mb=0.05, repeat=1, against="no-such-revision")
