"""Worker agent: turns one push into blocks on channels, and the PULLs into the aggregate.

Per push (DESIGN.md, steps 2 and 4): ``g = grad + residual``; update contribution
scores; rank; assign channels; send reliable blocks (TCP), local blocks (in-process to the
colocated shard), unreliable blocks (UDP, paced, one DSCP per channel), then END per
shard; wait for every shard's PULL; ``residual_b = g_b`` where the block did not arrive.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .errors import PeerFailure
from .config import TransmissionConfig
from .contribution import ContributionScores
from .feedback import Residual
from .layout import BlockLayout
from .scheduler.assign import (DROPPED, AdaptiveK, assign_channels, rank_blocks,
                               reliable_count)
from .scheduler.pacing import TokenBucket
from .transport import wire
from .transport.counters import Counters
from .transport.wire import Flag, MsgType


@dataclass
class Links:
    """How the agent reaches the network (filled in by the sidecar)."""

    send_tcp: Callable[[int, bytes], None]            # (shard, frame)
    send_udp: Callable[[int, int, np.ndarray], int]  # (channel, shard, rows) -> sent
    local_push: Callable[[int, np.ndarray, np.ndarray, float], None]
    waiting_for: Callable[[int], list[int]] = lambda t: []  # ranks shard me awaits in t


class WorkerAgent:
    """One node's worker side. ``grad`` and ``aggregate``: (padded,) float32 arrays over
    the trainer's shared memory."""

    def __init__(self, cfg: TransmissionConfig, layout: BlockLayout, rank: int,
                 session: int, key: bytes | None, grad: np.ndarray, aggregate: np.ndarray,
                 links: Links, counters: Counters, seed: int = 0):
        self.cfg, self.layout, self.rank, self.session, self.key = (cfg, layout, rank,
                                                                    session, key)
        self.grad = torch.from_numpy(grad)
        self.aggregate = aggregate
        self.links, self.counters = links, counters
        n = layout.n_blocks
        self.work = torch.zeros(layout.padded, dtype=torch.float32)
        self.scores = ContributionScores(n, cfg.alpha)
        self.residual = Residual(layout.padded, layout.block_elems, cfg.error_feedback)
        self.adaptive = AdaptiveK(cfg.k, min(cfg.k_min, cfg.k)) if cfg.adaptive_k else None
        self.gen = torch.Generator().manual_seed(seed * 1009 + rank)
        self.bucket = TokenBucket(cfg.pace_mbit, now=time.monotonic())
        self.pulls: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.pull_waiter: asyncio.Future | None = None
        self.iteration = 0
        self.k_history: list[float] = []
        # conservation invariant (DESIGN.md): float64 running sums
        self.raw_sum = torch.zeros(layout.padded, dtype=torch.float64) \
            if cfg.check_conservation else None
        self.applied_sum = torch.zeros_like(self.raw_sum) if self.raw_sum is not None else None

    # -- push -------------------------------------------------------------------------
    def plan(self, loss: float | None) -> tuple[np.ndarray, float]:
        """Compensate, score, rank and assign. Returns (channel per block (n_blocks,)
        int8, k used)."""
        cfg, n = self.cfg, self.layout.n_blocks
        g = self.work
        g.copy_(self.grad)
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
        return chan, k

    async def push(self, t: int, loss: float | None, timeout_s: float) -> float:
        """Run iteration ``t`` to the applied aggregate. Returns k. Raises PeerFailure
        when a shard's PULL does not come within ``timeout_s``."""
        self.iteration = t
        chan, k = self.plan(loss)
        self.k_history.append(k)
        lay, me = self.layout, self.rank
        blocks = self.work.numpy().reshape(lay.n_blocks, lay.block_elems)
        loop = asyncio.get_running_loop()
        self.pull_waiter = loop.create_future()
        counts = np.zeros((lay.n_shards, wire.MAX_CHANNELS), np.int64)
        ctr = self.counters.channels
        for s in range(lay.n_shards):  # reliable first: the important blocks
            lo, hi = lay.shard_lo(s), lay.shard_hi(s)
            sc = chan[lo:hi]
            sent = sc != DROPPED
            self.counters.blocks_unsent += int(sc.size - sent.sum())
            if s == me:
                self.counters.blocks_local += int(sent.sum())
                self.links.local_push(t, blocks[lo:hi], sent, time.monotonic())
                continue
            rel = np.flatnonzero(sc == 0)
            counts[s, 0] = rel.size
            if rel.size:
                frame = wire.encode(MsgType.BLOCKS, session=self.session, sender=me,
                                    shard=s, iteration=t, channel=0, block=int(lo + rel[0]),
                                    count=rel.size, flags=Flag.INDEXED, key=self.key,
                                    payload=wire.pack_indexed_blocks(lo + rel, blocks[lo + rel]))
                self.links.send_tcp(s, frame)
                ctr[0].blocks_sent += rel.size
                ctr[0].bytes_sent += len(frame)
        for c in range(1, self.cfg.channels + 1):  # then UDP, best band first
            per_shard = []
            for off in range(1, lay.n_shards):  # from me+1 on: senders start apart
                s = (me + off) % lay.n_shards
                lo, hi = lay.shard_lo(s), lay.shard_hi(s)
                idx = lo + np.flatnonzero(chan[lo:hi] == c)
                counts[s, c] = idx.size
                if not idx.size:
                    continue
                per_shard.append((s, wire.encode_block_datagrams(
                    session=self.session, sender=me, shard=s, iteration=t, channel=c,
                    indices=idx, blocks=blocks[idx], key=self.key)))
                ctr[c].blocks_sent += idx.size
                ctr[c].bytes_sent += per_shard[-1][1].size
            await self._send_paced(c, per_shard)
        for s in range(lay.n_shards):
            if s == me:
                continue
            self.links.send_tcp(s, wire.encode(
                MsgType.END, session=self.session, sender=me, shard=s, iteration=t,
                count=int(counts[s].sum()), payload=wire.pack_end(counts[s]), key=self.key))
        if len(self.pulls) < lay.n_shards:
            try:
                await asyncio.wait_for(asyncio.shield(self.pull_waiter), timeout_s)
            except asyncio.TimeoutError:
                missing = sorted(set(range(lay.n_shards)) - set(self.pulls))
                stalled = [w for w in self.links.waiting_for(t) if w != me]
                why = (f"; shard {me} never got END({t}) from rank(s) {stalled} "
                       f"(dead or frozen)" if stalled else "")
                raise PeerFailure(f"no PULL for iteration {t} from shard(s) {missing} "
                                  f"within {timeout_s:.0f} s{why}",
                                  stalled[0] if stalled else missing[0]) from None
        self._apply(t)
        return k

    async def _send_paced(self, channel: int, per_shard: list) -> None:
        """Send each shard's (n, size) datagrams in GSO batches of <= 64 KB, round-robin
        over the shards (so no receiver port gets every sender's full rate at once:
        no incast), each batch paced as one burst by the token bucket."""
        bucket, send = self.bucket, self.links.send_udp
        pos = [0] * len(per_shard)
        live = list(range(len(per_shard)))
        while live:
            for j in list(live):
                s, dgrams = per_shard[j]
                n, size = dgrams.shape
                k = min(max(1, 65000 // size), n - pos[j])
                d = bucket.delay(k * size, time.monotonic())
                if d > 0.0005:
                    await asyncio.sleep(d)
                sent = send(channel, s, dgrams[pos[j]:pos[j] + k])
                if sent < k:  # socket send buffer full: let the kernel drain it
                    await asyncio.sleep(0.0005)
                pos[j] += sent
                if pos[j] >= n:
                    live.remove(j)

    # -- pull -------------------------------------------------------------------------
    def on_pull(self, shard: int, iteration: int, aggregate: np.ndarray,
                received: np.ndarray) -> bool:
        """A shard's PULL (network or local). Returns False (caller counts it) when it is
        not for the iteration in flight or repeats one already taken."""
        if iteration != self.iteration or shard in self.pulls or self.pull_waiter is None:
            return False
        self.pulls[shard] = (aggregate, received)
        if len(self.pulls) == self.layout.n_shards and not self.pull_waiter.done():
            self.pull_waiter.set_result(None)
        return True

    def _apply(self, t: int) -> None:
        lay = self.layout
        arrived = np.concatenate([self.pulls[s][1] for s in range(lay.n_shards)])
        for s in range(lay.n_shards):
            lo, hi = lay.shard_lo(s) * lay.block_elems, lay.shard_hi(s) * lay.block_elems
            self.aggregate[lo:hi] = self.pulls[s][0]
        self.pulls.clear()
        self.pull_waiter = None
        self.residual.update(self.work, torch.from_numpy(arrived))
        if self.applied_sum is not None:
            self.applied_sum += torch.from_numpy(self.aggregate).double() * lay.n_shards
