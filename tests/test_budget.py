"""The time budget (--time-budget-ms): the sans-IO class fed measurements
(dgt.scheduler.budget), the planner's cut (dgt.planner), and the whole data path with
it on (the in-memory fabric of test_inprocess: conservation, identical replicas)."""
import math

import numpy as np
import pytest
import torch

from dgt.config import TransmissionConfig
from dgt.layout import BlockLayout
from dgt.planner import PushPlanner
from dgt.scheduler.assign import DROPPED
from dgt.scheduler.budget import TimeBudget
from test_inprocess import PARTS, run

BLOCK = 1412.0   # a reliable f32 block of 352 values: payload and u32 index, bytes


# -- the class, fed measurements ------------------------------------------------------
def test_no_measurement_no_cap():
    tb = TimeBudget(0.1)
    assert tb.allowance is None
    assert tb.fit(torch.full((50,), BLOCK), floor=5) == 50


def test_what_is_sent_fits_the_budget():
    tb = TimeBudget(0.5)
    tb.observe(sent_bytes=10e6, send_s=2.0)          # 5 MB/s
    assert tb.rate == 5e6 and tb.allowance == pytest.approx(2.5e6)
    cost = torch.full((10_000,), BLOCK)
    m = tb.fit(cost, floor=10)
    assert m == int(2.5e6 // BLOCK)                   # 1770 blocks
    assert cost[:m].sum() <= 2.5e6 < cost[:m + 1].sum()


def test_ranks_that_cost_nothing_do_not_use_the_allowance():
    tb = TimeBudget(1.0)
    tb.observe(3 * BLOCK, 1.0)                        # room for 3 blocks
    cost = torch.tensor([BLOCK, 0, BLOCK, 0, 0, BLOCK, BLOCK, 0])
    assert tb.fit(cost, floor=1) == 6                 # 3 paid ranks and the free between


def test_the_floor_holds_and_a_push_is_never_empty():
    tb = TimeBudget(1e-6)
    tb.observe(1e6, 1.0)                              # allowance 1 byte: no block fits
    cost = torch.full((100,), BLOCK)
    assert tb.fit(cost, floor=20) == 20
    assert tb.fit(cost, floor=1) == 1
    assert tb.fit(cost[:3], floor=20) == 3            # never more than there is


def test_a_part_gets_its_share_of_the_allowance():
    tb = TimeBudget(1.0)
    tb.observe(100 * BLOCK, 1.0)
    cost = torch.full((100,), BLOCK)
    assert tb.fit(cost, floor=1, share=0.25) == 25


def test_the_median_ignores_one_slow_push_and_follows_a_lasting_change():
    tb = TimeBudget(1.0)
    for _ in range(5):
        tb.observe(10e6, 1.0)
    tb.observe(10e6, 10.0)                            # one hiccup: 1 MB/s
    assert tb.rate == 10e6
    tb.observe(10e6, 10.0)
    assert tb.rate == 10e6                            # two of five: still the median
    tb.observe(10e6, 10.0)
    assert tb.rate == 1e6                             # three: the link is slower now


def test_bad_measurements_are_no_observation():
    tb = TimeBudget(1.0)
    for sent, s in ((0, 1.0), (1e6, 0.0), (1e6, -1.0), (float("nan"), 1.0),
                    (1e6, float("inf")), (1e300, 1e-300)):
        tb.observe(sent, s)
    assert tb.rate is None


def test_the_measured_rates_survive_a_checkpoint():
    """dgt.checkpoint keeps them: a resumed run does not start with one whole push."""
    import pickle
    tb = TimeBudget(0.5)
    for s in (1.0, 2.0, 4.0):
        tb.observe(8e6, s)
    again = TimeBudget(0.5)
    again.load_state_dict(pickle.loads(pickle.dumps(tb.state_dict())))
    assert again.rates == tb.rates and again.allowance == tb.allowance == 2e6


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_budget_must_be_a_positive_time(bad):
    with pytest.raises(ValueError, match="budget_s"):
        TimeBudget(bad)


def simulate(tb, rates, overhead_s, blocks=20_000, floor=100):
    """A link that takes ``overhead_s + bytes / rate`` per push; returns (blocks sent,
    push seconds) per push, the budget fed each push's measurement."""
    cost = torch.full((blocks,), BLOCK)
    out = []
    for rate in rates:
        m = tb.fit(cost, floor)
        sent = float(cost[:m].sum())
        s = overhead_s + sent / rate
        tb.observe(sent, s)
        out.append((m, s))
    return out


def test_closed_loop_settles_at_the_budget_and_recovers_when_the_link_speeds_up():
    budget_s, o = 0.4, 0.02
    tb = TimeBudget(budget_s)
    slow, fast = 12.5e6, 50e6                           # 100 and 400 Mbit/s
    hist = simulate(tb, [slow] * 15 + [fast] * 15, o)
    first = hist[0]
    assert first[0] == 20_000 and first[1] > 2.0        # unmeasured: all of it, 2.28 s
    for m, s in hist[10:15]:                            # settled on the slow link
        assert s == pytest.approx(budget_s, rel=0.01)
        assert m == pytest.approx(slow * (budget_s - o) / BLOCK, rel=0.01)
    for m, s in hist[25:]:                              # and on the fast one
        assert s == pytest.approx(budget_s, rel=0.01)
        assert m == pytest.approx(fast * (budget_s - o) / BLOCK, rel=0.01)


def test_closed_loop_rests_on_the_floor_when_the_budget_is_below_the_overhead():
    tb = TimeBudget(0.01)
    hist = simulate(tb, [12.5e6] * 20, overhead_s=0.02, floor=10)
    assert [m for m, _ in hist[-5:]] == [10] * 5
    # and leaves it when the budget can be met again (the overhead gone)
    hist = simulate(tb, [12.5e6] * 10, overhead_s=0.0, floor=10)
    assert hist[-1][0] == pytest.approx(12.5e6 * 0.01 / BLOCK, abs=1)


# -- the planner's cut ----------------------------------------------------------------
def planner(world=4, n_params=20_000, **kw):
    cfg = TransmissionConfig(block_bytes=1408, pace_mbit=0, **kw)
    lay = BlockLayout.from_bytes(n_params, cfg.block_bytes, world)
    return PushPlanner(cfg, lay, rank=1, seed=0), lay


def test_off_by_default():
    p, _ = planner()
    assert p.budget is None


def test_the_cut_takes_the_lowest_ranked_remote_blocks_and_never_local_ones():
    p, lay = planner(time_budget_ms=100.0, band_codec="fp32")   # f32 datagrams below
    g = torch.from_numpy(np.random.default_rng(0).standard_normal(lay.padded)
                         .astype(np.float32))
    chan0, _ = p.plan(g, None)                        # no measurement yet: every block
    assert p.budget_cut == 0 and (chan0 >= 0).all()
    local = np.zeros(lay.n_blocks, bool)
    local[lay.shard_lo(1):lay.shard_hi(1)] = True
    for room in (2.5, 10.5, 40.5):   # blocks' worth of bytes: the floor rules, then not
        p.budget.rates.clear()
        p.budget.observe(room * BLOCK, 0.1)           # in a 100 ms budget
        chan, _ = p.plan(g, None)
        scores = p.scores.scores.numpy()
        rank = np.empty(lay.n_blocks, int)
        rank[np.argsort(-scores, kind="stable")] = np.arange(lay.n_blocks)
        assert (chan[local] >= 0).all(), "the colocated shard's blocks cost the link nothing"
        cut, sent = chan == DROPPED, ~local & (chan >= 0)
        assert p.budget_cut == np.count_nonzero(cut) > 0
        assert rank[cut].min() > rank[sent].max(), "the lowest ranked are cut"
        floor = math.ceil(0.2 * lay.n_blocks)         # ranks, local ones included
        if room == 2.5:
            assert np.count_nonzero(sent) == np.count_nonzero(~local & (rank < floor))
        else:   # the bytes that fit, reliable blocks first, then udp1 (a datagram each)
            n_rel = math.ceil(0.5 * lay.n_blocks)
            rel = np.count_nonzero(~local & (rank < n_rel))
            assert np.count_nonzero(sent & (chan == 0)) == min(int(room), rel)
            udp = int((room * BLOCK - rel * BLOCK) // (34 + 1408)) if room > rel else 0
            assert np.count_nonzero(sent & (chan > 0)) == udp


def test_a_generous_budget_cuts_nothing_and_changes_no_channel():
    p, lay = planner(time_budget_ms=1000.0)
    q, _ = planner()
    g = torch.from_numpy(np.random.default_rng(1).standard_normal(lay.padded)
                         .astype(np.float32))
    p.budget.observe(1e9, 1.0)
    for _ in range(3):
        a, _ = p.plan(g, None)
        b, _ = q.plan(g, None)
        assert np.array_equal(a, b) and p.budget_cut == 0


# -- the data path with the budget on ---------------------------------------------------
def conservation_error(computed, applied, residual):
    return np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)


@pytest.mark.parametrize("mode", ["dgt", "tcp", "topk"])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_conservation_holds_with_the_time_budget_cutting(mode, drop):
    """A budget of 1 ns leaves the floor: most remote blocks are cut every push after
    the first; their mass waits in the residual, and the invariant holds (run() also
    checks that every replica applies the same aggregate)."""
    cfg = TransmissionConfig(mode=mode, block_bytes=64, pace_mbit=0, time_budget_ms=1e-6)
    fab, computed, applied, residual = run(cfg, drop=drop)
    assert conservation_error(computed, applied, residual) < 1e-4
    cut = [a.meter.cut_total for a in fab.agents]
    assert all(c > 0 for c in cut)
    assert sum(cut) <= sum(a.counters.blocks_unsent for a in fab.agents)
    assert all(a.meter.last["push_bytes"] > 0 for a in fab.agents)


def test_conservation_holds_with_the_time_budget_and_a_push_in_parts():
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, time_budget_ms=1e-6,
                             band_codec="int8")
    fab, computed, applied, residual = run(cfg, drop=0.3, parts=PARTS)
    assert conservation_error(computed, applied, residual) < 1e-4
    assert all(a.meter.cut_total > 0 for a in fab.agents)


