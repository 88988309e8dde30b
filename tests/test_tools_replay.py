"""dgt replay: port rewriting, byte-identical delivery, filters, computed schedule."""
from __future__ import annotations

import os
import json
import struct
import subprocess
import sys
import time
from collections import Counter

import pytest

from dgt.transport import wire
from dgt.tools import dissect, replay, synth

root = pytest.mark.skipif(os.geteuid() != 0, reason="capture needs root (AF_PACKET)")


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    cfg = synth.SynthConfig(base_port=synth.free_base_port(2), iterations=4,
                            blocks=(3, 4, 3, 2))
    sent, spec = synth.captured_run(cfg, str(d / "run.pcap"))
    return cfg, spec, d / "run.pcap"


def _expected(pcap, spec, keep):
    """Messages a replay must deliver: client-to-server TCP frames and all datagrams."""
    msgs, d = dissect.messages_from_pcap(pcap, spec)
    out = []
    for m in msgs:
        if m.proto == "tcp" and (m.dst, m.dport) != d.server_endpoint(m):
            continue
        if keep(m.header):
            out.append((m.proto, m.dport, m.data))
    return out


@root
def test_replay_rewrites_ports_byte_identical(cap, tmp_path):
    cfg, spec, pcap = cap
    new_base = synth.free_base_port(2)
    old_ports = [p for s in cfg.sidecars() for p in [s["tcp_port"], *s["udp_ports"]]]
    shift = new_base - cfg.base_port
    rec = synth.Recorder("127.0.0.1", tcp_ports=[new_base, new_base + 10],
                         udp_ports=[p + shift for p in old_ports if (p - cfg.base_port) % 10])
    pm = {p: p + shift for p in old_ports}
    rc = replay.ReplayConfig(files=[str(pcap)], to_host="127.0.0.1", port_map=pm, speed=4.0)
    rep = replay.replay(rc)
    time.sleep(0.3)
    got = rec.close()
    want = _expected(pcap, spec, lambda h: True)
    assert Counter((p, port - shift, data) for p, port, data in got) == Counter(want)
    assert rep["skipped"]["reverse"] > 0  # the PULLs were not re-sent
    assert rep["tcp_connections"] == cfg.ranks * cfg.ranks and not rep["send_errors"]
    blocks = rep["channels"]["udp1"]["blocks"]
    assert blocks == cfg.blocks[1] * cfg.ranks * cfg.ranks * cfg.iterations


