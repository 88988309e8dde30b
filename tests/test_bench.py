"""The benchmark harness: gloo baseline, 'dgt bench' (loopback, testbed), scoring bench.

Small and real: tiny models, a couple of iterations, real processes and sockets. No
timing is asserted; the numbers belong to the benchmark's own output.
"""
import json
import signal
import time
import os
import subprocess
import sys

import pytest
from conftest import needs, requires_tool

root_only = needs("ip", root="netns, veth, tc")

REPORT_KEYS = ("comm_ms_median", "comm_ms_p95", "target_reached", "final_test_accuracy",
               "iterations", "wall_seconds", "bytes_per_iteration", "history",
               "replicas_identical")


def test_gloo_train_on_loopback_writes_a_report(tmp_path):
    report = tmp_path / "gloo.json"
    p = subprocess.run([sys.executable, "-m", "dgt.tools.gloo_train", "--workers", "2",
                        "--iterations", "2", "--hidden", "32", "--report", str(report)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(report.read_text())
    for k in REPORT_KEYS:
        assert k in r, k
    assert r["mode"] == "gloo" and r["workers"] == 2 and r["iterations"] == 2
    assert len(r["comm_ms"]) == 2
    assert r["replicas_identical"]
    assert 0 < r["register_seconds"] < r["train_seconds"]   # as dgt train's report
    n = 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert r["n_params"] == n
    assert r["bytes_per_iteration"] == 4 * n  # 2 (N-1)/N = 1 for N = 2


def test_gloo_and_dgt_share_the_training_loop(tmp_path):
    """Same data, model, seed and optimiser: with the same averaged gradient (up to the
    summation order) the first epoch's accuracy agrees closely."""
    g = tmp_path / "g.json"
    d = tmp_path / "d.json"
    common = ["--workers", "2", "--iterations", "3", "--hidden", "32"]
    p = subprocess.run([sys.executable, "-m", "dgt.tools.gloo_train", *common,
                        "--report", str(g)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--mode", "tcp", *common,
                        "--report", str(d)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rg, rd = json.loads(g.read_text()), json.loads(d.read_text())
    assert rg["iterations"] == rd["iterations"] == 3
    assert rg["history"][-1]["loss"] == pytest.approx(rd["history"][-1]["loss"], rel=1e-3)


def test_bench_loopback_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--loopback",
                        "--workers", "2", "--hidden", "32", "--iterations", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "loopback.json").read_text())
    assert [c["system"] for c in doc["cells"]] == ["gloo", "tcp", "topk", "dgt"]
    for c in doc["cells"]:
        assert c["error"] is None, c["error"]
        assert c["iterations"] == 1
        assert c["comm_ms_median"] > 0 and c["comm_ms_p95"] >= c["comm_ms_median"]
    md = (out / "loopback.md").read_text()
    assert "dgt bench --loopback" in md and doc["date"] in md
    assert md.count("| loopback |") == 4
    assert (out / "loopback_comm_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[4/4]" in p.stdout   # progress lines


def test_an_interrupted_bench_keeps_the_cells_it_measured(tmp_path):
    """Breaker round 10: Ctrl-C to 'dgt bench --loopback' in its second cell threw away
    the first cell's figures (the outputs were written at the end only); 'dgt bench tta'
    kept them. Now both write after every cell, marked partial until the last."""
    out = tmp_path / "bench"
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "bench", "--loopback",
                          "--systems", "gloo,tcp", "--workers", "2", "--hidden", "32",
                          "--iterations", "200", "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "loopback.json").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGINT)   # as a terminal's Ctrl-C: to the whole group
        so, se = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, (so[-2000:], se[-2000:])
    assert f"the cells measured so far are in {out / 'loopback.json'}" in se, se
    doc = json.loads((out / "loopback.json").read_text())
    assert [c["system"] for c in doc["cells"]] == ["gloo"] and doc["complete"] is False
    assert doc["cells"][0]["error"] is None and doc["cells"][0]["iterations"] == 200
    assert "**Partial: 1 cells written so far" in (out / "loopback.md").read_text()
    assert not set(doc["config"]) & LOOPBACK_UNUSED, doc["config"]


#: BenchConfig's testbed settings: none applies to a --loopback run
LOOPBACK_UNUSED = {"scenarios", "rates", "loss_pct", "profile", "tcp_congestion", "prefix"}


def test_a_loopback_bench_writes_the_config_it_ran(tmp_path):
    """'dgt bench --loopback' wrote the testbed's scenarios, rates, loss and profile in
    its JSON's config (the defaults, never used), interrupted or complete. Its config
    now holds what the run used: the settings but the testbed's."""
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--loopback",
                        "--systems", "gloo", "--workers", "2", "--hidden", "32",
                        "--iterations", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    doc = json.loads((out / "loopback.json").read_text())
    assert doc["complete"] is True and doc["cells"][0]["error"] is None, doc["cells"]
    cfg = doc["config"]
    assert not set(cfg) & LOOPBACK_UNUSED, cfg
    assert cfg["loopback"] is True and cfg["systems"] == ["gloo"] and \
        cfg["workers"] == 2 and cfg["hidden"] == 32 and cfg["iterations"] == 3, cfg


def _bench_as_nobody() -> tuple[int, str]:
    """Run `dgt bench` in a forked child that dropped to uid 65534 (modules imported
    first: the interpreter's own files may be unreadable to that user)."""
    import dgt.cli
    import dgt.tools.bench  # noqa: F401
    import dgt.tools.cli  # noqa: F401
    import dgt.tc_profiles.testbed  # noqa: F401
    import dgt.tc_profiles.cli  # noqa: F401
    import importlib.readers  # noqa: F401  (the tc profiles are package data)
    parser = dgt.cli.build_parser()
    # the checks before the root check, once as root: whatever they import is loaded
    dgt.tools.bench.config_from_args(parser.parse_args(["bench", "--rates", "1gbit"])
                                     ).validate()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.dup2(w, 2)
            os.dup2(w, 1)
            sys.stdout = os.fdopen(1, "w")
            sys.stderr = os.fdopen(2, "w")
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            ns = parser.parse_args(["bench", "--rates", "1gbit"])
            code = ns.func(ns)
        except BaseException:
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def test_bench_without_root_is_one_line_error():
    if os.geteuid() == 0:
        code, text = _bench_as_nobody()
    else:
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench"], capture_output=True,
                           text=True, timeout=60)
        code, text = p.returncode, p.stdout + p.stderr
    assert code == 2
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert "needs root" in lines[0] and "--loopback" in lines[0]


def test_bench_rejects_unknown_system():
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--loopback",
                        "--systems", "nccl"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown system 'nccl'" in p.stderr and "Traceback" not in p.stderr


def test_bench_estimate_prints_plan():
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(" ~") == 32   # 4 systems x 4 scenarios x 2 rates
    assert "estimate:" in p.stdout


def test_bench_estimate_caps_each_cell_at_the_cell_timeout():
    """A leftover of breaker round 6: --estimate gave each cell its full estimate even
    where --cell-timeout-s kills the cell sooner."""
    def plan_of(*extra):
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate",
                            "--systems", "dgt", "--rates", "1gbit", "--scenarios", "clean",
                            *extra], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        cell = next(ln for ln in p.stdout.splitlines() if " ~" in ln)
        return float(cell.split("~")[1].split()[0])
    full = plan_of()
    assert full > 10, full   # the premise: a cell estimated longer than the cap below
    assert plan_of("--cell-timeout-s", "10") == 10


def test_bench_estimate_plans_a_loss_sweep():
    """--loss-pct 1,5: each lossy scenario once per loss rate, clean and tenant once."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate",
                        "--systems", "gloo,dgt", "--rates", "1gbit", "--loss-pct", "1,5,1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [ln.split()[1:-2] for ln in p.stdout.splitlines() if " ~" in ln]
    assert rows == [["clean", "gloo"], ["clean", "dgt"], ["tenant", "gloo"],
                    ["tenant", "dgt"], ["lossy", "1", "%", "gloo"], ["lossy", "1", "%", "dgt"],
                    ["lossy", "5", "%", "gloo"], ["lossy", "5", "%", "dgt"],
                    ["lossy-link", "1", "%", "gloo"], ["lossy-link", "1", "%", "dgt"],
                    ["lossy-link", "5", "%", "gloo"], ["lossy-link", "5", "%", "dgt"]]


@pytest.mark.parametrize("args", [
    ["--loopback", "--scenarios", "tenant"], ["--loopback", "--rates", "1gbit"],
    ["--loopback", "--loss-pct", "3"], ["--loopback", "--profile", "htb-3band"],
    ["tta", "--loopback", "--scenarios", "share"], ["--loopback", "--prefix", "b11"],
    ["--loopback", "--tcp-congestion", "bbr"],
    # given at their default values: refused as well (stop 47's leftover)
    ["--loopback", "--loss-pct", "1"], ["--loopback", "--profile", "htb-prio"],
    ["--loopback", "--prefix", "dgtbench"], ["--loopback", "--tcp-congestion", "cubic"]])
def test_bench_loopback_refuses_the_testbeds_flags_in_one_line(args):
    """Breaker round 9: 'dgt bench --loopback --scenarios tenant' ran the loopback cells
    and said nothing of the tenant it did not run. A flag given at its default value
    is as given: the parser's default is None (dgt.tools.bench.LATE_DEFAULTS)."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate", *args],
                       capture_output=True, text=True, timeout=60)
    flag = next(a for a in args if a.startswith("--") and a != "--loopback")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"{flag} does not apply with --loopback" in p.stderr, p.stderr
    assert p.stderr.strip().endswith("(see 'dgt bench --help')")
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_flags_a_bench_mode_does_not_read_are_refused_in_one_line():
    """Breaker round 11: 'dgt bench tta --loss-pct 1', 'tta --hidden 100', 'tta --epochs
    3', 'goodput --loss-pct 3' and 'goodput --scenarios lossy' each printed a normal
    estimate (tta --loss-pct 1 then started calibrating): flags of the matrix that tta
    or goodput do not read. Each is now refused naming the flag and the mode, at any
    value, and a flag that mode reads is still taken."""
    cases = [("tta", "--loss-pct", "1"), ("tta", "--hidden", "100"),
             ("tta", "--epochs", "3"), ("goodput", "--loss-pct", "3"),
             ("goodput", "--scenarios", "lossy"), ("goodput", "--systems", "gloo"),
             ("goodput", "--seed", "0"), ("goodput", "--tcp-congestion", "cubic"),
             ("goodput", "--keep-runs"), ("goodput", "--workers", "2"),
             ("goodput", "--target-accuracy", "0.8")]
    for what, flag, *value in cases:
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", what, "--estimate",
                            flag, *value], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (what, flag, p.stdout, p.stderr)
        assert p.stderr.startswith(f"dgt bench: error: {flag} does not apply to 'dgt "
                                   f"bench {what}'"), p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""
    for args in (["goodput", "--hidden", "64"],
                 ["tta", "--seed", "3", "--models", "mlp:64", "--scenarios", "clean"]):
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate", *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "estimate:" in p.stdout, (args, p.stdout, p.stderr)


