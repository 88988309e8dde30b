"""dgt.Client as a library against a real one-node sidecar: use and misuse."""
import glob
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

import dgt


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sidecar(tmp_path):
    path = str(tmp_path / "s.sock")
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                          "--world", "1", "--master-port", str(_free_port()), "--socket",
                          path, "--run-dir", str(tmp_path)], stderr=subprocess.PIPE,
                         text=True)
    yield path, p
    if p.poll() is None:
        p.kill()
    p.wait(timeout=30)
    # a sidecar killed with SIGKILL (here or by a test) cannot unlink its buffer
    for f in glob.glob(os.path.join("/dev/shm", f"dgt-{p.pid}-*")):
        os.unlink(f)


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
    with pytest.raises(RuntimeError, match="closed"):
        c.push_pull(2)
    assert proc.wait(timeout=30) == 0


def test_dead_sidecar_is_a_peer_failure_not_a_hang(sidecar):
    """...and leaves nothing in /dev/shm: the buffer's name went at the first push
    (both sides had mapped it), so even a SIGKILL that nobody cleans up after (the
    launcher killed too) cannot leak it."""
    path, proc = sidecar
    c = dgt.Client(path, timeout_s=30)
    m = nn.Linear(4, 2)
    c.register(m)
    assert glob.glob(os.path.join("/dev/shm", f"dgt-{proc.pid}-*"))
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
