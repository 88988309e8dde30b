"""One node's sidecar as a user runs it: its socket, its files, its flags, its peers."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

import dgt
from conftest import as_nobody, stop_procs
from dgt.errors import PeerFailure


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sidecar(rank, world, port, sock, run_dir, *extra, env=None):
    argv = [sys.executable, "-m", "dgt.cli", "sidecar", "--rank", str(rank), "--world",
            str(world), "--master-port", str(port), "--socket", str(sock)]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    return subprocess.Popen(argv + [str(a) for a in extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _ready(p, run_dir, rank=0, timeout_s=60):
    """Wait until the sidecar has rendezvoused (its endpoints file is written)."""
    path = os.path.join(run_dir, f"endpoints-{rank}.json")
    t_end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < t_end, f"{path} never appeared"
        time.sleep(0.05)


def _ready_sidecars(n, tmp_path, timeout_s=60, peer_timeout_s=60):
    """(sockets, processes) of an n-node job's sidecars, each rendezvoused. The caller
    stops them (``stop_procs``); on a start-up failure here they are stopped already.
    Their start-up grace is 60 s, not the default 10: these tests are not about
    start-up, and with --peer-timeout-s 2 the rendezvous allowed 12 s, which a sidecar
    started beside another on a CI machine at load 4 did not make (CI of 8edbe69)."""
    port = _free_port()
    socks = [tmp_path / f"s{r}.sock" for r in range(n)]
    procs = [_sidecar(r, n, port, socks[r], tmp_path, "--peer-timeout-s", peer_timeout_s,
                      "--startup-grace-s", 60)
             for r in range(n)]
    try:
        for r, p in enumerate(procs):
            _ready(p, tmp_path, r, timeout_s=timeout_s)
    except BaseException:
        stop_procs(*procs)
        raise
    return socks, procs


_SEEDING = threading.Lock()   # trainers run in threads; torch's RNG is global


def _model(seed=0):
    with _SEEDING:
        torch.manual_seed(seed)
        return nn.Linear(8, 4)


def test_a_second_sidecar_refuses_a_live_socket_and_never_unlinks_it(tmp_path):
    sock = tmp_path / "s.sock"
    a = _sidecar(0, 1, _free_port(), sock, tmp_path / "a")
    try:
        _ready(a, tmp_path / "a")
        ino = os.stat(sock).st_ino
        b = _sidecar(0, 1, _free_port(), sock, tmp_path / "b")
        try:
            out, err = b.communicate(timeout=60)
        finally:
            stop_procs(b)
        assert b.returncode == 2, err
        assert f"socket {sock} in use by pid {a.pid}" in err
        assert len(err.strip().splitlines()) == 1, err
        assert os.stat(sock).st_ino == ino   # still the first one's socket
        c = dgt.Client(str(sock), connect_timeout_s=5)   # and it still answers
        c.register(_model())
        c.close()
    finally:
        stop_procs(a)
    a.wait(timeout=30)


def test_a_stale_socket_is_reclaimed_and_a_foreign_one_is_not_unlinked(tmp_path):
    sock = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))   # bound, never listening, then closed: a dead process's file
    stale.close()
    a = _sidecar(0, 1, _free_port(), sock, tmp_path)
    try:
        _ready(a, tmp_path)
        # someone replaces the path while we run: on exit we must leave theirs alone
        os.unlink(sock)
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(sock))
        other.listen(1)
        ino = os.stat(sock).st_ino
    finally:
        stop_procs(a)
    assert os.path.exists(sock) and os.stat(sock).st_ino == ino
    other.close()


def _train_steps(path, steps, out, key, seed=0, sleep_before=None):
    """``steps`` push_pulls of a tiny model on sidecar ``path``; ``out[key]``: "ok" or
    the PeerFailure. ``sleep_before``: (step, seconds) to sleep before that push."""
    try:
        c = dgt.Client(str(path), timeout_s=120, connect_timeout_s=120)
        m = _model(seed)
        c.register(m)
        for t in range(steps):
            if sleep_before is not None and sleep_before[0] == t:
                time.sleep(sleep_before[1])
            m.zero_grad()
            m(torch.ones(2, 8)).sum().backward()
            c.push_pull(t)
        c.close()
        out[key] = "ok"
    except PeerFailure as e:
        out[key] = e


def test_a_rank_that_closes_early_is_named_at_once_with_its_last_step(tmp_path):
    socks, procs = _ready_sidecars(2, tmp_path)
    try:
        out = {}
        th = [threading.Thread(target=_train_steps, args=(socks[0], 6, out, 0)),
              threading.Thread(target=_train_steps, args=(socks[1], 3, out, 1))]
        for t in th:
            t.start()
        for t in th:
            t.join(timeout=200)   # without the fix: "dead or frozen" after 60 s
        assert not any(t.is_alive() for t in th), "rank 0 still waits for rank 1"
        assert out[1] == "ok"
        assert isinstance(out[0], PeerFailure), out
        assert "rank 1 closed after step 2" in str(out[0])
        assert "dead or frozen" not in str(out[0])
    finally:
        stop_procs(*procs)


@pytest.mark.parametrize("late_step", [0, 1])
def test_the_first_push_waits_out_a_slow_start_and_later_ones_do_not(tmp_path, late_step):
    """--peer-timeout-s 2; rank 1's trainer sleeps 6 s before one of its pushes. Before
    its first, it is still starting (importing, loading data, a cold first backward:
    tens of seconds apart under dgt bench tta), and rank 0's first PULL wait covers that
    (config.START_SKEW_S); before a later one, it is a silent peer, named after 2 s."""
    socks, procs = _ready_sidecars(2, tmp_path, peer_timeout_s=2)
    try:
        out = {}
        th = [threading.Thread(target=_train_steps, args=(socks[0], 3, out, 0)),
              threading.Thread(target=_train_steps, args=(socks[1], 3, out, 1),
                               kwargs={"sleep_before": (late_step, 6.0)})]
        for t in th:
            t.start()
        for t in th:
            t.join(timeout=200)
        assert not any(t.is_alive() for t in th)
        if late_step == 0:
            assert out == {0: "ok", 1: "ok"}, out
        else:
            assert isinstance(out[0], PeerFailure), out
            assert "no PULL for iteration 1" in str(out[0]) and "within 2 s" in str(out[0])
    finally:
        stop_procs(*procs)


def test_a_master_that_never_comes_up_is_one_line_without_cpp_frames(tmp_path):
    # the grace given (a hand-started sidecar's default grows with the load)
    p = _sidecar(1, 2, _free_port(), tmp_path / "s.sock", tmp_path, "--peer-timeout-s", "1",
                 "--startup-grace-s", "10")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3, err
    assert "did not come up within 11 s of start-up" in err
    assert "frame #" not in err and "socket.cpp" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_torchrun_variables_a_runtime_run_dir_a_ready_line_and_a_quiet_sigterm(tmp_path):
    cwd, xdg = tmp_path / "cwd", tmp_path / "xdg"
    cwd.mkdir()
    xdg.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGT_")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), XDG_RUNTIME_DIR=str(xdg),
               DGT_SOCKET=str(tmp_path / "s.sock"))
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar"], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "rank 0/1 ready: tcp " in line and str(tmp_path / "s.sock") in line, \
            (line, p.stderr.read() if p.poll() is not None else "")
        assert (xdg / "dgt" / "endpoints-0.json").exists()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (xdg / "dgt" / "sidecar-0.json").exists()
    assert os.listdir(cwd) == []          # nothing in the current directory
    assert " ERROR " not in err and "stopped by signal" in err, err
    # a requested stop is no failure: no record for the launcher to read (breaker round 4)
    assert not list((xdg / "dgt").glob("failure-*.json"))


def test_a_small_udp_buffer_is_in_the_summary_and_the_report(tmp_path):
    """The kernel caps SO_RCVBUF at net.core.rmem_max; shrinking what the sidecar asks
    for (--udp-buffer-bytes) shows the same shortfall without touching the sysctl."""
    import json
    report = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "2",
                        "--iterations", "2", "--hidden", "16", "--udp-buffer-bytes", "65536",
                        "--report", str(report)], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    warned = [w for w in json.loads(report.read_text())["warnings"] if "SO_RCVBUF" in w]
    assert len(warned) == 1 and "rank(s) [0, 1]" in warned[0]
    assert "sysctl -w net.core.rmem_max=" in warned[0] and "is 131072 B" in warned[0]
    assert f"warning: {warned[0]}" in p.stdout
    # the logs live in a temporary folder that is removed: the console says so
    assert "removed after a successful run" in p.stdout


def test_replicas_that_start_from_different_weights_are_refused_with_the_ranks_named(
        tmp_path):
    socks, procs = _ready_sidecars(3, tmp_path, timeout_s=120)
    try:
        out = {}
        th = [threading.Thread(target=_train_steps, args=(socks[r], 2, out, r, seed))
              for r, seed in enumerate((0, 0, 5))]
        for t in th:
            t.start()
        for t in th:
            t.join(timeout=300)
        for r in range(3):
            assert isinstance(out[r], PeerFailure), out
            assert "rank(s) [2] start from different parameters than rank 0" in str(out[r])
    finally:
        stop_procs(*procs)


def test_rank_0_hosts_the_store_on_an_inherited_socket_so_its_port_cannot_be_taken(tmp_path):
    """dgt train binds the rendezvous port itself and hands the listening socket to rank
    0 (--master-listen-fd): between choosing a free port and the store's start, another
    process could take it (EADDRINUSE at start-up, seen on a busy host). Here the test
    holds the port the whole time: a sidecar that bound --master-port itself would fail;
    one that uses the inherited socket serves the store on it."""
    lsock = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = lsock.getsockname()[1]
    fd = lsock.fileno()
    argv = [sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0", "--world", "1",
            "--master-port", str(port), "--master-listen-fd", str(fd),
            "--socket", str(tmp_path / "s.sock"), "--run-dir", str(tmp_path)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         pass_fds=(fd,))
    try:
        _ready(p, tmp_path)
        from torch.distributed import TCPStore
        from datetime import timedelta
        store = TCPStore("127.0.0.1", port, 1, is_master=False,
                         timeout=timedelta(seconds=20))
        assert store.get("dgt/session/0")   # the sidecar's store answers on that port
    finally:
        stop_procs(p)
        lsock.close()


@pytest.mark.parametrize("fd,rank", [("2", "0"), ("7", "1")])
def test_a_master_listen_fd_that_cannot_be_one_is_one_line(tmp_path, fd, rank):
    p = _sidecar(int(rank), 2, _free_port(), tmp_path / "s.sock", tmp_path,
                 "--master-listen-fd", fd)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert "--master-listen-fd is for rank 0 only" in err
    assert len(err.strip().splitlines()) == 1, err


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} print them) listening on ``port``."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, hexport = f[1].rsplit(":", 1)
            if f[3] == "0A" and int(hexport, 16) == port:
                out.append(addr)
    return out


def test_rank_0_s_rendezvous_store_listens_on_master_addr_only(tmp_path):
    """The store is unauthenticated (it holds the session id a HELLO must carry); left
    to itself TCPStore listens on every interface. Rank 0 binds --master-addr only."""
    port = _free_port()
    p = _sidecar(0, 1, port, tmp_path / "s.sock", tmp_path, "--master-addr", "127.0.0.1")
    try:
        _ready(p, tmp_path)
        assert _listeners(port) == ["0100007F"], _listeners(port)   # 127.0.0.1 only
    finally:
        stop_procs(p)



@pytest.mark.parametrize("case", ["stale-of-another-user", "unwritable-folder"])
def test_a_socket_path_this_user_cannot_take_is_one_line_naming_it(case, shared_tmp):
    # breaker round 5: "in use by another process" for a stale root socket nobody
    # listens on, and a bare "[Errno 13] Permission denied" for --socket /etc/…
    shared = shared_tmp
    os.chmod(shared, 0o1777)   # like /tmp: nobody may remove root's files in it
    if case == "stale-of-another-user":
        sock = os.path.join(shared, "dgt-5.sock")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(sock)   # root's, never listening: a dead process's file
        stale.close()
        os.chmod(sock, 0o755)
        want = (f"socket {sock} is owned by uid 0: a stale socket (or another user's "
                f"live one) that this user (uid 65534) cannot remove")
    else:
        sock = "/etc/dgt-test-brk.sock"
        want = f"--socket {sock}: permission denied"
    p = subprocess.run(as_nobody() + [
        sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0", "--world", "1",
        "--master-port", str(_free_port()), "--socket", sock, "--run-dir",
        os.path.join(shared, "run")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert want in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not os.path.exists("/etc/dgt-test-brk.sock")


def test_a_socket_path_too_long_to_bind_is_one_line_saying_so(tmp_path):
    # bench tta, 2026-12-02: a variant's run dir made 'AF_UNIX path too long' (Python's
    # words, no advice) the whole failure
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    sock = str(deep / "s.sock")
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                        "--world", "1", "--master-port", str(_free_port()), "--socket",
                        sock, "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert f"--socket {sock} is {len(sock)} bytes; a Unix socket path can have at most " \
           f"107: give a shorter one" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("flag", ["--master-port", "--base-port"])
def test_a_port_this_user_may_not_bind_is_named_with_what_to_do(flag, shared_tmp):
    # breaker round, stop 33: '[Errno 13] Permission denied' naming no port for
    # --base-port 80, and for --master-port 80 a warning that the address is not this
    # host's, the store then listening on every interface, and torch's EACCES
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
        if int(f.read()) <= 80:
            pytest.skip(reason="this machine lets any user bind port 80")
    nobody = as_nobody()
    run = shared_tmp   # theirs: tmp_path is 0700
    os.chown(run, 65534, 65534)
    port = ["--master-port", "80"] if flag == "--master-port" else \
        ["--master-port", str(_free_port()), "--base-port", "80"]
    p = subprocess.run(nobody + [
        sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0", "--world", "1",
        *port, "--socket", os.path.join(run, "s.sock"), "--run-dir", run],
        capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stderr
    want = ("--master-port 80 on 127.0.0.1: Permission denied (ports below 1024 need "
            "root); pick a port from 1024 up") if flag == "--master-port" else \
        ("TCP port 80 of rank 0: permission denied (--base-port 80: ports below 1024 "
         "need root); pick a --base-port from 1024 up")
    assert want in p.stderr, p.stderr
    assert "not an address of this host" not in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("flag,values", [("--channels", (3, 2)),
                                         ("--block-bytes", (1408, 1024)),
                                         ("--world", (2, 3)), ("--world", (3, 2))])
def test_sidecars_started_with_different_wire_flags_are_refused_at_rendezvous(
        tmp_path, flag, values):
    """Two hand-started sidecars (a torchrun node with its own DGT_* variables) that
    disagree on a flag shaping the wire: both stop at rendezvous with one line naming
    the flag, the rank apart and both values (--channels used to end in an IndexError
    at the first push, --block-bytes in a PULL timeout blaming a live rank, --world in
    a rendezvous timeout blaming a rank that was never started, while the other rank
    waited on for its trainer)."""
    port = _free_port()
    procs = [_sidecar(r, 2, port, tmp_path / f"s{r}.sock", tmp_path, "--peer-timeout-s",
                      10, flag, v) for r, v in enumerate(values)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        stop_procs(*procs)
    want = (f"rank 1 has {values[1]}, rank 0 has {flag} {values[0]}; every rank must "
            f"give the same {flag}")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 3, (out, err)
        assert want in err, err
        assert "Traceback" not in err and "IndexError" not in err, err


@pytest.mark.parametrize("args,want", [
    ((["--mode", "tcp"], ["--mode", "dgt"]),
     "rank 1 has --mode dgt, rank 0 has --mode tcp; every rank must give the same --mode"),
    ((["--band-codec", "int8"], ["--band-codec", "fp32"]),
     "rank 1 has --band-codec fp32, rank 0 has --band-codec int8; every rank must give "
     "the same --band-codec"),
    ((["--reliable-codec", "int4"], ["--reliable-codec", "fp32"]),
     "rank 1 has --reliable-codec fp32, rank 0 has --reliable-codec int4"),
    ((["--k", "0.9"], ["--k", "0.1"]), "rank 1 has --k 0.1, rank 0 has --k 0.9"),
    (([], ["--no-error-feedback"]),
     "rank 1 has --no-error-feedback, rank 0 has --error-feedback; every rank must give "
     "the same --error-feedback"),
])
def test_sidecars_started_with_different_job_flags_are_refused_at_rendezvous(
        tmp_path, args, want):
    """Hand-started sidecars that disagree on a flag of the job's arithmetic (an
    outside tester, breaker round 5: each of these pairs trained to the end, exit 0,
    each rank's report stating its own settings, none the job that ran): both stop at
    rendezvous with one line naming the flag, the rank apart and both values."""
    port = _free_port()
    procs = [_sidecar(r, 2, port, tmp_path / f"s{r}.sock", tmp_path, "--peer-timeout-s",
                      10, *a) for r, a in enumerate(args)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        stop_procs(*procs)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 3, (out, err)
        assert want in err, err
        assert "Traceback" not in err, err


def test_a_socket_probe_says_hello_as_dgt_ipc_writes_it():
    """dgt.unixsock's probes of a live sidecar socket (a second sidecar's, dgt.ddp's
    stale-socket check) send this line before they close: without it, a probe whose
    process then ended was taken for a trainer killed before it registered, and the
    live sidecar failed its job (test_a_second_sidecar_refuses_a_live_socket_...)."""
    from dgt import ipc, unixsock
    assert unixsock.HELLO_LINE == ipc.encode_msg({"op": "hello"})
