"""dgt.Client as a library against a real one-node sidecar: use and misuse."""
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

import dgt
from conftest import as_nobody, free_port


@pytest.mark.timeout(120)
def test_a_sidecar_killed_during_a_push_is_named_by_pid_and_socket(sidecar):
    # an outside tester: the trainer said only "sidecar closed the connection". The
    # sidecar is frozen, so the push is taken and the trainer waits for its answer,
    # then killed (should the kill come before the push, the push meets a broken pipe:
    # the same message)
    import threading
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=60)
    m = nn.Linear(4, 2)
    c.register(m)
    m(torch.ones(1, 4)).sum().backward()
    os.kill(proc.pid, signal.SIGSTOP)
    killer = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(dgt.PeerFailure) as e:
            c.push_pull(0)
    finally:
        killer.join()
    assert str(e.value) == (f"this rank's sidecar (pid {proc.pid}, socket {path}) closed "
                            f"the connection without a word: it exited or was killed"), \
        str(e.value)


def _conv_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    return m.to(memory_format=torch.channels_last)


def test_client_use_and_misuse(sidecar):
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    with pytest.raises(RuntimeError, match="register"):
        c.push_pull(0)
    with pytest.raises(ValueError, match="no trainable parameters"):
        c.register(nn.ReLU())
    with pytest.raises(TypeError, match="float32"):
        c.register(nn.Linear(2, 2).double())
    m = _conv_model()
    c.register(m)
    with pytest.raises(RuntimeError, match="already"):
        c.register(m)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for step in range(2):
        m.zero_grad()
        m(x).sum().backward()
        want = [p.grad.clone() for p in m.parameters()]
        c.push_pull(step)
        for p, w in zip(m.parameters(), want):  # one worker: the aggregate is its grad
            assert torch.equal(p.grad, w)
    with pytest.raises(ValueError, match="out of order"):
        c.push_pull(7)
    c.close()
    c.close()
    with pytest.raises(RuntimeError, match="this Client is closed"):
        c.push_pull(2)
    # breaker round 21: these two blamed the sidecar ("closed the connection without a
    # word") for the caller's own close()
    with pytest.raises(RuntimeError, match="this Client is closed"):
        c.push_buffer(2)
    with pytest.raises(RuntimeError, match="this Client is closed"):
        c.push_part(2, [(0, 1)])
    with pytest.raises(RuntimeError, match="this Client is closed"):
        c.save_state(os.path.join(os.path.dirname(path), "state.pt"))
    assert proc.wait(timeout=30) == 0


def test_dead_sidecar_is_a_peer_failure_not_a_hang(sidecar):
    """...and leaves nothing in /dev/shm: the buffer's name goes as soon as the
    client has mapped it, at register (it used to stay until the first push, and a
    sidecar killed before it leaked the buffer), so even a SIGKILL that nobody cleans
    up after (the launcher killed too) cannot leak it."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    c.register(m)
    assert not glob.glob(os.path.join("/dev/shm", f"dgt-{proc.pid}-*"))
    m(torch.randn(3, 4)).sum().backward()
    c.push_pull(0)
    assert not glob.glob(os.path.join("/dev/shm", f"dgt-{proc.pid}-*"))
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(dgt.PeerFailure):  # pytest-timeout fails a hang
        c.push_pull(1)


def test_sidecar_refuses_out_of_order_push_from_a_raw_client(sidecar):
    """A trainer that bypasses dgt.Client gets an error reply, and the sidecar exits."""
    import json
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    c.register(nn.Linear(4, 2))
    c.sock.sendall(b'{"op":"push","t":5}\n')
    reply = json.loads(c.file.readline())
    assert reply["op"] == "error" and "expected 0" in reply["message"]
    assert proc.wait(timeout=30) != 0
    assert "Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_grads_live_in_shared_memory_and_stay_correct(sidecar, set_to_none):
    """After push_pull a contiguous parameter's grad *is* the shared buffer (no copy on
    the next push when zero_grad keeps it); a channels_last one is copied. Either way
    every step's aggregate equals the gradient (one worker), whatever zero_grad does."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = _conv_model()
    c.register(m)
    buf = torch.from_numpy(c.grad)
    lo, hi = buf.data_ptr(), buf.data_ptr() + 4 * buf.numel()
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for step in range(3):
        m.zero_grad(set_to_none=set_to_none)
        (m(x) * (step + 1)).sum().backward()
        want = [p.grad.clone() for p in m.parameters()]
        c.push_pull(step)
        for p, w in zip(m.parameters(), want):
            assert torch.equal(p.grad, w)
            shared = lo <= p.grad.data_ptr() < hi
            assert shared == p.is_contiguous()
    c.close()
    assert proc.wait(timeout=30) == 0


