"""A stop signal (SIGTERM, SIGHUP, SIGINT: also one sent to a job started in the
background, whose SIGINT the shell ignores) to a root tool that builds state: what it
built goes, one line says it was interrupted, and the exit status is 128 + the signal,
as ``dgt train`` and ``dgt bench`` do (dgt.interrupt).

Outside tester: ``dgt testbed up --hosts 40 --prefix brkT &``, then ``kill -TERM`` three
seconds in: exit 143, no output, 41 ``brkT-*`` namespaces left (SIGHUP the same; SIGINT
cleaned up but exited 2). Every test builds only namespaces of its own prefix and takes
them down in ``finally``, whatever happened.
"""
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import needs, requires_tool

from dgt.tc_profiles import testbed

root_only = needs("ip", root="netns, veth, tc")

#: (signal, whether it comes to a background job: SIGINT ignored when it starts)
STOPS = [pytest.param(signal.SIGTERM, False, id="TERM"),
         pytest.param(signal.SIGHUP, False, id="HUP"),
         pytest.param(signal.SIGINT, False, id="INT"),
         pytest.param(signal.SIGINT, True, id="INT-background")]


def _dgt(*argv, background=False):
    """``python -m dgt.cli ARGV`` as a user starts it; ``background``: as ``cmd &`` in
    a script does, SIGINT ignored."""
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None
    return subprocess.Popen([sys.executable, "-m", "dgt.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pre)


def _namespaces(prefix: str) -> list[str]:
    """The namespaces of testbed ``prefix``, as ``ip netns list`` shows them."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=True).stdout
    return sorted(w for w in (ln.split()[0] for ln in out.splitlines() if ln.strip())
                  if w.startswith(f"{prefix}-"))


def _wait_until(cond, p: subprocess.Popen, what: str):
    """Poll ``cond()`` until true; fail if ``p`` ends first (or in 120 s)."""
    end = time.monotonic() + 120
    while not (got := cond()):
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"exited {p.returncode} before {what}: {out}{err}")
        assert time.monotonic() < end, f"{what}: not seen in 120 s"
        time.sleep(0.01)
    return got


def _stop(p: subprocess.Popen, sig: int) -> tuple[str, str]:
    p.send_signal(sig)
    return p.communicate(timeout=120)


def _one_interrupted_line(out: str, err: str) -> str:
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted" in lines[0], out + err
    return lines[0]


def _reap(p: subprocess.Popen | None) -> None:
    if p is not None and p.poll() is None:
        p.kill()
        p.wait()


def _signal_mid_build(prefix: str, argv: list[str], sig: int, background: bool):
    """Run ``dgt ARGV``, which builds testbed ``prefix``; send ``sig`` as soon as its
    first namespace exists. Returns (returncode, stdout, stderr, what of the testbed was
    left); the testbed is taken down whatever happened."""
    p = _dgt(*argv, background=background)
    try:
        _wait_until(lambda: _namespaces(prefix), p, "its first namespace")
        out, err = _stop(p, sig)
        left = _leftovers(prefix)
    finally:
        _reap(p)
        testbed.down(prefix)
    return p.returncode, out, err, left


def _leftovers(prefix: str) -> list[str]:
    """Anything of testbed ``prefix``: a namespace, its state file, a link named so."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return (_namespaces(prefix)
            + [str(testbed._state_file(prefix))] * testbed._state_file(prefix).exists()
            + [ln for ln in links.splitlines() if prefix in ln])


@root_only
@pytest.mark.parametrize("sig,background", STOPS)
def test_a_stop_signal_mid_build_removes_the_half_built_testbed(sig, background):
    """Signalled as soon as its first namespace exists, 'dgt testbed up --hosts 8' (9
    namespaces, 16 shaped ports: seconds of work left) removes all it built."""
    prefix = f"dgtsg{uuid.uuid4().hex[:6]}"
    rc, out, err, left = _signal_mid_build(
        prefix, ["testbed", "up", "--hosts", "8", "--prefix", prefix], sig, background)
    assert rc == 128 + sig, (rc, out, err)
    line = _one_interrupted_line(out, err)
    assert line.startswith("dgt testbed up: interrupted") and "removed" in line, line
    assert left == []


@root_only
def test_a_stop_signal_after_the_build_removes_the_testbed_too():
    """Stopped after its testbed was built, while it said so (breaker round 7: SIGINT
    1.3 s in, exit 130 and the testbed left up), 'dgt testbed up' removes it as one
    stopped half-way does. Its stdout is a pipe filled to the brim beforehand, so it
    blocks writing its summary, with the testbed built, until the signal comes."""
    import fcntl
    import os
    import threading
    prefix = f"dgtsa{uuid.uuid4().hex[:6]}"
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    assert fcntl.fcntl(w, fcntl.F_GETFL) & os.O_NONBLOCK == 0
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "testbed", "up", "--hosts",
                          "2", "--prefix", prefix], stdout=w, stderr=subprocess.PIPE,
                         text=True)
    os.close(w)
    drained = []
    try:
        _wait_until(lambda: testbed._state_file(prefix).exists(), p, "the state file")
        # blocked in its write: sleeping in the kernel with the testbed built
        _wait_until(lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1]
                    .split()[0] == "S", p, "a blocked write")
        p.send_signal(signal.SIGINT)
        reader = threading.Thread(target=lambda: drained.append(os.read(r, 1 << 20)))
        reader.start()
        err = p.communicate(timeout=120)[1]
        reader.join(timeout=10)
    finally:
        _reap(p)
        os.close(r)
        left = _leftovers(prefix)
        testbed.down(prefix)
    assert p.returncode == 130, (p.returncode, err)
    assert "dgt testbed up: interrupted; the testbed" in err and "removed" in err, err
    assert left == []


