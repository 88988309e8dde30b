"""Inputs an outside tester found mishandled in the sans-IO wire layer: encoders that
took values out of their field's range, parsers whose output depended on how the bytes
were split, and a shard session that took arguments it cannot work with."""
import random

import numpy as np
import pytest

from dgt.transport import wire
from dgt.transport import session as S
from dgt.transport import framing
from dgt.transport.framing import Deframer, split_frames
from dgt.transport.session import BlocksArrived, Rejected, ShardSession, WorkerFinalised
from dgt.transport.wire import MsgType, WireError

SESS = 0x1234
ELEMS = 4


# -- 1. encoders refuse what a decoder refuses, or what would wrap ---------------------

def _enc(**kw):
    args = dict(session=1, sender=0)
    args.update(kw)
    return wire.encode(kw.pop("t", MsgType.BLOCKS), **{k: v for k, v in args.items()
                                                       if k != "t"})


@pytest.mark.parametrize("field,value,phrase", [
    ("t", 99, "not a MsgType"),
    ("t", 0, "not a MsgType"),
    ("channel", 99, "channel 99"),
    ("channel", 8, "channel 8"),
    ("sender", 70000, "sender 70000"),
    ("sender", -1, "sender -1"),
    ("shard", 1 << 16, "shard 65536"),
    ("iteration", 1 << 32, "iteration 4294967296"),
    ("iteration", -1, "iteration -1"),
    ("block", 1 << 32, "block 4294967296"),
    ("count", -5, "count -5"),
    ("session", 1 << 64, "session"),
    ("flags", 256, "flags 256"),
])
def test_encode_refuses_a_field_out_of_its_range(field, value, phrase):
    with pytest.raises(ValueError, match=phrase) as e:
        _enc(**{field: value})
    assert not isinstance(e.value, WireError)
    assert "struct" not in str(e.value)


@pytest.mark.parametrize("field", ["sender", "iteration", "channel", "block"])
def test_encode_refuses_a_field_that_is_not_an_integer(field):
    with pytest.raises(TypeError, match=field):
        _enc(**{field: 1.5})


def test_encode_takes_the_largest_values_of_each_field():
    buf = _enc(session=(1 << 64) - 1, sender=65535, shard=65535, iteration=(1 << 32) - 1,
               block=(1 << 32) - 1, count=(1 << 32) - 1, channel=7, flags=0x1C,
               t=MsgType.BYE)
    h, _ = wire.decode(buf)
    assert (h.sender, h.iteration, h.channel) == (65535, (1 << 32) - 1, 7)


def _dgrams(**kw):
    args = dict(session=1, sender=1, shard=0, iteration=0, channel=1,
                indices=np.array([3]), blocks=np.ones((1, 4), np.float32))
    args.update(kw)
    return wire.encode_block_datagrams(**args)


@pytest.mark.parametrize("kw,phrase", [
    (dict(indices=np.array([2 ** 33])), "u32"),
    (dict(indices=np.array([-1])), "u32"),
    (dict(indices=np.array([1, 2])), "2 indices for 1 blocks"),
    (dict(channel=99), "channel 99"),
    (dict(sender=70000), "sender 70000"),
    (dict(iteration=-1), "iteration -1"),
    (dict(shard=1 << 16), "shard 65536"),
    (dict(session=-1), "session"),
    (dict(coding=6), "not a Coding"),
    (dict(blocks=np.ones(4, np.float32)), "2-D"),
    (dict(blocks=np.ones((1, 0), np.float32)), "no block"),
])
def test_encode_block_datagrams_refuses_what_would_wrap_or_be_refused(kw, phrase):
    with pytest.raises(ValueError, match=phrase):
        _dgrams(**kw)


def test_encode_block_datagrams_refuses_float_indices():
    with pytest.raises(TypeError, match="indices"):
        _dgrams(indices=np.array([1.5]))


def test_pack_indexed_blocks_needs_one_index_per_block():
    with pytest.raises(ValueError, match="3 indices for 2 blocks"):
        wire.pack_indexed_blocks(np.arange(3), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="u32"):
        wire.pack_indexed_blocks(np.array([2 ** 32]), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="u32"):
        wire.coded_indexed_blocks_parts(np.array([-1]), np.zeros((1, 8), np.uint8))
    assert len(wire.pack_indexed_blocks(np.arange(2), np.zeros((2, 4), np.float32))) == 40


