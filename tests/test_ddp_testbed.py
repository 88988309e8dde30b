"""The DDP hook across two testbed hosts: one torchrun per host, c10d rendezvous, two
trainers per host, every gradient through shaped 1 Gbit/s htb-prio ports."""
import json
import os
import subprocess
import sys

import pytest
from conftest import requires_tool, stop_procs
from dgt.transport.channels import channel_dscp

from test_ddp import EXAMPLE, REPO, _logs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), requires_tool("ip"),
              pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (netns)")]

PREFIX = "dgtdd"


@pytest.fixture
def testbed2():
    from dgt.tc_profiles import testbed
    testbed.down(PREFIX)
    try:
        yield testbed.up(2, rate="1gbit", profile="htb-prio", prefix=PREFIX)
    finally:
        testbed.down(PREFIX)


def test_two_hosts_two_trainers_each(tmp_path, testbed2):
    endpoint = f"{testbed2.host_addr(0)}:29400"
    procs = []
    for h in range(2):
        # gloo (DDP's process group) on the testbed port, not the host name's address
        env = dict(os.environ, DGT_RUN_DIR=str(tmp_path / f"h{h}"), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="eth0")
        log = open(tmp_path / f"torchrun-{h}.log", "w")
        procs.append(testbed2.popen_in(h, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "ddp-testbed",
            # the namespaces share one host name, so torchrun cannot tell which one
            # the endpoint is: say it
            "--rdzv-conf", f"is_host={int(h == 0)}",
            # and the workers' MASTER_ADDR is the host's name unless given an address
            "--local-addr", testbed2.host_addr(h), EXAMPLE, "--comm", "dgt", "--dataset", "digits",
            "--iterations", "80", "--report", str(tmp_path / "rep")],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        stop_procs(*procs)
    out = "".join((tmp_path / f"torchrun-{h}.log").read_text() + _logs(tmp_path / f"h{h}")
                  for h in range(2))
    assert [p.returncode for p in procs] == [0, 0], out[-4000:]
    res = [json.loads((tmp_path / "rep" / f"rank-{r}.json").read_text()) for r in range(4)]
    assert len({r["param_sha256"] for r in res}) == 1
    assert res[0]["world"] == 4 and res[0]["test_accuracy"] >= 0.9, res[0]["test_accuracy"]
    # each host's sidecars listen on its testbed address (not loopback)
    for h in range(2):
        eps = [json.loads(open(os.path.join(tmp_path / f"h{h}", n)).read())
               for n in os.listdir(tmp_path / f"h{h}") if n.startswith("endpoints-")]
        assert len(eps) == 2 and {e["host"] for e in eps} == {testbed2.host_addr(h)}
    # host 0's shaped port carried the pushes, each channel in the band of its DSCP
    state = testbed2.status()[f"{testbed2.host_netns(0)}:eth0"]
    by_dscp = {d: c["stats"]["bytes"] for c in state["classes"] for d in c["dscp"]}
    for dscp in channel_dscp(3):   # tcp, udp1, udp2, udp3
        assert by_dscp[dscp] > 100_000, (dscp, by_dscp)

