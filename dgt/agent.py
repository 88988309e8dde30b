"""Worker agent: turns one push into blocks on channels, and the PULLs into the aggregate.

Per push (docs/architecture.md, "One BSP iteration", steps 2 and 4), with dgt.planner
for the decisions and transport.sender for the messages: ``g = grad +
residual``; update contribution scores; rank; assign channels; send reliable blocks
(TCP), local blocks (in-process to the colocated shard), unreliable blocks (UDP, paced,
one DSCP per channel), then END per shard; wait for every shard's PULL;
``residual_b = g_b`` where the block did not arrive. The sending is dgt.parts's: the
whole vector at once, or (the DDP hook) in parts while backward runs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .errors import PeerFailure
from .failure import FailureReason
from .config import TransmissionConfig
from .layout import BlockLayout
from .parts import PartPush
from .planner import PushPlanner
from .push_meter import PushMeter
from .rank_list import rank_list
from .scheduler.pacing import PortPacing
from .transport.counters import Counters
from .transport.reasons import Reason
from .transport.sender import PushSender

log = logging.getLogger("dgt.sidecar")


@dataclass
class Links:
    """How the agent reaches the network (filled in by the sidecar)."""

    send_tcp: Callable[[int, bytes], None]            # (shard, frame)
    send_udp: Callable[[int, int, np.ndarray], int]  # (channel, shard, rows) -> sent
    local_push: Callable[[int, np.ndarray, np.ndarray, float], None]
    waiting_for: Callable[[int], list[int]] = lambda t: []  # ranks shard me awaits in t
    ends_refused: Callable[[int], dict] = lambda t: {}  # of those, END refused: why
    tcp_backlog: Callable[[int], int] = lambda s: 0  # bytes our TCP to that node has unsent
    push_sent: Callable[[], None] = lambda: None       # our push has left (END sent)
    udp_backlog: Callable[[], int] = lambda: 0       # bytes our UDP sockets have unsent


#: unsent TCP bytes to a node below which its UDP blocks may start (two GSO batches)
TCP_BACKLOG_SLACK = 128 * 1024
#: per-node UDP bucket depth: two GSO batches, so a timer that fires late (the event
#: loop's timers have 1 ms resolution) is made up by the next batch, not lost
UDP_BURST_BYTES = 2 * 65536


def stalled_text(me: int, t: int, stalled: list[int], refused: dict[int, str]) -> str:
    """What shard ``me`` waits on in iteration ``t``: the ranks whose END did not come
    (dead or frozen), and those whose END came and was refused (``refused``: rank ->
    the reason counted; breaker round 11: a live peer whose END was refused was called
    dead or frozen). "" when ``stalled`` is empty."""
    if not stalled:
        return ""
    silent = [w for w in stalled if w not in refused]
    lied = [w for w in stalled if w in refused]
    parts = [f"rank(s) {rank_list(silent)} (dead or frozen)"] if silent else []
    if lied:
        reasons = ", ".join(sorted({refused[w] for w in lied}))
        parts.append(f"rank(s) {rank_list(lied)}, whose END it refused ({reasons}: "
                     f"a broken or forged END, see the report's rejected counters)")
    return f"; shard {me} never got END({t}) from " + " nor from ".join(parts)


#: s: how long a push whose PULL wait ran out still reads what its sockets hold before
#: it fails, naming the shards still missing
QUEUED_GRACE_S = 0.5


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
        self.planner = PushPlanner(cfg, layout, rank, seed)
        p = self.planner   # the report and the metrics read these here
        self.residual, self.k_history, self.raw_sum, self.applied_sum = (
            p.residual, p.k_history, p.raw_sum, p.applied_sum)
        # one equal share of the egress port per peer node (scheduler.pacing.flow_share):
        # the TCP flows to it are paced at that share by the kernel; the UDP blocks to it
        # wait until that TCP has left (tcp_backlog), then go at the same share
        pacing = PortPacing(cfg.pace_mbit, [s for s in range(layout.n_shards) if s != rank],
                            layout.n_shards - 1, UDP_BURST_BYTES, TCP_BACKLOG_SLACK,
                            time.monotonic())
        self.sender = PushSender(session=session, rank=rank, key=key, counters=counters,
                                 pacing=pacing)
        self.ranges = [(layout.shard_lo(s), layout.shard_hi(s))
                       for s in range(layout.n_shards)]
        self.pulls: dict[int, np.ndarray] = {}   # shard -> received bitmap
        self.pull_waiter: asyncio.Future | None = None
        self.on_range: Callable[[int, int], None] | None = None   # this push's (push())
        self.iteration = 0
        self.sending = False   # our push has blocks on the port (dgt.parts)
        # per-iteration trace (dgt.trace): wall-clock marks of the push in flight, each
        # shard's PULL, and how many of our blocks did not arrive
        self.marks: dict[str, float] = {}
        self.pull_at: dict[int, float] = {}
        self.not_arrived = 0
        self.parts = PartPush(self)   # the push, whole or in parts (wait-free backprop)
        # --time-budget-ms: each push's bytes and seconds on the link, for the budget
        self.meter = PushMeter(counters, links.tcp_backlog, links.udp_backlog,
                               [s for s in range(layout.n_shards) if s != rank]) \
            if self.planner.budget is not None else None

    # -- push -------------------------------------------------------------------------
    async def push(self, t: int, loss: float | None, timeout_s: float,
                   pulled: Callable[[float], None] | None = None,
                   on_range: Callable[[int, int], None] | None = None) -> float:
        """Run iteration ``t`` to the applied aggregate: what its parts (dgt.parts) did
        not send yet, then the PULLs. Returns k. Raises PeerFailure when a shard's PULL
        does not come within ``timeout_s`` (and :data:`QUEUED_GRACE_S` more, in which
        what is queued in the sockets is read).

        ``on_range(lo, hi)``: called as each shard's PULL is in the aggregate, with its
        element range [lo, hi) of the padded vector, so the trainer can apply that
        range before the last one lands (PULLs pipelined per shard range).
        ``pulled(k)``: called once every PULL is in, before the residual is settled,
        so the trainer's optimiser step and our bookkeeping overlap."""
        self.iteration = t
        lay, me, links = self.layout, self.rank, self.links
        self.pull_waiter = asyncio.get_running_loop().create_future()
        self.on_range = on_range
        k = await self.parts.push(t, loss)
        if self.meter is not None:
            self.meter.end_sent()
        if len(self.pulls) < lay.n_shards:
            # asyncio.wait, not wait_for: what fails the push is a PULL still missing
            # once the time is up, never the timer itself. wait_for raised TimeoutError
            # when the last PULL came in the same turn of the loop as its timer, and the
            # message built from an empty list of missing shards raised IndexError: a
            # peer thawed after a SIGSTOP of exactly --peer-timeout-s (breaker round 12)
            await asyncio.wait([self.pull_waiter], timeout=timeout_s)
            if len(self.pulls) < lay.n_shards:
                # before blaming anyone, read what is queued: a sidecar that was itself
                # stopped (SIGSTOP) or starved past its deadline runs its expired timer
                # before it reads its sockets (uvloop: timers, then I/O), where its
                # peers' PULLs, or the ERROR of the one that timed out on it, wait
                # (re-check of breaker round 12: a thawed rank blamed the healthy one)
                await asyncio.wait([self.pull_waiter], timeout=QUEUED_GRACE_S)
            missing = sorted(set(range(lay.n_shards)) - set(self.pulls))
            if missing:
                stalled = [w for w in links.waiting_for(t) if w != me]
                refused = links.ends_refused(t)
                why = stalled_text(me, t, stalled, refused)
                raise PeerFailure(f"no PULL for iteration {t} from shard(s) "
                                  f"{rank_list(missing, 'shards')} "
                                  f"within {timeout_s:.0f} s{why}",
                                  stalled[0] if stalled else missing[0],
                                  FailureReason.PEER_REFUSED if stalled and
                                  set(stalled) <= set(refused) else
                                  FailureReason.PEER_SILENT, stalled or missing) from None
        arrived = self._arrived()
        if pulled is not None:
            pulled(k)
        self._settle(arrived)
        return k

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
        lo, hi = lay.shard_lo(shard) * lay.block_elems, lay.shard_hi(shard) * lay.block_elems
        self.aggregate[lo:hi] = aggregate
        if hi > lay.n_params and self.aggregate[lay.n_params:hi].any():
            # the padding after the last parameter is zeros (docs/wire.md); a PULL that
            # says otherwise (NaN included) is applied without it: on CPU the trainer's
            # gradient shares this memory, and the padding would come back in the next
            # push, costing this rank its own last block (breaker round 11)
            self.aggregate[lay.n_params:hi] = 0.0
            self.counters.rejected[Reason.PULL_PADDING] += 1
            if self.counters.rejected[Reason.PULL_PADDING] == 1:
                log.warning("rank %d: shard %d's PULL for iteration %d held non-zero "
                            "padding after the last parameter; applied without it "
                            "(counted in rejected pull_padding)", self.rank, shard,
                            iteration)
        self.planner.applied(lo, self.aggregate[lo:hi])
        self.pulls[shard] = received.copy()
        self.pull_at[shard] = time.time()
        if self.on_range is not None:
            self.on_range(lo, hi)
        if len(self.pulls) == self.layout.n_shards and not self.pull_waiter.done():
            self.pull_waiter.set_result(None)
        return True

    def _arrived(self) -> np.ndarray:
        """Every PULL is in: the (n_blocks,) bool map of our blocks that arrived."""
        arrived = np.concatenate([self.pulls[s] for s in range(self.layout.n_shards)])
        self.pulls.clear()
        self.pull_waiter = None
        self.on_range = None
        self.not_arrived = int(arrived.size - np.count_nonzero(arrived))
        return arrived

    def _settle(self, arrived: np.ndarray) -> None:
        self.planner.settle(arrived)
        bad = self.planner.non_finite_blocks
        if bad != self.counters.blocks_non_finite:
            if not self.counters.blocks_non_finite:   # the first: once in the log
                log.warning("rank %d: push %d held NaN or inf in %d block(s): sent as "
                            "zeros and kept out of the residual (the trainer's gradient "
                            "overflowed? counted in blocks_non_finite)", self.rank,
                            self.iteration, bad)
            self.counters.blocks_non_finite = bad
        if self.meter is not None:
            self.meter.settle(self.planner, self.parts.first_sent, self.parts.idle_s)
