"""The path MTU the kernel knows, and the largest block that fits one datagram.

A UDP socket connected to the peer reports the route's MTU (or the smaller path MTU
the kernel learnt from ICMP "fragmentation needed") with ``getsockopt(IP_MTU)``
(``IPV6_MTU`` for IPv6), once IP_MTU_DISCOVER is IP_PMTUDISC_DO (ip(7), ipv6(7)). dgt
never fragments, so a block's datagram (IP and UDP headers, the dgt header, the block,
the MAC with ``--secret``) must fit that MTU.
"""
from __future__ import annotations

import socket

from .wire import HEADER_BYTES, MAC_BYTES, block_datagram_bytes

IP_MTU = getattr(socket, "IP_MTU", 14)                    # linux/in.h
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
IPV6_MTU = getattr(socket, "IPV6_MTU", 24)                # linux/in6.h
IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)
IPV6_PMTUDISC_DO = getattr(socket, "IPV6_PMTUDISC_DO", 2)
#: IP + UDP header bytes
IPV4_UDP_BYTES, IPV6_UDP_BYTES = 20 + 8, 40 + 8


def path_mtu(host: str, port: int) -> tuple[int, int] | None:
    """(path MTU in bytes, IP + UDP header bytes) towards ``host:port`` as the kernel
    reports it now, or None when it cannot tell (no route, name does not resolve)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_DO)
                s.connect(addr)
                return s.getsockopt(socket.IPPROTO_IPV6, IPV6_MTU), IPV6_UDP_BYTES
            s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
            s.connect(addr)
            return s.getsockopt(socket.IPPROTO_IP, IP_MTU), IPV4_UDP_BYTES
    except OSError:
        return None


def max_block_bytes(mtu: int, ip_udp_bytes: int = IPV4_UDP_BYTES,
                    mac: bool = False, codings: tuple[int, ...] = (0,)) -> int:
    """The largest --block-bytes (a multiple of 4: whole float32 values) whose datagram
    fits ``mtu`` bytes in every band coding of ``codings`` (dgt.transport.wire.Coding;
    default f32 only). For f32: ``mtu - ip_udp_bytes - HEADER_BYTES (34) - MAC_BYTES
    (16, with --secret)``, rounded down to a multiple of 4. E.g. 1436 for MTU 1500 (1420
    with --secret), 1388 for MTU 1450, 1372 for MTU 1450 with --secret; with int8 bands
    only (one byte a value and a 4 B scale), 5,736 for MTU 1500."""
    room = mtu - ip_udp_bytes

    def fits(e: int) -> bool:
        return all(block_datagram_bytes(c, e, mac) <= room for c in codings)
    lo, hi = 0, 4 * max(room, 0) + 8   # no coding takes under 2 bits a value
    while lo < hi:                      # the largest e that fits: e <= lo
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return 4 * lo
