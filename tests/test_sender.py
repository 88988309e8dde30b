"""The sans-IO push sender (transport.sender) driven by a script: a fake clock, a fake
kernel that takes or refuses datagrams, no socket and no sleep. Asserts the exact
messages (bytes), their order and times, tail markers, END counts, pacing and what a
refused send becomes."""
import numpy as np
import pytest

from dgt.scheduler.pacing import PortPacing
from dgt.transport import wire
from dgt.transport.counters import Counters
from dgt.transport.sender import (SEND_EARLY_S, TAIL_COPIES, PushSender, TcpFrame,
                                  UdpBatch, Unpaced, batch_rows)
from dgt.transport.wire import Flag, MsgType

SESSION, KEY = 0x1234_5678_9ABC_DEF0, None
ELEMS = 4000                               # 16,000 B blocks: 4 datagrams per GSO batch
DGRAM = wire.HEADER_BYTES + 4 * ELEMS      # 16,034 B
RANGES = [(0, 4), (4, 8), (8, 12)]         # 3 shards of 4 blocks


def _blocks(n=12):
    return np.arange(n * ELEMS, dtype=np.float32).reshape(n, ELEMS)


def _sender(pacing=None, key=KEY, rank=0):
    return PushSender(session=SESSION, rank=rank, key=key, counters=Counters(),
                      pacing=pacing or Unpaced())


def drive(sender, kernel=None, backlog=lambda s: 0, now=0.0, limit=10_000):
    """Run the push to END as an adapter would, jumping the fake clock to each timer.
    ``kernel(batch, now)``: datagrams taken (default all). Returns [(time, message,
    datagrams taken or None)]."""
    log = []
    for _ in range(limit):
        if sender.done:
            return log
        for out in sender.datagrams_to_send(now, backlog):
            if isinstance(out, TcpFrame):
                log.append((now, out, None))
            else:
                n = kernel(out, now) if kernel else len(out.rows)
                log.append((now, out, n))
                sender.sent(out, n, now)
        at = sender.get_timer()
        if at is not None and at > now:
            now = at
    raise AssertionError("the push did not end")


def _tail(shard, channel, count, t=7):
    frame = wire.encode(MsgType.END, session=SESSION, sender=0, shard=shard, iteration=t,
                        channel=channel, count=count, key=KEY)
    return frame * TAIL_COPIES


def test_one_push_is_the_exact_messages_in_order():
    """Reliable frames first, then each shard's bands best first, each band followed by
    its tail marker (twice), then END per shard with the counts per channel; the local
    shard's blocks are counted, never sent; dropped blocks are counted as unsent."""
    chan = np.array([0, 1, 2, -1,  0, 1, 1, 2,  0, 0, -1, 1], np.int8)
    blocks = _blocks()
    s = _sender()
    frames = s.start(7, chan, blocks, RANGES, local=0, now=0.0)
    assert [(f.shard, f.kind) for f in frames] == [(1, "blocks"), (2, "blocks")]
    for f, idx in zip(frames, ([4], [8, 9])):
        idx = np.array(idx)
        assert b"".join(bytes(p) for p in f.frame) == wire.encode(
            MsgType.BLOCKS, session=SESSION, sender=0, shard=f.shard, iteration=7,
            channel=0, block=int(idx[0]), count=idx.size, flags=Flag.INDEXED, key=KEY,
            payload=wire.pack_indexed_blocks(idx, blocks[idx]))
    log = drive(s)

    def dgrams(shard, c, idx):
        return wire.encode_block_datagrams(session=SESSION, sender=0, shard=shard,
                                           iteration=7, channel=c, indices=np.array(idx),
                                           blocks=blocks[idx]).tobytes()

    got = [(type(m).__name__, m.shard, getattr(m, "channel", 0), getattr(m, "tail", False),
            m.rows.tobytes() if isinstance(m, UdpBatch) else bytes(m.frame))
           for _, m, _ in log]
    end = {sh: wire.encode(MsgType.END, session=SESSION, sender=0, shard=sh, iteration=7,
                           count=sum(c), payload=wire.pack_end(c + [0] * (8 - len(c))),
                           key=KEY)
           for sh, c in ((1, [1, 2, 1]), (2, [2, 1]))}
    assert got == [
        ("UdpBatch", 1, 1, False, dgrams(1, 1, [5, 6])),   # shard rank+1 first
        ("UdpBatch", 2, 1, False, dgrams(2, 1, [11])),
        ("UdpBatch", 1, 1, True, _tail(1, 1, 2)),
        ("UdpBatch", 2, 1, True, _tail(2, 1, 1)),
        ("UdpBatch", 1, 2, False, dgrams(1, 2, [7])),
        ("UdpBatch", 1, 2, True, _tail(1, 2, 1)),
        ("TcpFrame", 1, 0, False, end[1]),
        ("TcpFrame", 2, 0, False, end[2]),
    ]
    assert all(t == 0.0 for t, *_ in log)   # not paced: all at once
    ctr = s.counters
    assert ctr.blocks_local == 3 and ctr.blocks_unsent == 2
    assert ctr.tail_markers == 3 * TAIL_COPIES
    assert [ctr.channels[c].blocks_sent for c in range(4)] == [3, 3, 1, 0]
    assert ctr.channels[1].bytes_sent == 3 * DGRAM
    assert s.done and s.get_timer() is None