def test_a_parameter_no_worker_has_a_gradient_for_keeps_none(sidecar):
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 3), nn.Linear(4, 3)
    m = nn.ModuleDict({"used": used, "unused": unused})
    c.register(m)
    for step in range(2):
        m.zero_grad(set_to_none=True)
        used(torch.randn(5, 4)).sum().backward()
        want = [p.grad.clone() for p in used.parameters()]
        c.push_pull(step)
        assert all(p.grad is None for p in unused.parameters())
        assert all(torch.equal(p.grad, w) for p, w in zip(used.parameters(), want))
    c.close()
    assert proc.wait(timeout=30) == 0


def test_udp_sources_name_every_peer_socket_and_give_up_on_wildcards():
    from dgt.sidecar import udp_sources
    peers = {0: {"host": "127.0.0.1", "udp_ports": [5001, 5002]},
             1: {"host": "localhost", "udp_ports": [5011, 5012]}}
    src = udp_sources(peers, me=0)
    assert src[("127.0.0.1", 5011)] == 1 and src[("127.0.0.1", 5012)] == 1
    assert ("127.0.0.1", 5001) not in src            # our own sockets are no peer's
    assert udp_sources({**peers, 2: {"host": "0.0.0.0", "udp_ports": [1]}}, me=0) is None


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_strangers_idle_tcp_connections_are_capped_and_timed_out(sidecar, tmp_path):
    """Connections that never say HELLO: at most MAX_PENDING_HELLO wait, each on a
    64 KiB buffer (it was 1 MiB each, with no limit and no timeout: a breaker held
    1,000 of them for 1.3 GB), the oldest are evicted as new ones come, and every one is closed
    after HELLO_TIMEOUT_S. The report counts both."""
    import json
    import time

    from dgt.sidecar import HELLO_TIMEOUT_S, MAX_PENDING_HELLO
    path, proc = sidecar
    ep = tmp_path / "endpoints-0.json"
    t_end = time.monotonic() + 60
    while not ep.exists():
        assert proc.poll() is None and time.monotonic() < t_end
        time.sleep(0.1)
    port = json.loads(ep.read_text())["tcp_port"]
    before = _rss_kib(proc.pid)
    n = MAX_PENDING_HELLO + 40
    conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]
    time.sleep(1.0)
    grown_mib = (_rss_kib(proc.pid) - before) / 1024
    assert grown_mib < 0.25 * n, grown_mib     # 1 MiB per connection before
    closed = 0
    for c in conns:   # every one ends: evicted now or timed out later (bounded wait)
        c.settimeout(HELLO_TIMEOUT_S + 20)
        try:
            closed += c.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        c.close()
    assert closed == n
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    rejected = json.loads((tmp_path / "sidecar-0.json").read_text())["rejected"]
    assert rejected.get("evicted_pending") == n - MAX_PENDING_HELLO, rejected
    assert rejected.get("no_hello") == MAX_PENDING_HELLO, rejected