@pytest.mark.parametrize("args", [["--seconds", "3"], ["--mb", "5"],
                                  ["tta", "--seconds", "3"], ["tta", "--mb", "5"],
                                  ["--seconds", "5"], ["tta", "--mb", "100"]])
def test_goodputs_own_flags_are_refused_elsewhere_in_one_line(args):
    """Breaker round 10: --seconds and --mb (goodput's) were taken in silence by the
    matrix and tta benches."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate", *args],
                       capture_output=True, text=True, timeout=60)
    flag = next(a for a in args if a.startswith("--"))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"{flag} applies to 'dgt bench goodput' only" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_bench_errors_naming_a_flag_point_at_help_and_the_others_do_not():
    from dgt.tools.bench import with_help_hint
    assert with_help_hint("--workers must be 2..64,\n got 1") == \
        "--workers must be 2..64, got 1 (see 'dgt bench --help')"
    assert with_help_hint("dgt bench needs root") == "dgt bench needs root"
    # not_root's line names flags too (--loopback), and is the table's as it is
    assert with_help_hint("needs root; or add --loopback") == "needs root; or add --loopback"


@pytest.mark.parametrize("value, msg", [
    ("abc", "is not a percentage"), ("1,,3", "is not a percentage"),
    ("0", "in (0, 100)"), ("100", "in (0, 100)"), ("1,nan", "got nan"),
    ("-1", "in (0, 100)")])
def test_bench_loss_pct_is_checked_in_one_line(value, msg):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate",
                        f"--loss-pct={value}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and msg in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_loss_sweep_table_gives_growth_over_the_clean_cell(tmp_path):
    """The sweep table and plot come from the cells' own medians: each lossy cell's
    change against the same system's clean cell at that rate; a failed cell is '–'."""
    from dgt.tools import bench
    cfg = bench.BenchConfig(systems=("tcp", "dgt"), scenarios=("clean", "lossy-link"),
                            rates=("1gbit",), loss_pct=(1.0, 5.0))
    medians = {("clean", None, "tcp"): 100.0, ("clean", None, "dgt"): 200.0,
               ("lossy-link", 1.0, "tcp"): 110.0, ("lossy-link", 1.0, "dgt"): 150.0,
               ("lossy-link", 5.0, "tcp"): 300.0}
    cells = []
    for c in bench.plan(cfg):
        m = medians.get((c["scenario"], c["loss_pct"], c["system"]))
        cells.append(dict(c, label=bench.SYSTEM_LABEL[c["system"]],
                          error=None if m else "exit status 1",
                          **(dict(comm_ms_median=m, comm_ms_p95=m, iterations=1,
                                  target_reached=None, final_test_accuracy=0.5,
                                  bytes_per_iteration_node=1e6, gradient_bytes=1e6,
                                  history=[dict(iteration=0, seconds=1.0,
                                                test_accuracy=0.5, loss=1.0)])
                             if m else {})))
    doc = dict(command="dgt bench --loss-pct 1,5", date="2026-12-01T00:00:00+00:00",
               host=dict(cpus=2, kernel="k", load_before=[0.0]), estimate_s=60,
               config=__import__("dataclasses").asdict(cfg), cells=cells)
    sweep = bench.loss_sweep(doc)
    assert sweep["loss_pct"] == [1.0, 5.0]
    assert [(r["system"], r["clean_ms"], r["ms"]) for r in sweep["rows"]] == [
        ("tcp", 100.0, [110.0, 300.0]), ("dgt", 200.0, [150.0, None])]
    md = bench.markdown(doc)
    assert "| 1gbit | lossy-link | dgt --mode tcp | 100.0 | 110.0 (+10 %) | 300.0 (+200 %) |" in md
    assert "| 1gbit | lossy-link | dgt --mode dgt | 200.0 | 150.0 (-25 %) | – |" in md
    assert "| 1gbit | lossy-link 5 % | dgt --mode dgt | failed ‡: exit status 1 |" in md
    assert "- 1gbit lossy-link 5 % dgt --mode dgt: exit status 1" in md
    paths = bench.write_outputs(doc, str(tmp_path))
    assert (tmp_path / "loss_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(tmp_path / "loss_sweep.png") in paths
    doc["cells"] = [c for c in cells if c["loss_pct"] in (None, 1.0)]
    assert bench.loss_sweep(doc) is None   # one loss rate: no sweep


def test_a_failed_cells_whole_reason_is_listed_under_the_table():
    """Breaker round 9: the table cut a failed cell's reason at 120 characters, where the
    part that says what to do comes last, and a '|' in it split the row."""
    from dgt.tools.bench import failed_cell, failure_notes, md_text
    why = ("exit status 1; logs in /tmp/x: dgt train: trainer 2 failed | see "
           + "its log " * 20 + "and use a smaller --hidden")
    cell = failed_cell(why)
    assert cell.startswith("failed ‡: exit status 1") and cell.endswith("…")
    assert "|" not in cell.replace("\\|", "")   # no bare pipe: the row keeps its columns
    notes = failure_notes([{"error": why, "name": "c1"}, {"error": None, "name": "c2"}],
                          lambda c: c["name"])
    assert notes[-1] == f"- c1: {why}" and len(notes) == 4
    assert failure_notes([{"error": None}], str) == []
    assert md_text("a|b\nc") == "a\\|b c"


def test_scoring_bench_reports_throughput():
    from dgt.tools.bench_scoring import bench
    r = bench(mb=1.0, repeat=2)
    assert r["n_blocks"] == -(-250_000 // 352)
    assert r["threads"] == 1
    assert r["gb_per_s_per_core"] > 0 and r["total_s"] > 0


def test_udp_send_bench_runs_and_refuses_bad_flags(tmp_path, capsys):
    from dgt.tools import bench_udp_send
    out = tmp_path / "u.json"
    assert bench_udp_send.main(["--rows", "4", "--size", "200", "--repeat", "20",
                                "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["rows"] == 4 and r["send_s"] > 0 and r["send_without_toggle_s"] > 0
    assert "µs/call" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench_udp_send.main(["--size", "70000"])
    assert e.value.code == 2 and "--size 1..65000" in capsys.readouterr().err


@root_only
@pytest.mark.slow
@requires_tool("iperf3")
def test_bench_on_testbed_every_scenario(tmp_path):
    """The real matrix, tiny: 2 hosts, gloo + dgt, every scenario at one rate; the
    testbed is removed afterwards."""
    from dgt.tc_profiles import testbed
    out = tmp_path / "bench"
    prefix = f"dgtbt{os.getpid() % 10000}"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--workers", "2",
                        "--hidden", "32", "--iterations", "2", "--systems", "gloo,dgt",
                        "--rates", "1gbit", "--prefix", prefix, "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert testbed.current(prefix) is None, "testbed left behind"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert [(c["scenario"], c["system"]) for c in doc["cells"]] == [
        ("clean", "gloo"), ("clean", "dgt"), ("tenant", "gloo"), ("tenant", "dgt"),
        ("lossy", "gloo"), ("lossy", "dgt"), ("lossy-link", "gloo"), ("lossy-link", "dgt")]
    for c in doc["cells"]:
        assert c["error"] is None
        assert 0 < c["goodput_frac"]
        # not under the tenant, whose own flows share the hosts' TCP counters
        assert (c.get("tcp_retrans_per_iteration") is None) == (c["scenario"] == "tenant")
    tenant = [c for c in doc["cells"] if c["scenario"] == "tenant"]
    assert all(len(c["tenant"]) == 2 for c in tenant)
    assert doc["cells"][1]["channels"]["udp1"]["bytes_sent"] > 0
    md = (out / "README.md").read_text()
    assert doc["command"] in md
    for name in ("comm_time.png", "time_to_accuracy.png"):
        assert (out / name).stat().st_size > 1000


@root_only
@requires_tool("nft")
@pytest.mark.slow
def test_bench_loss_sweep_on_testbed(tmp_path):
    """A real sweep, tiny: one testbed per loss rate (the router's rule is rebuilt),
    every cell runs, the table and plot are written, the testbed is removed."""
    from dgt.tc_profiles import testbed
    out = tmp_path / "sweep"
    prefix = f"dgtbs{os.getpid() % 10000}"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--workers", "2",
                        "--hidden", "32", "--iterations", "2", "--systems", "dgt",
                        "--scenarios", "clean,lossy-link", "--loss-pct", "2,10",
                        "--rates", "1gbit", "--prefix", prefix, "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert testbed.current(prefix) is None, "testbed left behind"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "testbed: 2 hosts at 1gbit, 2 % loss on every packet" in p.stdout
    assert "testbed: 2 hosts at 1gbit, 10 % loss on every packet" in p.stdout
    doc = json.loads((out / "results.json").read_text())
    assert [(c["scenario"], c["loss_pct"]) for c in doc["cells"]] == [
        ("clean", None), ("lossy-link", 2.0), ("lossy-link", 10.0)]
    assert all(c["error"] is None for c in doc["cells"])
    # the hosts' own TCP counters: 10 % loss on every packet retransmits (the start-up's
    # rendezvous, registration and PULL frames: ~100+ segments, so P(none lost) < 1e-4)
    assert doc["cells"][0]["tcp_retrans_per_iteration"] >= 0
    assert doc["cells"][2]["tcp_retrans_per_iteration"] > 0
    md = (out / "README.md").read_text()
    assert "Comm time against loss" in md and "| 1gbit | lossy-link | dgt --mode dgt |" in md
    assert (out / "loss_sweep.png").stat().st_size > 1000


def _goodput(*args, timeout=120):
    return subprocess.Popen([sys.executable, "-m", "dgt.tools.goodput", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_goodput_tool_moves_every_block_through_the_shard_path():
    port = str(_free_port())
    recv = _goodput("recv", "--port", port, "--mb", "6", "--pushes", "3")
    send = _goodput("send", "--port", port, "--mb", "6", "--pushes", "3")
    sout, serr = send.communicate(timeout=120)
    rout, rerr = recv.communicate(timeout=120)
    assert send.returncode == 0 and recv.returncode == 0, serr + rerr
    r = json.loads(rout)
    per_push = round(6e6 / 3 / 1408)
    assert r["bytes"] == 3 * per_push * 1408 and r["pushes"] == 3
    assert r["rejected"] == 0 and r["seconds"] > 0 and r["mbit_s"] > 0


def test_goodput_tool_bad_flags_and_no_receiver():
    p = subprocess.run([sys.executable, "-m", "dgt.tools.goodput", "send", "--mb", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "--mb must be > 0" in p.stderr
    p = subprocess.run([sys.executable, "-m", "dgt.tools.goodput", "send", "--port",
                        str(_free_port()), "--timeout-s", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "ConnectionRefusedError" in p.stderr


def test_goodput_receiver_survives_strangers_and_sender_fails_on_mismatch():
    """A stray connection (no HELLO, then garbage) is cut off and counted; the real
    transfer still completes. A sender whose --mb differs gets no confirmation and
    fails, and the receiver says what it saw."""
    import socket
    port = str(_free_port())
    recv = _goodput("recv", "--port", port, "--mb", "3", "--pushes", "2", "--timeout-s", "60")
    for _ in range(200):
        try:
            c = socket.create_connection(("127.0.0.1", int(port)))
            break
        except OSError:
            import time
            time.sleep(0.05)
    c.sendall(b"\x00" * 100_000)
    c.close()
    socket.create_connection(("127.0.0.1", int(port))).close()
    send = _goodput("send", "--port", port, "--mb", "3", "--pushes", "2")
    sout, serr = send.communicate(timeout=120)
    rout, rerr = recv.communicate(timeout=120)
    assert send.returncode == 0 and recv.returncode == 0, serr + rerr
    r = json.loads(rout)
    assert r["bytes"] == 2 * round(3e6 / 2 / 1408) * 1408 and r["rejected"] >= 1
    port = str(_free_port())
    recv = _goodput("recv", "--port", port, "--mb", "2", "--timeout-s", "8")
    send = _goodput("send", "--port", port, "--mb", "4", "--timeout-s", "8")
    sout, serr = send.communicate(timeout=120)
    rout, rerr = recv.communicate(timeout=120)
    assert send.returncode == 1 and "did not confirm" in serr and "Traceback" not in serr
    assert recv.returncode == 1 and "same --mb" in rerr and "Traceback" not in rerr


@pytest.mark.parametrize("args", [["recv", "--timeout-s", "nan"], ["send", "--mb", "inf"],
                                  ["send", "--mb", "nan"], ["recv", "--timeout-s", "0"],
                                  ["send", "--block-bytes", "1000000"],
                                  ["send", "--mb", "0.001"]])
def test_goodput_tool_rejects_bad_numbers_in_one_line(args):
    p = subprocess.run([sys.executable, "-m", "dgt.tools.goodput", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args, msg", [
    (["--estimate", "--mb", "nan"], "--mb must be a finite number"),
    (["--estimate", "--seconds", "-3"], "--seconds must be a finite number"),
    (["--estimate", "--iterations", "-1"], "--iterations must be >= 1"),
    (["--estimate", "--loopback"], "--loopback does not apply"),
    (["--estimate", "--workers", "3"], "drop --workers"),
    # breaker round 26: a traceback (IndexError), and flags the matrix checks taken
    (["--estimate", "--rates", ","], "--rates names no rate; give one port rate"),
    (["--estimate", "--out", ""], "--out is empty: give the results folder"),
    (["--estimate", "--profile", "zzz"], "--profile: unknown profile 'zzz'"),
    (["--estimate", "--seconds", "1e30"], "--seconds must be at most 3600 (iperf3's run)")])
def test_bench_goodput_checks_flags_before_building_anything(args, msg):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "goodput", "--prefix",
                        "dgtbgpx", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "dgtbgpx" not in subprocess.run(["ip", "netns"], capture_output=True,
                                           text=True).stdout


@pytest.mark.parametrize("argv", [
    ["-m", "dgt.cli", "bench", "--prefix", "{p}", "--loopback"],
    ["-m", "dgt.cli", "bench", "--prefix", "{p}", "--estimate"],
    ["-m", "dgt.cli", "bench", "goodput", "--prefix", "{p}", "--estimate"],
    ["-m", "dgt.tools.gloo_train", "--testbed", "--testbed-prefix", "{p}"]],
    ids=["bench-loopback", "bench-estimate", "goodput", "gloo_train"])
@pytest.mark.parametrize("prefix", ["fixtest/r", "fixtest" + "a" * 236])
def test_testbed_prefix_flags_follow_the_testbed_rule(tmp_path, argv, prefix):
    """Every other CLI that takes a testbed prefix applies the testbed's rule up front:
    one line saying what is allowed, nothing created in the current folder."""
    flag = "--testbed-prefix" if "gloo_train" in argv[1] else "--prefix"
    p = subprocess.run([sys.executable, *[a.format(p=prefix) for a in argv]],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert f"error: bad {flag} '{prefix[:24]}'" in p.stderr, p.stderr
    assert "letters, digits, '-' or '_'" in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_goodput_estimate_runs_nothing():
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "goodput", "--estimate",
                        "--prefix", "dgtbgpy"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "estimate:" in p.stdout
    assert "dgt reliable channel" not in p.stdout   # nothing was measured
    assert "dgtbgpy" not in subprocess.run(["ip", "netns"], capture_output=True,
                                           text=True).stdout


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@root_only
@requires_tool("iperf3")
def test_bench_goodput_on_testbed(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "goodput", "--mb", "20",
                        "--seconds", "1", "--iterations", "2", "--hidden", "200",
                        "--prefix", "dgtbgp", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((tmp_path / "goodput.json").read_text())
    assert r["dgt_reliable"]["rejected"] == 0
    assert r["dgt_reliable"]["bytes"] == round(20e6 / 8 / 1408) * 8 * 1408
    assert r["iperf3_mbit"] > 0 and r["dgt_mbit"] > 0
    assert r["ratio"] == pytest.approx(r["dgt_mbit"] / r["iperf3_mbit"])
    assert len(r["train_comm_s"]) == 2
    assert "dgtbgp" not in subprocess.run(["ip", "netns"], capture_output=True,
                                          text=True).stdout


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_to_bench_stops_every_child(tmp_path):
    """SIGTERM to 'dgt bench --loopback' while a cell trains: the bench exits 143 (128 + SIGTERM) and
    no process it started (the cell's job, its sidecars and trainers) is left."""
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "bench", "--loopback",
                          "--workers", "2", "--hidden", "32", "--iterations", "100000",
                          "--epochs", "1000", "--out", str(tmp_path / "bench")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    t_end = time.monotonic() + 180
    try:
        while len(seen) < 3:   # the cell's launcher and at least two of its children
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < t_end, "the bench never started a cell"
            seen |= _descendants(p.pid)
            time.sleep(0.2)
        time.sleep(1.0)
        seen |= _descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out + err
    t_end = time.monotonic() + 10   # PR_SET_PDEATHSIG stragglers: bounded wait
    while [x for x in seen if _alive(x)] and time.monotonic() < t_end:
        time.sleep(0.1)
    assert not [x for x in seen if _alive(x)], (seen, err)
