import pytest

from dgt.transport import wire
from dgt.transport.framing import Deframer
from dgt.transport.wire import MsgType, WireError


def frames():
    return [wire.encode(MsgType.BLOCKS, session=9, sender=1, iteration=i, payload=b"x" * (i * 37))
            for i in range(6)]


@pytest.mark.parametrize("chunk", [1, 2, 7, 33, 34, 35, 100, 4096])
def test_frames_split_at_any_boundary(chunk):
    stream = b"".join(frames())
    d = Deframer()
    got = []
    for i in range(0, len(stream), chunk):
        got += [(h.iteration, bytes(p)) for h, p in d.feed(stream[i:i + chunk])]
    assert got == [(i, b"x" * (i * 37)) for i in range(6)]
    assert d.buffered == 0


def test_bad_header_raises_wire_error():
    d = Deframer()
    with pytest.raises(WireError) as e:
        d.feed(b"\x00" * 40)
    assert e.value.reason == "bad_magic"


def test_mac_enforced_on_stream():
    d = Deframer(key=b"s")
    good = wire.encode(MsgType.END, session=1, sender=0, key=b"s")
    assert len(d.feed(good)) == 1
    with pytest.raises(WireError) as e:
        d.feed(wire.encode(MsgType.END, session=1, sender=0))
    assert e.value.reason == "no_mac"