def test_client_refuses_a_socket_another_user_listens_on(shared_tmp):
    # breaker round 5: another user binds the path first and poses as the sidecar
    shared = shared_tmp
    os.chmod(shared, 0o1777)   # like /tmp itself
    path = os.path.join(shared, "dgt-3.sock")
    squat = subprocess.Popen(as_nobody() + [
        "/usr/bin/python3", "-c",
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(4)\n"
        "print('up', flush=True); time.sleep(120)", path],
        stdout=subprocess.PIPE, text=True)
    try:
        assert squat.stdout.readline().strip() == "up"
        with pytest.raises(dgt.PeerFailure) as e:
            dgt.Client(path, timeout_s=5, connect_timeout_s=5)
        msg = str(e.value)
        assert f"socket {path} is served by uid 65534 (pid {squat.pid})" in msg, msg
        assert f"not by this user (uid {os.getuid()})" in msg and "\n" not in msg
    finally:
        squat.kill()
        squat.wait()


@pytest.mark.timeout(180)
def test_a_sidecar_refuses_another_user_s_connection_and_waits_for_its_own(shared_tmp):
    """Breaker round 7: a process of uid 65534 that reached a root sidecar's socket (in a
    folder it can enter, made with umask 000) registered, then disconnected, and the
    sidecar stopped: 'trainer of rank 0 disconnected'. Now it is refused before its
    first line and the sidecar serves its own user's trainer afterwards."""
    nobody = as_nobody()
    os.chmod(shared_tmp, 0o1777)
    path = os.path.join(shared_tmp, "s.sock")
    run_dir = os.path.join(shared_tmp, "run")
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                          "--world", "1", "--master-port", str(free_port()), "--socket",
                          path, "--run-dir", run_dir], stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: os.umask(0))
    try:
        t_end = time.monotonic() + 120
        while not os.path.exists(path):
            assert p.poll() is None and time.monotonic() < t_end, p.stderr.read()
            time.sleep(0.05)
        intruder = subprocess.run(nobody + [
            "/usr/bin/python3", "-c",
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "try:\n"
            "    s.sendall(b'{\"op\": \"register\", \"n_params\": 10}\\n')\n"
            "except OSError:\n"   # refused at once: the sidecar may close first
            "    pass\n"
            "print(s.makefile().readline(), end='')", path],
            capture_output=True, text=True, timeout=60)
        assert f"this sidecar serves uid {os.getuid()}'s trainer only" in intruder.stdout, \
            (intruder.stdout, intruder.stderr)
        c = dgt.Client(path, timeout_s=60, connect_timeout_s=10)   # its own trainer
        c.register(nn.Linear(4, 2))
        c.close()
        assert p.wait(timeout=60) == 0
        err = p.stderr.read()
        assert "a connection from uid 65534" in err and "refused" in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_default_socket_and_run_dir_are_a_private_folder_of_this_user(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGT_")}
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                          "--world", "1", "--master-port", str(free_port())], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert f"socket {xdg}/dgt/sidecar-0.sock" in line, (line, p.poll())
        assert os.stat(xdg / "dgt").st_mode & 0o777 == 0o700
        c = dgt.Client(timeout_s=30, connect_timeout_s=30)   # the same default path
        c.register(nn.Linear(2, 2))
        c.close()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.parametrize("how", ["other-owner", "group-writable"])
