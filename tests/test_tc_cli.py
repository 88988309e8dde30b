"""`dgt tc` / `dgt testbed` through register(subparsers): output and one-line errors."""
import argparse
import os
import re
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
    assert r.stderr.strip() == ("dgt testbed up: error: needs root (CAP_NET_ADMIN: "
                                "network namespaces, veth, tc); run as root")
    r = dgt("tc", "apply", "htb-prio", "--dev", "lo", user=65534)
    assert r.returncode == 2 and "needs root" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------- testbed prefix and errors

def dgt_main(*argv, cwd=None, user=None):
    """The real ``dgt`` entry point (dgt.cli), as a user runs it."""
    cmd = [sys.executable, "-m", "dgt.cli", *argv]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def _netns_named(prefix: str, where=None) -> list[str]:
    """Namespaces that a testbed with this (possibly invalid) prefix would have made:
    in /run/netns, or, for a prefix with a '/' (pyroute2 takes it as a path), files
    relative to ``where`` (the command's current folder)."""
    if "/" in prefix:
        base = os.path.join(where or os.getcwd(), os.path.dirname(prefix))
        stem = os.path.basename(prefix)
    else:
        base, stem = "/run/netns", prefix
    pat = re.compile(rf"^{re.escape(stem)}-(sw|h\d+)$")
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    return [os.path.join(base, n) if "/" in prefix else n for n in names if pat.match(n)]


def _mounted(path: str) -> bool:
    """Whether ``path`` is a mount point (also a bind mount on the same file system,
    which os.path.ismount misses)."""
    with open("/proc/self/mountinfo") as f:
        points = {ln.split()[4].encode().decode("unicode_escape") for ln in f}
    return path in points


def _remove_strays(prefix: str, where=None) -> None:
    """Tear down whatever a broken build left, by exact name (never another prefix):
    unmount and remove each namespace (pyroute2 takes names with a '/' as paths, and
    then bind-mounts their folder onto itself: that goes too, if it is ours)."""
    from pyroute2 import netns as pr_netns
    for n in _netns_named(prefix, where):
        try:
            pr_netns.remove(n)
        except OSError:
            pass
    if "/" in prefix:
        where = os.path.abspath(where or os.getcwd())
        folder = os.path.abspath(os.path.join(where, os.path.dirname(prefix)))
        top = os.path.dirname(where)      # pytest's folder of this run's tmp_paths
        if folder != top and not folder.startswith(top + os.sep):
            return    # only this test run's own temporary folders
        for _ in range(8):   # shared propagation can stack the same mount
            if not _mounted(folder):
                break
            subprocess.run(["umount", "-l", folder], capture_output=True)


# priority takes no --prefix: it builds and removes a testbed of its own
TB_SUBCOMMANDS = [["up", "--hosts", "2"], ["down"], ["status"], ["exec", "0", "--", "true"],
                  ["load", "--seconds", "1"]]
BAD_PREFIXES = ["fixtest/r",            # a path: pyroute2 made files in the current folder
                "../fixtest",           # a path out of /run/netns
                "fixtest.x", "fixtest x", "fixtest\u00e9",  # outside [A-Za-z0-9_-]
                "-fixtest",             # reads as an option to `ip netns exec`
                "",
                "fixtest" + "a" * 236]  # 243: testbed-<prefix>.json exceeds NAME_MAX


@pytest.mark.parametrize("prefix", BAD_PREFIXES,
                         ids=["slash", "dotdot", "dot", "space", "non-ascii", "dash-first",
                              "empty", "too-long"])
