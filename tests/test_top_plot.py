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
    """tmux with SHELL=/bin/sh: its panes run their command with the user's shell, and
    a user whose login shell is nologin (nobody, a service account) saw every pane exit
    at once, so the test failed for that user with an empty pane."""
    return subprocess.run(["tmux", *args], env=dict(os.environ, SHELL="/bin/sh"),
                          capture_output=True, text=True,
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
    # the part of the path at fault is named (breaker round 11: errno text only)
    (tmp_path / "afile").write_text("x")
    for out, says in ((tmp_path / "afile" / "png", f"{tmp_path / 'afile'} is not a folder"),
                      ("/proc/dgt-png", "no folder can be made in /proc")):
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot",
                            str(tmp_path / "report.json"), "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and f"--out {out}: {says}" in p.stderr, p.stderr


@pytest.mark.parametrize("out", ["", "  "])
def test_plot_refuses_an_empty_out_in_one_line(tmp_path, out):
    """Breaker round 9: 'dgt plot report.json --out ""' was taken as no --out and wrote
    the PNGs beside the report."""
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"history": [], "comm_ms": [], "channels": {}}))
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(report), "--out", out],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--out is empty" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert sorted(x.name for x in tmp_path.iterdir()) == ["report.json"]


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
    # breaker round 25: a damaged trainer-0.json cost the accuracy in silence
    note = f"{run / 'trainer-0.json'}: unreadable (a JSON list, not an object); skipped"
    assert _squeezed(note) in _squeezed(out), out   # the caption wraps, mid-path too


def test_top_says_an_accuracy_outside_0_to_1_and_reads_the_log_instead(clean_run,
                                                                         tmp_path):
    """Breaker round 25: final_test_accuracy 5.0 was shown as 'test acc 5.0000' (dgt plot
    refuses it)."""
    run = tmp_path / "run"
    shutil.copytree(clean_run, run)
    trainer = json.loads((run / "trainer-0.json").read_text())
    (run / "trainer-0.json").write_text(json.dumps(dict(trainer, final_test_accuracy=5.0)))
    with open(run / "trainer-0.log", "a") as f:   # what a trainer of one's own prints
        f.write("step 9 test acc 7.5\nstep 10 test acc 0.8125\nstep 11 test acc .\n")
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", str(run), "--once"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COLUMNS="400"))
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out
    assert "test acc 0.8125" in out and "5.0000" not in out, out
    note = (f"{run / 'trainer-0.json'}: unreadable (final_test_accuracy = 5.0 is outside "
            f"0 to 1); skipped")
    assert _squeezed(note) in _squeezed(out), out   # the caption wraps, mid-path too


def _squeezed(text: str) -> str:
    return "".join(text.split())


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


def _plot(source, out, *args):
    return subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(source), "--out",
                           str(out), *args], capture_output=True, text=True, timeout=120)


def _one_error_line(p, *says):
    """``p`` refused in one line, exit 2, no traceback, the line saying each of ``says``."""
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    for x in says:
        assert x in p.stderr, (x, p.stderr)


#: (where in the report, value put there, the field as the error names it, the value as
#: it shows it): a hand-edited report's numbers that matplotlib cannot lay out (the
#: outside tester's 10**400 and ±1e308: an OverflowError or ValueError traceback) or
#: that no run gives (a negative time or count, an accuracy above 1)
OUT_OF_RANGE = [
    (("history", 0, "iteration"), 10**400, "history[0]['iteration']",
     "1000000000… (401 digits)"),
    (("channels", "tcp", "bytes_sent"), 10**400, "channels['tcp']['bytes_sent']",
     "1000000000… (401 digits)"),
    (("history", 0, "seconds"), 1e308, "history[0]['seconds']", "1e+308"),
    (("history", 0, "seconds"), -0.5, "history[0]['seconds']", "-0.5"),
    (("history", 0, "iteration"), float("inf"), "history[0]['iteration']", "inf"),
    (("history", 0, "test_accuracy"), 1.5, "history[0]['test_accuracy']", "1.5"),
    (("channels", "udp1", "bytes_delivered"), -1, "channels['udp1']['bytes_delivered']",
     "-1"),
    (("comm_ms", 3), 1e16, "comm_ms[3]", "1e+16"),
    (("comm_ms", 0), -10**400, "comm_ms[0]", "-100000000… (401 digits)"),
]


