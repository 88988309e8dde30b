"""dgt capture: real loopback traffic, count bound, ring rotation, channel filter, netns."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import requires_tool

from dgt.transport import wire
from dgt.tools import capture, dissect, ports, synth

root = pytest.mark.skipif(os.geteuid() != 0, reason="capture needs root (AF_PACKET)")
PY = sys.executable


def _blast(port: int, n: int, channel: int = 1, dscp: int = 34, elems: int = 64) -> bytes:
    """Send n real block datagrams to 127.0.0.1:port; returns the first datagram."""
    dgs = wire.encode_block_datagrams(session=7, sender=0, shard=0, iteration=1,
                                      channel=channel, indices=np.arange(n),
                                      blocks=np.ones((n, elems), np.float32))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    for row in dgs:
        s.sendto(row.tobytes(), ("127.0.0.1", port))
    s.close()
    return dgs[0].tobytes()


@root
def test_count_bound_stops_and_file_is_readable(tmp_path):
    base = synth.free_base_port(1)
    out = tmp_path / "c.pcap"
    cap = capture.Capture(capture.CaptureConfig(
        out=str(out), ports=ports.from_ports(f"{base}-{base + 3}"), count=25)).start()
    first = _blast(base + 1, 60)
    st = cap.join(10)
    assert st.stopped_by == "count" and st.packets == 25
    msgs, d = dissect.messages_from_pcap(out)
    assert len(msgs) == 25 and d.undecodable == 0
    assert msgs[0].data == first and msgs[0].dscp == 34
    assert [m.header.block for m in msgs] == list(range(25))  # lo: no duplicate copies


@root
def test_ring_rotation_keeps_newest_files(tmp_path):
    base = synth.free_base_port(1)
    out = tmp_path / "ring.pcap"
    cap = capture.Capture(capture.CaptureConfig(
        out=str(out), ports=ports.from_ports(str(base + 1)), ring=3, file_mb=0.02)).start()
    _blast(base + 1, 200)  # ~300 B frames: ~60 KB, so 3+ rotations at 20 KB
    time.sleep(0.3)
    cap.stop()
    st = cap.join(10)
    assert st.packets == 200
    assert len(st.files) == 3 and st.deleted_files >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(f)
                                                               for f in st.files)
    for f in st.files:
        assert os.path.getsize(f) <= 20_000
    msgs, d = dissect.messages_from_pcap(st.files[-1])
    assert msgs and msgs[-1].header.block == 199 and d.undecodable == 0
    # ring files read in order form one contiguous tail of the traffic
    blocks = [m.header.block for f in st.files for m in dissect.messages_from_pcap(f)[0]]
    assert blocks == list(range(200 - len(blocks), 200))


@root
def test_channel_filter_bpf_and_layout(tmp_path):
    cfg = synth.SynthConfig(base_port=synth.free_base_port(2), iterations=2)
    sent, spec = synth.captured_run(cfg, str(tmp_path / "ch.pcap"), channels=[0, 2])
    msgs, d = dissect.messages_from_pcap(tmp_path / "ch.pcap", spec)
    chans = {m.header.channel for m in msgs}
    assert chans == {0, 2}
    n2 = sum(1 for m in msgs if m.header.type == wire.MsgType.BLOCKS and m.header.channel == 2)
    assert n2 == sent["channels"]["udp2"]["blocks_sent"]
    assert "udp[12] = 2" in sent["capture"]["filter"]


def test_bpf_filter_text():
    spec = ports.from_base_port(47000, 2, 3)
    f = ports.bpf_filter(spec, [0, 1])
    assert f == ("(tcp and (port 47000 or port 47010)) or ((udp and (port 47001 or "
                 "port 47011)) and (udp[12] = 1 or ip6[52] = 1))")
    assert ports.bpf_filter(ports.from_ports("5-9")) == (
        "(tcp and (portrange 5-9)) or (udp and (portrange 5-9))")


@root
@requires_tool("ip")
def test_capture_inside_netns(tmp_path):
    ns = f"dgtcap{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(reason=f"cannot create a netns here: {r.stderr.strip()}")
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        out = tmp_path / "ns.pcap"
        cap = capture.Capture(capture.CaptureConfig(
            out=str(out), ports=ports.from_ports("47001"), netns=ns, count=5)).start()
        # the same port in the host namespace must not show up
        _blast(47001, 3, dscp=8)
        code = ("import socket,numpy as np; from dgt.transport import wire;"
                "d=wire.encode_block_datagrams(session=9,sender=3,shard=0,iteration=4,channel=1,"
                "indices=np.arange(5),blocks=np.zeros((5,4),np.float32));"
                "s=socket.socket(2,2);[s.sendto(x.tobytes(),('127.0.0.1',47001)) for x in d]")
        subprocess.run(["ip", "netns", "exec", ns, PY, "-c", code], check=True)
        st = cap.join(10)
        msgs, _ = dissect.messages_from_pcap(out)
        assert st.packets == 5 and {m.header.session for m in msgs} == {9}
    finally:
        subprocess.run(["ip", "netns", "del", ns])


def _cli(*args, **kw):
    return subprocess.run([PY, "-m", "dgt.tools.cli", *args], capture_output=True, text=True,
                          timeout=60, **kw)


@pytest.mark.parametrize("cmd", [["capture"], ["pcap"], ["pcap", "summary"], ["replay"]])
def test_help_on_every_command(cmd):
    r = _cli(*cmd, "--help")
    assert r.returncode == 0 and "usage: dgt" in r.stdout


def test_cli_errors_are_one_line_exit_2(tmp_path):
    cases = [
        ["pcap", "summary", str(tmp_path / "missing.pcap")],
        ["replay", str(tmp_path / "missing.pcap"), "--to", "127.0.0.1"],
        ["capture", "--ports", "1-x", "--count", "1"],
        ["capture", "--report", str(tmp_path / "nope.json"), "--count", "1"],
        ["capture", "--ports", "5000", "--ring", "3"],
        ["capture", "--ports", "5000", "-i", "nosuchif0", "--count", "1"],
    ]
    for args in cases:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "error" in r.stderr


def test_capture_not_root_says_so(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip(reason="needs root and setpriv to drop to an unprivileged user")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "--inh-caps=-all", PY, "-m", "dgt.tools.cli", "capture", "--ports",
                        "5000", "--count", "1", "-w", "/tmp/x.pcap"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 2 and "root" in r.stderr and "Traceback" not in r.stderr


@root
def test_cli_capture_count_via_subprocess(tmp_path):
    base = synth.free_base_port(1)
    out = tmp_path / "cli.pcap"
    p = subprocess.Popen([PY, "-m", "dgt.tools.capture", "--ports", str(base + 2),
                          "--count", "10", "-w", str(out), "--seconds", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = _first_log_line(p.stderr)
    assert "capturing on lo" in line
    _blast(base + 2, 20, channel=2, dscp=18)
    so, se = p.communicate(timeout=30)
    assert p.returncode == 0, se
    assert "packets" in so and "count" in so
    msgs, _ = dissect.messages_from_pcap(out)
    assert len(msgs) == 10 and {m.dscp for m in msgs} == {18}


@root
@pytest.mark.parametrize("tty", [False, True])
def test_capture_logs_progress_each_second_on_a_terminal_only(tmp_path, tty):
    """Breaker round 9: under nohup or CI, 'dgt capture' wrote a progress line every
    second into the log; there it writes one in 30 s, on a terminal still each second."""
    import pty
    base = synth.free_base_port(1)
    master, slave = pty.openpty() if tty else (None, None)
    err = tmp_path / "err.log"
    with open(err, "w") as f:
        p = subprocess.run([PY, "-m", "dgt.cli", "capture", "--ports", str(base + 2),
                            "-w", str(tmp_path / "p.pcap"), "--seconds", "3.5"],
                           stdout=subprocess.PIPE, stderr=slave if tty else f, text=True,
                           timeout=60)
    if tty:
        os.close(slave)
        text = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # EIO: the pty's other end is closed and drained
                break
            if not chunk:
                break
            text += chunk
        os.close(master)
        text = text.decode()
    else:
        text = err.read_text()
    assert p.returncode == 0, text
    assert "capturing on lo" in text
    progress = re.findall(r"captured \d+ packets, [\d.]+ MB", text)
    assert (len(progress) >= 1) if tty else (progress == []), text


# ------------------------------------------------ output that cannot be written (-w)

def _dgt_capture(*args, cwd=None, prefix_cmd=()):
    """`dgt capture` as a user runs it (no -q: a started capture logs 'capturing on')."""
    return subprocess.run([*prefix_cmd, PY, "-m", "dgt.cli", "capture", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def _assert_refused_up_front(r, path, reason):
    """Exit 2, no summary, and exactly one stderr line naming the path and the reason:
    the capture never started (it would have logged 'capturing on' first)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr and "capturing on" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dgt capture: error: cannot write {path} (-w): {reason}"), \
        r.stderr


