"""Server shard: sums the workers' blocks for its range and answers PULL.

Colocated, as in BytePS: node r owns blocks ``[layout.shard_lo(r), layout.shard_hi(r))``.
The transport-level bookkeeping (validation, bitmaps, END, deadlines) is the sans-IO
:class:`dgt.transport.session.ShardSession`; this class owns the numbers.

Determinism: arriving blocks are written into a per-worker buffer and summed in rank
order once every worker is finalised, never in arrival order, so the aggregate's bits
do not depend on timing (docs/architecture.md, step 3). Missing blocks are zero (DGT, OptiReduce).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from . import codec
from .layout import BlockLayout
from .pull_codec import CodedPull, PullCoder
from .transport.channels import RELIABLE
from .transport.session import (BlocksArrived, IterationComplete, ShardSession,
                                 WorkerFinalised)


class ServerShard:
    """``on_pull(worker, iteration, aggregate, received)`` is called once per worker per
    iteration with the shard's aggregate ((shard_blocks * block_elems,) float32, the mean
    over workers) and that worker's received bitmap ((shard_blocks,) bool).

    With ``coder`` (dgt.pull_codec, ``--pull-codec``) the aggregate is first compensated
    with the shard's residual and its low-contribution blocks replaced by their decoded
    coded form; ``coded_pull`` then holds the PULL's coded form (the same for every
    worker) until the next aggregate, else None."""

    def __init__(self, layout: BlockLayout, rank: int, session: ShardSession,
                 on_pull: Callable[[int, int, np.ndarray, np.ndarray], None],
                 coder: PullCoder | None = None):
        self.layout, self.rank, self.session, self.on_pull = layout, rank, session, on_pull
        #: ``on_advance(iteration)``: called as the session opens ``iteration``, before
        #: that iteration's PULLs go out (the sidecar moves its kernel filter's
        #: iteration window); None: nothing to call
        self.on_advance: Callable[[int], None] | None = None
        self.coder = coder
        self.coded_pull: CodedPull | None = None
        self.n_workers = session.n_workers
        n = layout.shard_blocks(rank)
        self.recv = np.zeros((self.n_workers, n, layout.block_elems), np.float32)
        self.bitmaps: list[np.ndarray | None] = [None] * self.n_workers
        #: coded blocks as they arrived, decoded once per worker at the aggregate:
        #: coding -> (payloads (workers, shard_blocks, coded bytes) uint8, which rows
        #: hold this iteration's (workers, shard_blocks) bool)
        self.staged: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.finalised_by_deadline = 0
        self.finalised_by_tail = 0   # some blocks lost, known from the tail markers

    def handle(self, events: list) -> None:
        """Apply session events: copy blocks, record bitmaps, aggregate when complete."""
        for e in events:
            if isinstance(e, BlocksArrived):
                if e.channel == RELIABLE:   # it may displace a staged unreliable copy
                    for _, held in self.staged.values():
                        held[e.sender, e.rows] = False
                if e.coding:   # a coded band: kept as it came, decoded at the aggregate
                    payloads, held = self._stage(e.coding, e.data.shape[-1])
                    payloads[e.sender, e.rows] = e.data
                    held[e.sender, e.rows] = True
                else:
                    self.recv[e.sender, e.rows] = e.data
            elif isinstance(e, WorkerFinalised):
                self.bitmaps[e.sender] = e.received
                self.finalised_by_deadline += e.reason == "deadline"
                self.finalised_by_tail += e.reason == "tail"
            elif isinstance(e, IterationComplete):
                self._aggregate(e.iteration)

    def local_push(self, iteration: int, blocks: np.ndarray, mask: np.ndarray,
                   now: float) -> None:
        """The colocated worker's blocks, copied in-process. ``blocks``: (shard_blocks,
        block_elems) float32; ``mask``: (shard_blocks,) bool, the blocks it sends."""
        self.recv[self.rank][mask] = blocks[mask]
        self.handle(self.session.deliver_local(self.rank, iteration, mask, now))

    def _stage(self, coding: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The staging arrays of ``coding`` (``staged``), made at its first block."""
        if coding not in self.staged:
            n = self.recv.shape[1]
            self.staged[coding] = (np.zeros((self.n_workers, n, width), np.uint8),
                                   np.zeros((self.n_workers, n), bool))
        return self.staged[coding]

    def _decode_staged(self) -> None:
        """Decode every worker's coded blocks of this iteration into ``recv``, one call
        per worker and coding (dgt.codec: row by row, so the bits are those of a decode
        per datagram), before the rank-ordered sum."""
        e = self.layout.block_elems
        for coding, (payloads, held) in self.staged.items():
            for w in range(self.n_workers):
                rows = np.flatnonzero(held[w])
                if rows.size == held.shape[1]:   # every block coded: straight into recv
                    codec.decode(coding, payloads[w], e, out=self.recv[w])
                elif rows.size:
                    self.recv[w, rows] = codec.decode(coding, payloads[w, rows], e)
            held.fill(False)

    def _aggregate(self, iteration: int) -> None:
        recv, bitmaps = self.recv, self.bitmaps
        self._decode_staged()
        for w in range(self.n_workers):  # a block that did not arrive counts as zero
            if not bitmaps[w].all():
                recv[w][~bitmaps[w]] = 0
        # finite blocks near float32's limit (a forged datagram, a diverging worker)
        # may sum to inf: no numpy warning in the sidecar's log, and their mean is taken
        # again below, in float64
        with np.errstate(over="ignore", invalid="ignore"):
            acc = self._sum(recv)
            # a NaN/inf in any worker's block makes that block's sum non-finite: one
            # pass over the sum (1/N of the data) finds them; only those are looked at
            bad = np.flatnonzero(~np.isfinite(acc.sum(axis=1)))
            if bad.size:
                self._exclude_non_finite(bad, acc)
            acc /= np.float32(self.n_workers)
            if bad.size:
                self._mean_of_overflows(bad, acc)
            if self.coder is not None:   # two-sided error feedback: the PULL side
                self.coded_pull = self.coder.code(acc)
        flat = acc.reshape(-1)
        self.bitmaps = [None] * self.n_workers
        self.session.advance()
        if self.on_advance is not None:
            self.on_advance(self.session.iteration)
        for w in range(self.n_workers):
            self.on_pull(w, iteration, flat, bitmaps[w])

    def _sum(self, recv: np.ndarray, rows=slice(None)) -> np.ndarray:
        """Sum of the workers' blocks ``rows`` in rank order (bitwise reproducible), as a
        new array: PULL frames send views of it without copying."""
        acc = np.add(recv[0, rows], recv[1, rows]) if self.n_workers > 1 \
            else recv[0, rows].copy()
        for w in range(2, self.n_workers):
            acc += recv[w, rows]
        return acc

    def _mean_of_overflows(self, rows: np.ndarray, acc: np.ndarray) -> None:
        """Blocks ``rows`` summed to NaN/inf and ``acc`` holds their mean: where a sum of
        finite copies overflowed float32 (each worker's values finite, near its limit:
        a diverging trainer, or a forged block), that mean is inf although the true one
        is finite. Such rows get the float64 mean of the copies, rounded to float32
        (a mean of finite float32 values is within float32's range), so no inf
        reaches the model (breaker round 6: 3e38 on two ranks made every replica inf).
        The rows are a few, and the same on every replica: each takes this PULL."""
        sub = acc[rows]
        over = rows[~np.isfinite(sub).all(axis=1)]
        if over.size:
            acc[over] = (self.recv[:, over].astype(np.float64).sum(axis=0)
                         / self.n_workers).astype(np.float32)

    def _exclude_non_finite(self, rows: np.ndarray, acc: np.ndarray) -> None:
        """Blocks ``rows`` summed to NaN/inf: every worker block among them that holds a
        NaN or inf is excluded like a lost block (zero in the sum, "missing" in that
        worker's bitmap, so its sender keeps its own gradient in the residual) and
        counted as ``rejected["non_finite"]``. A forged datagram cannot poison the model
        this way, nor can one worker's overflow (cf. torch.amp.GradScaler, which skips
        a step whose gradients are not finite)."""
        sub = self.recv[:, rows]                       # (workers, len(rows), block_elems)
        bad = ~np.isfinite(sub).all(axis=2)            # (workers, len(rows))
        for w in np.flatnonzero(bad.any(axis=1)):
            self.recv[w, rows[bad[w]]] = 0
            self.bitmaps[w][rows[bad[w]]] = False
        self.session.counters.rejected["non_finite"] += int(bad.sum())
        acc[rows] = self._sum(self.recv, rows)
