"""Dissector: scapy layer vs wire.py, TCP reassembly, fuzzing. No root needed."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dgt.transport import wire
from dgt.tools import dissect
from dgt.tools.dissect import DGT, Dissector, L4

SESSION = 0xA1B2C3D4E5F60718
KEY = b"job-secret"


def all_messages(key=None):
    """One message of every type, with realistic payloads."""
    rng = np.random.default_rng(0)
    blocks = rng.standard_normal((3, 8)).astype(np.float32)
    msgs = [
        wire.encode(wire.MsgType.HELLO, session=SESSION, sender=1, shard=2, key=key),
        wire.encode(wire.MsgType.BLOCKS, session=SESSION, sender=1, shard=2, iteration=9,
                    channel=0, block=5, count=3, flags=wire.Flag.INDEXED, key=key,
                    payload=wire.pack_indexed_blocks(np.array([5, 9, 77]), blocks)),
        wire.encode_block_datagrams(session=SESSION, sender=1, shard=2, iteration=9,
                                    channel=2, indices=np.array([11]), blocks=blocks[:1],
                                    key=key)[0].tobytes(),
        wire.encode(wire.MsgType.END, session=SESSION, sender=1, shard=2, iteration=9,
                    count=12, payload=wire.pack_end([3, 5, 2, 2]), key=key),
        wire.encode(wire.MsgType.PULL, session=SESSION, sender=2, shard=2, iteration=9,
                    count=4, key=key, payload=wire.pack_pull(
                        np.arange(32, dtype=np.float32), np.array([1, 0, 1, 1]))),
        wire.encode(wire.MsgType.ERROR, session=SESSION, sender=0, block=3, key=key,
                    payload="rank 3 failed: ünïcode".encode()),
        wire.encode(wire.MsgType.BYE, session=SESSION, sender=1, key=key),
    ]
    return msgs


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "mac"])
def test_scapy_layer_round_trip_every_type(key):
    msgs = all_messages(key)
    assert {wire.decode_header(m).type for m in msgs} == {int(t) for t in wire.MsgType}
    for m in msgs:
        h, payload = wire.decode(m, key=key)
        p = DGT(m)
        for name, _ in wire.HEADER_FIELDS:
            got = int(getattr(p, name))
            want = {"magic": wire.MAGIC, "version": wire.VERSION}.get(name)
            assert got == (want if want is not None else getattr(h, name)), name
        assert p.data == bytes(payload)
        if key:
            assert p.mac == m[-wire.MAC_BYTES:]
        assert bytes(p) == m  # byte for byte
        # build from fields (length filled in by post_build) gives the same bytes
        built = DGT(type=h.type, channel=h.channel, flags=h.flags, session=h.session,
                    sender=h.sender, shard=h.shard, iteration=h.iteration, block=h.block,
                    count=h.count, data=bytes(payload),
                    **({"mac": m[-wire.MAC_BYTES:]} if key else {}))
        assert bytes(built) == m


def test_scapy_fields_mirror_wire_header_fields():
    names = [f.name for f in DGT.fields_desc][:len(wire.HEADER_FIELDS)]
    assert names == [n for n, _ in wire.HEADER_FIELDS]
    assert len(bytes(DGT())) == wire.HEADER_BYTES


def test_stacked_messages_and_describe():
    msgs = all_messages(KEY)
    layers = dissect.scapy_messages(b"".join(msgs))
    assert [int(x.type) for x in layers] == [wire.decode_header(m).type for m in msgs]
    h, p = wire.decode(msgs[3])
    assert dissect.describe_payload(h, p) == {"end_counts": [3, 5, 2, 2, 0, 0, 0, 0]}
    h, p = wire.decode(msgs[1])
    assert dissect.describe_payload(h, p) == {"blocks": [5, 9, 77]}
    h, p = wire.decode(msgs[5])
    assert dissect.describe_payload(h, p)["error"].startswith("rank 3 failed")


def _udp(payload: bytes, frame=1) -> L4:
    return L4(frame, frame * 1000, "udp", "127.0.0.1", 40000, "127.0.0.1", 47001, 34, payload)


def _seg(payload: bytes, seq: int, frame: int, flags=0x18) -> L4:
    return L4(frame, frame * 1000, "tcp", "127.0.0.1", 40001, "127.0.0.1", 47000, 46,
              payload, seq & 0xFFFFFFFF, flags)


def test_udp_datagrams_and_gso_superpacket():
    d = Dissector(None)
    dgs = wire.encode_block_datagrams(session=SESSION, sender=0, shard=1, iteration=3,
                                      channel=1, indices=np.arange(5),
                                      blocks=np.ones((5, 4), np.float32))
    out = d.feed(_udp(dgs[0].tobytes()))
    assert len(out) == 1 and out[0].header.block == 0 and out[0].data == dgs[0].tobytes()
    out = d.feed(_udp(dgs.tobytes(), 2))  # a GSO super-packet seen on the tap
    assert [m.header.block for m in out] == [0, 1, 2, 3, 4] and all(m.gso for m in out)
    assert d.undecodable == 0
    assert d.feed(_udp(b"DG\x01" + b"\x00" * 10, 3)) == [] and d.reasons["short"] == 1
    assert d.feed(_udp(dgs[0].tobytes()[:-1], 4)) == [] and d.reasons["bad_length"] == 1


@pytest.mark.parametrize("chunk", [1, 7, 33, 35, 97, 1000])
def test_tcp_reassembly_odd_chunks(chunk):
    stream = b"".join(all_messages(KEY) * 3)
    d = Dissector(None)
    isn = 0xFFFFFF00  # wraps around 2**32 inside the stream
    assert d.feed(_seg(b"", isn, 1, flags=0x02)) == []
    got = []
    for i, off in enumerate(range(0, len(stream), chunk)):
        got += d.feed(_seg(stream[off:off + chunk], isn + 1 + off, i + 2))
    d.finish()
    assert b"".join(m.data for m in got) == stream
    assert len(got) == 21 and d.undecodable == 0


def test_tcp_reassembly_out_of_order_and_retransmissions():
    stream = b"".join(all_messages())
    isn = 1000
    d = Dissector(None)
    d.feed(_seg(b"", isn, 1, flags=0x02))
    chunks = [(off, stream[off:off + 50]) for off in range(0, len(stream), 50)]
    order = chunks[::2] + chunks[1::2] + chunks[:5]  # evens first, then odds, then dupes
    got = []
    for i, (off, data) in enumerate(order):
        got += d.feed(_seg(data, isn + 1 + off, i + 2))
    # an overlapping retransmission that straddles old and new bytes changes nothing
    got += d.feed(_seg(stream[10:90], isn + 11, 999))
    assert b"".join(m.data for m in got) == stream
    assert d.undecodable == 0


def test_tcp_mid_stream_pickup_resyncs():
    msgs = all_messages()
    stream = b"".join(msgs)
    d = Dissector(None)
    d.ports = dissect.PortSpec(tcp=frozenset({47000}), udp=frozenset())  # explicit ports
    got = d.feed(_seg(stream[13:], 5000, 1))  # no SYN, starts inside message 0
    assert [m.data for m in got] == msgs[1:]
    assert d.reasons["tcp_resync"] >= 1


@pytest.mark.parametrize("chunk", [5, 40, 100000])
def test_tcp_mid_stream_pickup_without_ports_is_found_by_its_headers(chunk):
    """No ports given and no SYN: a stream that starts inside a frame is still taken
    for dgt once a header that decodes comes (before, it was dropped as not dgt for
    its first two bytes); a stream of other bytes is not, even with dgt's magic in it."""
    msgs = all_messages()
    stream = b"".join(msgs)[13:]
    d = Dissector(None)
    got = []
    for i, off in enumerate(range(0, len(stream), chunk)):
        got += d.feed(_seg(stream[off:off + chunk], 5000 + off, i + 1))
    assert [m.data for m in got] == msgs[1:]
    assert d.reasons["tcp_resync"] >= 1
    other = Dissector(None)
    junk = (b"GET / HTTP/1.1\r\n" + b"DG\x01" + bytes(40)) * 4000   # > PROBE_BYTES
    for i, off in enumerate(range(0, len(junk), 1400)):
        assert other.feed(_seg(junk[off:off + 1400], 9000 + off, i + 1)) == []
    assert other.streams and all(s.is_dgt is False for s in other.streams.values())


