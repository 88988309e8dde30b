"""'dgt bench tta' (time to accuracy) and its DDP baselines: real processes, tiny models,
a few iterations; no timing is asserted."""
import json
import os
import subprocess
import sys
import uuid

import pytest
from conftest import needs

root_only = needs("ip", root="netns, veth, tc")


@pytest.mark.parametrize("args, says", [
    (["--systems", "nccl"], "unknown system 'nccl'"),
    (["--systems", "dgt:--no-such-flag"], "no transmission flag '--no-such-flag'"),
    (["--systems", "gloo:--band-codec=int8"], "only tcp, dgt and dgt-ddp take"),
    (["--systems", "dgt:--mode=tcp"], "the base name sets --mode"),
    (["--models", "alexnet:wide"], "MODEL:WIDTH"),
    (["--models", "bert"], "unknown model 'bert'"),
    (["--scenarios", "lossy"], "tta runs clean,tenant,share"),
    (["--share", "1.5"], "--share must be in"),
    (["--comm-ratio", "0"], "--comm-ratio must be"),
    (["--comm-ratio", "1e30"], "--comm-ratio must be in (0, 100]"),   # breaker round 26
    (["--ddp-bucket-cap-mb", "0"], "--ddp-bucket-cap-mb must be"),
    (["--iterations", "5"], "use --max-iterations"),
    (["--rates", "fast"], "--rates"),
    (["--tcp-congestion", "vegas2"], "--tcp-congestion: 'vegas2' is not available"),
    (["--seed", "-1"], "--seed must be in 0..4294967295 (each cell's dgt train --seed)"),
    # breaker: a variant's flag names were checked, not its values: the cell failed
    # minutes in. dgt train's own validation (dgt.config.from_args), the system named
    (["--systems", "dgt:--k 5"], "--systems 'dgt:--k 5': --k must be in [0, 1], got 5.0"),
    (["--systems", "tcp,dgt-ddp:--block-bytes=3"], "--systems 'dgt-ddp:--block-bytes=3': "
                                                   "--block-bytes must be a multiple of 4"),
    (["--systems", "dgt:--k abc"],
     "--systems 'dgt:--k abc': argument --k: expected a number such as 0.5 or 1e-3, got 'abc'"),
    # valid under some peer timeout, not the 20 s its cells get
    (["--systems", "dgt:--deadline-ms 15000"],
     "--systems 'dgt:--deadline-ms 15000': --deadline-ms must be in 0..10000 (half of "
     "--peer-timeout-s 20 s"),
])
def test_tta_bad_flags_are_one_line(args, says, tmp_path):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "tta", "--estimate",
                        "--out", str(tmp_path), *args], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("variant, says", [
    ("dgt:--k 5", "--k must be in [0, 1], got 5.0"),
    ("dgt:--deadline-ms 15000", "--deadline-ms must be in 0..10000"),
])
def test_a_bad_variant_value_stops_the_run_before_any_cell(variant, says, tmp_path):
    """Not --estimate: the run itself refuses the variant before its first cell (no
    cell ran, nothing written), one line, exit 2."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "tta", "--loopback",
                        "--models", "mlp:64", "--max-iterations", "2", "--systems",
                        f"gloo,{variant}", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and f"--systems {variant!r}: {says}" in p.stderr, \
        p.stderr
    assert "[1/" not in p.stdout and list(tmp_path.iterdir()) == [], p.stdout


@pytest.mark.parametrize("args", [
    ["--share", "0.3"], ["--share", "0.5"], ["--models", "mlp:64"],
    ["--batch-size", "32"], ["--max-iterations", "400"], ["--calibrate"],
    ["goodput", "--eval-samples", "1000"], ["goodput", "--ddp-bucket-cap-mb", "1"]])
def test_tta_flags_outside_tta_are_refused(tmp_path, args):
    """Each tta flag is refused by the matrix and goodput benches, at its default value
    too (stop 47's leftover: '--share 0.5' to the matrix was taken in silence)."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate", *args,
                        "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    flag = next(a for a in args if a.startswith("--"))
    assert p.returncode == 2 and p.stderr.strip() == \
        f"dgt bench: error: {flag} applies to 'dgt bench tta' only (see 'dgt bench " \
        "--help')", p.stderr


def test_tta_takes_the_prefix_given_even_at_the_matrixs_default():
    """tta's own namespaces' prefix (dgttta) unless --prefix is given, whatever its
    value: before, '--prefix dgtbench' was taken for not given."""
    from dgt.cli import build_parser
    from dgt.tools import bench_tta
    parse = build_parser().parse_args
    cfg = bench_tta.config_from_args(parse(["bench", "tta"]))
    assert cfg.prefix == bench_tta.TtaConfig.prefix == "dgttta"
    cfg = bench_tta.config_from_args(parse(["bench", "tta", "--prefix", "dgtbench"]))
    assert cfg.prefix == "dgtbench"
    a = parse(["bench", "tta", "--share", "0.5"])
    cfg = bench_tta.config_from_args(a)
    assert cfg.share == 0.5 and cfg.batch_size == bench_tta.TtaConfig.batch_size
    assert a.given == {"share"}


def test_calibrated_rate_gives_the_asked_ratio():
    """The calibrated rate makes the ring all-reduce take comm_ratio x compute; each
    workload gets its own rate in the plan."""
    from dgt.tools import bench_tta
    from dgt.tools.bench import rate_bits_per_s
    cal = {"mlp:64": dict(ring_wire_bytes=1e6, compute_ms_median=40.0)}
    rate = bench_tta.calibrated_rate(cal["mlp:64"], 2.0)
    assert rate_bits_per_s(rate) == pytest.approx(8e6 / 0.080, rel=1e-3)
    cfg = bench_tta.TtaConfig(workloads=bench_tta.parse_workloads("mlp:64"),
                              systems=bench_tta.parse_systems("gloo,dgt"),
                              rates=("calibrated", "1gbit"), comm_ratio=2.0)
    cells = bench_tta.plan(cfg, cal)
    assert [c["rate"] for c in cells] == [rate] * 6 + ["1gbit"] * 6
    assert [c["scenario"] for c in cells[:6]] == ["clean"] * 2 + ["tenant"] * 2 + ["share"] * 2


def test_tta_estimate_lists_every_cell(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "tta", "--estimate",
                        "--models", "mlp:64,alexnet:0.125", "--systems",
                        "gloo,dgt,dgt:--band-codec=int8", "--rates", "1gbit",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(" at most\n") == 2 * 3 * 3   # models x systems x scenarios
    assert "estimate: at most" in p.stdout


def test_tta_loopback_cell_end_to_end(tmp_path):
    """mlp on digits, 2 workers, a target reached in a few iterations: tta.json and
    tta.md carry every required field, replicas identical."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "tta", "--loopback",
                        "--models", "mlp:64", "--systems", "gloo,dgt", "--workers", "2",
                        "--target-accuracy", "0.3", "--eval-every", "2",
                        "--eval-samples", "200", "--max-iterations", "30", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "tta.json").read_text())
    assert [c["system"] for c in doc["cells"]] == ["gloo", "dgt"]
    assert doc["host"]["load_before"] and doc["command"].startswith("dgt bench tta")
    for c in doc["cells"]:
        assert c["error"] is None, c["error"]
        assert c["replicas_identical"] and len(set(c["param_sha256"])) == 1
        assert len(c["param_sha256"]) == 2
        assert c["time_to_target_s"] is not None and c["iterations_to_target"] <= 30
        # the evaluations' own time is recorded and taken out of the second figure
        evals = [h["eval_seconds"] for h in c["history"]]
        assert evals == sorted(evals) and evals[-1] > 0
        assert c["train_time_to_target_s"] == pytest.approx(
            c["time_to_target_s"] - c["target_reached"]["eval_seconds"])
        assert 0 < c["train_time_to_target_s"] < c["time_to_target_s"]
        assert c["iterations"] == c["iterations_to_target"]   # stopped at the target
        assert c["final_test_accuracy"] >= 0.3
        assert c["push_bytes_per_iteration"] > 0 and c["pull_bytes_per_iteration"] > 0
        if c["system"] == "dgt":   # counted by the sidecars: one PULL per remote worker
            assert "PULL frames" in c["bytes_source"]
            # half the gradient per node (f32 over loopback); at least (0.5 + 0.5 / 4) x
            # 0.5 = 0.31 of the fp32 gradient's bytes even with int8 PULLs
            assert c["pull_bytes_per_iteration"] > 0.3 * c["gradient_bytes"]
        assert c["compute_ms_median"] > 0 and c["comm_ms_median"] > 0
        # CPU per iteration: trainers' and (dgt) sidecars', the job's over the cores
        u = c["cpu"]
        assert u["trainer_ms"] > 0 and u["iteration_ms"] > 0
        if c["system"] == "dgt":
            assert u["sidecar_ms"] > 0 and 0 <= u["sidecar_sys_ms"] <= u["sidecar_ms"]
        else:   # gloo's all-reduce runs in the trainer: no sidecar
            assert u["sidecar_ms"] is None
        assert u["job_ms"] == pytest.approx(2 * (u["trainer_ms"] + (u["sidecar_ms"] or 0)))
        assert u["floor_ms"] == pytest.approx(u["job_ms"] / u["cores"])
        assert c["history"] and c["history"][-1]["test_accuracy"] >= 0.3
        assert "RUN_DIR" in c["command"]
    md = (out / "tta.md").read_text()
    assert doc["command"] in md and "training-time reduction" in md
    assert "evaluation time excluded" in md
    assert "| loopback | loopback | mlp:64 | dgt |" in md
    cpu_rows = [ln for ln in md.split("CPU per iteration, ms", 1)[1].split("\n\n")[1]
                .splitlines() if ln.startswith("| loopback | loopback | mlp:64 |")]
    assert len(cpu_rows) == 2 and "| gloo" in cpu_rows[0] and " | – | " in cpu_rows[0]
    assert (out / "tta_accuracy.png").stat().st_size > 0


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_ddp_hook_baselines_keep_replicas_identical(hook, tmp_path):
    """gloo + fp16_compress_hook and gloo + powerSGD_hook (one bucket) run and end
    with identical replicas; fp16 all-reduces 2 bytes per parameter, PowerSGD fewer
    bytes once it compresses (iteration 10 on)."""
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "dgt.tools.gloo_train", "--workers", "2",
                        "--iterations", "12" if hook == "powersgd" else "2",
                        "--hidden", "32", "--ddp-hook", hook, "--report",
                        str(tmp_path / "r.json"), "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["replicas_identical"] and r["mode"] == f"gloo-ddp-{hook}"
    sent = json.loads((run / "trainer-0.json").read_text())["allreduced_bytes"]
    n = r["n_params"]
    if hook == "fp16":
        assert sent == [2 * n, 2 * n]
        assert r["push_bytes_per_iteration"] == n   # (N-1)/N of 2n bytes, N = 2
    else:
        assert sent[:10] == [4 * n] * 10 and all(0 < b < 4 * n for b in sent[10:])


def test_dgt_hook_in_ddp_applies_what_ddps_all_reduce_applies(tmp_path):
    """gloo_train --ddp-hook dgt: DDP hands its buckets (here several: 1 kB each) to
    dgt_hook, one sidecar per rank pushes them during backward and PULLs the mean. With
    two workers and --mode tcp that mean is bitwise DDP's own all-reduce's ((a + b) / 2),
    so both runs end with the same parameters; each rank's sidecar took every push."""
    def run(name, *hook):
        p = subprocess.run([sys.executable, "-m", "dgt.tools.gloo_train", "--workers", "2",
                            "--iterations", "3", "--hidden", "32", *hook, "--report",
                            str(tmp_path / f"{name}.json"), "--run-dir",
                            str(tmp_path / name)], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        return json.loads((tmp_path / f"{name}.json").read_text())
    ddp = run("ddp", "--ddp-hook", "none")
    dgt = run("dgt", "--ddp-hook", "dgt", "--bucket-cap-mb", "0.001",
              "--sidecar-args", "--mode tcp --peer-timeout-s 20")
    assert dgt["mode"] == "gloo-ddp-dgt" and dgt["replicas_identical"]
    assert dgt["param_sha256"] == ddp["param_sha256"]
    assert "tx bytes" in dgt["bytes_source"]
    for r in range(2):
        side = json.loads((tmp_path / "dgt" / f"sidecar-{r}.json").read_text())
        assert side["pushes"] == 3 and side["config"]["mode"] == "tcp"
        assert side["failed"] is None


def test_dgt_ddp_cells_run_the_hook_with_dgt_flags(tmp_path):
    """A dgt-ddp cell is gloo_train with dgt's hook, several buckets, and the sidecars
    given what a dgt cell gives dgt train: --mode dgt, the peer timeout, the pace and
    the variant's flags."""
    from dgt.child_argv import module_argv
    from dgt.tools import bench_tta
    cfg = bench_tta.TtaConfig(workloads=bench_tta.parse_workloads("vgg11:0.25"),
                              systems=bench_tta.parse_systems("dgt-ddp:--k=0.3,dgt"))
    w = cfg.workloads[0]
    argv = {s.base: bench_tta.cell_argv(cfg, dict(system=s, workload=w, rate="1gbit"),
                                        "r.json", "RUN") for s in cfg.systems}
    hook = argv["dgt-ddp"]
    assert hook[:4] == module_argv("dgt.tools.gloo_train")
    assert hook[hook.index("--ddp-hook") + 1] == "dgt"
    assert float(hook[hook.index("--bucket-cap-mb") + 1]) < 4 * w.n_params() / 2 ** 20
    sidecar = hook[hook.index("--sidecar-args") + 1].split()
    plain = argv["dgt"]
    assert sidecar[:2] == ["--mode", "dgt"] and sidecar[-1] == "--k=0.3"
    for flag in ("--peer-timeout-s", "--pace-mbit"):
        assert sidecar[sidecar.index(flag) + 1] == plain[plain.index(flag) + 1]


@root_only
def test_share_scenario_installs_its_htb_classes(tmp_path):
    """The share profile on a real testbed: every job band's ceil is share x the port,
    the tenant band (DSCP 24) is guaranteed the rest; all removed by down()."""
    from dgt.tc_profiles import applier, testbed
    from dgt.tools import bench_tta
    prefix = "tta" + uuid.uuid4().hex[:5]
    prof = bench_tta.share_profile("htb-prio", 0.25, str(tmp_path / "share.yaml"))
    try:
        tb = testbed.up(2, rate="100mbit", profile=prof, prefix=prefix)
        for ns, dev in tb.ports():
            st = applier.show(dev, ns)
            classes = [c for c in st["classes"] if c["parent"] != "root"]   # the bands
            tenant = [c for c in classes if bench_tta.TENANT_DSCP in (c.get("dscp") or [])]
            assert len(tenant) == 1
            assert tenant[0]["rate_bit"] == pytest.approx(75e6, rel=0.01)
            assert tenant[0]["ceil_bit"] == pytest.approx(100e6, rel=0.01)
            job = [c for c in classes if c is not tenant[0]]
            assert len(job) == 9   # htb-prio's bands
            for c in job:
                assert c["ceil_bit"] == pytest.approx(25e6, rel=0.01), c
            assert any(46 in (c.get("dscp") or []) for c in job)
    finally:
        testbed.down(prefix)
    assert testbed.current(prefix) is None
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in names


def test_a_workload_passes_only_the_size_flag_its_model_uses():
    """--hidden with a CNN is ignored and warned about (round 9): a cell's command must
    not carry it, nor --width for the MLP."""
    from dgt.config import JobConfig
    from dgt.tools.bench_tta import parse_workloads
    mlp, vgg = parse_workloads("mlp:64,vgg11:0.25")
    assert mlp.argv() == ["--model", "mlp", "--hidden", "64", "--dataset", "digits"]
    assert vgg.argv() == ["--model", "vgg11", "--width", "0.25", "--dataset",
                          "fashion-mnist"]
    for w in (mlp, vgg):   # the job those flags make
        argv = w.argv()
        given = {argv[i][2:]: argv[i + 1] for i in range(0, len(argv), 2)}
        job = JobConfig(model=given["model"], dataset=given["dataset"],
                        **({"hidden": int(given["hidden"])} if "hidden" in given else {}),
                        **({"width": float(given["width"])} if "width" in given else {}))
        assert [x for x in job.warnings() if "is ignored" in x] == [], job.warnings()


def test_system_variants_pass_dgt_train_flags_through():
    """dgt:FLAGS keeps its flags as given, a comma inside a flag's value included."""
    from dgt.tools.bench_tta import parse_systems
    s = parse_systems("gloo,dgt:--band-codec=2:bf16,3:int8,tcp,dgt:--band-codec=int8 --k=0.3")
    assert [(x.base, x.flags) for x in s] == [
        ("gloo", ()), ("dgt", ("--band-codec=2:bf16,3:int8",)), ("tcp", ()),
        ("dgt", ("--band-codec=int8", "--k=0.3"))]


def test_the_plot_of_cells_that_all_failed_so_far_warns_nothing(tmp_path):
    # stop 27: the plot written after a first cell cut short by the time cap had no
    # curve, and matplotlib warned "No artists with labels found" into the bench's output
    import warnings

    from dgt.tools.bench_tta import plot_accuracy
    doc = {"config": {"target_accuracy": 0.8},
           "cells": [{"rate": "8981kbit", "scenario": "tenant", "workload": "googlenet:0.125",
                      "system": "gloo", "base": "gloo", "label": "gloo all_reduce",
                      "error": "timed out: time cap", "history": []}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_accuracy(doc, str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").stat().st_size > 0


def test_no_two_curves_of_a_panel_share_a_colour():
    """stop 31: a variant's curve took matplotlib's next colour, tcp's orange
    (docs/bench/tta_googlenet_reliable_accuracy.png before it was redrawn)."""
    import json
    from pathlib import Path

    from dgt.tools.bench_tta import curve_colors
    doc = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench" /
                      "tta_googlenet_reliable.json").read_text())
    cells = doc["cells"]
    assert len(cells) == 5 and sum(c["system"] != c["base"] for c in cells) == 3
    colors = curve_colors(cells)
    assert None not in colors and len(set(colors)) == len(cells), colors


def test_a_cells_queue_drops_are_the_difference_and_get_their_own_table():
    from dgt.tools.bench_tta import markdown, queue_drops_since
    before = {"host": {"46": 5, "0": 0}, "router": {"46": 0, "24": 7}}
    after = {"host": {"46": 5, "0": 3}, "router": {"46": 1200, "24": 7}}
    d = queue_drops_since(before, after)
    assert d == {"host": {"0": 3}, "router": {"46": 1200}}
    doc = {"command": "dgt bench tta", "date": "2026-12-03T00:00:00+00:00",
           "host": {"cpus": 2, "kernel": "k", "load_before": [0, 0, 0]},
           "config": {"target_accuracy": 0.8, "workers": 4, "batch_size": 32,
                      "eval_samples": 1000, "eval_every": 50, "max_iterations": 400,
                      "scenarios": ["share"], "share": 0.5},
           "cells": [{"rate": "8981kbit", "scenario": "share", "workload": "googlenet:0.125",
                      "system": "tcp", "base": "tcp", "label": "dgt --mode tcp",
                      "error": "exit status 1", "queue_drops": d, "command": "x",
                      "history": []}]}
    md = markdown(doc)
    assert ("| 8981kbit | share | googlenet:0.125 | dgt --mode tcp | DSCP 0: 3 "
            "| DSCP 46: 1,200 |") in md


@pytest.mark.parametrize("args, says", [
    (["tta", "--scenarios", "clean", "--share", "0.3"], "--share applies to the share "
                                                        "scenario only"),
    (["tta", "--loopback", "--share", "0.5"], "--share applies to the share scenario only"),
    (["tta", "--loopback", "--comm-ratio", "1"], "--comm-ratio applies to the calibrated "
                                                 "rate only"),
    (["tta", "--rates", "1gbit", "--comm-ratio", "2"], "--comm-ratio applies to the "
                                                       "calibrated rate only"),
    (["tta", "--calibrate", "--share", "0.5"], "--share does not apply with --calibrate"),
    (["tta", "--calibrate", "--max-iterations", "400"], "--max-iterations does not apply "
                                                        "with --calibrate"),
    (["--scenarios", "clean", "--loss-pct", "1"], "--loss-pct applies to the lossy "
                                                  "scenarios only"),
])
def test_a_flag_this_combination_leaves_unread_is_refused(tmp_path, args, says):
    """Breaker round 11 (re-check): each was taken in silence, the flag doing nothing
    with the others given."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate", *args,
                        "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and says in p.stderr, (p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_calibrate_with_estimate_runs_nothing(tmp_path):
    """Breaker round 11 (re-check): 'tta --calibrate --estimate' ran the calibration's
    training jobs, where --estimate promises to run nothing. It now prints the jobs it
    would run and their bound, and exits 0 with nothing written."""
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "tta", "--calibrate",
                        "--estimate", "--models", "mlp:64,alexnet:0.25", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["calibrate mlp", "calibrate alexnet"]
    assert lines[-1].startswith("estimate: at most ") and "2 calibration jobs" in lines[-1]
    assert not out.exists()
    for args in (["--share", "0.3", "--scenarios", "share"], ["--comm-ratio", "2"],
                 ["--scenarios", "lossy", "--loss-pct", "3"]):   # read: still taken
        cmd = ["tta", *args] if "--share" in args or "--comm-ratio" in args else args
        p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "--estimate", *cmd,
                            "--out", str(out)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (cmd, p.stderr)


def test_the_help_states_each_bench_s_own_cell_time_cap():
    """Breaker round 14: 'dgt bench tta --help' gave the matrix's cap (4x, >= 120 s)
    where tta caps at 2x its estimate, >= 180 s (tools/bench_tta.py, docs/tools.md)."""
    from dgt.tools.bench import CELL_TIMEOUT, cell_timeout_s
    assert CELL_TIMEOUT == {"matrix": (4.0, 120.0), "tta": (2.0, 180.0)}
    assert cell_timeout_s(10.0, *CELL_TIMEOUT["tta"]) == 180.0
    assert cell_timeout_s(100.0, *CELL_TIMEOUT["tta"]) == 200.0
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "bench", "tta", "--help"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0, p.stderr
    assert "matrix 4x, >= 120 s; tta 2x, >= 180 s" in p.stdout, p.stdout