@pytest.mark.parametrize("where,value,field,shown", OUT_OF_RANGE,
                         ids=[f"{w[-1]}={v!r:.8}" for w, v, _, _ in OUT_OF_RANGE])
def test_plot_refuses_a_number_out_of_its_field_s_range_in_one_line(clean_run, tmp_path,
                                                                    where, value, field,
                                                                    shown):
    r = json.loads((clean_run.parent / "report.json").read_text())
    assert r["history"] and r["history"][0]["test_accuracy"] is not None
    at = r
    for k in where[:-1]:
        at = at[k]
    at[where[-1]] = value
    src = tmp_path / "r.json"
    src.write_text(json.dumps(r))
    p = _plot(src, tmp_path / "png")
    bound = "1" if "test_accuracy" in field else "1e+15"
    _one_error_line(p, f"{src} is not a dgt train report: {field} = {shown} is outside 0 "
                       f"to {bound}")
    assert not (tmp_path / "png").exists()


def test_plot_refuses_the_outside_tester_s_seconds_of_plus_and_minus_1e308(clean_run,
                                                                          tmp_path):
    r = json.loads((clean_run.parent / "report.json").read_text())
    r["history"] = [dict(r["history"][0], seconds=s) for s in (1e308, -1e308)]
    src = tmp_path / "c.json"
    src.write_text(json.dumps(r))
    _one_error_line(_plot(src, tmp_path / "png"), str(src), "history[0]['seconds'] = "
                    "1e+308 is outside 0 to 1e+15")


def test_plot_draws_every_field_at_the_ends_of_its_range_and_refuses_just_past(clean_run,
                                                                               tmp_path):
    """The bound (dgt.plot.LIMIT) is one matplotlib lays out: a report with each field at
    0 and at the bound gives the four PNGs; one past it, or the least negative float,
    is refused."""
    from dgt.plot import LIMIT
    r = json.loads((clean_run.parent / "report.json").read_text())
    h = r["history"][0]
    r["history"] = [dict(h, seconds=0, iteration=0, test_accuracy=0),
                    dict(h, seconds=LIMIT, iteration=int(LIMIT), test_accuracy=1)]
    r["channels"]["tcp"].update(bytes_sent=int(LIMIT), bytes_delivered=0)
    r["comm_ms"] = [0, LIMIT, 0]
    src = tmp_path / "r.json"
    src.write_text(json.dumps(r))
    p = _plot(src, tmp_path / "png")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert len(list((tmp_path / "png").iterdir())) == 4
    r["history"][1]["iteration"] = int(LIMIT) + 1
    src.write_text(json.dumps(r))
    _one_error_line(_plot(src, tmp_path / "png"), "history[1]['iteration'] = "
                    "1000000000000001 is outside 0 to 1e+15")
    r["history"][1]["iteration"] = int(LIMIT)
    r["comm_ms"][2] = -5e-324
    src.write_text(json.dumps(r))
    _one_error_line(_plot(src, tmp_path / "png"), "comm_ms[2] = -5e-324 is outside 0 to "
                    "1e+15")


def test_plot_of_a_run_dir_names_an_out_of_range_trace_or_trainer_value(clean_run,
                                                                        tmp_path):
    """trainer-0.json with seconds 1e308 costs the accuracy curves, with a note naming
    the field; a trace line with comm_s 1e400 (JSON reads it as inf) is one error line
    naming the trace and the field."""
    run = tmp_path / "run"
    shutil.copytree(clean_run, run)
    trainer = json.loads((run / "trainer-0.json").read_text())
    trainer["history"][0]["seconds"] = 1e308
    (run / "trainer-0.json").write_text(json.dumps(trainer))
    p = _plot(run, tmp_path / "png")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert (f"{run / 'trainer-0.json'}: unreadable (history[0]['seconds'] = 1e+308 is "
            f"outside 0 to 1e+15), no accuracy curve") in p.stderr, p.stderr
    assert len(list((tmp_path / "png").iterdir())) == 4
    trace = run / "trace-1.jsonl"
    lines = trace.read_bytes().split(b"\n")
    it = [i for i, ln in enumerate(lines) if b'"kind":"iteration"' in ln][2]
    lines[it], n = re.subn(rb'"comm_s":[0-9.e+-]+', b'"comm_s":1e400', lines[it])
    assert n == 1
    trace.write_bytes(b"\n".join(lines))
    _one_error_line(_plot(run, tmp_path / "png2"), str(run),
                    "trace-1.jsonl comm_s (ms) of iteration line 2 = inf is outside 0 to "
                    "1e+15")


