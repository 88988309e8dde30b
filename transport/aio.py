"""Thin asyncio adapters (run on uvloop) around the sans-IO pieces.

``FrameProtocol``: one TCP connection; bytes -> :func:`~.framing.parse_frames` -> callback
per frame. A malformed frame closes the connection (a TCP stream cannot resynchronise) and
is counted by the owner's ``on_bad`` callback, after the good frames before it were
handed on: the same ones whatever the TCP segmentation. While a large frame is incomplete, the
socket's SO_RCVLOWAT (:func:`~.framing.wake_bytes`) lets the kernel gather its rest
before waking us, and a read that still leaves the frame short is not parsed again.

``DatagramProtocol``: one UDP channel socket; each datagram goes to a callback with the
receive time. Optional receive-side loss emulation (``drop_fraction``) drops datagrams
with a seeded RNG *before* any processing, standing in for a lossy link where tc netem
or nftables is not available (documented in docs/architecture.md).
"""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from typing import Callable

from . import sockopts, wire
from .framing import parse_frames, wake_bytes

log = logging.getLogger(__name__)


class FrameProtocol(asyncio.BufferedProtocol):
    """``on_frame(proto, header, payload, now)``; ``on_bad(proto, reason)``;
    ``on_lost(proto, exc)`` when the connection closes.

    Receives straight into one preallocated buffer (``get_buffer``/``buffer_updated``,
    i.e. ``recv_into``): a frame's payload is a view into it, valid only during
    ``on_frame`` (consumers copy what they keep). The buffer grows to the largest frame
    seen, and a partial frame is moved to the front once per read. An accepted
    connection starts with ``UNAUTHENTICATED_MAX`` bytes and gets ``INITIAL_BYTES``
    once it knows its peer (``peer_rank``, set from HELLO): a stranger's idle
    connection costs 64 KiB, not 1 MiB.

    Raises ValueError for an empty ``key`` (None is no key).

    ``reads`` counts the reads (``buffer_updated``), ``parses`` those that had a whole
    message or header to look at; ``lowat`` is the socket's SO_RCVLOWAT as last set
    (1, the kernel's default, or None where the socket refused it).
    """

    INITIAL_BYTES = 1 << 20
    UNAUTHENTICATED_MAX = 1 << 16

    def __init__(self, on_frame: Callable, on_lost: Callable, on_bad: Callable,
                 key: bytes | None = None, dscp: int | None = None,
                 rto_min_ms: float = 0.0):
        self.on_frame, self.on_lost, self.on_bad = on_frame, on_lost, on_bad
        wire.check_key(key)   # ValueError for an empty key (docs/wire.md)
        self.key = key
        self.buf = bytearray(self.UNAUTHENTICATED_MAX)
        self.have = 0           # bytes in buf
        self.need = wire.HEADER_BYTES   # bytes buf must hold before a parse can yield
        self.reads = self.parses = 0
        self.lowat: int | None = 1
        self._sock: socket.socket | None = None
        self.dscp = dscp
        self.rto_min_ms = rto_min_ms   # sockopts.set_rto_min, both ends
        self.transport: asyncio.Transport | None = None
        self.peer_rank: int | None = None  # learned from HELLO
        self.outgoing = False
        self.paced = False      # owner's flag: SO_MAX_PACING_RATE set on this socket
        self.on_made: Callable | None = None   # on_made(proto) once connected

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and self.dscp is not None:
            try:  # accepted sockets: mark the server's side too
                sockopts.set_dscp(sock, self.dscp)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as e:  # pragma: no cover - depends on socket kind
                log.debug("could not set DSCP on accepted socket: %s", e)
        if sock is not None:
            sockopts.set_rto_min(sock, self.rto_min_ms)
            if sock.family != socket.AF_UNIX:
                self._sock = sock
        if self.on_made is not None:
            self.on_made(self)

    def get_buffer(self, sizehint):
        if self.have == len(self.buf):  # full with one partial frame: grow
            self._grow(2 * len(self.buf))
        elif len(self.buf) < self.INITIAL_BYTES and self.peer_rank is not None:
            self._grow(self.INITIAL_BYTES)
        return memoryview(self.buf)[self.have:]

    def _grow(self, size: int) -> None:
        new = bytearray(size)  # a new buffer: views of the old one may still exist
        new[: self.have] = self.buf[: self.have]
        self.buf = new

    def buffer_updated(self, nbytes):
        self.have += nbytes
        self.reads += 1
        if self.have < self.need:   # the message in progress is still short
            self._wake_at(wake_bytes(self.need, self.have))
            return
        self.parses += 1
        view = memoryview(self.buf)[: self.have]
        frames, used, need, error = parse_frames(view, self.key)
        now = time.monotonic()
        for h, payload in frames:   # the good frames before a malformed one, if any
            self.on_frame(self, h, payload, now)
            if self.transport.is_closing():
                return
        del frames, view
        if error is not None:
            self.on_bad(self, error.reason)
            self.transport.abort()
            return
        rest = self.have - used
        if used and rest:
            self.buf[:rest] = self.buf[used:self.have]  # same-size move: no resize
        self.have = rest
        if need > len(self.buf):
            # a stranger (no HELLO yet) gets no large allocation out of us
            if self.peer_rank is None and need > self.UNAUTHENTICATED_MAX:
                self.on_bad(self, "too_long")
                self.transport.abort()
                return
            self._grow(need)
        self.need = need
        self._wake_at(wake_bytes(need, rest))

    def _wake_at(self, nbytes: int) -> None:
        """Set SO_RCVLOWAT to ``nbytes`` when it changes; a socket that refuses it (not
        TCP) is left at the default for good."""
        if nbytes == self.lowat or self.lowat is None or self._sock is None:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self.lowat = nbytes
        except OSError as e:
            log.debug("SO_RCVLOWAT refused: %s", e)
            self.lowat = None

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self.on_lost(self, exc)

    def send(self, data) -> None:
        """Queue ``data``: bytes, or a list of buffers from :func:`~.wire.encode_parts`
        (written with ``writelines``: the transport keeps references, not copies, so the
        caller must leave those buffers unmodified until they are sent)."""
        if self.transport is not None and not self.transport.is_closing():
            if isinstance(data, list):
                self.transport.writelines(data)
            else:
                self.transport.write(data)


class DatagramProtocol(asyncio.DatagramProtocol):
    """``on_datagram(data, addr, now)`` per datagram, unless emulated loss drops it."""

    def __init__(self, on_datagram: Callable, drop_fraction: float = 0.0, seed: int = 0):
        self.on_datagram = on_datagram
        self.drop_fraction = drop_fraction
        self.rng = random.Random(seed)
        self.emulated_drops = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        if self.drop_fraction and self.rng.random() < self.drop_fraction:
            self.emulated_drops += 1
            return
        self.on_datagram(data, addr, time.monotonic())

    def error_received(self, exc):  # ICMP errors (e.g. port unreachable): not fatal
        log.debug("UDP error: %s", exc)
