import pytest
import torch

from dgt.contribution import ContributionScores, block_magnitude
from dgt.feedback import Residual
from dgt.layout import BlockLayout


def test_layout_shards_cover_blocks_once():
    lay = BlockLayout.from_bytes(1_000_003, 1408, 4)
    assert lay.block_elems == 352 and lay.n_blocks == 2841
    spans = [(lay.shard_lo(s), lay.shard_hi(s)) for s in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == lay.n_blocks
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    import numpy as np
    blocks = np.arange(lay.n_blocks)
    owners = lay.shard_of(blocks)
    for s, (lo, hi) in enumerate(spans):
        assert (owners[lo:hi] == s).all()
    with pytest.raises(ValueError):
        BlockLayout.from_bytes(10, 6, 1)


def test_score_is_ema_of_mean_abs():
    g1 = torch.tensor([1., -1, 2, -2, 0, 0])
    g2 = torch.tensor([3., 3, 0, 0, -6, 6])
    s = ContributionScores(3, alpha=0.3)
    assert s.update(g1, 2).tolist() == [1, 2, 0]
    want = [0.3 * 1 + 0.7 * 3, 0.3 * 2 + 0.7 * 0, 0.3 * 0 + 0.7 * 6]
    assert s.update(g2, 2).tolist() == pytest.approx(want)
    assert block_magnitude(g2, 3).tolist() == pytest.approx([2, 4])


def test_residual_keeps_exactly_what_did_not_arrive():
    r = Residual(6, 2)
    g = torch.tensor([1., 2, 3, 4, 5, 6])
    r.update(g, torch.tensor([True, False, True]))
    assert r.residual.tolist() == [0, 0, 3, 4, 0, 0]
    g2 = torch.ones(6)
    assert r.compensate(g2).tolist() == [1, 1, 4, 5, 1, 1]
    off = Residual(6, 2, enabled=False)
    off.update(g, torch.tensor([False] * 3))
    assert off.compensate(torch.ones(6)).tolist() == [1] * 6


def test_residual_clears_when_everything_arrived():
    r = Residual(6, 2)
    r.update(torch.tensor([1., 2, 3, 4, 5, 6]), torch.tensor([False, True, False]))
    assert r.compensate(torch.zeros(6)).tolist() == [1, 2, 0, 0, 5, 6]
    r.update(torch.full((6,), 9.), torch.tensor([True, True, True]))
    assert r.residual.tolist() == [0] * 6
    assert r.compensate(torch.ones(6)).tolist() == [1] * 6
    r.update(torch.full((6,), 7.), torch.tensor([True, True, False]))
    assert r.compensate(torch.zeros(6)).tolist() == [0, 0, 0, 0, 7, 7]
