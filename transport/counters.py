"""Per-channel traffic counters, as reported in ``report.json`` under ``channels``.

Units: blocks are counts, bytes are DGT message bytes (header + payload + MAC) of BLOCKS
messages, which is what a capture sees as UDP payload or TCP frame length.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from .channels import MAX_UDP_CHANNELS, channel_name

FIELDS = ("blocks_sent", "bytes_sent", "blocks_delivered",
          "bytes_delivered", "blocks_late", "blocks_lost", "blocks_duplicate",
          "blocks_dropped_local")


@dataclass
class ChannelCounters:
    """One channel. ``lost``: counted in END but not delivered in time (late blocks are
    also lost). ``late``: arrived after its worker was finalised, dropped.
    ``dropped_local``: refused by this host's own egress queue for that band (ENOBUFS)
    for longer than the sender waits; never sent, not in END, kept by error feedback."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_delivered: int = 0
    bytes_delivered: int = 0
    blocks_late: int = 0
    blocks_lost: int = 0
    blocks_duplicate: int = 0
    blocks_dropped_local: int = 0


@dataclass
class Counters:
    """All channels of one node, plus: ``blocks_unsent`` (never sent, by design: mode
    topk's unreliable share), ``blocks_local`` (to the colocated shard, in-process), and ``rejected[reason]``
    (malformed, stray, replayed messages), ``tail_markers`` (UDP channel tail markers
    sent: END on a UDP channel after its last block), ``blocks_non_finite`` (blocks of
    this node's pushes that held a NaN or inf: sent as zeros, kept out of the
    residual)."""

    channels: list[ChannelCounters] = field(
        default_factory=lambda: [ChannelCounters() for _ in range(1 + MAX_UDP_CHANNELS)])
    rejected: Counter = field(default_factory=Counter)
    blocks_unsent: int = 0
    blocks_local: int = 0
    tail_markers: int = 0
    blocks_non_finite: int = 0

    def to_dict(self, n_channels: int) -> dict:
        return {
            "blocks_unsent": self.blocks_unsent,
            "blocks_local": self.blocks_local,
            "tail_markers": self.tail_markers,
            "blocks_non_finite": self.blocks_non_finite,
            "channels": {channel_name(c): asdict(self.channels[c])
                         for c in range(n_channels + 1)},
            "rejected": dict(self.rejected),
        }


def merge(dicts: list[dict]) -> dict:
    """Sum several ``Counters.to_dict`` results (one per node)."""
    out: dict = {"channels": {}, "rejected": Counter(), "blocks_unsent": 0,
                 "blocks_local": 0, "tail_markers": 0, "blocks_non_finite": 0}
    for d in dicts:
        for k in ("blocks_unsent", "blocks_local", "tail_markers", "blocks_non_finite"):
            out[k] += d.get(k, 0)
        for name, ch in d["channels"].items():
            acc = out["channels"].setdefault(name, dict.fromkeys(FIELDS, 0))
            for k, v in ch.items():
                acc[k] += v
        out["rejected"].update(d.get("rejected", {}))
    out["rejected"] = dict(out["rejected"])
    return out
