"""PULLs pipelined per shard range: the agent hands each shard's range to the trainer as
its PULL lands (and the residual is settled after the trainer has the aggregate), the
client completes parameters range by range, and a partial optimiser step per range
gives the bits of one step after the last PULL."""
import asyncio
import itertools
import json

import numpy as np
import pytest
import torch

from dgt.client import _Pending
from dgt.config import TransmissionConfig
from dgt.partial_step import PartialStep

from test_inprocess import Fabric


# -- the client's bookkeeping: which parameters a range completes ----------------------
def test_each_parameter_completes_once_at_its_last_missing_range():
    sizes = [5, 0, 12, 3, 40, 1]          # offsets 0 5 5 17 20 60 61
    ranges = [(0, 16), (16, 32), (32, 48), (48, 61)]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        pend = _Pending([0, *itertools.accumulate(sizes)])
        got = {}
        for k in order:
            for i in pend.take(*ranges[k]):
                assert i not in got, "a parameter is completed once"
                got[i] = k
        assert pend.rest() == [1], "the empty parameter is left for the end"
        assert pend.rest() == []
        # each completes with the last range it overlaps, in arrival order
        for i, (lo, hi) in enumerate(zip(pend.offsets, pend.offsets[1:])):
            if hi > lo:
                overlapping = [k for k in order if ranges[k][0] < hi and lo < ranges[k][1]]
                assert got[i] == overlapping[-1], (order, i)


def test_a_range_that_completes_nothing_returns_nothing():
    pend = _Pending([0, 100])
    assert pend.take(0, 40) == [] and pend.take(40, 99) == []
    assert pend.take(99, 100) == [0]


# -- the optimiser stepped in parts ------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2)])
def test_stepping_in_parts_gives_the_bits_of_one_step(make):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    whole, parted = model(), model()
    opt_w, opt_p = make(whole.parameters()), make(parted.parameters())
    partial = PartialStep(opt_p)
    gen = torch.Generator().manual_seed(1)
    for it in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in whole.parameters()]
        for m in (whole, parted):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
        opt_w.step()
        ps = list(parted.parameters())
        for group in ([ps[3], ps[0]], [ps[2]], [ps[1]]):   # any order, each once
            partial.step(group)
        assert all(p.grad is not None for p in ps), "hidden gradients are restored"
    for a, b in zip(whole.parameters(), parted.parameters()):
        assert torch.equal(a, b)
    assert partial.calls == 15


# -- the agent: ranges as PULLs land, the trainer's turn before the residual's --------
def test_ranges_reach_the_trainer_before_the_last_pull_and_pulled_before_settling():
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, band_codec="fp32")
    fab = Fabric(cfg, 3000, 4, drop=0.5, seed=2)
    lay, agent = fab.lay, fab.agents[0]
    events = []
    late = fab.shards[3].on_pull

    def delayed(w, it, agg, received):   # shard 3's PULL to worker 0 comes 50 ms late
        if w != 0:
            return late(w, it, agg, received)
        agg, received = agg.copy(), received.copy()

        def land():
            events.append(("landed", 3))
            late(w, it, agg, received)
        asyncio.get_running_loop().call_later(0.05, land)
    fab.shards[3].on_pull = delayed
    residual_at_pulled = []

    def pulled(k):
        events.append(("pulled",))
        residual_at_pulled.append(agent.residual.residual.clone())

    async def main():
        g = np.random.default_rng(0).standard_normal((4, 3000)).astype(np.float32)
        for r in range(4):
            fab.grads[r][:3000] = g[r]
        others = [a.push(0, None, 5.0) for a in fab.agents[1:]]
        mine = agent.push(0, None, 5.0, pulled, lambda lo, hi: events.append(("range", lo, hi)))
        await asyncio.gather(mine, *others)
    asyncio.run(main())
    kinds = [e[0] for e in events]
    assert kinds.index("landed") == 3 and kinds[-1] == "pulled", events
    ranges = sorted(e[1:] for e in events if e[0] == "range")
    e = lay.block_elems
    assert ranges == [(lay.shard_lo(s) * e, lay.shard_hi(s) * e) for s in range(4)]
    assert events[4] == ("range", lay.shard_lo(3) * e, lay.shard_hi(3) * e)
    # the trainer had the aggregate before the residual took this push's lost blocks
    assert not residual_at_pulled[0].any()
    assert agent.residual.residual.any(), "half the UDP blocks were dropped"


# -- a real job on loopback ----------------------------------------------------------------
@pytest.mark.slow
def test_a_pipelined_job_steps_in_parts_and_ends_at_the_bits_of_one_step(tmp_path):
    """dgt train (4 workers: the MLP's first layer lies in shard 0's range, its last
    ones in shard 3's, so every iteration completes parameters in at least two PULLs)
    steps the optimiser once per group of completed parameters, conserves mass, and
    ends at the same parameters as --no-pipeline-pulls."""
    from conftest import run_train
    results = {}
    for name, flags in (("pipelined", ()), ("whole", ("--no-pipeline-pulls",))):
        d = tmp_path / name
        # no loss: which UDP blocks a lossy run loses depends on timing, not on us
        _, r = run_train(d, "--iterations", 12, "--hidden", 256, "--check-conservation",
                         *flags)
        assert r["replicas_identical"]
        assert r["conservation_rel_error"] < 1e-4
        trainer = json.loads((d / "run" / "trainer-0.json").read_text())
        results[name] = (r["param_sha256"][0], trainer["steps_per_iteration"])
    assert results["pipelined"][0] == results["whole"][0]
    assert results["pipelined"][1] >= 2.0 and results["whole"][1] == 1.0, results
