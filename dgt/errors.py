"""Errors shared by the sidecar and the trainer API."""
from __future__ import annotations


class PeerFailure(RuntimeError):
    """A peer died, disconnected or timed out. ``rank`` names it when known."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