def test_a_figure_matplotlib_cannot_draw_is_one_line_naming_the_report(clean_run, tmp_path):
    """Valid but odd: a channel name, or a --title, that matplotlib reads as broken
    mathtext (a ValueError from deep in its drawing, a traceback before)."""
    r = json.loads((clean_run.parent / "report.json").read_text())
    r["channels"]["$\\frac$"] = r["channels"].pop("udp1")
    src = tmp_path / "m.json"
    src.write_text(json.dumps(r))
    _one_error_line(_plot(src, tmp_path / "png"),
                    f"{src}: matplotlib cannot draw channel_bytes.png: ")
    _one_error_line(_plot(clean_run.parent / "report.json", tmp_path / "png2", "--title",
                          "$\\foo$"), "report.json: matplotlib cannot draw accuracy_time.png")


def test_top_once_on_a_folder_that_is_not_a_run_dir_says_so(tmp_path):
    (tmp_path / "other.txt").write_text("x")
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", str(tmp_path), "--once"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{tmp_path} is not a run dir" in p.stderr and "waiting" not in p.stdout


def test_top_once_counts_the_iterations_each_rank_has_done(clean_run):
    # breaker round 14: a 12-iteration job showed 'iter 11' (the trace's t, from 0)
    # where the job's own epoch line says 'iter 12'
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "top", str(clean_run), "--once"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rows(p.stdout) == {0: 12, 1: 12}, p.stdout


def test_top_keeps_every_number_whole_on_an_80_column_terminal():
    # CI-like quiet machine, 2026-12-02: a fast job passed iteration 9999 and on an 80-
    # column terminal rich shrank 'iter' to its header, showing '140…' for 14045
    from rich.console import Console
    from dgt.top import render
    ch = {"blocks_per_s": 12530.0, "loss": 0.25}
    rows_ = {r: {"iterations": 140450 + r, "rate": 1138.2, "comm_ms": 7.5,
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


def test_plot_never_writes_through_a_link_nor_over_a_file_that_is_not_a_png(clean_run,
                                                                           tmp_path):
    """Breaker round 9: another user put ``channel_bytes.png`` beside a report in /tmp
    as a symbolic link to a root file, and ``dgt plot`` (root) wrote the PNG through it;
    a text file of a figure's name was replaced as well. Now a name that holds no PNG,
    through a link or not, is refused in one line before any figure is drawn, and a
    link to a PNG is replaced by the new file, its target left alone."""
    report = clean_run.parent / "report.json"
    victim = tmp_path / "victim.txt"
    victim.write_text("root data")
    out = tmp_path / "png"
    out.mkdir()
    (out / "channel_bytes.png").symlink_to(victim)
    _one_error_line(_plot(report, out), "channel_bytes.png: it exists and is not a PNG")
    assert victim.read_text() == "root data"
    assert sorted(x.name for x in out.iterdir()) == ["channel_bytes.png"]   # none drawn
    (out / "channel_bytes.png").unlink()
    (out / "comm_time.png").write_text("notes")
    _one_error_line(_plot(report, out), "comm_time.png: it exists and is not a PNG")
    assert (out / "comm_time.png").read_text() == "notes"
    (out / "comm_time.png").unlink()
    old_png = tmp_path / "old.png"
    old_png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 8)
    (out / "accuracy_time.png").symlink_to(old_png)
    p = _plot(report, out)
    assert p.returncode == 0, p.stderr
    assert not (out / "accuracy_time.png").is_symlink()
    assert old_png.read_bytes() == b"\x89PNG\r\n\x1a\n" + b"\0" * 8


def test_bench_refuses_an_out_folder_that_others_can_write(tmp_path):
    """Breaker round 9: ``dgt bench --out`` in a folder of mode 0777 wrote its figure
    and table through another user's links there. Such a folder is refused before any
    cell runs, in one line, as --run-dir is."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--loopback", "--systems",
                        "gloo", "--workers", "2", "--iterations", "2", "--out", str(shared)],
                       capture_output=True, text=True, timeout=120)
    _one_error_line(p, f"--out {shared} is writable by other users (mode 777)")
    assert os.listdir(shared) == []