def test_truncated_stream_counts_undecodable():
    m = all_messages()[1]
    d = Dissector(None)
    d.feed(_seg(b"", 0, 1, flags=0x02))
    assert d.feed(_seg(m[:-3], 1, 2)) == []
    d.finish()
    assert d.reasons["truncated"] == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**32 - 1))
def test_fuzz_random_bytes_never_raise(data, seq):
    d = Dissector(None)
    d.feed(_udp(data))
    d.feed(_udp(b"DG" + data))
    d.feed(_seg(data, seq, 2))
    d.feed(_seg(b"DG\x01" + data, seq, 3))
    d.finish()
    dissect.scapy_messages(data)
    dissect.scapy_messages(b"DG\x01" + data)
    h = wire.Header(2, 0, 2, 0, 0, 0, 0, 0, 2**32 - 1, len(data))
    dissect.describe_payload(h, data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(7)), st.lists(st.tuples(st.integers(0, 60), st.integers(0, 255)),
                                           max_size=6), st.integers(1, 64))
def test_fuzz_mutated_messages_never_raise(which, edits, chunk):
    m = bytearray(all_messages(KEY)[which])
    for pos, val in edits:
        if pos < len(m):
            m[pos] = val
    d = Dissector(None)
    d.feed(_udp(bytes(m)))
    d.feed(_seg(b"", 0, 1, flags=0x02))
    for off in range(0, len(m), chunk):
        d.feed(_seg(bytes(m[off:off + chunk]), 1 + off, 2))
    d.finish()
    dissect.scapy_messages(bytes(m))