def test_pack_end_refuses_fractions_negatives_and_too_many_channels():
    with pytest.raises(TypeError, match="integer"):
        wire.pack_end([1.5, 2])
    with pytest.raises(ValueError, match="END count of channel 1"):
        wire.pack_end([1, -2])
    with pytest.raises(ValueError, match="END count of channel 0"):
        wire.pack_end([1 << 32])
    with pytest.raises(ValueError, match="at most 8"):
        wire.pack_end([0] * 9)
    assert wire.unpack_end(memoryview(wire.pack_end([4, 3]))).tolist() == [4, 3] + [0] * 6


def test_an_empty_key_is_refused_by_every_encoder_and_decoder():
    """One rule: b"" is no key a job can have (1 to 64 bytes), never "no key"."""
    calls = [
        lambda: wire.encode(MsgType.HELLO, session=1, sender=0, key=b""),
        lambda: wire.encode_parts(MsgType.HELLO, session=1, sender=0, key=b""),
        lambda: _dgrams(key=b""),
        lambda: wire.decode(wire.encode(MsgType.HELLO, session=1, sender=0), key=b""),
        lambda: Deframer(key=b""),
        lambda: ShardSession(session=1, shard=0, lo=0, hi=4, block_elems=4, n_workers=2,
                             deadline_s=0.05, key=b""),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="1 to 64 bytes"):
            call()
    # None is no key: no MAC, in both encoders alike
    assert not wire.decode(wire.encode(MsgType.HELLO, session=1, sender=0))[0].flags
    assert not _dgrams(key=None)[0][5]


# -- 2. the same output however the bytes are split ------------------------------------

def _good_frames(n=8):
    return [wire.encode(MsgType.BLOCKS, session=9, sender=1, iteration=i,
                        payload=bytes([i]) * (3 * i)) for i in range(n)]


def _deframe(stream: bytes, cuts: list[int]):
    """Frames (iteration, payload) and the error reason, feeding ``stream`` cut at
    ``cuts``; every feed after the error must raise it again."""
    d = Deframer()
    got, err = [], None
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])] + [b""]
    for p in pieces:
        try:
            got += [(h.iteration, bytes(x)) for h, x in d.feed(p)]
        except WireError as e:
            err = e.reason
            with pytest.raises(WireError):
                d.feed(b"more")
            break
    return got, err


@pytest.mark.parametrize("garbage", [b"\x00" * 40, b"XY" + b"\x00" * 60,
                                     wire.encode(MsgType.END, session=9, sender=1)[:3]
                                     + b"\x63" + b"\x00" * 40])
def test_deframer_output_does_not_depend_on_the_split(garbage):
    frames = _good_frames()
    stream = b"".join(frames) + garbage
    want = [(i, bytes([i]) * (3 * i)) for i in range(8)]
    whole = _deframe(stream, [])
    assert whole[0] == want and whole[1] in ("bad_magic", "bad_type")
    assert _deframe(stream, list(range(1, len(stream)))) == whole   # byte by byte
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        assert _deframe(stream, cuts) == whole


def test_split_frames_returns_the_good_frames_before_the_error():
    stream = b"".join(_good_frames()) + b"\x00" * 40
    frames, used, need, err = framing.parse_frames(memoryview(stream))
    assert [h.iteration for h, _ in frames] == list(range(8))
    assert used == len(stream) - 40 and err.reason == "bad_magic"
    frames, used, need = split_frames(memoryview(stream))
    assert [h.iteration for h, _ in frames] == list(range(8))
    with pytest.raises(WireError, match="bad_magic"):
        split_frames(memoryview(stream)[used:])
    frames, used, need, err = framing.parse_frames(memoryview(b"".join(_good_frames(3))[:-1]))
    assert len(frames) == 2 and err is None and need > 0


def test_frame_protocol_acts_on_the_good_frames_then_aborts():
    """transport.aio: one read holding good frames and then garbage hands the good
    frames on, then counts the bad one and aborts, as byte-by-byte reads would."""
    from dgt.transport.aio import FrameProtocol

    class Transport:
        closing = False

        def is_closing(self):
            return self.closing

        def abort(self):
            log.append("abort")
            self.closing = True

        def get_extra_info(self, name):
            return None

    def run(stream, chunk):
        global log
        log = []
        p = FrameProtocol(on_frame=lambda pr, h, pl, now: log.append(h.iteration),
                          on_lost=lambda pr, e: None,
                          on_bad=lambda pr, why: log.append(why))
        p.connection_made(Transport())
        for i in range(0, len(stream), chunk):
            if p.transport.closing:
                break
            data = stream[i:i + chunk]
            buf = p.get_buffer(len(data))
            buf[:len(data)] = data
            p.buffer_updated(len(data))
        return log

    stream = b"".join(_good_frames()) + b"\x00" * 40
    want = list(range(8)) + ["bad_magic", "abort"]
    assert run(stream, len(stream)) == want
    assert run(stream, 1) == want
    assert run(stream, 50) == want