def test_synthetic_job_without_a_local_shard_sends_to_itself_last():
    chan = np.zeros(12, np.int8)
    s = _sender(rank=1)
    frames = s.start(0, chan, _blocks(), RANGES, local=None, now=0.0)
    assert [f.shard for f in frames] == [0, 1, 2]
    log = drive(s)
    assert [(m.shard, m.kind) for _, m, _ in log] == [(0, "end"), (1, "end"), (2, "end")]
    assert s.counters.blocks_local == 0 and s.counters.channels[0].blocks_sent == 12


def test_batches_are_gso_sized_and_paced_at_the_share_per_node():
    """10 blocks on channel 1 to each of 2 peers at 100 Mbit/s: batches of
    batch_rows(16,034 B) = 4 datagrams, each peer's bucket starting with one batch, then
    one batch per batch time at that peer's share; the two peers go side by side."""
    n = 40
    ranges = [(0, 0), (0, 20), (20, 40)]
    chan = np.ones(n, np.int8)
    p = PortPacing(100.0, [1, 2], 2, 2 * 65536, 128 * 1024, now=0.0)
    s = _sender(p)
    assert batch_rows(DGRAM) == 4
    s.start(0, chan, _blocks(n), ranges, local=0, now=0.0)
    log = drive(s, now=1.0)
    for shard in (1, 2):
        times = [t for t, m, _ in log if isinstance(m, UdpBatch) and m.shard == shard
                 and not m.tail]
        sizes = [len(m.rows) for t, m, _ in log if isinstance(m, UdpBatch)
                 and m.shard == shard and not m.tail]
        assert sizes == [4, 4, 4, 4, 4]
        gaps = np.diff(times)
        assert times[0] == 1.0
        np.testing.assert_allclose(gaps, 4 * DGRAM / p.share)
    kinds = [m.shard for _, m, _ in log if isinstance(m, UdpBatch) and not m.tail]
    assert kinds[:2] == [1, 2]   # interleaved from the start


def test_udp_waits_for_the_tcp_backlog_but_not_forever():
    """Shard 2's TCP never drains (a peer that stopped reading): its UDP waits, but only
    until twice the drain time + 1 s (then one batch time: no tokens saved up); shard 1's goes at once; nothing lost or repeated."""
    ranges = [(0, 0), (0, 8), (8, 16)]
    p = PortPacing(100.0, [1, 2], 2, 2 * 65536, 128 * 1024, now=0.0)
    s = _sender(p)
    s.start(0, np.ones(16, np.int8), _blocks(16), ranges, local=0, now=0.0)
    backlog = 4 * 128 * 1024
    log = drive(s, backlog=lambda sh: backlog if sh == 2 else 0)
    first = {sh: min(t for t, m, _ in log if isinstance(m, UdpBatch) and m.shard == sh)
             for sh in (1, 2)}
    assert first[1] == 0.0
    # at the give-up time its bucket is empty (the share was the TCP's until then): the
    # first batch goes one batch time later
    assert first[2] == pytest.approx(2 * backlog / p.share + 1.0 + 4 * DGRAM / p.share)
    for sh in (1, 2):
        assert sum(len(m.rows) for _, m, _ in log if isinstance(m, UdpBatch)
                   and m.shard == sh and not m.tail) == 8
    assert isinstance(log[-1][1], TcpFrame)


