"""Error feedback: what did not arrive is sent again later.

Source: error feedback / memory as in GRACE's ``Memory.compensate``/``update`` (Xu et
al.) and EF-SGD (Karimireddy et al., ICML 2019). DGT itself keeps no residual; this is
what makes dropping low-contribution blocks lossless in gradient mass.
"""
from __future__ import annotations

import torch


class Residual:
    """Per-block residual memory over the flat gradient.

    ``compensate(g)`` returns ``g + residual`` (in place on ``g``); ``update(g, arrived)``
    sets ``residual_b = g_b`` for blocks that did not arrive and 0 for those that did.
    ``enabled=False`` makes both no-ops (the paper's behaviour).
    """

    def __init__(self, padded: int, block_elems: int, enabled: bool = True, device="cpu"):
        self.enabled = enabled
        self.block_elems = block_elems
        self.residual = torch.zeros(padded if enabled else 0, dtype=torch.float32,
                                    device=device)
        self.empty = True   # residual is all zero: compensate is a no-op

    def compensate(self, g: torch.Tensor) -> torch.Tensor:
        """``g += residual``. ``g``: (padded,) float32. Returns ``g``."""
        if self.enabled and not self.empty:
            g.add_(self.residual)
        return g

    def compensate_rows(self, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``blocks += residual`` of blocks ``rows`` ((m,) int64, or a slice); ``blocks``: (m,
        block_elems) float32. Returns ``blocks`` (a push handed over in parts)."""
        if self.enabled and not self.empty:
            blocks.add_(self.residual.view(-1, self.block_elems)[rows])
        return blocks

    def update(self, g: torch.Tensor, arrived: torch.Tensor,
               coded: torch.Tensor | None = None, error: torch.Tensor | None = None
               ) -> None:
        """``arrived``: (n_blocks,) bool, True where the block reached its shard.
        ``coded``: (m,) int64, blocks sent in a reduced form (dgt.codec), and ``error``:
        (m, block_elems) float32, their ``g - decode(encode(g))``: a coded block that
        arrived keeps its coding error, one that did not keeps ``g`` whole."""
        if not self.enabled:
            return
        n = arrived.numel()
        if bool(arrived.all()):   # the common case on a clean link: nothing to keep
            if not self.empty:
                self.residual.zero_()
                self.empty = True
        else:
            keep = (~arrived).to(g.dtype).view(n, 1)   # per block: no (padded,) mask
            torch.mul(g.view(n, -1), keep, out=self.residual.view(n, -1))
            self.empty = False
        if coded is not None and coded.numel():
            sel = arrived[coded]
            if not bool(sel.all()):   # lost coded blocks keep g (above), not the error
                coded, error = coded[sel], error[sel]
            self.residual.view(n, -1).index_copy_(0, coded, error)
            self.empty = False

    def state_dict(self) -> dict:
        """The residual ((padded,) float32, on CPU; empty when disabled) for a
        checkpoint (``torch.save``-able)."""
        return {"residual": self.residual.detach().cpu().clone(), "empty": self.empty}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. Raises ValueError for another size (a
        different model or block size, or error feedback switched on or off)."""
        r = state["residual"]
        if r.shape != self.residual.shape:
            raise ValueError(f"checkpoint residual has {r.numel()} values, this one "
                             f"{self.residual.numel()} (same model, --block-bytes and "
                             f"--error-feedback needed)")
        self.residual.copy_(r)
        self.empty = bool(state["empty"])