def test_a_default_folder_another_user_could_write_is_refused_in_one_line(tmp_path, how):
    xdg = tmp_path / "xdg"
    (xdg / "dgt").mkdir(parents=True)
    if how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip(reason="needs root: chown to another user (uid 65534)")
        os.chown(xdg / "dgt", 65534, 65534)
        want = "is owned by uid 65534"
    else:
        (xdg / "dgt").chmod(0o770)
        want = "is writable by other users (mode 770)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGT_")}
    env["XDG_RUNTIME_DIR"] = str(xdg)
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                        "--world", "1", "--master-port", str(free_port())], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"{xdg}/dgt {want}" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_ready_callback_that_raises_leaves_the_client_in_step(sidecar):
    """PULLs pipelined (push_pull's ready): the callback gets every parameter once; when
    it raises, the error comes out after the iteration is read, and the next step works."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = _conv_model()
    c.register(m)
    x = torch.randn(2, 3, 8, 8)
    seen = []

    def ready(params):
        seen.extend(params)
    m(x).sum().backward()
    c.push_pull(0, ready=ready)
    assert [id(p) for p in seen] == [id(p) for p in m.parameters()]

    class Boom(Exception):
        pass

    def boom(params):
        raise Boom("from the caller")
    m.zero_grad()
    m(x).sum().backward()
    with pytest.raises(Boom):
        c.push_pull(1, ready=boom)
    m.zero_grad()
    m(x).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    seen.clear()
    c.push_pull(2, ready=ready)   # the stream is in step: step 2's answers, not step 1's
    assert len(seen) == len(want)
    for p, w in zip(m.parameters(), want):   # one worker: the aggregate is its grad
        assert torch.equal(p.grad, w)
    c.close()
    assert proc.wait(timeout=30) == 0


@pytest.mark.timeout(180)
def test_a_trainer_whose_sidecar_was_killed_names_its_log_and_no_peer(tmp_path):
    # an outside tester's fault F7: 'dgt train''s trainer said "job failed (a peer): ...
    # see its log sidecar-<rank>.log in the run dir": its own sidecar, no peer, and the
    # log's real path is known (beside the socket, with its rank)
    sock, log = tmp_path / "sidecar-0.sock", tmp_path / "sidecar-0.log"
    with open(log, "wb") as out:
        side = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                                 "--world", "1", "--master-port", str(free_port()),
                                 "--socket", str(sock), "--run-dir", str(tmp_path)],
                                stdout=out, stderr=subprocess.STDOUT)
    trainer = subprocess.Popen([sys.executable, "-m", "dgt.job", "--rank", "0", "--world",
                                "1", "--socket", str(sock), "--result",
                                str(tmp_path / "trainer-0.json"), "--hidden", "8",
                                "--iterations", "100000", "--eval-every", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline(), trainer.communicate(timeout=60)  # it trains
        side.kill()
        side.wait(timeout=30)
        _, err = trainer.communicate(timeout=60)
    finally:
        for p in (trainer, side):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for f in glob.glob(os.path.join("/dev/shm", f"dgt-{side.pid}-*")):
            os.unlink(f)
    assert trainer.returncode == 3, err
    assert (f"dgt trainer 0: job failed: this rank's sidecar (pid {side.pid}, socket "
            f"{sock}) closed the connection without a word: it exited or was killed; "
            f"see its log {log}") in err, err
    assert "a peer" not in err, err


UNCAUGHT = """
import sys, torch, dgt
c = dgt.Client(sys.argv[1], timeout_s=30)
c.register(torch.nn.Linear(3, 3).double())   # raises, uncaught
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["uncaught", "close(exception)"])
def test_a_register_refused_on_the_trainer_s_side_ends_the_sidecar(sidecar, how):
    """Breaker round 18: a float64 model's register() raised, and then the trainer either
    exited without close() (an uncaught exception) or called close(failed=<the
    exception>), which raised 'Object of type TypeError is not JSON serializable':
    either way the hand-started sidecar waited for ever."""
    path, proc = sidecar
    if how == "uncaught":
        t = subprocess.run([sys.executable, "-c", UNCAUGHT, path], capture_output=True,
                           text=True, timeout=60)
        assert t.returncode == 1 and "TypeError" in t.stderr, t.stderr
    else:
        c = dgt.Client(path, timeout_s=30)
        with pytest.raises(TypeError, match="float32") as e:
            c.register(nn.Linear(3, 3).double())
        c.close(failed=e.value)
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 3, err
    assert ("trainer of rank 0 failed before it registered (TypeError: dgt moves "
            "float32 gradients") in err, err
    assert " ready: " not in err


