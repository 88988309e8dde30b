"""`dgt tc` / `dgt testbed` through register(subparsers): output and one-line errors."""
import argparse
import os
import shutil
import subprocess
import sys

import pytest

from dgt.tc_profiles import cli

CLI = ("import argparse, sys\n"
       "from dgt.tc_profiles import cli\n"
       "ap = argparse.ArgumentParser(prog='dgt')\n"
       "sub = ap.add_subparsers(dest='command', required=True)\n"
       "cli.register(sub)\n"
       "a = ap.parse_args()\n"
       "sys.exit(a.func(a))\n")


def dgt(*argv, user=None):
    cmd = [sys.executable, "-c", CLI, *argv]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def parser():
    ap = argparse.ArgumentParser(prog="dgt")
    cli.register(ap.add_subparsers(dest="command", required=True))
    return ap


def test_register_sets_func_on_every_leaf():
    ap = parser()
    for argv in (["tc", "list"], ["tc", "show", "--dev", "x"], ["tc", "clear", "--dev", "x"],
                 ["tc", "apply", "htb-prio", "--dev", "x", "--dry-run"],
                 ["testbed", "up", "--hosts", "2"], ["testbed", "down"],
                 ["testbed", "status"], ["testbed", "exec", "0", "--", "true"],
                 ["testbed", "load", "--seconds", "1", "--pairs", "0:1"],
                 ["testbed", "priority", "--seconds", "1"]):
        assert callable(ap.parse_args(argv).func)


def test_list_and_dry_run():
    r = dgt("tc", "list")
    assert r.returncode == 0 and "htb-prio" in r.stdout and "prio-dscp" in r.stdout
    r = dgt("tc", "apply", "nic-1g", "--dev", "eth0", "--dry-run")
    assert r.returncode == 0
    assert "htb rate 950mbit ceil 950mbit" in r.stdout


def test_bad_profile_is_one_line_exit_2():
    r = dgt("tc", "apply", "no-such", "--dev", "eth0", "--dry-run")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "unknown profile 'no-such'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root to drop to an unprivileged user (setpriv)")
def test_not_root_message():
    r = dgt("testbed", "up", "--hosts", "2", user=65534)
    assert r.returncode == 2
    assert r.stderr.strip() == ("dgt testbed needs root (CAP_NET_ADMIN); run as root or "
                                "use loopback mode")
    r = dgt("tc", "apply", "htb-prio", "--dev", "lo", user=65534)
    assert r.returncode == 2 and "needs root" in r.stderr and "Traceback" not in r.stderr
