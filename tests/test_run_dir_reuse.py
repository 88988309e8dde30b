"""A run dir given again (``dgt train --run-dir``) holds the new job's files alone.

Outside tester, 2026-12: ``dgt train --workers 3`` then ``--workers 2`` in the same
--run-dir reported 3 sidecars and 3 param_sha256 (the third from the old job's
sidecar-2.json and trainer-2.json), "replicas identical False" and a warning of 162
forged blocks (rank 2's old counters), with exit status 0; trace-2.jsonl and
endpoints-2.json stayed. Now the launcher removes a previous job's per-rank files
before it starts (dgt.run_files.clear_previous), and every reader of a run dir takes
the ranks of its own job only."""
import json
import os
import re
import shutil

import pytest

from conftest import run_train
from dgt import failure
from dgt.metrics import metrics_path
from dgt.plot import load as plot_load
from dgt.run_files import RANK_FILES, clear_previous, rank_of
from dgt.tools import pull_lag
from dgt.top import TraceFollower
from dgt.trace import trace_path

SMALL = ("--hidden", 64, "--iterations", 10)
#: a file of rank 2, whatever its kind
RANK_2 = re.compile(r".*-2\.[a-z]+")


@pytest.fixture(scope="module")
def three_rank_run(tmp_path_factory):
    """The run dir a finished 3-worker job left (with --check-conservation: its
    conservation-<rank>.npz too), and a file of the user's in it."""
    tmp = tmp_path_factory.mktemp("three")
    run_train(tmp, "--workers", 3, *SMALL, "--check-conservation")
    (tmp / "run" / "notes.txt").write_text("the user's\n")
    return tmp / "run"


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_every_file_a_job_leaves_is_a_known_per_rank_or_job_file(three_rank_run):
    """The list clear_previous removes covers what a real job writes: a new kind of
    per-rank file must be added to dgt.run_files.RANK_FILES."""
    names = set(os.listdir(three_rank_run)) - {"lock", "pids.json", "notes.txt"}
    assert {n for n in names if rank_of(n) is None} == set()
    assert {rank_of(n) for n in names} == {0, 1, 2}
    assert {"trace-2.jsonl", "sidecar-2.json", "trainer-2.json", "endpoints-2.json",
            "conservation-2.npz", "sidecar-2.log", "trainer-2.log"} <= names


@pytest.mark.slow
def test_a_run_dir_reused_with_fewer_workers_reports_this_job_alone(three_rank_run,
                                                                     tmp_path):
    run = _copy(three_rank_run, tmp_path)
    # an earlier job's run dir (its files there): the user's file in it is kept as it is
    stale = len(os.listdir(run)) - 2   # all but lock and notes.txt
    # the second job checkpoints where it does by default, inside the run dir
    p, r = run_train(tmp_path, "--workers", 2, *SMALL, "--checkpoint-every", 10)
    assert r["workers"] == 2
    assert [s["rank"] for s in r["sidecars"]] == [0, 1]
    assert len(r["param_sha256"]) == 2 and r["replicas_identical"], p.stdout
    assert "replicas identical    True" in p.stdout
    assert not [w for w in r["warnings"] if "more block(s) than the ranks sent" in w], \
        r["warnings"]
    assert r["conservation_rel_error"] is None   # the old job's sums are gone too
    assert not [n for n in os.listdir(run) if RANK_2.fullmatch(n)], os.listdir(run)
    assert f"removed {stale} file(s) of a previous job from {run}" in p.stdout, p.stdout
    assert (run / "notes.txt").read_text() == "the user's\n"
    # a third job resumes from the checkpoint in the run dir: it is not removed
    p, r = run_train(tmp_path, "--workers", 2, "--hidden", 64, "--iterations", 20,
                     "--resume", run / "checkpoints")
    assert f"resuming from {run / 'checkpoints'}/step-" in p.stdout, p.stdout
    assert r["iterations"] == 20 and r["replicas_identical"]
    assert len(r["sidecars"]) == 2


def test_the_readers_of_a_run_dir_take_the_ranks_of_its_own_job(three_rank_run,
                                                                  tmp_path):
    """What a run dir of an older dgt holds (or dgt top sees of a job that starts): the
    traces of 3 ranks, and pids.json of a 2-worker job."""
    run = _copy(three_rank_run, tmp_path)
    procs = json.loads((run / "pids.json").read_text())
    (run / "pids.json").write_text(json.dumps([x for x in procs if x["rank"] < 2]))
    assert sorted(plot_load(str(run))["comm_ms"]) == [0, 1]
    assert {r for ranks in pull_lag.load(str(run)).values() for r in ranks} == {0, 1}
    top = TraceFollower(str(run))
    top.poll()
    assert sorted(top.rows()) == [0, 1]
    (run / "pids.json").unlink()   # a sidecar started by hand: every rank's trace
    assert sorted(plot_load(str(run))["comm_ms"]) == [0, 1, 2]


def test_clear_previous_removes_dgt_files_alone(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    ours = [t.format(r) for t in RANK_FILES for r in (0, 12)] + ["pids.json",
                                                                  "failure.json"]
    for name in ours:
        (run / name).write_text("old")
    # the writers' own path functions give names of the list
    for path in (trace_path(str(run), 12), metrics_path(str(run), 12),
                 failure.record_path(str(run), "sidecar", 12),
                 failure.record_path(str(run), "trainer", 12)):
        assert os.path.basename(path) in ours
    theirs = ["lock", "report.json", "notes.txt", "trace-02.jsonl", "trace-2.jsonl.bak",
              "sidecar-x.json", "trainer-1.pt", "checkpoints/step-00000010/trainer-0.pt",
              "attempt-2/notes.txt", "attempt-3/ck/step-00000010/trainer-0.pt",
              "attempt-3/trace-0.jsonl"]
    for name in theirs:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("keep")
    (run / "trace-3.jsonl").mkdir()   # a folder of that name is not ours
    outside = tmp_path / "outside.log"
    outside.write_text("keep")
    (run / "trainer-1.log").symlink_to(outside)   # the link goes, never its target
    for folder in ("attempt-1", "attempt-2"):   # a previous job's restarts
        (run / folder).mkdir(exist_ok=True)
        for name in ("sidecar-0.log", "pids.json", "failure.json"):
            (run / folder / name).write_text("old")

    removed = clear_previous(str(run), keep=(str(run / "checkpoints"),
                                             str(run / "attempt-3" / "ck")))

    assert removed == len(ours) + 1 + 6
    left = {str(p.relative_to(run)) for p in run.rglob("*") if not p.is_dir()}
    assert left == set(theirs)
    assert (run / "trace-3.jsonl").is_dir() and outside.read_text() == "keep"
    assert not (run / "attempt-1").exists()   # emptied: gone


def test_clear_previous_of_a_fresh_run_dir_removes_nothing(tmp_path):
    assert clear_previous(str(tmp_path)) == 0

