"""The kernel filter on a UDP channel socket (transport/sockfilter.py): real loopback
sockets; a datagram no peer can have sent never reaches the socket's queue, a real one
(alone, or a GSO run read with GRO) does, and the receive path still sees every field."""
import socket
import time

import numpy as np
import pytest

from dgt.transport import sockfilter, wire
from dgt.transport.udp_batch import BatchSender, enable_gro

SESSION = 0x1234_5678_9ABC_DEF0


def _udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s


@pytest.fixture
def link():
    rx, peer, stranger = _udp(), _udp(), _udp()
    rx.setblocking(False)
    code = sockfilter.program(session=SESSION, shard=1, world=3, lo=10, hi=20,
                              sources=[peer.getsockname()], family=rx.family)
    sockfilter.attach(rx, code)
    yield rx, peer, stranger
    for s in (rx, peer, stranger):
        s.close()


def _block(**kw):
    a = dict(session=SESSION, sender=0, shard=1, iteration=0, channel=1, block=12,
             count=1, payload=bytes(16))
    a.update(kw)
    return wire.encode(wire.MsgType.BLOCKS, **a)


def _received(rx) -> list[bytes]:
    time.sleep(0.05)
    out = []
    while True:
        try:
            out.append(rx.recv(65535))
        except BlockingIOError:
            return out


@pytest.mark.parametrize("name,payload", [
    ("stray", _block(session=SESSION ^ 1)),
    ("wrong_shard", _block(shard=2)),
    ("bad_sender", _block(sender=3)),
    ("bad_block below", _block(block=9)),
    ("bad_block above", _block(block=20)),
    ("bad_magic", b"XX" + _block()[2:]),
    ("bad_version", _block()[:2] + b"\x02" + _block()[3:]),
    ("short", _block()[:wire.HEADER_BYTES - 1]),
    ("bad_udp_message", wire.encode(wire.MsgType.HELLO, session=SESSION, sender=2, shard=1)),
])
def test_the_kernel_drops_what_no_peer_can_have_sent(link, name, payload):
    rx, peer, _ = link
    peer.sendto(payload, rx.getsockname())
    peer.sendto(_block(block=19), rx.getsockname())   # the real one after it
    assert _received(rx) == [_block(block=19)], name


def test_the_kernel_drops_a_datagram_from_no_peer_s_socket(link):
    rx, peer, stranger = link
    stranger.sendto(_block(), rx.getsockname())
    peer.sendto(wire.encode(wire.MsgType.END, session=SESSION, sender=2, shard=1,
                            channel=1, count=3), rx.getsockname())
    got = _received(rx)
    assert len(got) == 1 and wire.decode(got[0])[0].type == wire.MsgType.END


def test_a_gso_run_passes_whole_to_a_gro_socket(link):
    rx, peer, _ = link
    gro = enable_gro(rx)
    rows = wire.encode_block_datagrams(session=SESSION, sender=2, shard=1, iteration=0,
                                       channel=1, indices=np.arange(10, 20),
                                       blocks=np.ones((10, 4), np.float32))
    assert BatchSender(peer).send(rows, rx.getsockname()) == 10
    got = b"".join(_received(rx))
    assert got == rows.tobytes(), (gro, len(got))


def test_the_kernel_counts_what_its_filter_drops(link):
    rx, peer, stranger = link
    before = sockfilter.kernel_drops(rx)
    for _ in range(5):
        stranger.sendto(_block(), rx.getsockname())
    assert _received(rx) == []
    assert sockfilter.kernel_drops(rx) - before == 5


def test_a_drop_all_filter_keeps_nothing():
    rx, peer = _udp(), _udp()
    rx.setblocking(False)
    sockfilter.attach(rx, sockfilter.drop_all())
    peer.sendto(_block(), rx.getsockname())
    try:
        assert _received(rx) == []
    finally:
        rx.close()
        peer.close()
