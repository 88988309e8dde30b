"""What one push sends where (docs/architecture.md, "One BSP iteration", step 2) and
what the PULLs leave behind (step 4), with no I/O: error feedback
(``g = grad + residual``), contribution scores (``c_b = α c_b + (1-α) mean|g_b|``),
ranking with Slim-DP exploration, adaptive k and the channel of each block
(dgt.scheduler.assign); after the PULLs, ``residual_b = g_b`` where block b did not
arrive. Compression (which blocks go where) and memory (the residual) stay separate
pieces, as in GRACE."""
from __future__ import annotations

import math

import numpy as np
import torch

from . import codec
from .config import TransmissionConfig
from .contribution import ContributionScores, block_magnitude, drop_non_finite
from .feedback import Residual
from .layout import BlockLayout
from .scheduler.assign import (DROPPED, AdaptiveK, assign_channels, rank_blocks,
                               reliable_count)
from .scheduler.budget import TimeBudget
from .transport import wire


class PushPlanner:
    """``work``: (padded,) float32, this push's compensated gradient (the blocks sent
    are views of it until the next plan); it is the residual's buffer
    (dgt.feedback.Residual), the residual again after :meth:`settle`. With
    ``cfg.check_conservation``, float64 running sums of the raw gradients
    (``raw_sum``) and of the applied aggregates x N (``applied_sum``) for the
    conservation invariant."""

    def __init__(self, cfg: TransmissionConfig, layout: BlockLayout, rank: int, seed: int):
        self.cfg, self.layout = cfg, layout
        self.scores = ContributionScores(layout.n_blocks, cfg.alpha)
        self.residual = Residual(layout.padded, layout.block_elems, cfg.error_feedback)
        self.work = self.residual.work
        self.adaptive = AdaptiveK(cfg.k, min(cfg.k_min, cfg.k)) if cfg.adaptive_k else None
        self.gen = torch.Generator().manual_seed(seed * 1009 + rank)
        self.k_history: list[float] = []
        self.raw_sum = torch.zeros(layout.padded, dtype=torch.float64) \
            if cfg.check_conservation else None
        self.applied_sum = torch.zeros_like(self.raw_sum) if self.raw_sum is not None else None
        self.codings = cfg.channel_codings()   # channel -> dgt.transport.wire.Coding
        #: each reduced coding and its channels, in channel order (channel after channel)
        self._bands_by_coding = {k: [c for c, x in enumerate(self.codings) if x == k]
                                 for k in sorted(set(self.codings) - {0})}
        self.local = (layout.shard_lo(rank), layout.shard_hi(rank))
        #: the coded channels of the blocks planned last (a whole push or a part): channel
        #: -> (coding, block indices (m,) sorted int64, payloads (m, coded bytes) uint8),
        #: for transport.sender.PushSender.add
        self.coded: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self._coded_index: list[torch.Tensor] = []   # this push's coded blocks, (m,) int64
        self._coding_error: list[torch.Tensor] = []  # their g - decoded, (m, block_elems)
        #: --time-budget-ms (dgt.scheduler.budget), fed by the agent after each push;
        #: ``budget_cut``: remote blocks this push did not send for it (channel -1)
        self.budget = TimeBudget(cfg.time_budget_ms / 1000.0) if cfg.time_budget_ms \
            else None
        self.budget_cut = 0
        #: blocks of this node's pushes that held a NaN or inf, zeroed before they were
        #: sent and kept out of the residual (dgt.contribution.drop_non_finite), in all
        self.non_finite_blocks = 0
        if self.budget is not None:
            self._remote = torch.ones(layout.n_blocks, dtype=torch.bool)
            self._remote[self.local[0]:self.local[1]] = False
            self._chan_cost = self._wire_cost()

    def plan(self, grad: torch.Tensor, loss: float | None) -> tuple[np.ndarray, float]:
        """Compensate ``grad`` ((padded,) float32) into ``work``, score, rank and
        assign. Returns (channel per block (n_blocks,) int8: 0 reliable, 1..C UDP, -1
        dropped; k used)."""
        cfg, n, e = self.cfg, self.layout.n_blocks, self.layout.block_elems
        before = self._kept(slice(None))
        g = self.residual.compensate(grad)
        mag = block_magnitude(g, e)
        bad = drop_non_finite(g.view(-1, e), mag)
        self._count_raw(slice(None), grad, bad, before)
        k = self.adaptive.update(loss) if self.adaptive else cfg.k
        if cfg.mode == "tcp":
            k = 1.0
        n_rel = reliable_count(n, k)
        if cfg.mode == "random":
            scores = torch.rand(n, generator=self.gen)
        else:
            scores = self.scores.fold(mag)
        order = rank_blocks(scores, epsilon=cfg.epsilon, n_reliable=n_rel, generator=self.gen)
        chan = assign_channels(order, n_rel, cfg.channels,
                               drop_unreliable=cfg.mode == "topk")
        self.budget_cut = 0
        chan = self._fit_budget(None, order, chan).numpy()
        self.k_history.append(k)
        self._coded_index, self._coding_error = [], []
        self.coded = self._code(np.arange(n), chan)
        return chan, k

    def iteration_k(self, loss: float | None) -> float:
        """k of the next push (adaptive k takes the loss once per iteration), logged in
        ``k_history``; for a push in parts (:meth:`plan_rows`)."""
        k = self.adaptive.update(loss) if self.adaptive else self.cfg.k
        k = 1.0 if self.cfg.mode == "tcp" else k
        self.k_history.append(k)
        self._coded_index, self._coding_error = [], []
        self.budget_cut = 0
        return k

    def plan_rows(self, grad: torch.Tensor, rows: np.ndarray, k: float) -> np.ndarray:
        """Plan blocks ``rows`` ((m,) int64, ascending) of a push handed over in parts
        (wait-free backpropagation, docs/ddp.md): compensate them from ``grad``
        ((padded,) float32) into ``work``, fold them into the scores, rank them among
        themselves and give the top ``ceil(k m)`` TCP, the rest the UDP bands. Returns
        their channels ((m,) int8, as :meth:`plan`). Every block of the push goes
        through here exactly once; the compensated values and scores are bitwise those
        of :meth:`plan`, only the ranking is per part."""
        cfg, e = self.cfg, self.layout.block_elems
        if rows[-1] - rows[0] + 1 == rows.size:   # one run of blocks (a bucket): views
            idx = slice(int(rows[0]), int(rows[-1]) + 1)
        else:
            idx = torch.from_numpy(rows)
        before = self._kept(idx)
        g = self.residual.compensate_rows(idx, grad)
        mag = g.abs().mean(dim=1)
        bad = drop_non_finite(g, mag)
        if bad is not None and not isinstance(idx, slice):   # g is a gathered copy
            self.work.view(-1, e)[idx[bad]] = 0.0
        self._count_raw(idx, grad, bad, before)
        n_rel = reliable_count(rows.size, k)
        if cfg.mode == "random":
            scores = torch.rand(rows.size, generator=self.gen)
        else:
            scores = self.scores.fold_rows(idx, mag)
        order = rank_blocks(scores, epsilon=cfg.epsilon, n_reliable=n_rel, generator=self.gen)
        chan = assign_channels(order, n_rel, cfg.channels,
                               drop_unreliable=cfg.mode == "topk")
        chan = self._fit_budget(torch.from_numpy(rows), order, chan).numpy()
        self.coded = self._code(rows, chan)
        return chan

    def _kept(self, idx) -> torch.Tensor | None:
        """With ``cfg.check_conservation``: a copy of the residual's blocks ``idx`` (a
        slice, or (m,) int64) before this push is compensated into them (None when the
        residual holds nothing), for :meth:`_count_raw`; else None, uncopied."""
        if self.raw_sum is None or self.residual.empty or not self.residual.enabled:
            return None
        return self.work.view(-1, self.layout.block_elems)[idx].clone()

    def _count_raw(self, idx, grad: torch.Tensor, bad: torch.Tensor | None,
                   before: torch.Tensor | None) -> None:
        """Count blocks ``idx`` of ``grad`` ((padded,) float32) in ``raw_sum`` (with
        ``cfg.check_conservation``) and the ``bad`` ones (indices into ``idx``'s
        blocks) in :attr:`non_finite_blocks`. A zeroed block took its gradient and
        what the residual kept of it (``before``) out of the job: the invariant's left
        side loses both, so it still holds for the rest."""
        if bad is not None:
            self.non_finite_blocks += bad.numel()
        if self.raw_sum is None:
            return
        raw = self.raw_sum.view(-1, self.layout.block_elems)
        rows = raw[idx]   # a view for a slice, a copy otherwise: written back below
        if bad is not None:
            out = rows[bad] - (before[bad] if before is not None else 0.0)
        rows += grad.view(-1, self.layout.block_elems)[idx]
        if bad is not None:
            rows[bad] = out
        if not isinstance(idx, slice):
            raw[idx] = rows

    def _wire_cost(self) -> torch.Tensor:
        """(MAX_CHANNELS + 1,) float64: wire bytes one remote block costs on each
        channel (transport.counters' units): reliable, its payload (f32, or
        --reliable-codec's) and its u32 index in the INDEXED frame; a UDP band, its
        datagram (header, coded payload, MAC with --secret). The last entry, 0, is
        channel -1's (not sent)."""
        e, mac = self.layout.block_elems, bool(self.cfg.secret)
        cost = [wire.coded_payload_bytes(self.codings[0], e) + 4] + \
            [wire.block_datagram_bytes(c, e, mac) for c in self.codings[1:]]
        return torch.tensor(cost + [0], dtype=torch.float64)

    def _fit_budget(self, rows: torch.Tensor | None, order: torch.Tensor,
                    chan: torch.Tensor) -> torch.Tensor:
        """--time-budget-ms: blocks ``rows`` ((m,) int64; None: all) were ranked
        ``order`` ((m,) int64 positions into rows, best first) and given channels
        ``chan`` ((m,) int8). The remote blocks ranked beyond what fits the budget
        (the reliable share first, then the UDP bands in order: the rank order) get
        channel -1, not sent, kept whole by error feedback; the first
        ``ceil(min(k_min, k) m)`` ranks (at least one) always go. Blocks of the
        colocated shard cost the link nothing and are never cut. Returns ``chan``."""
        if self.budget is None:
            return chan
        n, m = self.layout.n_blocks, chan.numel()
        remote = self._remote if rows is None else self._remote[rows]
        cost = self._chan_cost[chan.long()] * remote   # chan -1: the last entry, 0
        floor = max(1, math.ceil(min(self.cfg.k_min, self.cfg.k) * m))
        keep = self.budget.fit(cost[order], floor, m / n)
        cut = order[keep:]
        cut = cut[cost[cut] > 0]
        chan[cut] = DROPPED
        self.budget_cut += cut.numel()
        return chan

    @property
    def coded_index(self) -> torch.Tensor | None:
        """(m,) int64: every block of this push sent in a reduced form, or None."""
        return _joined(self._coded_index)

    @property
    def coding_error(self) -> torch.Tensor | None:
        """(m, block_elems) float32: their ``g - decode(encode(g))``, or None."""
        return _joined(self._coding_error)

    def _code(self, rows: np.ndarray, chan: np.ndarray) -> dict:
        """Code blocks ``rows`` ((m,) int64, ascending) of every channel with a reduced
        form (``--band-codec``, ``--reliable-codec``; ``chan``: their channels, (m,)
        int8), but not those of the colocated shard (they never touch the wire).
        Returns their coded channels (as :attr:`coded`) and keeps their coding error
        ``g - decode(encode(g))`` for :meth:`settle`. The channels of one coding are
        coded in one pass (one gather, one encode that also writes the coding error over
        the gathered copy),
        channel after channel, so each channel's blocks and payloads are slices of it."""
        coded: dict = {}
        if not self._bands_by_coding:
            return coded
        blocks = self.work.view(-1, self.layout.block_elems)
        lo, hi = self.local
        remote = (rows < lo) | (rows >= hi)
        for coding, bands in self._bands_by_coding.items():
            parts = [rows[(chan == c) & remote] for c in bands]
            idx = np.concatenate(parts)
            if not idx.size:
                continue
            ti = torch.from_numpy(idx)
            g = blocks.index_select(0, ti)   # a gathered copy: it becomes the error
            payloads = codec.encode(coding, g, error=g)
            at = 0
            for c, part in zip(bands, parts):
                if part.size:
                    coded[c] = (coding, part, payloads[at:at + part.size])
                at += part.size
            self._coded_index.append(ti)
            self._coding_error.append(g)
        return coded

    def applied(self, lo: int, aggregate: np.ndarray) -> None:
        """One shard's PULL as applied: ``aggregate`` ((m,) float32, the aggregate's
        elements from ``lo``). With ``cfg.check_conservation``, adds it x N to
        ``applied_sum``; else nothing. Called per shard as its PULL lands, while the
        values are still the aggregate's (the trainer reuses that memory next)."""
        if self.applied_sum is not None:
            self.applied_sum[lo:lo + aggregate.size] += \
                torch.from_numpy(aggregate).double() * self.layout.n_shards

    def settle(self, arrived: np.ndarray) -> None:
        """After every PULL: ``arrived`` (n_blocks,) bool. The blocks that did not
        arrive go into the residual, and the coding error of the coded blocks that
        did. Reads only this planner's own copy of the push (``work``), so it may run
        after the trainer got the aggregate."""
        self.residual.update(torch.from_numpy(arrived), self.coded_index,
                             self.coding_error)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` concatenated along dim 0 (the one part itself, uncopied), or None."""
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)
