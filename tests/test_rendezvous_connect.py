"""dgt.rendezvous.wait_for_listener: a store is up only when something listens. A TCP
socket that connects to its own port (simultaneous open, what a connect to an unused
ephemeral port can do on one host) is not a listener. A service at the store's address
that is not a store is named as such, and a store that comes up late is still joined.
Real sockets and real TCPStores on loopback."""
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from dgt import rendezvous
from dgt.errors import PeerFailure
from dgt.rendezvous import QUIET_TORCH_ENV, Rendezvous, connected_to_itself, wait_for_listener


def test_a_socket_connected_to_itself_is_told_from_a_listener():
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.connect(s.getsockname())   # no listener: TCP simultaneous open with itself
        assert connected_to_itself(s)
    finally:
        s.close()
    with socket.create_server(("127.0.0.1", 0)) as srv, \
            socket.create_connection(srv.getsockname()) as c:
        assert not connected_to_itself(c)


def test_the_wait_ends_at_a_listener_and_names_rank_0_without_one():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        wait_for_listener("127.0.0.1", srv.getsockname()[1], 5.0)
        port = srv.getsockname()[1]
    with pytest.raises(PeerFailure, match="did not come up") as e:
        wait_for_listener("127.0.0.1", port, 0.3)
    assert e.value.rank == 0


#: a non-zero rank joining the store at argv[1], in a process of its own: the connect's
#: bound counts from the process's start (dgt.rendezvous.process_age_s)
WORKER = """
import sys
from dgt.errors import PeerFailure
from dgt.rendezvous import Rendezvous
try:
    r = Rendezvous("127.0.0.1", int(sys.argv[1]), 2, 1, float(sys.argv[2]))
except PeerFailure as e:
    print("PeerFailure:", e)
    sys.exit(3)
print(r.wait(["hello"], lambda _k, v: v)["hello"], r.store.timeout.total_seconds())
"""


def _worker(port: int, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WORKER, str(port), str(timeout_s)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **QUIET_TORCH_ENV})


def _serve(srv: socket.socket, reply) -> None:
    """Accept on ``srv`` until it closes; answer each connection with ``reply(first
    bytes read)`` and keep it open, as a long-lived service would."""
    held = []
    while True:
        try:
            c, _ = srv.accept()
        except OSError:
            break
        held.append(c)
        c.settimeout(5)
        try:
            c.sendall(reply(c.recv(64)))
        except OSError:
            pass
    for c in held:
        c.close()


@pytest.mark.parametrize("service,reply", [
    ("a banner (ssh)", lambda _got: b"SSH-2.0-OpenSSH_9.2\r\n"),
    ("an echo of other bytes", lambda got: got[::-1] + b"\0" * 8)])
def test_a_service_that_is_not_a_store_is_named_not_blamed_on_a_frozen_rank_0(
        service, reply):
    """The tester's master address held another service. TCPStore's client retries a
    wrong reply to its ping until its own timeout, past the connect's bound, and the
    job then blamed rank 0 as dead or frozen."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        threading.Thread(target=_serve, args=(srv, reply), daemon=True).start()
        out = _worker(srv.getsockname()[1], 20.0)
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert "not as dgt's rendezvous store" in out.stdout, out.stdout
    assert "--master-port" in out.stdout and "frozen" not in out.stdout, out.stdout


def test_a_store_that_comes_up_after_the_probe_is_joined():
    """Rank 0's listening socket exists (the launcher bound it) but its store starts
    only after the first, short connection has given up: the second one joins, and the
    store then answers with the whole timeout."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    fd = srv.detach()
    got: dict = {}

    def rank0():
        # the worker's first connect (wait_for_listener) makes the listener readable;
        # its probe follows at once and gives up after PROBE_S
        select.select([fd], [], [], 60)
        time.sleep(rendezvous.PROBE_S + 1.5)
        got["master"] = Rendezvous("127.0.0.1", port, 2, 0, 60.0, listen_fd=fd)
        got["master"].set("hello", "from-rank-0")
    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    try:
        out = _worker(port, 60.0)
    finally:
        t.join(60)
        if "master" not in got:
            os.close(fd)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert out.stdout.split() == ["from-rank-0", "60.0"], out.stdout


def test_a_taken_port_is_one_line_when_the_store_binds_every_interface():
    """Breaker round 7: with --master-addr not an address of this host the store binds
    every interface itself, and a taken port came back as torch's raw text ('The server
    socket has failed to listen … code: -98, name: EADDRINUSE'); on 127.0.0.1 the same
    was one line. (Nothing is sent: the store fails at its bind.)"""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        with pytest.raises(PeerFailure) as e:
            Rendezvous("192.0.2.1", port, 2, 0, 20.0)   # TEST-NET-1: no host's address
    assert str(e.value).startswith(f"--master-port {port} is in use on this host"), e.value
    assert "pick another port" in str(e.value) and "\n" not in str(e.value)


#: a rendezvous store (rank 0's: torch's TCPStore in a process of its own) that says
#: "up" and then waits to be frozen and thawed
SLOW_STORE = """
import datetime, sys, time
import torch.distributed as d
s = d.TCPStore('127.0.0.1', int(sys.argv[1]), 2, True,
               timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
print('up', flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("late_s", [12.2])
def test_a_store_that_answers_as_rank_1_gives_up_never_aborts_its_exit(tmp_path, late_s):
    """CI of e96b01b, at load average 6 on 2 cores: five sidecars whose rank 0 answered
    just as they gave up on it ('did not answer within 12 s of start-up') died of
    SIGABRT ('terminate called without an active exception'), not with status 3: the
    connect's thread completed inside torch's TCPStore during the interpreter's exit.
    Here rank 0's store is frozen (SIGSTOP) and thawed ``late_s`` after rank 1's
    sidecar started, at its 12 s deadline (--peer-timeout-s 2); before the fix 5 of 5
    such sidecars aborted."""
    import signal
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = subprocess.Popen([sys.executable, "-c", SLOW_STORE, str(port)],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **QUIET_TORCH_ENV})
    run = tmp_path / "r1"
    run.mkdir(mode=0o700)
    side = None
    try:
        assert store.stdout.readline() == "up\n"
        os.kill(store.pid, signal.SIGSTOP)
        side = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "1",
                                 "--world", "2", "--master-port", str(port), "--run-dir",
                                 str(run), "--socket", str(run / "s.sock"),
                                 "--peer-timeout-s", "2", "--startup-grace-s", "10"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(late_s)   # its deadline: 2 + 10 s (the grace given: its default
        # grows with the load, dgt.config.hand_started_grace)
        os.kill(store.pid, signal.SIGCONT)
        out, err = side.communicate(timeout=120)
    finally:
        for p in (side, store):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    assert side.returncode == 3, (side.returncode, err[-2000:])
    assert "terminate called" not in err and "Fatal Python error" not in err, err[-2000:]
    assert "rank 1:" in err, err[-2000:]