@pytest.mark.timeout(120)
def test_close_with_an_exception_fails_the_job_naming_it(sidecar):
    """Breaker round 18: close(failed=<an exception>) after register() raised a
    TypeError (json) and sent nothing; the sidecar took the trainer's exit for a crash."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    c.register(m)
    c.close(failed=RuntimeError("boom"))
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 3, err
    assert "rank 0's trainer failed (RuntimeError: boom) at step 0" in err, err


@pytest.mark.parametrize("kwargs,message", [
    ({"timeout_s": 1e10}, "Client(timeout_s=10000000000.0): give the seconds"),
    ({"connect_timeout_s": 10 ** 400}, "give the seconds to wait for the sidecar's socket"),
    ({"path": ""}, "Client(path=''): give the sidecar's Unix socket"),
])
def test_client_arguments_a_socket_cannot_take_are_refused_up_front(kwargs, message):
    """Breaker round 18: timeout_s=1e10 passed the check, then settimeout() raised
    OverflowError after the connection was made; Client('') gave a bare OSError."""
    with pytest.raises(ValueError) as e:
        dgt.Client(**{"path": "/nonexistent/s.sock", **kwargs})
    assert message in str(e.value)


@pytest.mark.timeout(120)
def test_an_empty_resume_is_refused_and_the_client_may_register_again(sidecar):
    """Breaker round 18: register(resume='') started again from step 0 (dgt train
    refuses --resume '' for that reason)."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"register\(resume=''\): give the file"):
        c.register(m, resume="")
    c.register(m)   # nothing was sent: the client is as before
    m(torch.ones(1, 4)).sum().backward()
    c.push_pull(0)
    c.close()
    assert proc.wait(timeout=60) == 0


@pytest.mark.timeout(120)
def test_a_step_that_is_not_an_int_and_an_empty_save_path_are_refused(sidecar):
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    c.register(m)
    m(torch.ones(1, 4)).sum().backward()
    for step in (True, 0.0):
        with pytest.raises(TypeError, match="step must be an int"):
            c.push_pull(step)
    with pytest.raises(ValueError, match=r"save_state\(''\): give the file"):
        c.save_state("")
    c.push_pull(0)   # nothing of the refused calls reached the sidecar
    c.close()
    assert proc.wait(timeout=60) == 0


def _one_step(path: str):
    """A Client of the sidecar at ``path``, registered with a Linear(4, 2) and past its
    first push_pull; (the client, the model)."""
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    c.register(m)
    m(torch.ones(1, 4)).sum().backward()
    c.push_pull(0)
    return c, m


class _Unreadable(Exception):
    def __str__(self):
        raise RuntimeError("str broken")


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("repr broken")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failed,said", [
    (_Unreadable(), "_Unreadable (its text could not be read: RuntimeError)"),
    (_NoRepr(), "_NoRepr (its text could not be read: RuntimeError)"),
    ("z" * 70_000, "z" * 300 + ") at step 1"),
    ("", "an error with no message"),
    (AssertionError(), "(AssertionError) at step 1")])
def test_close_says_any_failure_in_one_line_and_never_raises(sidecar, failed, said):
    """Breaker round 19: a failed object whose __str__ or __repr__ raised made close()
    raise before it sent anything; a 70,000-character text was over the control line's
    limit, and the sidecar, told 'control line too long', waited for ever (after
    register, an internal error with a traceback); close(failed='') (str of an
    AssertionError()) was taken for a clean goodbye, and the job ended with exit 0."""
    path, proc = sidecar
    c, m = _one_step(path)
    c.close(failed=failed)
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 3, err
    assert said in err and "internal error" not in err, err


class _Fspath:
    """An os.PathLike whose __fspath__ gives ``value`` (or raises)."""

    def __init__(self, value, raises: bool = False):
        self.value, self.raises = value, raises

    def __fspath__(self):
        if self.raises:
            raise RuntimeError("no path here")
        return self.value

    def __repr__(self):
        return "<odd path>"