@pytest.mark.parametrize("argv", TB_SUBCOMMANDS, ids=lambda a: a[0])
def test_bad_prefix_is_one_line_error_before_anything(tmp_path, monkeypatch, capsys, argv,
                                                      prefix):
    """Every `dgt testbed` subcommand refuses a prefix that cannot name namespaces, with
    one line in argparse's form that says what is allowed, before anything is created
    (no namespace, no file in the current folder), root or not."""
    monkeypatch.chdir(tmp_path)
    try:
        a = parser().parse_args(["testbed", argv[0], f"--prefix={prefix}", *argv[1:]])
        assert a.func(a) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"dgt testbed {argv[0]}: error: bad --prefix "), err
        assert "letters, digits, '-' or '_'" in err and "1..242" in err
        assert list(tmp_path.iterdir()) == []
        assert _netns_named(prefix) == []
    finally:
        _remove_strays(prefix)


def test_reported_slash_prefix_through_dgt(tmp_path):
    """The reported case, as the user ran it (twice: the second try used to fail with
    'File exists'), and `down` with it: one line each, nothing made."""
    prefix = "fixtest/r"
    try:
        for argv in (["up", "--hosts", "2"], ["up", "--hosts", "2"], ["down"]):
            r = dgt_main("testbed", argv[0], "--prefix", prefix, *argv[1:], cwd=tmp_path)
            assert r.returncode == 2, (r.stdout, r.stderr)
            assert r.stderr.startswith(f"dgt testbed {argv[0]}: error: bad --prefix "
                                       f"'{prefix}': use 1..242 letters, digits, '-' or "
                                       f"'_', starting with a letter or digit"), r.stderr
            assert r.stderr.count("\n") == 1 and r.stdout == ""
        assert list(tmp_path.iterdir()) == []
    finally:
        _remove_strays(prefix, tmp_path)


def test_longest_prefix_passes_the_check(tmp_path):
    """242 characters is allowed (the check is the limit, not below it): the command
    gets past the prefix to its own next check."""
    r = dgt_main("testbed", "up", "--prefix", "fixtest" + "a" * 235, "--hosts", "0",
                 cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr == "dgt testbed up: error: --hosts must be >= 1, got 0\n"


@pytest.mark.parametrize("argv, message", [
    (["up", "--hosts", "0"], "--hosts must be >= 1, got 0"),
    (["up", "--hosts", "2", "--loss-pct", "101"],
     "--loss-pct must be a percentage 0..100, got 101.0"),
    (["up", "--hosts", "2", "--queue-bytes", "10"],
     "--queue-bytes must be >= 1500 (one packet), got 10"),
    (["load", "--seconds", "0"], "--seconds must be a finite number > 0, got 0.0"),
    # outside tester: 1e9 ended in 'OverflowError: timeout is too large' (a traceback)
    (["load", "--seconds", "1e9"], "--seconds must be at most 86400 s, got 1000000000.0"),
    (["load", "--seconds", "inf"], "--seconds must be a finite number > 0, got inf"),
    (["priority", "--seconds", "1e9"],
     "--seconds must be at most 3600 s, got 1000000000.0"),
])
def test_testbed_errors_name_the_subcommand(argv, message):
    """Testbed errors have the one-line `prog: error: message` form of every other
    subcommand (dgt train, dgt capture, ...), not a bare line."""
    r = dgt_main("testbed", *argv)
    assert r.returncode == 2
    assert r.stderr == f"dgt testbed {argv[0]}: error: {message}\n"
    # the same through register() under a plain argparse parser
    r = dgt("testbed", *argv)
    assert r.returncode == 2
    assert r.stderr == f"dgt testbed {argv[0]}: error: {message}\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to get past the root check")
