"""The kernel filter on a UDP channel socket (transport/sockfilter.py): real loopback
sockets; a datagram no peer can have sent never reaches the socket's queue, a real one
(alone, or a GSO run read with GRO) does, and the receive path still sees every field."""
import os
import shutil
import socket
import subprocess
import sys
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


def test_the_iteration_window_keeps_only_its_iterations():
    """program(iteration=(first, last)): BLOCKS and END of iterations first..last pass,
    one below and one above are dropped in the kernel; Windowed gives the same bytes for
    every window without assembling again."""
    rx, peer = _udp(), _udp()
    rx.setblocking(False)
    kw = dict(session=SESSION, shard=1, world=3, lo=10, hi=20,
              sources=[peer.getsockname()], family=rx.family)
    windowed = sockfilter.Windowed(**kw)
    for window in [(4, 6), (0, 16), (2**32 - 3, 2**32 - 2)]:
        assert windowed.at(*window) == sockfilter.program(**kw, iteration=window)
    sockfilter.attach(rx, windowed.at(4, 6))
    try:
        for it in (3, 4, 5, 6, 7, 100):
            peer.sendto(_block(iteration=it, block=10 + it % 10), rx.getsockname())
            peer.sendto(wire.encode(wire.MsgType.END, session=SESSION, sender=2, shard=1,
                                    channel=1, iteration=it, count=1), rx.getsockname())
        got = [wire.decode_header(d) for d in _received(rx)]
        assert [(h.type, h.iteration) for h in got] == [
            (t, it) for it in (4, 5, 6) for t in (wire.MsgType.BLOCKS, wire.MsgType.END)]
        sockfilter.attach(rx, windowed.at(7, 23))   # the window moved on
        peer.sendto(_block(iteration=6), rx.getsockname())
        peer.sendto(_block(iteration=23), rx.getsockname())
        assert [wire.decode_header(d).iteration for d in _received(rx)] == [23]
    finally:
        rx.close()
        peer.close()


def test_a_node_replaces_its_filters_only_when_the_next_iteration_leaves_the_window():
    """dgt.node_sockets.NodeSockets.filter_iteration: the filters keep [n - 1, n +
    FILTER_AHEAD] and are replaced (one attach per channel) only when n + 1 leaves that
    window; a datagram of an iteration outside it is dropped in the kernel."""
    from dgt.config import NodeConfig, TransmissionConfig
    from dgt.node_sockets import FILTER_AHEAD, NodeSockets
    from dgt.transport.session import ShardSession
    socks = NodeSockets(TransmissionConfig(channels=1), NodeConfig(rank=1), [0, 0])
    rx, peer = _udp(), _udp()
    rx.setblocking(False)
    socks.senders[1] = BatchSender(rx)
    session = ShardSession(session=SESSION, shard=1, lo=10, hi=20, block_elems=4,
                           n_workers=3, deadline_s=1.0)
    attached = []
    attach = sockfilter.attach
    try:
        sockfilter.attach = lambda s, code: (attached.append(code), attach(s, code))
        socks.filter_udp(session, 3, [peer.getsockname()])
        for n in range(1, 2 * FILTER_AHEAD + 1):
            socks.filter_iteration(n)
        # at 0, then when n + 1 left [0 - 1, 0 + A] (n = A) and [A - 1, 2A] (n = 2A)
        assert len(attached) == 3, len(attached)
        assert socks._window == (2 * FILTER_AHEAD - 1, 3 * FILTER_AHEAD)
        for it in (2 * FILTER_AHEAD - 2, 2 * FILTER_AHEAD, 3 * FILTER_AHEAD + 1):
            peer.sendto(_block(iteration=it), rx.getsockname())
        assert [wire.decode_header(d).iteration for d in _received(rx)] == [2 * FILTER_AHEAD]
    finally:
        sockfilter.attach = attach
        rx.close()
        peer.close()


