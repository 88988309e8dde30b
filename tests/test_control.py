"""transport.control with a fake clock and no sockets: HELLO and its timeout, slots and
eviction, forged HELLO/ERROR/BYE, PULL checks, blame on a lost connection."""
import numpy as np

from dgt.transport import messages, wire
from dgt.transport.control import (LOST_GRACE_S, CloseConnection, ConnectionRefused,
                                   ConnState, ControlProtocol, PeerFailed, PeerLeft,
                                   PullArrived, RefuseConnection, ShardFrame)
from dgt.transport.reasons import Reason, Rejected
from dgt.transport.wire import MsgType

SESSION = 0x1234_5678_9ABC_DEF0
E = 4


def frame(mtype, *, sender=1, shard=0, session=SESSION, payload=b"", **kw):
    buf = wire.encode(mtype, session=session, sender=sender, shard=shard, payload=payload,
                      **kw)
    return wire.decode(buf)


def control(authenticated=False, **kw):
    c = ControlProtocol(rank=0, world=3, authenticated=authenticated, rejected={}, **kw)
    c.set_session(SESSION, 0.0)
    c.set_layout({0: (0, 2), 1: (2, 2), 2: (4, 1)}, E)
    return c


def hello(c, conn, sender=1, now=0.0, **kw):
    c.accepted(conn, now)
    return c.receive_frame(conn, *frame(MsgType.HELLO, sender=sender, **kw), now)


def test_hello_times_out_and_is_counted():
    c = control(hello_timeout_s=10.0)
    assert c.accepted(1, 0.0) == [] and c.accepted(2, 4.0) == []
    assert c.next_timer() == 10.0
    assert c.handle_timer(9.9) == []
    assert c.handle_timer(10.0) == [CloseConnection(1, "no_hello")]
    assert c.next_timer() == 14.0
    assert hello(c, 3, now=5.0) == []   # a HELLO in time: no longer pending
    assert c.handle_timer(100.0) == [CloseConnection(2, "no_hello")]
    assert c.next_timer() is None
    assert c.rejected == {"no_hello": 2}


def test_full_slots_evict_the_oldest_idle_connection_not_the_newcomer():
    c = control(max_pending=3)
    for i in range(3):
        assert c.accepted(i, float(i)) == []
    # a peer connecting now gets a slot; the stranger's oldest idle connection goes
    assert c.accepted(10, 5.0) == [CloseConnection(0, "evicted_pending")]
    assert c.receive_frame(10, *frame(MsgType.HELLO, sender=2), 5.0) == []
    assert c.state(10) is ConnState.CANDIDATE and c.incoming() == {2: 10}
    assert c.lost(0, 5.0) == []   # the evicted stranger's close blames nobody
    assert c.rejected == {"evicted_pending": 1}


def test_a_forged_hello_does_not_take_a_real_peers_place():
    c = control()
    assert hello(c, 1, sender=1) == []                       # the real peer
    assert hello(c, 2, sender=1, session=SESSION ^ 1) == [CloseConnection(2, "stray")]
    assert hello(c, 3, sender=1, shard=2) == [CloseConnection(3, "bad_hello")]
    assert hello(c, 4, sender=0) == [CloseConnection(4, "bad_hello")]     # our own rank
    assert hello(c, 5, sender=7) == [CloseConnection(5, "bad_hello")]
    # breaker round 11: a HELLO with a payload was taken (docs/wire.md: empty)
    assert hello(c, 9, sender=1, payload=b"8 bytes!") == [CloseConnection(9, "bad_hello")]
    # a HELLO with the session (a host on the path) coexists; it takes nothing
    assert hello(c, 6, sender=1) == []
    blocks = frame(MsgType.END, sender=1, payload=wire.pack_end([0]))
    ev = c.receive_frame(1, *blocks, 1.0)
    assert ev == [ShardFrame(1, *blocks)]
    c.confirm(1)                                             # the shard accepted it
    assert c.incoming() == {1: 1}
    # the superseded / forged candidate dropping blames nobody; the real one would
    assert c.lost(6, 2.0) == []
    assert c.lost(1, 2.0) == []
    assert c.handle_timer(2.0 + LOST_GRACE_S) == [
        PeerFailed(1, "lost connection to rank 1 (process died or network down)")]