def test_parse_packet_garbage_never_raises():
    rec = dissect.RawRecord(1, 0, b"\x00" * 13)
    for lt in (1, 101, 113, 276, 228, 9999):
        assert dissect.parse_packet(lt, rec) is None
    eth = b"\x00" * 12 + b"\x08\x00" + bytes([0x45, 0x88]) + struct.pack("!H", 100) + b"\x00" * 5
    assert dissect.parse_packet(1, dissect.RawRecord(1, 0, eth)) is None


def test_read_pcap_rejects_non_pcap(tmp_path):
    p = tmp_path / "x.pcap"
    p.write_bytes(b"not a pcap at all, clearly")
    with pytest.raises(dissect.PcapError, match=r"not a pcap file \(magic 6e6f7420;"):
        list(dissect.read_pcap(p))
    p.write_bytes(b"\xd4\xc3\xb2\xa1" + bytes(10))   # a pcap's magic, a header cut off
    with pytest.raises(dissect.PcapError, match=r"too short: 14 bytes, a pcap header is"):
        list(dissect.read_pcap(p))
    with pytest.raises(dissect.PcapError, match="cannot open"):
        list(dissect.read_pcap(tmp_path / "missing.pcap"))


def test_docs_wire_md_worked_example_matches_code():
    import pathlib
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "wire.md").read_text()
    d = wire.encode_block_datagrams(session=0x0123456789ABCDEF, sender=1, shard=0,
                                    iteration=7, channel=2, indices=np.array([42]),
                                    blocks=np.array([[1.0, -2.0, 0.5, 3.25]], np.float32),
                                    key=b"job-secret")[0].tobytes()
    e = wire.encode(wire.MsgType.END, session=0x0123456789ABCDEF, sender=1, shard=0,
                    iteration=7, count=10, payload=wire.pack_end([4, 3, 2, 1]))
    for b in (d, e):
        dump = "\n".join(f"{i:04x}  " + " ".join(f"{x:02x}" for x in b[i:i + 16])
                         for i in range(0, len(b), 16))
        assert dump in doc


def test_a_tail_marker_is_described_not_called_malformed():
    """END on a UDP channel (empty payload) is a tail marker; END on TCP without its
    counts stays malformed."""
    m = wire.encode(wire.MsgType.END, session=1, sender=0, shard=1, iteration=2,
                    channel=3, count=17)
    h, payload = wire.decode(m)
    assert dissect.describe_payload(h, payload) == {"tail_count": 17}
    t = wire.encode(wire.MsgType.END, session=1, sender=0, shard=1, iteration=2,
                    channel=0, count=17)
    h, payload = wire.decode(t)
    assert dissect.describe_payload(h, payload)["malformed"]


def _shard_session():
    from dgt.transport.session import ShardSession
    return ShardSession(session=SESSION, shard=1, lo=10, hi=20, block_elems=4,
                        n_workers=2, deadline_s=0.05)   # shard 1 needs 2 workers


def _block(b, elems=4):
    return wire.encode(wire.MsgType.BLOCKS, session=SESSION, sender=0, shard=1, iteration=0,
                       channel=1, block=b, count=1,
                       payload=np.full(elems, 1.0, np.float32).tobytes())


def _marker(ch=1, count=3):
    return wire.encode(wire.MsgType.END, session=SESSION, sender=0, shard=1, iteration=0,
                       channel=ch, count=count)


@pytest.mark.parametrize("parts, blocks, markers", [
    ([_marker(), _block(10)], 0, 0),              # unequal, not blocks first: refused whole
    ([_block(10), bytes(len(_block(11))), _block(12)], 2, 0),   # one bad row of three
    ([_block(10), _block(11), _block(12), _marker()], 3, 1),    # a GSO run and its marker
    ([_marker(), _marker()], 0, 1),               # a marker and its copy
    ([_block(10), _block(11, elems=8)], 1, 0),    # a longer second message
    # rows of the first message's size: the third straddles both markers, the tail is short
    ([_block(10), _block(11), _marker(), _marker(2, 0)], 2, 0),
], ids=["marker+block", "bad-middle-row", "run+marker", "marker-copy", "longer-second",
        "run+2-markers"])
def test_a_coalesced_datagram_is_split_as_a_receiver_splits_it(parts, blocks, markers):
    """``dgt pcap summary`` counts of a datagram holding several messages what a
    receiving shard takes of it, no more (breaker round 11's leftover: a datagram whose
    messages differ in size had its first message counted, which a receiver refuses)."""
    buf = b"".join(parts)
    s = _shard_session()
    s.receive_datagram(buf, now=0.0)
    took_blocks = sum(s.counters.channels[c].blocks_delivered for c in range(1, 4))
    took_markers = int((s.tail >= 0).sum())
    out = Dissector(None).feed(_udp(buf))
    seen_blocks = sum(m.header.type == wire.MsgType.BLOCKS for m in out)
    seen_markers = len({(m.header.sender, m.header.channel) for m in out
                        if m.header.type == wire.MsgType.END})
    assert (took_blocks, took_markers) == (blocks, markers)
    assert (seen_blocks, seen_markers) == (blocks, markers)