def test_a_filter_too_big_for_the_kernel_leaves_the_channel_open_not_closed(caplog):
    """More peers' sources than one classic BPF program can hold (4,096 instructions):
    the channel goes without a filter (the receive path checks every datagram), with one
    warning; before, it kept bind's drop-all filter and no datagram ever came in."""
    from dgt.config import NodeConfig, TransmissionConfig
    from dgt.node_sockets import NodeSockets
    from dgt.transport.session import ShardSession
    socks = NodeSockets(TransmissionConfig(channels=1), NodeConfig(rank=1), [0, 0])
    rx, peer = _udp(), _udp()
    rx.setblocking(False)
    socks.senders[1] = BatchSender(rx)
    sockfilter.attach(rx, sockfilter.drop_all())   # as bind leaves it
    session = ShardSession(session=SESSION, shard=1, lo=10, hi=20, block_elems=4,
                           n_workers=3, deadline_s=1.0)
    many = [peer.getsockname()] + [("127.0.0.2", p) for p in range(20000, 21000)]
    try:
        with pytest.raises(ValueError):
            sockfilter.program(session=SESSION, shard=1, world=3, lo=10, hi=20,
                               sources=many, iteration=(0, 1))
        socks.filter_udp(session, 3, many)
        for n in range(1, 40):
            socks.filter_iteration(n)
        peer.sendto(_block(), rx.getsockname())
        assert _received(rx) == [_block()]
        warned = [r for r in caplog.records if "no kernel filter" in r.getMessage()]
        assert len(warned) == 1, warned
    finally:
        rx.close()
        peer.close()


_SMALL_OPTMEM = '''
import socket, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
open("/proc/sys/net/core/optmem_max", "w").write("20480")   # this namespace's only
from dgt.config import NodeConfig, TransmissionConfig
from dgt.node_sockets import NodeSockets
from dgt.transport import sockfilter, wire
from dgt.transport.session import ShardSession
from dgt.transport.udp_batch import BatchSender
SESSION = 0x1234_5678_9ABC_DEF0
rx, peer = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
for s in (rx, peer):
    s.bind(("127.0.0.1", 0))
rx.settimeout(2.0)
socks = NodeSockets(TransmissionConfig(channels=3), NodeConfig(rank=1), [0] * 4)
socks.senders[1] = BatchSender(rx)
sockfilter.attach(rx, sockfilter.drop_all())   # as bind leaves it
# a 64-node job with 3 channels: 189 peers' sources, a 971-instruction program
sources = [peer.getsockname()] + [("10.0.0.%d" % (r + 2), 20000 + 10 * r + c)
                                  for r in range(62) for c in (1, 2, 3)]
socks.filter_udp(ShardSession(session=SESSION, shard=1, lo=10, hi=20, block_elems=4,
                              n_workers=64, deadline_s=1.0), 64, sources)
peer.sendto(wire.encode(wire.MsgType.BLOCKS, session=SESSION, sender=0, shard=1,
                        iteration=0, channel=1, block=12, count=1, payload=bytes(16)),
            rx.getsockname())
try:
    rx.recv(65535)
    print("received")
except socket.timeout:
    print("nothing came")
'''


def test_a_filter_the_kernel_will_not_hold_leaves_the_channel_open(tmp_path):
    """On a kernel whose net.core.optmem_max is 20480 (a long-time default; newer
    kernels have 131072), the filter of a 64-node job with 3 channels does not fit
    (ENOMEM): the channel goes without a filter, where before it kept bind's drop-all
    one and no datagram came in. Run in a network namespace of its own, whose
    optmem_max alone is lowered."""
    if os.geteuid() != 0:
        pytest.skip(reason="needs root (a network namespace with its own optmem_max)")
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip(reason="needs unshare (package util-linux) and ip (package iproute2)")
    p = subprocess.run(["unshare", "-n", sys.executable, "-c", _SMALL_OPTMEM],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "received", (p.stdout, p.stderr[-2000:])
    assert "no kernel filter on UDP channel 1" in p.stderr, p.stderr[-2000:]