def test_candidates_per_rank_are_capped_and_a_peer_s_own_is_kept():
    c = ControlProtocol(rank=0, world=3, authenticated=False, rejected={},
                        max_candidates=2)
    c.set_session(SESSION, 0.0, hosts={1: {"10.0.0.1"}, 2: {"10.0.0.2"}})

    def hello_from(conn, host, sender=1):
        c.accepted(conn, 0.0, host)
        return c.receive_frame(conn, *frame(MsgType.HELLO, sender=sender), 0.0)

    def refused(ev):   # the closes, each with the ERROR that says why
        assert all(isinstance(e, RefuseConnection) and e.rank == 1 for e in ev), ev
        return [(e.conn, e.reason) for e in ev]

    assert hello_from(1, "10.0.0.1") == []          # the real rank 1
    assert hello_from(2, "10.9.9.9") == []          # forged, from elsewhere
    assert refused(hello_from(3, "10.9.9.9")) == [(2, "evicted_candidate")]
    assert refused(hello_from(4, "::ffff:10.9.9.9")) == [(3, "evicted_candidate")]
    assert c.incoming() == {1: 1}                   # PULLs go to the rank's address
    # forged from the rank's own address too: the newcomer goes, the first one stays
    assert refused(hello_from(5, "10.0.0.1")) == [(4, "evicted_candidate")]
    ev = hello_from(6, "10.0.0.1")
    assert refused(ev) == [(6, "evicted_candidate")]
    assert "2 other connections claim rank 1" in ev[0].text
    # traffic decides, and the rank's other candidate is refused then
    assert refused(c.confirm(5)) == [(1, "rank_taken")]
    assert c.incoming() == {1: 5}
    assert c.lost(1, 1.0) == []


def test_full_slots_evict_a_stranger_s_connection_before_a_peer_s():
    c = ControlProtocol(rank=0, world=3, authenticated=False, rejected={}, max_pending=2)
    c.set_session(SESSION, 0.0, hosts={1: {"10.0.0.1"}, 2: {"10.0.0.2"}})
    c.accepted(1, 0.0, "10.0.0.1")                  # a peer, its HELLO not read yet
    c.accepted(2, 0.0, "10.9.9.9")
    assert c.accepted(3, 0.0, "10.9.9.9") == [CloseConnection(2, "evicted_pending")]
    assert c.accepted(4, 0.0, "10.9.9.9") == [CloseConnection(3, "evicted_pending")]
    assert c.state(1) is ConnState.PENDING


def test_a_hello_before_the_session_is_known_is_held():
    c = ControlProtocol(rank=0, world=3, authenticated=False, rejected={})
    c.accepted(1, 0.0)
    c.accepted(2, 0.0)
    assert c.receive_frame(1, *frame(MsgType.HELLO, sender=2), 0.0) == []
    assert c.receive_frame(2, *frame(MsgType.HELLO, sender=1, session=5), 0.0) == []
    assert c.set_session(SESSION, 1.0) == [CloseConnection(2, "stray")]
    assert c.state(1) is ConnState.CANDIDATE


def test_forged_error_and_bye_on_an_accepted_connection_change_nothing():
    c = control()
    hello(c, 1, sender=1)
    c.confirm(1)
    err = frame(MsgType.ERROR, sender=1, block=2, payload=b"forged: rank 2 died")
    assert c.receive_frame(1, *err, 1.0) == [Rejected("unverified_control")]
    assert c.receive_frame(1, *frame(MsgType.BYE, sender=1), 1.0) == \
        [Rejected("unverified_control")]
    assert c.left == set()
    assert c.rejected == {"unverified_control": 2}
    # a frame naming another rank than its HELLO did
    assert c.receive_frame(1, *frame(MsgType.END, sender=2), 1.0) == \
        [Rejected("wrong_sender")]
    assert c.receive_frame(1, *frame(MsgType.HELLO, sender=1), 1.0) == \
        [Rejected("duplicate_hello")]


