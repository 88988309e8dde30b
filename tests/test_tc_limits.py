"""`dgt tc apply`: every netlink value is checked before anything changes; apply is
transactional; unreadable profile files are named."""
import os
import subprocess
import sys

import pytest
from conftest import needs, requires_tool

from dgt.tc_profiles import applier, plan
from dgt.tc_profiles.schema import load_profile

root_only = needs("ip", root="netns, veth, tc")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dgt.cli", *args], capture_output=True,
                          text=True, timeout=120)


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("rate", ["1kbit", "2kbit", "50kbit", "8bit"])
def test_too_low_rate_refused_in_dry_run(rate):
    r = _cli("tc", "apply", "htb-prio", "--dev", "eth0", "--rate", rate, "--dry-run")
    _one_line_error(r, "profile 'htb-prio', ", "minimum usable --rate is ")
    assert "band '" in r.stderr or "root class" in r.stderr


@pytest.mark.parametrize("rate", ["100tbit", "40tbit"])
def test_too_high_rate_refused_in_dry_run(rate):
    r = _cli("tc", "apply", "htb-prio", "--dev", "eth0", "--rate", rate, "--dry-run")
    _one_line_error(r, "profile 'htb-prio'", "maximum usable --rate")


def test_named_bounds_are_usable_and_tight():
    p = load_profile("htb-prio")
    with pytest.raises(ValueError) as e:
        plan.compile_profile(p, 1000)
    lo = e.value.args[0].rsplit(" ", 1)[1]
    plan.compile_profile(p, applier.parse_rate(lo))      # the named minimum works
    with pytest.raises(ValueError) as e:
        plan.compile_profile(p, 10**14)
    hi = applier.parse_rate(e.value.args[0].rsplit(" ", 1)[1])
    plan.compile_profile(p, hi)
    with pytest.raises(ValueError):
        plan.compile_profile(p, hi * 2)
    for op in plan.compile_profile(p, hi):   # every built message encodes
        plan.encode(*[plan.build_message(op, 1)[i] for i in (2, 0, 1)])


def test_random_bytes_profile_names_the_file(tmp_path):
    f = tmp_path / "junk.yaml"
    f.write_bytes(bytes([0x86, 0xff, 0x00, 0xc3]) * 64)
    r = _cli("tc", "apply", str(f), "--dev", "eth0", "--dry-run")
    _one_line_error(r, str(f), "UTF-8")


def _ours(ns, dev):
    st = applier.show(dev, ns)
    return [q for q in st["qdiscs"] if q["handle"].startswith("d6:")] + st["classes"]


@root_only
@pytest.mark.parametrize("rate", ["1kbit", "100tbit"])
def test_bad_rate_apply_changes_nothing(veth, rate):
    ns, dev = veth
    r = _cli("tc", "apply", "htb-prio", "--dev", dev, "--netns", ns, "--rate", rate)
    _one_line_error(r, "usable --rate")
    assert _ours(ns, dev) == []


@root_only
def test_python_exception_midway_rolls_back(veth, monkeypatch):
    ns, dev = veth
    real = applier.request
    calls = []

    def flaky(ipr, m, t, f):
        calls.append(t)
        if len(calls) == 4:            # root deleted, root qdisc + a class created
            raise RuntimeError("boom")
        return real(ipr, m, t, f)
    monkeypatch.setattr(applier, "request", flaky)
    with pytest.raises(applier.TcError, match="boom.*reset"):
        applier.apply("htb-prio", dev, ns)
    monkeypatch.setattr(applier, "request", real)
    assert _ours(ns, dev) == []
    with pytest.raises(ValueError) as e:
        plan.compile_profile(load_profile("htb-prio"), 1000)
    lo = e.value.args[0].rsplit(" ", 1)[1]
    applier.apply("htb-prio", dev, ns, rate=lo)              # the named minimum applies
    assert len(_ours(ns, dev)) > 5
