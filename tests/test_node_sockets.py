"""A node's UDP channel sockets (dgt/node_sockets.py), real sockets on loopback: what
``drain`` hands over before a shard deadline is exactly what sat in the receive queues,
in order, through the kernel filter and the protocol's emulated loss, and no more than
its bound."""
import asyncio
import dataclasses
import socket

from dgt.config import NodeConfig, TransmissionConfig
from dgt.node_sockets import NodeSockets
from dgt.transport import wire
from dgt.transport.session import ShardSession

SESSION = 0x5EED_0000_0000_0001


def _block(block: int, channel: int = 1) -> bytes:
    return wire.encode(wire.MsgType.BLOCKS, session=SESSION, sender=1, shard=0,
                       iteration=0, channel=channel, block=block, count=1,
                       payload=block.to_bytes(4, "little") * 4)


def _run(tmp_path, cfg: TransmissionConfig, body):
    """Bind a rank-0 node's sockets, filter them for shard 0 of a 2-node job (any
    source), run ``body(socks, got, peer)`` with ``got``: (channel, datagram) handed
    over, in order; close everything after."""
    node = NodeConfig(rank=0, world=2, run_dir=str(tmp_path),
                      socket=str(tmp_path / "s.sock"))
    got: list[tuple[int, bytes]] = []

    async def main():
        socks = NodeSockets(cfg, node, [46, 34, 18, 10])
        await socks.bind(lambda: None, lambda c, d, a, now: got.append((c, bytes(d))),
                         lambda r, w: None)
        peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sess = ShardSession(session=SESSION, shard=0, lo=0, hi=1000, block_elems=4,
                                n_workers=2, deadline_s=0.05)
            socks.filter_udp(sess, 2, None)
            return body(socks, got, peer)
        finally:
            peer.close()
            socks.close()
    return asyncio.run(main())


def _send(peer, socks, channel: int, blocks) -> None:
    port = socks.udp_ports[channel - 1]
    for b in blocks:
        peer.sendto(_block(b, channel), ("127.0.0.1", port))


def test_drain_hands_over_every_queued_datagram_in_order_and_then_nothing(tmp_path):
    def body(socks, got, peer):
        # the loop never runs between the sends and the drain: all of it is queued
        _send(peer, socks, 1, range(300))
        _send(peer, socks, 3, range(500, 520))
        reads = socks.drain()
        first = list(got)
        return reads, first, socks.drain()
    reads, first, again = _run(tmp_path, TransmissionConfig(), body)
    assert [d for c, d in first if c == 1] == [_block(b, 1) for b in range(300)]
    assert [d for c, d in first if c == 3] == [_block(b, 3) for b in range(500, 520)]
    assert reads == 320 and again == 0


def test_drain_reads_no_more_than_its_bound_per_socket(tmp_path):
    def body(socks, got, peer):
        _send(peer, socks, 2, range(40))
        _send(peer, socks, 3, range(40))
        n = socks.drain(reads=7)
        first = list(got)
        return n, first, socks.drain()
    n, first, rest = _run(tmp_path, TransmissionConfig(), body)
    assert n == 14
    assert [d for c, d in first if c == 2] == [_block(b, 2) for b in range(7)]
    assert [d for c, d in first if c == 3] == [_block(b, 3) for b in range(7)]
    assert rest == 66   # the rest is still there for the next drain (or the loop)


def test_drain_goes_through_the_kernel_filter_and_the_emulated_loss(tmp_path):
    """A stranger's datagram never reaches the queue (the filter), and ``--drop-udp``
    drops drained datagrams as it drops the loop's, counted the same way."""
    cfg = dataclasses.replace(TransmissionConfig(), drop_udp=0.5)

    def body(socks, got, peer):
        port = socks.udp_ports[0]
        peer.sendto(wire.encode(wire.MsgType.BLOCKS, session=SESSION ^ 1, sender=1,
                                shard=0, iteration=0, channel=1, block=3, count=1,
                                payload=bytes(16)), ("127.0.0.1", port))
        _send(peer, socks, 1, range(200))
        reads = socks.drain()
        dropped = sum(p.emulated_drops for _, p in socks.udp.values())
        return reads, list(got), dropped
    reads, got, dropped = _run(tmp_path, cfg, body)
    assert reads == 200   # the stranger's never queued
    assert 0 < dropped < 200 and len(got) == 200 - dropped
    assert all(d == _block(int.from_bytes(d[-16:-12], "little"), 1) for _, d in got)


def test_a_closed_channel_is_not_read(tmp_path):
    def body(socks, got, peer):
        _send(peer, socks, 1, range(5))
        socks.udp[1][0].close()
        return socks.drain()
    assert _run(tmp_path, TransmissionConfig(), body) == 0
