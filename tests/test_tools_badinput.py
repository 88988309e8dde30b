"""Bad input to `dgt capture`, `dgt pcap summary` and `dgt replay`: one line on stderr,
exit 2, no traceback; damaged captures are reported, not silently summed."""
from __future__ import annotations

import gzip
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import threading

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from dgt.tools.dissect import DGT

PY = sys.executable


def _cli(*args, **kw):
    return subprocess.run([PY, "-m", "dgt.cli", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def _udp_pcap(path, n=3, dport=47001):
    _scapy_udp_pcap(path, [DGT(type=2, channel=1, session=0x1234, iteration=i, block=i,
                               count=1, data=b"x" * 32) for i in range(n)], dport)
    return path


def _tcp_pcap(path, server_ports, n=3, size=16):
    """One captured TCP connection per server port, n BLOCKS frames each, of ``size``
    payload bytes."""
    pkts = []
    for k, port in enumerate(server_ports):
        seq = 1000
        for i in range(n):
            msg = bytes(DGT(type=2, channel=0, session=0x1234, iteration=i, block=i,
                            count=1, data=b"y" * size))
            p = (Ether() / IP(src="127.0.0.1", dst="127.0.0.1")
                 / TCP(sport=65000 + k, dport=port, flags="PA", seq=seq) / msg)
            p.time = 1000 + i * 0.001 + k * 0.0001
            seq += len(msg)
            pkts.append(p)
    pkts.sort(key=lambda p: p.time)
    wrpcap(str(path), pkts)
    return path


# ----------------------------------------------------------------- bad flags

@pytest.mark.parametrize("flags,needle", [
    (["--ring", "-1", "--file-mb", "1"], "--ring"),
    (["--ring", "0", "--file-mb", "1"], "--ring"),
    (["--file-mb", "0"], "--file-mb"),
    (["--file-mb", "-1"], "--file-mb"),
    (["--file-mb", "nan"], "--file-mb"),
    (["--seconds", "nan"], "--seconds"),
    (["--seconds", "inf"], "--seconds"),
    (["--seconds", "-2"], "--seconds"),
    (["--count", "0"], "--count"),
])
def test_capture_bad_numbers(tmp_path, flags, needle):
    out = tmp_path / "c.pcap"
    r = _cli("capture", "--ports", "5000", "-w", str(out), *flags)
    _one_line_error(r, needle)
    assert not out.exists()


@pytest.mark.parametrize("flags,needle", [
    (["--ranks", "0"], "--ranks"), (["--ranks", "-3"], "--ranks"),
    (["--udp-channels", "0"], "--udp-channels"), (["--udp-channels", "8"], "--udp-channels"),
])
def test_capture_bad_layout(tmp_path, flags, needle):
    r = _cli("capture", "--base-port", "47000", "--count", "1", "-w",
             str(tmp_path / "c.pcap"), *flags)
    _one_line_error(r, needle)


@pytest.mark.parametrize("flags,needle", [
    (["--speed", "nan"], "--speed"), (["--speed", "inf"], "--speed"),
    (["--speed", "0"], "--speed"), (["--rate", "100"], "give a unit"),
    (["--rate", "nanpps"], "--rate"), (["--rate", "-5Mbit"], "--rate"),
    (["--rate", "10furlongs"], "--rate"),
])
def test_replay_bad_timing_flags(tmp_path, flags, needle):
    pcap = _udp_pcap(tmp_path / "u.pcap")
    _one_line_error(_cli("replay", str(pcap), "--to", "127.0.0.1", "--dry-run", *flags),
                    needle)


@pytest.mark.parametrize("rate", ["1e-9pps", "0.00001pps", "1e-12Mbit"])
def test_replay_absurd_schedule_refused(tmp_path, rate):
    pcap = _udp_pcap(tmp_path / "u.pcap", n=3)
    r = _cli("replay", str(pcap), "--to", "127.0.0.1", "--dry-run", "--rate", rate)
    _one_line_error(r, "would take", "24 h")


def test_replay_rate_units(tmp_path):
    from dgt.tools import replay
    assert replay.parse_rate("2Gbit") == (None, 2000.0)
    assert replay.parse_rate("500kbit") == (None, 0.5)
    pcap = _udp_pcap(tmp_path / "u.pcap", n=3)
    r = _cli("replay", str(pcap), "--to", "127.0.0.1", "--dry-run", "--rate", "10pps")
    assert r.returncode == 0 and "0.200000" in r.stdout


@pytest.mark.parametrize("session", ["zz", "12345678901234567", "-1", "0x"])
def test_summary_bad_session(tmp_path, session):
    pcap = _udp_pcap(tmp_path / "u.pcap")
    _one_line_error(_cli("pcap", "summary", str(pcap), "--session", session),
                    "16 hex digits")


# ------------------------------------------------------------- bad reports

#: JSON nested deeper than Python's recursion limit: json.loads raises RecursionError,
#: not ValueError (it was a traceback, exit 1, in every reader)
DEEP = "[" * 100000 + "]" * 100000

#: every tool that reads a report; each gets ``--report R`` and the pcap
REPORT_CMDS = {
    "summary": ["pcap", "summary"],
    "replay": ["replay", "--to", "127.0.0.1", "--dry-run"],
    "capture": ["capture", "--count", "1", "-w", "{tmp}/c.pcap"],
}


def _report_cli(tmp_path, tool, report):
    pcap = _udp_pcap(tmp_path / "u.pcap", n=1)
    cmd = [a.replace("{tmp}", str(tmp_path)) for a in REPORT_CMDS[tool]]
    return _cli(*cmd, "--report", str(report), *([] if tool == "capture" else [str(pcap)]))


@pytest.mark.parametrize("tool", [*REPORT_CMDS, "plot"])
def test_a_report_nested_too_deeply_is_one_line(tmp_path, tool):
    report = tmp_path / "deep.json"
    report.write_text(DEEP)
    r = _cli("plot", str(report)) if tool == "plot" else _report_cli(tmp_path, tool, report)
    _one_line_error(r, str(report))
    if tool != "plot":
        assert "nested too deeply" in r.stderr, r.stderr


def test_top_skips_a_trace_line_nested_too_deeply(tmp_path):
    """Such a line is one unreadable line, counted and named as any other."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "trace-0.jsonl").write_text(DEEP + "\n")
    r = _cli("top", "--once", str(run))
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert "trace-0.jsonl: 1 unreadable line skipped" in " ".join(r.stdout.split()), \
        r.stdout


#: sidecars rows whose ports are no port: a float (even a whole one, or 1e400, which
#: JSON gives as infinity), a bool, a string, 0, a negative, over 65535
BAD_ROWS = {
    "tcp-1e400": '{"rank": 0, "tcp_port": 1e400, "udp_ports": [1]}',
    "tcp-99999999-udp-minus-1": '{"rank": 0, "tcp_port": 99999999, "udp_ports": [-1]}',
    "udp-minus-1": '{"rank": 0, "tcp_port": 47000, "udp_ports": [-1]}',
    "tcp-5.0": '{"rank": 0, "tcp_port": 5.0, "udp_ports": [47001]}',
    "tcp-NaN": '{"rank": 0, "tcp_port": NaN, "udp_ports": [47001]}',
}


@pytest.mark.parametrize("row", BAD_ROWS.values(), ids=BAD_ROWS)
@pytest.mark.parametrize("tool", REPORT_CMDS)
def test_a_report_port_that_is_no_port_is_refused_by_every_tool(tmp_path, tool, row):
    report = tmp_path / "r.json"
    report.write_text('{"sidecars": [%s]}' % row)
    _one_line_error(_report_cli(tmp_path, tool, report), f"{report}: bad sidecars entry 0",
                    "not a port 1..65535")


@pytest.mark.parametrize("field,value", [
    ("tcp_port", 0), ("tcp_port", 65536), ("tcp_port", -5), ("tcp_port", 47000.0),
    ("tcp_port", float("inf")), ("tcp_port", True), ("tcp_port", "47000"),
    ("tcp_port", None), ("tcp_port", [47000]), ("udp_ports", [47001, 70000]),
    ("udp_ports", [False]), ("udp_ports", "47001"), ("udp_ports", [47001.5]),
    ("rank", -1), ("rank", 0.0), ("rank", True), ("host", ["127.0.0.1"]), ("host", ""),
])
def test_the_sidecars_table_takes_only_whole_ports_1_to_65535(field, value):
    from dgt.tools import ports
    good = {"rank": 0, "host": "127.0.0.1", "tcp_port": 47000, "udp_ports": [47001]}
    assert ports.sidecars_from_doc({"sidecars": [good]})[0].udp_ports == (47001,)
    with pytest.raises(ports.PortSpecError, match="bad sidecars entry 0"):
        ports.sidecars_from_doc({"sidecars": [{**good, field: value}]})


# ------------------------------------------------------------- damaged pcaps

def _header(linktype=1):
    return struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, linktype)


def _random_bytes(n: int) -> bytes:
    import random
    data = bytearray(random.Random(5).randbytes(n))
    data[:4] = b"\x3c\x8a\x1f\x2e"   # a magic that is none of the capture formats
    return bytes(data)


@pytest.mark.parametrize("content,needle", [
    (_random_bytes(5000), "not a pcap file (magic 3c8a1f2e; a pcap starts with a1b2c3d4"),
    (b"not a pcap at all, clearly", "not a pcap file (magic 6e6f7420;"),
    (_header()[:20], "not a pcap file (too short: 20 bytes, a pcap header is 24)"),
    (b"", "not a pcap file (too short: 0 bytes, a pcap header is 24)"),
    (gzip.compress(_random_bytes(5000)),
     "not a pcap file (gzip-compressed, magic 3c8a1f2e;"),
], ids=["random-5000", "text", "short-header", "empty", "gzip-random"])
@pytest.mark.parametrize("cmd", [["pcap", "summary"], ["replay", "--to", "127.0.0.1"]])
def test_a_file_that_is_no_pcap_is_named_for_what_it_is(tmp_path, cmd, content, needle):
    """The reason is true of the file: 'too short' only when it is shorter than a pcap
    header, else the magic number it starts with (a 5000-byte random file was called
    'too short'); for a gzip file, the same of what it holds."""
    f = tmp_path / "x.pcap"
    f.write_bytes(content)
    r = _cli(*cmd, str(f))
    _one_line_error(r, f"{f}: {needle}")
    if len(content) >= 24:
        assert "too short" not in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", [["pcap", "summary"], ["replay", "--to", "127.0.0.1"]])
def test_unsupported_link_type(tmp_path, cmd):
    f = tmp_path / "lt.pcap"
    f.write_bytes(_header(147) + struct.pack("<IIII", 1, 0, 4, 4) + b"abcd")
    r = _cli(cmd[0], *cmd[1:], str(f)) if cmd[0] == "replay" else _cli(*cmd, str(f))
    _one_line_error(r, "link type 147", "supported", "EN10MB")


@pytest.mark.parametrize("cmd", [["pcap", "summary"], ["replay", "--to", "127.0.0.1"]])
def test_garbage_after_header(tmp_path, cmd):
    f = tmp_path / "g.pcap"
    f.write_bytes(_header() + bytes(range(256)) * 4)
    r = _cli(*cmd, str(f))
    _one_line_error(r, "truncated at record 1 (byte offset 24)")


@pytest.mark.parametrize("cmd", [["pcap", "summary"], ["replay", "--to", "127.0.0.1"]])
def test_a_record_claiming_4_gib_is_one_line(tmp_path, cmd):
    """A record whose captured length is 0xffffffff: one line from us, no second line
    from the pcap reader (breaker round 4 saw scapy's own warning first)."""
    f = tmp_path / "big.pcap"
    f.write_bytes(_header() + struct.pack("<IIII", 0, 0, 0xffffffff, 0xffffffff) + b"x" * 10)
    _one_line_error(_cli(*cmd, str(f)), "truncated at record 1 (byte offset 24)",
                    "captured length 4294967295")


def test_truncated_capture_is_reported(tmp_path):
    f = _udp_pcap(tmp_path / "t.pcap", n=3)
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    js = tmp_path / "t.json"
    r = _cli("pcap", "summary", str(f), "--json", str(js))
    assert r.returncode == 0, r.stderr
    assert "truncated at record 3 (byte offset" in r.stdout
    doc = json.loads(js.read_text())
    assert doc["records"] == 2 and doc["truncated"][0]["record"] == 3
    assert doc["truncated"][0]["offset"] == len(data) - (len(data) - 24) // 3
    assert doc["totals"]["messages"] == 2


# -------------------------------------------------------------- output paths

@pytest.mark.parametrize("cmd", [
    ["pcap", "summary", "{pcap}", "--json", "{bad}"],
    ["pcap", "summary", "{pcap}", "--plot", "{bad}"],
    ["replay", "{pcap}", "--to", "127.0.0.1", "--dry-run", "--json", "{bad}"],
    ["capture", "--ports", "5000", "--count", "1", "-w", "{bad}"],
    ["capture", "--ports", "5000", "--count", "1", "-w", "{ok}", "--json", "{bad}"],
])
def test_bad_output_path_checked_up_front(tmp_path, cmd):
    pcap = _udp_pcap(tmp_path / "u.pcap")
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "out.x")           # parent is a file
    args = [a.format(pcap=pcap, bad=bad, ok=tmp_path / "ok.pcap") for a in cmd]
    r = _cli(*args)
    _one_line_error(r, "not a folder")
    assert not (tmp_path / "ok.pcap").exists()        # nothing captured first
    r = _cli(*[a.format(pcap=pcap, bad=tmp_path, ok=tmp_path / "ok.pcap") for a in cmd])
    _one_line_error(r, "is a folder")


def test_output_missing_folder_is_an_error_not_created(tmp_path):
    """A missing folder is a typo more often than a wish: it is an error naming the
    path, and nothing is created (as root that could be anywhere, e.g. /nonexistent)."""
    pcap = _udp_pcap(tmp_path / "u.pcap")
    out = tmp_path / "new" / "sub" / "s.json"
    r = _cli("pcap", "summary", str(pcap), "--json", str(out))
    _one_line_error(r, f"cannot write {out} (--json): No such file or directory")
    assert not (tmp_path / "new").exists()
    (tmp_path / "new" / "sub").mkdir(parents=True)
    r = _cli("pcap", "summary", str(pcap), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["totals"]["messages"] == 3


# ------------------------------------------------- output that cannot be written

@pytest.mark.parametrize("cmd, says", [
    (["pcap", "summary", "{pcap}", "--json", "{full}"],
     "cannot write {full} (--json): No space left on device"),
    (["pcap", "summary", "{pcap}", "--plot", "{full}"],
     "cannot write {full} (--plot): No space left on device"),
    (["replay", "{pcap}", "--to", "127.0.0.1", "--dry-run", "--json", "{full}"],
     "cannot write {full} (--json): No space left on device"),
    (["replay", "{pcap}", "--to", "127.0.0.1", "--speed", "100", "-q", "--json",
      "{full}"], "cannot write {full} (--json): No space left on device"),
    pytest.param(["capture", "--ports", "{port}", "--seconds", "0.5", "-q", "-w", "{ok}",
                  "--json", "{full}"], "cannot write {full} (--json): No space left on device",
                 marks=pytest.mark.skipif(os.geteuid() != 0,
                                          reason="capture needs root (AF_PACKET)")),
], ids=["summary-json", "summary-plot", "replay-dry-run-json", "replay-json",
        "capture-json"])
def test_an_output_that_fails_to_write_is_one_error_line(tmp_path, dev_full, cmd, says):
    """The outside tester's 'dgt pcap summary --json /dev/full' (rc 0): every output
    file a command writes that fails to write, flush or close is one error line, exit
    2. A /dev/full exists and is no regular file: it is written through, never replaced
    by a rename (as root that would have put a regular file in /dev)."""
    from dgt.tools import synth
    pcap = _udp_pcap(tmp_path / "u.pcap")
    args = [a.format(pcap=pcap, ok=tmp_path / "ok.pcap", port=synth.free_base_port(1),
                     full=dev_full) for a in cmd]
    r = _cli(*args)
    # where libpcap is missing, capture's first line says so (test_tools_capture)
    r.stderr = "".join(ln for ln in r.stderr.splitlines(True)
                       if "libpcap is not installed" not in ln)
    _one_line_error(r, says.format(full=dev_full))
    assert stat.S_ISCHR(os.stat(dev_full).st_mode)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


#: a dgt train report that 'dgt plot' draws (the fields it reads, two points each)
SMALL_REPORT = {"history": [{"iteration": i, "seconds": i / 6, "test_accuracy": i / 20}
                            for i in (6, 12)],
                "channels": {"tcp": {"bytes_sent": 1000, "bytes_delivered": 1000}},
                "comm_ms": [1.0, 2.0]}


@pytest.mark.parametrize("what", ["summary-plot", "summary-plot-full", "plot"])
def test_a_fresh_users_plot_prints_no_matplotlib_notice(tmp_path, dev_full, what):
    """An outside tester, as a new user: matplotlib's first-run "generated new
    fontManager" (INFO) came on stderr before 'dgt pcap summary --plot's own output
    (the tools' logging let every library's INFO through), so the one error line of a
    failed write was two. HOME and MPLCONFIGDIR are new, empty folders here: stderr is
    exactly what dgt says."""
    home, mpl = tmp_path / "home", tmp_path / "mpl"
    home.mkdir()
    mpl.mkdir()
    env = dict(os.environ, HOME=str(home), MPLCONFIGDIR=str(mpl))
    png = tmp_path / "s.png"
    if what == "plot":
        report = tmp_path / "report.json"
        report.write_text(json.dumps(SMALL_REPORT))
        r = _cli("plot", str(report), "--out", str(tmp_path / "png"), env=env)
        expected, png = "", tmp_path / "png" / "comm_time.png"
    else:
        out = dev_full if what == "summary-plot-full" else png
        r = _cli("pcap", "summary", str(_udp_pcap(tmp_path / "u.pcap")), "--plot",
                 str(out), env=env)
        expected = (f"dgt pcap summary: error: cannot write {out} (--plot): No space "
                    f"left on device\n" if out == dev_full else "")
    assert r.stderr == expected
    assert r.returncode == (2 if expected else 0)
    assert expected or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(mpl), "matplotlib's first run: it built its font cache here"


def test_matplotlib_s_first_run_notices_are_dropped_and_its_other_warnings_pass(caplog):
    """The font cache notice that matplotlib logs (WARNING) when building the cache
    takes over 5 s, which no test can make happen at will: the records themselves,
    through matplotlib's own logger."""
    import logging

    from dgt.plot import pyplot
    pyplot()
    log = logging.getLogger("matplotlib.font_manager")
    with caplog.at_level(logging.INFO):
        log.warning("Matplotlib is building the font cache; this may take a moment.")
        log.info("generated new fontManager")
        log.warning("findfont: Font family %r not found.", "Nope")
        log.error("a real error")
    assert [r.getMessage() for r in caplog.records] == \
        ["findfont: Font family 'Nope' not found.", "a real error"]


@pytest.mark.parametrize("flag, earlier", [
    ("--json", b'{"earlier": true}\n'), ("--plot", b"\x89PNG\r\n\x1a\nearlier")])
def test_a_full_disk_leaves_the_earlier_summary_output_whole(small_tmpfs, tmp_path, flag,
                                                             earlier):
    """A summary output on a disk that fills is one error line, exit 2, and the file
    an earlier run wrote there is left as it was (the old writer truncated it, then
    failed: half a file, or none)."""
    from test_tools_capture import fill_disk
    pcap = _udp_pcap(tmp_path / "u.pcap")
    mnt = small_tmpfs("64k")
    out = mnt / ("s.json" if flag == "--json" else "s.png")
    out.write_bytes(earlier)
    fill_disk(mnt)
    r = _cli("pcap", "summary", str(pcap), flag, str(out))
    _one_line_error(r, f"cannot write {out} ({flag}): No space left on device")
    assert out.read_bytes() == earlier
    assert sorted(p.name for p in mnt.iterdir()) == sorted(["filler", out.name])


# ------------------------------------------------------- replay: refused TCP

def test_replay_goes_on_when_one_tcp_destination_refuses(tmp_path):
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    live = lst.getsockname()[1]
    dead_s = socket.socket()
    dead_s.bind(("127.0.0.1", 0))
    dead = dead_s.getsockname()[1]
    dead_s.close()                       # nobody listens there
    got = []

    def serve():
        lst.settimeout(20)
        try:
            c, _ = lst.accept()
        except OSError:
            return
        with c:
            while d := c.recv(65536):
                got.append(d)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    pcap = _tcp_pcap(tmp_path / "t.pcap", [live, dead], n=3)
    js = tmp_path / "r.json"
    r = _cli("replay", str(pcap), "--to", "127.0.0.1", "--speed", "100", "--json", str(js))
    t.join(20)
    lst.close()
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "refused" in r.stderr
    rep = json.loads(js.read_text())
    assert rep["totals"]["messages"] == 3 and rep["tcp_connections"] == 1
    assert rep["send_errors_by_destination"] == {f"tcp:127.0.0.1:{dead}": {"ECONNREFUSED": 3}}
    assert sum(map(len, got)) == 3 * (34 + 16)
    # nothing deliverable at all: exit 2, one line
    r = _cli("replay", str(_tcp_pcap(tmp_path / "d.pcap", [dead])), "--to", "127.0.0.1",
             "--speed", "100")
    assert r.returncode == 2 and "cannot connect" in r.stderr and "Traceback" not in r.stderr


def test_replay_ends_when_a_receiver_sends_a_little_now_and_then(tmp_path):
    """At the end a replay reads what each receiver still sends until it closes; that
    read had a timeout per read only, so a receiver that sends a byte every 0.1 s,
    forever, kept the replay from ever ending. The drain now has one deadline per
    connection (replay.DRAIN_S)."""
    lst = socket.create_server(("127.0.0.1", 0))
    port, stop, got = lst.getsockname()[1], threading.Event(), []

    def serve():
        c, _ = lst.accept()
        with c:
            while sum(map(len, got)) < 3 * (34 + 16):   # the three frames replayed
                got.append(c.recv(65536))
            try:
                while not stop.wait(0.1):
                    c.sendall(b"x")
            except OSError:
                pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    js = tmp_path / "r.json"
    try:
        # 120 s (_cli): far past the drain's 0.5 s, and it never ended before
        r = _cli("replay", str(_tcp_pcap(tmp_path / "t.pcap", [port])), "--to",
                 "127.0.0.1", "--speed", "100", "--json", str(js))
    finally:
        stop.set()
        lst.close()
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(js.read_text())["totals"]["messages"] == 3


def test_replay_drops_a_connection_whose_receiver_stopped_reading(tmp_path):
    """Breaker round, stop 40: a TCP receiver that accepts and never reads (a frozen
    job) kept replay's send waiting for ever once the socket buffers were full. A send
    that makes no progress for stall_s drops that connection, its messages counted
    under ETIMEDOUT, and the replay ends."""
    from dgt.tools import replay
    lst = socket.create_server(("127.0.0.1", 0))   # accepts (the kernel), never reads
    port = lst.getsockname()[1]
    # 400 frames of 60 kB: far more than loopback's send and receive buffers hold
    pcap = _tcp_pcap(tmp_path / "big.pcap", [port], n=400, size=60000)
    try:
        rep = replay.replay(replay.ReplayConfig(files=[str(pcap)], to_host="127.0.0.1",
                                                speed=1000.0, stall_s=1.0))
    finally:
        lst.close()
    errors = rep["send_errors_by_destination"][f"tcp:127.0.0.1:{port}"]
    assert set(errors) == {"ETIMEDOUT"}, errors
    assert 0 < rep["totals"]["messages"] < 400 and \
        rep["totals"]["messages"] + errors["ETIMEDOUT"] == 400, rep["totals"]


def _scapy_udp_pcap(path, datagrams, dport=47001) -> None:
    """A pcap of ``datagrams`` (bytes or scapy layers) from 10.0.0.1:40000 to
    10.0.0.2:``dport``, 10 ms apart, written by scapy."""
    pkts = []
    for i, data in enumerate(datagrams):
        p = (Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=40000, dport=dport)
             / data)
        p.time = 1000 + i * 0.01
        pkts.append(p)
    wrpcap(str(path), pkts)


def test_pcap_summary_counts_a_pull_over_udp_as_no_receiver_takes_it(tmp_path):
    """Breaker round 11: a PULL carried in a UDP datagram was counted as a PULL
    ('PULLs 1 (1 unattributed)'), though every receiver drops it (bad_udp_message).
    The summary now goes by the receivers' rule (wire.udp_shape_problem)."""
    from dgt.tools import ports, summary
    from dgt.transport import wire
    block = wire.encode(wire.MsgType.BLOCKS, session=0x1234, sender=0, shard=1,
                        channel=1, block=3, count=1, payload=b"\0" * 16)
    pull = wire.encode(wire.MsgType.PULL, session=0x1234, sender=1, shard=1, block=2,
                       count=1, payload=b"\0" * 17)
    hello = wire.encode(wire.MsgType.HELLO, session=0x1234, sender=0, shard=1, channel=2)
    tail = wire.encode(wire.MsgType.END, session=0x1234, sender=0, shard=1, channel=1,
                       count=1, payload=wire.pack_end([0, 1]))   # a tail marker has none
    _scapy_udp_pcap(tmp_path / "u.pcap", (block, pull, hello, tail))
    s = summary.summarize(tmp_path / "u.pcap", ports.from_ports("47001"))
    assert s["pulls"] == 0 and s["udp_refused"] == 3, s
    assert s["types"] == {"BLOCKS": 1} and s["totals"]["blocks"] == 1
    assert s["tail_markers"] == 0
    assert "datagrams no receiver takes (a PULL, HELLO, ERROR, BYE or TCP frame over " \
        "UDP: bad_udp_message; a tail marker with a payload: bad_tail; a block of an " \
        "undefined coding or of a length no block has: bad_coding, bad_length; a block " \
        "of another size than its session's others): 3" in \
        summary.format_table(s)


def _raw_block(coding, length):
    """A one-block BLOCKS datagram, shard 1, channel 1, block 10, iteration 0, of
    ``coding`` (flags bits 2-4) and payload ``length`` zero bytes, built by hand."""
    import struct
    from dgt.transport import wire
    return struct.pack("!HBBBBQHHIIII", wire.MAGIC, wire.VERSION, wire.MsgType.BLOCKS, 1,
                       coding << wire.CODING_SHIFT, 0x1234, 0, 1, 0, 10, 1, length) \
        + b"\0" * length


@pytest.mark.parametrize("coding, length, reason", [
    (5, 1408, "bad_coding"), (7, 16, "bad_coding"),     # codings 5-7 are not defined
    (0, 0, "bad_length"), (0, 6, "bad_length"),          # no fp32 block has 0 or 6 bytes
    (1, 3, "bad_length"), (3, 4, "bad_length"),          # fp16: odd; int8: under 5
])
def test_pcap_summary_counts_a_block_no_receiver_takes_as_refused(tmp_path, coding, length,
                                                                  reason):
    """Re-check of breaker round 12: a block of an undefined coding, or of a length that
    no block has in its coding, was counted as an arrived block (blocks, bytes, loss),
    where every receiver drops it. The summary counts it under udp_refused; a real shard
    session refuses the same bytes for the same reason."""
    from dgt.tools import ports, summary
    from dgt.transport.session import ShardSession
    good, bad = _raw_block(0, 16), _raw_block(coding, length)
    shard = ShardSession(session=0x1234, shard=1, lo=10, hi=20, block_elems=4,
                         n_workers=2, deadline_s=0.05)   # shard 1 needs 2 workers
    shard.receive_datagram(bad, now=0.0)
    assert dict(shard.counters.rejected) == {reason: 1}
    _scapy_udp_pcap(tmp_path / "b.pcap", (good, bad, good))
    s = summary.summarize(tmp_path / "b.pcap", ports.from_ports("47001"))
    assert s["totals"]["blocks"] == 2 and s["types"] == {"BLOCKS": 2}, s
    assert s["udp_refused"] == 1 and s["channels"]["udp1"]["bytes"] == 2 * len(good), s


@pytest.mark.parametrize("coding, length", [(0, 20), (1, 10), (3, 9), (4, 7)])
def test_pcap_summary_counts_a_block_of_another_size_as_refused(tmp_path, coding, length):
    """A block whose length fits its coding but not the job's block size (4 values
    here: 16 bytes of fp32, as the session's other blocks) was counted as a good block;
    a shard refuses it (bad_length). The summary takes the size most of the session's
    block datagrams have, and counts the other under udp_refused."""
    from dgt.tools import ports, summary
    from dgt.transport.session import ShardSession
    good, bad = _raw_block(0, 16), _raw_block(coding, length)
    shard = ShardSession(session=0x1234, shard=1, lo=10, hi=20, block_elems=4,
                         n_workers=2, deadline_s=0.05)
    shard.receive_datagram(bad, now=0.0)
    assert dict(shard.counters.rejected) == {"bad_length": 1}
    _scapy_udp_pcap(tmp_path / "b.pcap", (good, bad, good))
    s = summary.summarize(tmp_path / "b.pcap", ports.from_ports("47001"))
    assert s["totals"]["blocks"] == 2 and s["types"] == {"BLOCKS": 2}, s
    assert s["udp_refused"] == 1 and s["channels"]["udp1"]["bytes"] == 2 * len(good), s
    assert "a block of another size than its session's others): 1" in \
        summary.format_table(s)
    # and says so, per session (breaker round 20: a flood of forged blocks of one other
    # size that outnumbers a session's own takes its size over, silently)
    mixed = s["block_sizes_mixed"]
    assert list(mixed) == [str(0x1234)] and list(mixed[str(0x1234)].items())[0] == ("4", 2)
    assert f"session {0x1234}: block datagrams of {len(mixed[str(0x1234)])} sizes (4 " \
        f"values: 2, " in summary.format_table(s), summary.format_table(s)


def test_pcap_summary_counts_blocks_of_one_size_in_every_coding_as_good(tmp_path):
    """Blocks of one size (5 values) in every coding are all taken: int4's length
    fits two sizes, either of which may be the session's."""
    from dgt.tools import ports, summary
    from dgt.transport import wire
    blocks = [_raw_block(int(c), wire.coded_payload_bytes(c, 5)) for c in wire.Coding]
    _scapy_udp_pcap(tmp_path / "b.pcap", blocks + blocks[-1:])
    s = summary.summarize(tmp_path / "b.pcap", ports.from_ports("47001"))
    assert s["udp_refused"] == 0 and s["totals"]["blocks"] == len(blocks) + 1, s
    assert s["block_sizes_mixed"] == {}, s


def test_pcap_summary_gives_a_far_future_iteration_no_row(tmp_path):
    """A forged datagram of an iteration far above the others (2**31) became a row of
    the timeline (and of the plot's axis). From the median iteration up, an iteration
    more than summary.MAX_ITERATION_GAP above the one below it gets no row; its
    messages are counted as out of range. Iterations that follow one another all keep
    their rows."""
    import struct
    from dgt.tools import ports, summary

    def block(t):
        raw = bytearray(_raw_block(0, 16))
        struct.pack_into("!I", raw, 18, t)   # the header's iteration field
        return bytes(raw)
    iters = [0, 1, 2, 3, 2 ** 31, 4]
    _scapy_udp_pcap(tmp_path / "f.pcap", [block(t) for t in iters])
    s = summary.summarize(tmp_path / "f.pcap", ports.from_ports("47001"))
    assert [r["iteration"] for r in s["iterations"]] == [0, 1, 2, 3, 4], s["iterations"]
    assert s["iterations_out_of_range"] == 1 and s["totals"]["blocks"] == 6, s
    assert "messages of iterations out of range (more than 1000 above the iterations " \
        "below them; no row): 1" in summary.format_table(s)
    gap = summary.MAX_ITERATION_GAP
    _scapy_udp_pcap(tmp_path / "g.pcap", [block(t) for t in (0, 1, gap + 1, gap + 2)])
    s = summary.summarize(tmp_path / "g.pcap", ports.from_ports("47001"))
    assert [r["iteration"] for r in s["iterations"]] == [0, 1, gap + 1, gap + 2]
    assert s["iterations_out_of_range"] == 0


def test_every_block_a_sender_codes_passes_the_summarys_payload_check():
    """wire.block_payload_problem refuses no block that wire.coded_payload_bytes gives,
    for any coding and block size: the summary never drops an honest block."""
    from dgt.transport import wire
    for coding in wire.Coding:
        for elems in range(1, 400):
            h = wire.decode_header(_raw_block(int(coding),
                                              wire.coded_payload_bytes(coding, elems)))
            assert wire.block_payload_problem(h) is None, (coding, elems)
