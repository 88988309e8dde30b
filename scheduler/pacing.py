"""Token-bucket pacing for the unreliable channels.

Source: the classic token bucket (RFC 2697 section 3 describes the single-rate form).
Sans-IO: the caller passes the clock; the bucket answers how long to wait.
"""
from __future__ import annotations

#: share of the port rate the pacers aim at; the rest is for the headers they do not
#: count: a 1,442 B datagram is 1,484 B on an Ethernet port (+2.9 %), and TCP pacing
#: counts its segments without the IP and Ethernet headers (1,480 of 1,514 B, +2.3 %)
WIRE_HEADROOM = 0.97


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
        self.rate_bps = rate_mbit * 1e6 / 8.0  # bytes per second
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
        if self.rate_bps <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate_bps)
        self.t = now
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate_bps
