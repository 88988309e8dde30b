"""Error feedback: what did not arrive is sent again later.

Source: error feedback / memory as in GRACE's ``Memory.compensate``/``update`` (Xu et
al.) and EF-SGD (Karimireddy et al., ICML 2019). DGT itself keeps no residual; this is
what makes dropping low-contribution blocks lossless in gradient mass.
"""
from __future__ import annotations

import torch


class Residual:
    """Per-block residual memory over the flat gradient, in one buffer with the push.

    ``work`` ((padded,) float32) holds the residual between pushes and the compensated
    gradient during one: ``compensate(grad)`` turns it into ``residual + grad`` in place
    (the push's blocks are views of it), and ``update(arrived)`` turns it back into the
    residual, ``work_b`` where block b did not arrive and 0 where it did. One buffer,
    not two: each node writes one gradient's worth of memory fewer (fresh pages are
    slow on some hosts, docs/bench/README.md) and makes one pass fewer per push. The
    bits are those of a separate buffer (``grad + residual`` equals
    ``residual + grad`` in IEEE arithmetic).

    ``residual`` is the residual as a tensor: zeros while it is empty, and while its
    mass travels with a push (after ``compensate``, before ``update``).
    ``enabled=False`` (the paper's behaviour) keeps nothing: ``compensate`` copies
    ``grad`` into ``work`` and ``update`` does nothing.
    """

    def __init__(self, padded: int, block_elems: int, enabled: bool = True, device="cpu"):
        self.enabled = enabled
        self.block_elems = block_elems
        # not zeroed: the first compensate writes it whole (its pages are touched there)
        self.work = torch.empty(padded, dtype=torch.float32, device=device)
        self.empty = True       # the residual is all zero: compensate copies
        self._in_push = False   # between compensate and update: the mass is in the push
        self._norm = 0.0        # L2 norm of what the last update left (norm())
        #: keep :meth:`norm` up to date (one pass over the kept blocks per update; the
        #: sidecar turns it on when it serves metrics, the only reader)
        self.track_norm = False

    @property
    def residual(self) -> torch.Tensor:
        """(padded,) float32, the residual now ((0,) when disabled). A view of ``work``
        when it holds one, else a new zero tensor."""
        if not self.enabled:
            return torch.zeros(0, dtype=torch.float32, device=self.work.device)
        if self.empty or self._in_push:
            return torch.zeros_like(self.work)
        return self.work

    def norm(self) -> float | None:
        """L2 norm of the residual the last :meth:`update` left (gradient units; 0 when
        disabled or empty), or None unless ``track_norm``. Kept by ``update`` from the
        blocks it keeps, so reading it (a metrics scrape, in another thread) never reads
        the buffer, and it holds while the next push is out."""
        return self._norm if self.track_norm else None

    def compensate(self, grad: torch.Tensor) -> torch.Tensor:
        """``work = residual + grad`` (``grad``: (padded,) float32, not changed).
        Returns ``work``."""
        if self.enabled and not self.empty:
            self.work.add_(grad)
        else:
            self.work.copy_(grad)
        self._in_push = True
        return self.work

    def compensate_rows(self, rows, grad: torch.Tensor) -> torch.Tensor:
        """``work = residual + grad`` on blocks ``rows`` only ((m,) int64 ascending, or a
        slice; ``grad``: (padded,) float32). Returns those blocks, (m, block_elems)
        float32: a view of ``work`` for a slice, a copy otherwise (a push handed over
        in parts; each block once per push)."""
        e = self.block_elems
        blocks = self.work.view(-1, e)
        if isinstance(rows, slice):
            g = blocks[rows]
            if self.enabled and not self.empty:
                g.add_(grad.view(-1, e)[rows])
            else:
                g.copy_(grad.view(-1, e)[rows])
        else:
            g = grad.view(-1, e)[rows]   # a gathered copy
            if self.enabled and not self.empty:
                g.add_(blocks[rows])
            blocks[rows] = g
        self._in_push = True
        return g

    def update(self, arrived: torch.Tensor, coded: torch.Tensor | None = None,
               error: torch.Tensor | None = None) -> None:
        """After the push: ``arrived``: (n_blocks,) bool, True where the block reached
        its shard. ``coded``: (m,) int64, blocks sent in a reduced form (dgt.codec), and
        ``error``: (m, block_elems) float32, their ``g - decode(encode(g))``: a coded
        block that arrived keeps its coding error, one that did not keeps ``g`` whole."""
        self._in_push = False
        if not self.enabled:
            return
        n = arrived.numel()
        blocks = self.work.view(n, -1)
        has_coded = coded is not None and coded.numel() > 0
        sq, track = 0.0, self.track_norm   # sq: squared L2 norm of what is kept
        if bool(arrived.all()):   # the common case on a clean link
            if not has_coded:
                self.empty, self._norm = True, 0.0   # nothing to keep, nothing to write
                return
            blocks.zero_()
        else:
            missing = ~arrived
            if track:
                lost = missing.nonzero().view(-1)
                sq += float(torch.linalg.vector_norm(blocks.index_select(0, lost))) ** 2
            blocks.mul_(missing.to(blocks.dtype).view(n, 1))   # per block, in place
        self.empty = False
        if has_coded:
            sel = arrived[coded]
            if not bool(sel.all()):   # lost coded blocks keep g (above), not the error
                coded, error = coded[sel], error[sel]
            blocks.index_copy_(0, coded, error)
            if track:
                sq += float(torch.linalg.vector_norm(error)) ** 2
        self._norm = sq ** 0.5

    def state_dict(self) -> dict:
        """The residual ((padded,) float32, on CPU; empty when disabled) for a
        checkpoint (``torch.save``-able)."""
        return {"residual": self.residual.detach().cpu().clone(), "empty": self.empty}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output. Raises ValueError for another size (a
        different model or block size, or error feedback switched on or off)."""
        r = state["residual"]
        want = self.work.numel() if self.enabled else 0
        if r.numel() != want:
            raise ValueError(f"checkpoint residual has {r.numel()} values, this one "
                             f"{want} (same model, --block-bytes and "
                             f"--error-feedback needed)")
        if self.enabled:
            self.work.copy_(r)
        self.empty = bool(state["empty"])
        self._in_push = False
        self._norm = float(r.double().norm()) if self.enabled and not self.empty else 0.0
