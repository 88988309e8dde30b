"""Not root: every root command's one line suggests only what that command has.

Outside tester: as uid 65534, ``dgt tc clear --dev lo`` said "run as root, or use
--dry-run", and ``dgt tc clear --dev lo --dry-run`` failed with "unrecognized arguments:
--dry-run"; ``dgt testbed down``, ``status`` and ``exec`` said "run as root or use
loopback mode", which none of them has. Every line now comes from one table
(dgt.tc_profiles.needs_root), and an alternative it offers is a flag of the command's
own parser that does the job without root.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import children_tmpdir

from dgt.tc_profiles import system
from dgt.tc_profiles.needs_root import COMMANDS, not_root

NOBODY = 65534
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: the line's form: the need, then "run as root", then at most one way around it
FORM = re.compile(r"needs root \((?P<why>[^()]+)\); run as root"
                  r"(?:, or (?P<verb>add|drop) (?P<flag>--[a-z][a-z0-9-]*) \S.*)?")


def _parser_of(command: str) -> argparse.ArgumentParser:
    """The parser of ``command`` (``dgt bench goodput``: the bench parser, whose
    positional takes 'goodput') in the real ``dgt`` CLI."""
    from dgt.cli import build_parser
    p = build_parser()
    for word in command.split()[1:]:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and word in subs[0].choices:
            p = subs[0].choices[word]
            continue
        assert any(a.choices and word in a.choices for a in p._actions
                   if not a.option_strings), f"{command}: no '{word}' in {p.prog}"
    return p


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_not_root_line_names_only_its_own_commands_flags(command):
    """In process, every entry against its command's parser: each flag the line
    names is one of the command's own, and so is the alternative's."""
    msg = not_root(command)
    m = FORM.fullmatch(msg)
    assert m, msg
    own = _options(_parser_of(command))
    assert set(FLAG.findall(msg)) <= own, (msg, sorted(own))
    assert m["flag"] == (COMMANDS[command].flag or None)
    assert not m["flag"] or m["flag"] in own


def _as_nobody(argv, cwd):
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", sys.executable, "-m", "dgt.cli", *argv],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def nobody_dir():
    """A folder uid 65534 may write (outputs, the cwd of its runs); skips when this
    test cannot run a process as that user."""
    if os.geteuid() != 0:
        pytest.skip(reason="needs root: the test runs dgt as another user (uid 65534)")
    if not system.have("setpriv"):
        pytest.skip(reason=system.missing_message("setpriv", "running dgt as uid 65534"))
    d = tempfile.mkdtemp(prefix="notroot-", dir=children_tmpdir())
    os.chown(d, NOBODY, NOBODY)
    probe = _as_nobody(["--version"], d)
    if probe.returncode != 0:   # e.g. an interpreter under a folder 65534 cannot enter
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip(reason=f"uid {NOBODY} cannot run this interpreter: "
                           f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


#: every root command as a user gives it: (the command, the rest of its argv, what is
#: added to try the suggestion: bench --estimate plans without running anything)
CASES = [
    ("dgt tc apply", ["htb-prio", "--dev", "lo"], []),
    ("dgt tc clear", ["--dev", "lo"], []),
    ("dgt tc show", ["--dev", "lo", "--netns", "dgtnr-x-h0"], []),
    ("dgt testbed up", ["--hosts", "2", "--prefix", "dgtnr"], []),
    ("dgt testbed down", ["--prefix", "dgtnr"], []),
    ("dgt testbed status", ["--prefix", "dgtnr"], []),
    ("dgt testbed exec", ["--prefix", "dgtnr", "0", "--", "true"], []),
    ("dgt testbed load", ["--prefix", "dgtnr", "--seconds", "1"], []),
    ("dgt testbed priority", ["--seconds", "1"], []),
    ("dgt capture", ["--ports", "47999", "-w", "{d}/c.pcap"], []),
    ("dgt bench", ["--out", "{d}/bench"], ["--estimate"]),
    ("dgt bench goodput", ["--out", "{d}/bench"], ["--estimate"]),
    ("dgt bench tta", ["--out", "{d}/bench"], ["--estimate"]),
]


def test_every_command_of_the_table_is_run_as_nobody_below():
    assert sorted(c for c, _, _ in CASES) == sorted(COMMANDS)


@pytest.mark.parametrize("command,rest,trying", CASES, ids=[c[4:] for c, _, _ in CASES])
def test_every_root_command_as_nobody_suggests_what_it_has(nobody_dir, command, rest,
                                                             trying):
    """As uid 65534, end to end: one line, exit 2; every flag it names is in the
    command's own --help; what it offers instead of root (a flag to add or drop)
    works as uid 65534; and the line is the table's."""
    words = command.split()[1:]
    rest = [a.replace("{d}", nobody_dir) for a in rest]
    r = _as_nobody([*words, *rest], nobody_dir)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    line = lines[0]
    assert "needs root" in line, line
    helptext = _as_nobody([*words, "--help"], nobody_dir).stdout
    own = set(FLAG.findall(helptext))
    assert set(FLAG.findall(line)) <= own, (line, sorted(own))
    # what it offers after "run as root" names the flag that gives it
    after = line.split("run as root", 1)[1] if "run as root" in line else line
    alt = FLAG.findall(after)
    assert after.strip() == "" or alt, f"offers something no flag of it gives: {line}"
    if alt:
        argv = [*words, *rest]
        if re.search(rf"\bdrop {re.escape(alt[0])}", after):
            i = argv.index(alt[0])
            argv = argv[:i] + argv[i + 2:]
        else:
            argv += [alt[0]]
        t = _as_nobody(argv + trying, nobody_dir)
        assert t.returncode == 0 and "needs root" not in t.stdout + t.stderr, \
            (line, argv + trying, t.stdout[-500:], t.stderr[-500:])
    # and it is the one the table has for this command
    assert line.endswith(f": error: {not_root(command)}"), (line, not_root(command))
