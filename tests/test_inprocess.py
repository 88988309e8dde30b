"""Worker agents + server shards wired through an in-memory fabric (no sockets,
dgt.tools.inprocess): the whole DGT data path, deterministic, with seeded loss and
shuffled delivery order."""
import asyncio
import warnings

import numpy as np
import torch
import pytest

from dgt.config import TransmissionConfig
from dgt.tools.inprocess import Fabric
from dgt.transport import wire


def run(cfg, steps=6, world=4, n_params=5000, drop=0.0, seed=0, shuffle=False, parts=()):
    fab = Fabric(cfg, n_params, world, drop, seed, shuffle)
    gen = np.random.default_rng(123)
    computed = np.zeros(fab.lay.padded)
    applied = np.zeros(fab.lay.padded)

    async def main():
        nonlocal computed, applied
        for t in range(steps):
            grads = [gen.standard_normal(n_params).astype(np.float32) for _ in range(world)]
            for g in grads:
                computed[:n_params] += g
            await fab.step(t, grads, parts)
            aggs = {fab.aggs[r].tobytes() for r in range(world)}
            assert len(aggs) == 1, "every replica applies the same aggregate"
            applied += fab.aggs[0].astype(np.float64) * world
    asyncio.run(main())
    residual = sum(a.residual.residual.double().numpy() if cfg.error_feedback
                   else np.zeros(fab.lay.padded) for a in fab.agents)
    return fab, computed, applied, residual


@pytest.mark.parametrize("mode", ["dgt", "topk", "random", "tcp"])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_conservation_invariant(mode, drop):
    cfg = TransmissionConfig(mode=mode, block_bytes=64, pace_mbit=0)
    fab, computed, applied, residual = run(cfg, drop=drop)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5
    lost = sum(s.session.counters.channels[c].blocks_lost for s in fab.shards
               for c in range(1, 4))
    assert (lost > 0) == (drop > 0 and mode in ("dgt", "random"))


def test_without_error_feedback_mass_is_lost():
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, error_feedback=False)
    _, computed, applied, residual = run(cfg, drop=0.3)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err > 1e-2


def test_aggregate_bits_do_not_depend_on_arrival_order():
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0)
    a = run(cfg, seed=1, shuffle=False)[0]
    b = run(cfg, seed=1, shuffle=True)[0]
    assert a.aggs[0].tobytes() == b.aggs[0].tobytes()


def test_reliable_share_follows_k():
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, k=0.25)
    fab = run(cfg, steps=2)[0]
    sent = [sum(a.counters.channels[c].blocks_sent for a in fab.agents) for c in range(4)]
    assert sent[0] / sum(sent) == pytest.approx(0.25, abs=0.02)
    assert sent[1] == pytest.approx(sent[3], rel=0.1)


def test_contribution_picks_the_large_blocks():
    """With one block 100x larger than the rest on every worker, it always goes
    reliable, so it is never lost even at 90% UDP loss."""
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, k=0.1)
    fab = Fabric(cfg, 1600, 2, drop=0.9, seed=3)
    hot = 37 * 16  # block 37

    async def main():
        for t in range(3):
            g = np.random.default_rng(t).standard_normal(1600).astype(np.float32) * 0.01
            g[hot:hot + 16] = 1.0
            await fab.step(t, [g, g])
            assert np.allclose(fab.aggs[0][hot:hot + 16], 1.0)
    asyncio.run(main())


@pytest.mark.parametrize("k", [0.3, 0.5])
def test_push_reports_the_k_it_used(k):
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, k=k)
    fab = Fabric(cfg, 3000, 4)

    async def main():
        g = np.ones(3000, np.float32)
        return await asyncio.gather(*(a.push(0, None, 5.0) for a in fab.agents
                                      if not fab.grads[a.rank].__setitem__(slice(0, 3000), g)))
    assert asyncio.run(main()) == [k] * 4


