"""Token-bucket pacing for the unreliable channels.

Source: the classic token bucket (RFC 2697 section 3 describes the single-rate form).
Sans-IO: the caller passes the clock; the bucket answers how long to wait.
"""
from __future__ import annotations

from typing import Callable

#: share of the port rate the pacers aim at; the rest is for the bytes they do not
#: count: a 1,442 B datagram is 1,484 B on an Ethernet port (+2.9 %), TCP pacing counts
#: its segments without the IP and Ethernet headers (1,480 of 1,514 B, +2.3 %), and the
#: ACKs for what the node receives leave on the same port (about 1 % of its ingress).
#: Measured on the 1 Gbit/s testbed, 31 iterations of 4 x 25.8 MB, `--mode dgt`: 0.97
#: gave 1,061 TCP retransmissions and 3,199 late or lost UDP blocks, 0.95 gave 8 and
#: 598; with PULLs held per worker (HeldPulls) and TokenBucket.hold, 0.95 gave 8 and
#: 729, 0.93 gave 9 and 276
WIRE_HEADROOM = 0.93


def flow_share(rate_mbit: float, flows: int) -> float:
    """Bytes per second for each of ``flows`` concurrent flows out of one port of
    ``rate_mbit`` (times ``WIRE_HEADROOM``); 0 (uncapped) when ``rate_mbit`` is 0.

    A node sends to each of its N-1 peers at an equal share, so every receiving port gets
    N-1 shares, exactly its rate: no incast, whatever the blocks' ranking does to the
    per-peer split of TCP and UDP bytes (each peer's total is fixed: its shard's blocks).
    """
    if rate_mbit <= 0 or flows <= 0:
        return 0.0
    return rate_mbit * 1e6 / 8.0 * WIRE_HEADROOM / flows


