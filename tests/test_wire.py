import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dgt.transport import wire
from dgt.transport.wire import Flag, MsgType, WireError

SESSION = 0x0123456789ABCDEF


@pytest.mark.parametrize("mtype", list(MsgType))
@pytest.mark.parametrize("key", [None, b"job-secret"])
def test_round_trip_every_type(mtype, key):
    payload = bytes(range(256)) * 3
    buf = wire.encode(mtype, session=SESSION, sender=3, shard=2, iteration=77, channel=1,
                      block=1234, count=5, payload=payload, key=key)
    h, p = wire.decode(buf, key)
    assert (h.type, h.session, h.sender, h.shard, h.iteration, h.channel, h.block,
            h.count, h.length) == (mtype, SESSION, 3, 2, 77, 1, 1234, 5, len(payload))
    assert bytes(p) == payload
    assert bool(h.flags & Flag.MAC) == (key is not None)
    assert len(buf) == wire.HEADER_BYTES + len(payload) + (wire.MAC_BYTES if key else 0)


def test_header_is_34_bytes_big_endian():
    buf = wire.encode(MsgType.END, session=1, sender=0x0102, iteration=0x0A0B0C0D)
    assert wire.HEADER_BYTES == 34
    assert buf[:2] == b"DG"
    assert buf[14:16] == b"\x01\x02"
    assert buf[18:22] == b"\x0a\x0b\x0c\x0d"


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:10], "short"),
    (lambda b: b"XX" + b[2:], "bad_magic"),
    (lambda b: b[:2] + b"\x09" + b[3:], "bad_version"),
    (lambda b: b[:3] + b"\x63" + b[4:], "bad_type"),
    (lambda b: b[:4] + b"\x08" + b[5:], "bad_channel"),
    (lambda b: b + b"\x00", "bad_length"),
    (lambda b: b[:-1], "bad_length"),
])
def test_decode_names_the_rule(mutate, reason):
    buf = wire.encode(MsgType.BLOCKS, session=1, sender=0, payload=b"\x00" * 8)
    with pytest.raises(WireError) as e:
        wire.decode(mutate(buf))
    assert e.value.reason == reason


def test_mac_rejects_tampering_and_missing_tag():
    key = b"k"
    buf = bytearray(wire.encode(MsgType.BLOCKS, session=1, sender=0, payload=b"abcd", key=key))
    buf[wire.HEADER_BYTES] ^= 1
    with pytest.raises(WireError) as e:
        wire.decode(bytes(buf), key)
    assert e.value.reason == "bad_mac"
    plain = wire.encode(MsgType.BLOCKS, session=1, sender=0, payload=b"abcd")
    with pytest.raises(WireError) as e:
        wire.decode(plain, key)
    assert e.value.reason == "no_mac"


def test_length_is_never_trusted():
    h = wire.Header(MsgType.PULL, 0, 0, 1, 0, 0, 0, 0, 0, wire.MAX_FRAME_PAYLOAD + 1)
    with pytest.raises(WireError) as e:
        wire.decode_header(wire.HEADER.pack(wire.MAGIC, wire.VERSION, *[
            h.type, h.channel, h.flags, h.session, h.sender, h.shard, h.iteration,
            h.block, h.count, h.length]))
    assert e.value.reason == "too_long"


@pytest.mark.parametrize("key", [None, b"secret"])
def test_vectorised_datagrams_equal_single_encodes(key):
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((7, 352)).astype(np.float32)
    idx = np.array([3, 9, 10, 11, 40, 41, 99])
    batch = wire.encode_block_datagrams(session=SESSION, sender=1, shard=2, iteration=5,
                                        channel=3, indices=idx, blocks=blocks, key=key)
    for i in range(7):
        one = wire.encode(MsgType.BLOCKS, session=SESSION, sender=1, shard=2, iteration=5,
                          channel=3, block=int(idx[i]), count=1, payload=blocks[i].tobytes(),
                          key=key)
        assert batch[i].tobytes() == one
    assert batch.shape[1] + 28 <= 1500  # one datagram fits a 1500 B MTU with IP+UDP


def test_payload_layouts_round_trip():
    rng = np.random.default_rng(1)
    idx = np.array([5, 1, 7], np.int64)
    blocks = rng.standard_normal((3, 4)).astype(np.float32)
    i2, b2 = wire.unpack_indexed_blocks(memoryview(wire.pack_indexed_blocks(idx, blocks)), 3, 4)
    assert i2.tolist() == [5, 1, 7] and np.array_equal(b2, blocks)
    counts = wire.unpack_end(memoryview(wire.pack_end([4, 3, 2, 1])))
    assert counts.tolist() == [4, 3, 2, 1, 0, 0, 0, 0]
    agg = rng.standard_normal(11 * 4).astype(np.float32)
    rec = rng.random(11) > 0.5
    a2, r2 = wire.unpack_pull(memoryview(wire.pack_pull(agg, rec)), 11, 4)
    assert np.array_equal(a2, agg) and np.array_equal(r2, rec)
    with pytest.raises(WireError):
        wire.unpack_pull(memoryview(wire.pack_pull(agg, rec))[:-1], 11, 4)
    with pytest.raises(WireError):
        wire.unpack_indexed_blocks(memoryview(b"\x00" * 5), 3, 4)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_never_raises_anything_but_wire_error_on_random_bytes(data):
    try:
        wire.decode(data)
    except WireError:
        pass


VALID = wire.encode(MsgType.BLOCKS, session=SESSION, sender=1, shard=0, iteration=3,
                    channel=2, block=4, count=1, payload=np.ones(352, np.float32).tobytes())


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID)))
def test_decoder_on_mutated_valid_messages(flips, cut):
    buf = bytearray(VALID)
    for pos, val in flips:
        buf[pos] = val
    try:
        h, p = wire.decode(bytes(buf[:cut]))
    except WireError:
        return
    assert wire.frame_size(h) == cut and len(p) == h.length


def test_the_int8_worked_example_of_the_spec_is_what_the_code_sends():
    """docs/wire.md's int8 datagram, byte for byte, and its decoded values."""
    import re
    from pathlib import Path

    import torch

    from dgt import codec
    rows = codec.encode(wire.Coding.INT8, torch.tensor([[1.0, -2.0, 0.5, 3.25]]))
    d = wire.encode_block_datagrams(session=0x0123456789ABCDEF, sender=1, shard=0,
                                    iteration=7, channel=3, indices=np.array([42]),
                                    blocks=rows, coding=wire.Coding.INT8)[0]
    text = (Path(__file__).resolve().parents[1] / "docs" / "wire.md").read_text()
    dump = text.split("coded as int8")[1].split("```")[1]
    spec = bytes.fromhex("".join(re.sub(r"^[0-9a-f]{4}  ", "", ln)
                                 for ln in dump.strip().splitlines()).replace(" ", ""))
    assert d.tobytes() == spec
    assert d[5] == wire.Coding.INT8 << wire.CODING_SHIFT
    h, payload = wire.decode(d.tobytes())
    assert wire.coding_of(h.flags) == wire.Coding.INT8
    assert h.length == wire.coded_payload_bytes(wire.Coding.INT8, 4) == 8
    dec = codec.decode(wire.Coding.INT8, np.frombuffer(payload, np.uint8)[None], 4)
    assert dec.tolist() == [[np.float32(v) for v in (0.99803156, -1.9960631, 0.511811,
                                                     3.25)]]
