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
    assert r.compensate(g).tolist() == g.tolist()   # empty: the push is the gradient
    assert not r.residual.any()   # while the push is out, its mass is in the push
    r.update(torch.tensor([True, False, True]))
    assert r.residual.tolist() == [0, 0, 3, 4, 0, 0]
    assert g.tolist() == [1, 2, 3, 4, 5, 6]   # the gradient itself is never written
    g2 = torch.ones(6)
    assert r.compensate(g2).tolist() == [1, 1, 4, 5, 1, 1]
    off = Residual(6, 2, enabled=False)
    off.compensate(g)
    off.update(torch.tensor([False] * 3))
    assert off.residual.numel() == 0
    assert off.compensate(torch.ones(6)).tolist() == [1] * 6


def test_residual_clears_when_everything_arrived():
    r = Residual(6, 2)
    r.compensate(torch.tensor([1., 2, 3, 4, 5, 6]))
    r.update(torch.tensor([False, True, False]))
    assert r.compensate(torch.zeros(6)).tolist() == [1, 2, 0, 0, 5, 6]
    r.update(torch.tensor([True, True, True]))
    assert r.residual.tolist() == [0] * 6
    assert r.compensate(torch.ones(6)).tolist() == [1] * 6
    r.update(torch.tensor([True, True, False]))
    assert r.residual.tolist() == [0, 0, 0, 0, 1, 1]
    assert r.compensate(torch.full((6,), 6.)).tolist() == [6, 6, 6, 6, 7, 7]


def test_coded_blocks_keep_their_coding_error_and_lost_ones_keep_everything():
    r = Residual(6, 2)
    r.compensate(torch.tensor([1., 2, 3, 4, 5, 6]))
    err = torch.tensor([[.5, .5], [.25, .25]])
    r.update(torch.tensor([True, True, True]), torch.tensor([0, 2]), err)
    assert r.residual.tolist() == [.5, .5, 0, 0, .25, .25]
    r.compensate(torch.tensor([1., 1, 1, 1, 1, 1]))
    r.update(torch.tensor([True, False, False]), torch.tensor([0, 2]), err)
    assert r.residual.tolist() == [.5, .5, 1, 1, 1.25, 1.25]   # block 2 lost: whole


def test_residual_rows_in_parts_match_the_whole_push():
    whole, parts = Residual(8, 2), Residual(8, 2)
    for r in (whole, parts):
        r.compensate(torch.arange(8.))
        r.update(torch.tensor([False, True, False, True]))
    g = torch.full((8,), 10.)
    want = whole.compensate(g).clone()
    assert parts.compensate_rows(slice(0, 2), g).tolist() == [[10, 11], [10, 10]]
    assert parts.compensate_rows(torch.tensor([2, 3]), g).tolist() == [[14, 15], [10, 10]]
    assert torch.equal(parts.work, want)


def test_residual_norm_is_what_the_last_update_left_and_holds_during_a_push():
    r = Residual(6, 2)
    assert r.norm() is None   # not tracked: no pass spent on it
    r.track_norm = True
    assert r.norm() == 0.0
    r.compensate(torch.tensor([3., 4, 1, 1, 0, 0]))
    r.update(torch.tensor([False, True, True]), torch.tensor([1]), torch.tensor([[0., 2]]))
    want = float(torch.tensor([3., 4, 0, 2, 0, 0]).norm())
    assert r.residual.tolist() == [3, 4, 0, 2, 0, 0]
    assert r.norm() == pytest.approx(want)
    r.compensate(torch.ones(6))   # the next push is out: the gauge keeps the last value
    assert r.norm() == pytest.approx(want)
    r.update(torch.tensor([True, True, True]))
    assert r.norm() == 0.0
    back = Residual(6, 2)
    back.track_norm = True
    r.compensate(torch.tensor([0., 0, 5, 12, 0, 0]))
    r.update(torch.tensor([True, False, True]))
    back.load_state_dict(r.state_dict())
    assert back.norm() == r.norm() == pytest.approx(13.0)
