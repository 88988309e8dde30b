"""Fault injection against a real 'dgt train' run: malformed input, dead peers."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import logs_of

pytestmark = pytest.mark.slow


def free_base_port() -> int:
    """A base port whose next 40 ports are free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1] // 10 * 10
        if base + 40 > 65000:
            continue
        ok = True
        for off in range(40):
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                with socket.socket(socket.AF_INET, kind) as t:
                    try:
                        t.bind(("127.0.0.1", base + off))
                    except OSError:
                        ok = False
        if ok:
            return base
    pytest.skip(reason="no free block of 40 ports on loopback")


def start_train(run_dir, *args):
    cmd = [sys.executable, "-m", "dgt.cli", "train", "--run-dir", str(run_dir),
           *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path, proc, timeout_s=120):
    t_end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < t_end, f"{path} never appeared"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_bad_input_during_training_is_counted_and_dropped(tmp_path):
    from dgt.tools.fuzz import fuzz
    base = free_base_port()
    run_dir, report = tmp_path / "run", tmp_path / "r.json"
    p = start_train(run_dir, "--epochs", 6, "--base-port", base, "--report", report)
    wait_for(run_dir / "endpoints-1.json", p)
    head = []
    for line in p.stdout:  # rank 0's progress: the session is live, training runs
        head.append(line)
        if line.startswith("epoch"):
            break
    ep = json.loads((run_dir / "endpoints-1.json").read_text())
    sent = fuzz("127.0.0.1", ep["tcp_port"], ep["udp_ports"], n=10_000, seed=1)
    out, err = p.communicate(timeout=300)
    out = "".join(head) + out
    assert p.returncode == 0, out + err
    r = json.loads(report.read_text())
    assert r["replicas_identical"]
    assert r["final_test_accuracy"] >= 0.95
    rejected = sum(r["rejected"].values())
    # every UDP mutant and every TCP connection that got through is counted
    assert rejected >= sent["udp"] * 0.95 + 1, (sent, r["rejected"])
    logs = logs_of(run_dir) + err
    assert "Traceback" not in logs


@pytest.mark.parametrize("victim", ["trainer", "sidecar"])
def test_dead_peer_ends_the_job_with_its_rank_named(tmp_path, victim):
    run_dir = tmp_path / "run"
    p = start_train(run_dir, "--epochs", 200)
    wait_for(run_dir / "pids.json", p)
    for line in p.stdout:  # rank 0's progress: training has started
        if line.startswith("epoch"):
            break
    pids = json.loads((run_dir / "pids.json").read_text())
    dead = next(x for x in pids if x["kind"] == victim and x["rank"] == 2)
    os.kill(dead["pid"], signal.SIGKILL)
    out, err = p.communicate(timeout=60)  # bounded: a hang fails the test
    assert p.returncode != 0
    text = out + err
    assert f"{victim} of rank 2" in text or "rank 2" in text, text
    assert "failed" in text
    assert not [x for x in pids if alive(x["pid"])]
    logs = logs_of(run_dir)
    assert "Traceback" not in logs
    # the survivors named the dead rank themselves
    assert "rank 2" in (run_dir / "trainer-0.log").read_text()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"dgt-{dead['pid']}")]


def _started(tmp_path, *args):
    run_dir = tmp_path / "run"
    p = start_train(run_dir, *args)
    wait_for(run_dir / "pids.json", p)
    for line in p.stdout:  # rank 0's progress: training has started
        if line.startswith("epoch"):
            break
    return p, run_dir, json.loads((run_dir / "pids.json").read_text())


def test_frozen_trainer_is_named_and_the_job_ends(tmp_path):
    p, run_dir, pids = _started(tmp_path, "--epochs", 200, "--peer-timeout-s", 5)
    frozen = next(x for x in pids if x["kind"] == "trainer" and x["rank"] == 2)
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        out, err = p.communicate(timeout=90)
    finally:
        try:
            os.kill(frozen["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert p.returncode != 0
    assert "rank(s) [2]" in out + err, out + err
    assert not [x for x in pids if alive(x["pid"])]


def test_sigterm_to_the_launcher_stops_every_child(tmp_path):
    p, run_dir, pids = _started(tmp_path, "--epochs", 200)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert "interrupted" in out + err
    assert not [x for x in pids if alive(x["pid"])]
    mine = {str(x["pid"]) for x in pids}
    assert not [f for f in os.listdir("/dev/shm") if f.split("-")[1:2] and
                f.split("-")[1] in mine]
    assert not list(run_dir.glob("*.sock"))


def test_too_slow_pacing_is_refused_with_the_flag_named(train):
    p, _ = train("--workers", 2, "--iterations", 1, "--pace-mbit", 0.5, check=False,
                 timeout=120)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "--pace-mbit 0.5" in out and "--peer-timeout-s" in out, out
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the testbed check)")
def test_missing_testbed_is_reported_first_with_the_prefix_and_leaves_nothing(tmp_path):
    before = set(os.listdir(tempfile.gettempdir()))
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--testbed",
                        "--testbed-prefix", "nosuchtb", "--workers", "2", "--epochs", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "dgt testbed up --hosts 2 --prefix nosuchtb" in p.stdout + p.stderr
    assert "logs in" not in p.stdout + p.stderr
    new = set(os.listdir(tempfile.gettempdir())) - before
    assert not [d for d in new if d.startswith("dgt-run-")]
