"""Two-sided error feedback, the PULL side (dgt.pull_codec, ``--pull-codec``): the
shard codes its low-contribution aggregate blocks, every replica applies the same
bytes, and the shard residual keeps what was rounded away (conservation). In-process
fabric (tests/test_inprocess.py) and the PULL's wire format; the multi-process runs
are in tests/test_train_e2e.py."""
import numpy as np
import pytest
import torch

from dgt.config import TransmissionConfig
from dgt.datapath import pull_coder
from dgt.pull_codec import PullCoder, decode_pull
from dgt.transport import messages, wire
from dgt.transport.control import ControlProtocol, PullArrived
from dgt.transport.reasons import Rejected
from dgt.transport.wire import Coding, MsgType

from test_inprocess import run

CODINGS = ["fp16", "bf16", "int8", "int4"]


def with_pull_codec(cfg, world=4, keep_residual=True, **kw):
    """run() (tests/test_inprocess.py) with each shard's PULL codec of ``cfg``
    (``keep_residual=False``: the shards keep no residual, the workers still do);
    returns (fabric, conservation error with the shard residuals, sum of |shard
    residual|)."""
    import test_inprocess as ti
    made = ti.Fabric.__init__

    def init(self, *a, **k):
        made(self, *a, **k)
        for r, s in enumerate(self.shards):
            s.coder = pull_coder(self.cfg, self.lay, r)
            s.coder.keep_residual = keep_residual
    ti.Fabric.__init__ = init
    try:
        fab, computed, applied, residual = run(cfg, world=world, **kw)
    finally:
        ti.Fabric.__init__ = made
    shard_res = np.concatenate([s.coder.residual.reshape(-1).astype(np.float64)
                                for s in fab.shards])
    total = applied + residual + world * shard_res
    err = np.linalg.norm(total - computed) / np.linalg.norm(computed)
    return fab, err, np.abs(shard_res).sum()


@pytest.mark.parametrize("pull_codec", CODINGS)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_conservation_holds_with_the_shard_residual(pull_codec, drop):
    """sum applied x N + worker residuals + N x shard residuals = sum of gradients, with
    coded bands and coded PULLs (and loss); replicas agree (run() checks each step)."""
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="1:fp16,2:int8,3:int4",
                             pull_codec=pull_codec, pull_coded_fraction=0.5)
    fab, err, shard_res = with_pull_codec(cfg, drop=drop)
    assert err < 1e-5
    assert shard_res > 0   # something was rounded away, and kept
    assert all(s.coder.coded_blocks > 0 for s in fab.shards)


@pytest.mark.parametrize("pull_codec", ["bf16", "int4"])
def test_without_the_shard_residual_conservation_fails(pull_codec):
    """The check can fail: the same run (coded bands, loss, the workers' residuals)
    with shards that keep no residual loses the PULL's coding error."""
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="int8",
                             pull_codec=pull_codec, pull_coded_fraction=0.5)
    _, err, _ = with_pull_codec(cfg, drop=0.3)
    assert err < 1e-5
    _, err_off, res_off = with_pull_codec(cfg, drop=0.3, keep_residual=False)
    assert res_off == 0
    assert err_off > 1e-4   # the invariant's tolerance (1e-5 here) 10 times over


def test_fp32_or_no_block_to_code_keeps_the_bits():
    """--pull-codec fp32 (auto's meaning for --mode tcp and topk), or a fraction that
    codes no block, is no codec: the shard makes no coder, and the aggregate's bits are
    those of before."""
    lay_cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, pull_codec="fp32")
    fab = run(lay_cfg)[0]
    assert pull_coder(lay_cfg, fab.lay, 0) is None
    zero = TransmissionConfig(block_bytes=64, pace_mbit=0, pull_codec="int8",
                              pull_coded_fraction=0.0)
    assert pull_coder(zero, fab.lay, 0) is None
    # one node: its only PULL is in-process, so nothing is coded (auto or int8 alike)
    from dgt.layout import BlockLayout
    alone = BlockLayout.from_bytes(5000, 64, 1)
    assert pull_coder(TransmissionConfig(block_bytes=64, pull_codec="int8"), alone, 0) is None
    assert pull_coder(TransmissionConfig(block_bytes=64), fab.lay, 0) is not None
    coded = with_pull_codec(TransmissionConfig(block_bytes=64, pace_mbit=0,
                                               pull_codec="int8"))[0]
    assert coded.aggs[0].tobytes() != fab.aggs[0].tobytes()


def test_the_lowest_contribution_blocks_are_coded_and_fp16_overflow_goes_f32():
    e, n = 8, 10
    acc = np.arange(1, n + 1, dtype=np.float32)[:, None] * np.ones((n, e), np.float32)
    acc[0] *= -1                 # |.| ranks, not the sign
    acc[1] = 1e5                 # fp16 overflows: this block goes f32 although ranked low
    acc[2] = 0.0                 # the lowest contribution
    coder = PullCoder(Coding.FP16, 0.4, n, e)
    before = acc.copy()
    cp = coder.code(acc)
    # mean |c|: block 2 0, block 0 1, block 3 4, block 4 5: the four lowest
    assert np.flatnonzero(cp.coded).tolist() == [0, 2, 3, 4]
    big = PullCoder(Coding.FP16, 1.0, n, e)
    cp2 = big.code(before.copy())
    assert not cp2.coded[1] and cp2.coded.sum() == n - 1   # the overflow goes f32
    assert np.isfinite(big.residual).all()