log: list = []


def _norm(events):
    """Events one block and one outcome each; consecutive equal rejections as one (a
    run's stretch of datagrams refused for one reason is one event)."""
    out = []
    for e in events:
        if isinstance(e, BlocksArrived):
            rows = np.atleast_1d(e.rows)
            data = np.asarray(e.data).reshape(rows.size, -1)
            out += [("block", e.sender, e.iteration, e.channel, int(r), d.tobytes(),
                     e.coding) for r, d in zip(rows, data)]
        elif isinstance(e, Rejected):
            if out and out[-1] == ("rejected", e.reason):
                continue
            out.append(("rejected", e.reason))
        elif isinstance(e, WorkerFinalised):
            out.append(("final", e.sender, e.iteration, e.received.tobytes(), e.reason))
        else:
            out.append((type(e).__name__, e.iteration))
    return out


def _mk(key=None):
    return ShardSession(session=SESS, shard=1, lo=10, hi=20, block_elems=ELEMS,
                        n_workers=3, deadline_s=0.05, key=key)


def test_a_duplicate_within_one_gro_run_is_reported_as_alone():
    """The tester's reproduction: block 3 twice, alone and as one GRO buffer."""
    d = wire.encode_block_datagrams(session=1, sender=1, shard=0, iteration=0, channel=1,
                                    indices=np.array([3, 3]),
                                    blocks=np.ones((2, 4), np.float32))

    def mk():
        return ShardSession(session=1, shard=0, lo=0, hi=10, block_elems=4, n_workers=2,
                            deadline_s=0.05)
    a, b = mk(), mk()
    one = a.receive_datagram(bytes(d[0]), 0) + a.receive_datagram(bytes(d[1]), 0)
    run = b.receive_datagram(bytes(d[0]) + bytes(d[1]), 0)
    assert [type(e).__name__ for e in one] == ["BlocksArrived", "Rejected"]
    assert _norm(run) == _norm(one)
    assert a.counters.channels[1] == b.counters.channels[1]


def test_in_a_run_a_rejection_comes_where_its_datagram_is():
    good = wire.encode_block_datagrams(session=SESS, sender=0, shard=1, iteration=0,
                                       channel=1, indices=np.array([10, 11]),
                                       blocks=np.ones((2, ELEMS), np.float32))
    bad = wire.encode_block_datagrams(session=SESS, sender=0, shard=1, iteration=0,
                                      channel=1, indices=np.array([25]),
                                      blocks=np.ones((1, ELEMS), np.float32))
    buf = good[0].tobytes() + bad[0].tobytes() + good[1].tobytes()
    ev = _mk().receive_datagram(buf, 0)
    assert [(type(e).__name__, getattr(e, "reason", None)) for e in ev] == \
        [("BlocksArrived", None), ("Rejected", "bad_block"), ("BlocksArrived", None)]


def _state(s):
    return (s.received.tobytes(), s.per_channel.tobytes(), s.finalised.tobytes(),
            dict(s.counters.rejected),
            [(c.blocks_delivered, c.bytes_delivered, c.blocks_duplicate, c.blocks_late,
              c.blocks_lost) for c in s.counters.channels])


def _prepared(key):
    """A shard in iteration 2 with iteration 1's blocks 10-12 of worker 0 in, worker 2
    final, worker 1's END waiting for 2 blocks on channel 1."""
    s = _mk(key)
    s.advance()
    s.receive_datagram(wire.encode_block_datagrams(
        session=SESS, sender=0, shard=1, iteration=1, channel=1,
        indices=np.array([10, 11, 12]), blocks=np.ones((3, ELEMS), np.float32),
        key=key).tobytes(), 0)
    s.advance()
    for w, counts in ((2, [0, 0]), (1, [0, 2])):
        s.receive_frame(*wire.decode(wire.encode(
            MsgType.END, session=SESS, sender=w, shard=1, iteration=2, count=sum(counts),
            payload=wire.pack_end(counts), key=key), key), 0)
    return s


_MUTANTS = ["magic", "version", "type_end", "type_hello", "type_99", "channel9",
            "indexed", "coding5", "coding1", "count2", "longer", "shorter", "nomac"]


