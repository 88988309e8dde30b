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
