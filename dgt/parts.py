"""Wait-free backpropagation: one worker's push, handed over in parts while backward runs.

The trainer (the DDP hook, :mod:`dgt.ddp`) tells its sidecar, bucket by bucket, which
elements of the shared flat gradient are final: ``{"op": "part", "t": t, "ranges":
[[lo, hi], ...]}`` (element ranges ``[lo, hi)``, written to the shared memory before
the message). The blocks lying wholly inside what is final, and not sent yet, are
planned at once (:meth:`dgt.planner.PushPlanner.plan_rows`: residual, scores, ranked
among themselves, the top ``ceil(k m)`` over TCP, the rest in the UDP bands) and handed
to the push sender (:meth:`dgt.transport.sender.PushSender.add`), whose UDP streams go
on while backward computes the next buckets; a block that straddles two buckets goes
when both are in. The ``push`` that follows the last bucket plans the blocks still
unsent (every block when no part came: the whole-vector push of ``dgt.Client``, ranked
all together), sends the colocated shard's blocks in-process, then the tail markers and
END, as before. Each block reaches its shard exactly once per iteration, so the shard's
rank-order sum, the PULL bitmaps, error feedback and the conservation invariant are
those of a whole push (docs/ddp.md, "What overlaps backward").
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from .errors import PeerFailure
from .scheduler.assign import DROPPED
from .transport.sender import SEND_EARLY_S, TcpFrame


class PartPush:
    """The push side of one :class:`dgt.agent.WorkerAgent`: the parts handed over in
    the open iteration, and the task that writes the sender's messages out.

    ``first_sent``: CLOCK_MONOTONIC (s) when the open (or last) iteration's first
    block left for a remote shard (a reliable frame written, or a UDP batch the kernel
    took); None when none did (one node)."""

    def __init__(self, agent):
        self.agent = agent
        lay = agent.layout
        self.e = lay.block_elems
        self.final = np.ones(lay.padded, bool)      # elements final in iteration t
        self.planned = np.zeros(lay.n_blocks, bool)  # blocks handed to the sender
        self.chan = np.zeros(lay.n_blocks, np.int8)  # their channels
        self.t: int | None = None                    # the iteration open, if any
        self.k: float | None = None
        self.first_sent: float | None = None
        self.idle_s = 0.0   # after first_sent: s the sender waited for the next part
        self.wake = asyncio.Event()
        self.pump: asyncio.Task | None = None

    def _open(self, t: int) -> None:
        agent = self.agent
        self.t, self.k, self.first_sent, self.idle_s = t, None, None, 0.0
        agent.marks, agent.pull_at = {}, {}
        self.final[:agent.layout.n_params] = False
        self.planned[:] = False
        agent.sender.begin(t, agent.ranges, agent.rank)
        agent.sending = True
        self.pump = asyncio.get_running_loop().create_task(self._pump())

    def add(self, t: int, ranges) -> None:
        """Elements ``ranges`` ([[lo, hi], ...], ints) of iteration ``t`` are final in the
        shared gradient: send the blocks they complete. Raises ValueError for a range
        outside the model or one given twice in the iteration."""
        if self.t != t:
            self._open(t)
        n = self.agent.layout.n_params
        if not isinstance(ranges, list) or not ranges:
            raise ValueError(f"part of iteration {t}: 'ranges' must be a non-empty list "
                             f"of [lo, hi] element ranges")
        b0, b1 = self.planned.size, 0
        for r in ranges:
            lo, hi = r if isinstance(r, list) and len(r) == 2 else (None, None)
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= n):
                raise ValueError(f"part of iteration {t}: range {r!r} is not [lo, hi) "
                                 f"with 0 <= lo < hi <= {n} (the model's elements)")
            if self.final[lo:hi].any():
                raise ValueError(f"part of iteration {t}: elements [{lo}, {hi}) were "
                                 f"handed over before in this iteration")
            self.final[lo:hi] = True
            b0, b1 = min(b0, lo // self.e), max(b1, -(-hi // self.e))
        if self.agent.planner.scores.fresh:
            return   # the first push scores every block at once: all of it at the push
        done = self.final[b0 * self.e:b1 * self.e].reshape(-1, self.e).all(axis=1)
        rows = b0 + np.flatnonzero(done & ~self.planned[b0:b1])
        if rows.size:
            if self.k is None:
                self.k = self.agent.planner.iteration_k(None)
            self._hand_over(rows, self.agent.planner.plan_rows(self.agent.grad, rows,
                                                               self.k))

    def _hand_over(self, rows: np.ndarray, chan: np.ndarray) -> None:
        agent = self.agent
        self.planned[rows], self.chan[rows] = True, chan
        blocks = agent.planner.work.numpy().reshape(-1, self.e)
        # the reliable frames view the work buffer: its rows are rewritten only by the
        # next iteration's plan, after every shard's PULL, i.e. after each has them
        frames = agent.sender.add(rows, chan, blocks, agent.planner.coded)
        for f in frames:
            agent.links.send_tcp(f.shard, f.frame)
        if frames:
            self._mark_sent()
        self.wake.set()

    def _mark_sent(self) -> None:
        if self.first_sent is None:
            self.first_sent = time.monotonic()
            self.agent.marks["first_sent_s"] = time.time()

    async def push(self, t: int, loss: float | None) -> float:
        """The last bucket is in: send what is left of iteration ``t`` (all of it when
        no part came), the colocated shard's blocks, then the tail markers and END.
        Returns k."""
        agent, lay = self.agent, self.agent.layout
        if self.t != t:
            self._open(t)
        if not self.planned.any():   # the whole vector at once, ranked all together
            chan, self.k = agent.planner.plan(agent.grad, loss)
            self._hand_over(np.arange(lay.n_blocks), chan)
        elif not self.planned.all():
            rows = np.flatnonzero(~self.planned)
            self._hand_over(rows, agent.planner.plan_rows(agent.grad, rows, self.k))
        agent.sender.finish()
        agent.marks["reliable_sent_s"] = time.time()
        lo, hi = lay.shard_lo(agent.rank), lay.shard_hi(agent.rank)   # in-process
        blocks = agent.planner.work.numpy().reshape(-1, self.e)
        agent.links.local_push(t, blocks[lo:hi], self.chan[lo:hi] != DROPPED,
                               time.monotonic())
        pump, self.pump, self.t = self.pump, None, None
        await pump
        return self.k

    async def _pump(self) -> None:
        """Write out what the sender says, when it says, until its END is out; while
        it waits for more blocks, the held PULLs of the last iteration may go."""
        agent, sender, links = self.agent, self.agent.sender, self.agent.links
        while not sender.done:
            for out in sender.datagrams_to_send(time.monotonic(), links.tcp_backlog):
                if isinstance(out, TcpFrame):
                    links.send_tcp(out.shard, out.frame)
                else:
                    sender.sent(out, links.send_udp(out.channel, out.shard, out.rows),
                                time.monotonic())
                    if not out.tail:
                        self._mark_sent()
            at, now = sender.get_timer(), time.monotonic()
            if at is None or at - now <= SEND_EARLY_S:
                continue
            self.wake.clear()
            if at == float("inf"):   # idle until the next part (or the push)
                agent.sending = False
                links.push_sent()
                idle_from = time.monotonic()
                await self.wake.wait()
                if self.first_sent is not None:
                    self.idle_s += time.monotonic() - max(idle_from, self.first_sent)
                agent.sending = True
            elif sender.final:
                await asyncio.sleep(at - now)
            else:   # a batch is due later, unless a part brings more first
                try:
                    await asyncio.wait_for(self.wake.wait(), at - now)
                except asyncio.TimeoutError:
                    pass
        agent.sending = False
        agent.marks["end_s"] = time.time()
        links.push_sent()


async def part_op(sidecar, msg: dict) -> None:
    """The sidecar's ``part`` op (dgt.trainer_link). Raises PeerFailure (the job
    fails, naming this rank) for a part before register, of another iteration than
    the next push's, or with bad ranges."""
    agent, rank = sidecar.agent, sidecar.rank
    if agent is None:
        raise PeerFailure(f"rank {rank}: part before register", rank)
    t = msg.get("t")
    expected = agent.iteration + 1 if sidecar.pushes else 0
    if t != expected:
        raise PeerFailure(f"rank {rank} handed over a part of iteration {t!r}, expected "
                          f"{expected}", rank)
    try:
        agent.parts.add(t, msg.get("ranges"))
    except ValueError as e:
        raise PeerFailure(f"rank {rank}: {e}", rank) from None