def test_capture_missing_folder_is_refused_and_not_created(tmp_path):
    """The reported case (-w /nonexistent/x.pcap exited 0): a folder that does not exist
    is an error before capturing, and it is not created."""
    out = tmp_path / "nonexistent" / "x.pcap"
    r = _dgt_capture("--base-port", "5000", "-w", str(out), "--seconds", "1")
    _assert_refused_up_front(r, out, "No such file or directory")
    assert not out.parent.exists()
    # with --file-mb the first file (x.00001.pcap) is the one tried
    r = _dgt_capture("--base-port", "5000", "-w", str(out), "--seconds", "1",
                     "--file-mb", "1")
    _assert_refused_up_front(r, out.parent / "x.00001.pcap", "No such file or directory")
    assert not out.parent.exists()


def test_capture_to_a_folder_is_refused(tmp_path):
    r = _dgt_capture("--base-port", "5000", "-w", str(tmp_path), "--seconds", "1")
    _assert_refused_up_front(r, tmp_path, "is a folder")


def test_capture_where_no_file_can_be_made_is_refused(tmp_path):
    """/proc takes no new files, for root either (whose access() says 'writable')."""
    out = f"/proc/fixtest-{os.getpid()}.pcap"
    r = _dgt_capture("--base-port", "5000", "-w", out, "--seconds", "1")
    # root: ENOENT; a normal user: EACCES or ENOENT, depending on the kernel's /proc
    reason = "No such file or directory"
    if os.geteuid() != 0 and "Permission denied" in r.stderr:
        reason = "Permission denied"
    _assert_refused_up_front(r, out, reason)


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                    reason="as root, needs setpriv to run as a user a folder can refuse")
def test_capture_into_unwritable_folder_is_refused():
    """A folder the user may not write (mode 555), checked before the root check: a
    user learns about the path first."""
    import tempfile
    base = tempfile.mkdtemp(prefix="fixtest-cap-")   # /tmp: reachable by 'nobody'
    try:
        os.chmod(base, 0o755)
        ro = os.path.join(base, "ro")
        os.mkdir(ro, 0o555)
        os.chmod(ro, 0o555)
        out = os.path.join(ro, "x.pcap")
        as_user = (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
                   if os.geteuid() == 0 else [])
        r = _dgt_capture("--base-port", "5000", "-w", out, "--seconds", "1", cwd="/",
                         prefix_cmd=as_user)
        _assert_refused_up_front(r, out, "Permission denied")
        assert os.listdir(ro) == []
    finally:
        os.chmod(os.path.join(base, "ro"), 0o755)
        shutil.rmtree(base)


