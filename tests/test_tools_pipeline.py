"""dgt.tools.bench_pipeline: its row arithmetic, its one-line errors, and one real pair
on loopback (figures only; timing is never asserted)."""
import json
import subprocess
import sys

import pytest

from dgt.tools import bench_pipeline


def run_row(way, period, tail, sha="s", lost=0):
    return {"way": way, "period_ms": period, "tail_ms": tail, "param_sha256": sha,
            "lost": lost}


def test_pairs_give_ratios_in_either_order():
    runs = [run_row("pipelined", 90.0, 30.0), run_row("whole", 100.0, 40.0),
            run_row("whole", 120.0, 60.0, "t", lost=3), run_row("pipelined", 60.0, 15.0)]
    rows = bench_pipeline.pair_rows(runs)
    assert [r["pair"] for r in rows] == [1, 2]
    assert rows[0]["period_ratio"] == 0.9 and rows[0]["tail_ratio"] == 0.75
    assert rows[1]["period_ratio"] == 0.5 and rows[1]["tail_ratio"] == 0.25
    assert rows[0]["same_bits"] and not rows[1]["same_bits"]
    assert rows[0]["comparable"] and not rows[1]["comparable"]


def test_figures_take_medians_from_the_second_iteration_on():
    trainer = {"iterations": 4, "steps_per_iteration": 2.0,
               "comm_at": [(0.0, 0.5), (1.0, 1.02), (1.1, 1.13), (1.3, 1.32)],
               "stepped_at": [0.6, 1.05, 1.14, 1.36]}
    report = {"param_sha256": ["abc"], "replicas_identical": True,
              "channels": {"tcp": {"blocks_lost": 0}, "udp1": {"blocks_lost": 2,
                                                                "blocks_late": 1}}}
    f = bench_pipeline.figures("pipelined", trainer, report, 0.5)
    assert f["period_ms"] == pytest.approx(150.0)       # 100 and 200 ms: the first skipped
    assert f["tail_ms"] == pytest.approx(50.0)          # 50, 40, 60 ms
    assert f["param_sha256"] == "abc" and f["steps_per_iteration"] == 2.0
    assert f["lost"] == 3


@pytest.mark.parametrize("args, says", [
    (["--pairs", "0"], "--pairs must be at least 1"),
    (["--", "--no-pipeline-pulls"], "leave --pipeline-pulls"),
    (["--pairs", "x"], "expected a whole number such as 42, got 'x'")])
def test_bad_flags_are_one_line(args, says):
    p = subprocess.run([sys.executable, "-m", "dgt.tools.bench_pipeline", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_one_pair_on_loopback_ends_at_the_same_bits(tmp_path):
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "dgt.tools.bench_pipeline", "--pairs", "1",
                        "--json", str(out), "--", "--iterations", "8", "--hidden", "128"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["same_bits"] or not row["comparable"]
    assert row["pipelined"]["steps_per_iteration"] >= 2.0
    assert row["whole"]["steps_per_iteration"] == 1.0
    assert row["period_ratio"] > 0 and row["tail_ratio"] > 0
    assert "| 1 |" in p.stdout and "median ratio" in p.stdout
