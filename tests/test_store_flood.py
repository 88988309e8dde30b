"""A connection flood on the rendezvous store's port (the sixth breaker round): the
store's server runs in a process of its own (dgt.store_host), so the connections a
stranger holds open use up that process's descriptors, never rank 0's sidecar's. Before,
the store ran in the sidecar, and under a tight ``ulimit -n`` a flood made the sidecar's
checkpoint files fail with "Too many open files". Real sockets on loopback, real jobs."""
import json
import os
import resource
import subprocess
import sys
import time

import pytest

from dgt import checkpoint
from dgt.rendezvous import QUIET_TORCH_ENV, Rendezvous
from dgt.store_host import CROWDED, CrowdWatch
from dgt.tools.store_flood import master_port

#: a stranger: open argv[2] connections to 127.0.0.1:argv[1] (trying again for 60 s
#: while the listen queue is full, before the store's process accepts), send argv[3]
#: (hex) on each, keep them open, say how many connected, and hold them until stdin
#: closes
FLOOD = """
import socket, sys, time
held, t_end = [], time.monotonic() + 60
while len(held) < int(sys.argv[2]) and time.monotonic() < t_end:
    try:
        held.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1))
        held[-1].sendall(bytes.fromhex(sys.argv[3]))
    except OSError as e:
        print(e, file=sys.stderr)
        time.sleep(0.05)
print(len(held), flush=True)
sys.stdin.read()
"""


def _flood(port: int, n: int, send: bytes = b"") -> tuple[subprocess.Popen, int]:
    """Start a stranger holding ``n`` connections to ``port``, having sent ``send`` on
    each; (its process, how many connected)."""
    p = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), str(n), send.hex()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def _fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_flood_lands_in_the_store_s_process_not_in_rank_0(monkeypatch):
    for k, v in QUIET_TORCH_ENV.items():
        monkeypatch.setenv(k, v)
    port = _free_port()
    r0 = Rendezvous("127.0.0.1", port, 2, 0, 20.0)
    stranger = None
    try:
        assert r0.host_process is not None and r0.host_process.pid != os.getpid()
        before = _fds()
        stranger, held = _flood(port, 300)
        assert held == 300
        time.sleep(0.5)   # the store's server accepts them (no timing asserted)
        grew = _fds() - before
        assert grew < 10, f"rank 0's process took {grew} of the stranger's connections"
        assert _fds(r0.host_process.pid) >= 300   # they landed in the store's process
        # rank 0 still uses the store, and a rank that joins after the flood too
        r0.set("hello", "world")
        r1 = subprocess.run(
            [sys.executable, "-c",
             "import sys; from dgt.rendezvous import Rendezvous\n"
             "r = Rendezvous('127.0.0.1', int(sys.argv[1]), 2, 1, 20.0)\n"
             "print(r.wait(['hello'], lambda _k, v: v)['hello'])", str(port)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, **QUIET_TORCH_ENV})
        assert r1.stdout.strip() == "world", r1.stderr
    finally:
        if stranger is not None:
            stranger.stdin.close()
            stranger.wait(30)
        host = r0.host_process
        r0.close()
    assert host.proc.poll() is not None   # close() stopped and reaped it


def test_the_store_s_process_ends_with_rank_0():
    code = ("import sys, time\nfrom dgt.rendezvous import Rendezvous\n"
            "r = Rendezvous('127.0.0.1', int(sys.argv[1]), 1, 0, 20.0)\n"
            "print(r.host_process.pid, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(_free_port())],
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **QUIET_TORCH_ENV})
    try:
        host = int(p.stdout.readline())
        assert os.path.exists(f"/proc/{host}")
    finally:
        p.kill()   # SIGKILL: rank 0 gets no chance to stop it
        p.wait()
    t_end = time.monotonic() + 30
    while os.path.exists(f"/proc/{host}") and time.monotonic() < t_end:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{host}"), "the store's process outlived rank 0"


