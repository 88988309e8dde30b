"""IPv6 end to end on ::1: traffic class marks (IPV6_TCLASS = DSCP << 2, read back with
IPV6_RECVTCLASS), a sidecar pair exchanging blocks over IPv6, and 'dgt replay --to
::1' keeping each datagram's DSCP. Skips when the kernel has IPv6 turned off."""
from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn

import dgt
from dgt.transport import sockopts, wire
from dgt.transport.channels import channel_dscp
from dgt.tools import replay, synth


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _ipv6_loopback(),
                                reason="IPv6 is turned off in this kernel (no ::1)")


def _tclass_receiver() -> socket.socket:
    rx = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    rx.setsockopt(socket.IPPROTO_IPV6, sockopts.IPV6_RECVTCLASS, 1)
    rx.bind(("::1", 0))
    rx.settimeout(5)
    return rx


def _recv_with_tclass(rx: socket.socket, n: int) -> list[tuple[bytes, int]]:
    out = []
    for _ in range(n):
        data, anc, _flags, _addr = rx.recvmsg(65536, socket.CMSG_SPACE(4))
        tcs = [int.from_bytes(v[:4], sys.byteorder) for lvl, typ, v in anc
               if lvl == socket.IPPROTO_IPV6 and typ == sockopts.IPV6_TCLASS]
        out.append((data, tcs[0] if tcs else None))
    return out


def test_udp_socket_on_ipv6_carries_the_dscp_as_traffic_class():
    rx = _tclass_receiver()
    tx = sockopts.udp_socket("::1", 0, 34)
    try:
        assert tx.family == socket.AF_INET6
        assert tx.getsockopt(socket.IPPROTO_IPV6, sockopts.IPV6_TCLASS) == 34 << 2
        tx.sendto(b"x" * 100, rx.getsockname()[:2])
        [(data, tclass)] = _recv_with_tclass(rx, 1)
        assert data == b"x" * 100 and tclass == 34 << 2
    finally:
        tx.close()
        rx.close()


def test_dual_stack_listener_and_ipv6_client():
    lst = sockopts.tcp_listener("::", 0, 46)
    cli = sockopts.tcp_client(46, sockopts.family_of("::1"))
    try:
        assert lst.family == socket.AF_INET6 and cli.family == socket.AF_INET6
        cli.setblocking(True)
        cli.connect(("::1", lst.getsockname()[1]))
        assert cli.getsockopt(socket.IPPROTO_IPV6, sockopts.IPV6_TCLASS) == 46 << 2
    finally:
        cli.close()
        lst.close()
    assert sockopts.family_of("127.0.0.1") == socket.AF_INET
    assert sockopts.family_of("fe80::1%lo") == socket.AF_INET6