@pytest.mark.timeout(120)
def test_a_nul_in_a_save_path_is_refused_and_the_job_goes_on(sidecar):
    """Breaker round 19: save_state('...\\0...') failed the job with the sidecar's
    'internal error: embedded null byte'. The Client refuses it; a raw save that
    carries one is answered as a file that cannot be written."""
    path, proc = sidecar
    from dgt.client import _registered
    c, m = _one_step(path)
    with pytest.raises(ValueError, match=r"save_state\('/tmp/a\\x00b'\): give the file"):
        c.save_state("/tmp/a\0b")
    with pytest.raises(ValueError, match=r"register\(resume='/tmp/a\\x00b'\)"):
        _registered(m, "/tmp/a\0b")
    # a PathLike whose __fspath__ gives no str (an int, bytes) or raises: TypeError
    # from os.fspath before, not the one line naming the argument
    for odd in (_Fspath(7), _Fspath(b"/tmp/x"), _Fspath(None, raises=True)):
        with pytest.raises(ValueError, match=r"save_state\(<odd path>\): give the file"):
            c.save_state(odd)
        with pytest.raises(ValueError, match=r"register\(resume=<odd path>\)"):
            _registered(m, odd)
        with pytest.raises(ValueError, match=r"Client\(path=<odd path>\): give the "):
            dgt.Client(odd)
    c._send({"op": "save", "path": "/tmp/a\0b"})   # as another client could
    assert c._recv("saved")["error"] == "the path has a NUL byte"
    c.push_pull(1)   # the job went on
    c.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


@pytest.mark.timeout(120)
def test_a_registered_trainer_s_overlong_control_line_is_named_not_an_internal_error(sidecar):
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    c.register(nn.Linear(4, 2))
    c.sock.sendall(b'{"op": "push", "pad": "' + b"x" * 70_000 + b'"}\n')
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 3, err
    assert "rank 0's trainer sent a control line over 65536 bytes" in err, err
    assert "internal error" not in err and "Traceback" not in err, err


class _InterruptingStr(Exception):
    def __str__(self):
        raise KeyboardInterrupt


class _ExitingRepr:
    def __repr__(self):
        raise SystemExit(3)


class _NamelessType(type):
    @property
    def __name__(cls):
        raise RuntimeError("name")


class _Nameless(metaclass=_NamelessType):
    def __repr__(self):
        raise RuntimeError("repr")


@pytest.mark.parametrize("make,text", [
    (_InterruptingStr, "_InterruptingStr (its text could not be read: KeyboardInterrupt)"),
    (_ExitingRepr, "_ExitingRepr (its text could not be read: SystemExit)"),
    (_Nameless, "an object (its text could not be read: RuntimeError)"),
    (lambda: "bad \udc80 surrogate", "bad \\udc80 surrogate"),
    (lambda: "a\x00nul", "a\\x00nul"),
    (lambda: "é ü 中", "é ü 中")],
    ids=["str-interrupts", "repr-exits", "nameless-type", "surrogate", "nul", "utf-8"])
def test_a_failure_text_is_one_printable_line_whatever_the_object_raises(make, text):
    """Breaker round 20: close(failed=...) raised when the object's __str__ or __repr__
    raised SystemExit or KeyboardInterrupt (or its type's name raised), and sent
    nothing: a hand-started sidecar waited for ever. A lone surrogate could not go on
    to the other ranks (UTF-8); a NUL reached the sidecar's log line raw. (The objects
    are made in the test: pytest's report would call their repr.)"""
    from dgt.client import failure_text
    got = failure_text(make())
    assert got == text
    got.encode("utf-8")   # the wire's and the store's encoding


