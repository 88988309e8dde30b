"""A stranger cannot stop a job: idle connections and forged HELLO/ERROR/BYE frames at
every sidecar from the moment its ports open (tools/attack.py), with and without
--secret. The job completes, replicas are identical (with --secret: the same bits as a
clean run of the same seed), the counters show the rejections, and no rank is blamed."""
import os
import threading

import pytest

from conftest import logs_of, run_train
from test_train_faults import free_base_port

pytestmark = pytest.mark.slow

JOB = ("--workers", 3, "--iterations", 12, "--hidden", 64, "--seed", 3)


def _attacked(tmp_path, name, *extra):
    from dgt.tools.attack import attack
    base = free_base_port()
    stop = threading.Event()
    sent: dict = {}
    sniff = os.geteuid() == 0   # an attacker on the path knows the session id

    def run():
        sent.update(attack("127.0.0.1", base, 3, duration_s=300, idle=256, every_s=0.05,
                           sniff=sniff, stop=stop))

    t = threading.Thread(target=run)
    t.start()   # before the sidecars bind: from the moment the ports open
    try:
        p, r = run_train(tmp_path / name, *JOB, "--base-port", base, *extra, timeout=300,
                         check=False)
    finally:
        stop.set()
        t.join(60)
    logs = logs_of(tmp_path / name / "run")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + logs[-3000:]
    assert r["replicas_identical"]
    assert "Traceback" not in logs
    # nobody blamed: no lost connection, no ERROR taken for real
    assert "lost connection" not in logs and "reports:" not in logs, logs[-3000:]
    rej = r["rejected"]
    assert sent["forged_hello"] > 0 and sent["idle_connections"] >= 3 * 128, sent
    assert rej.get("evicted_pending", 0) + rej.get("no_hello", 0) > 0, rej
    # the ERROR-first connections: refused at HELLO (with --secret: at the MAC)
    assert rej.get("bad_hello", 0) + rej.get("no_mac", 0) > 0, rej
    return r, sent


def test_a_stranger_at_start_up_cannot_stop_a_job_without_a_secret(tmp_path):
    r, sent = _attacked(tmp_path, "plain")
    if sent["session_sniffed"]:
        # forged HELLOs with the real session either coexist with the real ones, their
        # ERROR/BYE changing nothing (unverified_control), or come after the rank's
        # connection carried traffic and are refused (rank_taken): which, is a race of
        # the sniffer against start-up (CI of e5d6d29 saw rank_taken 9 and no
        # unverified_control), so either counts
        rej = r["rejected"]
        assert rej.get("unverified_control", 0) + rej.get("rank_taken", 0) > 0, (sent, rej)


def test_with_a_secret_an_attacked_job_ends_with_the_clean_run_s_bits(tmp_path):
    # a fixed 10 s deadline: a block that the attack's CPU load delays is late, never
    # lost (a lost block changes the bits as designed, and on a loaded 2-core machine
    # the default 50 ms floor made this comparison a matter of luck); tail markers end
    # each wait as soon as a band is in, so nothing waits the 10 s
    secret = ("--secret", "s3cret-of-this-job", "--deadline-ms", 10000)
    _, clean = run_train(tmp_path / "clean", *JOB, *secret)
    r, _ = _attacked(tmp_path, "attacked", *secret)
    lost = {c: v["lost"] for c, v in r["channels"].items() if v.get("lost")}
    assert not lost, lost
    assert r["param_sha256"] == clean["param_sha256"]