def test_a_workers_own_non_finite_blocks_are_sent_as_zeros_and_not_kept():
    """A NaN or inf in a worker's own gradient (its overflow) is caught where the
    block is scored: the block is sent as zeros and nothing of it stays in the residual
    or the scores. The aggregate stays finite and identical on every replica, and
    counts the worker as zero there, as the shard counts a block it kept out."""
    cfg = TransmissionConfig(k=0.5, band_codec="fp32")
    fab = Fabric(cfg, 5000, 4)
    lay = fab.lay
    gen = np.random.default_rng(7)
    grads = [gen.standard_normal(5000).astype(np.float32) for _ in range(4)]
    bad = [3, lay.shard_lo(2) + 1]            # two blocks of worker 1, on two shards
    for b in bad:
        grads[1][b * lay.block_elems + 5] = np.nan if b == 3 else np.inf
    asyncio.run(fab.step(0, grads))
    agg = fab.aggs[0]
    assert np.isfinite(agg).all()
    assert len({a.tobytes() for a in fab.aggs}) == 1
    e = lay.block_elems
    for b in bad:   # the other three workers' mean over N, worker 1 counted as zero
        want = (grads[0] + grads[2] + grads[3])[b * e:(b + 1) * e] / np.float32(4)
        np.testing.assert_allclose(agg[b * e:(b + 1) * e], want, rtol=1e-6)
    assert fab.agents[1].counters.blocks_non_finite == 2
    assert sum(a.counters.blocks_non_finite for a in fab.agents) == 2
    assert sum(s.session.counters.rejected["non_finite"] for s in fab.shards) == 0
    assert np.isfinite(fab.agents[1].residual.residual.numpy()).all()
    assert torch.isfinite(fab.agents[1].planner.scores.scores).all()


def test_a_forged_non_finite_block_is_kept_out_and_its_sender_keeps_its_own():
    """A NaN that reaches the shard in place of a worker's block (a forged datagram
    that got in first) is excluded there like a lost block: zero in the sum, counted
    as rejected 'non_finite', and its sender keeps its own, finite, gradient in the
    residual (error feedback)."""
    cfg = TransmissionConfig(k=0.5, band_codec="fp32", epsilon=0.0)
    fab = Fabric(cfg, 5000, 4)
    e, hb = fab.lay.block_elems, wire.HEADER_BYTES
    deliver, hit = fab._udp_to, []

    def forge(channel, s, rows):   # worker 1's first datagram to shard 2 turns NaN
        h = wire.decode_header(rows[0].tobytes()) if len(rows) else None
        if h is not None and h.sender == 1 and s == 2 and not hit:
            rows = rows.copy()
            rows[0, hb:hb + 4 * e] = np.full(e, np.nan, np.float32).view(np.uint8)
            hit.append(h.block)
        return deliver(channel, s, rows)
    for a in fab.agents:
        a.links.send_udp = forge
    grads = [np.random.default_rng(r).standard_normal(5000).astype(np.float32)
             for r in range(4)]
    asyncio.run(fab.step(0, grads))
    assert hit, "worker 1 sent shard 2 a datagram"
    b = hit[0]
    agg = fab.aggs[0]
    assert np.isfinite(agg).all()
    assert len({a.tobytes() for a in fab.aggs}) == 1
    want = (grads[0] + grads[2] + grads[3])[b * e:(b + 1) * e] / np.float32(4)
    np.testing.assert_allclose(agg[b * e:(b + 1) * e], want, rtol=1e-6)
    assert sum(s.session.counters.rejected["non_finite"] for s in fab.shards) == 1
    assert fab.agents[1].counters.blocks_non_finite == 0
    res = fab.agents[1].residual.residual.numpy()
    assert np.array_equal(res[b * e:(b + 1) * e], grads[1][b * e:(b + 1) * e])


@pytest.mark.parametrize("parts", [(), "PARTS"])
@pytest.mark.parametrize("band_codec", ["fp32", "int8"])
def test_one_non_finite_push_leaves_no_trace_in_later_iterations(parts, band_codec):
    """Worker 1's gradient holds a NaN and an inf at step 2 only, with loss on the UDP
    bands (lost blocks are kept in the residual) and --check-conservation. Before the
    fix the residual kept the NaN for good: every later push of that block was g + NaN,
    kept out at the shard in every iteration (an outside tester's DDP run: rank 1's
    block missing from iteration 3 to the end, without a word). Now only step 2 misses
    it; the residual and the scores stay finite, and the conservation invariant holds
    with the two blocks' mass (their gradient and what the residual held of them)
    taken out of its left side."""
    parts = PARTS if parts else ()
    cfg = TransmissionConfig(k=0.5, band_codec=band_codec, block_bytes=64, pace_mbit=0,
                             check_conservation=True)
    fab = Fabric(cfg, 5000, 4, drop=0.3, seed=1)
    lay, e = fab.lay, fab.lay.block_elems
    gen = np.random.default_rng(5)
    bad = [3, lay.shard_lo(2) + 1]

    async def main():
        for t in range(6):
            grads = [gen.standard_normal(5000).astype(np.float32) for _ in range(4)]
            if t == 2:
                grads[1][3 * e + 1] = np.nan
                grads[1][bad[1] * e + 2] = np.inf
            await fab.step(t, grads, parts)
            assert np.isfinite(fab.aggs[0]).all(), t
            assert len({a.tobytes() for a in fab.aggs}) == 1, t
    asyncio.run(main())
    assert sum(s.session.counters.rejected["non_finite"] for s in fab.shards) == 0
    assert fab.agents[1].counters.blocks_non_finite == 2
    for a in fab.agents:
        assert np.isfinite(a.residual.residual.numpy()).all()
        assert torch.isfinite(a.planner.scores.scores).all()
    raw = sum(a.raw_sum.numpy() for a in fab.agents)
    kept = sum(a.residual.residual.double().numpy() for a in fab.agents)
    applied = fab.agents[0].applied_sum.numpy()
    assert np.isfinite(raw).all()
    assert np.linalg.norm(applied + kept - raw) / np.linalg.norm(raw) < 1e-5


