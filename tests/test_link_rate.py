"""``--pace-mbit auto``: the pacing rate comes from the egress link (real routes, real
qdiscs; root parts in a namespace of their own)."""
import os
import subprocess
import sys

import pytest
from conftest import needs, requires_tool
from pyroute2 import IPRoute

from dgt.config import PACE_AUTO, TransmissionConfig, parse_pace, to_argv
from dgt.link_rate import auto_pace_mbit
from dgt.tc_profiles import applier

root_only = needs("ip", root="netns, veth, tc")


def test_loopback_peers_are_unpaced():
    rate, why = auto_pace_mbit(["127.0.0.1", "127.0.0.1"])
    assert rate == 0.0 and "loopback" in why


def test_pace_flag_parses_auto_and_numbers():
    assert parse_pace("auto") == PACE_AUTO and parse_pace("250") == 250.0
    for bad in ("-3", "fast", "inf", "nan"):
        with pytest.raises(Exception, match="auto"):
            parse_pace(bad)
    argv = to_argv(TransmissionConfig())
    assert argv[argv.index("--pace-mbit") + 1] == "auto"   # round-trips to the sidecars


def _in_ns(ns: str, dst: str):
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                          "from dgt.link_rate import auto_pace_mbit;"
                          f"r, w = auto_pace_mbit([{dst!r}]); print(r); print(w)"],
                         capture_output=True, text=True, timeout=60, check=True)
    rate, why = out.stdout.strip().splitlines()
    return float(rate), why


@root_only
def test_htb_rate_then_link_speed(veth):
    ns, dev = veth
    from dgt.tc_profiles._nl import open_ipr
    with open_ipr(ns) as ipr:
        ipr.addr("add", index=ipr.link_lookup(ifname=dev)[0], address="10.99.0.1",
                 prefixlen=24)
    applier.apply("htb-prio", dev, ns, rate="300mbit")
    assert _in_ns(ns, "10.99.0.2") == (300.0, f"HTB rate of {dev}")
    applier.clear(dev, ns)
    rate, why = _in_ns(ns, "10.99.0.2")   # no HTB: the veth's reported speed, if any
    assert why in (f"link speed of {dev}", f"{dev} reports no speed: 1000")
    assert rate > 0 and rate != 300.0


@root_only
def test_no_route_falls_back_with_reason(veth):
    ns, _ = veth   # a namespace with no address and no route at all
    rate, why = _in_ns(ns, "10.98.0.9")
    assert rate == 1000.0 and "unknown" in why


def test_route_lookup_uses_the_kernel():
    with IPRoute() as ipr:   # the same lookup the sidecar makes, here for loopback
        assert ipr.route("get", dst="127.0.0.1")