@root
def test_replay_filters_iterations_and_channels_with_base_port(cap, tmp_path):
    cfg, spec, pcap = cap
    new_base = synth.free_base_port(2)
    rec = synth.Recorder("127.0.0.1", tcp_ports=[new_base, new_base + 10],
                         udp_ports=[new_base + o for o in (1, 2, 3, 11, 12, 13)])
    r = subprocess.run([sys.executable, "-m", "dgt.tools.cli", "replay", str(pcap),
                        "--to", "127.0.0.1", "--base-port", str(new_base),
                        "--iterations", "1-2", "--channels", "0,2", "--rate", "5000pps",
                        "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "total" in r.stdout
    time.sleep(0.3)
    got = rec.close()
    hdrs = [wire.decode_header(data) for _, _, data in got]
    blocks = [h for h in hdrs if h.type == wire.MsgType.BLOCKS]
    assert {h.channel for h in blocks} == {0, 2}
    assert {h.iteration for h in hdrs if h.type != wire.MsgType.HELLO
            and h.type != wire.MsgType.BYE} == {1, 2}
    keep = (lambda h: h.type in (wire.MsgType.HELLO, wire.MsgType.BYE)
            or (1 <= h.iteration <= 2 and (h.type != wire.MsgType.BLOCKS or h.channel in (0, 2))))
    want = _expected(pcap, spec, keep)
    shift = new_base - cfg.base_port
    assert Counter((p, port - shift, d) for p, port, d in got) == Counter(want)


@root
def test_schedule_matches_capture_deltas(cap):
    cfg, spec, pcap = cap
    items, info = replay.plan(replay.ReplayConfig(files=[str(pcap)], ports=spec))
    offs = replay.schedule(items)
    ts = [it.ts_ns for it in items]
    assert offs[0] == 0.0
    for i in range(1, len(items)):
        assert offs[i] == pytest.approx((ts[i] - ts[0]) / 1e9, abs=1e-9)
    half = replay.schedule(items, speed=2.0)
    assert half[-1] == pytest.approx(offs[-1] / 2)
    pps = replay.schedule(items, rate_pps=100)
    assert pps[10] == pytest.approx(0.1)
    mb = replay.schedule(items, rate_mbit=1.0)
    assert mb[1] == pytest.approx(len(items[0].data) * 8 / 1e6)


def test_parse_helpers():
    assert replay.parse_rate("1000pps") == (1000.0, None)
    assert replay.parse_rate("50Mbit") == (None, 50.0)
    assert replay.parse_iterations("3-7") == (3, 7)
    assert replay.parse_port_map("1:2,3:4") == {1: 2, 3: 4}
    for bad in ("x", "-1pps", "0"):
        with pytest.raises(ValueError):
            replay.parse_rate(bad)
    with pytest.raises(ValueError):
        replay.parse_iterations("5-3")


@root
def test_replay_refused_tcp_is_one_line_error(cap, tmp_path):
    cfg, spec, pcap = cap
    dead = synth.free_base_port(2)
    r = subprocess.run([sys.executable, "-m", "dgt.tools.cli", "replay", str(pcap),
                        "--to", "127.0.0.1", "--base-port", str(dead), "--speed", "100"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot connect" in r.stderr
    assert "Traceback" not in r.stderr


_PEAK = """
import resource, sys
from dgt.tools.cli import standalone
try:
    rc = standalone("replay", sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
sys.exit(rc)
"""


def _peak_rss_mb(tmp_path, *args) -> float:
    """Run 'dgt replay ARGS' in a child; its peak RSS in MB (ru_maxrss of the child)."""
    out = tmp_path / "peak.txt"
    r = subprocess.run([sys.executable, "-c", _PEAK, str(out), *map(str, args)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(out.read_text()) / 1024


@pytest.mark.parametrize("mode", ["--dry-run", "send"])
def test_replay_streams_memory_independent_of_file_size(tmp_path, mode):
    """A 100 MB capture costs about what a 2 MB one does: the replay reads the file as a
    stream (the old code kept every message, about 1.5x the file, in memory)."""
    small, big = tmp_path / "small.pcap", tmp_path / "big.pcap"
    synth.write_pcap(str(small), 2, block_elems=2048)
    synth.write_pcap(str(big), 100, block_elems=2048)
    base = synth.free_base_port(2)   # nothing listens there: the datagrams are dropped
    args = ["--to", "127.0.0.1", "--base-port", base, "--rate", "100Gbit", "-q"]
    if mode == "--dry-run":
        args.append("--dry-run")
    rss_small = _peak_rss_mb(tmp_path, small, *args)
    rss_big = _peak_rss_mb(tmp_path, big, *args)
    big.unlink()
    assert rss_big - rss_small < 40, (rss_small, rss_big)


def test_replay_and_summary_read_pcapng(tmp_path):
    """pcapng (what Wireshark and dumpcap write by default) streams through the same
    path as pcap: the dry-run schedule and the summary are identical."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether
    from scapy.utils import wrpcap, wrpcapng

    from dgt.tools.dissect import DGT
    pkts = []
    for i in range(6):
        p = (Ether() / IP(src="10.0.0.1", dst="10.0.0.2", tos=34 << 2)
             / UDP(sport=40000, dport=47001)
             / DGT(type=2, channel=1, session=0x1234, iteration=i // 2, block=i, count=1,
                   data=b"x" * 32))
        p.time = 1000 + i * 0.01
        pkts.append(p)
    wrpcap(str(tmp_path / "a.pcap"), pkts)
    wrpcapng(str(tmp_path / "a.pcapng"), pkts)
    outs = []
    for name in ("a.pcap", "a.pcapng"):
        r = subprocess.run([sys.executable, "-m", "dgt.cli", "replay", "--dry-run",
                            "--to", "127.0.0.1", str(tmp_path / name)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 6
    # --dry-run --json writes what would be sent (it used to write nothing, silently)
    r = subprocess.run([sys.executable, "-m", "dgt.cli", "replay", "--dry-run", "--to",
                        "127.0.0.1", "--json", str(tmp_path / "dry.json"),
                        str(tmp_path / "a.pcap")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    dry = json.loads((tmp_path / "dry.json").read_text())
    assert dry["dry_run"] is True and dry["messages"] == 6
    msgs = [(m.ts_ns, m.dscp, m.data) for m in
            dissect.messages_from_pcap(str(tmp_path / "a.pcapng"))[0]]
    assert msgs == [(m.ts_ns, m.dscp, m.data) for m in
                    dissect.messages_from_pcap(str(tmp_path / "a.pcap"))[0]]
    assert [d for _, d, _ in msgs] == [34] * 6


def _ng_block(kind: int, body: bytes) -> bytes:
    """One little-endian pcapng block: type, total length, body padded to 4, length."""
    body += b"\x00" * (-len(body) % 4)
    return struct.pack("<II", kind, 12 + len(body)) + body + struct.pack("<I", 12 + len(body))


#: a section header, an Ethernet interface, and one UDP packet in an enhanced block
_SHB = _ng_block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1))
_IDB = _ng_block(1, struct.pack("<HHI", 1, 0, 0))
_FRAME = bytes(12) + b"\x08\x00" + struct.pack(
    "!BBHHHBBH4s4s", 0x45, 0x88, 68, 0, 0, 64, 17, 0, bytes([127, 0, 0, 1]),
    bytes([127, 0, 0, 1])) + struct.pack("!HHHH", 40000, 47001, 48, 0) + b"w" * 40


def _epb(caplen: int = len(_FRAME), interface: int = 0) -> bytes:
    return _ng_block(6, struct.pack("<5I", interface, 0, 1, caplen, len(_FRAME)) + _FRAME)


@pytest.mark.parametrize("blocks, says", [
    ([_IDB, _epb(0xFFFFFFFF)], "at record 1 (byte offset 48) in {f}: not a pcapng packet "
                               "block (captured length 4294967295 in a block of 116 bytes)"),
    ([_IDB, struct.pack("<II", 6, 0xFFFFFFF0) + bytes(100)],
     "at record 1 (byte offset 48) in {f}: pcapng block cut off or garbled (type 6, "
     "length 4294967280, 108 bytes left in the file)"),
    ([_epb(interface=1)], "at record 1 (byte offset 28) in {f}: a packet block (type 6) "
                          "that cannot "
               "be read: no interface description before it, or garbled"),
], ids=["caplen-past-block", "length-past-file", "no-interface"])
def test_a_pcapng_of_bad_blocks_has_no_readable_packets(tmp_path, blocks, says):
    """Breaker round 25: scapy ends a pcapng at its first bad block as if at the end of
    the file, so these read as empty captures (packets 0, exit 0) and dgt replay then
    blamed the filters; a classic pcap's bad record was 'no readable packets'."""
    f = tmp_path / "bad.pcapng"
    f.write_bytes(_SHB + b"".join(blocks))
    r = subprocess.run([sys.executable, "-m", "dgt.cli", "pcap", "summary", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "error: no readable packets: truncated " + says.format(f=f) in r.stderr, r.stderr
    # after a good packet the same block ends the capture, said, the packet counted
    f.write_bytes(_SHB + _IDB + _epb() + b"".join(b for b in blocks if b != _IDB))
    r = subprocess.run([sys.executable, "-m", "dgt.cli", "pcap", "summary", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "packets 1," in r.stdout, r.stdout + r.stderr
    assert "truncated at record 2 (byte offset " in r.stdout, r.stdout


def test_a_pcapng_simple_packet_block_is_read_and_a_new_section_has_its_own_interfaces(
        tmp_path):
    """Breaker round 26: a simple packet block (no time stamp) was a TypeError traceback;
    a packet after a second section header was read with the first section's
    interface (pcapng scopes interface ids to their section)."""
    f = tmp_path / "spb.pcapng"
    spb = _ng_block(3, struct.pack("<I", len(_FRAME)) + _FRAME)
    idb = _ng_block(1, struct.pack("<HHI", 1, 0, 65535))   # an SPB is cut to the snaplen
    f.write_bytes(_SHB + idb + _epb() + spb)
    r = subprocess.run([sys.executable, "-m", "dgt.cli", "pcap", "summary", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "packets 2," in r.stdout, r.stdout + r.stderr
    assert "truncated" not in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    f.write_bytes(_SHB + _IDB + _epb() + _SHB + _epb())
    r = subprocess.run([sys.executable, "-m", "dgt.cli", "pcap", "summary", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "packets 1," in r.stdout, r.stdout + r.stderr
    assert "truncated at record 2 (byte offset 192) in " + str(f) + ": a packet block " \
        "(type 6) that cannot be read: no interface description before it" in r.stdout, \
        r.stdout
