"""The sans-IO shard session driven by scripted packet sequences (no sockets)."""
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dgt.transport import wire
from dgt.transport.session import (BlocksArrived, IterationComplete, Rejected,
                                   ShardSession)
from dgt.transport.wire import Flag, MsgType

S = 0xABCDEF
ELEMS = 4
#: the shard the scripts' sessions own: shard 0 is valid for any worker count (a
#: session refuses a shard >= n_workers; many scripts have one worker)
SHARD = 0


def session(n_workers=3, lo=10, hi=20, deadline_s=0.05, key=None):
    return ShardSession(session=S, shard=SHARD, lo=lo, hi=hi, block_elems=ELEMS,
                        n_workers=n_workers, deadline_s=deadline_s, key=key)


def dgram(sender, block, it=0, ch=1, sess=S, shard=SHARD, val=1.0, key=None):
    return wire.encode(MsgType.BLOCKS, session=sess, sender=sender, shard=shard, iteration=it,
                       channel=ch, block=block, count=1,
                       payload=np.full(ELEMS, val, np.float32).tobytes(), key=key)


def tcp_blocks(sender, blocks, it=0):
    idx = np.array(blocks)
    data = np.tile(np.arange(len(blocks), dtype=np.float32)[:, None], (1, ELEMS))
    buf = wire.encode(MsgType.BLOCKS, session=S, sender=sender, shard=SHARD, iteration=it,
                      channel=0, block=blocks[0], count=len(blocks), flags=Flag.INDEXED,
                      payload=wire.pack_indexed_blocks(idx, data))
    return wire.decode(buf)


def end(sender, counts, it=0):
    return wire.decode(wire.encode(MsgType.END, session=S, sender=sender, shard=SHARD,
                                   iteration=it, count=sum(counts),
                                   payload=wire.pack_end(counts)))


def kinds(events):
    return [type(e).__name__ for e in events]


def test_complete_when_every_counted_block_arrived():
    s = session(n_workers=1)
    ev = s.receive_frame(*tcp_blocks(0, [10, 11, 12]), now=0)
    assert kinds(ev) == ["BlocksArrived"] and ev[0].rows.tolist() == [0, 1, 2]
    assert s.receive_frame(*end(0, [3, 2]), now=0) == []     # 2 UDP blocks still due
    assert s.next_deadline() == pytest.approx(0.05)
    assert kinds(s.receive_datagram(dgram(0, 13), now=0.01)) == ["BlocksArrived"]
    ev = s.receive_datagram(dgram(0, 19), now=0.02)
    assert kinds(ev) == ["BlocksArrived", "WorkerFinalised", "IterationComplete"]
    fin = ev[1]
    assert fin.reason == "complete"
    assert fin.received.tolist() == [True] * 4 + [False] * 5 + [True]
    assert s.counters.channels[0].blocks_delivered == 3
    assert s.counters.channels[1].blocks_delivered == 2


def test_deadline_finalises_with_missing_blocks_and_counts_loss_and_late():
    s = session(n_workers=1)
    s.receive_datagram(dgram(0, 10, ch=2), now=0)
    s.receive_frame(*end(0, [0, 0, 3]), now=1.0)
    assert s.poll(1.01) == []
    ev = s.poll(1.05)
    assert kinds(ev) == ["WorkerFinalised", "IterationComplete"]
    assert ev[0].reason == "deadline" and ev[0].received.sum() == 1
    assert s.counters.channels[2].blocks_lost == 2
    ev = s.receive_datagram(dgram(0, 11, ch=2), now=1.1)   # same iteration, finalised
    assert ev == [Rejected("late")]
    s.advance()
    assert s.receive_datagram(dgram(0, 12, ch=2, it=0), now=1.2) == [Rejected("late")]
    assert s.counters.channels[2].blocks_late == 2


def test_iteration_completes_only_when_every_worker_is_final():
    s = session(n_workers=2)
    ev = s.deliver_local(0, 0, np.ones(10, bool), now=0)
    assert kinds(ev) == ["WorkerFinalised"]
    ev = s.receive_frame(*end(1, [0]), now=0)
    assert kinds(ev) == ["WorkerFinalised", "IterationComplete"]
    assert ev[-1] == IterationComplete(0)


@pytest.mark.parametrize("buf,reason", [
    (dgram(0, 10, sess=S + 1), "stray"),
    (dgram(0, 10, shard=2), "wrong_shard"),
    (dgram(7, 10), "bad_sender"),
    (dgram(0, 9), "bad_block"),
    (dgram(0, 20), "bad_block"),
    (dgram(0, 10, it=5), "future"),
    (dgram(0, 10, ch=0), "bad_udp_message"),
    (b"\x00" * 3, "short"),
    (dgram(0, 10)[:-4], "bad_length"),
])
def test_bad_datagrams_are_counted_and_dropped(buf, reason):
    s = session()
    assert s.receive_datagram(buf, now=0) == [Rejected(reason)]
    assert s.counters.rejected[reason] == 1
    assert not s.received.any()


def test_duplicate_block_is_dropped():
    s = session()
    s.receive_datagram(dgram(0, 10, val=1.0), now=0)
    assert s.receive_datagram(dgram(0, 10, val=2.0), now=0) == [Rejected("duplicate")]
    assert s.counters.channels[1].blocks_duplicate == 1


