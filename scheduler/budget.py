"""Time budget: how much of its push a worker may send so the push fits a time budget.

Pure decisions: fed measurements, returns a count; no sockets, no clock of its own.

Source: the DGT code's adaptive k, which read the measured throughput of recent
iterations (DGT, Zhou et al., FGCS 2021); here the measured quantity is turned into a
byte allowance per push, and what does not fit stays in the residual (error feedback)
instead of stretching the iteration.

**What is measured.** Per iteration, the bytes the push put on the wire (DGT message
bytes of its BLOCKS to remote shards: ``transport.counters``' ``bytes_sent``) and the
seconds it took them to leave this node: from its first block sent to the moment END
was sent and our TCP and UDP send queues to the peers were empty (less the time the
sender sat idle waiting for the next bucket of a push in parts). That is the
throughput the push itself achieved, on this link, at this pacing, against whatever
else shares the port. Time from the first send to the last PULL was the other
candidate; it is not used, because it also holds the wait for the slowest worker and
the PULL's own transfer, which this worker's bytes do not decide: with it, a budget
below the PULL time would drive every push to the floor.

**Estimator.** The median of the per-iteration rates (bytes / seconds) of the last
``window`` (5) pushes. A median, not an EWMA: on a shared host one push in a few is
slowed by something else (a CPU hiccup, a retransmission timeout), and the median
ignores it where an EWMA would cut the next several pushes for it; it still follows a
lasting change of the link within ``window // 2 + 1`` (3) pushes, faster or slower.

**Allowance.** ``budget_s x rate`` bytes per push. If a push also costs a fixed time
``o`` besides its bytes (its first and last round trip), sending ``a`` bytes measures
the rate ``a / (o + a / R)``, and the allowance settles at ``R (budget_s - o)``, where
the push takes exactly the budget (the iteration ``a' = budget_s a / (o + a / R)``
contracts by ``o / budget_s`` per push). When the link speeds up, the same bytes leave
sooner, the measured rate rises and the allowance with it (recovery); a budget shorter
than ``o`` leaves the floor, never zero blocks.
"""
from __future__ import annotations

import math
import statistics

import torch

#: pushes whose rate the median is taken over
DEFAULT_WINDOW = 5


class TimeBudget:
    """One worker's time budget. ``budget_s``: seconds (> 0) a push may take on the
    link; ``window``: pushes the rate is the median of. Deterministic given what
    :meth:`observe` was fed.

    Example::

        tb = TimeBudget(0.5)
        tb.observe(sent_bytes=25_000_000, send_s=2.0)   # 12.5 MB/s measured
        tb.fit(torch.full((10_000,), 1412.0), floor=2000)  # ranks sent: 4426

    Raises ValueError for ``budget_s`` <= 0 (or not finite) or ``window`` < 1.
    """

    def __init__(self, budget_s: float, window: int = DEFAULT_WINDOW):
        if not (budget_s > 0 and math.isfinite(budget_s)):
            raise ValueError(f"budget_s must be a finite number of seconds > 0, got "
                             f"{budget_s}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.budget_s, self.window = budget_s, window
        self.rates: list[float] = []   # bytes/s of the last ``window`` pushes, oldest first

    def observe(self, sent_bytes: float, send_s: float) -> None:
        """One push: ``sent_bytes`` (bytes) left this node in ``send_s`` (seconds). A
        push that sent nothing or has no positive finite duration is no observation."""
        if not (sent_bytes > 0 and 0 < send_s < math.inf):
            return
        rate = sent_bytes / send_s
        if not 0 < rate < math.inf:
            return
        self.rates.append(rate)
        del self.rates[:-self.window]

    @property
    def rate(self) -> float | None:
        """The measured rate, bytes/s: the median of the last ``window`` pushes; None
        before the first."""
        return statistics.median(self.rates) if self.rates else None

    @property
    def allowance(self) -> float | None:
        """Bytes a whole push may send: ``budget_s x rate``; None (no cap) before the
        first observation."""
        rate = self.rate
        return None if rate is None else self.budget_s * rate

    def fit(self, cost: torch.Tensor, floor: int, share: float = 1.0) -> int:
        """How many of the best ranks go. ``cost``: (m,) float, the wire bytes of each
        rank's block, best rank first (0 for one that costs the link nothing: sent
        in-process, or not sent anyway); ``floor``: ranks that go whatever the budget
        (>= 1 keeps a push from ever being empty); ``share``: the fraction (0..1] of
        the push's allowance these ranks get (a push handed over in parts: each part
        its share). Returns the longest prefix whose cost fits ``share x allowance``,
        at least ``min(floor, m)``; m before the first observation."""
        m = cost.numel()
        allowance = self.allowance
        if allowance is None or m == 0:
            return m
        cum = torch.cumsum(cost.to(torch.float64), 0)
        fits = int(torch.searchsorted(cum, torch.tensor([share * allowance],
                                                        dtype=torch.float64),
                                      right=True).item())
        return max(min(floor, m), fits)

    def state_dict(self) -> dict:
        """The rates measured (plain Python values, picklable)."""
        return {"rates": list(self.rates)}

    def load_state_dict(self, state: dict) -> None:
        self.rates = [float(r) for r in state["rates"]][-self.window:]
