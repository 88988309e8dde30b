"""The flood tool (``dgt.tools.flood``) over real loopback sockets: every datagram it
counts as sent is one well-formed forged BLOCKS datagram at a sidecar's channel port."""
import json
import socket
import threading

import pytest

from dgt.tools.flood import BATCH, flood
from dgt.transport import sockfilter, wire


def _free_udp_base(world: int, channels: int) -> tuple[int, list[socket.socket]]:
    for base in range(42000, 60000, 97):
        socks = []
        try:
            for r in range(world):
                for c in range(1, channels + 1):
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    socks.append(s)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
                    s.bind(("127.0.0.1", base + 10 * r + c))
            return base, socks
        except OSError:
            for s in socks:
                s.close()
    pytest.skip(reason="no free block of UDP ports on loopback")


def test_every_datagram_counted_as_sent_arrives_well_formed():
    world, channels = 2, 2
    base, socks = _free_udp_base(world, channels)
    got = {s.getsockname()[1]: [] for s in socks}
    done = threading.Event()

    def drain(s):
        s.settimeout(0.2)
        while True:
            try:
                got[s.getsockname()[1]].append(s.recv(65535))
            except socket.timeout:
                if done.is_set():
                    return
    threads = [threading.Thread(target=drain, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    try:
        # below the rate of a whole batch per pacing step, and above it
        out = flood("127.0.0.1", base, world, channels, rate=5000, duration_s=0.5,
                    sniff=False, spoof=False, block_bytes=256)
        done.set()
        for t in threads:
            t.join(5)
        # a receive buffer that overflowed on a loaded host: the kernel counts it
        dropped = sum(sockfilter.kernel_drops(s) or 0 for s in socks)
    finally:
        done.set()
        for s in socks:
            s.close()
    received = sum(len(v) for v in got.values())
    assert out["errors"] == 0 and out["datagrams"] > BATCH
    assert received + dropped == out["datagrams"], (received, dropped, out)
    assert received > BATCH
    for port, datagrams in got.items():
        r, c = divmod(port - base, 10)
        assert datagrams, port   # every sidecar's every channel is hit
        for d in datagrams[:50]:
            h = wire.decode_header(d)
            assert (h.type, h.shard, h.channel) == (wire.MsgType.BLOCKS, r, c)
            assert len(d) == wire.HEADER_BYTES + 256


def test_flood_refuses_a_host_off_loopback():
    with pytest.raises(ValueError, match="not a loopback address"):
        flood("10.1.2.3", 40000, 1, 1, 10, 0.1, False, False)


def test_the_sniffers_kernel_filter_keeps_only_tcp_from_the_jobs_ports():
    """The sniffer's packet socket on lo gets the TCP segments a job port sends, and
    none of the UDP datagrams (the flood's own) nor TCP from other ports."""
    import os
    import time
    if os.geteuid() != 0:
        pytest.skip(reason="a packet socket on lo needs root (CAP_NET_RAW)")
    from dgt.tools.flood import tcp_from_ports_filter
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sockfilter.attach(sniff, tcp_from_ports_filter(port, port))
    sniff.bind(("lo", 0))
    sniff.settimeout(0.3)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:   # UDP from the job port's own number: only the protocol check can drop it
        udp.bind(("127.0.0.1", port))
    except OSError:
        udp.bind(("127.0.0.1", 0))
    try:
        c1, c2 = socket.create_connection(("127.0.0.1", port)), \
            socket.create_connection(("127.0.0.1", other.getsockname()[1]))
        a1, a2 = srv.accept()[0], other.accept()[0]
        for _ in range(20):
            udp.sendto(b"x" * 100, ("127.0.0.1", port))
        a1.sendall(b"from-the-job-port")
        a2.sendall(b"from-another-port")
        seen = []
        t_end = time.monotonic() + 2
        while time.monotonic() < t_end:
            try:
                seen.append(sniff.recv(65535))
            except socket.timeout:
                break
        assert any(b"from-the-job-port" in pkt for pkt in seen)
        for pkt in seen:
            ihl = (pkt[14] & 0x0F) * 4
            assert pkt[12:14] == b"\x08\x00" and pkt[14 + 9] == socket.IPPROTO_TCP
            assert int.from_bytes(pkt[14 + ihl:14 + ihl + 2], "big") == port
        for s in (c1, c2, a1, a2):
            s.close()
    finally:
        for s in (srv, other, sniff, udp):
            s.close()


def _report(path, lost, dup=0, it_s=0.1, sha="ab" * 32, identical=True):
    ch = {"tcp": {"blocks_lost": 0, "blocks_duplicate": 0}}
    for c in (1, 2, 3):
        ch[f"udp{c}"] = {"blocks_lost": lost // 3 + (c <= lost % 3), "blocks_duplicate": dup}
    path.write_text(json.dumps({"channels": ch, "train_seconds": it_s * 30,
                                "iterations": 30, "replicas_identical": identical,
                                "param_sha256": [sha] * 3}))


def test_flood_sets_table_adds_up_the_reports(tmp_path, capsys):
    from dgt.tools.flood_sets import RUNS, main
    lost = {"plain-no": 0, "plain-yes": 100, "keyed-no": 0, "keyed-yes": 30,
            "plain-refused": 20}
    dirs = []
    for s, scale in ((1, 1), (2, 3)):
        d = tmp_path / f"set{s}"
        d.mkdir()
        for name, _, flooded in RUNS:
            _report(d / f"{name}.json", lost[name] * scale, dup=7 if name == "plain-yes" else 0)
            if flooded:
                (d / f"{name}.flood.json").write_text(json.dumps({"rate_per_sidecar": 19990 + s}))
        dirs.append(str(d))
    (tmp_path / "set3").mkdir()   # a set that never ran is named, not counted
    assert main(["table", *dirs, str(tmp_path / "set3")]) == 0
    out = capsys.readouterr().out
    assert "| set1 |" in out and "| 100 / 30 / 20 | 0.30 | 1.50 |" in out
    assert "| 300 / 90 / 60 | 0.30 | 1.50 |" in out and "21 / 0" in out
    assert "set3 | incomplete" in out
    assert "2 sets: real UDP blocks lost with --secret 120, without 400 (0.30 times" in out
    assert "lowest flood rate 19991/s" in out and "identical in every run: True" in out


def test_flood_sets_run_needs_root_and_sane_ports(tmp_path, capsys):
    import os
    from dgt.tools.flood_sets import main
    with pytest.raises(SystemExit):
        main(["run", "--out", str(tmp_path), "--sets", "200"])
    assert "--sets must be 1..100" in capsys.readouterr().err
    if os.geteuid() != 0:
        assert main(["run", "--out", str(tmp_path), "--sets", "1"]) == 2
        assert "run as root" in capsys.readouterr().err
