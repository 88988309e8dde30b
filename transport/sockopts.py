"""Socket options: DSCP, priority, buffer sizes. Linux semantics.

IPv4 and IPv6: every socket here is made for the family of its address, and the DSCP
goes where that family reads it: ``IP_TOS`` (IPv4), ``IPV6_TCLASS`` (IPv6; RFC 3542),
and both on an IPv6 socket, whose IPv4-mapped traffic takes ``IP_TOS``.

Sources: ip(7) (IP_TOS, and "setting IP_TOS resets SO_PRIORITY"), ipv6(7), socket(7)
(SO_PRIORITY: values outside 0..6 need CAP_NET_ADMIN; SO_RCVBUF/SO_SNDBUF are capped at
net.core.rmem_max/wmem_max and the kernel doubles the value), RFC 2474 (TOS = DSCP << 2).
"""
from __future__ import annotations

import fcntl
import logging
import socket
import struct

log = logging.getLogger(__name__)

IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_PROBE = getattr(socket, "IP_PMTUDISC_PROBE", 3)
IP_RECVERR = getattr(socket, "IP_RECVERR", 11)   # linux/in.h
IPV6_MTU_DISCOVER = getattr(socket, "IPV6_MTU_DISCOVER", 23)   # linux/in6.h
IPV6_PMTUDISC_PROBE = getattr(socket, "IPV6_PMTUDISC_PROBE", 3)
IPV6_RECVERR = getattr(socket, "IPV6_RECVERR", 25)
IPV6_TCLASS = getattr(socket, "IPV6_TCLASS", 67)
IPV6_RECVTCLASS = getattr(socket, "IPV6_RECVTCLASS", 66)


def family_of(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address (``::``, ``::1``, ``fe80::1%eth0``) or a name that
    resolves only to IPv6, else AF_INET. Raises OSError (socket.gaierror) for a name
    that does not resolve."""
    if ":" in host:
        return socket.AF_INET6
    try:
        socket.inet_aton(host)
        return socket.AF_INET
    except OSError:
        pass
    fams = {ai[0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    return socket.AF_INET if socket.AF_INET in fams or not fams else socket.AF_INET6


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
    """Mark the socket's packets with ``dscp`` (0..63): ``IP_TOS = dscp << 2`` on IPv4;
    on IPv6 ``IPV6_TCLASS = dscp << 2`` and ``IP_TOS`` too (for IPv4-mapped peers of a
    dual-stack socket). SO_PRIORITY is set after it, since setting IP_TOS resets it.
    Raises ValueError for a bad DSCP."""
    if not 0 <= dscp <= 63:
        raise ValueError(f"DSCP must be 0..63, got {dscp}")
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_TCLASS, dscp << 2)
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
    """A bound, non-blocking UDP socket carrying ``dscp``, of ``host``'s family (``::``
    is a dual-stack wildcard). ``port`` 0 picks a free port."""
    s = socket.socket(family_of(host), socket.SOCK_DGRAM)
    try:
        # never fragment (DF), but ignore the path MTU that ICMP "fragmentation needed"
        # reports (PROBE, ip(7), ipv6(7)): anyone can forge one, and under DO it made
        # every later send fail with EMSGSIZE, which stopped the job (and the route's
        # cached MTU stays poisoned for 10 minutes). A datagram over the interface MTU
        # still fails with EMSGSIZE; one over a smaller MTU further on is lost, and
        # error feedback keeps its block
        if s.family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_PROBE)
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
        # IP_RECVERR stays off here: BatchSender.send turns it on only for its own
        # sendmsg calls (see transport.udp_batch.recverr_during)
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
    listen, and set again on each accepted socket by the adapter). Of ``host``'s family
    (``::`` is a dual-stack wildcard)."""
    s = socket.socket(family_of(host), socket.SOCK_STREAM)
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


def tcp_client(dscp: int, family: int = socket.AF_INET) -> socket.socket:
    """An unconnected TCP socket of ``family`` (:func:`family_of` the peer) with ``dscp``
    set before connect(), so the SYN carries the mark too; TCP_NODELAY on (frames are
    already batched)."""
    s = socket.socket(family, socket.SOCK_STREAM)
    set_dscp(s, dscp)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    return s


#: socket(7) SO_MAX_PACING_RATE (Linux 3.13+); Python's socket module does not name it
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)


def set_pacing_rate(sock, bytes_per_s: float) -> bool:
    """Cap ``sock``'s send rate at ``bytes_per_s`` (socket(7) SO_MAX_PACING_RATE). On a
    TCP socket this turns on the kernel's internal TCP pacing (Linux 4.13+; no fq qdisc
    needed), so a flow leaves at a steady rate instead of in cwnd bursts. ``<= 0``
    removes the cap; above 2^32 - 2 (inf included) it is that. Returns False where the
    kernel refuses (logged, not raised)."""
    # min() before int(): a rate of inf (or past 2^63) is the highest cap, not an error
    v = 0xFFFFFFFF if bytes_per_s <= 0 else max(1, int(min(bytes_per_s, 0xFFFFFFFE)))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", v))
        return True
    except OSError as e:
        log.debug("SO_MAX_PACING_RATE refused: %s", e)
        return False


SIOCOUTQNSD = 0x894B   # linux/sockios.h: bytes in a TCP socket not yet sent
SIOCOUTQ = 0x5411      # linux/sockios.h (= TIOCOUTQ): bytes in a socket's send queue


def _ioctl_int(sock, request: int) -> int:
    """An int-valued socket ioctl; 0 where unsupported or the socket is closed."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def tcp_unsent(sock) -> int:
    """Bytes queued in TCP socket ``sock`` that the kernel has not sent yet (tcp(7)
    SIOCOUTQNSD; in-flight unacknowledged bytes are not counted). 0 where unsupported."""
    return _ioctl_int(sock, SIOCOUTQNSD)


def udp_unsent(sock) -> int:
    """Bytes of UDP socket ``sock`` still on this host: handed to the kernel and not yet
    passed on by the device (udp(7) SIOCOUTQ: the socket's write memory, so queued
    datagrams in our egress qdisc count, with their buffer overhead). 0 where
    unsupported."""
    return _ioctl_int(sock, SIOCOUTQ)


#: tcp(7) TCP_RTO_MIN_US (Linux 6.15+): this socket's minimum retransmission timeout
TCP_RTO_MIN_US = 45


def set_rto_min(sock, ms: float) -> bool:
    """Lower ``sock``'s minimum retransmission timeout from the kernel's 200 ms to
    ``ms`` (TCP_RTO_MIN_US; the kernel takes 2 jiffies .. 200 ms and rounds up to
    jiffies). On a sub-millisecond-RTT cluster network a lost tail segment otherwise
    costs 200 ms; the RTO still follows srtt + 4 rttvar above the floor (RFC 6298).
    ``ms <= 0`` leaves the kernel default. Returns False where the kernel refuses
    (older than 6.15, or out of range): logged, not raised."""
    if ms <= 0:
        return True
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, int(ms * 1000))
        return True
    except OSError as e:
        log.debug("TCP_RTO_MIN_US %g ms refused: %s", ms, e)
        return False