@root
@requires_tool("unshare")
def test_capture_on_read_only_file_system_is_refused(tmp_path):
    """A read-only mount (a tmpfs mounted ro in a private mount namespace: gone with
    the process, nothing to tear down)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    out = mnt / "x.pcap"
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o ro,size=1m fixtest "{mnt}" && exec "{PY}" -m dgt.cli capture '
         f'--base-port 5000 -w "{out}" --seconds 1'],
        capture_output=True, text=True, timeout=60)
    if "mount:" in r.stderr:
        pytest.skip(reason=f"cannot mount a tmpfs here: {r.stderr.strip()}")
    _assert_refused_up_front(r, out, "Read-only file system")


#: the one line dgt capture prints first where libpcap is absent (its filter then runs
#: in user space, tools/capture.py); the capture's own log follows it
LIBPCAP_NOTE = "libpcap is not installed"


def _first_log_line(stream) -> str:
    """The capture's first log line, past the libpcap note when there is one."""
    line = stream.readline()
    return stream.readline() if LIBPCAP_NOTE in line else line


WRITTEN = re.compile(r"; (\d+) packets \((\d+) bytes\) were written completely before "
                     r"that(.*)$")


def _assert_failed_after_start(r, path, reason) -> tuple[int, int, str]:
    """Started (logged 'capturing on'), then the writer failed: exit 2, no summary,
    the last line names the file and why, then what was written completely before
    that. Returns (packets, bytes, the rest of the line: what was done to the file)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout               # never a success summary
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if LIBPCAP_NOTE not in ln]
    assert "capturing on" in lines[0], r.stderr
    head = f"dgt capture: error: cannot write {path}: {reason}"
    assert lines[-1].startswith(head), r.stderr
    m = WRITTEN.fullmatch(lines[-1][len(head):])
    assert m, r.stderr
    return int(m.group(1)), int(m.group(2)), m.group(3)


@root
def test_capture_write_failure_after_start_is_an_error(dev_full):
    """/dev/full opens fine and fails every write: the capture must fail, not print a
    summary naming a file that holds nothing."""
    r = _dgt_capture("--base-port", str(synth.free_base_port(1)), "-w", dev_full,
                     "--seconds", "1")
    # nothing reached it, and a device is neither cut back nor removed
    assert _assert_failed_after_start(r, dev_full, "No space left on device") == \
        (0, 0, "")


@root
def test_capture_broken_pipe_is_an_error(tmp_path):
    """Writing into a pipe whose reader went away ([Errno 32] Broken pipe): exit 2
    naming the pipe, no summary."""
    fifo = tmp_path / "live.pcap"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # so the writer's open returns
    try:
        p = subprocess.Popen([PY, "-m", "dgt.cli", "capture", "--base-port",
                              str(synth.free_base_port(1)), "-w", str(fifo),
                              "--seconds", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = _first_log_line(p.stderr)   # logged after the pipe was opened
    finally:
        os.close(reader)                  # the reader goes away
    so, se = p.communicate(timeout=60)
    r = subprocess.CompletedProcess(p.args, p.returncode, so, first + se)
    assert _assert_failed_after_start(r, fifo, "Broken pipe") == (0, 0, "")


@root
def test_capture_failing_ring_rotation_is_an_error(tmp_path):
    """The second ring file cannot be made (a folder has its name): the capture stops
    with an error naming that file instead of going on or claiming success."""
    base = synth.free_base_port(1)
    (tmp_path / "ring.00002.pcap").mkdir()
    p = subprocess.Popen([PY, "-m", "dgt.cli", "capture", "--ports", str(base + 1),
                          "--file-mb", "0.02", "--count", "200", "--seconds", "30",
                          "-w", str(tmp_path / "ring.pcap")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = _first_log_line(p.stderr)
    _blast(base + 1, 200)                 # ~60 KB: past the first 20 KB file
    so, se = p.communicate(timeout=60)
    r = subprocess.CompletedProcess(p.args, p.returncode, so, first + se)
    n, nbytes, rest = _assert_failed_after_start(r, tmp_path / "ring.00002.pcap",
                                                 "Is a directory")
    # what it says was written is what the first file holds
    assert (n, nbytes, rest) == (*_records(tmp_path / "ring.00001.pcap"), ""), r.stderr
    assert 0 < n < 200


def _records(path) -> tuple[int, int]:
    """(records, frame bytes) of a pcap file, read by dissect.read_pcap, which must
    find it whole: no record cut off."""
    st: dict = {}
    lens = [len(rec.data) for _, rec in dissect.read_pcap(path, st)]
    assert "truncated" not in st, st
    return len(lens), sum(lens)


# --------------------------------------------------------- a disk that fills (-w)

def fill_disk(mnt):
    """Fill the file system at ``mnt`` to its last byte (a file ``filler`` there);
    returns ``mnt``."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (4096, 1):
            try:
                while os.write(fd, b"\0" * chunk):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return mnt