@root_only
@requires_tool("iperf3")
@pytest.mark.parametrize("sig,background", STOPS)
def test_a_stop_signal_to_testbed_load_stops_its_bulk_tcp(sig, background):
    """'dgt testbed load' runs iperf3 in the hosts; stopped, it leaves none running
    there (killed by SIGTERM before, it left them running for --seconds)."""
    prefix = f"dgtsg{uuid.uuid4().hex[:6]}"
    p = None
    try:
        tb = testbed.up(2, prefix=prefix)
        p = _dgt("testbed", "load", "--prefix", prefix, "--seconds", "300", "--pairs",
                 "0:1", background=background)
        # the client runs in h0 once the server listens in h1
        _wait_until(lambda: testbed._netns_pids(tb.host_netns(0)), p, "the iperf3 client")
        out, err = _stop(p, sig)
        running = {ns: testbed._netns_pids(ns) for ns in (tb.host_netns(0),
                                                          tb.host_netns(1), tb.router)}
    finally:
        _reap(p)
        testbed.down(prefix)
    assert p.returncode == 128 + sig, (p.returncode, out, err)
    assert _one_interrupted_line(out, err).startswith("dgt testbed load: interrupted")
    assert running == {ns: [] for ns in running}


@root_only
@pytest.mark.parametrize("sig", [pytest.param(s, id=s.name[3:]) for s in
                                 (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)])
def test_testbed_exec_is_the_command_a_signal_stops(sig):
    """'dgt testbed exec 0 -- sleep 300' signalled: before, dgt died and sleep ran on in
    the host (SIGTERM, SIGHUP), or dgt said 'error: interrupted' with exit 2 (SIGINT).
    Now dgt becomes the command, as 'ip netns exec' does: the signal is the command's,
    and so is the exit status (a shell says 128 + the signal). (In the background, the
    command keeps the SIGINT it was given, ignored, as under 'ip netns exec'.)"""
    prefix = f"dgtsg{uuid.uuid4().hex[:6]}"
    p = None
    try:
        tb = testbed.up(1, prefix=prefix)
        ns = tb.host_netns(0)
        p = _dgt("testbed", "exec", "--prefix", prefix, "0", "--", "sleep", "300")
        _wait_until(lambda: p.pid in testbed._netns_pids(ns), p,
                    "dgt's own process running the command in h0")
        out, err = _stop(p, sig)
        running = testbed._netns_pids(ns)
    finally:
        _reap(p)
        testbed.down(prefix)
    assert p.returncode == -sig, (p.returncode, out, err)
    assert running == []
    assert "interrupted" not in err and "Traceback" not in err, err


