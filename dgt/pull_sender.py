"""A shard's PULLs to the workers (docs/architecture.md, "One BSP iteration", step 3).

Each PULL goes on the connection its worker dialled (TCP, EF). On a paced port a PULL is
held while our own push is still on the port, while our push to that worker has not
left (its share of the port is busy: scheduler.pacing.HeldPulls) or while our UDP
blocks still sit in our egress queue (scheduler.pacing.OwnQueueGate): the push goes
first, so no peer's port gets two shares from us (incast).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import numpy as np

from .agent import TCP_BACKLOG_SLACK
from .layout import BlockLayout
from .peer_links import PeerLinks
from .pull_codec import CodedPull
from .scheduler.pacing import HeldPulls, OwnQueueGate, flow_share
from .transport import messages
from .transport.aio import FrameProtocol


class PullSender:
    """``conn_of(worker)``: the accepted connection that worker's PULLs go on, or None;
    ``sending()``: True while our own push is on the port; ``iteration()``: the
    iteration of our push; ``coded()``: the shard's coded PULL of the iteration
    (dgt.pull_codec, ``--pull-codec``) or None. ``held``: PULLs that waited (the
    report's ``pulls_held``)."""

    def __init__(self, *, session: int, rank: int, key: bytes | None, layout: BlockLayout,
                 pace_mbit: float, links: PeerLinks,
                 conn_of: Callable[[int], FrameProtocol | None],
                 sending: Callable[[], bool], iteration: Callable[[], int],
                 coded: Callable[[], CodedPull | None] = lambda: None):
        self.session, self.rank, self.key, self.layout = session, rank, key, layout
        self.coded = coded
        self.links, self.conn_of, self.sending, self.iteration = (links, conn_of,
                                                                  sending, iteration)
        world = layout.n_shards
        self.held_pulls = self.own_udp = None
        if pace_mbit > 0 and world > 1:
            self.held_pulls = HeldPulls(flow_share(pace_mbit, world - 1), TCP_BACKLOG_SLACK)
            self.own_udp = OwnQueueGate(flow_share(pace_mbit, 1))
        self.held = 0
        self.bytes_sent = 0   # PULL frames to remote workers (the report's pull_bytes_sent)
        self._timer: asyncio.TimerHandle | None = None

    def send(self, conn: FrameProtocol, worker: int, iteration: int,
             aggregate: np.ndarray, received: np.ndarray) -> None:
        """PULL(``iteration``) to ``worker``: ``aggregate`` ((shard blocks * block
        elements,) float32, sent as a view: the shard never writes it again) and
        ``received`` ((shard blocks,) bool, the worker's received bitmap)."""
        lay, coded = self.layout, self.coded()
        frame = messages.pull(self.session, self.rank, iteration, lay.shard_lo(self.rank),
                              aggregate, received, self.key,
                              coded.wire_parts() if coded is not None else None)
        self.bytes_sent += sum(memoryview(p).nbytes for p in frame)
        self.links.pace(conn)
        if self.held_pulls is not None and (
                self.sending() or self.links.tcp_backlog(worker) > TCP_BACKLOG_SLACK
                or self._own_udp_wait(iteration, time.monotonic())):
            # our push is still on the port (other shards wait for it), on that
            # worker's share of it, or in our own egress queue: the push goes first
            self.held_pulls.hold(worker, frame)
            self.held += 1
            if not self.sending() and self._timer is None:
                self.flush()
            return
        conn.send(frame)

    def _own_udp_wait(self, iteration: int, now: float) -> float:
        """Seconds the PULLs of ``iteration`` wait for our queued UDP blocks to leave
        this host (scheduler.pacing.OwnQueueGate)."""
        return self.own_udp.wait(self.links.udp_backlog(), iteration, now)

    def flush(self) -> None:
        """Send the held PULLs whose worker's share of our port is free again (our push
        to it has left); look again when the others' backlog should have drained."""
        self._timer = None
        if self.held_pulls is None or self.sending():
            return   # the agent's push_sent() calls again when our push has left
        now = time.monotonic()
        wait = self._own_udp_wait(self.iteration(), now)
        if not wait:
            ready, wait = self.held_pulls.release(self.links.tcp_backlog, now)
            for worker, frame in ready:
                conn = self.conn_of(worker)
                if conn is not None and not conn.transport.is_closing():
                    conn.send(frame)
        if wait is not None:
            self._timer = asyncio.get_running_loop().call_later(wait, self.flush)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
