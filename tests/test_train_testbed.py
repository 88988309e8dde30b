"""'dgt train --testbed': every gradient crosses shaped 1 Gbit/s htb-prio ports."""
import os

import pytest
from conftest import requires_tool
from dgt.transport.channels import channel_dscp

pytestmark = [pytest.mark.slow, requires_tool("ip"),
              pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (netns)")]


@pytest.fixture
def testbed4():
    from dgt.tc_profiles import testbed
    testbed.down()
    try:
        yield testbed.up(4, rate="1gbit", profile="htb-prio")
    finally:
        testbed.down()


def test_train_across_the_testbed(train, testbed4):
    p, r = train("--testbed", "--workers", 4)
    assert r["final_test_accuracy"] >= 0.95, p.stdout
    assert r["replicas_identical"]
    hosts = {s["host"] for s in r["sidecars"]}
    assert hosts == {testbed4.host_addr(i) for i in range(4)}
    for name in ("tcp", "udp1", "udp2", "udp3"):
        assert r["channels"][name]["blocks_sent"] > 0
    # host 0's shaped port carried the traffic, each channel in the band of its DSCP
    state = testbed4.status()[f"{testbed4.host_netns(0)}:eth0"]
    by_dscp = {d: c["stats"]["bytes"] for c in state["classes"] for d in c["dscp"]}
    for dscp in channel_dscp(3):   # tcp, udp1, udp2, udp3
        assert by_dscp[dscp] > 1_000_000, (dscp, by_dscp)


@pytest.mark.parametrize("codec, block", [("fp32", 4096), ("auto", 8192)])
def test_datagram_over_path_mtu_is_refused_clearly(train, testbed4, codec, block):
    # f32 bands, and the default int8 ones (a byte a value: twice the block to overflow)
    p, r = train("--testbed", "--workers", 2, "--epochs", 1, "--block-bytes", block,
                 "--band-codec", codec, check=False)
    assert p.returncode != 0 and r is None
    from dgt.transport import pmtu
    from dgt.transport.wire import Coding
    coding = int(Coding.INT8) if codec == "auto" else 0
    fit = pmtu.max_block_bytes(1500, pmtu.IPV4_UDP_BYTES, mac=False,   # testbed: 1500 B
                               codings=(coding,))
    out = p.stdout + p.stderr
    assert "does not fit: the path MTU to rank" in out and "is 1500 B" in out, out
    assert f"use --block-bytes {fit} or less" in out, out


def test_a_testbed_taken_down_under_a_job_is_named(tmp_path):
    """'dgt testbed down' under a running '--testbed' job stops what runs in its
    namespaces: the job fails naming that, blaming no rank (breaker round 7: "trainer of
    rank 0 was killed by signal 15", nothing more)."""
    import subprocess
    import sys
    import uuid

    from dgt.tc_profiles import testbed
    prefix = f"dgttd{uuid.uuid4().hex[:6]}"
    testbed.up(2, rate="1gbit", prefix=prefix)
    p = None
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "dgt.cli", "train", "--workers", "2", "--testbed",
             "--testbed-prefix", prefix, "--iterations", "100000", "--epochs", "10000",
             "--eval-every", "0", "--run-dir", str(tmp_path / "run")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in p.stdout:   # training has begun: its first epoch's line
            if line.startswith("epoch"):
                break
        testbed.down(prefix)
        out, err = p.communicate(timeout=120)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        testbed.down(prefix)
    assert p.returncode == 1, (p.returncode, err)
    assert f"the testbed '{prefix}' was taken down under the job" in err, err