def test_bad_end_is_rejected():
    s = session()
    h, p = end(0, [1])
    assert s.receive_frame(h, p[:-1], now=0) == [Rejected("bad_length")]
    assert s.receive_frame(*end(0, [11]), now=0) == [Rejected("bad_end")]  # > shard size
    s.receive_frame(*end(0, [1]), now=0)
    assert s.receive_frame(*end(0, [1]), now=0) == [Rejected("bad_end")]    # twice


def test_mac_required_when_keyed():
    s = session(key=b"k")
    assert s.receive_datagram(dgram(0, 10), now=0) == [Rejected("no_mac")]
    assert kinds(s.receive_datagram(dgram(0, 10, key=b"k"), now=0)) == ["BlocksArrived"]
    assert s.receive_datagram(dgram(0, 11, key=b"x"), now=0) == [Rejected("bad_mac")]


def test_a_late_copy_of_a_block_that_arrived_is_a_duplicate_not_late():
    """A replay (with a valid MAC) of a block that arrived in its iteration, sent after
    that iteration closed, is counted as a duplicate and does not widen the adaptive
    deadline; a block of that iteration that never arrived is late. Alone and in a GRO
    run (an outside tester's replays of iteration t-1 showed as 95,462 late blocks and
    took the deadline from 50 to 1,000 ms)."""
    seen = []

    class Policy:
        def observe(self, spread_s, late=False):
            seen.append((spread_s, late))

        def deadline_s(self):
            return 0.05

    s = session(n_workers=1, key=b"k")
    s.deadline_policy = Policy()
    ev = s.receive_frame(*end(0, [0, 3]), now=0.0)
    for b in (10, 11, 12):
        ev += s.receive_datagram(dgram(0, b, key=b"k"), now=0.01)
    assert "IterationComplete" in kinds(ev)
    s.advance()
    seen.clear()
    assert s.receive_datagram(dgram(0, 10, key=b"k"), now=0.02) == [Rejected("duplicate")]
    run = b"".join(dgram(0, b, key=b"k") for b in (11, 12))
    assert s.receive_datagram(run, now=0.02) == [Rejected("duplicate")]
    mixed = b"".join(dgram(0, b, it=0, ch=c, key=b"k") for b, c in ((12, 1), (13, 2)))
    assert kinds(s.receive_datagram(mixed, now=0.02)) == ["Rejected", "Rejected"]
    ch = s.counters.channels
    assert ch[1].blocks_duplicate == 4 and ch[1].blocks_late == 0   # 10, 11, 12, 12
    assert ch[2].blocks_late == 1 and ch[2].blocks_duplicate == 0   # 13 never came
    assert [late for _, late in seen] == [True]   # only the really late one is observed
    assert s.receive_datagram(dgram(0, 14, key=b"k"), now=0.03) == [Rejected("late")]


def test_without_a_key_a_mac_flagged_datagram_is_refused_alone_and_in_a_run():
    """A job without a secret refuses a UDP datagram carrying the MAC flag, whether it
    comes alone or in a GRO run (it was accepted alone and refused in a run); a
    tail marker with the flag too."""
    s = session()
    one = dgram(0, 10, key=b"k")
    assert s.receive_datagram(one, now=0) == [Rejected("bad_udp_message")]
    run = b"".join(dgram(0, b, key=b"k") for b in (11, 12, 13))
    assert s.receive_datagram(run, now=0) == [Rejected("bad_udp_message")]
    mixed = b"".join(dgram(w, 14, key=b"k") for w in (0, 1, 2))   # headers differ
    assert s.receive_datagram(mixed, now=0) == [Rejected("bad_udp_message")]
    tail = wire.encode(MsgType.END, session=S, sender=0, shard=SHARD, iteration=0, channel=1,
                       count=2, key=b"k")
    assert s.receive_datagram(tail, now=0) == [Rejected("bad_udp_message")]
    assert s.counters.rejected["bad_udp_message"] == 1 + 3 + 3 + 1
    assert s.counters.channels[1].blocks_delivered == 0


def test_with_a_key_a_block_outside_the_shard_or_a_non_udp_kind_costs_no_hash():
    """The checks that need no key come before the MAC: a forgery (wrong key) of a
    block outside the shard's range is bad_block, one of a TCP kind bad_udp_message,
    never bad_mac; a real block of the range still needs its MAC."""
    s = session(key=b"k")
    assert s.receive_datagram(dgram(0, 25, key=b"x"), now=0) == [Rejected("bad_block")]
    assert s.receive_datagram(dgram(0, 10, ch=0, key=b"x"), now=0) == \
        [Rejected("bad_udp_message")]
    hello = wire.encode(MsgType.HELLO, session=S, sender=0, shard=SHARD, channel=1, key=b"x")
    assert s.receive_datagram(hello, now=0) == [Rejected("bad_udp_message")]
    assert s.receive_datagram(dgram(0, 10, key=b"x"), now=0) == [Rejected("bad_mac")]
    assert kinds(s.receive_datagram(dgram(0, 10, key=b"k"), now=0)) == ["BlocksArrived"]
    assert s.counters.rejected["bad_mac"] == 1