def test_a_partial_send_is_retried_from_the_first_refused_datagram():
    """The kernel takes 1 of 4 datagrams (EAGAIN on the rest): the other 3 go again after
    half a batch's time at the share, and nothing is dropped."""
    ranges = [(0, 0), (0, 4), (4, 4)]
    p = PortPacing(100.0, [1, 2], 2, 2 * 65536, 128 * 1024, now=0.0)
    s = _sender(p)
    blocks = _blocks(4)
    s.start(0, np.ones(4, np.int8), blocks, ranges, local=0, now=0.0)
    calls = []

    def kernel(batch, now):
        calls.append((now, batch.rows.tobytes()))
        return 1 if len(calls) == 1 else len(batch.rows)

    drive(s, kernel)
    whole = wire.encode_block_datagrams(session=SESSION, sender=0, shard=1, iteration=0,
                                        channel=1, indices=np.arange(4), blocks=blocks)
    assert calls[0] == (0.0, whole.tobytes())
    assert calls[1][1] == whole[1:].tobytes()
    assert calls[1][0] == pytest.approx(s.retry_after(DGRAM))
    assert s.counters.channels[1].blocks_dropped_local == 0
    assert s.counts[1, 1] == 4


def test_a_band_the_kernel_keeps_refusing_is_dropped_and_taken_out_of_end():
    """Band 2 to shard 1 is refused for good (a starved scavenger queue): after
    refused_budget its rest is counted as dropped here and removed from its tail marker
    and END; every other band goes out whole."""
    ranges = [(0, 0), (0, 12), (12, 24)]
    chan = np.array([1] * 6 + [2] * 6 + [1] * 6 + [2] * 6, np.int8)
    p = PortPacing(100.0, [1, 2], 2, 2 * 65536, 128 * 1024, now=0.0)
    s = _sender(p)
    s.start(3, chan, _blocks(24), ranges, local=0, now=0.0)
    refused = []

    def kernel(batch, now):
        if (batch.shard, batch.channel) == (1, 2):
            refused.append(now)
            return 0
        return len(batch.rows)

    log = drive(s, kernel)
    assert refused[-1] - refused[0] >= s.refused_budget(DGRAM)
    ch2 = s.counters.channels[2]
    assert ch2.blocks_dropped_local == 6 and ch2.blocks_sent == 6
    assert ch2.bytes_sent == 6 * DGRAM
    markers = [(m.shard, m.channel, wire.decode(m.rows[0].tobytes())[0].count)
               for _, m, _ in log if isinstance(m, UdpBatch) and m.tail]
    assert sorted(markers) == [(1, 1, 6), (1, 2, 0), (2, 1, 6), (2, 2, 6)]
    ends = {m.shard: wire.unpack_end(wire.decode(bytes(m.frame))[1]).tolist()
            for _, m, _ in log if isinstance(m, TcpFrame)}
    assert ends == {1: [0, 6, 0, 0, 0, 0, 0, 0], 2: [0, 6, 6, 0, 0, 0, 0, 0]}


def test_refused_tail_markers_are_counted_as_not_sent_and_not_retried():
    ranges = [(0, 0), (0, 2)]
    s = _sender()
    s.start(0, np.ones(2, np.int8), _blocks(2), ranges, local=0, now=0.0)
    log = drive(s, lambda b, now: 0 if b.tail else len(b.rows))
    assert sum(1 for _, m, _ in log if isinstance(m, UdpBatch) and m.tail) == 1
    assert s.counters.tail_markers == 0


def test_a_push_starts_only_after_the_last_one_sent_its_end():
    s = _sender()
    s.start(0, np.ones(12, np.int8), _blocks(), RANGES, local=0, now=0.0)
    with pytest.raises(RuntimeError, match="before push 0 sent its END"):
        s.start(1, np.ones(12, np.int8), _blocks(), RANGES, local=0, now=0.0)
    drive(s)
    s.start(1, np.ones(12, np.int8), _blocks(), RANGES, local=0, now=0.0)
    assert not s.done


def test_every_datagram_carries_the_mac_when_keyed():
    key = b"k" * 32
    s = _sender(key=key)
    s.start(0, np.array([0, 1] * 6, np.int8), _blocks(), RANGES, local=0, now=0.0)
    for _, m, _ in drive(s):
        for row in (m.rows if isinstance(m, UdpBatch) else [bytes(m.frame)]):
            h, _ = wire.decode(bytes(row), key)   # raises WireError on a bad MAC
            assert h.flags & Flag.MAC