@root
@pytest.mark.parametrize("ring", [False, True], ids=["one-file", "ring"])
def test_a_disk_that_fills_ends_the_capture_with_what_was_written(small_tmpfs, ring):
    """The outside tester's case: a 3 MB tmpfs filled mid-capture. The capture printed
    'captured 0 packets' and an error, and left 3 MB of 91 records, the last one cut
    off. Now: one line with the packets and bytes written completely, exit 2, and the
    file(s) cut back to the last complete record: a pcap every reader takes whole."""
    mnt = small_tmpfs("1m")
    out = mnt / "c.pcap"
    base = synth.free_base_port(1)
    ring_args = ["--file-mb", "0.4"] if ring else []
    p = subprocess.Popen([PY, "-m", "dgt.cli", "capture", "--ports", str(base + 1),
                          "--seconds", "30", "-w", str(out), *ring_args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = _first_log_line(p.stderr)
    for _ in range(6):              # 6 x 500 datagrams of 1.4 KB: 4 MB for a 1 MB disk
        if p.poll() is not None:
            break
        _blast(base + 1, 500, elems=350)
    so, se = p.communicate(timeout=60)
    r = subprocess.CompletedProcess(p.args, p.returncode, so, first + se)
    files = sorted(mnt.iterdir())
    failed = files[-1]
    n, nbytes, rest = _assert_failed_after_start(r, failed, "No space left on device")
    assert [f.name for f in files] == (["c.00001.pcap", "c.00002.pcap", "c.00003.pcap"]
                                       if ring else ["c.pcap"]), files
    counts = [_records(f) for f in files]        # each file whole, its last record too
    assert (n, nbytes) == tuple(map(sum, zip(*counts))), (counts, r.stderr)
    # the disk was full: what is there fills it, to within a record and a page
    assert sum(f.stat().st_size for f in files) > 900_000, files
    assert rest in ("", f"; {failed} ends with the last of them (a partial record cut "
                        f"off)"), r.stderr
    from scapy.utils import RawPcapReader        # and another reader agrees
    assert sum(sum(1 for _ in RawPcapReader(str(f))) for f in files) == n


@root
def test_a_new_file_whose_header_does_not_fit_is_removed(small_tmpfs):
    """A file the disk had no room for at all (not even the 24-byte pcap header) is
    no pcap: it is removed, and the line says so."""
    mnt = fill_disk(small_tmpfs("64k"))
    out = mnt / "c.pcap"
    writer = capture.PcapRing(str(out), 1, None, None)
    writer.write(1, b"x" * 60, 60)
    with pytest.raises(capture.CaptureError) as e:
        writer.close()
    assert str(e.value) == (f"cannot write {out}: No space left on device; 0 packets "
                            f"(0 bytes) were written completely before that; {out} is "
                            f"removed (not even its pcap header fit)")
    assert not out.exists() and writer.files == []


def test_every_key_of_capture_s_json_is_documented():
    """Re-check of breaker round 14: 'dgt capture --json' writes the stats' fields
    (CaptureStats.as_dict), and filtered_out, deleted_files and stopped_by were in no
    doc."""
    from conftest import doc_names
    keys = set(capture.CaptureStats().as_dict())
    assert {"packets", "stopped_by", "filtered_out"} <= keys
    assert keys - doc_names("docs/tools.md", "## dgt capture (root)") == set()

