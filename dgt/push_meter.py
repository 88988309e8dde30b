"""What the time budget is fed (``--time-budget-ms``, dgt.scheduler.budget): per push,
the bytes it put on the wire and the seconds they took to leave this node.

Bytes: the growth of ``bytes_sent`` over every channel (transport.counters: DGT message
bytes of BLOCKS to remote shards; a band starved at our own egress queue is taken off
again) between two pushes. Seconds: from the push's first block sent
(``dgt.parts.PartPush.first_sent``) to the moment its END was sent and our send queues
to the peers were empty (the TCP connections' unsent bytes, the UDP sockets' SIOCOUTQ;
looked at every millisecond after END), less the time the sender sat idle waiting for
the next bucket of a push in parts. The reliable frames are written to TCP at once, so
END alone would not say when they left; a queue that never drains (a starved CS1 band)
is bounded by the last PULL, which no shard sends before our END arrived.
"""
from __future__ import annotations

import asyncio
import time

#: seconds between two looks at the send queues after END
POLL_S = 0.001


class PushMeter:
    """``counters``: the node's transport.counters.Counters; ``tcp_backlog(shard)`` /
    ``udp_backlog()``: unsent bytes (dgt.peer_links.PeerLinks); ``remote``: the remote
    shards. ``last``: the trace fields of the last push settled (dgt.trace)."""

    def __init__(self, counters, tcp_backlog, udp_backlog, remote: list[int]):
        self.counters, self.tcp_backlog, self.udp_backlog = counters, tcp_backlog, udp_backlog
        self.remote = remote
        self.mark = self._bytes()
        self.task: asyncio.Task | None = None
        self.last: dict = {}
        self.cut_total = 0   # blocks cut by the budget over the run (the report's)

    def _bytes(self) -> int:
        return sum(ch.bytes_sent for ch in self.counters.channels)

    def end_sent(self) -> None:
        """The push's END is out: watch our send queues drain (a task)."""
        self.task = asyncio.get_running_loop().create_task(self._until_left())

    async def _until_left(self) -> float:
        while self.udp_backlog() or any(self.tcp_backlog(s) for s in self.remote):
            await asyncio.sleep(POLL_S)
        return time.monotonic()

    def settle(self, planner, first_sent: float | None, idle_s: float) -> None:
        """Every PULL is in: feed ``planner.budget`` (dgt.planner.PushPlanner) this
        push's bytes and seconds (``first_sent``: CLOCK_MONOTONIC s of its first block
        sent, None when none left; ``idle_s``: seconds the sender waited for buckets)
        and keep the trace fields in :attr:`last`."""
        now = time.monotonic()
        left = now
        if self.task is not None:
            if self.task.done() and not self.task.cancelled():
                left = self.task.result()
            else:
                self.task.cancel()
            self.task = None
        sent = self._bytes() - self.mark
        self.mark += sent
        budget = planner.budget
        allowance = budget.allowance   # what this push was planned with
        send_s = left - first_sent - idle_s if first_sent is not None else 0.0
        budget.observe(sent, send_s)
        self.cut_total += planner.budget_cut
        self.last = {"budget_cut": planner.budget_cut, "budget_allowance_bytes": allowance,
                     "push_bytes": sent, "push_send_s": send_s}
