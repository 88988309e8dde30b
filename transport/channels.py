"""Channels and their DSCP marks.

Channel 0 is the reliable channel (TCP). Channels 1..C (C = 1..``MAX_UDP_CHANNELS``, 7) are unreliable UDP
channels, highest priority first. Each channel's packets carry their own DSCP, which
Linux tc (``dgt.tc_profiles``) and switch QoS map to priority bands.

DSCP code points: RFC 2474 (field), RFC 3246 (EF = 46), RFC 2597 (AFxy), RFC 8622
(LE = 1). ``IP_TOS = dscp << 2`` (RFC 2474 section 3; the two low bits are ECN).
"""
from __future__ import annotations

RELIABLE = 0
#: the one limit on C: the wire's channel field and END's per-channel counts
#: (transport.wire.MAX_CHANNELS = 1 + this), the DSCP table below, --channels
MAX_UDP_CHANNELS = 7
#: the default C (--channels)
DEFAULT_UDP_CHANNELS = 3

DSCP_EF = 46    # reliable channel
DSCP_AF41 = 34
DSCP_AF31 = 26
DSCP_AF21 = 18
DSCP_CS2 = 16
DSCP_AF11 = 10
DSCP_CS1 = 8
DSCP_LE = 1

#: Default DSCP of the UDP channels for each channel count C, highest priority first.
#: C = 3 is the default: AF41, AF21, AF11. Up to C = 5 every channel sits above best
#: effort (DSCP 0); only C = 6 and 7 add the scavengers CS1 (RFC 3662) and LE (RFC 8622)
#: below it. Why not lower: in BSP every shard waits for a worker's blocks until END plus
#: the deadline, so a band below best effort makes a bulk tenant's load part of every
#: iteration (docs/tc_profiles.md, "Where the lowest channel sits").
UDP_DSCP_DEFAULTS: dict[int, tuple[int, ...]] = {
    1: (DSCP_AF41,),
    2: (DSCP_AF41, DSCP_AF21),
    3: (DSCP_AF41, DSCP_AF21, DSCP_AF11),
    4: (DSCP_AF41, DSCP_AF31, DSCP_AF21, DSCP_AF11),
    5: (DSCP_AF41, DSCP_AF31, DSCP_AF21, DSCP_CS2, DSCP_AF11),
    6: (DSCP_AF41, DSCP_AF31, DSCP_AF21, DSCP_CS2, DSCP_AF11, DSCP_CS1),
    7: (DSCP_AF41, DSCP_AF31, DSCP_AF21, DSCP_CS2, DSCP_AF11, DSCP_CS1, DSCP_LE),
}


def channel_dscp(udp_channels: int) -> tuple[int, ...]:
    """DSCP per channel, index = channel number: (EF, udp1, ..., udpC).

    Raises ValueError when ``udp_channels`` is outside 1..MAX_UDP_CHANNELS.
    """
    if udp_channels not in UDP_DSCP_DEFAULTS:
        raise ValueError(f"channels must be 1..{MAX_UDP_CHANNELS}, got {udp_channels}")
    return (DSCP_EF,) + UDP_DSCP_DEFAULTS[udp_channels]


def channel_name(channel: int) -> str:
    """'tcp' for channel 0, 'udp1'.. for the unreliable channels (report keys)."""
    return "tcp" if channel == RELIABLE else f"udp{channel}"
