"""The UDP MAC (docs/wire.md, "UDP MAC"): the native helper (transport/_udpmac.c)
against the step-by-step Python of transport/udpmac.py, against SipHash's published
vectors, and against the spec's test vector; every flipped bit is refused."""
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from dgt.transport import udpmac, wire

SPEC = (Path(__file__).resolve().parents[1] / "docs" / "wire.md").read_text()

# SipHash-2-4, 128-bit output, key 00..0f, message 00..(i-1): the reference
# implementation's vectors.h (vectors_sip128), i = 0..9
SIP128 = ["a3817f04ba25a8e66df67214c7550293", "da87c1d86b99af44347659119b22fc45",
          "8177228da4a45dc7fca38bdef60affe4", "9c70b60c5267a94e5f33b6b02985ed51",
          "f88164c12d9c8faf7d0f6e7c7bcd5579", "1368875980776f8854527a07690e9627",
          "14eeca338b208613485ea0308fd7a15e", "a1f1ebbed8dbc153c0b84aa61ff08239",
          "3b62a9ba6258f5610f83e264f31497b4", "264499060ad9baabc47f8b02bb6d71ed"]


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def test_the_native_helper_is_built():
    """pip install builds it where a C compiler is (this machine, CI): the fast path.
    A build that broke silently (the extension is optional) fails here."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if _compiler() is None or not headers.exists():
        pytest.skip(reason="no C compiler or no Python headers: install Debian's gcc and "
                           "python3-dev, then pip install -e . again (the UDP MAC runs "
                           "in Python meanwhile)")
    assert udpmac.NATIVE, "transport/_udpmac.c was not built though a compiler is here"


@pytest.mark.parametrize("i", range(len(SIP128)))
def test_siphash128_matches_the_reference_vectors(i):
    key, msg = bytes(range(16)), bytes(range(i))
    assert udpmac.siphash128(key, msg).hex() == SIP128[i]
    if udpmac.NATIVE:
        assert udpmac._native.siphash128(key, msg).hex() == SIP128[i]


def test_native_and_python_agree_on_every_length_and_key():
    rng = np.random.default_rng(1)
    lengths = list(range(0, 80)) + list(range(1400, 1416)) + [4096, 65000]
    for key_len in (1, 10, 64):
        key = bytes(rng.integers(0, 256, key_len, np.uint8))
        for n in lengths:
            msg = bytes(rng.integers(0, 256, wire.HEADER_BYTES + n, np.uint8))
            keys = udpmac.derive_keys(key)
            assert udpmac.tag(keys, msg) == udpmac._py_tag(keys, msg), (key_len, n)


def test_the_spec_test_vector():
    """docs/wire.md's worked BLOCKS datagram with K = b"job-secret": its derived keys,
    hash values and tag, and the datagram byte for byte."""
    keys = udpmac.derive_keys(b"job-secret")
    k_prf = re.search(r"`k_prf = ([0-9a-f]{32})`", SPEC).group(1)
    nh_key16 = re.search(r"NH key bytes\s+0\.\.15 `([0-9a-f]{32})`", SPEC).group(1)
    nh = dict(re.findall(r"`NH_(\d) =\s+(0x[0-9a-f]+)`", SPEC))
    assert keys[:16].hex() == k_prf and keys[16:32].hex() == nh_key16
    assert len(keys) == 16 + 65512 and udpmac.NH_KEY_BYTES == 65512
    d = wire.encode_block_datagrams(
        session=0x0123456789ABCDEF, sender=1, shard=0, iteration=7, channel=2,
        indices=np.array([42]), blocks=np.array([[1.0, -2.0, 0.5, 3.25]], np.float32),
        key=b"job-secret")[0].tobytes()
    payload = d[wire.HEADER_BYTES:-wire.MAC_BYTES]
    assert udpmac.nh4(payload, keys[16:]) == [int(nh[str(j)], 16) for j in range(4)]
    dump = SPEC.split("A BLOCKS datagram on UDP channel 2")[1].split("```")[1]
    spec = bytes.fromhex("".join(re.sub(r"^[0-9a-f]{4}  ", "", ln)
                                 for ln in dump.strip().splitlines()).replace(" ", ""))
    assert d == spec
    assert wire.decode(d, b"job-secret")[0].block == 42


def test_nh_wraps_like_the_spec():
    """Payloads of 0xff bytes make every sum wrap mod 2^32 and every NH total wrap mod
    2^64: the native code and Python's exact big integers must agree."""
    keys = udpmac.derive_keys(b"k")
    for n in (8, 56, 57, 1408, 65457):
        msg = bytes(wire.HEADER_BYTES) + b"\xff" * n
        assert udpmac.tag(keys, msg) == udpmac._py_tag(keys, msg)
        words = [0xFFFFFFFF] * ((n + 7) // 8 * 2)
        for i in range(n, (n + 7) // 8 * 8):   # the zero padding
            words[i // 4] &= ~(0xFF << (8 * (i % 4)))
        kw = [int.from_bytes(keys[16 + 4 * t:20 + 4 * t], "little") for t in range(len(words) + 12)]
        for j in range(4):
            exact = sum(((words[2 * i] + kw[2 * i + 4 * j]) % 2**32)
                        * ((words[2 * i + 1] + kw[2 * i + 1 + 4 * j]) % 2**32)
                        for i in range(len(words) // 2)) % 2**64
            assert udpmac.nh4(msg[wire.HEADER_BYTES:], keys[16:])[j] == exact


def test_every_flipped_bit_is_refused():
    d = wire.encode_block_datagrams(
        session=7, sender=1, shard=0, iteration=3, channel=1, indices=np.array([5]),
        blocks=np.ones((1, 4), np.float32), key=b"s")[0]
    assert udpmac.match_one(udpmac.derive_keys(b"s"), d.tobytes())
    for bit in range(d.size * 8):
        bad = d.copy()
        bad[bit // 8] ^= 1 << (bit % 8)
        assert not udpmac.match_one(udpmac.derive_keys(b"s"), bad.tobytes()), bit
        assert not udpmac.match(udpmac.derive_keys(b"s"), bad.reshape(1, -1))[0], bit
    assert not udpmac.match_one(udpmac.derive_keys(b"other"), d.tobytes())


def test_one_forged_row_of_a_run_is_the_only_one_refused():
    rows = wire.encode_block_datagrams(
        session=7, sender=1, shard=0, iteration=3, channel=1, indices=np.arange(45),
        blocks=np.random.default_rng(0).standard_normal((45, 352)).astype(np.float32),
        key=b"s")
    rows[17, 40] ^= 0x10
    good = udpmac.match(udpmac.derive_keys(b"s"), rows)
    assert good.tolist() == [i != 17 for i in range(45)]


def test_the_python_fallback_signs_and_verifies_the_same(monkeypatch):
    """Where no C compiler was at install, the same bytes come from Python."""
    rows = wire.encode_block_datagrams(
        session=7, sender=2, shard=1, iteration=9, channel=3, indices=np.arange(3),
        blocks=np.arange(3 * 352, dtype=np.float32).reshape(3, 352), key=b"s")
    monkeypatch.setattr(udpmac, "_native", None)
    again = rows.copy()
    again[:, -16:] = 0
    udpmac.sign_rows(udpmac.derive_keys(b"s"), again)
    assert np.array_equal(again, rows)
    assert udpmac.match(udpmac.derive_keys(b"s"), rows).all() and udpmac.match_one(udpmac.derive_keys(b"s"), rows[0].tobytes())
    rows[1, 50] ^= 1
    assert udpmac.match(udpmac.derive_keys(b"s"), rows).tolist() == [True, False, True]


def test_a_tcp_frame_keeps_blake2b_and_a_udp_tail_marker_takes_the_udp_mac():
    """The MAC follows the header's channel (docs/wire.md, "Session id and key")."""
    tcp = wire.encode(wire.MsgType.BYE, session=7, sender=1, key=b"s")
    assert tcp[-16:] == wire.mac_tag(b"s", tcp[:-16])
    tail = wire.encode(wire.MsgType.END, session=7, sender=1, channel=2, iteration=4,
                       count=9, key=b"s")
    assert tail[-16:] == udpmac.tag(udpmac.derive_keys(b"s"), tail[:-16])
    for frame in (tcp, tail):
        wire.decode(frame, b"s")
        with pytest.raises(wire.WireError, match="bad_mac"):
            wire.decode(frame[:-1] + bytes([frame[-1] ^ 1]), b"s")
