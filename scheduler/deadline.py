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

import math
import numbers
from dataclasses import dataclass

from .assign import check_state, number_or_nan, real_value


def _finite(name: str, value, low: float, what: str) -> float:
    """``value`` of the AdaptiveDeadline argument ``name`` as a float. Raises ValueError
    naming it unless it is a finite number >= ``low`` (not a bool or a str)."""
    v = number_or_nan(value)
    if not low <= v < math.inf:   # NaN too
        raise ValueError(f"AdaptiveDeadline({name}={value!r}): give {what}, a finite "
                         f"number >= {low:g}")
    return v


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


class AdaptiveDeadline:
    """The wait after END, adapted to the arrival spread the shard measures (sans-IO).

    Reference: OptiReduce (Warraich et al., NSDI 2025), whose receivers time out
    adaptively from the completion times they observed rather than with a fixed bound.
    Here the shard reports, per worker and iteration, the **arrival spread**: seconds
    from that worker's END to its last block (0 when every block came before END), and,
    for a block that came after its worker was finalised (*late*), seconds from that
    END to the late block. The deadline is

        deadline_s = min(ceiling_s, max(floor_s, margin * max(last ``window`` spreads)))

    so it never drops below the fixed policy (``floor_s``: :meth:`DeadlinePolicy.
    after_end_s`, 50 ms by default), and one late block lifts it to ``margin`` times
    its lateness for the next ``window`` observations (about ``window / workers``
    iterations), then it decays back. A block that never comes (a real loss) is no
    observation, so loss does not inflate the wait. ``floor_s`` >= ``ceiling_s`` gives
    the fixed deadline ``floor_s``. Units: seconds. Raises ValueError, in one line
    naming the argument, for a ``floor_s`` or ``ceiling_s`` that is not a finite
    number >= 0, a ``margin`` that is not a finite number >= 1, or a ``window`` that is
    not an int >= 1 (NaN, inf, a bool or a str included).
    """

    def __init__(self, floor_s: float, ceiling_s: float, margin: float = 1.5,
                 window: int = 64):
        floor_s = _finite("floor_s", floor_s, 0.0, "seconds")
        ceiling_s = _finite("ceiling_s", ceiling_s, 0.0, "seconds")
        margin = _finite("margin", margin, 1.0, "a factor")
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) \
                or window < 1:
            raise ValueError(f"AdaptiveDeadline(window={window!r}): give the number of "
                             f"spreads kept, an int >= 1")
        from collections import deque
        self.floor_s, self.ceiling_s = floor_s, max(floor_s, ceiling_s)
        self.margin = margin
        self.spreads: deque[float] = deque(maxlen=int(window))
        self.highest_s = floor_s   # the longest deadline handed out (for the report)
        # worker-iterations complete only after floor_s: each would have lost blocks
        # under the fixed deadline (for the report)
        self.beyond_floor = 0

    def observe(self, spread_s: float, late: bool = False) -> None:
        """One arrival spread (s): a worker's END to its last block, or with ``late``
        its END to a block that came after it was finalised. ``spread_s`` is one real
        number, kept as ``float(spread_s)`` (a Python number, a numpy scalar, a 0-dim or
        one-element tensor or array: ``dgt.scheduler.assign.real_value``). A negative
        or NaN spread is no observation and is ignored (the shard passes NaN for a
        late block of a worker whose END it never saw); one above ``ceiling_s`` (inf
        included) counts as ``ceiling_s``. Raises TypeError naming ``spread_s`` for
        anything else (a str, None, a bool, a tensor of more elements), before any
        state changes."""
        spread_s = real_value(spread_s, "spread_s")
        if spread_s >= 0:   # not NaN, not negative
            self.spreads.append(min(spread_s, self.ceiling_s))
            self.beyond_floor += not late and spread_s > self.floor_s

    def deadline_s(self) -> float:
        """Seconds to wait after the next END."""
        d = self.floor_s
        if self.spreads:
            d = min(self.ceiling_s, max(d, self.margin * max(self.spreads)))
        self.highest_s = max(self.highest_s, d)
        return d

    def state_dict(self) -> dict:
        """The spreads in the window (s), the highest deadline handed out (s) and the
        count beyond the floor: plain Python values (picklable)."""
        return {"spreads": list(self.spreads), "highest_s": self.highest_s,
                "beyond_floor": self.beyond_floor}

    def load_state_dict(self, state: dict) -> None:
        """Back to what :meth:`state_dict` gave. Each value is taken as :meth:`observe`
        takes a spread (``dgt.scheduler.assign.real_value``): ``spreads``, a list of
        real numbers >= 0 (a one-element tensor or a numpy scalar is kept as its float;
        one above ``ceiling_s`` as ``ceiling_s``; only the last ``window`` are kept);
        ``highest_s``, a finite real number >= 0; ``beyond_floor``, an int >= 0 (a
        numpy int or a one-element integer tensor as its int). Raises ValueError, in
        one line naming the key, leaving the state as it was, for a ``state`` that is
        not a dict with those keys or a value that is none of these (a str, None, a
        bool, NaN, a negative, a tensor of more elements)."""
        check_state("AdaptiveDeadline", state, ("spreads", "highest_s", "beyond_floor"))
        raw = state["spreads"]
        if not isinstance(raw, (list, tuple)):
            _bad_state("spreads", raw, "a list of spreads (s), real numbers >= 0")
        spreads = [_state_number(f"spreads[{i}]", v, "a spread (s), a real number >= 0")
                   for i, v in enumerate(raw)]
        highest = _state_number("highest_s", state["highest_s"],
                                "seconds, a finite real number >= 0", inf=False)
        beyond = state["beyond_floor"]
        n = _integral(beyond)
        if n is None or n < 0:
            _bad_state("beyond_floor", beyond, "a count, an int >= 0")
        self.spreads.clear()
        self.spreads.extend(min(v, self.ceiling_s) for v in spreads)
        self.highest_s = highest
        self.beyond_floor = n


def _bad_state(key: str, value, what: str):
    raise ValueError(f"AdaptiveDeadline.load_state_dict: {key}={value!r} is not what "
                     f"state_dict() gives: give {what}")


def _state_number(key: str, value, what: str, inf: bool = True) -> float:
    """``value`` (the state's ``key``) as observe takes a spread: a float >= 0, inf only
    with ``inf``; else :func:`_bad_state`."""
    try:
        v = real_value(value, key)
    except TypeError:
        v = math.nan
    if not (0.0 <= v and (inf or v < math.inf)):   # NaN too
        _bad_state(key, value, what)
    return v


def _integral(value) -> int | None:
    """An int of ``value``: a Python or numpy int (not a bool), a one-element tensor or
    array of an integer dtype (its ``item()``); None for anything else."""
    try:
        if getattr(value, "shape", None) is not None and math.prod(value.shape) == 1:
            value = value.item()   # a numpy scalar, a one-element array or tensor
    except Exception:   # noqa: BLE001 - not a number at all
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
