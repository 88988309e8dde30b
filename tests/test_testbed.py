"""The netns star testbed: build/teardown, DSCP classification, priority (root only)."""
import os
import subprocess
import uuid

import pytest
from conftest import needs, requires_tool

from dgt.tc_profiles import applier, testbed
from dgt.tc_profiles.plan import band_classid, fmt_handle
from dgt.tc_profiles.schema import load_profile
from dgt.transport import channels

root_only = needs("ip", root="netns, veth, tc")


def _links_and_netns():
    ns = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return sorted(ns.split("\n")), sorted(ln.split(":")[1] for ln in links.splitlines())


@pytest.fixture
def bed(request):
    """A fresh testbed with a unique prefix; torn down even when the test fails."""
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    kw = getattr(request, "param", {})
    try:
        yield testbed.up(prefix=prefix, **{"hosts": 2, **kw})
    finally:
        testbed.down(prefix)


def _send_udp(dst: str, port: int, dscps, count: int) -> int:
    import socket
    sent = 0
    for d in dscps:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, d << 2)    # IP_TOS = dscp << 2
        for _ in range(count):
            s.sendto(b"x" * 1000, (dst, port))
            sent += 1
        s.close()
    return sent


@root_only
def test_up_down_leaves_nothing():
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    before = _links_and_netns()
    try:
        tb = testbed.up(3, prefix=prefix)
        assert tb.host_netns(2) == f"{prefix}-h2" and tb.host_addr(2) == "10.77.2.2"
        found = testbed.current(prefix)
        assert found is not None and found.hosts == 3 and found.profile == "htb-prio"
        r = tb.exec_in(0, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
        assert "10.77.0.2/24" in r.stdout
        # every port carries the profile
        for ns, dev in tb.ports():
            assert applier.show(dev, ns)["qdiscs"][0]["handle"] == "d6:"
        # routed through the router: host 0 reaches host 2
        got = tb.run_in(0, _tcp_roundtrip, tb.host_addr(2), tb.host_netns(2))
        assert got == b"pong"
        # up again with the same prefix replaces the old one
        testbed.up(2, prefix=prefix)
        assert testbed.current(prefix).hosts == 2
    finally:
        removed = testbed.down(prefix)
    assert f"{prefix}-sw" in removed
    assert testbed.current(prefix) is None
    assert _links_and_netns() == before
    assert testbed.down(prefix) == []


def _tcp_roundtrip(addr: str, server_ns: str) -> bytes:
    """Echo over TCP from this netns to a server forked into ``server_ns``."""
    import socket
    from pyroute2 import netns as pn
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            pn.setns(server_ns, flags=0)
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((addr, 7777))
            ls.listen(1)
            os.write(w, b"1")
            c, _ = ls.accept()
            c.recv(4)
            c.sendall(b"pong")
            c.close()
        finally:
            os._exit(0)
    os.read(r, 1)
    c = socket.create_connection((addr, 7777), timeout=10)
    c.sendall(b"ping")
    data = c.recv(4)
    os.waitpid(pid, 0)
    return data


@root_only
def test_each_channel_dscp_lands_in_its_band(bed):
    """UDP with each channel's DSCP (C = 7 covers them all) from h1 to h0 lands in the
    band the profile names, on h1's egress and on the router port towards h0."""
    prof = load_profile(bed.profile)
    dscps = sorted(set(channels.channel_dscp(7)) | {0})
    ports = [(bed.host_netns(1), "eth0"), (bed.router, "p0")]
    def direct(p):   # packets HTB sent unshaped, classified into no band
        return applier.show(p[1], p[0])["qdiscs"][0]["direct_packets_stat"]

    before = {p: applier.class_counters(applier.show(p[1], p[0])) for p in ports}
    direct_before = {p: direct(p) for p in ports}
    count = 50
    for d in dscps:
        bed.run_in(1, _send_udp, bed.host_addr(0), 9, [d], count)
    after = {p: applier.class_counters(applier.show(p[1], p[0])) for p in ports}
    for p in ports:
        delta = {c: after[p][c]["packets"] - before[p][c]["packets"] for c in after[p]}
        for d in dscps:
            i = [b.name for b in prof.bands].index(prof.band_for_dscp(d).name)
            cid = fmt_handle(band_classid(prof, i))
            assert delta[cid] >= count, (p, d, cid, delta)
        # none of our DSCPs went to the unshaped direct queue: an unclassified one would
        # put all its `count` packets there. A packet that is not ours (the link's own
        # non-IPv4 control traffic, which no DSCP filter matches; not identified) went
        # there once in CI on 2026-12-01, so the bound is below one DSCP's count, not 0.
        assert direct(p) - direct_before[p] < count, (p, direct(p), direct_before[p])


@root_only
@requires_tool("nft")
@pytest.mark.parametrize("bed", [{"loss_pct": 100, "loss_dscp": (8,)}], indirect=True)
def test_nft_loss_only_for_given_dscp(bed):
    r = bed.exec_in(bed.router, ["nft", "list", "table", "ip", testbed.NFT_TABLE])
    assert "ip dscp cs1" in r.stdout and "drop" in r.stdout
    assert "numgen random mod 1000000 < 25000" in testbed.nft_loss_ruleset(2.5, (34, 18, 8))
    bed.run_in(1, _send_udp, bed.host_addr(0), 9, [8, 34], 20)
    # CS1 dropped in the router (never reaches the port to h0), AF41 passes
    cnt = applier.class_counters(applier.show("p0", bed.router))
    assert cnt["d6:17"]["packets"] == 0
    assert cnt["d6:11"]["packets"] >= 20


@root_only
def test_queue_bytes_and_rate(request):
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    try:
        tb = testbed.up(1, rate="100mbit", queue_bytes=65536, prefix=prefix)
        st = applier.show("eth0", tb.host_netns(0))
        assert {q["limit"] for q in st["qdiscs"] if q["kind"] == "bfifo"} == {65536}
        assert {c["ceil_bit"] for c in st["classes"]} == {100_000_000}
    finally:
        testbed.down(prefix)


@root_only
def test_queue_drops_counts_what_a_full_band_dropped_by_side_and_dscp():
    # 400 datagrams of 1 KB marked EF into a 1 Mbit/s port whose queues hold 3,000 bytes:
    # host 1's eth0 drops most of them in band 46, nothing else drops, and nothing
    # reaches the router's queue faster than it drains
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    try:
        tb = testbed.up(2, rate="1mbit", queue_bytes=3000, prefix=prefix)
        before = tb.queue_drops()
        assert before == {"host": {k: 0 for k in before["host"]},
                          "router": {k: 0 for k in before["router"]}}
        assert "46" in before["host"] and "0" in before["host"]
        tb.run_in(1, _send_udp, tb.host_addr(0), 9, [46], 400)
        after = tb.queue_drops()
        assert after["host"]["46"] > 300, after
        assert sum(after["host"].values()) == after["host"]["46"]
        assert sum(after["router"].values()) == 0, after
    finally:
        testbed.down(prefix)


def _read_sysctl(key: str) -> str:
    with open(f"/proc/sys/{key}") as f:
        return f.read().strip()


@root_only
def test_every_namespace_runs_the_asked_congestion_control(request):
    # the testbed's TCP does not follow this machine's default (bbr on some VMs):
    # cubic, Linux's default, unless asked otherwise; '' keeps the machine's
    key = "net/ipv4/tcp_congestion_control"
    machine = _read_sysctl(key)
    other = "reno" if machine != "reno" else "cubic"
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    try:
        tb = testbed.up(2, rate="100mbit", prefix=prefix)
        assert tb.tcp_congestion == "cubic"
        for ns in (tb.router, tb.host_netns(0), tb.host_netns(1)):
            assert testbed.run_in_netns(ns, _read_sysctl, key) == "cubic"
        tb = testbed.up(2, rate="100mbit", prefix=prefix, tcp_congestion=other)
        assert testbed.run_in_netns(tb.host_netns(1), _read_sysctl, key) == other
        tb = testbed.up(2, rate="100mbit", prefix=prefix, tcp_congestion="")
        assert testbed.run_in_netns(tb.host_netns(0), _read_sysctl, key) == machine
    finally:
        testbed.down(prefix)
    assert _read_sysctl(key) == machine   # the machine's own default is left alone


@root_only
def test_an_available_but_not_allowed_congestion_control_is_allowed_first():
    """A machine that boots with bbr allows only "reno bbr": Linux then refuses cubic as
    a namespace's default with EPERM, even to root, and every testbed failed to come up
    ("in netns ...-sw: PermissionError"). up() adds it to the allowed list first."""
    allowed_key, key = "net/ipv4/tcp_allowed_congestion_control", \
        "net/ipv4/tcp_congestion_control"
    machine, allowed = _read_sysctl(key), _read_sysctl(allowed_key)
    cc = "cubic" if machine != "cubic" else "reno"
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    try:   # the machine as it boots with another default: cc available, not allowed
        testbed._write(f"/proc/sys/{allowed_key}",
                       " ".join(a for a in allowed.split() if a != cc) or machine)
        assert cc not in _read_sysctl(allowed_key).split()
        tb = testbed.up(2, rate="100mbit", prefix=prefix, tcp_congestion=cc)
        for ns in (tb.router, tb.host_netns(0), tb.host_netns(1)):
            assert testbed.run_in_netns(ns, _read_sysctl, key) == cc
        assert cc in _read_sysctl(allowed_key).split()
    finally:
        testbed.down(prefix)
        testbed._write(f"/proc/sys/{allowed_key}", allowed)
    assert _read_sysctl(key) == machine   # the machine's own default is left alone


@root_only
def test_an_unavailable_congestion_control_is_refused_before_anything_is_built():
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    with pytest.raises(testbed.TestbedError, match="'vegas2' is not available.*pick one"):
        testbed.up(1, prefix=prefix, tcp_congestion="vegas2")
    assert testbed.current(prefix) is None


@root_only
def test_missing_qdisc_testbed_creates_nothing():
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    before = _links_and_netns()
    with pytest.raises(testbed.TestbedError, match="qdisc 'prio' is not in this kernel"):
        testbed.up(2, profile="prio-dscp", prefix=prefix)
    assert _links_and_netns() == before


def test_udp_offer_gso_generator():
    """The GSO generator paces UDP with its DSCP; one send carries many datagrams where
    the kernel has UDP GSO, else it falls back to one per send and says so (no root)."""
    import socket
    from dgt.tc_profiles.priority_check import parse_cases, udp_offer
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    rx.bind(("127.0.0.1", 0))
    try:
        r = udp_offer("127.0.0.1", rx.getsockname()[1], 46, 20, 0.3)
    finally:
        rx.close()
    assert r["datagrams"] > 0 and r["payload_bytes"] == r["datagrams"] * 1400
    if r["gso"]:
        assert r["sends"] * 44 == r["datagrams"] and not r["note"]
    else:
        assert "datagram per send" in r["note"]
    assert not udp_offer("127.0.0.1", 9, 8, 20, 0.05, gso=False)["gso"]
    assert parse_cases("EF:46:600,CS1:8:300") == (("EF", 46, 600.0), ("CS1", 8, 300.0))
    with pytest.raises(ValueError, match="NAME:DSCP:MBIT"):
        parse_cases("EF:46")


@root_only
@requires_tool("iperf3")
def test_priority_under_bulk_load():
    """EF keeps >= 90 % of what it offers through a 1 Gbit/s htb-prio port saturated by
    bulk best-effort TCP; CS1 (below best effort) keeps much less. Behaviour, not
    timing: the fractions come from the port's class counters.

    The UDP comes from the GSO generator (44 datagrams per send), which offers 600
    Mbit/s next to the bulk flow even on a 2-core machine; the port, not the CPU, is the
    bottleneck. The namespaces go even when the check fails."""
    from dgt.tc_profiles.priority_check import priority_check, render
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    res = []
    try:
        # CS1 says something only on a saturated port; a machine too busy to run the
        # bulk flow leaves the link idle, so CS1 is measured again (up to 3 tries)
        for _ in range(3):
            res += priority_check(rate="1gbit", seconds=3, prefix=prefix,
                                  cases=(("EF", 46, 600), ("CS1", 8, 600)))
            if res[-1]["port_busy"]:
                break
    finally:
        testbed.down(prefix)
    print(render(res))
    assert testbed.current(prefix) is None
    for ef in [r for r in res if r["case"] == "EF"]:
        assert ef["port_pkts"] > 0 and ef["delivered_frac"] >= 0.9, ef
        assert ef["src_drops"] == 0, ef
    ef_frac = min(r["delivered_frac"] for r in res if r["case"] == "EF")
    cs1 = [r for r in res if r["case"] == "CS1"][-1]
    if not cs1["port_busy"]:
        pytest.skip(reason=f"the bulk flow could not saturate the port in 3 tries (machine busy, "
                    f"load {cs1['load1']}): CS1 untested; EF held")
    assert cs1["port_drops"] > 0
    assert cs1["delivered_frac"] < 0.5 * ef_frac, cs1


# ------------------------------------------------------------------ prefix rule

@pytest.mark.parametrize("prefix", ["fixtest/r", "../fixtest", "fixtest.x", "-fixtest", "",
                                    "fixtest\u00e9", "fixtest" + "a" * 236])
def test_bad_prefix_refused_by_every_entry_point(tmp_path, monkeypatch, prefix):
    """up/down/current/status/exec_in refuse a prefix that cannot name namespaces
    before touching anything (a '/' made pyroute2 create files in the current folder;
    243 characters overflow NAME_MAX in testbed-<prefix>.json), root or not. The error
    is also a ValueError, so flag validators that catch ValueError report it."""
    from test_tc_cli import _netns_named, _remove_strays
    monkeypatch.chdir(tmp_path)
    try:
        for call in (lambda: testbed.up(2, prefix=prefix), lambda: testbed.down(prefix),
                     lambda: testbed.current(prefix), lambda: testbed.status(prefix),
                     lambda: testbed.exec_in(0, ["true"], prefix=prefix)):
            with pytest.raises(testbed.PrefixError,
                               match="letters, digits, '-' or '_'") as e:
                call()
            assert isinstance(e.value, ValueError)
            assert isinstance(e.value, testbed.TestbedError)
        with pytest.raises(ValueError, match=r"bad --testbed-prefix 'fixtest/r'"):
            testbed.check_prefix("fixtest/r", "--testbed-prefix")
        assert list(tmp_path.iterdir()) == []
        assert _netns_named(prefix) == []
    finally:
        _remove_strays(prefix, tmp_path)


@root_only
def test_longest_allowed_prefix_builds_and_goes():
    """The limit is real, not a guess: a 242-character prefix (the longest) builds a
    testbed, is found, and is removed, state file and all."""
    prefix = f"fixtest{uuid.uuid4().hex[:6]}".ljust(testbed.MAX_PREFIX_LEN, "a")
    assert len(prefix) == testbed.MAX_PREFIX_LEN == 242
    try:
        tb = testbed.up(1, prefix=prefix)
        assert testbed.current(prefix).hosts == 1
        assert tb.exec_in(0, ["true"]).returncode == 0
        assert testbed._state_file(prefix).exists()
    finally:
        removed = testbed.down(prefix)
    assert sorted(removed) == sorted([f"{prefix}-h0", f"{prefix}-sw"])
    assert not testbed._state_file(prefix).exists()
    assert testbed.current(prefix) is None


@root_only
def test_exec_by_namespace_name_finds_its_testbed(bed):
    """breaker round, stop 41: 'dgt testbed exec brk-h0 -- CMD' with testbed brk up said
    "no testbed with prefix 'dgt' is up": the name was looked up in --prefix's default
    testbed. A namespace's name carries its testbed's prefix."""
    import sys
    run = lambda *a: subprocess.run([sys.executable, "-m", "dgt.cli", "testbed", "exec", *a],
                                    capture_output=True, text=True, timeout=120)
    for host in (bed.host_netns(1), bed.router):
        r = run(host, "--", "ip", "-o", "-4", "addr")
        assert r.returncode == 0, r.stderr
        assert ("10.77.1.2/24" in r.stdout) == (host != bed.router), r.stdout
    r = run("--prefix", bed.prefix, bed.host_netns(0), "--", "true")   # the same testbed
    assert r.returncode == 0, r.stderr
    r = run("--prefix", "dgtother", bed.host_netns(0), "--", "true")
    assert r.returncode == 2 and r.stderr.strip().endswith(
        f"is a namespace of testbed '{bed.prefix}', not of --prefix dgtother"), r.stderr
    r = run("not-a-host", "--", "true")
    assert r.returncode == 2 and "neither a host index nor a testbed namespace" in r.stderr


#: a process of ours that holds a prefix's testbed lock until its stdin closes
HOLD_LOCK = """
import sys
from dgt.tc_profiles import testbed
with testbed._exclusive(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@root_only
def test_a_second_command_on_a_prefix_being_built_is_refused_in_one_line():
    """Breaker round 7: two ``dgt testbed up --prefix P`` at once ended in tracebacks
    (``LookupError: netns 'P-sw' does not exist``), ``[Errno 17] File exists``, and a
    testbed of either size. While one command builds or removes a prefix's testbed,
    another on that prefix is refused, naming its pid; nothing is built. Then two at
    once: each builds, or is refused in one line; never a traceback."""
    import sys
    prefix = f"dgtt{uuid.uuid4().hex[:6]}"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, prefix],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for cmd in (["up", "--hosts", "2"], ["down"]):
            p = subprocess.run([sys.executable, "-m", "dgt.cli", "testbed", *cmd,
                                "--prefix", prefix], capture_output=True, text=True,
                               timeout=120)
            assert p.returncode == 2, p.stderr
            assert p.stderr.strip() == (
                f"dgt testbed {cmd[0]}: error: testbed {prefix} is being built or removed "
                f"by another process (pid {holder.pid}); wait for it to finish, or give "
                f"another --prefix"), p.stderr
        assert testbed.current(prefix) is None
    finally:
        holder.stdin.close()
        holder.wait(30)
    try:
        both = [subprocess.Popen([sys.executable, "-m", "dgt.cli", "testbed", "up",
                                  "--hosts", str(n), "--prefix", prefix],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for n in (3, 2)]
        outs = [p.communicate(timeout=300) for p in both]
        for p, (out, err) in zip(both, outs):
            assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
            assert p.returncode == 0 or "is being built or removed by another" in err, err
        built = [n for p, n in zip(both, (3, 2)) if p.returncode == 0]
        assert built, outs
        # the testbed left is whole: that of the command that built last
        assert testbed.current(prefix).hosts in built
    finally:
        testbed.down(prefix)
    assert testbed.current(prefix) is None


# ------------------------------------------------------- outside tester's round (fx)

@pytest.fixture
def fxbed():
    """A 2-host testbed with a prefix of this file's own ('fx...'); removed even when
    the test fails."""
    prefix = f"fxt{uuid.uuid4().hex[:6]}"
    try:
        yield testbed.up(2, prefix=prefix)
    finally:
        testbed.down(prefix)


def _dgt(*argv):
    import sys
    return subprocess.run([sys.executable, "-m", "dgt.cli", *argv], capture_output=True,
                          text=True, timeout=120)


@root_only
def test_exec_takes_prefix_after_the_host(fxbed):
    """Outside tester: 'exec 0 --prefix P -- CMD' ran '--prefix P -- CMD' in the
    default testbed ("no testbed with prefix 'dgt' is up"); 'exec P-h0 --prefix Q --
    true' tried to run '--prefix'. Options between HOST and '--' are options now,
    anything else there is one line, exit 2."""
    p = fxbed.prefix
    r = _dgt("testbed", "exec", "0", "--prefix", p, "--", "ip", "-o", "-4", "addr")
    assert r.returncode == 0 and "10.77.0.2/24" in r.stdout, r.stderr
    r = _dgt("testbed", "exec", "1", f"--prefix={p}", "--", "ip", "-o", "-4", "addr")
    assert r.returncode == 0 and "10.77.1.2/24" in r.stdout, r.stderr
    r = _dgt("testbed", "exec", "--prefix", p, "0", "ip", "-o", "-4", "addr")  # as before
    assert r.returncode == 0 and "10.77.0.2/24" in r.stdout, r.stderr
    for argv, says in (
            ([f"{p}-h0", "--prefix", "fxzz", "--", "true"],
             f"is a namespace of testbed '{p}', not of --prefix fxzz"),
            (["0", "--prefix", p, "--bogus", "--", "true"], "'--bogus' after HOST"),
            (["0", "--prefix", p, "ip", "addr"], "no `--` before the command 'ip'"),
            (["0", "--prefix", "fx/zz", "--", "true"], "bad --prefix 'fx/zz'")):
        r = _dgt("testbed", "exec", *argv)
        assert r.returncode == 2 and r.stdout == "", (argv, r.stdout, r.stderr)
        assert r.stderr.startswith("dgt testbed exec: error: ") and says in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr


@root_only
@requires_tool("iperf3")
def test_load_of_a_fraction_of_a_second_measures(fxbed):
    """'load --seconds 0.5' handed iperf3 '-t 0.5', which it reads as 0 and runs for
    ever: cut after 15 s, 0.0 Mbit/s. iperf3 gets whole seconds (rounded up)."""
    r = _dgt("testbed", "load", "--prefix", fxbed.prefix, "--pairs", "0:1",
             "--seconds", "0.5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("h0 -> h1: ") and r.stdout.split()[3] != "0.0", r.stdout


def test_iperf3_gets_whole_seconds_rounded_up():
    """iperf3 reads -t as an integer: -t 0.5 was 0 (for ever), and 'testbed priority''s
    bulk flow (-t seconds + 2, e.g. 4.5) ran up to a second short of its probe's window."""
    from dgt.tc_profiles.bounds import iperf_seconds
    assert [iperf_seconds(s) for s in (0.5, 1, 1.01, 5.5, 86400)] == [1, 1, 2, 6, 86400]


def test_load_refuses_what_cannot_run_before_anything_starts():
    """Outside tester: '--seconds 1e9' ended in 'OverflowError: timeout is too large'
    (a traceback), '--pairs 0:0' measured a host to itself (48753.2 Mbit/s, no shaped
    port crossed). Testbed.load refuses both, naming why, before anything starts (this
    testbed is not even up)."""
    tb = testbed.Testbed(2, prefix="fxnotup")
    for seconds in (1e9, 86400.5, float("inf"), float("nan"), 0, -1):
        with pytest.raises(testbed.TestbedError, match="seconds must be"):
            tb.load(seconds, [(0, 1)])
    with pytest.raises(testbed.TestbedError, match="pair 1:1 is a host to itself"):
        tb.load(1, [(0, 1), (1, 1)])


def _lock_exists(prefix: str) -> bool:
    return testbed._lock_path(prefix).exists()


@root_only
def test_a_lock_file_goes_with_its_testbed():
    """Outside tester: every prefix ever used left /run/dgt/testbed-<prefix>.lock (482
    of them), a 'down' of one never built too. The lock file is removed when nothing of
    its testbed is left, by the holder before it lets the lock go; it stays while the
    testbed is up, and the read-only look (taken_down, LOCK_SH) works throughout."""
    prefix = f"fxl{uuid.uuid4().hex[:6]}"
    try:
        assert testbed.down(prefix) == [] and not _lock_exists(prefix)   # never built
        with pytest.raises(testbed.TestbedError):   # a failed up builds nothing
            testbed.up(2, prefix=prefix, profile="no-such-profile")
        assert not _lock_exists(prefix)
        testbed.up(2, prefix=prefix)
        assert _lock_exists(prefix)          # up: the lock stays with the testbed
        assert testbed.taken_down(prefix, 2) is False
        assert testbed.taken_down(prefix, 3) is True
        testbed.down(prefix)
        assert not _lock_exists(prefix)
        assert testbed.taken_down(prefix, 2) is True
    finally:
        testbed.down(prefix)
    assert not _lock_exists(prefix)


@root_only
def test_a_lock_file_unlinked_under_a_waiter_is_not_taken_for_the_lock():
    """The race of unlinking a lock file: a process that opened it before the holder
    unlinked it can lock it after the holder let it go, and then holds a file no one
    else sees. It must see that (same device and inode as the path's: _same_file) and
    lock the file at the path instead; and while another holds that one, it is
    refused as before."""
    import fcntl
    import sys
    prefix = f"fxr{uuid.uuid4().hex[:6]}"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, prefix],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        path = testbed._lock_path(prefix)
        early = open(path)                     # opened while the holder holds it
        holder.stdin.close()
        assert holder.wait(30) == 0
        assert not path.exists()               # nothing built: it went, unlinked first
        fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)   # the orphan locks fine...
        assert not testbed._same_file(early, path)          # ...and is seen as one
        with testbed._exclusive(prefix):       # takes the file at the path
            held = testbed._held[prefix][0]
            assert testbed._same_file(held, path)
            p = subprocess.run([sys.executable, "-c", HOLD_LOCK, prefix],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=60)
            assert p.returncode != 0 and "is being built or removed by another process " \
                f"(pid {os.getpid()})" in p.stderr, p.stderr
        early.close()
        assert not path.exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        testbed.down(prefix)
    assert not testbed._lock_path(prefix).exists()