def test_replay_to_ipv6_sets_the_traffic_class(tmp_path):
    """A capture's datagrams (IPv4, DSCP 34/18/10 by channel) replayed to ::1 arrive
    with traffic class DSCP << 2 (before: 0, IP_TOS on an IPv6 socket)."""
    pcap = tmp_path / "c.pcap"
    synth.write_pcap(str(pcap), 0.05, block_elems=16, ranks=2)
    rx = _tclass_receiver()
    port = rx.getsockname()[1]
    try:
        pm = {46000 + 10 * s + c: port for s in range(2) for c in (1, 2, 3)}
        cfg = replay.ReplayConfig(files=[str(pcap)], to_host="::1", port_map=pm,
                                  rate_pps=20000)
        items, _ = replay.plan(cfg)
        n = 60
        items = items[::len(items) // n][:n]   # every channel and both ranks
        assert {it.dst for it in items} == {"::1"}
        rep = replay.replay(cfg, items)
        assert rep["totals"]["messages"] == n and not rep["send_errors"]
        got = _recv_with_tclass(rx, n)
    finally:
        rx.close()
    sent = {it.data: it.dscp for it in items}
    assert {d for d in sent.values()} == set(channel_dscp(3)[1:])
    for data, tclass in got:
        assert tclass == sent[data] << 2, (wire.decode_header(data).channel, tclass)


def test_sidecar_pair_exchanges_blocks_over_ipv6(tmp_path):
    """Two sidecars listening on ::1 (TCP and UDP channels), two trainers: every step's
    aggregate is the mean of both gradients, and the UDP channels carried blocks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = s.getsockname()[1]
    procs, paths = [], []
    for r in range(2):
        path = str(tmp_path / f"s{r}.sock")
        run = tmp_path / f"run{r}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dgt.cli", "sidecar", "--rank", str(r), "--world", "2",
             "--host", "::1", "--master-port", str(master), "--socket", path,
             "--run-dir", str(run), "--k", "0.3"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        paths.append(path)
    grads = {}
    errors = []
    models = []
    for _ in range(2):   # made here: torch's global RNG is shared by the threads
        torch.manual_seed(0)
        models.append(nn.Linear(64, 32))   # 2080 parameters: several blocks per shard

    def trainer(r):
        try:
            m = models[r]
            c = dgt.Client(paths[r], timeout_s=60)
            c.register(m)
            for step in range(3):
                for p in m.parameters():
                    p.grad = torch.full_like(p, float(r + 1 + step))
                c.push_pull(step)
                grads[(r, step)] = torch.cat([p.grad.flatten() for p in m.parameters()])
            c.close()
        except BaseException as e:   # reported below
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in glob.glob(os.path.join("/dev/shm", f"dgt-{p.pid}-*")):
                os.unlink(f)
    assert not errors, (errors, [p.stderr.read()[-2000:] for p in procs])
    for step in range(3):
        want = torch.full_like(grads[(0, step)], (1 + step + 2 + step) / 2)
        assert torch.equal(grads[(0, step)], want) and torch.equal(grads[(1, step)], want)
    reps = [json.loads((tmp_path / f"run{r}" / f"sidecar-{r}.json").read_text())
            for r in range(2)]
    assert {rp["host"] for rp in reps} == {"::1"}
    udp = sum(rp["channels"][f"udp{c}"]["blocks_delivered"] for rp in reps
              for c in (1, 2, 3))
    assert udp > 0, reps[0]["channels"]
    assert not any(rp["rejected"].get("unknown_source") for rp in reps), reps


def test_udp_sources_know_ipv6_peers_and_ipv4_peers_seen_by_a_dual_stack_socket():
    from dgt.sidecar import udp_sources
    src = udp_sources({0: {"host": "::1", "udp_ports": [5001]},
                       1: {"host": "127.0.0.1", "udp_ports": [5011]}, 2: {}}, 2)
    assert src[("::1", 5001)] == 0
    assert src[("127.0.0.1", 5011)] == 1 and src[("::ffff:127.0.0.1", 5011)] == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (capture opens AF_PACKET)")
def test_capture_channel_filter_and_dissector_on_ipv6(tmp_path):
    """Capture on lo keeps IPv6 datagrams of the chosen channel (the kernel filter's
    channel byte is ip6[52] there; the user-space filter agrees), and the dissector
    reads their DSCP from the traffic class."""
    from dgt.tools import capture, dissect, ports
    base = synth.free_base_port(1)
    spec = ports.from_ports(str(base + 1))
    outs = {}
    for name, chans, count in (("ch2", [2], 5), ("all", None, 10)):
        out = tmp_path / f"{name}.pcap"
        cap = capture.Capture(capture.CaptureConfig(out=str(out), ports=spec, count=count,
                                                    channels=chans, seconds=60)).start()
        for ch, dscp in ((1, 34), (2, 18)):
            tx = sockopts.udp_socket("::1", 0, dscp)
            for row in wire.encode_block_datagrams(
                    session=7, sender=0, shard=0, iteration=1, channel=ch,
                    indices=np.arange(5), blocks=np.ones((5, 16), np.float32)):
                tx.sendto(row.tobytes(), ("::1", base + 1))
            tx.close()
        st = cap.join(90)   # stops at the count: what passed the filter
        assert st.stopped_by == "count", st
        outs[name] = out
    msgs, _ = dissect.messages_from_pcap(outs["ch2"])
    assert len(msgs) == 5 and {(m.header.channel, m.dscp, m.dst) for m in msgs} == \
        {(2, 18, "::1")}
    frames = [rec.data for _, rec in dissect.read_pcap(outs["all"])]
    assert len(frames) == 10
    match = capture.user_filter(spec, [2])
    assert sum(match(f, 1) for f in frames) == 5
    assert all(capture.user_filter(spec)(f, 1) for f in frames)