def test_a_batch_due_within_send_early_s_goes_now():
    ranges = [(0, 0), (0, 8)]
    p = PortPacing(100.0, [1], 1, 4 * DGRAM, 128 * 1024, now=0.0)
    s = _sender(p)
    s.start(0, np.ones(8, np.int8), _blocks(8), ranges, local=0, now=0.0)
    first = s.datagrams_to_send(0.0, lambda sh: 0)
    s.sent(first[0], 4, 0.0)
    due = s.get_timer()
    assert due == 0.0   # now: the next batch is charged on the next call
    assert s.datagrams_to_send(0.0, lambda sh: 0) == []
    at = s.get_timer()
    assert at > SEND_EARLY_S
    assert [len(b.rows) for b in s.datagrams_to_send(at - SEND_EARLY_S / 2,
                                                     lambda sh: 0)] == [4]


def test_the_other_messages_decode_to_what_was_asked():
    from dgt.transport import messages
    key = b"k" * 16
    h, p = wire.decode(messages.hello(SESSION, 2, 1, key), key)
    assert (h.type, h.sender, h.shard, h.session, len(p)) == (MsgType.HELLO, 2, 1, SESSION, 0)
    h, _ = wire.decode(messages.bye(SESSION, 2, 17, None))
    assert (h.type, h.sender, h.count) == (MsgType.BYE, 2, 17)
    h, p = wire.decode(messages.error(SESSION, 0, None, "x" * 2000, None))
    assert (h.type, h.block, bytes(p)) == (MsgType.ERROR, messages.NO_RANK, b"x" * 1000)
    agg = np.arange(3 * 4, dtype=np.float32)
    got = np.array([True, False, True])
    frame = b"".join(bytes(x) for x in messages.pull(SESSION, 1, 9, 6, agg, got, key))
    h, p = wire.decode(frame, key)
    assert (h.type, h.sender, h.shard, h.iteration, h.block, h.count) == \
        (MsgType.PULL, 1, 1, 9, 6, 3)
    a, r = wire.unpack_pull(p, 3, 4)
    np.testing.assert_array_equal(a, agg)
    np.testing.assert_array_equal(r, got)


def test_synth_and_the_goodput_sender_encode_no_message_of_their_own():
    """The tools push through PushSender and transport.messages: no wire encoder is
    called in tools/synth.py, nor in the goodput tool's send()."""
    import ast
    from pathlib import Path
    tools = Path(__file__).resolve().parents[1] / "tools"
    encoders = {"encode", "encode_parts", "encode_block_datagrams", "pack_end",
                "pack_indexed_blocks", "indexed_blocks_parts", "pack_pull", "pull_parts"}

    def calls(node):
        return sorted({n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call)
                       and isinstance(n.func, ast.Attribute) and n.func.attr in encoders})

    assert calls(ast.parse((tools / "synth.py").read_text())) == []
    goodput = ast.parse((tools / "goodput.py").read_text())
    send = next(n for n in goodput.body if isinstance(n, ast.AsyncFunctionDef)
                and n.name == "send")
    assert calls(send) == []


def test_a_push_in_parts_sends_each_part_at_once_and_ends_after_finish():
    """begin/add/finish (wait-free backpropagation, dgt.parts): each part's reliable
    frame comes back from add and its UDP blocks go at once; while no part is pending
    the timer is +inf and neither tail marker nor END goes; finish sends each channel's
    tail marker once, after its last block, then END with every part's counts."""
    blocks = _blocks()
    s = _sender()
    s.begin(7, RANGES, local=0)
    assert s.get_timer() == float("inf") and not s.datagrams_to_send(0.0, lambda _: 0)
    # part 1: blocks 8..11 (shard 2): 8 reliable, 9 and 10 on channel 1, 11 on channel 2
    frames = s.add(np.array([8, 9, 10, 11]), np.array([0, 1, 1, 2], np.int8), blocks)
    assert [(f.shard, f.kind) for f in frames] == [(2, "blocks")]
    log = drive_until_idle(s)
    assert [(m.shard, m.channel, m.tail) for m in log] == [(2, 1, False), (2, 2, False)]
    assert s.get_timer() == float("inf") and not s.done
    # part 2: blocks 0..7: shard 0 is local (counted, not sent); shard 1 and 2 get more
    frames = s.add(np.arange(8), np.array([0, 1, 2, -1, 1, 0, 1, 2], np.int8), blocks)
    assert [(f.shard, f.kind) for f in frames] == [(1, "blocks")]
    log = drive_until_idle(s)
    assert [(m.shard, m.channel, m.tail) for m in log] == [(1, 1, False), (1, 2, False)]
    s.finish()
    log = drive(s)
    kinds = [(m.shard, getattr(m, "channel", 0), getattr(m, "tail", False),
              getattr(m, "kind", None)) for _, m, _ in log]
    # every channel already through: its tail marker at once (shard 2 first: rank 0's
    # streams start at rank + 1), then END per remote shard
    assert kinds == [(1, 1, True, None), (1, 2, True, None), (2, 1, True, None),
                     (2, 2, True, None), (1, 0, False, "end"), (2, 0, False, "end")] or \
        kinds == [(2, 1, True, None), (2, 2, True, None), (1, 1, True, None),
                  (1, 2, True, None), (1, 0, False, "end"), (2, 0, False, "end")]
    ends = {m.shard: wire.unpack_end(wire.decode(bytes(m.frame))[1])
            for _, m, _ in log if isinstance(m, TcpFrame)}
    assert list(ends[1][:3]) == [1, 2, 1] and list(ends[2][:3]) == [1, 2, 1]
    assert s.done and s.counters.blocks_local == 3 and s.counters.blocks_unsent == 1