def test_a_finite_block_whose_magnitude_overflows_keeps_a_finite_score():
    """Values near float32's largest: the block's mean |g| overflows to inf, and an
    EMA that took it would stay inf for ever. The block is sent (it is finite) and its
    score is its float64 mean, at most half float32's largest."""
    from dgt.contribution import MAX_MAGNITUDE, drop_non_finite
    blocks = torch.ones(3, 4)
    blocks[1] = 3e38
    blocks[2, 0] = float("nan")
    mag = blocks.abs().mean(dim=1)
    assert not torch.isfinite(mag[1])
    bad = drop_non_finite(blocks, mag)
    assert bad.tolist() == [2]
    assert mag.tolist() == [1.0, MAX_MAGNITUDE, 0.0]
    assert (blocks[1] == torch.tensor(3e38)).all() and not blocks[2].any()
    assert drop_non_finite(torch.ones(2, 4), torch.ones(2)) is None


# -- a push in parts (wait-free backpropagation, dgt.parts) ---------------------------
#: the hook's buckets: last layers first, cut inside blocks (16 elements a block here);
#: the second is two runs of blocks, the third completes the blocks between them
PARTS = (((3001, 5000),), ((1234, 2000), (2500, 3001)), ((2000, 2500), (1000, 1234)))
# the push sends [0, 1000)


@pytest.mark.parametrize("mode", ["dgt", "topk", "random"])
def test_a_push_in_parts_conserves_mass_and_sends_each_block_once(mode):
    cfg = TransmissionConfig(mode=mode, block_bytes=64, pace_mbit=0, epsilon=0.1)
    fab, computed, applied, residual = run(cfg, drop=0.3, parts=PARTS)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5
    n_blocks = fab.lay.n_blocks
    for a in fab.agents:   # 6 pushes, each block sent, kept local or dropped once
        ctr = a.counters
        assert sum(ctr.channels[c].blocks_sent for c in range(4)) + ctr.blocks_local + \
            ctr.blocks_unsent == 6 * n_blocks
    assert not sum(s.session.counters.channels[c].blocks_duplicate for s in fab.shards
                   for c in range(4))
    assert sum(s.session.counters.channels[c].blocks_lost for s in fab.shards
               for c in range(1, 4)) > 0 or mode == "topk"


@pytest.mark.parametrize("mode", ["tcp", "dgt"])
def test_a_push_in_parts_applies_the_bits_of_a_whole_push(mode):
    # nothing lost: the same blocks reach the shards, whatever channel each took (f32
    # bands: a coded band's bits depend on which blocks the per-part ranking sent on it)
    cfg = TransmissionConfig(mode=mode, block_bytes=64, pace_mbit=0, band_codec="fp32")
    whole = run(cfg)[0]
    parted = run(cfg, parts=PARTS)[0]
    assert whole.aggs[0].tobytes() == parted.aggs[0].tobytes()
    # the parts went before the push, each in its own reliable frame per shard
    blocks = wire.MsgType.BLOCKS
    assert whole.frames[blocks] == 6 * 4 * 3   # iterations x workers x remote shards
    assert parted.frames[blocks] > whole.frames[blocks]


def test_parts_refuse_bad_ranges():
    fab = Fabric(TransmissionConfig(block_bytes=64, pace_mbit=0), 100, 1)

    async def main():
        await fab.step(0, [np.ones(100, np.float32)])
        agent = fab.agents[0]
        agent.parts.add(1, [[0, 50]])
        for bad in ([[40, 60]], [[60, 101]], [[5, 5]], "0-10", [[0.5, 3]]):
            with pytest.raises(ValueError):
                agent.parts.add(1, bad)
        await agent.push(1, None, 5.0)
    asyncio.run(main())


# -- coded bands (dgt.codec): the coding error is the residual's, as a lost block is ----

