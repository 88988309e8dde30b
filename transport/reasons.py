"""Every reason a message or connection is rejected, as one enum.

The values are the counter keys of the report (``rejected[reason]`` in
``sidecar-<rank>.json`` and ``report.json``); ``docs/wire.md`` lists them in a table that
``tests/test_wire_spec.py`` checks against this enum. Every ``WireError``, every
``Rejected`` event (``transport.session``, ``transport.control``) and every direct count
uses one of these.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(str, enum.Enum):
    """Why a message (or a connection) was counted and dropped. ``str`` valued: a member
    compares and hashes as its counter key."""

    # header and framing (transport.wire, transport.framing)
    SHORT = "short"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_TYPE = "bad_type"
    BAD_CHANNEL = "bad_channel"
    TOO_LONG = "too_long"
    BAD_LENGTH = "bad_length"
    BAD_CODING = "bad_coding"
    NO_MAC = "no_mac"
    BAD_MAC = "bad_mac"
    # addressing and timing (transport.session)
    UNKNOWN_SOURCE = "unknown_source"
    NOT_READY = "not_ready"
    STRAY = "stray"
    WRONG_SHARD = "wrong_shard"
    BAD_SENDER = "bad_sender"
    BAD_BLOCK = "bad_block"
    STALE = "stale"
    LATE = "late"
    FUTURE = "future"
    DUPLICATE = "duplicate"
    BAD_UDP_MESSAGE = "bad_udp_message"
    BAD_TCP_BLOCKS = "bad_tcp_blocks"
    BAD_END = "bad_end"
    BAD_TAIL = "bad_tail"
    BAD_LOCAL = "bad_local"
    NON_FINITE = "non_finite"
    # connections and control frames (transport.control)
    BAD_HELLO = "bad_hello"
    DUPLICATE_HELLO = "duplicate_hello"
    NO_HELLO = "no_hello"
    EVICTED_PENDING = "evicted_pending"
    EVICTED_CANDIDATE = "evicted_candidate"
    RANK_TAKEN = "rank_taken"
    WRONG_SENDER = "wrong_sender"
    UNVERIFIED_CONTROL = "unverified_control"
    UNEXPECTED_TYPE = "unexpected_type"
    BAD_PULL = "bad_pull"
    NON_FINITE_PULL = "non_finite_pull"
    PULL_PADDING = "pull_padding"
    # the rendezvous store (dgt.rendezvous)
    STORE_REJECTED = "store_rejected"
    STORE_REWRITTEN = "store_rewritten"

    def __str__(self) -> str:
        return self.value


#: reasons that are counted per channel (``blocks_late``, ``blocks_duplicate``) rather
#: than in ``rejected``
PER_CHANNEL = frozenset({Reason.LATE, Reason.DUPLICATE})


class Event:
    """Base type of every event a sans-IO state machine of ``dgt.transport`` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Rejected(Event):
    """A message was counted and dropped. ``reason`` is the counter key."""

    reason: str