def test_error_and_bye_count_on_the_connection_we_dialled():
    c = control()
    c.connected(7, 2, 0.0)
    ev = c.receive_frame(7, *frame(MsgType.ERROR, sender=2, block=1,
                                   payload="trainer\x1b[2J died".encode()), 1.0)
    assert ev == [PeerFailed(1, "rank 2 reports: trainer?[2J died", reported=True)]
    ev = c.receive_frame(7, *frame(MsgType.ERROR, sender=2, block=0xFFFFFFFF), 1.0)
    assert ev[0].rank is None
    # BYE's count: the iterations that rank pushed (a peer still pushing fails at once)
    assert c.receive_frame(7, *frame(MsgType.BYE, sender=2, payload=b"x"), 1.0) == \
        [Rejected("bad_length")]   # BYE's payload is empty (checked)
    assert c.receive_frame(7, *frame(MsgType.BYE, sender=2, count=44), 1.0) == \
        [PeerLeft(2, True, pushed=44)]
    assert c.lost(7, 2.0) == []   # it said BYE


def test_with_a_secret_every_connection_is_verified():
    c = control(authenticated=True)
    hello(c, 1, sender=1)
    assert c.receive_frame(1, *frame(MsgType.BYE, sender=1, count=3), 1.0) == \
        [PeerLeft(1, True, pushed=3)]


def test_pull_checks_and_types_per_direction():
    c = control()
    c.connected(7, 1, 0.0)
    agg = np.arange(2 * E, dtype=np.float32)
    ok = frame(MsgType.PULL, sender=1, shard=1, block=2, count=2,
               payload=wire.pack_pull(agg, np.array([True, False])))
    (ev,) = c.receive_frame(7, *ok, 1.0)
    assert isinstance(ev, PullArrived) and (ev.shard, ev.iteration) == (1, 0)
    assert np.array_equal(ev.aggregate, agg) and ev.received.tolist() == [True, False]
    wrong = frame(MsgType.PULL, sender=1, shard=1, block=0, count=2,
                  payload=wire.pack_pull(agg, np.array([True, False])))
    assert c.receive_frame(7, *wrong, 1.0) == [Rejected("bad_pull")]
    short = frame(MsgType.PULL, sender=1, shard=1, block=2, count=2, payload=b"x")
    assert c.receive_frame(7, *short, 1.0) == [Rejected("bad_length")]
    # BLOCKS on a connection we dialled, PULL on one we accepted: wrong direction
    assert c.receive_frame(7, *frame(MsgType.BLOCKS, sender=1), 1.0) == \
        [Rejected("unexpected_type")]
    hello(c, 1, sender=2)
    assert c.receive_frame(1, *frame(MsgType.PULL, sender=2, shard=2), 1.0) == \
        [Rejected("unexpected_type")]
    assert c.receive_frame(7, *frame(MsgType.END, sender=1, session=3), 1.0) == \
        [CloseConnection(7, "stray")]


def test_losing_the_connection_we_dialled_blames_its_rank_unless_finishing():
    c = control()
    c.connected(7, 1, 0.0)
    c.connected(8, 2, 0.0)
    assert c.lost(7, 1.0) == []   # its ERROR, on the other socket, may still be coming
    assert c.next_timer() == 1.0 + LOST_GRACE_S
    assert c.handle_timer(1.0 + LOST_GRACE_S / 2) == []
    assert c.handle_timer(1.0 + LOST_GRACE_S) == [
        PeerFailed(1, "lost connection to rank 1 (process died or network down)")]
    assert c.next_timer() is None
    c.finishing = True
    assert c.lost(8, 1.0) == [PeerLeft(2, clean=False)]


def test_a_lost_connection_waits_for_the_error_that_explains_it():
    """A failing peer sends ERROR on its connection and closes ours: the two sockets'
    events come in either order. The ERROR that comes within the grace is the failure
    (naming the rank it names); the loss alone fails the job only after the grace."""
    c = control(authenticated=True)
    c.connected(7, 1, 0.0)
    hello(c, 3, sender=2)
    c.receive_frame(3, *frame(MsgType.END, sender=2, payload=wire.pack_end([0])), 0.5)
    c.confirm(3)
    assert c.lost(7, 1.0) == []
    err = wire.decode(messages.error(SESSION, 2, 2, "trainer of rank 2 died", None))
    ev = c.receive_frame(3, *err, 1.1)
    assert len(ev) == 1 and isinstance(ev[0], PeerFailed) and ev[0].reported, ev
    assert ev[0].rank == 2 and "rank 2 reports: trainer of rank 2 died" in ev[0].reason
    # a peer that said BYE meanwhile is not blamed when the grace ends
    c2 = control()
    c2.connected(7, 1, 0.0)
    assert c2.lost(7, 1.0) == []
    c2.left.add(1)
    assert c2.handle_timer(2.0) == []