def test_ctrl_c_of_a_hand_started_sidecar_prints_no_traceback_of_its_store(tmp_path):
    """A terminal's Ctrl-C reaches the whole foreground process group: the sidecar and
    the store's process. The latter printed a KeyboardInterrupt traceback; it ignores
    SIGINT and ends with its sidecar."""
    import signal
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                          "--world", "1", "--master-port", str(_free_port()), "--socket",
                          str(tmp_path / "s.sock"), "--run-dir", str(tmp_path / "run")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, **QUIET_TORCH_ENV})
    try:
        assert "ready" in p.stdout.readline()   # the rendezvous is done: the store is up
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "stopped by signal" in err, err


def test_rank_0_says_how_its_store_s_process_ended():
    """Breaker round 7: the store's process killed alone read as "the rendezvous store
    (rank 0) is gone", in rank 0's own log too; rank 0 knows how its child ended."""
    import signal

    from dgt.errors import PeerFailure
    r0 = Rendezvous("127.0.0.1", _free_port(), 1, 0, 20.0)
    try:
        r0.set("k", "v")
        assert r0.job_failure() is None
        os.kill(r0.host_process.pid, signal.SIGKILL)
        with pytest.raises(PeerFailure) as e:
            for _ in range(100):   # the first look may still find the connection open
                r0.job_failure()
                time.sleep(0.05)
        assert f"its process, pid {r0.host_process.pid}, was killed by SIGKILL" in \
            str(e.value), str(e.value)
    finally:
        r0.close()


def _until(pred, what: str, timeout_s: float = 30) -> None:
    t_end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < t_end, f"not {what} within {timeout_s} s"
        time.sleep(0.05)


def test_the_store_s_process_freezes_and_thaws_with_rank_0():
    """Rank 0's sidecar stopped (SIGSTOP): the store's process stops too, so the other
    ranks see a frozen rank 0 (tests/test_sidecar_waits.py); continued (SIGCONT): the
    store answers again."""
    import signal
    from datetime import timedelta

    from torch.distributed import TCPStore

    from dgt.process import state
    port = _free_port()
    code = ("import sys, time\nfrom dgt.rendezvous import Rendezvous\n"
            "r = Rendezvous('127.0.0.1', int(sys.argv[1]), 2, 0, 20.0)\n"
            "r.set('k', 'v')\nprint(r.host_process.pid, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, **QUIET_TORCH_ENV})
    try:
        host = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGSTOP)
        _until(lambda: state(host) == "T", "stopped with rank 0")
        os.kill(p.pid, signal.SIGCONT)
        _until(lambda: state(host) not in ("T", ""), "continued with rank 0")
        store = TCPStore("127.0.0.1", port, 2, is_master=False,
                         timeout=timedelta(seconds=20), wait_for_workers=False)
        assert store.get("k") == b"v"   # no secret: the plain name and value
    finally:
        p.kill()
        p.wait()


def test_a_crowded_store_says_so_once_per_interval():
    watch = CrowdWatch(limit=1000, port=29500, world=2, base=20)
    assert watch.look(int(CROWDED * 1000) - 1, now=100.0) is None
    assert not watch.crowded(int(CROWDED * 1000) - 1) and watch.crowded(950)
    watch.shed = 7
    said = watch.look(950, now=100.0)
    assert "950 descriptors of its limit of 1000" in said
    assert "930 connections to port 29500, where the job's 2 ranks make 2" in said
    assert "7 silent ones shut down so far" in said
    assert watch.look(960, now=105.0) is None      # within WARN_EVERY_S
    assert watch.look(960, now=111.0) is not None