@root_only
def test_testbed_exec_passes_a_signal_death_through():
    """A command killed by a signal: 'dgt testbed exec' ended as if killed by it too
    (exit 128 + the signal in a shell), not with 256 - the signal (241 for SIGTERM, what
    'return -15' from main made of it)."""
    prefix = f"dgtsg{uuid.uuid4().hex[:6]}"
    try:
        testbed.up(1, prefix=prefix)
        r = subprocess.run([sys.executable, "-m", "dgt.cli", "testbed", "exec", "--prefix",
                            prefix, "0", "--", "sh", "-c", "kill -TERM $$"],
                           capture_output=True, text=True, timeout=120)
        r2 = subprocess.run(["sh", "-c", f"{sys.executable} -m dgt.cli testbed exec "
                             f"--prefix {prefix} 0 -- sh -c 'exit 7'; echo $?"],
                            capture_output=True, text=True, timeout=120)
    finally:
        testbed.down(prefix)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr)
    assert r2.stdout.strip() == "7", r2


@needs(root="capture opens AF_PACKET")
@pytest.mark.parametrize("sig,background", [
    pytest.param(signal.SIGHUP, False, id="HUP"),
    pytest.param(signal.SIGINT, True, id="INT-background")])
def test_a_stop_signal_ends_a_capture_as_ctrl_c_does(tmp_path, sig, background):
    """'dgt capture' ends on Ctrl-C or SIGTERM by design (docs/tools.md): the pcap is
    completed, the stats printed, exit 0 (what was recorded is the result), "stopped
    by" naming the signal. SIGHUP killed it, stats unprinted, and a background capture
    ignored SIGINT; each was "stopped by interrupt", whatever the signal."""
    from dgt.tools import dissect
    out = tmp_path / "c.pcap"
    p = _dgt("capture", "--ports", "47999", "-w", str(out), "--seconds", "300",
             background=background)
    try:
        _wait_until(lambda: "capturing on" in p.stderr.readline(), p, "'capturing on'")
        so, se = _stop(p, sig)
    finally:
        _reap(p)
    assert p.returncode == 0, (p.returncode, so, se)
    assert re.search(rf"^stopped by +{sig.name}$", so, re.M), so
    assert re.search(rf"^files +{re.escape(str(out))}$", so, re.M), so
    # a whole pcap file (its header at least: stopped at once, before 'capturing on'
    # was in the try whose finally completes the file, it was left with 0 bytes)
    records = list(dissect.read_pcap(out, status := {}))
    assert "truncated" not in status and re.search(rf"^packets +{len(records)}$", so, re.M)


@needs("ip", "iperf3", root="the bench's testbed")
def test_bench_goodput_in_the_background_stops_on_sigint_and_removes_its_testbed(tmp_path):
    """SIGINT to 'dgt bench goodput &' (SIGINT ignored, as a script's background job
    has it): it ran on to the end; now it stops as on Ctrl-C (130), testbed removed.
    (SIGTERM and SIGHUP stopped it before; tests/test_bench.py sends SIGTERM to a
    --loopback bench.)"""
    prefix = f"dgtsg{uuid.uuid4().hex[:6]}"
    rc, out, err, left = _signal_mid_build(
        prefix, ["bench", "goodput", "--prefix", prefix, "--rates", "100mbit", "--mb", "5",
                 "--seconds", "1", "--iterations", "1", "--hidden", "32", "--out",
                 str(tmp_path / "out")], signal.SIGINT, background=True)
    assert rc == 128 + signal.SIGINT, (rc, out, err)
    assert "dgt bench: interrupted" in err and "testbed removed" in err, err
    assert left == []