#: dgt testbed up through dgt.cli, a SIGTERM sent to itself at up's commit point
#: (argv[2]): "before" the stop signals are held there, or "after"
UP_SIGNAL_AT = """
import os, signal, sys
from dgt import cli
from dgt.tc_profiles import cli as tc_cli
prefix, where = sys.argv[1:3]
real = tc_cli.hold_stop_signals
term = lambda: os.kill(os.getpid(), signal.SIGTERM)
tc_cli.hold_stop_signals = ((lambda: (term(), real())) if where == "before"
                            else (lambda: (real(), term())))
sys.exit(cli.main(["testbed", "up", "--hosts", "1", "--prefix", prefix]))
"""


@root_only
@pytest.mark.parametrize("where", ["before", "after"])
def test_up_is_either_undone_or_complete_around_its_commit_point(where):
    """The tc apply fault's kind in `testbed up`: a signal after it had said "testbed
    up" and flushed (at its `return 0`) gave exit 143 with the testbed up. A signal
    before its commit point removes the testbed (143, one line); after it, up
    completes: exit 0, the testbed up. Sent at a fixed point, not a time."""
    import sys
    prefix = f"fxu{uuid.uuid4().hex[:6]}"
    try:
        r = subprocess.run([sys.executable, "-c", UP_SIGNAL_AT, prefix, where],
                           capture_output=True, text=True, timeout=300)
        if where == "after":
            assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
            assert r.stdout.startswith("testbed up: 1 hosts")
            assert testbed.current(prefix).hosts == 1
        else:
            assert r.returncode == 143, (r.stdout, r.stderr)
            assert r.stderr == (f"dgt testbed up: interrupted; the testbed '{prefix}' "
                                f"was removed\n"), r.stderr
            assert testbed.current(prefix) is None
    finally:
        testbed.down(prefix)
    assert not testbed._lock_path(prefix).exists()


