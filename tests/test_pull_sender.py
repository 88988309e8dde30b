"""dgt.pull_sender.PullSender over real loopback sockets: on a paced port a shard's PULL
to a worker waits while our push connection to that worker still has unsent bytes
(scheduler.pacing.HeldPulls), and goes, whole, once that push has left.

The end-to-end job (tests/test_train_e2e.py) checks that held PULLs all arrive; whether
a PULL gets held there depends on timing. Here the push is made to wait for sure: the
worker's end of our push connection stops reading, so its unsent bytes stay far above
TCP_BACKLOG_SLACK until the test lets it read.
"""
import asyncio

import numpy as np

from dgt.agent import TCP_BACKLOG_SLACK
from dgt.config import TransmissionConfig
from dgt.layout import BlockLayout
from dgt.peer_links import PeerLinks
from dgt.pull_sender import PullSender
from dgt.transport import wire
from dgt.transport.channels import channel_dscp
from dgt.transport.aio import FrameProtocol

SESSION, SHARD, WORKER, ITERATION = 7, 0, 1, 5


def _quiet(**kw) -> FrameProtocol:
    return FrameProtocol(lambda *a: None, lambda *a: None, lambda *a: None, **kw)


async def _accepted(loop, make):
    """A listening server whose accepted protocol (made by ``make``) is returned once
    connected, with the client's end."""
    got: list[FrameProtocol] = []

    def on_accept():
        got.append(make())
        return got[-1]

    server = await loop.create_server(on_accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, client = await loop.create_connection(_quiet, "127.0.0.1", port)
    while not got or got[0].transport is None:
        await asyncio.sleep(0.01)
    return server, client, got[0]


async def _held_then_sent(pace_mbit: float):
    loop = asyncio.get_running_loop()
    layout = BlockLayout.from_bytes(352 * 2 * 8, 1408, 2)       # 8 blocks per shard
    links = PeerLinks(TransmissionConfig(pace_mbit=pace_mbit), SHARD, 2, list(channel_dscp(3)),
                      None)
    # our push connection to the worker's shard: its far end does not read yet
    push_server, push_conn, push_sink = await _accepted(loop, _quiet)
    push_sink.transport.pause_reading()
    links.out_conns[WORKER] = push_conn
    push_conn.send(bytes(16 << 20))   # 16 MiB: far more than the kernel buffers take
    # the connection the worker dialled to us, on which its PULLs go; the worker reads
    pulls: list[tuple] = []

    def on_pull(proto, header, payload, now):
        pulls.append((header, bytes(payload)))

    pull_server, pull_conn, _ = await _accepted(
        loop, lambda: FrameProtocol(on_pull, lambda *a: None, lambda *a: None))
    sender = PullSender(session=SESSION, rank=SHARD, key=None, layout=layout,
                        pace_mbit=pace_mbit, links=links, conn_of=lambda w: pull_conn,
                        sending=lambda: False, iteration=lambda: ITERATION)
    backlog_at_send = links.tcp_backlog(WORKER)
    aggregate = np.arange(8 * 352, dtype=np.float32)
    received = np.ones(8, bool)
    sender.send(pull_conn, WORKER, ITERATION, aggregate, received)
    held_at_send = sender.held
    await asyncio.sleep(0.2)
    arrived_while_held = len(pulls)
    push_sink.transport.resume_reading()      # the push leaves; the PULL follows it
    for _ in range(3000):                     # a bound, not a timing assert: 30 s
        if pulls:
            break
        await asyncio.sleep(0.01)
    sender.close()
    for c in (push_conn, pull_conn):
        c.transport.close()
    push_server.close()
    pull_server.close()
    return backlog_at_send, held_at_send, arrived_while_held, pulls


def test_a_pull_waits_for_the_push_to_its_worker_and_then_goes_whole():
    backlog, held, early, pulls = asyncio.run(_held_then_sent(pace_mbit=400.0))
    assert backlog > TCP_BACKLOG_SLACK
    assert held == 1 and early == 0
    assert len(pulls) == 1
    header, payload = pulls[0]
    assert header.type == wire.MsgType.PULL and header.iteration == ITERATION
    agg, received = wire.unpack_pull(memoryview(payload), 8, 352)
    assert np.array_equal(agg, np.arange(8 * 352, dtype=np.float32)) and received.all()


def test_an_unpaced_port_sends_the_pull_at_once():
    """The same push backlog without pacing (--pace-mbit 0): nothing is held."""
    backlog, held, early, pulls = asyncio.run(_held_then_sent(pace_mbit=0.0))
    assert backlog > TCP_BACKLOG_SLACK
    assert held == 0 and early == 1 and len(pulls) == 1