class TokenBucket:
    """Pace sends at ``rate_mbit`` (10^6 bit/s) with bursts up to ``burst_bytes``.

    ``rate_mbit <= 0`` disables pacing (``delay`` always returns 0).
    """

    def __init__(self, rate_mbit: float, burst_bytes: int = 64 * 1024, now: float = 0.0):
        self.rate_bytes_per_s = rate_mbit * 1e6 / 8.0  # bytes per second
        self.burst = float(burst_bytes)
        self.tokens = self.burst
        self.t = now

    @classmethod
    def bytes_per_s(cls, rate: float, burst_bytes: int = 64 * 1024,
                    now: float = 0.0) -> "TokenBucket":
        """A bucket filling at ``rate`` bytes per second (0 = unpaced)."""
        return cls(rate * 8.0 / 1e6, burst_bytes, now)

    def delay(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` tokens; return seconds to wait before sending them (>= 0).

        Tokens may go negative: the debt is the wait, so a sender that sleeps for the
        returned delay keeps the long-run rate exactly.
        """
        if self.rate_bytes_per_s <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.t) * self.rate_bytes_per_s)
        self.t = max(self.t, now)
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate_bytes_per_s

    def hold(self, now: float, until: float, tokens: float = 0.0) -> None:
        """Refill up to ``now``, keep at most ``tokens`` (bytes) and add none before
        ``until`` (s): the time up to then belongs to other bytes of the same share (the
        TCP bytes queued ahead of these datagrams), so it must not become a burst."""
        self.delay(0, now)
        self.tokens = min(self.tokens, float(tokens))
        self.t = max(self.t, until)


def drain_wait(backlog: int, share: float, slack: int, now: float,
               give_up: float | None, grace_s: float = 1.0) -> tuple[float, float | None]:
    """The rule for anything that must follow our TCP bytes to a peer (its UDP blocks,
    its PULL): ``backlog`` unsent bytes at ``share`` bytes/s. Returns ``(seconds to wait,
    0.0 = go now; the give-up time)``. It goes once the backlog is at most ``slack``
    (a connection always has bytes in flight), or at the give-up time, set at the first
    wait to twice the drain time + ``grace_s``, so a peer that stopped reading cannot
    hold it back for good."""
    if backlog <= slack or share <= 0:
        return 0.0, give_up
    if give_up is None:
        give_up = now + 2 * backlog / share + grace_s
    if now >= give_up:
        return 0.0, give_up
    return max(0.0005, min(backlog / share, give_up - now)), give_up


class HeldPulls:
    """PULL frames a shard holds back until its worker's share of our port is free.

    Every peer node gets one share of the egress port (:func:`flow_share`); our push to
    a worker and our PULL to it are in that share one after the other, never together,
    or that worker's port would get two shares from us (incast: its queue overflows into
    retransmissions). Sans-IO: the caller passes the clock and each worker's unsent push
    bytes (``backlog``); :meth:`release` says which PULLs may go now and when to look
    again, by :func:`drain_wait` (the same rule as the UDP blocks to that peer).

    ``share``: bytes per second (> 0); ``slack``: unsent bytes below which the push
    counts as gone (a TCP connection always has some bytes in flight).
    """

    def __init__(self, share: float, slack: int):
        if share <= 0:
            raise ValueError(f"share must be > 0 bytes/s, got {share}")
        self.share, self.slack = share, slack
        self.items: list[list] = []   # [worker, frame, give-up time or None]

    def __len__(self) -> int:
        return len(self.items)

    def hold(self, worker: int, frame) -> None:
        self.items.append([worker, frame, None])

    def release(self, backlog: Callable[[int], int], now: float) -> tuple[list, float | None]:
        """Returns ``(frames to send now as (worker, frame), seconds until the next
        look or None when nothing is held)``."""
        ready, later = [], []
        for item in self.items:
            w, item[2] = drain_wait(backlog(item[0]), self.share, self.slack, now, item[2])
            if w:
                later.append((w, item))
            else:
                ready.append((item[0], item[1]))
        self.items = [item for _, item in later]
        return ready, (min(w for w, _ in later) if later else None)


class OwnQueueGate:
    """Held PULLs also wait for our own UDP blocks to leave this host.

    "Sent" UDP blocks may still sit in our egress qdisc; a PULL (the reliable channel's
    DSCP, EF) written then goes ahead of them, and a low band (CS1) can wait there longer
    than the shard's deadline: late blocks and a deadline wait, every iteration (on the
    1 Gbit/s testbed, clean: 207 and 309 late udp3 blocks in 31 iterations). So the
    PULLs go once our UDP send queues are empty (``backlog``: their bytes, udp(7)
    SIOCOUTQ), or, per iteration, after twice that backlog's drain time at the port rate
    plus ``grace_s``: a band that is starved (CS1 under best-effort bulk traffic) does not
    drain at all, and the PULLs must not wait for it. Sans-IO: the caller passes the
    clock."""

    def __init__(self, port_rate: float, grace_s: float = 0.002):
        if port_rate <= 0:
            raise ValueError(f"port_rate must be > 0 bytes/s, got {port_rate}")
        self.port_rate, self.grace_s = port_rate, grace_s
        self.iteration: int | None = None
        self.give_up: float | None = None

    def wait(self, backlog: int, iteration: int, now: float) -> float:
        """Seconds the PULLs of ``iteration`` should still wait (0.0: go now)."""
        if iteration != self.iteration:
            self.iteration, self.give_up = iteration, None
        wait, self.give_up = drain_wait(backlog, self.port_rate, 0, now, self.give_up,
                                        self.grace_s)
        return wait


class PortPacing:
    """The pacing state of one node's push (transport.sender.Pacing): one equal share of
    the egress port per peer node (:func:`flow_share` of ``rate_mbit`` over
    ``n_peers``), a :class:`TokenBucket` of ``burst_bytes`` per peer, and
    :func:`drain_wait` for the UDP blocks that follow our TCP bytes to a peer (below
    ``slack`` unsent bytes they go). ``rate_mbit`` 0: not paced. Sans-IO: the caller
    passes the clock (s)."""

    def __init__(self, rate_mbit: float, peers, n_peers: int, burst_bytes: int,
                 slack: int, now: float):
        self.share = flow_share(rate_mbit, n_peers)   # bytes/s per peer
        self.slack = slack
        self.buckets = {s: TokenBucket.bytes_per_s(self.share, burst_bytes, now)
                        for s in peers}

    def delay(self, node: int, nbytes: int, now: float) -> float:
        return self.buckets[node].delay(nbytes, now)

    def hold(self, node: int, now: float, until: float, tokens: float = 0.0) -> None:
        self.buckets[node].hold(now, until, tokens)

    def drain_wait(self, backlog: int, now: float,
                   give_up: float | None) -> tuple[float, float | None]:
        return drain_wait(backlog, self.share, self.slack, now, give_up)