def test_replayed_sequence_is_deterministic():
    """Replaying one scripted packet sequence gives the same events and bitmaps."""
    script = [("d", dgram(0, 10)), ("d", dgram(1, 15, ch=3)), ("f", end(0, [0, 1])),
              ("d", dgram(2, 12, ch=2)), ("f", end(1, [0, 0, 0, 2])), ("f", end(2, [0, 0, 1]))]

    def run():
        s = session()
        out = []
        for t, (kind, m) in enumerate(script):
            ev = s.receive_datagram(m, t) if kind == "d" else s.receive_frame(*m, t)
            out += [(type(e).__name__, getattr(e, "sender", None)) for e in ev]
        out += [(type(e).__name__, getattr(e, "sender", None)) for e in s.poll(100)]
        return out, s.received.copy()

    a, b = run(), run()
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    assert ("IterationComplete", None) in a[0]


def _rows(sender, blocks, it=0, ch=1, key=None, sess=S, shard=SHARD):
    data = np.tile(np.array(blocks, np.float32)[:, None], (1, ELEMS)) + sender / 8
    rows = wire.encode_block_datagrams(session=sess, sender=sender, shard=shard,
                                       iteration=it, channel=ch or 1,
                                       indices=np.array(blocks), blocks=data, key=key)
    if ch == 0:   # forged (the encoder refuses channel 0, TCP's): the header's channel
        rows[:, 4] = 0   # byte; receivers refuse it by its shape, before any MAC
    return rows


@pytest.mark.parametrize("key", [None, b"k"])
def test_coalesced_datagrams_equal_one_by_one(key):
    """A GRO buffer (n equal-size datagrams back to back) gives the same state as the
    same datagrams one by one, including strays, duplicates and a short tail."""
    good = _rows(0, [10, 11, 12], key=key)
    other = _rows(1, [15, 16], ch=2, key=key)
    stray = _rows(0, [13], sess=S + 1, key=key)
    dup = _rows(0, [11], key=key)
    parts = [good, stray, other, dup]
    buf = b"".join(p.tobytes() for p in parts) + b"\x00" * 7  # junk tail
    a, b = session(key=key), session(key=key)
    ev = a.receive_datagram(buf, now=0)
    for p in parts:
        for row in p:
            b.receive_datagram(row.tobytes(), now=0)
    b.receive_datagram(b"\x00" * 7, now=0)
    assert np.array_equal(a.received, b.received)
    assert np.array_equal(a.per_channel, b.per_channel)
    assert a.counters.rejected == b.counters.rejected
    assert a.counters.rejected["stray"] == 1 and a.counters.rejected["short"] == 1
    for c in (1, 2):
        assert a.counters.channels[c] == b.counters.channels[c]
    assert a.counters.channels[1].blocks_duplicate == 1
    arrived = [e for e in ev if isinstance(e, BlocksArrived)]
    assert sorted(int(r) for e in arrived for r in np.atleast_1d(e.rows)) == [0, 1, 2, 5, 6]


def test_coalesced_late_and_completion():
    s = session(n_workers=1)
    s.receive_frame(*end(0, [0, 3]), now=0)
    ev = s.receive_datagram(_rows(0, [10, 11, 12]).tobytes(), now=0.01)
    assert kinds(ev)[-2:] == ["WorkerFinalised", "IterationComplete"]
    s.advance()
    ev = s.receive_datagram(_rows(0, [13, 14], it=0).tobytes(), now=0.02)
    assert Rejected("late") in ev and s.counters.channels[1].blocks_late == 2


run_spec = st.tuples(
    st.integers(0, 3),                     # sender (3 = not a worker)
    st.sampled_from([SHARD] * 3 + [2]),    # shard (2 = wrong shard)
    st.sampled_from([S, S, S, S + 1]),     # session (S + 1 = stray)
    st.sampled_from([0, 0, 0, 1]),         # iteration (1 = future)
    st.integers(0, 3),                     # channel (0 = reliable: not allowed on UDP)
    st.lists(st.integers(5, 24), min_size=1, max_size=12))  # blocks, some outside [10, 20)


@settings(max_examples=300, deadline=None)
@given(st.lists(run_spec, min_size=1, max_size=4), st.booleans())
@example(runs=[(0, SHARD, S, 0, 0, [5]), (0, SHARD, S, 0, 1, [10]),
                (0, SHARD, S, 0, 2, [10])],
         split=False)   # one row twice in a run: the first copy counts, as one by one
def test_any_gro_run_equals_one_by_one(runs, split):
    """GSO runs (equal headers but the block: the uniform fast path) and mixed runs (the
    general vectorised path) give exactly the state, counters and block data that the
    same datagrams give one by one: duplicates, strays, futures, late blocks of a
    finalised worker, bad senders, shards and blocks included."""
    parts = [_rows(w, blocks, it=it, ch=ch, sess=sess, shard=sh)
             for w, sh, sess, it, ch, blocks in runs]
    a, b = session(), session()
    for s in (a, b):   # worker 2 is final already: its blocks are late
        s.receive_frame(*end(2, [0, 0]), now=0)
    got_a, got_b = np.zeros((3, 10, ELEMS), np.float32), np.zeros((3, 10, ELEMS), np.float32)
    bufs = [p.tobytes() for p in parts] if split else [b"".join(p.tobytes() for p in parts)]
    for buf in bufs:
        for e in a.receive_datagram(buf, now=0):
            if isinstance(e, BlocksArrived):
                got_a[e.sender, e.rows] = e.data
    for p in parts:
        for row in p:
            for e in b.receive_datagram(row.tobytes(), now=0):
                if isinstance(e, BlocksArrived):
                    got_b[e.sender, e.rows] = e.data
    assert np.array_equal(a.received, b.received)
    assert np.array_equal(a.per_channel, b.per_channel)
    assert a.counters.rejected == b.counters.rejected
    for c in range(wire.MAX_CHANNELS):
        assert a.counters.channels[c] == b.counters.channels[c]
    assert np.array_equal(got_a, got_b)


