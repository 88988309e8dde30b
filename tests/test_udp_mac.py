"""The UDP MAC (docs/wire.md, "The UDP MAC"): a Carter-Wegman MAC. A reference written
from the spec alone, one message at a time in Python integers, must give the test
vector and agree with the vectorised ``wire.UdpMac``; a flipped bit anywhere, or a tag
moved to another nonce, is refused by the shard; a keyed job ends with the plain job's
bits."""
import hashlib
import pathlib
import struct

import numpy as np
import pytest

from conftest import run_train
from dgt.transport import wire
from dgt.transport.reasons import Rejected
from dgt.transport.session import BlocksArrived, ShardSession
from dgt.transport.wire import MsgType

P = 2 ** 26 - 5
SECRET = b"job-secret"
SESSION = 0x0123456789ABCDEF
DOC = (pathlib.Path(__file__).parents[1] / "docs" / "wire.md").read_text()


# -- the reference: the spec's seven steps, one message, Python integers --------------
def ref_values(stream: bytes, n: int) -> list[int]:
    out = []
    for (w,) in struct.iter_unpack("<I", stream):
        v = w & 0x3FFFFFF
        if v < P:
            out.append(v)
            if len(out) == n:
                return out
    raise AssertionError("stream too short")


def ref_keys(secret: bytes):
    hash_key = hashlib.blake2b(b"", digest_size=32, key=secret,
                               person=b"dgt-udp-mac-hash").digest()
    pad_key = hashlib.blake2b(b"", digest_size=32, key=secret,
                              person=b"dgt-udp-mac-pads").digest()
    return hash_key, pad_key


def ref_matrix(hash_key: bytes, columns: int) -> list[list[int]]:
    v = ref_values(hashlib.shake_128(hash_key).digest(4 * (4 * columns + 64)), 4 * columns)
    return [[v[4 * j + i] for j in range(columns)] for i in range(4)]


def ref_pad(pad_key: bytes, session, sender, shard, iteration, channel, mtype, block):
    nonce = struct.pack(">QHHIBBI", session, sender, shard, iteration, channel, mtype,
                        block >> 8)
    v = ref_values(hashlib.shake_128(pad_key + nonce).digest(4 * 1100), 1024)
    return [v[4 * (block % 256) + i] for i in range(4)]


