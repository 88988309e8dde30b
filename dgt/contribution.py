"""Contribution scores: how much each gradient block is expected to matter.

Source: DGT (Zhou et al., FGCS 2021), section 4.2, and the DGT code's DGT_CONTRI_ALPHA:
``c_b <- alpha * c_b + (1 - alpha) * mean(|g_b|)``, alpha = 0.3.

Scoring is separate from channel assignment (``dgt.scheduler.assign``) and from error
feedback (``dgt.feedback``), so each can be swapped and tested alone (as in GRACE).
"""
from __future__ import annotations

import torch

DEFAULT_ALPHA = 0.3


def block_magnitude(flat: torch.Tensor, block_elems: int) -> torch.Tensor:
    """mean(|g_b|) per block. ``flat``: (n_blocks * block_elems,) float32, any device.
    Returns (n_blocks,) float32 on the same device."""
    return flat.view(-1, block_elems).abs().mean(dim=1)


#: a finite block's magnitude is at most this: half float32's largest, so that the EMA
#: of two such values (a convex combination) stays finite
MAX_MAGNITUDE = float(torch.finfo(torch.float32).max) / 2


def drop_non_finite(blocks: torch.Tensor, mag: torch.Tensor) -> torch.Tensor | None:
    """Keep one bad value from poisoning the scores and the residual for the rest of
    the run. ``blocks``: (m, block_elems) float32, this push's compensated blocks (a
    view of the residual's buffer, written in place); ``mag``: (m,) float32, their
    :func:`block_magnitude`, written in place. Where ``mag`` is not finite (one pass
    over m values; the blocks are read only there): a block holding a NaN or inf is
    zeroed, its magnitude 0 (it is sent as zeros, and nothing of it stays in the
    residual: an EMA or a residual that took a NaN would keep it for ever, and the
    shard would keep the block out of every later sum); a finite block whose mean
    overflowed float32 gets its float64 mean, at most :data:`MAX_MAGNITUDE`. Returns
    the indices of the zeroed blocks ((z,) int64, into ``blocks``), or None when there
    are none. Source: torch.amp's GradScaler, which skips a step whose gradients are
    not finite, here per block."""
    odd = ~torch.isfinite(mag)
    if not bool(odd.any()):
        return None
    cand = odd.nonzero().view(-1)
    rows = blocks.index_select(0, cand)
    finite = torch.isfinite(rows).all(dim=1)
    big = cand[finite]
    if big.numel():
        mag[big] = rows[finite].double().abs().mean(dim=1).clamp(max=MAX_MAGNITUDE).float()
    bad = cand[~finite]
    if not bad.numel():
        return None
    blocks[bad] = 0.0
    mag[bad] = 0.0
    return bad


class ContributionScores:
    """EMA of per-block mean |g| (one pass per push, on the gradient's own device).

    ``alpha`` in [0, 1). The first update sets the scores to the first magnitudes.
    """

    def __init__(self, n_blocks: int, alpha: float = DEFAULT_ALPHA, device="cpu"):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        self.alpha = alpha
        self.scores = torch.zeros(n_blocks, dtype=torch.float32, device=device)
        self._fresh = True

    def update(self, flat: torch.Tensor, block_elems: int) -> torch.Tensor:
        """Fold one push's gradient into the scores and return them ((n_blocks,) f32)."""
        return self.fold(block_magnitude(flat, block_elems))

    def fold(self, mag: torch.Tensor) -> torch.Tensor:
        """Fold one push's magnitudes (:func:`block_magnitude`, (n_blocks,) float32)
        into the scores and return them ((n_blocks,) float32)."""
        if self._fresh:
            self.scores.copy_(mag)
            self._fresh = False
        else:
            self.scores.mul_(self.alpha).add_(mag, alpha=1.0 - self.alpha)
        return self.scores

    def update_rows(self, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Fold blocks ``rows`` ((m,) int64, or a slice) of one push, ``blocks`` ((m, block_elems)
        float32), into their scores (a push handed over in parts); returns their scores
        ((m,) float32), bitwise what :meth:`update` gives those rows. Raises
        RuntimeError before the first :meth:`update` (the first push is one whole)."""
        return self.fold_rows(rows, blocks.abs().mean(dim=1))

    def fold_rows(self, rows: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
        """:meth:`update_rows` with the blocks' magnitudes given (``mag``: (m,) float32,
        ``blocks.abs().mean(dim=1)``). Raises RuntimeError before the first
        :meth:`fold`."""
        if self._fresh:
            raise RuntimeError("the first push scores every block at once (update)")
        out = self.scores[rows].mul_(self.alpha).add_(mag, alpha=1.0 - self.alpha)
        if isinstance(rows, torch.Tensor):   # a gathered copy; a slice is a view
            self.scores[rows] = out
        return out

    @property
    def fresh(self) -> bool:
        """No push folded in yet."""
        return self._fresh

    def state_dict(self) -> dict:
        """The scores ((n_blocks,) float32, on CPU) and whether none was folded in yet:
        what a checkpoint needs to resume bitwise (``torch.save``-able, no sockets)."""
        return {"scores": self.scores.detach().cpu().clone(), "fresh": self._fresh}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. Raises ValueError for another block
        count."""
        scores = state["scores"]
        if scores.shape != self.scores.shape:
            raise ValueError(f"checkpoint has {scores.numel()} block scores, this layout "
                             f"{self.scores.numel()}")
        self.scores.copy_(scores)
        self._fresh = bool(state["fresh"])
