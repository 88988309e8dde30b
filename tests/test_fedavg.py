"""FedAvg deltas through the whole DGT data path (worker agents + server shards over the
in-memory fabric of test_inprocess): replicas bitwise identical after every round, and the
conservation invariant for deltas under UDP loss."""
import asyncio

import numpy as np
import pytest
import torch

from dgt.config import TransmissionConfig
from test_inprocess import Fabric


def fedavg_rounds(cfg, rounds=6, world=4, n=3000, local_steps=3, drop=0.3):
    """Each worker runs ``local_steps`` of gradient descent on its own quadratic
    (optimum ``targets[r]``: non-IID), pushes ``delta = w0 - w_local``; every replica
    sets ``w = w0 - aggregate``. Returns (fabric, computed, applied, residual, replicas)."""
    fab = Fabric(cfg, n, world, drop=drop, seed=2)
    rng = np.random.default_rng(0)
    targets = [rng.standard_normal(n).astype(np.float32) * (r + 1) for r in range(world)]
    replicas = [np.zeros(n, np.float32) for _ in range(world)]
    computed = np.zeros(fab.lay.padded)
    applied = np.zeros(fab.lay.padded)

    async def main():
        for t in range(rounds):
            deltas = []
            for r in range(world):
                w = replicas[r].copy()
                for _ in range(local_steps):
                    w -= np.float32(0.2) * (w - targets[r])
                deltas.append(replicas[r] - w)
                computed[:n] += deltas[-1]
            await fab.step(t, deltas)
            for r in range(world):
                replicas[r] = replicas[r] - fab.aggs[r][:n]
            assert len({w.tobytes() for w in replicas}) == 1, f"replicas differ after round {t}"
            applied[:] += fab.aggs[0].astype(np.float64) * world
    asyncio.run(main())
    residual = sum(a.residual.residual.double().numpy() if cfg.error_feedback
                   else np.zeros(fab.lay.padded) for a in fab.agents)
    return fab, computed, applied, residual, replicas


@pytest.mark.parametrize("mode", ["dgt", "random", "tcp"])
def test_delta_conservation_and_identical_replicas(mode):
    cfg = TransmissionConfig(mode=mode, block_bytes=64, pace_mbit=0)
    fab, computed, applied, residual, _ = fedavg_rounds(cfg)
    err = np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed)
    assert err < 1e-5
    lost = sum(s.session.counters.channels[c].blocks_lost for s in fab.shards
               for c in range(1, 4))
    assert (lost > 0) == (mode != "tcp")


def test_without_error_feedback_delta_mass_is_lost():
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=0, error_feedback=False)
    _, computed, applied, residual, _ = fedavg_rounds(cfg)
    assert np.linalg.norm(applied + residual - computed) / np.linalg.norm(computed) > 1e-2


def test_fedavg_round_pushes_the_delta_and_applies_the_aggregate():
    """FedAvgRound: the delta w0 - w goes out in p.grad, and whatever push_pull leaves in
    p.grad (the mean delta) is applied as w = w0 - p.grad, in place."""
    from dgt.workloads.fedavg import FedAvgRound
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w0 = [p.detach().clone() for p in model.parameters()]
    seen = []

    class Comm:   # push_pull's contract: p.grad <- the mean over workers (here: 0.25)
        def push_pull(self, step, loss=None):
            seen.append((step, [p.grad.clone() for p in model.parameters()]))
            for p in model.parameters():
                p.grad.fill_(0.25)

    fed = FedAvgRound(model, Comm())
    fed.start()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)                              # the local steps moved w by +1
    fed.finish(0)
    assert seen[0][0] == 0
    assert all(torch.allclose(g, torch.full_like(g, -1.0)) for g in seen[0][1])
    assert all(torch.equal(p, w - 0.25) for p, w in zip(model.parameters(), w0))
    with pytest.raises(RuntimeError, match="call start"):
        FedAvgRound(model, Comm()).finish(1)
