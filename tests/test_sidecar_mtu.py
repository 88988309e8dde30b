"""A path MTU below 1500 B: the EMSGSIZE advice comes from the MTU the kernel reports,
with and without --secret, and the advised --block-bytes then works (two network
namespaces joined by a veth pair with MTU 1450; root)."""
import json
import os
import shutil
import subprocess
import sys
import threading
import uuid

import pytest
import torch
from torch import nn

import dgt
from conftest import stop_procs
from dgt.errors import PeerFailure
from dgt.transport import pmtu

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, veth)"),
              pytest.mark.skipif(shutil.which("ip") is None,
                                 reason="needs 'ip' (Debian package iproute2)")]

MTU = 1450


def test_max_block_bytes_subtracts_the_headers_and_the_mac():
    assert pmtu.max_block_bytes(1500) == 1436
    assert pmtu.max_block_bytes(1500, mac=True) == 1420
    assert pmtu.max_block_bytes(MTU) == 1388
    assert pmtu.max_block_bytes(MTU, mac=True) == 1372
    assert pmtu.max_block_bytes(MTU, pmtu.IPV6_UDP_BYTES) == 1368
    # coded bands: the widest coding rules; int8 is a byte a value plus a 4 B scale
    from dgt.transport.wire import Coding, block_datagram_bytes
    int8 = pmtu.max_block_bytes(1500, codings=(int(Coding.INT8),))
    assert int8 == 4 * (1500 - 28 - 34 - 4) == 5736
    assert block_datagram_bytes(Coding.INT8, int8 // 4, False) + 28 == 1500
    assert pmtu.max_block_bytes(1500, codings=(int(Coding.INT8), 0)) == 1436


@pytest.fixture
def two_hosts():
    """(netns a, netns b): 10.77.0.1 and 10.77.0.2 over a veth pair with MTU 1450."""
    tag = uuid.uuid4().hex[:6]
    ns = [f"dgtmtu-{tag}-a", f"dgtmtu-{tag}-b"]

    def ip(*a):
        subprocess.run(["ip", *a], check=True, capture_output=True)
    try:
        for n in ns:
            ip("netns", "add", n)
        ip("link", "add", f"m{tag}a", "netns", ns[0], "type", "veth", "peer", "name",
           f"m{tag}b", "netns", ns[1])
        for i, n in enumerate(ns):
            dev = f"m{tag}{'ab'[i]}"
            ip("-n", n, "link", "set", "lo", "up")
            ip("-n", n, "link", "set", dev, "mtu", str(MTU), "up")
            ip("-n", n, "addr", "add", f"10.77.0.{i + 1}/24", "dev", dev)
        yield ns
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _run(ns, tmp_path, block_bytes, secret="", band_codec="fp32"):
    """Two sidecars (rank r in ns[r]) and their trainers push one step; returns rank 0's
    PeerFailure or None. ``band_codec``: f32 datagrams unless told (the advice's case)."""
    tmp = tmp_path / f"{block_bytes}-{bool(secret)}-{band_codec}"
    tmp.mkdir()
    env = dict(os.environ, DGT_SECRET=secret) if secret else dict(os.environ)
    procs = []
    for r in range(2):
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns[r], sys.executable, "-m", "dgt.cli", "sidecar",
             "--rank", str(r), "--world", "2", "--master-addr", "10.77.0.1",
             "--master-port", "29533", "--host", f"10.77.0.{r + 1}", "--socket",
             str(tmp / f"{r}.sock"), "--run-dir", str(tmp), "--block-bytes",
             str(block_bytes), "--peer-timeout-s", "60", "--pace-mbit", "0",
             "--band-codec", band_codec],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    out = {}
    seeding = threading.Lock()

    def trainer(r):
        try:
            c = dgt.Client(str(tmp / f"{r}.sock"), timeout_s=120, connect_timeout_s=120)
            with seeding:   # torch's RNG is global: seed and draw under one lock
                torch.manual_seed(0)
                m = nn.Linear(64, 64)
            c.register(m)
            m(torch.ones(1, 64)).sum().backward()
            c.push_pull(0)
            c.close()
            out[r] = None
        except PeerFailure as e:
            out[r] = e
    try:
        th = [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
        for t in th:
            t.start()
        for t in th:
            t.join(timeout=300)
    finally:
        stop_procs(*procs)
    return out.get(0) or out.get(1)


@pytest.mark.slow
def test_the_mtu_advice_fits_the_path_and_then_works(two_hosts, tmp_path):
    failed = _run(two_hosts, tmp_path, 1408)
    assert failed is not None and "path MTU to rank" in str(failed), failed
    assert "is 1450 B; use --block-bytes 1388 or less" in str(failed)
    assert _run(two_hosts, tmp_path, 1388) is None
    failed = _run(two_hosts, tmp_path, 1388, secret="s3cret")
    assert failed is not None and "use --block-bytes 1372 or less" in str(failed), failed
    assert _run(two_hosts, tmp_path, 1372, secret="s3cret") is None
    # --mode dgt's default int8 bands (auto: peers across a link): a 1408 B block is a
    # 390 B datagram, which fits
    assert _run(two_hosts, tmp_path, 1408, band_codec="auto") is None
    for r in range(2):
        with open(tmp_path / "1408-False-auto" / f"sidecar-{r}.json") as f:
            cfg = json.load(f)["config"]
        assert (cfg["band_codec"], cfg["pull_codec"]) == ("int8", "int8")


_FORGE = r'''
import socket, struct, sys, time
import numpy as np
from dgt.transport import sockopts
from dgt.transport.udp_batch import BatchSender

def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff

a = sockopts.udp_socket("127.0.0.1", 0, 10)
b = sockopts.udp_socket("127.0.0.1", 0, 10)
# as if the ICMP came during a send (BatchSender turns IP_RECVERR on for its sends): it
# also leaves EMSGSIZE pending on the socket and an error in its queue
a.setsockopt(socket.IPPROTO_IP, sockopts.IP_RECVERR, 1)
sp, dp = a.getsockname()[1], b.getsockname()[1]
size = 1458   # a default BLOCKS datagram with its MAC
lo = socket.inet_aton("127.0.0.1")
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + size, 1, 0x4000, 64, 17, 0, lo, lo)
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
icmp = struct.pack("!BBHHH", 3, 4, 0, 0, 552) + ip + struct.pack("!HHHH", sp, dp, 8 + size, 0)
icmp = icmp[:2] + struct.pack("!H", csum(icmp)) + icmp[4:]
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
for _ in range(20):   # "fragmentation needed, next-hop MTU 552", quoting a -> b
    raw.sendto(icmp, ("127.0.0.1", 0))
time.sleep(0.2)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:   # the route took it
    probe.setsockopt(socket.IPPROTO_IP, 10, 2)
    probe.connect(("127.0.0.1", dp))
    print("route mtu", probe.getsockopt(socket.IPPROTO_IP, 14))
rows = np.full((3, size), 7, np.uint8)
sender = BatchSender(a)
try:
    print("sent", sender.send(rows, ("127.0.0.1", dp)), "icmp", sender.icmp_errors)
except OSError as e:
    print("failed", e)
b.setblocking(True)
b.settimeout(5)
print("received", sum(len(b.recv(65536)) for _ in range(3)))
'''


def test_a_forged_fragmentation_needed_cannot_stop_the_sends(tmp_path):
    """A stranger's ICMP "fragmentation needed" (next-hop MTU 552) for a channel's flow,
    sent in a namespace of the test's own (so no other route cache is touched): the
    kernel takes the MTU into its route cache, and the channel socket still sends and
    delivers full-size datagrams, stepping over the EMSGSIZE the ICMP left pending.
    With IP_PMTUDISC_DO (before) every send failed with EMSGSIZE and the sidecar
    stopped the job; with PROBE alone, the pending one still did (an outside tester's
    forged burst during a run)."""
    ns = f"dgticmp-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True,
                       capture_output=True)
        script = tmp_path / "forge.py"
        script.write_text(_FORGE)
        p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(script)],
                           capture_output=True, text=True, timeout=60,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "route mtu 552" in p.stdout, p.stdout   # the forgery did land
    assert "sent 3 icmp 1" in p.stdout and "received 4374" in p.stdout, p.stdout