def test_every_rejection_is_a_reason():
    c = control()
    for r in c.rejected:
        Reason(r)
    assert all(isinstance(Reason(x.value), Reason) for x in Reason)


def test_once_a_rank_s_connection_is_established_no_rival_takes_its_place():
    """The breaker's attack: a stranger who read the session id from the (unauthenticated)
    rendezvous store says HELLO as rank 1 mid-run and sends BLOCKS/END first. dgt never
    reconnects, so once rank 1's connection carried accepted traffic a rival is closed
    (or its frames dropped unapplied), gets no PULL, and its drop blames nobody."""
    c = control()
    assert hello(c, 1, sender=1) == []                       # the real peer
    end = frame(MsgType.END, sender=1, payload=wire.pack_end([0]))
    assert c.receive_frame(1, *end, 1.0) == [ShardFrame(1, *end)]
    c.confirm(1)                                             # established
    # a HELLO for rank 1 after that: closed at once, with an ERROR that says why (the
    # real rank 1 learns it, should this be its connection and the stranger's the first)
    ev = hello(c, 2, sender=1)
    assert [(type(e), e.conn, e.reason, e.rank) for e in ev] == \
        [(RefuseConnection, 2, "rank_taken", 1)]
    assert "holds rank 1's place" in ev[0].text
    assert c.rejected["rank_taken"] == 1
    assert c.incoming() == {1: 1}
    assert c.lost(2, 2.0) == []                              # nobody blamed


def test_a_rival_candidate_s_traffic_is_never_applied_once_one_is_established():
    c = control()
    assert hello(c, 1, sender=1) == []                       # three candidates at start-up
    assert hello(c, 2, sender=1) == []
    assert hello(c, 3, sender=1) == []
    end = frame(MsgType.END, sender=1, payload=wire.pack_end([0]))
    assert c.receive_frame(1, *end, 1.0) == [ShardFrame(1, *end)]
    assert c.receive_frame(3, *end, 1.0) == [ShardFrame(3, *end)]
    # the first one the shard accepts wins; the rivals are refused at once
    ev = c.confirm(1)
    assert [(type(e), e.conn, e.reason) for e in ev] == \
        [(RefuseConnection, 2, "rank_taken"), (RefuseConnection, 3, "rank_taken")]
    # a rival's frame already read is dropped, and confirming it changes nothing
    assert c.receive_frame(3, *end, 1.0) == []
    assert c.confirm(3) == [] and c.confirm(2) == []
    assert c.incoming() == {1: 1}
    assert c.lost(2, 2.0) == []
    assert c.lost(1, 2.0) == []
    assert c.handle_timer(2.0 + LOST_GRACE_S) == [
        PeerFailed(1, "lost connection to rank 1 (process died or network down)")]


def test_a_refusal_reaches_the_rank_only_on_the_connection_it_dialled():
    """A shard's ERROR with block REFUSED on a connection we dialled: our own connection
    was cut off there, because another connection holds our rank (a stranger with the
    session id won the race at start-up): ConnectionRefused, which the sidecar turns
    into a failure that blames no rank. On an accepted connection it is unverified."""
    c = control()
    c.connected(9, 1, 0.0)                                   # we dialled shard 1
    err = frame(MsgType.ERROR, sender=1, shard=0, block=messages.REFUSED,
                payload=b"another connection holds rank 0's place")
    assert c.receive_frame(9, *err, 1.0) == \
        [ConnectionRefused(1, "another connection holds rank 0's place")]
    assert hello(c, 2, sender=1) == []                       # an accepted one: no
    assert c.receive_frame(2, *err, 1.0) == [Rejected("unverified_control")]
    # a plain ERROR naming nobody stays a peer's report
    plain = frame(MsgType.ERROR, sender=1, shard=0, block=messages.NO_RANK, payload=b"x")
    assert c.receive_frame(9, *plain, 1.0) == [PeerFailed(None, "rank 1 reports: x",
                                                          reported=True)]