def marker(sender, ch, count, it=0, sess=S, shard=SHARD, payload=b"", key=None):
    """A UDP channel's tail marker: END on channel ``ch`` after its last block."""
    return wire.encode(MsgType.END, session=sess, sender=sender, shard=shard, iteration=it,
                       channel=ch, count=count, payload=payload, key=key)


@pytest.mark.parametrize("marker_first", [False, True])
def test_a_tail_marker_finalises_a_worker_whose_blocks_were_lost(marker_first):
    """Block 12 of three on channel 1 is lost; once END and channel 1's marker are both
    in (either order), the worker is final: no deadline, the loss counted."""
    s = session(n_workers=1)
    for b in (10, 11):
        s.receive_datagram(dgram(0, b), now=0)
    first, second = ((lambda: s.receive_datagram(marker(0, 1, 3), now=0.01)),
                     (lambda: s.receive_frame(*end(0, [0, 3]), now=0.01)))
    if not marker_first:
        first, second = second, first
    assert first() == []
    ev = second()
    assert kinds(ev) == ["WorkerFinalised", "IterationComplete"]
    assert ev[0].reason == "tail" and ev[0].received.tolist() == [True] * 2 + [False] * 8
    assert s.next_deadline() is None
    assert s.counters.channels[1].blocks_lost == 1 and not s.counters.rejected


def test_every_short_channel_needs_its_marker_and_a_wrong_count_is_no_marker():
    s = session(n_workers=1)
    s.receive_datagram(dgram(0, 10, ch=1), now=0)
    s.receive_datagram(dgram(0, 11, ch=2), now=0)
    s.receive_frame(*end(0, [0, 2, 2]), now=0)            # one block lost on each channel
    assert s.receive_datagram(marker(0, 1, 2), now=0.001) == []
    assert s.receive_datagram(marker(0, 2, 1), now=0.002) == []   # END said 2: not the tail
    assert s.next_deadline() == pytest.approx(0.05)
    ev = s.poll(0.05)
    assert ev[0].reason == "deadline"
    assert s.counters.channels[1].blocks_lost == s.counters.channels[2].blocks_lost == 1


def test_a_marker_after_its_worker_is_final_is_ignored_quietly():
    """The clean case: every block came, END finalised the worker, the marker comes
    last; and a marker of a past iteration. Neither is an error."""
    s = session(n_workers=1)
    s.receive_datagram(dgram(0, 10), now=0)
    assert kinds(s.receive_frame(*end(0, [0, 1]), now=0))[0] == "WorkerFinalised"
    assert s.receive_datagram(marker(0, 1, 1), now=0.001) == []
    s.advance()
    assert s.receive_datagram(marker(0, 1, 1, it=0), now=0.002) == []
    assert not s.counters.rejected and s.next_deadline() is None


@pytest.mark.parametrize("buf,reason", [
    (marker(0, 1, 1, payload=b"x"), "bad_tail"),
    (marker(0, 1, 11), "bad_tail"),                       # more than the shard's blocks
    (marker(0, 1, 1, sess=S + 1), "stray"),
    (marker(0, 1, 1, shard=2), "wrong_shard"),
    (marker(9, 1, 1), "bad_sender"),
    (marker(0, 1, 1, it=3), "future"),
    (marker(0, 0, 1), "bad_udp_message"),                 # END on UDP names a UDP channel
])
def test_bad_tail_markers_are_counted_and_change_nothing(buf, reason):
    s = session(n_workers=1)
    s.receive_frame(*end(0, [0, 1]), now=0)
    assert s.receive_datagram(buf, now=0.001) == [Rejected(reason)]
    assert s.counters.rejected[reason] == 1
    assert (s.tail == -1).all() and s.next_deadline() == pytest.approx(0.05)


def test_a_marker_s_copy_is_ignored_and_a_contradicting_one_rejected():
    s = session(n_workers=2)
    assert s.receive_datagram(marker(0, 1, 2), now=0) == []
    assert s.receive_datagram(marker(0, 1, 2), now=0) == []       # the second copy
    assert s.receive_datagram(marker(0, 1, 1), now=0) == [Rejected("bad_tail")]
    assert s.tail[0, 1] == 2 and s.counters.rejected == {"bad_tail": 1}


def test_a_marker_at_the_end_of_a_gro_run_comes_after_the_run_s_blocks():
    """GRO appends a shorter last datagram to a run: the marker. Its blocks must count
    before it, or they would be late and the worker short of them."""
    s = session(n_workers=1)
    s.receive_frame(*end(0, [0, 3]), now=0)               # block 12 will be lost
    ev = s.receive_datagram(_rows(0, [10, 11]).tobytes() + marker(0, 1, 3), now=0.01)
    assert kinds(ev) == ["BlocksArrived", "WorkerFinalised", "IterationComplete"]
    assert ev[1].reason == "tail" and ev[1].received[:3].tolist() == [True, True, False]
    assert s.counters.channels[1].blocks_late == 0


