"""'dgt top' in tmux against a live 4-worker job, and 'dgt plot' on a real report."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.slow

WORKERS = 4
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+[0-9.]+\s+[0-9.]+", re.M)


def tmux(*args) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True,
                          timeout=20).stdout


def rows(pane: str) -> dict[int, int]:
    """{rank: iteration} of the table rows in a captured pane."""
    return {int(r): int(it) for r, it in ROW.findall(pane)}


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (Debian package tmux)")
def test_top_shows_every_rank_live_and_q_quits(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # The job must outlive the observation on any machine speed (on CI it ended after
    # its 10 epochs, 110 iterations, before top had drawn twice): it runs far longer
    # than the test watches, and the finally clause stops it.
    job = subprocess.Popen([sys.executable, "-m", "dgt.cli", "train", "--workers",
                            str(WORKERS), "--hidden", "64", "--iterations", "1000000",
                            "--epochs", "100000",
                            "--run-dir", str(run)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.STDOUT)
    name = f"dgttop-{uuid.uuid4().hex[:8]}"
    cmd = f"{sys.executable} -m dgt.cli top {run} --interval-s 0.3; echo top-exited-$?; sleep 60"
    tmux("new-session", "-d", "-s", name, "-x", "150", "-y", "30", cmd)
    try:
        seen: list[dict[int, int]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            got = rows(tmux("capture-pane", "-p", "-t", name))
            if sorted(got) == list(range(WORKERS)) and (not seen or got != seen[-1]):
                seen.append(got)
                if len(seen) >= 2:
                    break
            time.sleep(0.3)
        pane = tmux("capture-pane", "-p", "-t", name)
        assert len(seen) >= 2, pane
        assert all(seen[1][r] >= seen[0][r] for r in range(WORKERS))
        assert seen[1] != seen[0]   # numbers change while the job runs
        assert "dgt top" in pane and "tcp" in pane and "udp1" in pane
        tmux("send-keys", "-t", name, "q")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "top-exited-" not in pane:
            time.sleep(0.2)
            pane = tmux("capture-pane", "-p", "-t", name)
        assert "top-exited-0" in pane, pane
    finally:
        tmux("kill-session", "-t", name)
        job.kill()
        job.wait()


def test_plot_writes_pngs_from_a_real_report(tmp_path):
    from conftest import run_train
    _, r = run_train(tmp_path, "--workers", 2, "--hidden", 32, "--iterations", 24,
                     "--eval-every", 6)
    assert len(r["comm_ms"]) == r["iterations"] == 24
    for source, out in ((tmp_path / "report.json", tmp_path / "png"),
                        (tmp_path / "run", tmp_path / "png-run")):
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(source), "--out",
                            str(out)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        names = sorted(x.name for x in out.iterdir())
        assert names == ["accuracy_iteration.png", "accuracy_time.png",
                         "channel_bytes.png", "comm_time.png"]
        for x in out.iterdir():
            data = x.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # a mistyped --out is an error, not a new tree (breaker round 4 saw /nonexistent/x made)
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(tmp_path / "report.json"),
                        "--out", str(tmp_path / "missing" / "png")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "No such file or directory" in p.stderr, p.stderr
    assert not (tmp_path / "missing").exists()


def test_plot_refuses_what_is_not_a_report(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps([1, 2]))
    for source in (bad, tmp_path / "missing.json", tmp_path):
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(source)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "dgt plot: error:" in p.stderr


@pytest.mark.parametrize("field,value", [
    ("history", "x"), ("history", [1, 2]), ("history", [{"seconds": "a"}]),
    ("channels", {"tcp": None}), ("channels", [1]),
    ("channels", {"tcp": {"bytes_sent": "1", "bytes_delivered": 2}}),
    ("comm_ms", ["a", None]), ("comm_ms", 3),
])
def test_plot_refuses_a_report_whose_fields_have_the_wrong_type(tmp_path, field, value):
    """Valid JSON with one field of the wrong type (the breaker's cases): one line, exit
    2, never a traceback from plot() or matplotlib."""
    good = {"history": [{"seconds": 1.0, "iteration": 1, "test_accuracy": 0.5}],
            "channels": {"tcp": {"bytes_sent": 10, "bytes_delivered": 10}},
            "comm_ms": [1.0, 2.0]}
    good[field] = value
    src = tmp_path / "r.json"
    src.write_text(json.dumps(good))
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(src), "--out",
                        str(tmp_path / "png")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "is not a dgt train report" in p.stderr


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    from conftest import run_train
    tmp = tmp_path_factory.mktemp("clean")
    run_train(tmp, "--workers", 2, "--hidden", 32, "--iterations", 12)
    return tmp / "run"


#: the breaker's damages to trace-0.jsonl: a line ``[]``, an iteration line with its
#: numbers replaced by "abc", non-UTF-8 bytes appended; and all three at once
DAMAGES = {"list": ["list"], "abc": ["abc"], "bytes": ["bytes"],
           "all": ["list", "abc", "bytes"]}


@pytest.fixture(params=sorted(DAMAGES))
def damaged_run(request, clean_run, tmp_path):
    """A copy of a real run dir with trace-0.jsonl damaged, and trainer-0.json ``[]``.
    Returns (run dir, how many unreadable lines trace-0.jsonl holds)."""
    run = tmp_path / "run"
    shutil.copytree(clean_run, run)
    kinds = DAMAGES[request.param]
    trace = run / "trace-0.jsonl"
    lines = trace.read_bytes().split(b"\n")
    it = [i for i, ln in enumerate(lines) if b'"kind":"iteration"' in ln][1]
    bad = [b"[]"] if "list" in kinds else []
    if "abc" in kinds:
        bad.append(re.sub(rb'":(-?[0-9.e+-]+)([,}])', rb'":"abc"\2', lines[it]))
    lines[it:it] = bad
    trace.write_bytes(b"\n".join(lines) + (b"\x00\xff\xfe" if "bytes" in kinds else b""))
    (run / "trainer-0.json").write_text("[]")
    return run, len(kinds)


def test_top_skips_and_counts_the_unreadable_lines_of_a_damaged_trace(damaged_run):
    run, n = damaged_run
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", str(run), "--once"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COLUMNS="200"))   # no cell cut short
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out
    note = f"trace-0.jsonl: {n} unreadable line{'s' if n > 1 else ''} skipped"
    assert note in " ".join(out.split()), out
    assert sorted(rows(p.stdout)) == [0, 1], out


def test_plot_skips_and_counts_the_unreadable_lines_of_a_damaged_trace(damaged_run,
                                                                       tmp_path):
    run, n = damaged_run
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(run), "--out",
                        str(tmp_path / "png")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    note = f"trace-0.jsonl: {n} unreadable line{'s' if n > 1 else ''} skipped"
    assert p.stderr.count(note) == 1, p.stderr
    assert f"{run / 'trainer-0.json'}: unreadable" in p.stderr, p.stderr
    assert len(list((tmp_path / "png").iterdir())) == 4


def test_top_once_on_a_folder_that_is_not_a_run_dir_says_so(tmp_path):
    (tmp_path / "other.txt").write_text("x")
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", str(tmp_path), "--once"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{tmp_path} is not a run dir" in p.stderr and "waiting" not in p.stdout


def test_top_keeps_every_number_whole_on_an_80_column_terminal():
    # CI-like quiet machine, 2026-12-02: a fast job passed iteration 9999 and on an 80-
    # column terminal rich shrank 'iter' to its header, showing '140…' for 14045
    from rich.console import Console
    from dgt.top import render
    ch = {"blocks_per_s": 12530.0, "loss": 0.25}
    rows_ = {r: {"iteration": 140450 + r, "rate": 1138.2, "comm_ms": 7.5,
                 "comm_ms_median": 5.6, "k": 0.5, "lost": 123456,
                 "channels": {c: ch for c in ("tcp", "udp1", "udp2", "udp3")}}
             for r in range(4)}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(render(rows_, "/tmp/" + "d" * 60 + "/run", None, []))
    text = console.export_text()
    assert "…" not in text, text
    assert rows(text) == {r: 140450 + r for r in range(4)}, text
    for number in ("1138.2", "123456", "12530", "25%"):
        assert text.count(number) >= 4, text