def _datagram(rng, key, mutant=None):
    """One 50-byte (66 with a key) BLOCKS datagram, random fields, maybe a mutant."""
    k = key
    if key is not None and rng.random() < 0.1:
        k = b"wrong"
    payload = np.full(ELEMS, rng.random(), np.float32).tobytes()
    if mutant == "nomac":   # no MAC flag, a payload as long as a MAC-ed block's datagram
        k, payload = None, payload + bytes(16)
    d = bytearray(wire.encode(
        MsgType.BLOCKS, session=SESS if rng.random() < 0.9 else SESS + 1,
        sender=rng.choice([0, 0, 1, 1, 1, 2, 3]),
        shard=1 if rng.random() < 0.9 else 2,
        iteration=rng.choice([0, 1, 1, 2, 2, 2, 2, 3]),
        channel=rng.choice([0, 1, 1, 1, 2, 3]), block=rng.randint(8, 21), count=1,
        payload=payload, key=k))
    if mutant == "magic":
        d[0] = 0
    elif mutant == "version":
        d[2] = 9
    elif mutant == "type_end":
        d[3] = MsgType.END
    elif mutant == "type_hello":
        d[3] = MsgType.HELLO
    elif mutant == "type_99":
        d[3] = 99
    elif mutant == "channel9":
        d[4] = 9
    elif mutant == "indexed":
        d[5] |= wire.INDEXED_BIT
    elif mutant == "coding5":
        d[5] |= 5 << wire.CODING_SHIFT
    elif mutant == "coding1":
        d[5] |= 1 << wire.CODING_SHIFT
    elif mutant == "count2":
        d[29] = 2
    elif mutant == "longer":
        d[33] += 4
    elif mutant == "shorter":
        d[33] -= 4
    return bytes(d)


@pytest.mark.parametrize("key", [None, b"k"])
def test_a_gro_run_gives_the_events_of_its_datagrams_one_by_one(key):
    """Datagrams cut into GRO runs at random (each run starting with an intact BLOCKS
    datagram, as the kernel's runs do, possibly a tail marker last) give the same
    events in the same order, the same counters and state, as one by one: strays,
    bad blocks and MACs, stale, late, future, duplicates within and across runs, a
    worker finalised in the middle of a run, and malformed datagrams."""
    rng = random.Random(11 if key else 5)
    for trial in range(150):
        n = rng.randint(1, 30)
        mutant_p = rng.choice([0.0, 0.1, 0.3])
        dgs, anchors = [], []
        for i in range(n):
            m = rng.choice(_MUTANTS) if rng.random() < mutant_p else None
            if m == "nomac" and key is None:
                m = None
            dgs.append(_datagram(rng, key, m))
            if m in (None, "magic", "version", "channel9", "indexed", "coding5",
                     "coding1", "count2"):
                anchors.append(i)   # header keeps its BLOCKS type and its size
        starts = sorted({0} | {i for i in anchors if rng.random() < 0.3}) \
            if anchors and anchors[0] == 0 else None
        if starts is None:
            continue
        runs = [dgs[a:b] for a, b in zip(starts, [*starts[1:], n])]
        if rng.random() < 0.3:   # a tail marker appended to the last run, as GRO does
            marker = wire.encode(MsgType.END, session=SESS, sender=rng.choice([0, 1]),
                                 shard=1, iteration=2, channel=1, count=rng.randint(0, 3),
                                 key=key)
            runs[-1] = runs[-1] + [marker]
        a, b = _prepared(key), _prepared(key)
        one = [e for run in runs for d in run for e in b.receive_datagram(d, 0.01)]
        whole = [e for run in runs for e in a.receive_datagram(b"".join(run), 0.01)]
        assert _norm(whole) == _norm(one), (trial, runs)
        assert _state(a) == _state(b), trial


# -- 3. a session refuses arguments it cannot work with --------------------------------

@pytest.mark.parametrize("kw,phrase", [
    (dict(deadline_s=float("nan")), "deadline_s"),
    (dict(deadline_s=float("inf")), "deadline_s"),
    (dict(deadline_s=-1.0), "deadline_s"),
    (dict(n_workers=0), "n_workers"),
    (dict(block_elems=0), "block_elems"),
    (dict(block_elems=-4), "block_elems"),
    (dict(lo=5, hi=4), "hi"),
    (dict(lo=-1), "lo"),
    (dict(shard=1 << 16), "shard"),
    (dict(session=-1), "session"),
])
def test_shard_session_refuses_arguments_it_cannot_work_with(kw, phrase):
    args = dict(session=1, shard=0, lo=0, hi=10, block_elems=4, n_workers=2,
                deadline_s=0.05)
    args.update(kw)
    with pytest.raises(ValueError, match=phrase):
        ShardSession(**args)


def test_shard_session_refuses_a_fractional_count():
    with pytest.raises(TypeError, match="n_workers"):
        ShardSession(session=1, shard=0, lo=0, hi=10, block_elems=4, n_workers=2.5,
                     deadline_s=0.05)