def test_a_marker_and_its_copy_coalesced_by_gro_are_read_one_by_one():
    s = session(n_workers=1)
    s.receive_datagram(dgram(0, 10), now=0)
    s.receive_frame(*end(0, [0, 2]), now=0)
    ev = s.receive_datagram(marker(0, 1, 2) * 2, now=0.01)
    assert kinds(ev) == ["WorkerFinalised", "IterationComplete"] and ev[0].reason == "tail"
    assert not s.counters.rejected
    # the same length that is not a run of whole datagrams stays malformed
    assert s.receive_datagram(marker(0, 1, 2) + b"\x00" * 10, now=0.02) == \
        [Rejected("bad_length")]


@pytest.mark.parametrize("gro", [False, True])
def test_a_reliable_block_displaces_an_unreliable_copy_of_it(gro):
    """A forged (or stray) UDP copy of a block the worker sends over TCP came first: the
    TCP row still wins. The shard stores the TCP data, the UDP delivery is recounted as
    a duplicate on its channel, and the END accounting sees the block on TCP. (The UDP
    copy used to win and the reliable row was dropped as the duplicate.)"""
    from dgt.layout import BlockLayout
    from dgt.shard import ServerShard
    lay = BlockLayout.from_bytes(20 * ELEMS, ELEMS * 4, 2)
    # blocks [lo, hi) of the layout's shard 1; the session's shard number (SHARD) is
    # only what the scripts' headers carry
    s = ShardSession(session=S, shard=SHARD, lo=lay.shard_lo(1), hi=lay.shard_hi(1),
                     block_elems=ELEMS, n_workers=2, deadline_s=0.05)
    shard = ServerShard(lay, 1, s, lambda *a: None)
    lo = lay.shard_lo(1)
    forged = dgram(0, lo + 1, ch=2, val=666.0) + (dgram(0, lo + 3, ch=2, val=667.0)
                                                   if gro else b"")
    shard.handle(s.receive_datagram(forged, now=0))
    assert s.counters.channels[2].blocks_delivered == 1 + gro
    ev = s.receive_frame(*tcp_blocks(0, [lo, lo + 1, lo + 2]), now=0)
    shard.handle(ev)
    assert kinds(ev) == ["BlocksArrived"]
    assert ev[0].rows.tolist() == [0, 1, 2]
    assert shard.recv[0, :3, 0].tolist() == [0.0, 1.0, 2.0]   # the TCP data
    assert s.counters.channels[0].blocks_delivered == 3
    assert s.counters.channels[0].blocks_duplicate == 0
    assert s.counters.channels[2].blocks_delivered == gro
    assert s.counters.channels[2].blocks_duplicate == 1
    assert s.per_channel[0, :3].tolist() == [3, 0, gro]
    # and a later UDP copy of a TCP row is the duplicate, never the winner
    assert s.receive_datagram(dgram(0, lo + 2, ch=1, val=9.0), now=0) == \
        [Rejected("duplicate")]
    assert s.counters.channels[1].blocks_duplicate == 1
    # a TCP row sent twice is still a duplicate of itself
    ev = s.receive_frame(*tcp_blocks(0, [lo + 2, lo + 4]), now=0)
    assert kinds(ev) == ["Rejected", "BlocksArrived"] and ev[1].rows.tolist() == [4]
    assert s.counters.channels[0].blocks_duplicate == 1


@pytest.mark.parametrize("rows", [[10, 11, 10], [10, 10, 11], [13, 19, 19], [18, 12, 18]])
def test_a_tcp_frame_naming_a_block_twice_is_rejected(rows):
    s = session(n_workers=1)
    assert s.receive_frame(*tcp_blocks(0, rows), now=0) == [Rejected("bad_block")]
    assert not s.received.any()


def test_a_tcp_frame_of_distinct_blocks_in_any_order_is_taken():
    s = session(n_workers=1)
    ev = s.receive_frame(*tcp_blocks(0, [18, 12, 15]), now=0)
    assert [e.rows.tolist() for e in ev] == [[8, 2, 5]]   # shard rows (lo = 10)


def test_end_completes_the_reliable_channel_without_a_deadline():
    """TCP is in order and END follows the reliable blocks on the same connection: a
    reliable block that is not in when END is read (rejected) will not come, so END
    finalises at once, counting it lost, instead of waiting for the deadline."""
    s = session(n_workers=1)
    s.receive_frame(*tcp_blocks(0, [10]), now=0)
    s.receive_frame(*tcp_blocks(0, [11, 25]), now=0)          # rejected: block 25 not ours
    ev = s.receive_frame(*end(0, [2, 0]), now=0)
    assert kinds(ev) == ["WorkerFinalised", "IterationComplete"]
    assert ev[0].reason == "tail"
    assert s.counters.channels[0].blocks_lost == 1
    assert s.next_deadline() is None


@pytest.mark.parametrize("key", [None, b"k"])
def test_a_block_two_iterations_behind_is_stale_not_late(key):
    """One iteration behind is lateness (counted per channel); two or more is a replay
    or a datagram that sat out a whole iteration: rejected as 'stale', so a replay
    flood does not read as network lateness, one by one and in a GRO run alike."""
    s = session(n_workers=1, key=key)
    for _ in range(3):
        s.advance()                                   # current iteration: 3
    assert s.receive_datagram(dgram(0, 10, it=2, key=key), now=0) == [Rejected("late")]
    assert s.receive_datagram(dgram(0, 11, it=1, key=key), now=0) == [Rejected("stale")]
    run = b"".join(dgram(0, b, it=0, key=key) for b in (12, 13, 14))
    assert Rejected("stale") in s.receive_datagram(run, now=0)
    h, p = tcp_blocks(0, [15, 16], it=1)
    assert s.receive_frame(h, p, now=0) == [Rejected("stale")]
    assert s.counters.rejected["stale"] == 5
    assert s.counters.channels[1].blocks_late == 1 and not s.received.any()


