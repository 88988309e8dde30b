"""The sockets one node listens on: TCP (the reliable channel: blocks, END, PULL, EF
marked), one UDP socket per unreliable channel (each with its channel's DSCP, GRO on
where the kernel has it, the same socket sends that channel's datagrams) and the Unix
socket of the local trainer. Ports follow --base-port: rank r binds TCP ``B+10r`` and
UDP channel c ``B+10r+c`` (0: free ports)."""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Callable

from . import buffers, unixsock
from .config import NodeConfig, TransmissionConfig
from .transport import sockfilter, sockopts
from .transport.aio import DatagramProtocol
from .transport.udp_batch import BatchSender, enable_gro

log = logging.getLogger("dgt.sidecar")

#: bytes of receive buffer one queued datagram takes at the least (its skb's truesize
#: is more): :meth:`NodeSockets.drain` reads at most SO_RCVBUF / this per socket, a
#: full queue's worth, so a peer that keeps sending cannot hold the event loop there
MIN_QUEUED_BYTES = 512
#: bytes one read takes: a GRO run of up to 64 datagrams fits (asyncio's own datagram
#: transports read up to 256 KiB as well)
READ_BYTES = 256 * 1024
#: the kernel filter keeps iterations up to this many ahead of the open one, and is
#: replaced when the next one leaves its window (:meth:`NodeSockets.filter_iteration`)
FILTER_AHEAD = 16