@pytest.mark.parametrize("shard,n_workers", [(1, 1), (2, 2), (5, 2), (-1, 2), (-1, 1)])
def test_shard_session_refuses_a_shard_no_worker_owns(shard, n_workers):
    # shard 1 of 1 worker was taken: no worker sends it a block, its END counts never add up
    with pytest.raises(ValueError) as e:
        ShardSession(**dict(_SESSION_ARGS, shard=shard, n_workers=n_workers))
    assert str(e.value) == (f"shard {shard} must be 0..{n_workers - 1} (one shard per "
                            f"worker, n_workers {n_workers})")


def test_shard_session_takes_each_workers_shard():
    for n in (1, 2, 65536):
        for shard in {0, n - 1}:
            assert ShardSession(**dict(_SESSION_ARGS, shard=shard, n_workers=n)).shard == shard


def test_a_zero_deadline_still_finalises_after_end():
    s = ShardSession(session=1, shard=0, lo=0, hi=10, block_elems=4, n_workers=2,
                     deadline_s=0.0)
    s.receive_frame(*wire.decode(wire.encode(MsgType.END, session=1, sender=1, shard=0,
                                             count=1, payload=wire.pack_end([0, 1]))), 0)
    assert s.next_deadline() == 0.0
    assert [type(e).__name__ for e in s.poll(0.0)] == ["WorkerFinalised"]


assert S.ShardSession is ShardSession


# -- round 18: ShardSession's bools and strs, block dtypes, the PULL bitmap's length ----

_SESSION_ARGS = dict(session=1, shard=0, lo=0, hi=10, block_elems=4, n_workers=2,
                     deadline_s=0.05)


@pytest.mark.parametrize("name,value", [
    ("deadline_s", "0.05"), ("deadline_s", True), ("deadline_s", np.bool_(False)),
    ("deadline_s", None), ("n_workers", True), ("block_elems", True), ("shard", False),
    ("session", True), ("lo", False), ("hi", True), ("n_workers", "2")])
def test_shard_session_refuses_a_bool_or_a_str_naming_the_argument(name, value):
    # deadline_s "0.05" and True were taken; n_workers=True: "TypeError: an integer is
    # required", naming nothing
    with pytest.raises(TypeError) as e:
        ShardSession(**dict(_SESSION_ARGS, **{name: value}))
    assert str(e.value).startswith(f"{name} must be ")
    assert repr(value) in str(e.value)


def test_shard_session_still_takes_numpy_numbers():
    s = ShardSession(**dict(_SESSION_ARGS, n_workers=np.int64(2), deadline_s=np.float32(0),
                            block_elems=np.uint16(4)))
    assert s.n_workers == 2 and s.deadline_s == 0.0


@pytest.mark.parametrize("coding,dtype,need", [
    (wire.Coding.FP16, np.float32, "uint8"), (wire.Coding.BF16, np.float32, "uint8"),
    (wire.Coding.INT8, np.int8, "uint8"), (wire.Coding.INT4, np.float64, "uint8"),
    (wire.Coding.FP32, np.uint8, "float32"), (wire.Coding.FP32, np.float64, "float32"),
    (wire.Coding.FP32, np.int32, "float32"), (wire.Coding.FP16, np.float16, "uint8")])
def test_encode_block_datagrams_refuses_blocks_of_the_wrong_dtype_for_the_coding(
        coding, dtype, need):
    # FP16 with float32 (n, 352) blocks cast them to uint8 and sent zeros as fp16
    width = 352 if coding == wire.Coding.FP32 else wire.coded_payload_bytes(coding, 352)
    with pytest.raises(TypeError) as e:
        _dgrams(coding=coding, blocks=np.ones((2, width), dtype), indices=np.arange(2))
    assert str(e.value) == (f"blocks must be {need} for coding "
                            f"{wire.Coding(coding).name}, got {np.dtype(dtype)}")


def test_encode_block_datagrams_still_takes_float32_in_either_byte_order():
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.array_equal(_dgrams(blocks=a, indices=np.arange(2)),
                          _dgrams(blocks=a.astype(">f4"), indices=np.arange(2)))


@pytest.mark.parametrize("aggregate,received", [
    (np.zeros((2, 352), np.float32), np.zeros(3, bool)),
    (np.zeros((2, 352), np.float32), np.zeros(1, bool)),
    (np.zeros(2 * 352, np.float32), np.zeros(3, bool)),
    (np.zeros(2, np.float32), np.zeros(3, bool)),
    (np.zeros(4, np.float32), np.zeros(0, bool)),
    (np.zeros((2, 4), np.float32), np.zeros((2, 1), bool)),
])
def test_pack_pull_refuses_a_received_bitmap_of_another_block_count(aggregate, received):
    # 2 blocks and 3 bits gave a 2817 B payload that unpack_pull refuses for either count
    for f in (wire.pack_pull, wire.pull_parts):
        with pytest.raises(ValueError) as e:
            f(aggregate, received)
        assert str(e.value).startswith("received must be one bool per block of the "
                                       "aggregate")
        assert f"{received.shape}" in str(e.value) and f"{aggregate.shape}" in str(e.value)