def test_the_check_can_fail_with_the_budget_on():
    """Without error feedback, what the budget cut is gone: the same check fails."""
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, time_budget_ms=1e-6,
                             error_feedback=False)
    _, computed, applied, residual = run(cfg)
    assert conservation_error(computed, applied, residual) > 1e-2


def test_budget_off_keeps_the_bits_of_before():
    a = run(TransmissionConfig(block_bytes=64, pace_mbit=0), drop=0.3)[0]
    b = run(TransmissionConfig(block_bytes=64, pace_mbit=0, time_budget_ms=0.0),
            drop=0.3)[0]
    assert a.aggs[0].tobytes() == b.aggs[0].tobytes()
    assert all(ag.meter is None for ag in b.agents)


# -- a real job on loopback ---------------------------------------------------------------
@pytest.mark.slow
def test_a_job_with_the_time_budget_conserves_and_reports_what_it_cut(train, tmp_path):
    """Sidecars over loopback, paced at 200 Mbit/s (a push of 3 MB per node takes
    some 130 ms there), a 30 ms budget: blocks are cut every iteration after the
    first, each replica applies the same bits, and the invariant holds; the trace says
    what was cut and what was measured, the summary and the report the total."""
    from dgt.trace import iterations, read_trace
    p, r = train("--workers", 3, "--iterations", 8, "--pace-mbit", 200,
                 "--time-budget-ms", 30, "--check-conservation", "--drop-udp", 0.1)
    assert r["replicas_identical"]
    assert r["conservation_rel_error"] < 1e-4
    assert 0 < r["blocks_cut_by_budget"] <= r["blocks_unsent"]
    assert "time budget:" in p.stdout
    lines = iterations(read_trace(str(tmp_path / "run" / "trace-0.jsonl")))
    assert len(lines) == 8
    assert lines[0]["budget_cut"] == 0 and lines[0]["budget_allowance_bytes"] is None
    assert all(ln["push_bytes"] > 0 and ln["push_send_s"] > 0 for ln in lines)
    assert all(ln["budget_allowance_bytes"] > 0 for ln in lines[1:])
    assert sum(ln["budget_cut"] for ln in lines) > 0
    # what was cut is unsent, not lost: the push after a cut sends fewer bytes
    assert max(ln["push_bytes"] for ln in lines[1:]) < lines[0]["push_bytes"]
