"""'dgt top', 'dgt plot' and the report of 'dgt train' on a run dir whose files are not
regular files: a FIFO, a directory, a symbolic link to /dev/zero, or a regular file of
more bytes than any run writes (sparse: it takes no disk).

The outside tester's fault: with ``trace-0.jsonl`` a link to /dev/zero both tools read
without end (22 GB of memory, then the OOM killer), with a FIFO both waited forever,
and with a directory 'dgt plot' ended in a traceback. Now such a file is skipped with
a line naming it and what it is (dgt.run_files.open_regular), and nothing is read
without a bound (dgt.trace.MAX_LINE, dgt.run_files.MAX_RECORD). Every child runs under
an address-space limit and a timeout, so a regression fails the test (MemoryError,
TimeoutExpired) instead of eating the machine's memory or hanging it.
"""
import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
from test_top_plot import rows

pytestmark = pytest.mark.slow

#: the address space a child may use (bytes): top and plot need some 600 MB
MEMORY = 1 << 30
#: the sparse regular trace: past MEMORY, so reading it whole fails at once
HUGE_TRACE = 1280 << 20
#: the sparse trainer-0.json: past dgt.run_files.MAX_RECORD (256 MiB)
HUGE_RECORD = 300 << 20
#: a child that waits this long (s) is hung: a FIFO opened for reading
TIMEOUT = 120

#: what a note says the planted file is
IS = {"fifo": "a FIFO, not a regular file",
      "directory": "a directory, not a regular file",
      "dev-zero": "a symbolic link to a character device (/dev/zero), not a regular file"}


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def dgt(cwd, *args):
    """``python -m dgt.cli ARGS`` in ``cwd`` (so that a note's paths are short and no
    terminal width cuts them), with its memory and time bounded."""
    return subprocess.run([sys.executable, "-m", "dgt.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT,
                          preexec_fn=_limit_memory, env=dict(os.environ, COLUMNS="200"))


def plant(path, kind: str) -> str:
    """Make the run dir's file ``path`` a ``kind`` (IS's, or ``huge``: the file with
    sparse zeros after it); returns what a note says of it, after its path."""
    if kind == "huge" and path.suffix == ".jsonl":   # a last line of endless NULs
        grow(path)
        os.truncate(path, path.stat().st_size + HUGE_TRACE)
        return "1 unreadable line skipped"
    if kind == "huge":
        os.truncate(path, HUGE_RECORD)
        return f"{HUGE_RECORD:,} bytes, over the limit of {256 << 20:,} bytes"
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return IS[kind]


def grow(trace) -> None:
    """Append copies of ``trace``'s iteration lines, ``t`` counting on, to more than 3
    MiB: lines across the boundaries of the 1 MiB chunks it is read in
    (dgt.trace.CHUNK), each of which must parse."""
    its = [ln for ln in map(json.loads, trace.read_text().splitlines())
           if ln["kind"] == "iteration"]
    t = its[-1]["t"]
    with open(trace, "a") as f:
        while f.tell() < 3 << 20:
            for ln in its:
                t += 1
                f.write(json.dumps(dict(ln, t=t), separators=(",", ":")) + "\n")


def last_t(trace) -> int:
    """``t`` of the last line before the NULs that plant(huge) put after ``trace``."""
    with open(trace, "rb") as f:
        text = f.read(os.path.getsize(trace) - HUGE_TRACE)
    return json.loads(text.splitlines()[-1])["t"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    from conftest import run_train
    tmp = tmp_path_factory.mktemp("clean")
    run_train(tmp, "--workers", 2, "--hidden", 32, "--iterations", 12)
    return tmp / "run"


@pytest.fixture
def run(clean_run, tmp_path):
    """A copy of a real 2-worker run dir, as ``tmp_path/run``."""
    shutil.copytree(clean_run, tmp_path / "run")
    return tmp_path / "run"


def _no_traceback(p):
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr, p.stderr


KINDS = sorted(IS)
#: (file, kind) of each run dir top and plot are given
CASES = [(name, kind) for name in ("trace-0.jsonl", "pids.json", "trainer-0.json")
         for kind in KINDS] + [("trace-0.jsonl", "huge"), ("trainer-0.json", "huge")]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_top_skips_a_file_that_is_not_a_regular_file_with_a_note(run, name, kind):
    says = plant(run / name, kind)
    p = dgt(run.parent, "top", "--once", "run")
    _no_traceback(p)
    out = " ".join(p.stdout.split())   # the caption wraps
    if name == "trace-0.jsonl" and kind == "huge":   # a trace's lines are named so
        assert f"{name}: {says}" in out, p.stdout
    else:
        assert f"run/{name}: {says}; skipped" in out, p.stdout
    # top shows the iterations done: the 12 of this job (t of its last line + 1)
    shown = {0: 12, 1: 12} if name != "trace-0.jsonl" else \
        {0: last_t(run / name) + 1, 1: 12} if kind == "huge" else {1: 12}
    assert rows(p.stdout) == shown, p.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_top_skips_a_trainer_log_that_is_not_a_regular_file_with_a_note(run, kind):
    """Without trainer-0.json, top looks for the accuracy in trainer-0.log."""
    (run / "trainer-0.json").unlink()
    says = plant(run / "trainer-0.log", kind)
    p = dgt(run.parent, "top", "--once", "run")
    _no_traceback(p)
    assert f"run/trainer-0.log: {says}; skipped" in " ".join(p.stdout.split()), p.stdout


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_plot_skips_a_file_that_is_not_a_regular_file_in_one_line(run, tmp_path, name,
                                                                   kind):
    says = plant(run / name, kind)
    p = dgt(run.parent, "plot", "run", "--out", tmp_path / "png")
    _no_traceback(p)
    if name == "trace-0.jsonl" and kind == "huge":
        said = [ln for ln in p.stderr.splitlines() if name in ln]
        assert said == [f"dgt plot: {name}: {says}"], p.stderr
    else:
        said = [ln for ln in p.stderr.splitlines() if f"run/{name}" in ln]
        assert len(said) == 1 and says in said[0], p.stderr
    assert len(list((tmp_path / "png").iterdir())) == 4


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_plot_refuses_a_report_that_is_not_a_regular_file_in_one_line(tmp_path, kind):
    says = plant(tmp_path / "report.json", kind)
    p = dgt(tmp_path, "plot", "report.json", "--out", tmp_path / "png")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"dgt plot: error: cannot read report.json: {says} (see 'dgt plot --help')"]


#: dgt train's report of a run dir, as dgt.launch builds it when the job ends
REPORT = """
import json, sys
from dgt.config import JobConfig, TransmissionConfig
from dgt.report import build_report
r = build_report(sys.argv[1], JobConfig(workers=2, iterations=12, hidden=32),
                 TransmissionConfig(), 1.0)
print(json.dumps({"warnings": r["warnings"], "iterations": r["iterations"]}))
"""


@pytest.mark.parametrize("name", ["trace-0.jsonl", "sidecar-0.json"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_report_leaves_out_a_file_that_is_not_a_regular_file_with_a_warning(
        run, name, kind):
    says = plant(run / name, kind)
    p = subprocess.run([sys.executable, "-c", REPORT, "run"], cwd=run.parent,
                       capture_output=True, text=True, timeout=TIMEOUT,
                       preexec_fn=_limit_memory)
    _no_traceback(p)
    r = json.loads(p.stdout)
    said = [w for w in r["warnings"] if f"run/{name}" in w]
    assert len(said) == 1 and says in said[0], r["warnings"]
    assert r["iterations"] == 12
