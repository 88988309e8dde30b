"""Token-bucket pacing for the unreliable channels.

Source: the classic token bucket (RFC 2697 section 3 describes the single-rate form).
Sans-IO: the caller passes the clock; the bucket answers how long to wait.
"""
from __future__ import annotations


class TokenBucket:
    """Pace sends at ``rate_mbit`` (10^6 bit/s) with bursts up to ``burst_bytes``.

    ``rate_mbit <= 0`` disables pacing (``delay`` always returns 0).
    """

    def __init__(self, rate_mbit: float, burst_bytes: int = 64 * 1024, now: float = 0.0):
        self.rate_bps = rate_mbit * 1e6 / 8.0  # bytes per second
        self.burst = float(burst_bytes)
        self.tokens = self.burst
        self.t = now

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
