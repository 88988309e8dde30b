"""Batched UDP sends: one ``sendmsg`` per up to 64 datagrams with UDP GSO.

Linux UDP GSO (``UDP_SEGMENT``, kernel >= 4.18; udp(7)): the kernel (or NIC) cuts one
large buffer into equal-size datagrams, so the wire still carries MTU-sized datagrams
(no IP fragmentation) while the sender makes one syscall per batch. Falls back to one
``sendto`` per datagram where the kernel refuses GSO.

The socket is the plain, non-blocking socket the sidecar made; uvloop keeps using the
same fd for receiving (and for nothing else on the send side).

``IP_RECVERR`` is on only while this module's own sends run (``recverr_during``). Left on,
an ICMP error (a peer's port closed: a peer that died or ended first) queues on the
socket and raises POLLERR; libuv (1.48+, in uvloop 0.23.0) then reads the error queue
and hands uvloop ``UV__ERR(serr->ee_errno)``, an unsigned negation, as a length of
about 4 GiB, and uvloop's ``__uv_udp_on_receive`` copies that much: SIGSEGV (seen in
``tests/test_train_faults.py::test_a_killed_launcher_takes_its_children_with_it``,
core dump: ``uv__udp_recvmsg_errqueue`` -> ``PyBytes_FromStringAndSize(size=4294967185)``,
that is ECONNREFUSED).
"""
from __future__ import annotations

import errno
import logging
import socket
import struct

import numpy as np

from .sockopts import IP_RECVERR, IPV6_RECVERR

log = logging.getLogger(__name__)

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
MAX_SEGMENTS = 64          # UDP_MAX_SEGMENTS in the kernel
MAX_GSO_BYTES = 65000      # one UDP payload of at most 65,507 bytes
_ICMP_ERRNOS = frozenset((errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                          errno.EHOSTDOWN))
#: sock_extended_err.ee_origin of an error an ICMP message reported (linux/errqueue.h)
_ORIGIN_ICMP = (2, 3)   # SO_EE_ORIGIN_ICMP, SO_EE_ORIGIN_ICMP6
#: queued ICMP errors one send() steps over before it returns early (a retry later), so
#: a flood of them cannot hold it in its loop
MAX_ICMP_RETRIES = 64


class recverr_during:
    """``with recverr_during(sock):`` turns ``IP_RECVERR`` on for the block, then off.

    On: a datagram this host's egress qdisc drops fails its send with ENOBUFS (ip(7);
    the kernel's ``udp_send_skb`` swallows that error otherwise). Off again: the kernel
    purges the error queue (``do_ip_setsockopt``), and ``SO_ERROR`` is read to clear a
    pending ``sk_err``, so the event loop never sees POLLERR (module docstring: why).
    An unconnected UDP socket without ``IP_RECVERR`` queues no ICMP errors at all.
    Costs three setsockopt/getsockopt calls per batch of sends."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.v6 = sock.family == socket.AF_INET6   # (socket.family builds an enum)

    def __enter__(self):
        self._set(1)
        return self

    def _set(self, on: int) -> None:
        # IPv6: IPV6_RECVERR for IPv6 peers, IP_RECVERR for IPv4-mapped ones
        if self.v6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVERR, on)
        self.sock.setsockopt(socket.IPPROTO_IP, IP_RECVERR, on)

    def __exit__(self, *exc):
        self._set(0)
        self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        return False


def enable_gro(sock: socket.socket) -> bool:
    """Ask for UDP GRO on receive; False where the kernel lacks it."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        return True
    except OSError:
        return False


class BatchSender:
    """Send rows of a (n, size) uint8 array as n datagrams of ``size`` bytes."""

    def __init__(self, sock: socket.socket, use_gso: bool = True):
        self.sock = sock
        self.recverr = recverr_during(sock)   # re-entered per send
        self.gso = use_gso
        self.syscalls = 0
        self.backoffs = 0       # ENOBUFS: our own egress qdisc was full (see send)
        self.icmp_errors = 0    # a queued ICMP error surfaced on a send (see send)

    def send(self, rows: np.ndarray, addr) -> int:
        """Send as many rows as the socket buffer takes; return how many were sent
        (fewer than ``len(rows)`` when the send buffer is full: retry later).

        With ``IP_RECVERR`` on for these sends (``recverr_during``) a datagram
        that this host's own egress qdisc drops fails with ENOBUFS instead of vanishing
        (ip(7); the kernel's udp_send_skb): that is backpressure, so it also returns
        early for a retry. An ICMP error queued by an earlier datagram (ECONNREFUSED
        and kin) is counted and the batch retried, and so is an EMSGSIZE that an ICMP
        "fragmentation needed" left pending (anyone can forge one; the socket ignores
        its MTU, transport.sockopts.udp_socket), told from this host's own refusal of a
        datagram over the interface MTU by the error queue's origin; after
        :data:`MAX_ICMP_RETRIES` of them it returns early. Raises OSError for anything
        else (EMSGSIZE included, when the datagram really is too big)."""
        with self.recverr:
            return self._send(rows, addr)

    def _send(self, rows: np.ndarray, addr) -> int:
        n, size = rows.shape
        per = max(1, min(MAX_SEGMENTS, MAX_GSO_BYTES // size)) if self.gso else 1
        sent = retries = 0
        cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
        while sent < n:
            k = min(per, n - sent)
            chunk = rows[sent:sent + k]
            try:
                if k > 1:
                    self.sock.sendmsg([chunk.data], cmsg, 0, addr)
                else:
                    self.sock.sendto(chunk[0].data, addr)
            except BlockingIOError:
                return sent
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.backoffs += 1
                    return sent
                if e.errno in _ICMP_ERRNOS or (e.errno == errno.EMSGSIZE and
                                                self._drain_error_queue()):
                    self.icmp_errors += 1
                    retries += 1
                    if retries > MAX_ICMP_RETRIES:
                        return sent
                    continue
                if k > 1 and e.errno in (errno.EINVAL, errno.ENOPROTOOPT, errno.EIO,
                                         errno.EOPNOTSUPP):
                    log.warning("UDP GSO refused (%s); sending one datagram per syscall", e)
                    self.gso, per = False, 1
                    continue
                raise
            self.syscalls += 1
            sent += k
        return sent

    def _drain_error_queue(self, limit: int = 256) -> bool:
        """Read queued errors (MSG_ERRQUEUE, ip(7)) so they stop holding receive memory;
        an ICMP error only says a peer's port was unreachable, or some path's MTU
        smaller, at some point. Returns whether one of them came from an ICMP message
        (``sock_extended_err.ee_origin``, its fifth byte), not from this host."""
        icmp = False
        for _ in range(limit):
            try:
                _, anc, _, _ = self.sock.recvmsg(1, 1024, socket.MSG_ERRQUEUE)
            except OSError:
                return icmp
            icmp = icmp or any(len(d) > 4 and d[4] in _ORIGIN_ICMP for _, _, d in anc)
        return icmp
