"""Receiver deadline after END.

After a worker's END(t) arrives at a shard (over TCP, sent after the worker's last UDP
datagram), unreliable blocks still in flight can only be in a queue: the sender's pacer
has released them all. The longest they can still take is the time to drain the
queues on the path. The shard therefore waits

    deadline_s = max(min_s, queue_bytes * 8 / (rate_mbit * 1e6) * slack)

after END, then finalises the worker with whatever arrived; a block arriving later is
*late* and is dropped (error feedback has already put it back in the sender's residual).

Why not wait for everything: a block dropped by a full queue never comes, and waiting
for it would turn every loss into a stall, which is what DGT exists to avoid. Why not 0:
on a busy receiver datagrams sit in the socket buffer behind the END frame for a few ms;
finalising at END would mark them lost though they arrived.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlinePolicy:
    """``min_s``: floor (s). ``queue_bytes``: bytes that may be queued on the path.
    ``rate_mbit``: bottleneck rate (10^6 bit/s). ``slack``: safety factor."""

    min_s: float = 0.05
    queue_bytes: int = 1 << 20
    rate_mbit: float = 1000.0
    slack: float = 2.0

    def after_end_s(self) -> float:
        """Seconds to wait after END before finalising a worker."""
        drain = self.queue_bytes * 8 / (self.rate_mbit * 1e6) if self.rate_mbit > 0 else 0.0
        return max(self.min_s, drain * self.slack)
