"""python -m dgt.tools.pull_lag on a real 3-worker run: every PULL counted once, a PULL
made 200 ms late found in its iteration, damaged traces and a missing run dir are one
line, never a traceback."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import run_train
from dgt.tools import pull_lag

WORKERS, ITERATIONS = 3, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lag")
    run_train(tmp, "--workers", WORKERS, "--hidden", 32, "--iterations", ITERATIONS)
    return tmp / "run"


def edited(run, tmp_path, rank, edit):
    """A copy of ``run`` in ``tmp_path`` whose rank ``rank`` trace has ``edit(x)`` applied
    to each iteration record ``x``."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    trace = out / f"trace-{rank}.jsonl"
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    for x in lines:
        if x.get("kind") == "iteration":
            edit(x)
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return out


def tool(*args):
    return subprocess.run([sys.executable, "-m", "dgt.tools.pull_lag", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_every_remote_pull_is_counted_once(run):
    r = json.loads(tool(run, "--json").stdout)
    assert r["iterations"] == ITERATIONS
    # each shard's PULL to each of the other workers
    assert r["pulls"] == ITERATIONS * WORKERS * (WORKERS - 1)
    assert sum(r["histogram"].values()) == r["pulls"]


def test_a_pull_made_200_ms_late_is_found_in_its_iteration(run, tmp_path):
    def later(x):
        if x["t"] == 5:
            x["pull_s"]["0"] += 0.2   # shard 0's PULL reached rank 2 200 ms late
    late = edited(run, tmp_path, 2, later)
    before = pull_lag.lags(pull_lag.load(str(run)))
    after = pull_lag.lags(pull_lag.load(str(late)))
    assert 5 not in before["stalled"] and after["stalled"] == sorted(before["stalled"] + [5])
    assert after["pulls"] == before["pulls"]
    assert sum(n for b, n in after["histogram"].items() if 175 <= b <= 225) >= 1


def test_damaged_traces_and_a_missing_run_dir_are_one_line(run, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    with open(bad / "trace-0.jsonl", "ab") as f:
        f.write(b'[]\n{"kind":"iteration","t":"abc","rank":0,"pull_s":{}}\n'
                b'{"kind":"iteration","t":99,"rank":0,"pull_s":{"1":"x"}}\n\x00\xff\xfe')
    p = tool(bad)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert f"of {ITERATIONS}" in p.stdout
    p = tool(tmp_path / "nothing")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "no trace-<rank>.jsonl" in p.stderr and "Traceback" not in p.stderr


def test_a_trace_that_is_a_fifo_is_one_line_not_a_hang(run, tmp_path):
    """Third breaker round (stop 42): the readers of a run dir waited for ever on a FIFO
    put in a trace's place; pull_lag read its traces with a plain open()."""
    import os
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    (bad / "trace-1.jsonl").unlink()
    os.mkfifo(bad / "trace-1.jsonl")
    p = tool(bad)   # on the old code: the 60 s timeout of tool()
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "trace-1.jsonl: a FIFO, not a regular file" in p.stderr, p.stderr


def test_phases_split_push_skew_from_the_network(run, tmp_path):
    """A worker that pushed 300 ms after the others shows in the push skew, a PULL that
    landed 200 ms late in the network phase; the text output names both."""
    before = pull_lag.phases(pull_lag.load(str(run)))
    assert before["push_skew_ms"]["median"] is not None
    assert before["after_last_end_ms"]["median"] is not None
    def move(x):
        if x["t"] == 4:
            x["push_start_s"] += 0.3   # rank 1 began pushing 300 ms later
        if x["t"] == 6:
            x["pull_s"]["0"] += 0.2    # shard 0's PULL reached rank 1 200 ms later
    moved = edited(run, tmp_path, 1, move)
    after = pull_lag.phases(pull_lag.load(str(moved)))
    # iteration 4's skew as it must now be: rank 1's start 300 ms on
    starts = {r: x["push_start_s"] for r, x in pull_lag.load(str(run))[4].items()}
    starts[1] += 0.3
    want = 1000.0 * (max(starts.values()) - min(starts.values()))
    assert after["push_skew_ms"]["max"] >= want - 0.1
    # that PULL's own network phase, which may be just below zero (shard 0's last block
    # can come before another shard's last END), grows by exactly the 200 ms
    rs = pull_lag.load(str(run))[6]
    was = 1000.0 * (rs[1]["pull_s"]["0"] - max(x["end_s"] for x in rs.values()))
    assert after["after_last_end_ms"]["max"] >= was + 199.9
    out = tool(moved).stdout
    assert "push skew" in out and "network phase" in out
    assert "phases" in json.loads(tool(moved, "--json").stdout)