CODECS = ["fp16", "bf16", "int8", "int4", "1:fp32,2:bf16,3:int4"]


@pytest.mark.parametrize("band_codec", CODECS)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_conservation_invariant_with_coded_bands(band_codec, drop):
    """sum of applied aggregates x N + residuals = sum of gradients, with every band
    coded (and, with drop, coded blocks lost too); replicas agree (run() checks)."""
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec=band_codec)
    fab, computed, applied, residual = run(cfg, drop=drop)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5
    # the bands were coded: fewer bytes than f32 datagrams, and a coding error kept
    plain = run(TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="fp32"),
                drop=drop)[0]
    sent = [sum(a.counters.channels[c].bytes_sent for a in f.agents for c in range(1, 4))
            for f in (fab, plain)]
    assert sent[0] < sent[1]
    assert any(a.planner.coding_error is not None and a.planner.coding_error.abs().sum() > 0
               for a in fab.agents)


@pytest.mark.parametrize("band_codec", ["fp16", "bf16", "int8", "int4"])
def test_a_lost_and_a_delivered_coded_block_both_conserve(band_codec):
    """One push, one worker's view: a delivered coded block leaves exactly
    g - decode(encode(g)) in the residual (nonzero), a lost one leaves g; the shard
    applied decode(encode(g)) for the delivered one and nothing for the lost one."""
    from dgt import codec
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec=band_codec,
                             k=0.0, channels=1)   # every block on coded udp1
    fab = Fabric(cfg, 2000, 2, drop=0.5, seed=3)
    g0 = np.random.default_rng(5).standard_normal((2, 2000)).astype(np.float32)
    fab.agents[0].residual.track_norm = True   # as a sidecar serving metrics does
    asyncio.run(fab.step(0, list(g0)))
    lay, coding = fab.lay, cfg.band_codings()[1]
    agent = fab.agents[0]
    arrived = np.concatenate([fab.bitmaps[0, s] for s in range(2)])
    remote = np.ones(lay.n_blocks, bool)
    remote[lay.shard_lo(0):lay.shard_hi(0)] = False   # the colocated shard: no coding
    # the first push: the residual was empty, so the push is the gradient itself
    g = fab.grads[0].reshape(lay.n_blocks, lay.block_elems)
    res = agent.residual.residual.numpy().reshape(lay.n_blocks, lay.block_elems)
    delivered, lost = np.flatnonzero(remote & arrived), np.flatnonzero(remote & ~arrived)
    assert delivered.size and lost.size, "the seeded loss keeps some and drops some"
    dec = codec.decode(coding, codec.encode(coding, torch.from_numpy(g[delivered].copy())),
                       lay.block_elems)
    assert np.array_equal(res[delivered], g[delivered] - dec)
    assert np.abs(res[delivered]).sum() > 0
    assert np.array_equal(res[lost], g[lost])
    assert not res[~remote].any()   # local blocks go whole, in-process
    # the metrics gauge's norm, kept by the update from lost blocks and coding errors,
    # is the buffer's
    assert agent.residual.norm() == pytest.approx(float(np.linalg.norm(res.astype(np.float64))),
                                                  rel=1e-5)
    assert fab.agents[1].residual.norm() is None   # not tracked
    # what the shard applied: the decoded block (plus the other worker's), never g itself
    other = fab.grads[1].reshape(lay.n_blocks, lay.block_elems)
    other_res = fab.agents[1].residual.residual.numpy().reshape(lay.n_blocks, -1)
    agg = fab.aggs[0].reshape(lay.n_blocks, lay.block_elems).astype(np.float64) * 2
    total = agg + res + other_res
    assert np.allclose(total, g.astype(np.float64) + other, rtol=1e-5, atol=1e-5)


def test_fp32_bands_keep_the_bits_of_before():
    """--band-codec fp32 sends the same bytes and applies the same bits as a per-band
    spec that names fp32 (and codes nothing)."""
    a = run(TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="fp32"), drop=0.3)[0]
    b = run(TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="1:fp32"), drop=0.3)[0]
    assert a.aggs[0].tobytes() == b.aggs[0].tobytes()
    assert all(ag.planner.coded == {} for ag in (*a.agents, *b.agents))


