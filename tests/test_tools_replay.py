"""dgt replay: port rewriting, byte-identical delivery, filters, computed schedule."""
from __future__ import annotations

import os
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