def _run_iteration(s, it, late_at=None):
    """Worker 0 sends 2 UDP blocks + END at t = it; block 19 is lost, or arrives at
    ``late_at`` (after the deadline: late, one iteration on)."""
    t0 = float(it)
    s.receive_datagram(dgram(0, 13, it=it), now=t0)
    s.receive_frame(*end(0, [0, 2], it=it), now=t0 + 0.001)
    deadline = s.next_deadline()
    ev = s.poll(deadline)
    assert [e.reason for e in ev if type(e).__name__ == "WorkerFinalised"] == ["deadline"]
    s.advance()
    if late_at is not None:
        assert kinds(s.receive_datagram(dgram(0, 19, it=it), now=t0 + late_at)) == \
            ["Rejected"]
    return deadline - (t0 + 0.001)


def test_the_adaptive_deadline_learns_from_a_late_block_and_not_from_a_lost_one():
    from dgt.scheduler.deadline import AdaptiveDeadline
    policy = AdaptiveDeadline(floor_s=0.05, ceiling_s=1.0, margin=1.5, window=4)
    s = ShardSession(session=S, shard=SHARD, lo=10, hi=20, block_elems=ELEMS, n_workers=1,
                     deadline_s=0.05, deadline_policy=policy)
    # a block that never comes (real loss) leaves the deadline at its floor
    assert _run_iteration(s, 0) == pytest.approx(0.05)
    assert _run_iteration(s, 1, late_at=0.081) == pytest.approx(0.05)
    assert s.counters.channels[1].blocks_late == 1
    # the late block came 80 ms after END: the next wait is 1.5 x 80 ms
    assert _run_iteration(s, 2) == pytest.approx(0.12)
    for it in range(3, 7):   # complete iterations (spread 0) push it out of the window
        s.receive_frame(*end(0, [0, 0], it=it), now=float(it))
        s.advance()
    assert _run_iteration(s, 7) == pytest.approx(0.05)


def test_blocks_read_from_the_queue_at_a_deadline_count_and_teach_the_wait_nothing():
    """The sidecar's drain hands over, inside ``queued()``, what sat in this host's
    receive queue when a deadline came: those blocks complete the worker (not lost),
    but their read time is no arrival spread, so the next wait stays at the floor.
    Read the same way outside ``queued()``, the completion stretches it to 1.5 x."""
    from dgt.scheduler.deadline import AdaptiveDeadline

    def wait_after(drained: bool) -> float:
        policy = AdaptiveDeadline(floor_s=0.05, ceiling_s=1.0, margin=1.5, window=4)
        s = ShardSession(session=S, shard=SHARD, lo=10, hi=20, block_elems=ELEMS,
                         n_workers=1, deadline_s=0.05, deadline_policy=policy)
        s.receive_datagram(dgram(0, 13), now=0.0)
        s.receive_frame(*end(0, [0, 2]), now=0.001)
        due = s.next_deadline()
        if drained:
            with s.queued():
                ev = s.receive_datagram(dgram(0, 19), now=due + 0.02)
        else:
            ev = s.receive_datagram(dgram(0, 19), now=due + 0.02)
        fin = [e for e in ev if type(e).__name__ == "WorkerFinalised"]
        assert [e.reason for e in fin] == ["complete"] and fin[0].received.sum() == 2
        assert s.counters.channels[1].blocks_lost == 0
        return policy.deadline_s()   # the next iteration's wait after END
    assert wait_after(True) == pytest.approx(0.05)
    assert wait_after(False) == pytest.approx(1.5 * 0.07)   # read 70 ms after END


def test_the_adaptive_deadline_has_a_floor_and_a_ceiling():
    from dgt.scheduler.deadline import AdaptiveDeadline
    p = AdaptiveDeadline(floor_s=0.05, ceiling_s=0.2)
    assert p.deadline_s() == 0.05
    p.observe(0.01)
    assert p.deadline_s() == 0.05
    p.observe(5.0)
    assert p.deadline_s() == 0.2 and p.highest_s == 0.2
    p.observe(float("nan"))
    p.observe(-1.0)
    assert len(p.spreads) == 2 and p.beyond_floor == 1
    assert AdaptiveDeadline(floor_s=0.05, ceiling_s=0.0).deadline_s() == 0.05   # fixed


# -- coded bands (docs/wire.md, "Block codings") ------------------------------------------

def _coded(sender, blocks, coding, it=0, ch=1, key=None, flags_coding=None):
    """Datagrams of ``blocks`` coded as ``coding``; ``flags_coding`` forges the header's."""
    import torch
    from dgt import codec
    data = torch.tensor([[b + 0.1 * i + 1 / 3 for i in range(ELEMS)] for b in blocks],
                        dtype=torch.float32)
    rows = wire.encode_block_datagrams(
        session=S, sender=sender, shard=SHARD, iteration=it, channel=ch,
        indices=np.array(blocks), blocks=codec.encode(coding, data), key=key,
        coding=coding)
    if flags_coding is not None:
        rows[:, 5] = (rows[:, 5] & (0xFF ^ wire.CODING_MASK)) | (flags_coding << wire.CODING_SHIFT)
    return rows, data.numpy()


