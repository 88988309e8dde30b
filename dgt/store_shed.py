"""Shedding the connections of a crowded rendezvous store (dgt.store_host) that are no
rank's.

A TCPStore client speaks first, at once: its validation message (a query-type byte, 0,
and a four-byte magic number; torch 2.13 sends a ping of five more bytes in the same
write) follows the connect in the same breath. A connection to the store's port that
has sent less than that one message and then stayed silent for ``SILENT_S`` is
therefore no rank's; a connection flood is made of them, whether its connections send
nothing or a byte each (breaker round 6: a byte each was not shed). When the store's
process runs short of descriptors it shuts such connections down (shutdown(2),
SHUT_RDWR), and the store's own event loop, which reads the end of the stream, closes
them and frees their descriptors, so a rank that connects during the flood still finds
room. The descriptors are only looked at and shut down here, never closed: they stay
the store's.

The facts come from the kernel: TCP_INFO (tcp(7); ``struct tcp_info`` of
linux/tcp.h): ``tcpi_state`` (byte 0; 1 = ESTABLISHED), ``tcpi_last_data_recv`` (u32
at byte 52, ms since data last came, or since the connection was made when none has)
and ``tcpi_bytes_received`` (u64 at byte 128, Linux 4.1 and later; where the kernel
gives a shorter struct nothing is shed). What stays open: a flood whose connections
each send the store's whole validation message looks like ranks and is not shed.
"""
from __future__ import annotations

import os
import socket
import struct

#: s: silence after which a connection to the store's port that has sent less than
#: HANDSHAKE_BYTES is no rank's
SILENT_S = 2.0
#: bytes of a TCPStore client's validation message, its first: the query type (1 byte)
#: and the magic number (uint32)
HANDSHAKE_BYTES = 5
TCP_ESTABLISHED = 1
#: bytes of struct tcp_info read: up to and including tcpi_bytes_received
INFO_BYTES = 136


def is_no_rank(info: bytes, silent_ms: float) -> bool:
    """Whether a TCP_INFO reply ``info`` is an established connection that has received
    less than :data:`HANDSHAKE_BYTES` in all and nothing for ``silent_ms`` ms (since it
    was made, or since its last byte). False when ``info`` is too short to say (an old
    kernel)."""
    if len(info) < INFO_BYTES or info[0] != TCP_ESTABLISHED:
        return False
    last_recv_ms = struct.unpack_from("<I", info, 52)[0]
    received = struct.unpack_from("<Q", info, 128)[0]
    return received < HANDSHAKE_BYTES and last_recv_ms >= silent_ms


def our_fds(limit: int) -> list[int]:
    """This process's descriptors (/proc/self/fd); every number below ``limit`` when
    that folder cannot be opened (no descriptor left to open it with)."""
    try:
        return [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, limit))


def shed(port: int, limit: int, silent_s: float = SILENT_S) -> int:
    """Shut down every TCP connection of this process whose local port is ``port`` and
    that is no rank's, silent for ``silent_s`` seconds (:func:`is_no_rank`); ``limit``: the
    soft RLIMIT_NOFILE (the range looked at when /proc/self/fd cannot be read). Returns
    how many were shut down. Never raises for a descriptor that closed meanwhile."""
    n = 0
    for fd in our_fds(limit):
        if fd < 3:
            continue
        try:
            s = socket.socket(fileno=fd)   # no new descriptor: detached below
        except OSError:   # not a socket, or closed meanwhile
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET,
                                                                 socket.AF_INET6) \
                    or s.getsockname()[1] != port:
                continue
            if is_no_rank(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, INFO_BYTES),
                         silent_s * 1000):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            continue
        finally:
            s.detach()
    return n
