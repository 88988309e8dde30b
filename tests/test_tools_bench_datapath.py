"""python -m dgt.tools.bench_datapath: the sidecars' data path in one process, every
system's replicas identical, today's code against a git revision's, and bad input one
line. No timing is asserted (that is the tool's output, not a test)."""
import json
import subprocess
import sys

from conftest import requires_tool
from dgt.tools import bench_datapath

SMALL = ["--model", "mlp:24", "--workers", "3", "--iterations", "2", "--warmup", "1"]


def tool(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dgt.tools.bench_datapath", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_every_system_pushes_to_identical_replicas_with_the_real_wire_bytes():
    """A coded band and a coded PULL go through the session and the PULL decoder (not
    around them): the replicas come out identical, and a CPU time is measured."""
    n = bench_datapath._params("mlp:24")
    for flags in ("--mode tcp", "--mode dgt --band-codec int8 --pull-codec int8",
                  "--mode dgt --band-codec int4 --pull-codec fp16 --k 0.3"):
        r = bench_datapath.measure(flags, n, 3, iterations=3, warmup=1)
        assert r["replicas_identical"], flags
        assert r["cpu_ms_per_push"] > 0 and r["first_push_cpu_ms"] > 0


@requires_tool("git", "bench_datapath --against (a git worktree of the revision)")
def test_against_a_revision_gives_a_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    p = tool(*SMALL, "--rounds", "1", "--systems", "tcp;dgt", "--against", "HEAD",
             "--json", out)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert [s["flags"] for s in r["systems"]] == ["--mode tcp", "--mode dgt"]
    for s in r["systems"]:
        assert s["replicas_identical"] and s["ratio"] > 0
        assert len(s["cpu_ms_per_push"]) == len(s["against_cpu_ms_per_push"]) == 1
        assert len(s["first_push_cpu_ms"]) == 1 and s["first_push_median"] > 0
        assert len(s["against_first_push_cpu_ms"]) == 1 and s["against_first_push_median"] > 0
    assert "| `--mode dgt` |" in p.stdout and "today / HEAD" in p.stdout
    # the temporary worktree is gone again
    trees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True)
    assert "dgt-against-" not in trees.stdout


def test_bad_input_is_one_line():
    for args, says in ((["--workers", "1"], "--workers >= 2"),
                       (["--model", "nosuchnet"], "--model nosuchnet"),
                       ([*SMALL, "--rounds", "1", "--systems", "dgt --k 7"], "error"),
                       ([*SMALL, "--against", "no-such-revision"], "no-such-revision"),
                       ([*SMALL, "--systems", ";;"], "--systems names no system"),
                       # breaker round, stop 25: named bench tta's --models; a doubled
                       # prefix
                       (["--model", "mlp:abc"], "--model mlp:abc: 'mlp:abc': give"),
                       ([*SMALL, "--rounds", "1", "--systems", "bogus"],
                        "'--mode bogus': argument --mode: invalid choice"),
                       ([*SMALL, "--json", "/nonexistent/dir/x.json"],
                        "cannot write /nonexistent/dir/x.json (--json)"),
                       ([*SMALL, "--json", "/tmp"], "cannot write /tmp (--json)")):
        p = tool(*args)
        assert p.returncode == 2, (args, p.stdout)
        assert "Traceback" not in p.stderr and says in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 or "usage:" in p.stderr