@pytest.mark.parametrize("coding", list(wire.Coding)[1:])
@pytest.mark.parametrize("gro", [False, True])
@pytest.mark.parametrize("key", [None, b"k"])
def test_a_coded_block_arrives_with_its_coding(coding, gro, key):
    """Coded datagrams, one by one or as one GRO run, arrive as their payloads with the
    coding named, and complete the worker like f32 ones."""
    from dgt import codec
    s = session(n_workers=1, key=key)
    rows, data = _coded(0, [12, 14, 15], coding, key=key)
    ev = s.receive_datagram(rows.tobytes(), 0) if gro else \
        [e for r in rows for e in s.receive_datagram(r.tobytes(), 0)]
    got = [e for e in ev if isinstance(e, BlocksArrived)]
    assert got and all(e.coding == coding for e in got)
    dec = np.concatenate([codec.decode(coding, e.data.reshape(-1, e.data.shape[-1]), ELEMS)
                          for e in got])
    assert sorted(int(r) for e in got for r in np.atleast_1d(e.rows)) == [2, 4, 5]
    # within half a step of the coarsest coding (int4: max|x| / 14) and not exact
    assert np.abs(dec - data).max() <= np.abs(data).max() / 14 and \
        not np.array_equal(dec, data)
    assert s.counters.channels[1].blocks_delivered == 3
    assert s.counters.channels[1].bytes_delivered == rows.size
    ev = s.receive_frame(*end(0, [0, 3]), now=0)
    assert kinds(ev) == ["WorkerFinalised", "IterationComplete"]


@pytest.mark.parametrize("gro", [False, True])
def test_an_unknown_coding_or_a_wrong_length_is_counted_and_dropped(gro):
    s = session(n_workers=1)
    unknown, _ = _coded(0, [12, 13], wire.Coding.INT8, flags_coding=5)
    # an f32 payload (4E bytes) labelled int8 (4 + E bytes): a length that does not match
    relabelled = _rows(0, [14, 15])
    relabelled[:, 5] |= wire.Coding.INT8 << wire.CODING_SHIFT
    for rows, reason in ((unknown, "bad_coding"), (relabelled, "bad_length")):
        if gro:
            ev = s.receive_datagram(rows.tobytes(), 0)
        else:
            ev = [e for r in rows for e in s.receive_datagram(r.tobytes(), 0)]
        assert set(ev) == {Rejected(reason)}
        assert s.counters.rejected[reason] == 2
    assert not s.received.any()


def test_a_gro_run_with_one_forged_coding_loses_only_that_datagram():
    """Rows of one size in one run, one of them with another coding of that size (fp16
    among bf16) and one with an unknown coding: the vectorised reader keeps each good
    row with its own coding and drops the unknown one."""
    s = session(n_workers=1)
    rows, _ = _coded(0, [10, 11, 12], wire.Coding.BF16)
    rows[1, 5] = (rows[1, 5] & (0xFF ^ wire.CODING_MASK)) | (wire.Coding.FP16 << wire.CODING_SHIFT)
    rows[2, 5] = (rows[2, 5] & (0xFF ^ wire.CODING_MASK)) | (7 << wire.CODING_SHIFT)
    ev = s.receive_datagram(rows.tobytes(), 0)
    got = {int(r): e.coding for e in ev if isinstance(e, BlocksArrived)
           for r in np.atleast_1d(e.rows)}
    assert got == {0: wire.Coding.BF16, 1: wire.Coding.FP16}
    assert s.counters.rejected["bad_coding"] == 1


def _coded_tcp(blocks, coding, flags_coding=None, cut=0):
    """A reliable BLOCKS frame of ``blocks`` coded as ``coding`` (--reliable-codec);
    ``flags_coding`` forges the header's coding, ``cut`` drops payload bytes."""
    import torch
    from dgt import codec
    data = torch.tensor([[b + 0.1 * i + 1 / 3 for i in range(ELEMS)] for b in blocks],
                        dtype=torch.float32)
    payloads = codec.encode(coding, data)
    parts = wire.coded_indexed_blocks_parts(np.array(blocks), payloads)
    payload = b"".join(bytes(p) for p in parts)[:len(b"".join(bytes(p) for p in parts)) - cut]
    c = coding if flags_coding is None else flags_coding
    buf = wire.encode(MsgType.BLOCKS, session=S, sender=0, shard=SHARD, channel=0,
                      block=blocks[0], count=len(blocks),
                      flags=Flag.INDEXED | (c << wire.CODING_SHIFT), payload=payload)
    return wire.decode(buf), payloads, data.numpy()


@pytest.mark.parametrize("coding", [wire.Coding.FP16, wire.Coding.BF16, wire.Coding.INT8,
                                    wire.Coding.INT4])
def test_a_coded_tcp_blocks_frame_arrives_with_its_coding(coding):
    """--reliable-codec: the INDEXED payload holds the coded blocks after the indices;
    the session hands them on as they came (the shard decodes), tagged with the
    header's coding, counted on the reliable channel."""
    s = session(n_workers=1)
    (h, payload), payloads, _ = _coded_tcp([10, 12, 11], coding)
    ev = s.receive_frame(h, payload, now=0)
    assert kinds(ev) == ["BlocksArrived"]
    assert ev[0].coding == coding and ev[0].channel == 0
    assert ev[0].rows.tolist() == [0, 2, 1]
    assert np.array_equal(ev[0].data, payloads)
    assert s.received[0, :3].all() and s.coding_of[0, :3].tolist() == [coding] * 3
    assert s.counters.channels[0].blocks_delivered == 3