def test_only_silent_connections_to_the_port_are_shut_down():
    """dgt.store_shed.shed on real loopback connections held by this process: two that
    never sent a byte and two that sent less than a store handshake (one byte, four)
    are shut down (their peers read the end of the stream); one that sent a whole
    handshake (a TCPStore client's validation message), the listener and a connection
    on another port are left alone; every descriptor stays open (the store closes them
    itself). Before, only those that sent nothing were shed (breaker round 6)."""
    import select
    import socket

    from dgt.store_shed import HANDSHAKE_BYTES, shed
    srv, other = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    silent[2].sendall(b"\x00")
    silent[3].sendall(b"\x00\xce\xf7\x85")
    talker = socket.create_connection(("127.0.0.1", port))
    talker.sendall(b"\x00\xce\xf7\x85\x3c")   # VALIDATE and torch's magic number
    assert HANDSHAKE_BYTES == 5
    elsewhere = socket.create_connection(other.getsockname())
    accepted = [srv.accept()[0] for _ in range(5)] + [other.accept()[0]]
    try:
        time.sleep(0.5)   # older than the silence asked for below
        assert shed(port, resource.getrlimit(resource.RLIMIT_NOFILE)[0], silent_s=0.3) == 4
        for c in silent:
            assert select.select([c], [], [], 10)[0] and c.recv(1) == b""
        for c in (talker, elsewhere):
            assert not select.select([c], [], [], 0.2)[0]   # nothing came: still open
        for a in accepted + [srv, other]:
            os.fstat(a.fileno())   # still ours to close
    finally:
        for x in silent + [talker, elsewhere, srv, other] + accepted:
            x.close()


def _train_under_flood(args: list[str], run_dir, flood_when, n: int, send: bytes = b""):
    """``dgt train`` with ``args`` (and ``--run-dir run_dir``) under ``ulimit -n 256``;
    once ``flood_when(p)`` is true, a stranger holds ``n`` connections to the store's
    port, ``send`` sent on each, until the job ends. Returns (exit status, output)."""
    cmd = [sys.executable, "-m", "dgt.cli", "train", "--workers", "2", "--hidden", "16",
           "--seed", "1", "--run-dir", str(run_dir)] + args
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=_limit_fds(256))
    stranger = None
    try:
        t_end = time.monotonic() + 240
        while not flood_when(p) or master_port(str(run_dir)) is None:
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < t_end, "no time to flood within 240 s"
            time.sleep(0.01)
        stranger, held = _flood(master_port(str(run_dir)), n, send)
        assert held >= 250   # past the job's limit of 256 either way
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if stranger is not None:
            stranger.stdin.close()
            stranger.wait(30)
    return p.returncode, out


@pytest.mark.parametrize("send", [b"", b"\x00"], ids=["silent", "one-byte"])
def test_a_flood_at_start_up_does_not_stop_the_job(tmp_path, send):
    """A stranger holds 1,000 connections to the store's port from the moment it is
    known, before the ranks join, under ``ulimit -n 256``, each silent or having sent
    one byte (the first of a store handshake): the store's process sheds them and the
    ranks join (before: the job failed, blaming rank 0; with a byte each, it still
    did)."""
    run_dir = tmp_path / "run"
    code, out = _train_under_flood(["--iterations", "20"], run_dir, lambda p: True, 1000,
                                   send)
    assert code == 0, out
    log0 = (run_dir / "sidecar-0.log").read_text()
    assert "silent ones shut down so far" in log0, log0


def _limit_fds(n: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return preexec


def test_a_flood_during_training_costs_rank_0_no_checkpoint(tmp_path):
    """The breaker's job: 2 workers under ``ulimit -n 256``, checkpoints every 50
    iterations; once training runs, a stranger opens 400 connections to the store's
    port and holds them. The job ends well with every checkpoint written; the store's
    process says it is crowded."""
    run_dir, ck, report = tmp_path / "run", tmp_path / "ck", tmp_path / "r.json"
    code, out = _train_under_flood(
        ["--iterations", "2000", "--epochs", "100", "--checkpoint-every", "50",
         "--checkpoint-dir", str(ck), "--report", str(report)], run_dir,
        lambda p: checkpoint.latest(str(ck), 2) is not None, 400)
    assert code == 0, out
    assert "not written" not in out, out
    r = json.loads(report.read_text())
    assert r["warnings"] == [], r["warnings"]
    assert checkpoint.latest(str(ck), 2).endswith("step-00002000")
    log0 = (run_dir / "sidecar-0.log").read_text()
    assert "the rendezvous store holds" in log0 and "a connection flood?" in log0, log0