def test_the_default_band_codec_follows_the_mode():
    """--band-codec auto (the default): --mode dgt codes its UDP bands in int8 (fewer
    bytes than fp32 on every band), --mode tcp sends every block f32 on TCP."""
    from dgt.transport.wire import Coding
    assert TransmissionConfig().band_codings()[1:4] == [int(Coding.INT8)] * 3
    assert TransmissionConfig(mode="tcp").band_codings() == TransmissionConfig(
        band_codec="fp32").band_codings()
    auto = run(TransmissionConfig(block_bytes=64, pace_mbit=0))[0]
    fp32 = run(TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="fp32"))[0]
    sent = [[sum(a.counters.channels[c].bytes_sent for a in f.agents) for c in range(1, 4)]
            for f in (auto, fp32)]
    assert all(0 < x < y for x, y in zip(*sent)), sent


@pytest.mark.parametrize("band_codec", ["int8", "1:fp16,2:bf16,3:int4"])
def test_a_push_in_parts_with_coded_bands_conserves_mass(band_codec):
    """The DDP hook's parts (dgt.parts) and coded bands together: each part's coded
    blocks keep their coding error, the lost ones keep g, so mass is conserved."""
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec=band_codec)
    fab, computed, applied, residual = run(cfg, drop=0.3, parts=PARTS)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5
    plain = run(TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="fp32"),
                drop=0.3, parts=PARTS)[0]
    sent = [sum(a.counters.channels[c].bytes_sent for a in f.agents for c in range(1, 4))
            for f in (fab, plain)]
    assert sent[0] < sent[1]


@pytest.mark.parametrize("reliable_codec", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("parts", [(), PARTS])
def test_a_coded_reliable_channel_conserves_mass(reliable_codec, parts):
    """--reliable-codec: the top-k share goes over TCP in a reduced form, the bands in
    int8, with loss on the bands, in one push and in parts. Mass is conserved (each
    reliable block leaves its coding error in the residual), the replicas agree (run()
    checks), and the reliable channel sends fewer bytes than in f32."""
    base = dict(block_bytes=64, pace_mbit=0, band_codec="int8")
    fab, computed, applied, residual = run(
        TransmissionConfig(reliable_codec=reliable_codec, **base), drop=0.3, parts=parts)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5
    plain = run(TransmissionConfig(**base), drop=0.3, parts=parts)[0]
    sent = [sum(a.counters.channels[0].bytes_sent for a in f.agents) for f in (fab, plain)]
    assert 0 < sent[0] < sent[1]
    if not parts:   # in parts, ``coded`` is the last part's (maybe only local blocks)
        assert all(0 in a.planner.coded for a in fab.agents)
        assert all(0 not in a.planner.coded for a in plain.agents)


def test_a_coded_reliable_channel_in_tcp_mode_differs_from_plain_tcp():
    """--mode tcp with --reliable-codec fp16 codes every remote block: its aggregate is
    not plain tcp's, and without the coding error in the residual mass would be lost
    (the residual is not zero after a lossless run)."""
    a, computed, applied, residual = run(TransmissionConfig(
        mode="tcp", block_bytes=64, pace_mbit=0, reliable_codec="fp16"))
    b = run(TransmissionConfig(mode="tcp", block_bytes=64, pace_mbit=0))[0]
    assert a.aggs[0].tobytes() != b.aggs[0].tobytes()
    assert np.abs(residual).sum() > 0
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5


@pytest.mark.parametrize("pull_codec", ["fp32", "int8"])
def test_finite_blocks_whose_sum_overflows_put_no_warning_in_the_log(pull_codec):
    """Finite blocks near float32's limit (a forged datagram, a diverging worker) whose
    sum overflows: numpy warns nothing (breaker: 'RuntimeWarning: overflow encountered
    in reduce' in the sidecars' logs, from the shard's finite check and --pull-codec's
    ranking), and the aggregate is their mean, finite (breaker round 6: it was float32's
    sum, inf, on every replica)."""
    cfg = TransmissionConfig(mode="tcp", block_bytes=64, pace_mbit=0, pull_codec=pull_codec)
    fab = Fabric(cfg, 5000, 2, pull_codecs=True, wire_pulls=True)
    assert (fab.shards[0].coder is None) == (pull_codec == "fp32")
    e = fab.lay.block_elems
    grads = [np.ones(5000, np.float32) for _ in range(2)]
    for g in grads:
        g[:e] = 1e38           # 2e38 an element: finite, the block's sum is not
        g[e:2 * e] = 3e38      # 6e38: inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(fab.step(0, grads))
    assert len({a.tobytes() for a in fab.aggs}) == 1
    agg = fab.aggs[0]
    assert np.isfinite(agg).all()
    if pull_codec == "fp32":   # float32's sum, then / 2; past the limit, float64's mean
        assert (agg[:e] == np.float32(1e38)).all()
        assert (agg[e:2 * e] == np.float32(3e38)).all()
    assert (agg[2 * e:5000] == 1).all()
