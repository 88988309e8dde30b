"""A node's outgoing links to its peers: one push connection (TCP, EF) to each peer
shard and one UDP socket per channel (each with its channel's DSCP).

What a send needs beyond the bytes lives here: the peer's address (from the rendezvous),
kernel TCP pacing at one peer's share of the port (SO_MAX_PACING_RATE), the bytes a link
has not sent yet (the backlog the push sender and the held PULLs wait for), and the
--block-bytes advice when the kernel refuses a datagram as too big for the path MTU.
The messages themselves come from transport.sender (push) and dgt.pull_sender (PULL).
"""
from __future__ import annotations

import asyncio
import errno
import time
from typing import Callable

import numpy as np

from .errors import PeerFailure
from .failure import FailureReason
from .config import TransmissionConfig
from .scheduler.pacing import flow_share
from .transport import messages, pmtu, sockopts, wire
from .transport.aio import FrameProtocol
from .transport.udp_batch import BatchSender


class PeerLinks:
    """``peers``: rank -> endpoint ``{"host", "tcp_port", "udp_ports"}`` (filled by the
    rendezvous); ``udp_senders``: channel -> BatchSender over that channel's socket."""

    def __init__(self, cfg: TransmissionConfig, rank: int, world: int, dscp: list[int],
                 key: bytes | None):
        self.cfg, self.rank, self.world, self.dscp, self.key = cfg, rank, world, dscp, key
        self.mac = key is not None
        self.out_conns: dict[int, FrameProtocol] = {}   # to peer shards (we are worker)
        self.udp_senders: dict[int, BatchSender] = {}
        self.peers: dict[int, dict] = {}

    async def connect(self, make_protocol: Callable[[int], FrameProtocol], session: int,
                      on_connected: Callable[[FrameProtocol, int], None]) -> None:
        """Dial every peer's TCP port, retrying for --peer-timeout-s; send HELLO on each.
        Raises PeerFailure naming the rank that cannot be reached."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.cfg.peer_timeout_s
        for r, ep in self.peers.items():
            if r == self.rank:
                continue
            while True:
                sock = sockopts.tcp_client(self.dscp[0], sockopts.family_of(ep["host"]))
                try:
                    await loop.sock_connect(sock, (ep["host"], ep["tcp_port"]))
                    break
                except OSError as e:
                    sock.close()
                    if time.monotonic() > deadline:
                        raise PeerFailure(f"cannot reach rank {r} at {ep['host']}:"
                                          f"{ep['tcp_port']}: {e}", r,
                                          FailureReason.PEER_GONE) from None
                    await asyncio.sleep(0.1)
            _, proto = await loop.create_connection(lambda r=r: make_protocol(r), sock=sock)
            proto.send(messages.hello(session, self.rank, r, self.key))
            self.out_conns[r] = proto
            on_connected(proto, r)
            self.pace(proto)

    def send_tcp(self, shard: int, frame) -> None:
        """Write ``frame`` (bytes or a list of buffers) on our push connection to
        ``shard``. Raises PeerFailure when it is closed."""
        conn = self.out_conns.get(shard)
        if conn is None or conn.transport.is_closing():
            raise PeerFailure(f"connection to rank {shard} is closed", shard,
                              FailureReason.PEER_GONE)
        conn.send(frame)

    def send_udp(self, channel: int, shard: int, rows: np.ndarray) -> int:
        """Send ``rows`` ((n, datagram bytes) uint8) to ``shard``'s channel port; returns
        the datagrams the kernel took. Raises PeerFailure with the --block-bytes to use
        when a datagram does not fit the path MTU, or naming the peer otherwise."""
        ep = self.peers[shard]
        try:
            return self.udp_senders[channel].send(rows, (ep["host"],
                                                         ep["udp_ports"][channel - 1]))
        except OSError as e:
            if e.errno in (errno.EMSGSIZE, errno.EINVAL):   # EINVAL: a GSO segment
                too_big = self._mtu_advice(rows.shape[1], shard, ep)
                if too_big is not None:
                    raise PeerFailure(too_big, self.rank) from None
            raise PeerFailure(f"UDP send to rank {shard} failed: {e}", shard,
                              FailureReason.PEER_GONE) from None

    def _mtu_advice(self, size: int, shard: int, ep: dict) -> str | None:
        """The line for a ``size`` B datagram to ``shard`` that the kernel refused: the
        --block-bytes that fits the path MTU it reports now (transport.pmtu), or None
        when the datagram fits that MTU (the error had another cause)."""
        found = pmtu.path_mtu(ep["host"], ep["udp_ports"][0])
        mtu, ip_udp = found if found else (1500, pmtu.IPV4_UDP_BYTES)
        if found and size + ip_udp <= mtu:
            return None
        codings = tuple(sorted(set(self.cfg.band_codings()[1:self.cfg.channels + 1])))
        fit = pmtu.max_block_bytes(mtu, ip_udp, mac=self.mac, codings=codings)
        where = f"the path MTU to rank {shard} is {mtu} B" if found else \
            "the path MTU is unknown (assumed 1500 B)"
        return (f"a {size} B datagram (--block-bytes {self.cfg.block_bytes}"
                f"{' + MAC' if self.mac else ''}) does not fit: {where}; use --block-bytes "
                f"{fit} or less (IP+UDP {ip_udp} B + header {wire.HEADER_BYTES} B"
                f"{f' + MAC {wire.MAC_BYTES} B' if self.mac else ''} + block "
                f"{'/'.join(wire.Coding(c).name.lower() for c in codings)} <= {mtu} B)")

    def tcp_backlog(self, peer: int) -> int:
        """Bytes our push connection to ``peer`` has not sent yet: in the transport's
        buffer plus the kernel's unsent queue."""
        conn = self.out_conns.get(peer)
        if conn is None or conn.transport is None:
            return 0
        sock = conn.transport.get_extra_info("socket")
        return conn.transport.get_write_buffer_size() + (sockopts.tcp_unsent(sock)
                                                         if sock is not None else 0)

    def udp_backlog(self) -> int:
        """Bytes our UDP sockets have queued and not sent yet (udp(7) SIOCOUTQ)."""
        return sum(sockopts.udp_unsent(b.sock) for b in self.udp_senders.values())

    def pace(self, conn: FrameProtocol) -> None:
        """Cap a reliable connection at one peer's share of the port (kernel TCP pacing,
        SO_MAX_PACING_RATE): N-1 senders into one port then add up to its rate, so the
        port's queue does not overflow into retransmission timeouts (incast)."""
        if self.cfg.pace_mbit > 0 and not conn.paced and conn.transport is not None:
            sockopts.set_pacing_rate(conn.transport.get_extra_info("socket"),
                                     flow_share(self.cfg.pace_mbit, self.world - 1))
            conn.paced = True


async def drain(conns: list[FrameProtocol], timeout_s: float) -> None:
    """Wait until every connection's send buffer is empty, at most ``timeout_s``."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end and any(
            c.transport is not None and not c.transport.is_closing()
            and c.transport.get_write_buffer_size() for c in conns):
        await asyncio.sleep(0.01)
