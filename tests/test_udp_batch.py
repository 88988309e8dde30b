"""UDP GSO send and GRO receive over real loopback sockets."""
import asyncio
import os
import socket

import numpy as np
import pytest
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


def _pollerr(sock) -> bool:
    """Would the event loop see POLLERR on this socket now? (select.poll reads nothing.)"""
    import select
    p = select.poll()
    p.register(sock.fileno(), 0)
    return any(ev & select.POLLERR for _, ev in p.poll(0))


def _closed_port() -> tuple:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    addr = s.getsockname()
    s.close()
    return addr


def test_an_icmp_error_leaves_no_pollerr_on_the_socket():
    """Sending to a closed port makes loopback answer ICMP port unreachable at once.
    With IP_RECVERR left on, that error would sit in the socket's error queue and the
    event loop would see POLLERR (and uvloop 0.23 crash reading it: next test)."""
    tx = sockopts.udp_socket("127.0.0.1", 0, 34)
    rows = np.zeros((8, 512), np.uint8)
    sender = BatchSender(tx)
    dead = _closed_port()
    for _ in range(3):
        sender.send(rows, dead)
    assert not _pollerr(tx)
    assert tx.getsockopt(socket.IPPROTO_IP, sockopts.IP_RECVERR) == 0
    tx.close()


CRASH_SCRIPT = r"""
import asyncio, socket, sys
import numpy as np, uvloop
from dgt.transport import sockopts
from dgt.transport.udp_batch import BatchSender

async def main():
    loop = asyncio.get_running_loop()
    got = []
    class P(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr): got.append(len(data))
        def error_received(self, exc): pass
    s = sockopts.udp_socket("127.0.0.1", 0, 34)
    tr, _ = await loop.create_datagram_endpoint(P, sock=s)
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dead.bind(("127.0.0.1", 0)); addr = dead.getsockname(); dead.close()
    sender = BatchSender(s)
    for _ in range(20):
        sender.send(np.zeros((4, 512), np.uint8), addr)
        await asyncio.sleep(0.005)
    sender.send(np.zeros((4, 512), np.uint8), s.getsockname())   # to ourselves
    await asyncio.sleep(0.05)
    tr.close()
    print("alive", len(got))

uvloop.run(main())
"""


def test_uvloop_survives_icmp_errors_for_its_udp_socket():
    """Regression: a sidecar whose peer had closed its port died of SIGSEGV inside
    uvloop (libuv's error-queue read hands uvloop a 4 GiB length). In a child process,
    because the failure mode is the interpreter dying."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", CRASH_SCRIPT], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.split() == ["alive", "4"], p.stdout


ENOBUFS_SCRIPT = r"""
import json, socket
import numpy as np
from dgt.transport import sockopts
from dgt.transport.udp_batch import BatchSender
s = sockopts.udp_socket("10.98.0.1", 0, 34)
sender = BatchSender(s, use_gso=False)
sent = sender.send(np.zeros((200, 1000), np.uint8), ("10.98.0.2", 9))
print(json.dumps({"sent": sent, "backoffs": sender.backoffs,
                  "recverr": s.getsockopt(socket.IPPROTO_IP, sockopts.IP_RECVERR)}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, veth, tc)")
def test_a_full_egress_qdisc_is_backpressure_not_silent_loss(veth):
    """IP_RECVERR is on during the sends, so a datagram our own qdisc drops fails with
    ENOBUFS and the sender stops there (to retry later) instead of counting it sent.
    The qdisc: HTB at 8 kbit/s over a 4-packet pfifo, on a veth in the test's netns."""
    import json
    import subprocess
    import sys
    ns, dev = veth
    ip = ["ip", "-n", ns]
    subprocess.run(ip + ["addr", "add", "10.98.0.1/24", "dev", dev], check=True)
    mac = json.loads(subprocess.run(ip + ["-j", "link", "show", "vb"], check=True,
                                    capture_output=True, text=True).stdout)[0]["address"]
    subprocess.run(ip + ["neigh", "add", "10.98.0.2", "lladdr", mac, "dev", dev], check=True)
    tc = ["ip", "netns", "exec", ns, "tc"]
    subprocess.run(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                         "default", "1"], check=True)
    subprocess.run(tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                         "htb", "rate", "8kbit"], check=True)
    subprocess.run(tc + ["qdisc", "add", "dev", dev, "parent", "1:1", "pfifo", "limit",
                         "4"], check=True)
    p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", ENOBUFS_SCRIPT],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["backoffs"] == 1 and 0 < out["sent"] < 200, out
    assert out["recverr"] == 0, out