def test_testbed_runtime_errors_name_the_subcommand():
    r = dgt_main("testbed", "status", "--prefix", "fixtestnone")
    assert r.returncode == 2
    assert r.stderr == ("dgt testbed status: error: no testbed with prefix 'fixtestnone' "
                        "is up; run `dgt testbed up`\n")
    r = dgt_main("testbed", "exec", "--prefix", "fixtestnone", "0")
    assert r.returncode == 2
    assert r.stderr.startswith("dgt testbed exec: error: give a command")
    r = dgt_main("tc", "show", "--dev", "fixtestnodev0")
    assert r.returncode == 2 and r.stderr.startswith("dgt tc show: error: ")
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["up", "--hosts", "2", "--prefix", "fixtestq", "--loss-dscp", "abc",
      "--loss-pct", "1"],
     "argument --loss-dscp: give DSCPs 0..63, comma-separated (e.g. 34,18,10), got 'abc'"),
    (["up", "--hosts", "2", "--loss-dscp", "34,64"],
     "argument --loss-dscp: give DSCPs 0..63, comma-separated (e.g. 34,18,10), got "
     "'34,64'"),
    (["load", "--pairs", "abc"], "argument --pairs: give src:dst host indexes, "
                                 "comma-separated (e.g. 0:1,1:0), got 'abc'"),
    (["load", "--pairs", "0:1,2"], "argument --pairs: give src:dst host indexes, "
                                   "comma-separated (e.g. 0:1,1:0), got '0:1,2'"),
    (["priority", "--cases", "EF:x:600"],
     "argument --cases: bad case 'EF:x:600': use NAME:DSCP:MBIT, e.g. EF:46:600"),
    (["priority", "--seconds", "nan"], "--seconds must be a finite number > 0, got nan"),
    (["priority", "--queue-bytes", "10"],
     "--queue-bytes must be >= 1500 (one packet), got 10"),
    (["priority", "--rate", "fast"], "--rate: rate 'fast' is not a rate like '1gbit'"),
    # outside tester: a host to itself measured 48753.2 Mbit/s, crossing no shaped port
    (["load", "--pairs", "0:1,0:0"], "argument --pairs: pair 0:0 is a host to itself; "
                                     "give two hosts, src:dst (e.g. 0:1)"),
    (["priority", "--cases", "EF:46:nan"],
     "argument --cases: bad case 'EF:46:nan': DSCP 0..63, 0 < Mbit/s <= 1000000"),
    (["priority", "--cases", "EF:46:1e9"],
     "argument --cases: bad case 'EF:46:1e9': DSCP 0..63, 0 < Mbit/s <= 1000000"),
], ids=["loss-dscp-word", "loss-dscp-64", "pairs-word", "pairs-half", "priority-cases",
        "priority-seconds", "priority-queue-bytes", "priority-rate", "pairs-same-host",
        "priority-cases-nan", "priority-cases-huge"])
def test_a_flag_value_that_does_not_parse_is_named(argv, message):
    """breaker: '--loss-dscp abc' and '--pairs abc' said only "invalid literal for int()
    with base 10: 'abc'"; priority's values were read after the root check, or never.
    One line naming the flag and what it takes, exit 2, before anything is built."""
    r = dgt_main("testbed", *argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"dgt testbed {argv[0]}: error: {message}"), r.stderr
    assert r.stderr.count("\n") == 1 and "invalid literal" not in r.stderr, r.stderr
    assert _netns_named("fixtestq") == []


def test_priority_takes_no_prefix():
    """breaker: 'dgt testbed priority --prefix X' was taken, left out of its usage, and
    ignored (it builds dgtpc<pid>). A --prefix naming the user's testbed would have it
    torn down, so it is refused like any unknown flag."""
    r = dgt_main("testbed", "priority", "--prefix", "fixtestnone")
    assert r.returncode == 2
    assert r.stderr.startswith("dgt testbed priority: error: unrecognized arguments: "
                               "--prefix fixtestnone"), r.stderr
    assert "--prefix" not in dgt_main("testbed", "priority", "--help").stdout


def test_a_host_in_other_digits_is_not_an_index():
    """'exec ²' (a digit to str.isdigit, not to int()) is a name that is not one of the
    testbed's, not "invalid literal for int()"."""
    from dgt.tc_profiles.names import TestbedError
    from dgt.tc_profiles.testbed import Testbed
    tb = Testbed(2, prefix="fixtest")
    assert tb._ns("1") == "fixtest-h1"
    with pytest.raises(TestbedError, match="'²' is not a namespace of this testbed"):
        tb._ns("²")


