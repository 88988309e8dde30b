"""python -m dgt.tools.bench_startup: three short loopback jobs side by side (dgt, dgt
with numpy's huge-page advice, gloo), every figure taken from the jobs' own reports,
and bad input one line. No timing is asserted (that is the tool's output)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def tool(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dgt.tools.bench_startup", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_one_round_gives_every_system_from_its_report(tmp_path):
    out = tmp_path / "s.json"
    p = tool("--rounds", "1", "--workers", "2", "--hidden", "32", "--json", out)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert list(r["systems"]) == ["dgt", "dgt, numpy huge-page advice", "gloo all_reduce"]
    for name, s in r["systems"].items():
        run, = s["runs"]
        assert run["replicas_identical"], name
        # register_s is the slowest rank's, the times rank 0's (each on its own clock)
        assert run["register_s"] > 0 and 0 < run["to_iteration_2_s"] < run["to_iteration_4_s"]
        assert run["first_push_pull_ms"] > 0
        assert s["median"]["register_s"] == run["register_s"]
        assert f"| {name} |" in p.stdout


def test_bad_input_is_one_line():
    for args, says in ((["--rounds", "0"], "--rounds >= 1"),
                       (["--workers", "1"], "--workers >= 2"),
                       (["--json", "/nonexistent/dir/x.json"],
                        "cannot write /nonexistent/dir/x.json (--json)"),
                       (["--bogus"], "unrecognized arguments: --bogus")):
        p = tool(*args)
        assert p.returncode == 2, (args, p.stdout)
        assert "Traceback" not in p.stderr and says in p.stderr, (args, p.stderr)
