"""Socket options: DSCP, priority, buffer sizes. Linux semantics.

Sources: ip(7) (IP_TOS, and "setting IP_TOS resets SO_PRIORITY"), socket(7)
(SO_PRIORITY: values outside 0..6 need CAP_NET_ADMIN; SO_RCVBUF/SO_SNDBUF are capped at
net.core.rmem_max/wmem_max and the kernel doubles the value), RFC 2474 (TOS = DSCP << 2).
"""
from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)

#: Linux skb priority per DSCP: EF highest. Values <= 6 need no privilege.
def priority_for_dscp(dscp: int) -> int:
    """SO_PRIORITY for a DSCP: 6 for EF, 5..1 for AF4x..AF1x/CS2, 0 for CS1/LE/BE."""
    if dscp >= 46:
        return 6
    if dscp >= 8 * 2:
        return min(5, dscp // 8 + 1)
    if dscp >= 10:
        return 1
    return 0


def set_dscp(sock: socket.socket, dscp: int) -> None:
    """Mark the socket's packets with ``dscp`` (0..63), then set SO_PRIORITY after it,
    since setting IP_TOS resets SO_PRIORITY. Raises ValueError for a bad DSCP."""
    if not 0 <= dscp <= 63:
        raise ValueError(f"DSCP must be 0..63, got {dscp}")
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority_for_dscp(dscp))


def set_buffers(sock: socket.socket, rcv_bytes: int | None, snd_bytes: int | None,
                need_bytes: int = 0) -> tuple[int, int]:
    """Ask for buffer sizes; return the effective (rcvbuf, sndbuf) the kernel granted.

    Warns (logging) when the granted receive buffer is below ``need_bytes`` (the burst
    it must absorb): raise net.core.rmem_max, or lower the pacing rate.
    """
    if rcv_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcv_bytes)
    if snd_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, snd_bytes)
    rcv = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    snd = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    if need_bytes and rcv < need_bytes:
        log.warning("SO_RCVBUF is %d B, below the %d B burst it must absorb; raise "
                    "net.core.rmem_max (sysctl -w net.core.rmem_max=%d) or lower --pace-mbit",
                    rcv, need_bytes, need_bytes)
    return rcv, snd


def udp_socket(host: str, port: int, dscp: int, rcvbuf: int = 4 << 20,
               sndbuf: int = 4 << 20) -> socket.socket:
    """A bound, non-blocking UDP socket carrying ``dscp``. ``port`` 0 picks a free port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # never fragment: a datagram over the path MTU fails with EMSGSIZE (ip(7))
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        set_dscp(s, dscp)
        set_buffers(s, rcvbuf, sndbuf, need_bytes=rcvbuf // 2)
        s.bind((host, port))
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def tcp_listener(host: str, port: int, dscp: int) -> socket.socket:
    """A listening TCP socket whose accepted sockets inherit ``dscp`` (set before
    listen, and set again on each accepted socket by the adapter)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        set_dscp(s, dscp)
        s.bind((host, port))
        s.listen(64)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def tcp_client(dscp: int) -> socket.socket:
    """An unconnected TCP socket with ``dscp`` set before connect(), so the SYN carries
    the mark too; TCP_NODELAY on (frames are already batched)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    set_dscp(s, dscp)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    return s