def test_pack_pull_takes_one_bit_per_block_flat_or_by_rows():
    agg = np.arange(3 * ELEMS, dtype=np.float32)
    rec = np.array([True, False, True])
    flat = wire.pack_pull(agg, rec)
    assert wire.pack_pull(agg.reshape(3, ELEMS), rec) == flat
    a, r = wire.unpack_pull(memoryview(flat), 3, ELEMS)
    assert np.array_equal(a, agg) and r.tolist() == rec.tolist()
    assert wire.pack_pull(np.zeros(0, np.float32), np.zeros(0, bool)) == b""


def _coded_pull_args(n=5, coded=(1, 3), width=8):
    mask = np.zeros(n, bool)
    mask[list(coded)] = True
    return (np.ones((n - mask.sum(), ELEMS), np.float32), np.ones((mask.sum(), width), np.uint8),
            np.ones(n, bool), mask)


@pytest.mark.parametrize("change,phrase", [
    # received of another block count than coded: the header's count is received's
    (dict(received=np.ones(4, bool)), "received must be one bool per block as coded is, "
     "got received (4,) for coded (5,)"),
    (dict(received=np.ones(6, bool)), "got received (6,) for coded (5,)"),
    (dict(coded=np.zeros((5, 1), bool)), "coded must be (n,) bool, one per block, got "
     "coded (5, 1)"),
    # a set bit of coded without its payload, or a payload without its bit
    (dict(payloads=np.ones((1, 8), np.uint8)), "payloads must be one row per coded "
     "block, got 1 rows for 2 set bits of coded"),
    (dict(payloads=np.ones((3, 8), np.uint8)), "got 3 rows for 2 set bits of coded"),
    # plain + payloads rows != len(coded)
    (dict(plain=np.ones((2, ELEMS), np.float32)), "plain must be one row per block not "
     "coded, got 2 rows for 3 of coded's 5 blocks (plain + payloads rows must be "
     "len(coded) 5)"),
    (dict(plain=np.ones((4, ELEMS), np.float32)), "got 4 rows for 3 of coded's 5 blocks"),
    (dict(plain=np.ones(3 * ELEMS, np.float32)), "plain must be 2-D, one row per block, "
     "got plain (12,)"),
    (dict(payloads=np.ones(16, np.uint8)), "payloads must be 2-D, one row per block, "
     "got payloads (16,)"),
])
def test_coded_pull_parts_refuses_inputs_that_do_not_add_up(change, phrase):
    # each gave a PULL that every receiver refuses as bad_length (or one whose received
    # bitmap is cut off or padded), blaming the peer instead of the sender's code
    args = dict(zip(("plain", "payloads", "received", "coded"), _coded_pull_args()))
    args.update(change)
    with pytest.raises(ValueError) as e:
        wire.coded_pull_parts(**args)
    assert phrase in str(e.value)


@pytest.mark.parametrize("coded", [(), (1, 3), (0, 1, 2, 3, 4)])
def test_coded_pull_parts_takes_what_unpack_coded_pull_gives_back(coded):
    width = wire.coded_payload_bytes(wire.Coding.INT8, ELEMS)
    plain, payloads, received, mask = _coded_pull_args(coded=coded, width=width)
    received[0] = False
    buf = b"".join(bytes(p) for p in wire.coded_pull_parts(plain, payloads, received, mask))
    got = wire.unpack_coded_pull(memoryview(buf), 5, ELEMS, wire.Coding.INT8)
    assert np.array_equal(got[0], plain.reshape(-1)) and np.array_equal(got[1], payloads)
    assert got[2].tolist() == received.tolist() and got[3].tolist() == mask.tolist()