def test_a_coded_tcp_blocks_frame_that_lies_is_rejected_whole():
    """An unknown coding (7) is bad_coding; a coding whose size is not the payload's
    (int4 payloads labelled fp16, a payload one byte short) is bad_length; nothing of
    such a frame is received."""
    s = session(n_workers=1)
    for frame, reason in ((_coded_tcp([10, 11], wire.Coding.INT8, flags_coding=7)[0],
                           "bad_coding"),
                          (_coded_tcp([10, 11], wire.Coding.INT4,
                                      flags_coding=wire.Coding.FP16)[0], "bad_length"),
                          (_coded_tcp([10, 11], wire.Coding.BF16, cut=1)[0], "bad_length")):
        assert s.receive_frame(*frame, now=0) == [Rejected(reason)]
    assert s.counters.rejected == {"bad_coding": 1, "bad_length": 2}
    assert not s.received.any()


def test_a_reliable_copy_displaces_a_staged_coded_one():
    """A coded UDP copy of a block is staged at the shard, then the block's reliable
    copy comes: the aggregate holds the reliable copy's values, not the staged
    decode (the staged row is given up with the displaced delivery)."""
    from dgt.layout import BlockLayout
    from dgt.shard import ServerShard
    lay = BlockLayout.from_bytes(20 * ELEMS, ELEMS * 4, 2)
    # blocks [lo, hi) of the layout's shard 1; the session's shard number (SHARD) is
    # only what the scripts' headers carry
    s = ShardSession(session=S, shard=SHARD, lo=lay.shard_lo(1), hi=lay.shard_hi(1),
                     block_elems=ELEMS, n_workers=1, deadline_s=0.05)
    pulled = []
    shard = ServerShard(lay, 1, s, lambda *a: pulled.append(a[2].copy()))
    lo = lay.shard_lo(1)
    rows, _ = _coded(0, [lo + 1], wire.Coding.INT8, ch=2)
    shard.handle(s.receive_datagram(rows[0].tobytes(), 0))
    assert shard.staged[wire.Coding.INT8][1][0, 1]
    n = lay.shard_blocks(1)
    shard.handle(s.receive_frame(*tcp_blocks(0, list(range(lo, lo + n))), now=0))
    shard.handle(s.receive_frame(*end(0, [n]), now=0))
    assert len(pulled) == 1
    got = pulled[0].reshape(n, ELEMS)[:, 0]
    assert got.tolist() == [float(i) for i in range(n)]   # tcp_blocks' values


def test_a_displaced_coded_copy_takes_back_its_own_bytes():
    """A coded UDP copy of a block that then comes over TCP is recounted as a duplicate,
    and its channel's delivered bytes go back by that copy's size, not an f32 one's."""
    s = session(n_workers=1)
    rows, _ = _coded(0, [11], wire.Coding.INT8, ch=2)
    s.receive_datagram(rows[0].tobytes(), 0)
    assert s.counters.channels[2].bytes_delivered == rows.shape[1]
    s.receive_frame(*tcp_blocks(0, [10, 11]), now=0)
    assert s.counters.channels[2].blocks_delivered == 0
    assert s.counters.channels[2].bytes_delivered == 0
    assert s.counters.channels[2].blocks_duplicate == 1


def test_a_refused_end_is_told_from_a_missing_one():
    """Breaker round 11: a live peer whose END was refused (a count over the shard's
    blocks, another iteration) was reported as 'dead or frozen'. The session now says
    whose END it refused, and the failure names those ranks as such."""
    from dgt.agent import stalled_text
    from dgt.failure import BLAME_TEXT, FailureReason, FailureRecord
    s = session(n_workers=3)   # the shard holds 10 blocks
    assert s.receive_frame(*end(0, [0, 10]), now=0) == []   # accepted: blocks due
    assert s.receive_frame(*end(1, [11]), now=0) == [Rejected("bad_end")]   # too many
    assert s.receive_frame(*end(2, [2], it=1), now=0) == [Rejected("bad_end")]   # t + 1
    assert s.waiting_for(0) == [1, 2]
    assert s.ends_refused(0) == {1: "bad_end", 2: "bad_end"} and s.ends_refused(1) == {}
    text = stalled_text(1, 0, [1, 2], s.ends_refused(0))
    assert "(dead or frozen)" not in text and "rank(s) [1, 2], whose END it refused " \
        "(bad_end" in text, text
    assert "rank(s) [0] (dead or frozen) nor from rank(s) [2], whose END" in \
        stalled_text(1, 0, [0, 2], {2: "bad_end"})
    assert stalled_text(1, 0, [], {}) == ""
    rec = FailureRecord("sidecar", 0, FailureReason.PEER_REFUSED, "m", [1])
    assert rec.headline_blame(0) == f"rank(s) [1] {BLAME_TEXT[FailureReason.PEER_REFUSED]}"
    # its END accepted at last: no longer waited for, no longer refused
    assert s.receive_frame(*end(1, [10]), now=0.01) is not None
    assert 1 not in s.ends_refused(0)
    s.advance()
    assert s.ends_refused(1) == {}
