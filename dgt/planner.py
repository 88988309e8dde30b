"""What one push sends where (docs/architecture.md, "One BSP iteration", step 2) and
what the PULLs leave behind (step 4), with no I/O: error feedback
(``g = grad + residual``), contribution scores (``c_b = α c_b + (1-α) mean|g_b|``),
ranking with Slim-DP exploration, adaptive k and the channel of each block
(dgt.scheduler.assign); after the PULLs, ``residual_b = g_b`` where block b did not
arrive. Compression (which blocks go where) and memory (the residual) stay separate
pieces, as in GRACE."""
from __future__ import annotations

import numpy as np
import torch

from . import codec
from .config import TransmissionConfig
from .contribution import ContributionScores
from .feedback import Residual
from .layout import BlockLayout
from .scheduler.assign import AdaptiveK, assign_channels, rank_blocks, reliable_count


class PushPlanner:
    """``work``: (padded,) float32, this push's compensated gradient (the blocks sent
    are views of it until the next plan). With ``cfg.check_conservation``, float64
    running sums of the raw gradients (``raw_sum``) and of the applied aggregates x N
    (``applied_sum``) for the conservation invariant."""

    def __init__(self, cfg: TransmissionConfig, layout: BlockLayout, rank: int, seed: int):
        self.cfg, self.layout = cfg, layout
        self.work = torch.zeros(layout.padded, dtype=torch.float32)
        self.scores = ContributionScores(layout.n_blocks, cfg.alpha)
        self.residual = Residual(layout.padded, layout.block_elems, cfg.error_feedback)
        self.adaptive = AdaptiveK(cfg.k, min(cfg.k_min, cfg.k)) if cfg.adaptive_k else None
        self.gen = torch.Generator().manual_seed(seed * 1009 + rank)
        self.k_history: list[float] = []
        self.raw_sum = torch.zeros(layout.padded, dtype=torch.float64) \
            if cfg.check_conservation else None
        self.applied_sum = torch.zeros_like(self.raw_sum) if self.raw_sum is not None else None
        self.codings = cfg.band_codings()   # channel -> dgt.transport.wire.Coding
        self.local = (layout.shard_lo(rank), layout.shard_hi(rank))
        #: this push's coded bands: channel -> (coding, block indices (m,) sorted int64,
        #: payloads (m, coded bytes) uint8), for transport.sender.PushSender.start
        self.coded: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self.coded_index: torch.Tensor | None = None   # (m,) int64, every coded block
        self.coding_error: torch.Tensor | None = None  # (m, block_elems) g - decoded

    def plan(self, grad: torch.Tensor, loss: float | None) -> tuple[np.ndarray, float]:
        """Compensate ``grad`` ((padded,) float32) into ``work``, score, rank and
        assign. Returns (channel per block (n_blocks,) int8: 0 reliable, 1..C UDP, -1
        dropped; k used)."""
        cfg, n = self.cfg, self.layout.n_blocks
        g = self.work
        g.copy_(grad)
        if self.raw_sum is not None:
            self.raw_sum += g
        self.residual.compensate(g)
        k = self.adaptive.update(loss) if self.adaptive else cfg.k
        if cfg.mode == "tcp":
            k = 1.0
        n_rel = reliable_count(n, k)
        if cfg.mode == "random":
            scores = torch.rand(n, generator=self.gen)
        else:
            scores = self.scores.update(g, self.layout.block_elems)
        order = rank_blocks(scores, epsilon=cfg.epsilon, n_reliable=n_rel, generator=self.gen)
        chan = assign_channels(order, n_rel, cfg.channels,
                               drop_unreliable=cfg.mode == "topk").numpy()
        self.k_history.append(k)
        self._code(chan)
        return chan, k

    def _code(self, chan: np.ndarray) -> None:
        """Code the blocks of every band with a reduced form (``--band-codec``), but
        not those of the colocated shard (they never touch the wire), into
        :attr:`coded`; keep their coding error ``g - decode(encode(g))``."""
        self.coded, self.coded_index, self.coding_error = {}, None, None
        if not any(self.codings):
            return
        e = self.layout.block_elems
        blocks = self.work.view(-1, e)
        lo, hi = self.local
        index, error = [], []
        for c, coding in enumerate(self.codings):
            if not coding:
                continue
            idx = np.flatnonzero(chan == c)
            idx = idx[(idx < lo) | (idx >= hi)]
            if not idx.size:
                continue
            ti = torch.from_numpy(idx)
            g = blocks[ti]   # a gathered copy
            rows = codec.encode(coding, g)
            self.coded[c] = (coding, idx, rows)
            index.append(ti)
            error.append(g.sub_(torch.from_numpy(codec.decode(coding, rows, e))))
        if index:
            self.coded_index, self.coding_error = torch.cat(index), torch.cat(error)

    def settle(self, arrived: np.ndarray, aggregate: np.ndarray) -> None:
        """After every PULL: ``arrived`` (n_blocks,) bool, ``aggregate`` (padded,)
        float32 as applied. The blocks that did not arrive go into the residual, and the
        coding error of the coded blocks that did."""
        self.residual.update(self.work, torch.from_numpy(arrived), self.coded_index,
                             self.coding_error)
        if self.applied_sum is not None:
            self.applied_sum += torch.from_numpy(aggregate).double() * self.layout.n_shards