# -- 2. encoders refuse a payload of the wrong dtype: nothing is cast ------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.int64])
def test_coded_indexed_blocks_parts_refuses_payloads_that_are_not_uint8(dtype):
    # float32 (3, 4) payloads were cast to uint8: 12 bytes of truncated values sent
    with pytest.raises(TypeError) as e:
        wire.coded_indexed_blocks_parts(np.arange(3), np.ones((3, 4), dtype))
    assert str(e.value) == (f"payloads must be a uint8 numpy array (the coded blocks), "
                            f"got {np.dtype(dtype)}")
    with pytest.raises(TypeError, match="payloads must be a uint8 numpy array"):
        wire.coded_indexed_blocks_parts(np.arange(1), [[1, 2]])
    idx, rows = wire.coded_indexed_blocks_parts(np.arange(3), np.ones((3, 4), np.uint8))
    assert idx == np.arange(3).astype(">u4").tobytes() and rows.tolist() == [1] * 12


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.complex64, np.float16,
                                   np.int32, np.uint8])
def test_pack_pull_and_pack_indexed_blocks_refuse_what_is_not_float32(dtype):
    # float64, int64 and complex were cast to float32 (complex: its imaginary part lost)
    agg = np.ones((2, ELEMS), dtype)
    for f, name, args in ((wire.pack_pull, "aggregate", (agg, np.ones(2, bool))),
                          (wire.pull_parts, "aggregate", (agg.reshape(-1), np.ones(2, bool))),
                          (wire.pack_indexed_blocks, "blocks", (np.arange(2), agg)),
                          (wire.indexed_blocks_parts, "blocks", (np.arange(2), agg))):
        with pytest.raises(TypeError) as e:
            f(*args)
        assert str(e.value) == f"{name} must be a float32 numpy array, got {np.dtype(dtype)}"
    with pytest.raises(TypeError, match="aggregate must be a float32 numpy array, got list"):
        wire.pack_pull([1.0, 2.0], np.ones(2, bool))


def test_pack_pull_and_pack_indexed_blocks_still_take_float32_in_either_byte_order():
    agg = np.arange(2 * ELEMS, dtype=np.float32).reshape(2, ELEMS)
    rec = np.ones(2, bool)
    assert wire.pack_pull(agg.astype(">f4"), rec) == wire.pack_pull(agg, rec)
    assert wire.pack_indexed_blocks(np.arange(2), agg.astype(">f4")) == \
        wire.pack_indexed_blocks(np.arange(2), agg)


# -- 3. encode_block_datagrams: key, blocks, coding, size and channel ----------------------

@pytest.mark.parametrize("key", [bytearray(b"k"), memoryview(b"k"), "k"])
def test_every_encoder_refuses_a_key_that_is_not_bytes_in_one_line(key):
    # bytearray: "TypeError: unhashable type: 'bytearray'" from the cached MAC keys
    calls = [lambda: _dgrams(key=key),
             lambda: wire.encode(MsgType.HELLO, session=1, sender=0, key=key),
             lambda: wire.encode(MsgType.END, session=1, sender=0, channel=1, key=key)]
    for call in calls:
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value) == f"key must be bytes or None, got {type(key).__name__}"
    assert wire.decode(_dgrams(key=b"k")[0].tobytes(), key=b"k")[0].flags & wire.MAC_BIT


def test_encode_block_datagrams_refuses_blocks_that_are_not_a_numpy_array():
    # a tensor: AttributeError 'torch.dtype' object has no attribute 'kind'
    import torch
    for blocks in (torch.ones(1, 4), [[1.0, 2.0, 3.0, 4.0]]):
        with pytest.raises(TypeError) as e:
            _dgrams(blocks=blocks)
        assert str(e.value) == ("blocks must be a numpy array, (n, E) float32 or (n, P) "
                                f"uint8 coded payloads, got {type(blocks).__name__}")


@pytest.mark.parametrize("coding", [True, False, 1.0, 0.0, "1", None, np.float32(3)])
def test_encode_block_datagrams_refuses_a_coding_that_is_a_bool_or_not_an_int(coding):
    # True and 1.0 were taken as FP16 (True == 1.0 == 1)
    with pytest.raises(TypeError) as e:
        _dgrams(coding=coding, blocks=np.ones((1, 8), np.uint8))
    assert str(e.value) == (f"coding must be a Coding (an int), got "
                            f"{type(coding).__name__} {coding!r}")


def test_encode_block_datagrams_still_takes_a_coding_as_an_int_or_a_numpy_int():
    rows = np.ones((1, 8), np.uint8)
    want = _dgrams(coding=wire.Coding.FP16, blocks=rows)
    assert np.array_equal(_dgrams(coding=1, blocks=rows), want)
    assert np.array_equal(_dgrams(coding=np.int64(1), blocks=rows), want)


