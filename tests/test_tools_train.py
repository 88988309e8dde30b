"""The tools against a real 'dgt train' run: capture -> summary == report; replay of an
old session at a running job is rejected and changes nothing."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import requires_tool
from test_train_faults import free_base_port, wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="packet capture needs root"),
              # the capture must hold every packet of a busy job on lo: that takes the
              # kernel filter libpcap compiles (user-space filtering drops under load)
              requires_tool("libpcap")]

DGT = [sys.executable, "-m", "dgt.cli"]
SMALL = ["--epochs", "15", "--hidden", "128", "--seed", "5", "--deadline-ms", "3000"]


def train(tmp, name, base, *extra, wait=True):
    cmd = DGT + ["train", *SMALL, "--base-port", str(base), "--run-dir", str(tmp / name),
                 "--report", str(tmp / f"{name}.json"), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
    return p


def lost(report):
    return sum(ch["blocks_lost"] for ch in report["channels"].values())


def test_capture_summary_matches_report_and_replay_is_rejected(tmp_path):
    base_a = free_base_port()
    pcap = tmp_path / "a.pcap"
    cap = subprocess.Popen(DGT + ["capture", "--base-port", str(base_a), "--ranks", "4",
                                  "--udp-channels", "3", "-w", str(pcap), "-q"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2)  # the filter is attached before traffic starts
    assert cap.poll() is None, cap.communicate()
    train(tmp_path, "a", base_a)
    cap.send_signal(signal.SIGTERM)
    cap.communicate(timeout=30)
    ra = json.loads((tmp_path / "a.json").read_text())
    assert lost(ra) == 0, "precondition: a run without loss"

    s = subprocess.run(DGT + ["pcap", "summary", str(pcap), "--report", str(tmp_path / "a.json"),
                              "--json", str(tmp_path / "sa.json")],
                       capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stdout + s.stderr
    summary = json.loads((tmp_path / "sa.json").read_text())
    assert summary["undecodable"]["total"] == 0 if isinstance(summary["undecodable"], dict) \
        else summary["undecodable"] == 0
    for name, ch in ra["channels"].items():
        got = summary["channels"].get(name, {"blocks": 0, "bytes": 0})
        assert (got["blocks"], got["bytes"]) == (ch["blocks_sent"], ch["bytes_sent"]), name

    # run B, same seed, while the capture of run A is replayed at it
    base_b = free_base_port()
    while abs(base_b - base_a) < 40:
        base_b = free_base_port()
    pb = train(tmp_path, "b", base_b, "--peer-timeout-s", "600", wait=False)
    wait_for(tmp_path / "b" / "endpoints-3.json", pb)
    # run B's trainers are held (SIGSTOP) while the replay runs, so B cannot finish
    # before the replay's last message however slow this host is; its sidecars listen
    # and receive throughout, and the pause changes none of B's bits
    wait_for(tmp_path / "b" / "pids.json", pb)
    trainers = [e["pid"] for e in json.loads((tmp_path / "b" / "pids.json").read_text())
                if e["kind"] == "trainer"]
    for pid in trainers:
        os.kill(pid, signal.SIGSTOP)
    try:
        rep = subprocess.run(DGT + ["replay", str(pcap), "--to", "127.0.0.1", "--base-port",
                                    str(base_b), "--from-base-port", str(base_a),
                                    "--speed", "4",
                                    "--json", str(tmp_path / "replay.json")],
                             capture_output=True, text=True, timeout=300)
    finally:
        for pid in trainers:
            os.kill(pid, signal.SIGCONT)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    out, err = pb.communicate(timeout=300)
    assert pb.returncode == 0, out + err
    rb = json.loads((tmp_path / "b.json").read_text())
    assert lost(rb) == 0, "precondition: a run without loss"
    assert rb["param_sha256"] == ra["param_sha256"]     # training unaffected
    rejected = rb["rejected"]
    # run A's datagrams come from ports that are none of run B's peers, or arrive
    # before B's shards exist: the kernel filter drops them (transport.sockfilter);
    # its TCP connections carry A's session (stray)
    assert rejected.get("stray", 0) + rejected.get("not_ready", 0) > 0, rejected
    assert rb["udp_kernel_drops"] + rejected.get("unknown_source", 0) > 0, rejected
    shutil.rmtree(tmp_path / "a", ignore_errors=True)
