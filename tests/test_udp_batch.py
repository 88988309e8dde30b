"""UDP GSO send and GRO receive over real loopback sockets."""
import asyncio
import socket

import numpy as np
import uvloop

from dgt.transport import sockopts, wire
from dgt.transport.session import ShardSession
from dgt.transport.udp_batch import BatchSender, enable_gro


def test_gso_batches_arrive_as_the_same_datagrams():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    tx = sockopts.udp_socket("127.0.0.1", 0, 34)
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((100, 352)).astype(np.float32)
    rows = wire.encode_block_datagrams(session=7, sender=0, shard=0, iteration=0, channel=1,
                                       indices=np.arange(100), blocks=blocks)
    sender = BatchSender(tx)
    assert sender.send(rows, rx.getsockname()) == 100
    got = [rx.recv(65536) for _ in range(100)]   # no GRO: the kernel segments for us
    assert got == [r.tobytes() for r in rows]
    if sender.gso:
        assert sender.syscalls == 3              # 44 + 44 + 12 datagrams
    tx.close()
    rx.close()


def test_gro_receiver_session_takes_every_block():
    async def main():
        loop = asyncio.get_running_loop()
        sess = ShardSession(session=7, shard=0, lo=0, hi=300, block_elems=352, n_workers=2,
                            deadline_s=1.0)
        calls = []

        class P(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                calls.append(len(data))
                sess.receive_datagram(data, loop.time())

        rx = sockopts.udp_socket("127.0.0.1", 0, 34)
        gro = enable_gro(rx)
        tr, _ = await loop.create_datagram_endpoint(P, sock=rx)
        tx = sockopts.udp_socket("127.0.0.1", 0, 34)
        rows = wire.encode_block_datagrams(
            session=7, sender=1, shard=0, iteration=0, channel=2, indices=np.arange(300),
            blocks=np.ones((300, 352), np.float32))
        assert BatchSender(tx).send(rows, rx.getsockname()) == 300
        for _ in range(100):
            if sess.received[1].all():
                break
            await asyncio.sleep(0.02)
        tr.close()
        tx.close()
        return sess, calls, gro

    sess, calls, gro = uvloop.run(main())
    assert sess.received[1].all()
    assert sess.counters.channels[2].blocks_delivered == 300
    if gro:
        assert len(calls) < 300   # coalesced