#: dgt testbed down through dgt.cli, a SIGTERM sent to itself "before" the removal
#: (as it checks root) or "during" it (inside testbed.down, once it removed)
DOWN_SIGNAL_AT = """
import os, signal, sys
from dgt import cli
from dgt.tc_profiles import cli as tc_cli, testbed
prefix, where = sys.argv[1:3]
term = lambda: os.kill(os.getpid(), signal.SIGTERM)
real_root, real_down = tc_cli._root, testbed.down
tc_cli._root = lambda args: (term() if where == "before" else None, real_root(args))[1]
testbed.down = lambda p: (real_down(p), term() if where == "during" else None)[0]
sys.exit(cli.main(["testbed", "down", "--prefix", prefix]))
"""


@root_only
@pytest.mark.parametrize("where", ["before", "during"])
def test_a_stop_signal_to_down_is_one_line_or_the_down_completes(where):
    """Re-check of breaker round 14: 'dgt testbed down' printed "removed 3 namespaces"
    and exited 130 (2 of 12 SIGINTs), and SIGTERM killed it without a word, half-way
    or not (7 of 10). Before it removes: one line and 143, the testbed kept; once it
    removes: all of it, "removed", exit 0. Sent at a fixed point, not a time."""
    import sys
    prefix = f"fxd{uuid.uuid4().hex[:6]}"
    testbed.up(1, prefix=prefix)
    try:
        r = subprocess.run([sys.executable, "-c", DOWN_SIGNAL_AT, prefix, where],
                           capture_output=True, text=True, timeout=120)
        if where == "during":
            assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stdout, r.stderr)
            assert r.stdout.startswith("removed 2 namespaces: "), r.stdout
            assert testbed.current(prefix) is None
        else:
            assert r.returncode == 143, (r.returncode, r.stdout, r.stderr)
            assert r.stdout == "" and r.stderr == "dgt testbed down: interrupted\n", \
                r.stderr
            assert testbed.current(prefix).hosts == 1
    finally:
        testbed.down(prefix)
    assert not testbed._lock_path(prefix).exists()

