"""Errors shared by the sidecar and the trainer API."""
from __future__ import annotations

from .failure import FailureReason


class PeerFailure(RuntimeError):
    """A peer died, disconnected or timed out. ``rank`` names it when known; ``ranks``
    every rank at fault (default ``[rank]``); ``reason`` a ``dgt.failure.FailureReason``
    (what the failure record says, so that no reader parses ``message``)."""

    def __init__(self, message: str, rank: int | None = None,
                 reason: FailureReason = FailureReason.OTHER,
                 ranks: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.reason = FailureReason(reason)
        self.ranks = list(ranks) if ranks is not None else \
            ([rank] if rank is not None else [])


def printable(text: str) -> str:
    """``text`` with every character that is not printable (a NUL, a control, a lone
    surrogate) as its backslash escape: what a log line and the wire (UTF-8) take. A
    trainer's failure text with a lone surrogate could not be sent on to the other
    ranks (breaker round 20: they named a lost connection instead)."""
    return text if text.isprintable() else "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode()
        for c in text)


def one_line(text: str, empty: str = "failed") -> str:
    """A trainer's error as its sidecar is told it, and as the sidecar passes it on:
    one line of at most 300 characters, made :func:`printable`; ``empty`` when
    nothing is left. The one place a trainer's error text is shaped (dgt.Client, the
    sidecar, dgt.job)."""
    return printable(" ".join(str.split(text[:100_000]))[:300]) or empty