class NodeSockets:
    """``udp``: channel -> (transport, DatagramProtocol); ``senders``: channel ->
    BatchSender; ``warnings``: socket buffer warnings (dgt.buffers), once each."""

    def __init__(self, cfg: TransmissionConfig, node: NodeConfig, dscp: list[int]):
        self.cfg, self.node, self.dscp = cfg, node, dscp
        self.udp: dict[int, tuple[asyncio.DatagramTransport, DatagramProtocol]] = {}
        self.senders: dict[int, BatchSender] = {}
        self.queue_datagrams: dict[int, int] = {}   # channel -> drain's bound
        self.gro = False
        self.warnings: list[str] = []
        self.socket_owned: tuple[int, int] | None = None   # (dev, inode) we bound
        self.tcp_server = self.unix_server = None
        self._windowed: sockfilter.Windowed | None = None   # every channel's filter
        self._window: tuple[int, int] | None = None   # the filters' iterations kept
        self._unfiltered: set[int] = set()   # channels whose filter the kernel refused

    async def bind(self, accepted: Callable, on_datagram: Callable,
                   serve_trainer: Callable) -> None:
        """Bind and serve: ``accepted()`` makes the protocol of an accepted TCP
        connection, ``on_datagram(channel, data, addr, now)`` takes every datagram,
        ``serve_trainer(reader, writer)`` serves the Unix socket. Raises OSError
        (EADDRINUSE, EADDRNOTAVAIL, ...) and refuses a Unix socket that is live."""
        loop = asyncio.get_running_loop()
        cfg, node = self.cfg, self.node
        base = node.base_port + 10 * node.rank if node.base_port else 0
        self.tcp_sock = _naming_port("TCP", base, sockopts.tcp_listener, node.host, base,
                                     self.dscp[0])
        self.tcp_server = await loop.create_server(accepted, sock=self.tcp_sock)
        for c in range(1, cfg.channels + 1):
            port = base + c if base else 0
            s = _naming_port("UDP", port, sockopts.udp_socket, node.host, port,
                             self.dscp[c], cfg.udp_buffer_bytes, cfg.udp_buffer_bytes)
            for w in buffers.check(s, cfg.udp_buffer_bytes):
                if w not in self.warnings:   # the same on every channel: once
                    self.warnings.append(w)
                    log.warning("rank %d: %s", node.rank, w)
            # GRO hands us coalesced runs of datagrams; receive-side loss emulation
            # must drop single datagrams, so it runs without GRO
            self.gro = enable_gro(s) if not cfg.drop_udp else False
            self.senders[c] = BatchSender(s)
            # the most datagrams its receive queue holds: drain's bound
            self.queue_datagrams[c] = s.getsockopt(socket.SOL_SOCKET,
                                                   socket.SO_RCVBUF) // MIN_QUEUED_BYTES
            self._filter_one(c, s, sockfilter.drop_all())   # nothing is ready for it yet
            tr, proto = await loop.create_datagram_endpoint(
                lambda c=c: DatagramProtocol(lambda d, a, now, c=c: on_datagram(c, d, a, now),
                                             cfg.drop_udp,
                                             seed=node.seed * 131 + node.rank * 7 + c),
                sock=s)
            self.udp[c] = (tr, proto)
        usock, self.socket_owned = unixsock.claim(node.socket)   # refuses a live socket
        self.unix_server = await asyncio.start_unix_server(serve_trainer, sock=usock)
        log.info("rank %d listening: tcp %d, udp %s, unix %s", node.rank, self.tcp_port,
                 self.udp_ports, node.socket)

    def filter_udp(self, s, world: int, sources: list | None) -> None:
        """Attach the kernel filter (transport.sockfilter) to every channel socket, for
        shard session ``s`` (transport.session.ShardSession) of a ``world``-node job and
        the peers' channel ``sources`` ((address, port) pairs; None: any): a datagram no
        peer can have sent, or that belongs to no iteration around ``s``'s open one, is
        dropped before it queues. :meth:`filter_iteration` moves that window on."""
        self._windowed = self._window = None
        if not self.senders:   # --mode tcp: no channel socket
            return
        family = next(iter(self.senders.values())).sock.family   # all on node.host
        try:   # one program for every channel: they share the sources and the family
            self._windowed = sockfilter.Windowed(
                session=s.session, shard=s.shard, world=world, lo=s.lo, hi=s.hi,
                sources=sources, family=family)
        except ValueError as e:   # more sources than one program holds
            for c, sender in self.senders.items():
                self._no_filter(c, sender.sock, e)
        self.filter_iteration(s.iteration)

    def filter_iteration(self, iteration: int) -> None:
        """Called as the shard opens ``iteration``: while the filters' iteration window
        holds ``iteration + 1`` nothing is done; else each channel socket's filter is
        replaced by one keeping ``[iteration - 1, iteration + FILTER_AHEAD]``. So
        datagrams more than FILTER_AHEAD iterations older than the open one (a replay
        of an old capture) are dropped in the kernel, not after they have filled the
        receive buffer, at one attach per channel every FILTER_AHEAD iterations (each
        costs the kernel about 70 us: transport.sockfilter). A no-op before
        :meth:`filter_udp`."""
        if self._windowed is None or (self._window is not None and
                                      iteration + 1 <= self._window[1]):
            return
        self._window = (max(iteration - 1, 0), iteration + FILTER_AHEAD)
        code = self._windowed.at(*self._window)
        for c, sender in self.senders.items():
            self._filter_one(c, sender.sock, code)

    def _filter_one(self, c: int, sock, code: bytes) -> None:
        try:
            sockfilter.attach(sock, code)
        except OSError as e:   # the receive path checks it all anyway
            self._no_filter(c, sock, e)

    def _no_filter(self, c: int, sock, e: Exception) -> None:
        """Channel ``c``'s filter could not be made or attached: take off the one it
        has (bind's drop-all would keep every datagram out), and say so once."""
        try:
            sockfilter.detach(sock)
        except OSError:   # none attached
            pass
        if c not in self._unfiltered:   # once per channel, not once per iteration
            self._unfiltered.add(c)
            log.warning("rank %d: no kernel filter on UDP channel %d (%s); forged "
                        "datagrams are refused in the receive path only", self.node.rank,
                        c, e)

    def drain(self, reads: int | None = None) -> int:
        """Hand the datagrams already queued on each channel socket to its protocol now,
        as the event loop would on its next rounds (emulated loss included), at most
        ``reads`` reads (one datagram or one GRO run each) per socket; default: as many
        datagrams as its receive buffer can hold (``queue_datagrams``: without GRO a
        read is one datagram, and one iteration's backlog from three peers is
        thousands). The sidecar calls it before a shard's deadline finalises a worker:
        a block that sits in this host's receive queue has arrived, and counting it lost
        would charge the network for this process's own delay (docs/architecture.md,
        "The receiver deadline"). Returns the reads made. Never raises: a queued ICMP
        error goes to the protocol's ``error_received``, as the loop would pass it."""
        n = 0
        for c, (tr, proto) in self.udp.items():
            if tr.is_closing():
                continue
            sock = self.senders[c].sock
            for _ in range(self.queue_datagrams[c] if reads is None else reads):
                try:
                    data, addr = sock.recvfrom(READ_BYTES)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:   # an ICMP error the socket had queued
                    proto.error_received(e)
                    continue
                proto.datagram_received(data, addr)
                n += 1
        return n

    def kernel_drops(self) -> int:
        """Datagrams the kernel dropped on the channel sockets: the filter's refusals
        and full receive buffers (transport.sockfilter.kernel_drops; 0 where unknown)."""
        return sum(sockfilter.kernel_drops(b.sock) or 0 for b in self.senders.values())

    @property
    def tcp_port(self) -> int:
        return self.tcp_sock.getsockname()[1]

    @property
    def udp_ports(self) -> list[int]:
        return [self.udp[c][0].get_extra_info("sockname")[1] for c in sorted(self.udp)]

    def close(self) -> None:
        for tr, _ in self.udp.values():
            tr.close()
        if self.tcp_server is not None:
            self.tcp_server.close()
        if self.unix_server is not None:
            self.unix_server.close()
        unixsock.release(self.node.socket, self.socket_owned)


def _naming_port(proto: str, port: int, make: Callable, *args):
    """``make(*args)``; EADDRINUSE and EACCES are raised again naming ``proto`` and
    ``port`` (the error's ``filename``, so the message says which port is taken or
    needs root)."""
    try:
        return make(*args)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES) and port:
            raise OSError(e.errno, e.strerror, f"{proto} port {port}") from None
        raise
