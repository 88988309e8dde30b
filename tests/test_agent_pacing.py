"""The worker agent's UDP scheduler on a paced port, with scripted links (no sockets):
who goes when, and that a peer whose TCP never drains cannot stall a push."""
import asyncio

import numpy as np

from dgt.agent import TCP_BACKLOG_SLACK, Links, WorkerAgent
from dgt.config import TransmissionConfig
from dgt.layout import BlockLayout
from dgt.transport import wire
from dgt.transport.counters import Counters


def _agent(links, pace_mbit=100.0, world=3):
    cfg = TransmissionConfig(block_bytes=64, pace_mbit=pace_mbit)
    lay = BlockLayout.from_bytes(4000, cfg.block_bytes, world)
    z = np.zeros(lay.padded, np.float32)
    return WorkerAgent(cfg, lay, 0, 1, None, z, z.copy(), links, Counters())


def _streams(rows_per_channel):
    """Node 1 and node 2, channels 1 and 2, ``rows_per_channel`` 100 B datagrams each;
    row j of (node, channel) is filled with a tag so the order can be read back."""
    return [(s, [(c, np.full((rows_per_channel, 100), 10 * s + c, np.uint8))
                 for c in (1, 2)]) for s in (1, 2)]


def test_each_node_gets_its_channels_in_order_and_every_row_once():
    sent = []

    def send_udp(c, s, rows):
        sent.append((s, c, int(rows[0, 0]), len(rows)))
        return len(rows)

    agent = _agent(Links(send_tcp=None, send_udp=send_udp, local_push=None), pace_mbit=0)
    asyncio.run(agent._send_paced(_streams(1500)))
    for s in (1, 2):
        mine = [(c, tag, n) for node, c, tag, n in sent if node == s]
        assert sum(n for c, _, n in mine if c == 1) == 1500
        assert sum(n for c, _, n in mine if c == 2) == 1500
        chans = [c for c, _, _ in mine]
        assert chans == sorted(chans)              # band 1 entirely before band 2
        assert all(tag == 10 * s + c for c, tag, _ in mine)
    assert {s for s, *_ in sent[:2]} == {1, 2}    # the nodes interleave from the start


def test_udp_waits_for_tcp_backlog_but_not_forever():
    """Node 2's TCP never drains (a peer that stopped reading): its UDP still goes
    after the bounded wait, node 1's goes at once, nothing is lost or repeated."""
    sent = []
    order = []

    def send_udp(c, s, rows):
        sent.append((s, len(rows)))
        order.append(s)
        return len(rows)

    links = Links(send_tcp=None, send_udp=send_udp, local_push=None,
                  tcp_backlog=lambda s: 4 * TCP_BACKLOG_SLACK if s == 2 else 0)
    agent = _agent(links, pace_mbit=100.0)
    asyncio.run(asyncio.wait_for(agent._send_paced(_streams(50)), 60))
    assert sum(n for s, n in sent if s == 1) == 100
    assert sum(n for s, n in sent if s == 2) == 100
    assert order.index(2) > order.index(1) and order[-1] == 2


def test_a_band_our_own_queue_keeps_refusing_is_dropped_and_taken_out_of_end():
    """Band 2 to node 1 is refused for good (a starved scavenger queue under bulk
    best-effort traffic): the push still ends, band 2's rest is counted as dropped here
    and removed from the END counts; every other band goes out whole, and then its tail
    marker with the count the END will carry."""
    sent, markers = [], []

    def send_udp(c, s, rows):
        if (s, c) == (1, 2):
            return 0               # ENOBUFS, every time
        if rows.shape[1] != 100:   # a tail marker: END on that channel
            h, payload = wire.decode(rows[0].tobytes())
            assert len(rows) == 2 and rows[0].tobytes() == rows[1].tobytes() and not payload
            # after the band's last block: all of them are in `sent` already
            assert h.count == sum(n for s2, c2, n in sent if (s2, c2) == (s, c))
            markers.append((s, c, h.type, h.channel, h.shard, h.count))
            return 2
        sent.append((s, c, len(rows)))
        return len(rows)

    agent = _agent(Links(send_tcp=None, send_udp=send_udp, local_push=None),
                   pace_mbit=100.0)
    counts = np.zeros((3, 8), np.int64)
    counts[1, 1] = counts[1, 2] = counts[2, 1] = counts[2, 2] = 300
    for c in (1, 2):
        agent.counters.channels[c].blocks_sent = 600
    asyncio.run(asyncio.wait_for(agent._send_paced(_streams(300), counts), 60))
    assert sum(n for s, c, n in sent if (s, c) == (1, 1)) == 300
    assert sum(n for s, c, n in sent if s == 2) == 600
    assert counts[1, 2] == 0 and counts[1, 1] == counts[2, 2] == 300
    ch2 = agent.counters.channels[2]
    assert ch2.blocks_dropped_local == 300 and ch2.blocks_sent == 300
    END = wire.MsgType.END
    assert sorted(markers) == [(1, 1, END, 1, 1, 300), (2, 1, END, 1, 2, 300),
                               (2, 2, END, 2, 2, 300)]   # (1, 2)'s was refused too
    assert agent.counters.tail_markers == 6   # two copies each
