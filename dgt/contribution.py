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
        mag = block_magnitude(flat, block_elems)
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
        if self._fresh:
            raise RuntimeError("the first push scores every block at once (update)")
        mag = blocks.abs().mean(dim=1)
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
