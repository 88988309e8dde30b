"""Batched UDP sends: one ``sendmsg`` per up to 64 datagrams with UDP GSO.

Linux UDP GSO (``UDP_SEGMENT``, kernel >= 4.18; udp(7)): the kernel (or NIC) cuts one
large buffer into equal-size datagrams, so the wire still carries MTU-sized datagrams
(no IP fragmentation) while the sender makes one syscall per batch. Falls back to one
``sendto`` per datagram where the kernel refuses GSO.

The socket is the plain, non-blocking socket the sidecar made; uvloop keeps using the
same fd for receiving (and for nothing else on the send side).
"""
from __future__ import annotations

import errno
import logging
import socket
import struct

import numpy as np

log = logging.getLogger(__name__)

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
MAX_SEGMENTS = 64          # UDP_MAX_SEGMENTS in the kernel
MAX_GSO_BYTES = 65000      # one UDP payload of at most 65,507 bytes
_ICMP_ERRNOS = frozenset((errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                          errno.EHOSTDOWN))


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
        self.gso = use_gso
        self.syscalls = 0
        self.backoffs = 0       # ENOBUFS: our own egress qdisc was full (see send)
        self.icmp_errors = 0    # a queued ICMP error surfaced on a send (see send)

    def send(self, rows: np.ndarray, addr) -> int:
        """Send as many rows as the socket buffer takes; return how many were sent
        (fewer than ``len(rows)`` when the send buffer is full: retry later).

        With ``IP_RECVERR`` on the socket (``sockopts.udp_socket`` sets it) a datagram
        that this host's own egress qdisc drops fails with ENOBUFS instead of vanishing
        (ip(7); the kernel's udp_send_skb): that is backpressure, so it also returns
        early for a retry. An ICMP error queued by an earlier datagram (ECONNREFUSED
        and kin) is counted and the batch retried. Raises OSError for anything else."""
        n, size = rows.shape
        per = max(1, min(MAX_SEGMENTS, MAX_GSO_BYTES // size)) if self.gso else 1
        sent = 0
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
                if e.errno in _ICMP_ERRNOS:
                    self.icmp_errors += 1
                    self._drain_error_queue()
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

    def _drain_error_queue(self, limit: int = 256) -> None:
        """Read queued ICMP errors (MSG_ERRQUEUE, ip(7)) so they stop holding receive
        memory; they only say a peer's port was unreachable at some point."""
        for _ in range(limit):
            try:
                self.sock.recvmsg(1, 1024, socket.MSG_ERRQUEUE)
            except OSError:
                return
