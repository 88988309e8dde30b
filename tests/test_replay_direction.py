"""dgt replay sends the worker -> shard half of every captured TCP connection, whatever
its ports and whether or not the capture holds its SYN: the message types say which end
is the shard (docs/wire.md: a worker sends HELLO, BLOCKS and END, a shard PULL).

The outside tester's case: a 'dgt train' job captured mid-way (no SYN), its --base-port
above the ephemeral range (61000) or inside it. Replay took the lower port of each
connection for the shard's: it scheduled only the PULLs, to the workers' ephemeral
ports, and counted every BLOCKS and END as skipped.reverse."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from conftest import needs, stop_procs
from dgt.tools import dissect, synth
from dgt.transport import messages, wire
from dgt.transport.wire import MsgType

DGT = [sys.executable, "-m", "dgt.cli"]
SESSION = 0x5EED
HOST = "127.0.0.1"
WORKER_TYPES = {MsgType.HELLO, MsgType.BLOCKS, MsgType.END}


# ------------------------------------------------------------ captures written here

def _blocks(sender: int, shard: int, it: int, channel: int = 0) -> bytes:
    if channel:   # one UDP block
        return wire.encode(MsgType.BLOCKS, session=SESSION, sender=sender, shard=shard,
                           iteration=it, channel=channel, block=it, count=1,
                           payload=np.ones(8, "<f4").tobytes())
    return wire.encode(MsgType.BLOCKS, session=SESSION, sender=sender, shard=shard,
                       iteration=it, block=0, count=2, flags=wire.INDEXED_BIT,
                       payload=wire.pack_indexed_blocks(np.arange(2),
                                                        np.ones((2, 8), np.float32)))


def _end(sender: int, shard: int, it: int) -> bytes:
    return wire.encode(MsgType.END, session=SESSION, sender=sender, shard=shard,
                       iteration=it, count=2, payload=wire.pack_end([2]))


def _pull(shard: int, it: int) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in messages.pull(
        SESSION, shard, it, 0, np.zeros(16, np.float32), np.ones(2, bool), None))


class _Tcp:
    """One TCP connection between a worker's ephemeral port and a shard's port, as a
    tap sees it: each end's segments carry that end's own sequence numbers."""

    def __init__(self, worker_port: int, shard_port: int):
        self.port = {"w": worker_port, "s": shard_port}
        self.seq = {"w": 1_000, "s": 7_000_000}
        self.frames: list[tuple[str, bytes]] = []   # (who, whole dgt frame) sent

    def seg(self, who: str, payload: bytes = b"", flags: str = "PA", frame: bool = True):
        """The packet ``who`` ('w' worker, 's' shard) sends; ``frame``: ``payload`` is
        one whole dgt frame (else a piece of one, or none)."""
        other = "s" if who == "w" else "w"
        p = (Ether() / IP(src=HOST, dst=HOST)
             / TCP(sport=self.port[who], dport=self.port[other], flags=flags,
                   seq=self.seq[who]))
        if payload:
            p = p / Raw(payload)
        self.seq[who] = (self.seq[who] + len(payload) + ("S" in flags)) & 0xFFFFFFFF
        if payload and frame:
            self.frames.append((who, payload))
        return p


def _write(path: Path, *streams: list) -> None:
    """Interleave the packet lists round-robin (connections side by side), 1 ms apart."""
    pkts, i = [], 0
    while any(i < len(s) for s in streams):
        pkts += [s[i] for s in streams if i < len(s)]
        i += 1
    for k, p in enumerate(pkts):
        p.time = 1000 + k * 0.001
    wrpcap(str(path), pkts)


def _dry_run(pcap: Path, tmp_path: Path, *extra: str) -> tuple[list[tuple], dict]:
    """'dgt replay --dry-run --json' as a user runs it: the schedule's (proto, port,
    type) rows and the JSON."""
    out = tmp_path / "dry.json"
    r = subprocess.run(DGT + ["replay", str(pcap), "--to", HOST, "--dry-run", "--json",
                              str(out), *extra], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = []
    for line in r.stdout.splitlines():   # "  0.001000  tcp  127.0.0.1:61500   2 ch=0 ..."
        _, proto, dst, typ = line.split()[:4]
        rows.append((proto, int(dst.rsplit(":", 1)[1]), int(typ)))
    return rows, json.loads(out.read_text())


@pytest.mark.parametrize("ports", [None, "40000-62000"], ids=["any-port", "ports"])
def test_streams_without_syn_or_starting_with_a_pull_replay_their_worker_half(tmp_path,
                                                                              ports):
    """Three connections: A is picked up mid-way (no SYN), its shard on 61500, above its
    worker's port; B's first packet is a PULL (no SYN), shard 61510; C has its SYN, its
    shard on 47600 (inside the ephemeral range), below its worker's port 52000. Only the
    HELLO/BLOCKS/END of each go, to the shard's port; every PULL (and C's BYE, which the
    shard sends) is skipped.reverse; the UDP datagrams all go. With ``--ports`` naming
    both ends of each connection (a range over the ephemeral ports), A's first packet is
    the tail of a frame (without --ports a stream must start with the magic number)."""
    a, b, c = _Tcp(40100, 61500), _Tcp(40200, 61510), _Tcp(52000, 47600)
    sa = [a.seg("w", _blocks(0, 1, 0)[-20:], frame=False)] if ports else []
    sb = [b.seg("s", _pull(1, 0))]                             # a PULL first
    sc = [c.seg("w", flags="S"), c.seg("s", flags="SA"), c.seg("w", flags="A"),
          c.seg("w", messages.hello(SESSION, 0, 1, None))]
    for it in (1, 2, 3):
        for conn, seq in ((a, sa), (b, sb), (c, sc)):
            seq += [conn.seg("w", _blocks(0, 1, it)), conn.seg("w", _end(0, 1, it)),
                    conn.seg("s", _pull(1, it))]
    sc.append(c.seg("s", messages.bye(SESSION, 1, 3, None)))
    udp = [Ether() / IP(src=HOST, dst=HOST) / UDP(sport=61501, dport=61511)
           / Raw(_blocks(0, 1, it, channel=1)) for it in (1, 2, 3)]
    pcap = tmp_path / "mid.pcap"
    _write(pcap, sa, sb, sc, udp)

    rows, dry = _dry_run(pcap, tmp_path, *(["--ports", ports] if ports else []))
    want = Counter((conn.port["s"], wire.decode_header(f).type)
                   for conn in (a, b, c) for who, f in conn.frames if who == "w")
    assert want == {(61500, 2): 3, (61500, 3): 3, (61510, 2): 3, (61510, 3): 3,
                    (47600, 1): 1, (47600, 2): 3, (47600, 3): 3}   # the test's own frames
    assert Counter((port, typ) for proto, port, typ in rows if proto == "tcp") == want
    assert Counter(port for proto, port, _ in rows if proto == "udp") == {61511: 3}
    from_shards = sum(who == "s" for conn in (a, b, c) for who, _ in conn.frames)
    assert from_shards == 3 + 4 + 3 + 1
    assert dry["skipped"] == {"reverse": from_shards}
    assert dry["messages"] == len(rows) == sum(want.values()) + 3
    assert dry["tcp_direction"] == {"types": 3, "syn": 0, "ports": 0, "syn_disagreed": 0}


def test_types_win_over_a_syn_and_a_stream_that_says_nothing_is_left_to_the_ports(
        tmp_path):
    """E's SYN names its worker's end (40400) as the server, but the worker sends BLOCKS
    and END on it: the types decide, so they go to the shard's port 61530, and its PULL
    is skipped (before: all the other way round). D carries only a BYE, captured
    mid-way: nothing says which end is the shard, so the ports decide, as before (the
    lower port, 40300, without --ports). Sent for real to two loopback receivers."""
    e, d = _Tcp(40400, 61530), _Tcp(40300, 61520)
    se = [e.seg("s", flags="S")]
    for it in (1, 2):
        se += [e.seg("w", _blocks(0, 1, it)), e.seg("w", _end(0, 1, it)),
               e.seg("s", _pull(1, it))]
    sd = [d.seg("s", messages.bye(SESSION, 1, 2, None))]
    pcap = tmp_path / "odd.pcap"
    _write(pcap, se, sd)

    base = synth.free_base_port(2)
    rec = synth.Recorder(HOST, tcp_ports=[base, base + 10])
    try:
        r = subprocess.run(DGT + ["replay", str(pcap), "--to", HOST, "--speed", "100",
                                  "--port-map", f"61530:{base},40300:{base + 10}",
                                  "--json", str(tmp_path / "rep.json")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        t_end = time.monotonic() + 30   # a bound, not a measurement
        while len(rec.messages) < 5 and time.monotonic() < t_end:
            time.sleep(0.05)
    finally:
        got = rec.close()
    assert Counter((port, data) for _, port, data in got) == Counter(
        [(base, f) for who, f in e.frames if who == "w"]
        + [(base + 10, f) for _, f in d.frames])
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["tcp_direction"] == {"types": 1, "syn": 0, "ports": 1, "syn_disagreed": 1}
    assert rep["skipped"] == {"reverse": 2} and not rep["send_errors"]
    assert "1 connection(s) with no SYN and no HELLO/BLOCKS/END/PULL" in r.stdout
    assert "1 connection(s) whose message types name the other end than their SYN" \
        in r.stdout


# ------------------------------------------------------------ a real job, captured

def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    return lo, hi


def _base_port(where: str) -> int:
    """A free --base-port for 2 ranks (B..B+13): 'above' the ephemeral range (61000 or
    more), or 'inside' it, near its top, so that the workers' ephemeral ports lie below
    the shards' (the old guess, the lower port, then picks every worker's end)."""
    lo, hi = _ephemeral_range()
    if where == "above":
        if hi + 1 > 64900:
            pytest.skip(reason=f"the ephemeral port range {lo}-{hi} leaves no room above")
        return synth.free_base_port(2, max(61000, hi + 1), 65000)
    return synth.free_base_port(2, hi - 500, hi)


def _epochs(path: Path) -> int:
    return len(re.findall(r"^epoch\s+\d+/", path.read_text(errors="replace"), re.M))


def _wait(cond, procs, what: str, timeout_s: float = 240) -> None:
    t_end = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{p.args[3]} ended while waiting for {what}"
        assert time.monotonic() < t_end, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.slow
@needs("libpcap", root="dgt capture opens an AF_PACKET socket")
@pytest.mark.parametrize("where", ["above", "inside"])
def test_replay_of_a_job_captured_mid_way(tmp_path, where):
    """'dgt train' on --base-port B, 'dgt capture' started once epoch 1 is printed (its
    connections are up: no SYN in the capture) and stopped two epochs later. The dry
    run schedules exactly the capture's BLOCKS and END of each worker, to its shard's
    port (B or B + 10); the PULLs are skipped.reverse; the datagrams all go."""
    base = _base_port(where)
    shard_ports = {base, base + 10}
    out, cap_log, pcap = tmp_path / "train.out", tmp_path / "capture.log", tmp_path / "j.pcap"
    env = dict(os.environ, PYTHONUNBUFFERED="1")   # epoch lines as they come
    procs = []
    try:
        with open(out, "w") as f:
            procs.append(subprocess.Popen(
                DGT + ["train", "--workers", "2", "--hidden", "16", "--epochs", "1000",
                       "--seed", "5", "--base-port", str(base),
                       "--run-dir", str(tmp_path / "run")],
                stdout=f, stderr=subprocess.STDOUT, env=env))
        _wait(lambda: _epochs(out) >= 1, procs, "epoch 1")
        with open(cap_log, "w") as f:
            procs.append(subprocess.Popen(
                DGT + ["capture", "--base-port", str(base), "--ranks", "2",
                       "--udp-channels", "3", "-w", str(pcap)],
                stdout=subprocess.DEVNULL, stderr=f, env=env))
        _wait(lambda: "capturing on" in cap_log.read_text(), procs, "capture start")
        seen = _epochs(out)
        _wait(lambda: _epochs(out) >= seen + 2, procs, "two more epochs")
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=60) == 0, cap_log.read_text()[-2000:]
    finally:
        stop_procs(*procs)

    pkts = [dissect.parse_packet(lt, rec) for lt, rec in dissect.read_pcap(pcap)]
    syns = [p for p in pkts if p and p.proto == "tcp" and p.tcp_flags & 0x02]
    assert not syns, "precondition: the capture starts after the job's connections"
    msgs, _ = dissect.messages_from_pcap(pcap)
    tcp = [m for m in msgs if m.proto == "tcp"]
    # the job's layout says who is who: a shard's end is on port B or B + 10
    to_shard = [m for m in tcp if m.dport in shard_ports and m.sport not in shard_ports]
    from_shard = [m for m in tcp if m.sport in shard_ports and m.dport not in shard_ports]
    assert len(to_shard) + len(from_shard) == len(tcp)
    assert {m.header.type for m in to_shard} == {MsgType.BLOCKS, MsgType.END}
    assert {m.header.type for m in from_shard} == {MsgType.PULL}
    assert len({(m.dport, m.sport) for m in to_shard}) == 2, "one connection per worker"

    rows, dry = _dry_run(pcap, tmp_path)
    assert Counter((port, typ) for proto, port, typ in rows if proto == "tcp") == \
        Counter((m.dport, m.header.type) for m in to_shard)
    assert sum(proto == "udp" for proto, _, _ in rows) == len(msgs) - len(tcp) > 0
    assert dry["skipped"] == {"reverse": len(from_shard)}
    assert dry["messages"] == len(rows) == len(msgs) - len(from_shard)
    assert dry["tcp_direction"] == {"types": 2, "syn": 0, "ports": 0, "syn_disagreed": 0}