@pytest.mark.parametrize("key", [None, b"k"])
def test_encode_block_datagrams_refuses_a_datagram_over_the_udp_maximum(key):
    # 20,000 float32 values gave 80,034 B datagrams, which sendmsg refuses (EMSGSIZE)
    mac = wire.MAC_BYTES if key else 0
    with pytest.raises(ValueError) as e:
        _dgrams(blocks=np.ones((1, 20_000), np.float32), key=key)
    assert str(e.value) == (f"blocks: a datagram of {80_034 + mac} B (80000 B of block) "
                            "is over the UDP maximum of 65507 B")
    most = (wire.MAX_UDP_PAYLOAD - wire.HEADER_BYTES - mac) // 4   # still fits
    assert _dgrams(blocks=np.ones((1, most), np.float32), key=key).shape[1] <= 65507
    with pytest.raises(ValueError, match="over the UDP maximum of 65507 B"):
        _dgrams(blocks=np.ones((1, most + 1), np.float32), key=key)
    p = wire.MAX_UDP_PAYLOAD - wire.HEADER_BYTES - mac   # coded rows: the same limit
    assert _dgrams(coding=wire.Coding.INT8, blocks=np.ones((1, p), np.uint8),
                   key=key).shape[1] == 65507
    with pytest.raises(ValueError, match=f"a datagram of 65508 B \\({p + 1} B of block\\)"):
        _dgrams(coding=wire.Coding.INT8, blocks=np.ones((1, p + 1), np.uint8), key=key)


def test_encode_block_datagrams_refuses_channel_0_which_receivers_refuse():
    # channel 0 is the reliable (TCP) channel: a shard's session refuses a UDP BLOCKS
    # datagram on it (bad_udp_message, docs/wire.md "Header fields per message type")
    with pytest.raises(ValueError) as e:
        _dgrams(channel=0)
    assert str(e.value) == ("channel 0 is the reliable (TCP) channel: a UDP block "
                            "datagram goes on 1..7 (receivers refuse it: bad_udp_message)")
    import dataclasses
    h = wire.decode_header(bytes(_dgrams(channel=1)[0]))
    assert wire.udp_shape_problem(h) is None
    assert wire.udp_shape_problem(dataclasses.replace(h, channel=0)) == "bad_udp_message"


# -- stop 52's leftovers: what the wire library's callers get for odd inputs ----------

@pytest.mark.parametrize("buf", [None, 5, 1.5], ids=["None", "int", "float"])
def test_decoders_name_a_buffer_that_is_not_bytes_like(buf):
    # decode_header(None) said only "object of type 'NoneType' has no len()"
    with pytest.raises(TypeError, match=r"decode_header\(buf\): give a bytes-like object"):
        wire.decode_header(buf)
    with pytest.raises(TypeError, match=r"decode\(buf\): give one whole message"):
        wire.decode(buf)


def test_encode_names_a_payload_part_that_is_not_contiguous_or_not_bytes():
    # an array read backwards: "memoryview: casts are restricted to C-contiguous views"
    backwards = np.arange(8, dtype=np.float32)[::-1]
    for enc in (lambda p: _enc(payload=p),
                lambda p: wire.encode_parts(MsgType.BLOCKS, session=1, sender=0,
                                            parts=(b"ok", p))):
        with pytest.raises(TypeError, match=r"payload part \d is not C-contiguous .*"
                                            r"np\.ascontiguousarray"):
            enc(backwards)
    with pytest.raises(TypeError, match=r"payload part 1: a str is not bytes-like"):
        wire.encode_parts(MsgType.BLOCKS, session=1, sender=0, parts=(b"ok", "text"))
    with pytest.raises(TypeError, match=r"give a sequence of bytes-like objects"):
        wire.encode_parts(MsgType.BLOCKS, session=1, sender=0, parts=b"one object")
    # the same values, contiguous, are taken and come back
    h, payload = wire.decode(_enc(payload=np.ascontiguousarray(backwards)))
    assert np.frombuffer(payload, np.float32).tolist() == backwards.tolist()


@pytest.mark.parametrize("count,error,phrase", [
    (-1, ValueError, "count -1 is out of range"),
    ("1", TypeError, "count must be an integer"),
    (1.0, TypeError, "count must be an integer"),
    (True, TypeError, "count must be an integer")],
    ids=["negative", "str", "float", "bool"])
def test_unpack_indexed_blocks_refuses_a_count_that_is_no_count(count, error, phrase):
    # count "1" read 12 bytes against "need 11111111111111111111 B" (a str repeated)
    with pytest.raises(error, match=phrase):
        wire.unpack_indexed_blocks(memoryview(b"\0" * 20), count, ELEMS)


def test_unpack_indexed_blocks_still_takes_a_numpy_count():
    idx, blocks = wire.unpack_indexed_blocks(memoryview(b"\0" * 20), np.uint32(1), ELEMS)
    assert idx.tolist() == [0] and blocks.shape == (1, ELEMS)