def ref_hash(k: list[list[int]], m: bytes) -> list[int]:
    words = [m[2 * j] + 256 * (m[2 * j + 1] if 2 * j + 1 < len(m) else 0)
             for j in range((len(m) + 1) // 2)]
    return [(k[i][0] * len(m) + sum(k[i][j + 1] * w for j, w in enumerate(words))) % P
            for i in range(4)]


def ref_tag(k, pad, m: bytes) -> bytes:
    return struct.pack("<4I", *((h + r) % P for h, r in zip(ref_hash(k, m), pad)))


@pytest.fixture(scope="module")
def ref():
    hash_key, pad_key = ref_keys(SECRET)
    return ref_matrix(hash_key, 4100), pad_key   # enough columns for 8 KiB messages


def example() -> bytes:
    """The BLOCKS datagram of docs/wire.md's worked example (its test vector)."""
    return wire.encode_block_datagrams(
        session=SESSION, sender=1, shard=0, iteration=7, channel=2,
        indices=np.array([42]), blocks=np.array([[1.0, -2.0, 0.5, 3.25]], np.float32),
        key=SECRET)[0].tobytes()


def test_the_test_vector_of_the_spec(ref):
    """Every value of docs/wire.md's test vector, from the reference and from the code."""
    k, pad_key = ref
    hash_key, _ = ref_keys(SECRET)
    d = example()
    pad = ref_pad(pad_key, SESSION, 1, 0, 7, 2, MsgType.BLOCKS, 42)
    h = ref_hash(k, d[:50])
    tag = ref_tag(k, pad, d[:50])
    for text in (f"| `hash_key` | `{hash_key.hex()}` |", f"| `pad_key` | `{pad_key.hex()}` |",
                 "| K column 0 (i = 0..3) | " + ", ".join(str(k[i][0]) for i in range(4)),
                 "| K column 1 | " + ", ".join(str(k[i][1]) for i in range(4)),
                 "| pad of block 42 | " + ", ".join(map(str, pad)),
                 "| H (L = 50) | " + ", ".join(map(str, h)),
                 "| T | " + ", ".join(map(str, struct.unpack("<4I", tag))),
                 "| MAC bytes | `" + " ".join(f"{b:02x}" for b in tag) + "` |"):
        assert text in DOC, text
    assert d[50:] == tag   # the code agrees with the reference
    assert d[:50] + tag == wire.encode_datagram(
        MsgType.BLOCKS, session=SESSION, sender=1, shard=0, iteration=7, channel=2,
        block=42, count=1, payload=d[34:50], key=SECRET)
    assert wire.udp_mac(SECRET).pad_key == pad_key


@pytest.mark.parametrize("seed", [0, 1])
def test_the_vectorised_mac_agrees_with_the_reference(ref, seed):
    """Random batches of random lengths (odd ones, and over 4,094 B: reduced per
    2,046 words), random pads: the same tags as the reference, and ``match`` says
    exactly which rows were spoilt."""
    k, _ = ref
    rng = np.random.default_rng(seed)
    mac = wire.udp_mac(SECRET)
    for length in (34, 35, 50, 1442, 4094, 4095, 8191):
        n = 5
        msgs = rng.integers(0, 256, (n, length), dtype=np.uint8)
        pads = rng.integers(0, P, (n, 4)).astype(np.uint32)
        tags = mac.tags(msgs, pads)
        for i in range(n):
            assert tags[i].tobytes() == ref_tag(k, pads[i].tolist(), msgs[i].tobytes()), length
        rows = np.concatenate([msgs, tags], axis=1)
        spoilt = rng.random(n) < 0.5
        for i in np.flatnonzero(spoilt):
            rows[i, rng.integers(0, length + 16)] ^= 1 << int(rng.integers(0, 8))
        assert (mac.match(rows, pads) == ~spoilt).all(), length
        for i in range(n):
            assert mac.match_one(rows[i].tobytes(), pads[i]) == (not spoilt[i])
            assert mac.match_one(rows[i].tobytes(), tuple(pads[i].tolist())) == (not spoilt[i])


def test_a_tag_value_of_p_or_more_never_matches():
    """T and T + p are the same mod p: only the canonical value is the tag."""
    mac = wire.udp_mac(SECRET)
    d = bytearray(example())
    pad = mac.pad_chunk(SESSION, 1, 0, 7, 2, MsgType.BLOCKS, 0)[42]
    assert mac.match_one(bytes(d), pad)
    t0 = struct.unpack_from("<I", d, 50)[0]
    struct.pack_into("<I", d, 50, t0 + P)
    assert not mac.match_one(bytes(d), pad)
    assert not mac.match(np.frombuffer(bytes(d), np.uint8)[None], pad[None])[0]


ELEMS = 352


def shard_session(iteration=0):
    s = ShardSession(session=SESSION, shard=0, lo=0, hi=600, block_elems=ELEMS,
                     n_workers=3, deadline_s=1.0, key=SECRET)
    for _ in range(iteration):
        s.advance()
    return s


def datagrams(blocks, it=0, sender=1, ch=1, seed=0):
    data = np.random.default_rng(seed).standard_normal((len(blocks), ELEMS)).astype(np.float32)
    return wire.encode_block_datagrams(session=SESSION, sender=sender, shard=0, iteration=it,
                                       channel=ch, indices=np.array(blocks), blocks=data,
                                       key=SECRET)


def delivered(events) -> int:
    return sum(np.size(e.rows) for e in events if isinstance(e, BlocksArrived))


@pytest.mark.parametrize("gro", [False, True], ids=["one", "gro"])
def test_a_flipped_bit_anywhere_is_refused(gro):
    """Every bit of a datagram's header, payload and tag, one at a time: never
    delivered; the unspoilt datagram still is."""
    d = datagrams([300])[0]
    flips = []
    for byte in range(d.size):
        for bit in range(8):
            x = d.copy()
            x[byte] ^= 1 << bit
            flips.append(x)
    s = shard_session()
    if gro:   # runs of 40 spoilt datagrams, each verified in one call
        rows = np.stack(flips)
        for a in range(0, len(rows), 40):
            assert delivered(s.receive_datagram(rows[a:a + 40].tobytes(), now=0)) == 0
    else:
        for x in flips:
            assert delivered(s.receive_datagram(x.tobytes(), now=0)) == 0
    assert s.counters.rejected["bad_mac"] > 0.9 * len(flips), dict(s.counters.rejected)
    assert delivered(s.receive_datagram(d.tobytes(), now=0)) == 1


@pytest.mark.parametrize("gro", [False, True], ids=["one", "gro"])
@pytest.mark.parametrize("moved", ["block", "iteration", "channel", "sender"])
def test_a_tag_moved_to_another_nonce_is_refused(gro, moved):
    """The same payload under another block, iteration, channel or sender, with the
    tag of the original: bad_mac. The original itself is accepted."""
    it = 1
    kw = {"block": 301, "iteration": it, "channel": 1, "sender": 1}
    orig = datagrams([kw["block"]], it=kw["iteration"], ch=kw["channel"], sender=kw["sender"])
    other = dict(kw)
    other[moved] += 1 if moved != "iteration" else -1   # t - 1 is still checked
    real = datagrams([other["block"]], it=other["iteration"], ch=other["channel"],
                     sender=other["sender"])   # same payload (same seed), its own tag
    fake = real.copy()
    fake[:, wire.HEADER_BYTES:] = orig[:, wire.HEADER_BYTES:]   # payload and tag
    s = shard_session(iteration=it)
    n = 3 if gro else 1
    events = s.receive_datagram(np.repeat(fake, n, axis=0).tobytes(), now=0)
    assert Rejected("bad_mac") in events and delivered(events) == 0
    assert s.counters.rejected["bad_mac"] == n
    assert delivered(s.receive_datagram(orig.tobytes(), now=0)) == 1
    # the real datagrams of the other nonce pass their MAC: delivered, late (t - 1) or
    # duplicates (the same block on another channel), never bad_mac
    s.receive_datagram(np.repeat(real, n, axis=0).tobytes(), now=0)
    assert s.counters.rejected["bad_mac"] == n
    assert sum(c.blocks_delivered + c.blocks_late + c.blocks_duplicate
               for c in s.counters.channels) == 1 + n


def test_a_run_with_one_forgery_delivers_the_rest():
    """A GRO run of 45 with one spoilt tag, and a run mixing two senders' datagrams:
    exactly the spoilt ones are refused."""
    s = shard_session()
    rows = datagrams(list(range(100, 145)))
    rows[17, -1] ^= 0x80
    events = s.receive_datagram(rows.tobytes(), now=0)
    assert delivered(events) == 44 and s.counters.rejected["bad_mac"] == 1
    mixed = np.concatenate([datagrams([200, 201], sender=1), datagrams([202, 203], sender=2)])
    mixed[2, 40] ^= 1
    events = s.receive_datagram(mixed.tobytes(), now=0)
    assert delivered(events) == 3 and s.counters.rejected["bad_mac"] == 2


def test_a_tail_marker_with_the_udp_mac():
    """A tail marker carries the UDP MAC of type END, block 0: accepted; with the
    BLAKE2b tag of a TCP frame, or a block other than 0, refused."""
    s = shard_session()
    kw = dict(session=SESSION, sender=1, shard=0, iteration=0, channel=2, count=0)
    good = wire.encode_datagram(MsgType.END, key=SECRET, **kw)
    tcp = wire.encode(MsgType.END, key=SECRET, **kw)
    moved = wire.encode_datagram(MsgType.END, key=SECRET, block=256, **kw)
    assert s.receive_datagram(tcp, now=0) == [Rejected("bad_mac")]
    assert s.receive_datagram(moved, now=0) == [Rejected("bad_tail")]
    assert s.receive_datagram(good, now=0) == []
    assert s.tail[1, 2] == 0


@pytest.mark.slow
def test_a_keyed_job_ends_with_the_plain_job_s_bits(tmp_path):
    """The same seed with and without --secret: identical replicas, the same SHA-256
    (a 10 s deadline: on a loaded machine no block is lost, so the bits must agree)."""
    job = ("--workers", 3, "--iterations", 8, "--hidden", 64, "--seed", 5,
           "--deadline-ms", 10000)
    _, plain = run_train(tmp_path / "plain", *job)
    _, keyed = run_train(tmp_path / "keyed", *job, "--secret", "s3cret-of-this-job")
    for r in (plain, keyed):
        assert r["replicas_identical"]
        assert not {c: v["blocks_lost"] for c, v in r["channels"].items() if v["blocks_lost"]}
    assert keyed["param_sha256"] == plain["param_sha256"]
    udp = [v for c, v in keyed["channels"].items() if c != "tcp"]
    assert sum(v["blocks_delivered"] for v in udp) > 0   # the UDP MAC was used and held
