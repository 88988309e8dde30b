"""Worker agent: turns one push into blocks on channels, and the PULLs into the aggregate.

Per push (docs/architecture.md, "One BSP iteration", steps 2 and 4): ``g = grad +
residual``; update contribution scores; rank; assign channels; send reliable blocks
(TCP), local blocks (in-process to the colocated shard), unreliable blocks (UDP, paced,
one DSCP per channel), then END per shard; wait for every shard's PULL;
``residual_b = g_b`` where the block did not arrive.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .errors import PeerFailure
from .failure import FailureReason
from .config import TransmissionConfig
from .contribution import ContributionScores
from .feedback import Residual
from .layout import BlockLayout
from .scheduler.assign import (DROPPED, AdaptiveK, assign_channels, rank_blocks,
                               reliable_count)
from .scheduler.pacing import TokenBucket, drain_wait, flow_share
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
    tcp_backlog: Callable[[int], int] = lambda s: 0  # bytes our TCP to that node has unsent
    push_sent: Callable[[], None] = lambda: None       # our push has left (END sent)


#: unsent TCP bytes to a node below which its UDP blocks may start (two GSO batches)
TCP_BACKLOG_SLACK = 128 * 1024
#: copies of each tail marker (dgt.transport.session: END on a UDP channel)
TAIL_COPIES = 2
#: per-node UDP bucket depth: two GSO batches, so a timer that fires late (the event
#: loop's timers have 1 ms resolution) is made up by the next batch, not lost
UDP_BURST_BYTES = 2 * 65536


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
        # one equal share of the egress port per peer node (scheduler.pacing.flow_share):
        # the TCP flows to it are paced at that share by the kernel; the UDP blocks to it
        # wait until that TCP has left (tcp_backlog), then go at the same share
        self.share = flow_share(cfg.pace_mbit, layout.n_shards - 1)
        now = time.monotonic()
        self.buckets = {s: TokenBucket.bytes_per_s(self.share, UDP_BURST_BYTES, now)
                        for s in range(layout.n_shards) if s != rank}
        self.pulls: dict[int, np.ndarray] = {}   # shard -> received bitmap
        self.pull_waiter: asyncio.Future | None = None
        self.iteration = 0
        self.sending = False   # between plan() and END: our push is on the port
        self.k_history: list[float] = []
        # per-iteration trace (dgt.trace): wall-clock marks of the push in flight, each
        # shard's PULL, and how many of our blocks did not arrive
        self.marks: dict[str, float] = {}
        self.pull_at: dict[int, float] = {}
        self.not_arrived = 0
        # conservation invariant (docs/architecture.md): float64 running sums
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
        self.sending = True
        self.marks, self.pull_at = {}, {}
        chan, k = self.plan(loss)
        self.k_history.append(k)
        lay, me = self.layout, self.rank
        blocks = self.work.numpy().reshape(lay.n_blocks, lay.block_elems)
        loop = asyncio.get_running_loop()
        self.pull_waiter = loop.create_future()
        counts = np.zeros((lay.n_shards, wire.MAX_CHANNELS), np.int64)
        ctr = self.counters.channels
        frames: list[tuple[int, list]] = []
        for s in range(lay.n_shards):  # reliable first: the important blocks
            lo, hi = lay.shard_lo(s), lay.shard_hi(s)
            sc = chan[lo:hi]
            sent = sc != DROPPED
            self.counters.blocks_unsent += int(sc.size - sent.sum())
            if s == me:   # in-process, after the network sends are under way
                self.counters.blocks_local += int(sent.sum())
                local = (blocks[lo:hi], sent)
                continue
            rel = np.flatnonzero(sc == 0)
            counts[s, 0] = rel.size
            if rel.size:
                # all reliable (tcp mode): send a view of the work buffer, no gather. It
                # is rewritten only by the next plan(), after every shard's PULL, i.e.
                # after each shard has received these bytes.
                data = blocks[lo:hi] if rel.size == hi - lo else blocks[lo + rel]
                frame = wire.encode_parts(
                    MsgType.BLOCKS, session=self.session, sender=me, shard=s, iteration=t,
                    channel=0, block=int(lo + rel[0]), count=rel.size, flags=Flag.INDEXED,
                    key=self.key, parts=wire.indexed_blocks_parts(lo + rel, data))
                frames.append((s, frame))
                ctr[0].blocks_sent += rel.size
        for s, frame in frames:
            self.links.send_tcp(s, frame)
            size = sum(memoryview(b).nbytes for b in frame)
            ctr[0].bytes_sent += size
        self.marks["reliable_sent_s"] = time.time()
        self.links.local_push(t, *local, time.monotonic())
        streams = []   # per peer node: its UDP blocks, best band first
        for off in range(1, lay.n_shards):  # from me+1 on: senders start apart
            s = (me + off) % lay.n_shards
            lo, hi = lay.shard_lo(s), lay.shard_hi(s)
            segments = []
            for c in range(1, self.cfg.channels + 1):
                idx = lo + np.flatnonzero(chan[lo:hi] == c)
                counts[s, c] = idx.size
                if not idx.size:
                    continue
                segments.append((c, wire.encode_block_datagrams(
                    session=self.session, sender=me, shard=s, iteration=t, channel=c,
                    indices=idx, blocks=blocks[idx], key=self.key)))
                ctr[c].blocks_sent += idx.size
                ctr[c].bytes_sent += segments[-1][1].size
            if segments:
                streams.append((s, segments))
        await self._send_paced(streams, counts)
        for s in range(lay.n_shards):
            if s == me:
                continue
            self.links.send_tcp(s, wire.encode(
                MsgType.END, session=self.session, sender=me, shard=s, iteration=t,
                count=int(counts[s].sum()), payload=wire.pack_end(counts[s]), key=self.key))
        self.sending = False
        self.marks["end_s"] = time.time()
        self.links.push_sent()
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
                                  stalled[0] if stalled else missing[0],
                                  FailureReason.PEER_SILENT, stalled or missing) from None
        self._apply(t)
        return k

    async def _send_paced(self, streams: list, counts: np.ndarray | None = None) -> None:
        """Send each peer node's UDP datagrams (``streams``: [(node, [(channel, (n, size)
        uint8 datagrams), ...])], channels best first) in GSO batches of <= 64 KB. The
        nodes go concurrently, each at its own share of the port (its bucket) once our
        TCP bytes to it have left, always the batch that is due first: so every node's
        stream is continuous (no barrier between channels), and no receiving port gets
        more than its rate from all senders together (no incast).

        A batch our own egress queue refuses (ENOBUFS) or our socket buffer cannot take
        is retried; when that band stays refused for ``_refused_budget`` (it is starved,
        e.g. CS1 under best-effort bulk traffic), the rest of that node's band is dropped
        here: counted as ``blocks_dropped_local``, taken out of ``counts`` (the END
        counts, so the shard does not wait for them) and kept by error feedback."""
        send = self.links.send_udp
        seg = [0] * len(streams)      # current (channel, datagrams) segment per node
        pos = [0] * len(streams)      # next row in it
        charged = [0] * len(streams)  # rows whose tokens are taken, not yet sent
        due: dict[int, float] = {}
        give_up: dict[int, float | None] = {}   # node -> stop waiting for its TCP then
        refused_since: dict[int, float] = {}   # node -> first refused send of this band

        def take(j: int, now: float) -> None:
            s, segments = streams[j]
            n, size = segments[seg[j]][1].shape
            if self.share > 0:
                # a paced port: that node's TCP bytes leave first; bounded, so a peer
                # that stopped reading cannot stall our push: END still goes and the
                # PULL wait names the peer
                wait, give_up[j] = drain_wait(self.links.tcp_backlog(s), self.share,
                                              TCP_BACKLOG_SLACK, now, give_up.get(j))
                if wait:
                    charged[j] = 0
                    due[j] = now + wait
                    # the share is the TCP's until then: no tokens saved up meanwhile
                    self.buckets[s].hold(now, due[j])
                    return
            charged[j] = min(self._batch_rows(size), n - pos[j])
            due[j] = now + self.buckets[s].delay(charged[j] * size, now)

        now = time.monotonic()
        for j in range(len(streams)):
            # a bucket idle since the last push is full; start with one batch at most, so
            # the N-1 first batches together fit the egress queue
            s, segments = streams[j]
            size = segments[0][1].shape[1]
            self.buckets[s].hold(now, now, self._batch_rows(size) * size)
            take(j, now)
        while due:
            j = min(due, key=due.__getitem__)
            wait = due[j] - time.monotonic()
            if wait > 0.0005:
                await asyncio.sleep(wait)
            if not charged[j]:   # it was waiting for that node's TCP backlog
                take(j, time.monotonic())
                continue
            s, segments = streams[j]
            c, dgrams = segments[seg[j]]
            sent = send(c, s, dgrams[pos[j]:pos[j] + charged[j]])
            pos[j] += sent
            charged[j] -= sent
            now = time.monotonic()
            if sent:
                refused_since.pop(j, None)
            if charged[j]:   # socket buffer or our own qdisc full: let it drain
                first = refused_since.setdefault(j, now)
                if now - first < self._refused_budget(dgrams.shape[1]):
                    # retry after half a batch's time at our share: a queue that is
                    # draining takes it then, and a starved one costs few syscalls
                    due[j] = now + self._retry_after(dgrams.shape[1])
                    continue
                dropped = dgrams.shape[0] - pos[j]   # the band is starved: drop its rest
                ctr = self.counters.channels[c]
                ctr.blocks_dropped_local += dropped
                ctr.blocks_sent -= dropped
                ctr.bytes_sent -= dropped * dgrams.shape[1]
                if counts is not None:
                    counts[s, c] -= dropped
                charged[j], pos[j] = 0, dgrams.shape[0]
            refused_since.pop(j, None)
            if pos[j] == dgrams.shape[0]:
                if counts is not None:
                    self._send_tail(c, s, int(counts[s, c]))
                seg[j], pos[j] = seg[j] + 1, 0
            if seg[j] < len(segments):
                take(j, now)
            else:
                del due[j]

    def _send_tail(self, channel: int, shard: int, count: int) -> None:
        """Channel ``channel``'s tail marker to ``shard``: END on that channel, after its
        last block and in the same queue, so the shard need not wait out the deadline
        for blocks that were lost (transport.session). Best effort: a marker that is
        refused or lost leaves the deadline in charge. Sent ``TAIL_COPIES`` times: one
        random loss (1 % of 3 markers to each of N-1 nodes) would otherwise cost a whole
        deadline in a third of the iterations of a 4-node job."""
        frame = wire.encode(MsgType.END, session=self.session, sender=self.rank,
                            shard=shard, iteration=self.iteration, channel=channel,
                            count=count, key=self.key)
        rows = np.frombuffer(frame, np.uint8)[None].repeat(TAIL_COPIES, axis=0)
        self.counters.tail_markers += self.links.send_udp(channel, shard, rows)

    @staticmethod
    def _batch_rows(datagram_bytes: int) -> int:
        """Datagrams per GSO send (one UDP payload of at most 65,000 bytes)."""
        return max(1, 65000 // datagram_bytes)

    def _retry_after(self, datagram_bytes: int) -> float:
        batch = self._batch_rows(datagram_bytes) * datagram_bytes
        return max(0.0005, batch / self.share / 2) if self.share > 0 else 0.0005

    def _refused_budget(self, datagram_bytes: int) -> float:
        """Seconds a band may keep refusing sends before the rest of it is dropped:
        the time our share of the port takes for 4 GSO batches (at least 2 ms), i.e. a
        queue that does not drain while higher bands go first."""
        batch = self._batch_rows(datagram_bytes) * datagram_bytes
        return max(0.002, 4 * batch / self.share) if self.share > 0 else 0.05

    # -- pull -------------------------------------------------------------------------
    def on_pull(self, shard: int, iteration: int, aggregate: np.ndarray,
                received: np.ndarray) -> bool:
        """A shard's PULL (network or local): ``aggregate`` ((shard_blocks * block_elems,)
        float32, may be a view into a receive buffer) is copied straight into the
        trainer's shared aggregate. Returns False (caller counts it) when it is not for
        the iteration in flight or repeats one already taken."""
        if iteration != self.iteration or shard in self.pulls or self.pull_waiter is None:
            return False
        lay = self.layout
        self.aggregate[lay.shard_lo(shard) * lay.block_elems:
                       lay.shard_hi(shard) * lay.block_elems] = aggregate
        self.pulls[shard] = received.copy()
        self.pull_at[shard] = time.time()
        if len(self.pulls) == self.layout.n_shards and not self.pull_waiter.done():
            self.pull_waiter.set_result(None)
        return True

    def _apply(self, t: int) -> None:
        lay = self.layout
        arrived = np.concatenate([self.pulls[s] for s in range(lay.n_shards)])
        self.pulls.clear()
        self.pull_waiter = None
        self.not_arrived = int(arrived.size - np.count_nonzero(arrived))
        self.residual.update(self.work, torch.from_numpy(arrived))
        if self.applied_sum is not None:
            self.applied_sum += torch.from_numpy(self.aggregate).double() * lay.n_shards