@pytest.mark.parametrize("rest, opts, cmd", [
    (["--", "ip", "addr"], {}, ["ip", "addr"]),
    (["--prefix", "fxa", "--", "ip", "-br", "addr"], {"prefix": "fxa"},
     ["ip", "-br", "addr"]),
    (["--prefix=fxa", "--", "true", "--", "x"], {"prefix": "fxa"}, ["true", "--", "x"]),
    (["ping", "-c1", "--prefix", "x"], {}, ["ping", "-c1", "--prefix", "x"]),  # as before
    (["sh", "-c", "true", "--", "x"], {}, ["sh", "-c", "true", "--", "x"]),
    ([], {}, []),
    (["-h"], {"help": True}, []),
])
def test_exec_reads_options_between_host_and_the_double_dash(rest, opts, cmd):
    """Outside tester: 'exec 0 --prefix fxa -- ip -br addr' ran '--prefix fxa -- ip
    ...' in testbed 'dgt'. What follows HOST: a first word starting with '-' begins
    options, up to '--'; any other first word begins the command (as before)."""
    assert cli.exec_split(rest) == (opts, cmd)


@pytest.mark.parametrize("rest, message", [
    (["--prefix", "fxa", "--bogus", "--", "true"], "'--bogus' after HOST: only --prefix P"),
    (["--prefix", "fxzz", "true"], "no `--` before the command 'true'"),
    (["--prefix", "fxa"], "no `--` and no command after the options"),
    (["--prefix"], "--prefix after HOST needs a value"),
])
def test_exec_refuses_anything_else_before_the_command(rest, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        cli.exec_split(rest)
    assert "\n" not in str(e.value) and str(e.value).endswith(cli.EXEC_USAGE)


def test_exec_option_errors_are_one_line_before_anything():
    """Through the CLI, root or not: one line, exit 2, nothing run (the bad word was
    run as the command: 'exec of "--prefix" failed: No such file or directory')."""
    for argv, message in (
            (["fxa-h0", "--prefix", "fxzz", "--bogus", "--", "true"], "'--bogus' after HOST"),
            (["0", "--prefix", "fx/zz", "--", "true"], "bad --prefix 'fx/zz'")):
        r = dgt_main("testbed", "exec", *argv)
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr.startswith("dgt testbed exec: error: ") and message in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr


def _synopsis() -> list[list[str]]:
    """The `dgt tc` / `dgt testbed` lines of docs/tc_profiles.md's CLI synopsis, as
    words, continuation lines joined to their command."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "tc_profiles.md").read_text()
    block = doc.split("`dgt.tc_profiles.cli.register(subparsers)` adds:")[1]
    lines = []
    for ln in block.split("\n\n")[1].splitlines():
        if ln.strip().startswith("dgt "):
            lines.append(ln.split())
        else:
            lines[-1] += ln.split()
    return lines


def test_the_doc_synopsis_shows_only_current_flags():
    """Outside tester: the synopsis showed `dgt testbed up ... [--loss PCT]`, which the
    tool calls deprecated ("use --loss-pct"). Every flag the synopsis shows is one its
    subcommand takes and shows in --help (a deprecated one is hidden there)."""
    ap = parser()
    lines = _synopsis()
    assert len(lines) >= 10, lines
    for words in lines:
        sp = ap._subparsers._group_actions[0].choices[words[1]]
        sp = sp._subparsers._group_actions[0].choices[words[2]]
        shown = {o for a in sp._actions if a.help != argparse.SUPPRESS
                 for o in a.option_strings}
        flags = {w.strip("[]").split("=")[0] for w in words[3:]
                 if w.strip("[]").startswith("--") and w.strip("[]") != "--"}
        assert flags <= shown, (" ".join(words[:3]), flags - shown)