KILLED_BEFORE_REGISTER = """
import os, signal, sys
import dgt
c = dgt.Client(sys.argv[1], timeout_s=30)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(120)
def test_a_trainer_killed_before_it_registers_ends_its_sidecar(sidecar):
    """Breaker round 19: a trainer killed (SIGKILL, SIGTERM) after it connected and
    before register() left its hand-started sidecar waiting for ever (its connection
    closed without a line). Its process has ended, so the sidecar names it."""
    path, proc = sidecar
    t = subprocess.run([sys.executable, "-c", KILLED_BEFORE_REGISTER, path], timeout=60)
    assert t.returncode == -signal.SIGKILL
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 3, err
    assert re.search(r"trainer of rank 0 \(pid \d+\) ended before it registered, without "
                     r"a word", err), err


@pytest.mark.timeout(120)
def test_a_live_process_that_closes_a_connection_without_a_word_changes_nothing(sidecar):
    path, proc = sidecar
    t_end = time.monotonic() + 60
    while not os.path.exists(path):   # the sidecar's start-up (a guard, not a timing)
        assert proc.poll() is None and time.monotonic() < t_end
        time.sleep(0.05)
    with socket.socket(socket.AF_UNIX) as s:   # this process lives on
        s.connect(path)
    c, _ = _one_step(path)
    c.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()


@pytest.mark.timeout(120)
def test_a_failure_that_names_the_rank_is_logged_with_the_rank_once(sidecar):
    """The sidecar's log line put its rank before a message that already began with it:
    'rank 0: rank 0: register sent twice'."""
    path, proc = sidecar
    c, m = _one_step(path)
    c._send({"op": "register", "n": 10})   # a second register, as a broken client would
    with pytest.raises(dgt.PeerFailure, match="register sent twice"):
        c._recv("registered")
    proc.wait(timeout=60)
    err = proc.stderr.read()
    assert proc.returncode == 3, err
    assert "rank 0: register sent twice" in err, err
    assert "rank 0: rank 0:" not in err, err


@pytest.mark.timeout(120)
def test_push_buffer_and_push_part_check_their_arguments_before_sending(sidecar):
    """Breaker round 22: push_buffer(0.9) then push_buffer(1.2) ran as steps 0 and 1;
    push_part(0, [(0.5, inf)]) raised a bare OverflowError; push_buffer before register()
    was sent, and the sidecar closed the connection ('not a trainer: the first message
    must be register'). Each is now refused here, nothing sent, the Client usable."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    with pytest.raises(RuntimeError, match=r"call register\(model\) before push_buffer"):
        c.push_buffer(0)
    with pytest.raises(RuntimeError, match=r"call register\(model\) before push_part"):
        c.push_part(0, [(0, 1)])
    for model in (None, "model", [nn.Linear(4, 2)]):   # breaker round 23: AttributeError
        with pytest.raises(TypeError, match=r"register\(model=\.\.\.\): give a torch\.nn"):
            c.register(model)
    m = nn.Linear(4, 2)
    c.register(m)   # the connection is as before
    for bad in (0.9, True, "0", None):
        with pytest.raises(TypeError, match="step must be an int"):
            c.push_buffer(bad)
        with pytest.raises(TypeError, match="step must be an int"):
            c.push_part(bad, [(0, 1)])
    with pytest.raises(ValueError, match="step 1 out of order: expected 0"):
        c.push_buffer(1)
    for ranges in ([(0.5, float("inf"))], [(0, 1.0)], [(True, 2)], [(0, 1, 2)], 5):
        with pytest.raises(TypeError, match=r"push_part\(ranges=\.\.\.\): give \(lo, hi\)"):
            c.push_part(0, ranges)
    # breaker round 23: a range the sidecar refuses failed the job, the caller told
    # nothing (Linear(4, 2) has 10 elements)
    for ranges in ([(5, 1)], [(0, 10**12)], [(-1, 3)], [], [(0, 11)]):
        with pytest.raises(ValueError, match=r"give one or more \[lo, hi\) with "
                                             r"0 <= lo < hi <= 10"):
            c.push_part(0, ranges)
    m(torch.ones(1, 4)).sum().backward()
    with pytest.raises(TypeError, match=r"push_pull\(ready=\.\.\.\): give a function"):
        c.push_pull(0, ready=5)   # a bare "'int' object is not callable", mid-push
    c.push_pull(np.int64(0))   # a numpy integer is an int
    c.push_part(1, [(0, 2)])
    # a range that overlaps one of the iteration's failed the job at the sidecar
    for ranges in ([(1, 3)], [(4, 6), (5, 7)], [(0, 10)]):
        with pytest.raises(ValueError, match=r"overlap: each element is handed over once "
                                             r"per iteration \(step 1\)"):
            c.push_part(1, ranges)
    c.push_part(1, [(2, 4), (8, 10)])   # next to [0, 2): no overlap
    c.push_buffer(1)
    c.push_part(2, [(0, 2)])   # a new iteration starts afresh
    c.push_buffer(2)
    c.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