def test_a_part_added_while_its_band_is_pending_defers_the_tail_marker():
    """A channel's tail marker waits for its last block: blocks of channel 1 added by
    a later part keep channel 1's marker back until they are sent."""
    blocks = _blocks()
    s = _sender()
    s.begin(3, RANGES, local=0)
    s.add(np.array([4]), np.array([1], np.int8), blocks)
    s.add(np.array([5]), np.array([1], np.int8), blocks)
    s.finish()
    log = [m for _, m, _ in drive(s)]
    assert [(m.channel, m.tail, m.rows.shape[0]) for m in log if isinstance(m, UdpBatch)] \
        == [(1, False, 1), (1, False, 1), (1, True, TAIL_COPIES)]
    ends = {m.shard: wire.decode(bytes(m.frame)) for m in log if isinstance(m, TcpFrame)}
    h, payload = ends[1]
    assert h.type == MsgType.END and list(wire.unpack_end(payload)[:2]) == [0, 2]


def drive_until_idle(sender, now=0.0):
    """Send what is due until the sender waits for more blocks; the UDP batches."""
    out = []
    while sender.get_timer() != float("inf"):
        for m in sender.datagrams_to_send(now, lambda _: 0):
            assert isinstance(m, UdpBatch)
            out.append(m)
            sender.sent(m, len(m.rows), now)
        now = max(now, sender.get_timer())
    return out


def test_a_coded_band_sends_the_payloads_it_is_given_with_its_coding():
    """``coded``: the band's payloads (coded by the worker) go out as they are, each
    datagram naming the coding in its flags and sized by it; the other bands stay f32,
    and the byte counters count the coded datagrams."""
    chan = np.array([0, 1, 2, 2] * 3, np.int8)
    blocks = _blocks()
    idx = np.flatnonzero(chan == 2)
    idx = idx[idx >= 4]                            # shard 0 is local: never coded
    p = wire.coded_payload_bytes(wire.Coding.INT8, ELEMS)
    payloads = (np.arange(idx.size * p) % 251).astype(np.uint8).reshape(idx.size, p)
    s = _sender()
    s.start(7, chan, blocks, RANGES, 0, 0.0,
            coded={2: (wire.Coding.INT8, idx, payloads)})
    log = drive(s)
    sent = {(m.shard, m.channel): m.rows for _, m, _ in log
            if isinstance(m, UdpBatch) and not m.tail}
    for shard in (1, 2):
        rows = sent[shard, 2]
        assert rows.shape == (2, wire.HEADER_BYTES + p)
        for r, i in zip(rows, np.flatnonzero(chan[RANGES[shard][0]:RANGES[shard][1]] == 2)):
            h, payload = wire.decode(r.tobytes())
            blk = RANGES[shard][0] + i
            assert (h.block, wire.coding_of(h.flags)) == (blk, wire.Coding.INT8)
            assert bytes(payload) == payloads[np.searchsorted(idx, blk)].tobytes()
        f32 = sent[shard, 1]
        assert f32.shape == (1, DGRAM) and wire.coding_of(f32[0, 5]) == wire.Coding.FP32
    assert s.counters.channels[2].bytes_sent == 4 * (wire.HEADER_BYTES + p)
    assert s.counters.channels[1].bytes_sent == 2 * DGRAM