def test_a_coded_pull_on_the_wire_decodes_to_what_the_shard_applied():
    """The PULL bytes (dgt.transport.messages.pull) read back (wire.decode, then
    unpack_coded_pull, then dgt.pull_codec.decode_pull) are bitwise the aggregate the
    shard applied in-process, and fewer than an f32 PULL's."""
    e, n = 352, 40
    rng = np.random.default_rng(0)
    cases = [(c, 0.5) for c in (Coding.FP16, Coding.BF16, Coding.INT8, Coding.INT4)]
    cases += [(Coding.INT8, 1.0), (Coding.FP16, 1.0)]   # every block coded; below, none
    for coding, fraction in cases:
        acc = (rng.standard_normal((n, e)) * rng.uniform(0.01, 3, (n, 1))).astype(np.float32)
        if fraction == 1.0 and coding == Coding.FP16:
            acc[:] = 1e6   # fp16 overflows everywhere: every block goes f32
        coder = PullCoder(coding, fraction, n, e)
        cp = coder.code(acc)
        received = rng.random(n) < 0.8
        frame = b"".join(bytes(p) for p in messages.pull(
            7, 1, 3, 40, acc.reshape(-1), received, b"k", cp.wire_parts()))
        plain = b"".join(bytes(p) for p in messages.pull(7, 1, 3, 40, acc.reshape(-1),
                                                         received, b"k"))
        assert len(frame) < len(plain) or not cp.coded.any()
        h, payload = wire.decode(frame, b"k")
        assert wire.coding_of(h.flags) == coding
        agg, rows, rec, coded = wire.unpack_coded_pull(payload, n, e, coding)
        assert np.array_equal(rec, received) and np.array_equal(coded, cp.coded)
        out = decode_pull(PullArrived(1, 3, agg, rec, coding, coded, rows), e)
        assert out.tobytes() == acc.tobytes()


def control():
    c = ControlProtocol(rank=0, world=2, authenticated=False, rejected={})
    c.set_session(7, 0.0)
    c.set_layout({0: (0, 5), 1: (5, 5)}, 4)
    c.connected(3, 1, 0.0)
    return c


def pull_frame(payload: bytes, coding: int):
    return wire.decode(wire.encode(MsgType.PULL, session=7, sender=1, shard=1, block=5,
                                   count=5, payload=payload,
                                   flags=coding << wire.CODING_SHIFT))


def test_malformed_coded_pulls_are_counted_and_dropped():
    """A stranger's (or a broken peer's) coded PULL: an unknown coding, a length that
    is not what its coded bitmap says, a coded block that decodes to NaN. Each is a
    counted reason, never an exception."""
    c = control()
    e, n = 4, 5
    acc = np.arange(n * e, dtype=np.float32).reshape(n, e) + 1
    cp = PullCoder(Coding.INT8, 0.4, n, e).code(acc)
    good = b"".join(bytes(p) for p in wire.coded_pull_parts(
        cp.plain, cp.payloads, np.ones(n, bool), cp.coded))
    (ev,) = c.receive_frame(3, *pull_frame(good, Coding.INT8), 1.0)
    assert isinstance(ev, PullArrived) and ev.coded.tolist() == cp.coded.tolist()
    assert decode_pull(ev, e).tobytes() == acc.tobytes()
    assert c.receive_frame(3, *pull_frame(good, 5), 1.0) == [Rejected("bad_coding")]
    assert c.receive_frame(3, *pull_frame(good[1:], Coding.INT8), 1.0) == \
        [Rejected("bad_length")]
    # the coded bitmap (last byte) announces one more coded block than the payload has
    more = good[:-1] + bytes([good[-1] | 0x80 >> int(np.flatnonzero(~cp.coded)[0])])
    assert c.receive_frame(3, *pull_frame(more, Coding.INT8), 1.0) == \
        [Rejected("bad_length")]
    assert c.receive_frame(3, *pull_frame(b"", Coding.INT4), 1.0) == \
        [Rejected("bad_length")]
    assert c.receive_frame(3, *pull_frame(good, Coding.INT4), 1.0) == \
        [Rejected("bad_length")]
    # a NaN scale: decodes non-finite; the node counts non_finite_pull and drops it
    nan = bytearray(good)
    off = 4 * cp.plain.size
    nan[off:off + 4] = np.array([np.nan], "<f4").tobytes()
    (ev,) = c.receive_frame(3, *pull_frame(bytes(nan), Coding.INT8), 1.0)
    assert decode_pull(ev, e) is None
    assert c.rejected == {"bad_coding": 1, "bad_length": 4}


def test_checkpoint_state_round_trips():
    coder = PullCoder(Coding.INT4, 0.5, 6, 8)
    coder.code(torch.randn(6, 8).numpy())
    other = PullCoder(Coding.INT4, 0.5, 6, 8)
    other.load_state_dict(coder.state_dict())
    assert other.residual.tobytes() == coder.residual.tobytes() and not other.empty
    with pytest.raises(ValueError):
        PullCoder(Coding.INT4, 0.5, 5, 8).load_state_dict(coder.state_dict())


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--pull-coded-fraction"):
        TransmissionConfig(pull_coded_fraction=1.5).validate()
    assert TransmissionConfig(pull_codec="int4").pull_coding() == Coding.INT4
    assert TransmissionConfig(pull_codec="fp32").pull_coding() == Coding.FP32
    # auto (the default) follows --mode: int8 where blocks are ranked, fp32 for baselines
    assert TransmissionConfig().pull_coding() == Coding.INT8
    assert TransmissionConfig(mode="random").pull_coding() == Coding.INT8
    assert TransmissionConfig(mode="tcp").pull_coding() == Coding.FP32
    assert TransmissionConfig(mode="topk").pull_coding() == Coding.FP32
