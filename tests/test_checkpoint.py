"""Checkpoint, resume and restarts (dgt.checkpoint): the state objects round-trip through
torch.save/torch.load, a resumed 'dgt train' ends bitwise where an uninterrupted one
does, and --max-restarts survives a killed trainer and leaves nothing behind."""
import fcntl
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import alive, kill_after_checkpoint

from dgt import checkpoint
from dgt.contribution import ContributionScores
from dgt.feedback import Residual
from dgt.scheduler.assign import AdaptiveK
from dgt.scheduler.deadline import AdaptiveDeadline


def _round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)   # tensors and plain values only


def test_state_objects_round_trip_through_torch_save():
    g = torch.arange(12, dtype=torch.float32) - 5
    scores = ContributionScores(3, 0.3)
    scores.update(g, 4)
    scores.update(g * 2, 4)
    res = Residual(12, 4)
    res.compensate(g)
    res.update(torch.tensor([True, False, True]))
    k = AdaptiveK(0.5, 0.2)
    k.update(2.0)
    dl = AdaptiveDeadline(0.05, 1.0)
    dl.observe(0.2)

    scores2, res2, k2, dl2 = (ContributionScores(3, 0.3), Residual(12, 4),
                              AdaptiveK(0.5, 0.2), AdaptiveDeadline(0.05, 1.0))
    for a, b in ((scores, scores2), (res, res2), (k, k2), (dl, dl2)):
        b.load_state_dict(_round_trip(a.state_dict()))
    assert torch.equal(scores2.scores, scores.scores) and not scores2._fresh
    assert torch.equal(res2.residual, res.residual) and not res2.empty
    assert k2.update(1.0) == k.update(1.0) == pytest.approx(0.25)
    assert dl2.deadline_s() == dl.deadline_s() == pytest.approx(0.3)
    # the next update continues from the restored state, bit for bit
    assert torch.equal(scores2.update(g, 4), scores.update(g, 4))


def test_a_state_of_another_layout_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="block scores"):
        ContributionScores(4).load_state_dict(ContributionScores(3).state_dict())
    with pytest.raises(ValueError, match="--block-bytes"):
        Residual(16, 4).load_state_dict(Residual(12, 4).state_dict())


def test_resume_path_is_resolved_to_the_newest_complete_step(tmp_path):
    for step, ranks in ((10, (0, 1)), (20, (0, 1)), (30, (0,))):   # 30: cut short
        d = checkpoint.step_dir(str(tmp_path), step)
        os.makedirs(d)
        for r in ranks:
            for f in (checkpoint.trainer_file(d, r), checkpoint.sidecar_file(d, r)):
                checkpoint.save({"format": checkpoint.FORMAT}, f)
    assert checkpoint.resolve(str(tmp_path), 2).endswith("step-00000020")
    with pytest.raises(ValueError, match=r"has no trainer-1\.pt, sidecar-1\.pt \(cut short\)"):
        checkpoint.resolve(checkpoint.step_dir(str(tmp_path), 30), 2)
    with pytest.raises(ValueError, match="no complete checkpoint of 3 workers"):
        checkpoint.resolve(str(tmp_path), 3)
    with pytest.raises(ValueError, match="no such folder"):
        checkpoint.resolve(str(tmp_path / "nope"), 2)
    checkpoint.prune(str(tmp_path), 2, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-00000020", "step-00000030"]
    # rank 0 prunes while the other ranks still write the step it just wrote: that
    # step counts as one of the two kept (three were left before)
    d = checkpoint.step_dir(str(tmp_path), 40)
    os.makedirs(d)
    checkpoint.save({"format": checkpoint.FORMAT}, checkpoint.trainer_file(d, 0))
    checkpoint.prune(str(tmp_path), 2, keep=2, writing=40)
    assert sorted(os.listdir(tmp_path)) == ["step-00000020", "step-00000040"]
    with pytest.raises(ValueError, match="not a dgt checkpoint"):
        (tmp_path / "junk.pt").write_bytes(b"junk")
        checkpoint.load(str(tmp_path / "junk.pt"))


def test_a_bad_resume_flag_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "2",
                        "--resume", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert "--resume" in p.stderr and "--checkpoint-every" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


SMALL = ("--workers", 2, "--hidden", 32, "--seed", 3, "--deadline-ms", 3000)


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dgt.cli", "train", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_the_run_is_refused_before_anything_starts(tmp_path):
    """Breaker round 4: another --hidden, --block-bytes or --mode, a truncated or foreign
    file, and an unwritable --checkpoint-dir each started every process and ended with
    exit 1 and a rank blamed; now each is one line and exit 2 before anything starts."""
    ck = tmp_path / "ck"
    p = _train("--workers", 2, "--hidden", 32, "--iterations", 10, "--checkpoint-every",
               10, "--checkpoint-dir", ck, "--run-dir", tmp_path / "run0")
    assert p.returncode == 0, p.stderr
    base = ("--workers", 2, "--hidden", 32, "--iterations", 20, "--run-dir",
            tmp_path / "run1")
    for extra, want in ((("--hidden", 64), "taken with --hidden 32, this run has --hidden 64"),
                        # breaker round, stop 27: caught only after launch, exit 1
                        (("--no-error-feedback",), "taken with --error-feedback, this "
                                                   "run has --no-error-feedback"),
                        (("--block-bytes", 704), "--block-bytes 1408, this run has "
                                                  "--block-bytes 704"),
                        (("--mode", "tcp"), "--mode dgt, this run has --mode tcp"),
                        # breaker round 6: taken, then overridden by the optimiser's
                        # restored state in silence, the report saying 5
                        (("--lr", 5), "taken with --lr 0.002, this run has --lr 5.0")):
        p = _train(*base[:4], *extra, *base[4:], "--resume", ck)
        assert p.returncode == 2 and want in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "rank" not in p.stderr, p.stderr
    step = checkpoint.step_dir(str(ck), 10)
    side = checkpoint.sidecar_file(step, 1)
    data = open(side, "rb").read()
    with open(side, "wb") as f:   # cut short
        f.write(data[:100])
    p = _train(*base, "--resume", ck)
    assert p.returncode == 2 and "sidecar-1.pt is not a dgt checkpoint file" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    open(side, "wb").close()   # empty: torch's own words were about mmap
    p = _train(*base, "--resume", ck)
    assert p.returncode == 2 and "sidecar-1.pt is not a dgt checkpoint file (empty)" \
        in p.stderr, p.stderr
    os.unlink(side)
    os.mkfifo(side)   # breaker round, stop 27: torch.load blocked on it for ever
    p = _train(*base, "--resume", ck, timeout=120)
    assert p.returncode == 2 and "sidecar-1.pt is not a dgt checkpoint file (not a " \
        "regular file)" in p.stderr, p.stderr
    os.unlink(side)
    with open(side, "wb") as f:
        f.write(data)
    # breaker round, stop 27: a DDP script resuming dgt train's checkpoint: a KeyError
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "examples", "ddp_train.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", example, "--comm", "dgt", "--dataset",
                        "digits", "--hidden", "32", "--iterations", "20", "--resume",
                        step], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DGT_RUN_DIR=str(tmp_path / "ddp-run"),
                                OMP_NUM_THREADS="1"))
    ours = [ln for ln in p.stderr.splitlines() if "ddp_train.py rank" in ln]
    assert p.returncode != 0 and ours, p.stderr[-3000:]
    assert all("is a checkpoint of dgt train, not of a DDP script; resume it with dgt "
               "train --resume" in ln for ln in ours), p.stderr[-3000:]
    assert "KeyError" not in p.stderr
    torch.save({"a": 1}, checkpoint.trainer_file(step, 0))   # foreign
    p = _train(*base, "--resume", ck)
    assert p.returncode == 2 and "trainer-0.pt is not a dgt checkpoint file" in p.stderr
    (tmp_path / "file").write_text("x")
    p = _train(*base, "--checkpoint-every", 5, "--checkpoint-dir", tmp_path / "file" / "ck")
    assert p.returncode == 2 and f"--checkpoint-dir {tmp_path / 'file' / 'ck'}: " \
        f"{tmp_path / 'file'} is not a folder" in p.stderr, p.stderr
    assert not (tmp_path / "run1" / "pids.json").exists()   # nothing was started


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("--mode", "tcp"), ("--mode", "dgt"),
                                  # topk keeps a residual and ranks by the scores: the
                                  # sidecar's state decides the bits
                                  ("--mode", "topk", "--adaptive-k"),
                                  # the shard's residual (dgt.pull_codec) is state too
                                  ("--mode", "dgt", "--pull-codec", "int4")],
                         ids=["tcp", "dgt", "topk", "dgt-pull-int4"])
def test_a_resumed_run_ends_bitwise_where_an_uninterrupted_one_does(tmp_path, mode):
    from conftest import run_train
    ck = tmp_path / "ck"
    _, whole = run_train(tmp_path / "whole", *SMALL, *mode, "--iterations", 20)
    _, first = run_train(tmp_path / "first", *SMALL, *mode, "--iterations", 10,
                         "--checkpoint-every", 10, "--checkpoint-dir", ck)
    assert sorted(os.listdir(ck / "step-00000010")) == [
        "sha256-0.txt", "sha256-1.txt", "sidecar-0.pt", "sidecar-1.pt", "trainer-0.pt",
        "trainer-1.pt"]
    p, resumed = run_train(tmp_path / "resumed", *SMALL, *mode, "--iterations", 20,
                           "--resume", ck)
    assert "resuming from" in p.stdout
    lost = sum(ch["blocks_lost"] for ch in resumed["channels"].values())
    assert lost == 0, "precondition: a run without loss"
    assert first["param_sha256"][0] != whole["param_sha256"][0]
    assert resumed["replicas_identical"]
    assert resumed["param_sha256"] == whole["param_sha256"]
    assert resumed["iterations"] == whole["iterations"] == 20


@pytest.mark.slow
def test_a_killed_trainer_restarts_from_the_checkpoint_and_leaves_nothing(tmp_path):
    run_dir, ck, report = tmp_path / "run", tmp_path / "ck", tmp_path / "r.json"
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "train",
                          *map(str, (*SMALL, "--mode", "tcp", "--iterations", 400,
                                     "--epochs", 100, "--checkpoint-every", 10,
                                     "--checkpoint-dir", ck, "--max-restarts", 1,
                                     "--run-dir", run_dir, "--report", report))],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        kill_after_checkpoint(p, ck, 2, lambda: next(
            x["pid"] for x in json.loads((run_dir / "pids.json").read_text())
            if x["kind"] == "trainer" and x["rank"] == 1))
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out
    assert "trainer of rank 1 was killed by signal 9" in out, out
    assert f"restart 1/1 from {ck}/step-" in out, out
    r = json.loads(report.read_text())
    assert r["restarts"] == 1 and r["iterations"] == 400 and r["replicas_identical"]
    first = json.loads((run_dir / "attempt-1" / "pids.json").read_text())
    everyone = first + json.loads((run_dir / "pids.json").read_text())
    assert len(everyone) == 8
    # nothing left behind: no process, socket file, shared memory segment or lock
    assert not [x for x in everyone if alive(x["pid"])]
    for folder in (run_dir, run_dir / "attempt-1"):
        assert not [f for f in os.listdir(folder) if f.endswith(".sock")]
    sidecars = {x["pid"] for x in everyone if x["kind"] == "sidecar"}
    assert not [f for f in os.listdir("/dev/shm")
                if f.startswith("dgt-") and f.split("-")[1].isdigit()   # not dgt-records-*
                and int(f.split("-")[1]) in sidecars]
    with open(run_dir / "lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)   # raises if still held


def test_the_ddp_hook_state_round_trips_through_torch_save(tmp_path):
    import pickle

    from dgt.ddp import DgtState
    state = DgtState(connect=False)
    state.iteration, state.layout_numels = 50, [2048, 32, 320, 10]
    torch.save({"dgt": state.state_dict()}, tmp_path / "ckpt.pt")
    back = DgtState(connect=False)
    back.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["dgt"])
    assert back.state_dict() == state.state_dict()
    assert back.iteration == 50 and back.layout_numels == [2048, 32, 320, 10]
    twin = pickle.loads(pickle.dumps(state))   # no socket or process in its pickle
    assert twin.state_dict() == state.state_dict()
    back.layout_numels = [1, 2]
    with pytest.raises(ValueError, match="load the checkpoint of this model"):
        back.load_state_dict(state.state_dict())


def test_a_damaged_newest_step_is_skipped_and_none_loadable_names_the_file(tmp_path):
    # breaker round 5: --resume D took the newest step even with a truncated file in it
    for step in (10, 20):
        d = checkpoint.step_dir(str(tmp_path), step)
        os.makedirs(d)
        for r in (0, 1):
            for f in (checkpoint.trainer_file(d, r), checkpoint.sidecar_file(d, r)):
                checkpoint.save({"format": checkpoint.FORMAT, "x": torch.zeros(64)}, f)
    bad20 = checkpoint.trainer_file(checkpoint.step_dir(str(tmp_path), 20), 1)
    os.truncate(bad20, 100)
    assert checkpoint.resolve(str(tmp_path), 2).endswith("step-00000010")
    assert checkpoint.latest(str(tmp_path), 2).endswith("step-00000010")
    os.truncate(checkpoint.sidecar_file(checkpoint.step_dir(str(tmp_path), 10), 0), 50)
    with pytest.raises(ValueError) as e:
        checkpoint.resolve(str(tmp_path), 2)
    assert f"{bad20} is not a dgt checkpoint file" in str(e.value)
    assert "\n" not in str(e.value)


def _dummy_step(root: str, step: int, world: int = 2, **extra) -> str:
    """Step folder ``step`` under ``root`` with small files of every rank."""
    d = checkpoint.step_dir(root, step)
    os.makedirs(d)
    for r in range(world):
        for f in (checkpoint.trainer_file(d, r), checkpoint.sidecar_file(d, r)):
            checkpoint.save({"format": checkpoint.FORMAT, **extra}, f)
    return d


def test_a_step_missing_a_sidecar_file_is_skipped_and_never_costs_the_last_one(
        tmp_path, caplog):
    # outside tester: --resume CKDIR refused ("cannot read .../sidecar-1.pt") when the
    # newest step lacked a sidecar file, instead of taking the step before
    root = str(tmp_path)
    _dummy_step(root, 10, writer="dgt train")
    d20 = _dummy_step(root, 20, writer="dgt train")
    os.unlink(checkpoint.sidecar_file(d20, 1))
    with caplog.at_level("WARNING", logger="dgt.checkpoint"):
        assert checkpoint.resolve(root, 2).endswith("step-00000010")
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skips) == 1 and "sidecar-1.pt: No such file or directory" in skips[0], skips
    # dgt train's trainer files need their sidecar files even when none is there
    os.unlink(checkpoint.sidecar_file(d20, 0))
    assert checkpoint.latest(root, 2).endswith("step-00000010")
    # a step whose trainer file is a folder (a write that failed) is not complete, and
    # rank 0's pruning while step 30 is written keeps step 10, the last complete one
    os.unlink(checkpoint.trainer_file(d20, 1))
    os.mkdir(checkpoint.trainer_file(d20, 1))
    assert checkpoint.complete_steps(root, 2) == [(10, checkpoint.step_dir(root, 10))]
    os.makedirs(checkpoint.step_dir(root, 30))
    checkpoint.prune(root, 2, writing=30)
    assert sorted(os.listdir(root)) == ["step-00000010", "step-00000030"]


def _warned(p, rep) -> list[str]:
    """The run's checkpoint warnings: the report's, each also on the console."""
    got = [w for w in rep["warnings"] if w.startswith("checkpoint ")]
    for w in got:
        assert f"warning: {w}" in p.stdout, p.stdout[-3000:]
    return got


@pytest.mark.slow
def test_a_checkpoint_file_that_cannot_be_written_is_a_warning_and_training_goes_on(
        tmp_path):
    """Outside tester: a checkpoint write that failed (ENOSPC on a tmpfs) killed the job
    ("trainer of rank 0 disconnected"). Here the writes fail another real way, for any
    user: a folder where the file goes. Step 20's sidecar-1.pt (the sidecar's write) and
    step 30's trainer-0.pt (the trainer's) are each one warning, the job finishes, and
    neither step passes for complete."""
    from conftest import run_train
    ck = tmp_path / "ck"
    os.makedirs(ck / "step-00000020" / "sidecar-1.pt")
    os.makedirs(ck / "step-00000030" / "trainer-0.pt")
    p, rep = run_train(tmp_path / "run", *SMALL, "--iterations", 30,
                       "--checkpoint-every", 10, "--checkpoint-dir", ck)
    assert rep["iterations"] == 30 and rep["replicas_identical"]
    assert sorted(_warned(p, rep)) == [
        f"checkpoint {ck}/step-00000020/sidecar-1.pt not written: Is a directory",
        f"checkpoint {ck}/step-00000030/trainer-0.pt not written: Is a directory"]
    # step 20 (rank 1 wrote no trainer file) was pruned at 30; 30 lacks trainer-0.pt
    assert checkpoint.complete_steps(str(ck), 2) == [(10, str(ck / "step-00000010"))]
    assert sorted(os.listdir(ck / "step-00000030")) == ["sha256-1.txt", "sidecar-1.pt",
                                                        "trainer-0.pt", "trainer-1.pt"]
    assert checkpoint.resolve(str(ck), 2) == str(ck / "step-00000010")


def test_digests_that_cannot_be_written_leave_the_step_incomplete(tmp_path):
    """Each rank's sha256-<r>.txt is written last (dgt.checkpoint.seal); when it cannot
    be (here a folder in its place) the step costs that rank's files, as any other
    checkpoint file would: one warning, the run finishes, the step is not complete.
    It was the run's only step: the run has no checkpoint, which is an error at the end
    (exit status 1; breaker round 10: exit 0 when every checkpoint had failed)."""
    from conftest import run_train
    ck = tmp_path / "ck"
    os.makedirs(ck / "step-00000010" / "sha256-1.txt")
    p, rep = run_train(tmp_path / "run", *SMALL, "--iterations", 10,
                       "--checkpoint-every", 10, "--checkpoint-dir", ck, check=False)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert (f"dgt train: error: no checkpoint was written to {ck}: 1 file(s) could not "
            f"be written, the first: checkpoint {ck}/step-00000010/sha256-1.txt not "
            f"written: Is a directory; exit status 1") in p.stderr, p.stderr
    assert rep["iterations"] == 10 and rep["replicas_identical"]
    assert _warned(p, rep) == [
        f"checkpoint {ck}/step-00000010/sha256-1.txt not written: Is a directory"]
    assert checkpoint.complete_steps(str(ck), 2) == []
    assert sorted(os.listdir(ck / "step-00000010")) == [
        "sha256-0.txt", "sha256-1.txt", "sidecar-0.pt", "trainer-0.pt"]


@pytest.mark.slow
def test_a_full_checkpoint_disk_is_a_warning_and_keeps_the_last_complete_step(
        tmp_path, small_tmpfs):
    """Outside tester: a checkpoint write that filled the disk killed the job (torch's
    RuntimeError "unexpected pos" wrapping ENOSPC; "rank 0 disconnected"). Step 10 is
    taken with room to spare; then the disk is filled to half a trainer file free: at
    steps 20 and 30 each rank's sidecar or trainer file fails, one warning each, the
    job finishes, and step 10 stays the one --resume takes."""
    from conftest import run_train
    tiny_tmpfs = small_tmpfs("1m", mode="700")
    ck = tiny_tmpfs / "ck"
    ck.mkdir(mode=0o700)
    run_train(tmp_path / "first", *SMALL, "--iterations", 10, "--checkpoint-every", 10,
              "--checkpoint-dir", ck)
    assert checkpoint.latest(str(ck), 2) == str(ck / "step-00000010")
    room = os.path.getsize(ck / "step-00000010" / "trainer-0.pt") // 2
    st = os.statvfs(tiny_tmpfs)
    fd = os.open(tiny_tmpfs / "filler", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - room)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:   # torch's RuntimeError, as the errno it wraps
        checkpoint.save({"x": torch.zeros(64 * 1024)}, str(ck / "probe.pt"))
    assert e.value.errno == 28 and e.value.filename == str(ck / "probe.pt")
    p, rep = run_train(tmp_path / "second", *SMALL, "--iterations", 30, "--resume", ck,
                       "--checkpoint-every", 10, "--checkpoint-dir", ck)
    assert rep["iterations"] == 30 and rep["replicas_identical"]
    failed = []   # (step, rank): its sidecar file, or else its trainer file, failed
    for w in _warned(p, rep):
        m = re.fullmatch(rf"checkpoint {ck}/step-000000([23]0)/(sidecar|trainer)-([01])"
                         rf"\.pt not written: No space left on device", w)
        assert m, w
        failed.append((m[1], m[3]))
    assert sorted(failed) == [("20", "0"), ("20", "1"), ("30", "0"), ("30", "1")], failed
    assert checkpoint.complete_steps(str(ck), 2) == [(10, str(ck / "step-00000010"))]
    # the failed steps' folders, empty once both ranks' files were discarded, are
    # removed by the launcher after the job (not by a rank while the other still writes
    # there: CI of c764589 saw rank 1's write fail with ENOENT, not ENOSPC)
    assert [n for n in os.listdir(ck) if n.startswith("step-")] == ["step-00000010"]
    assert checkpoint.resolve(str(ck), 2) == str(ck / "step-00000010")
    left = [f for _, _, fs in os.walk(ck) for f in fs if f.endswith(".tmp")]
    assert not left, left


def test_only_empty_step_folders_are_removed_after_the_job(tmp_path):
    root = tmp_path / "ck"
    for name in ("step-00000010", "step-00000020", "step-00000030", "notes"):
        (root / name).mkdir(parents=True)
    (root / "step-00000020" / "trainer-0.pt").write_bytes(b"x")
    (root / "step-00000040").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    assert checkpoint.remove_empty_steps(str(root)) == [
        str(root / "step-00000010"), str(root / "step-00000030")]
    assert sorted(os.listdir(root)) == ["notes", "step-00000020", "step-00000040"]
    assert (tmp_path / "elsewhere").is_dir()
    assert checkpoint.remove_empty_steps(str(tmp_path / "none")) == []


def _resume_past_a_damaged_step(tmp_path, ck, damage, iterations):
    """Train 20 iterations with checkpoints every 10 into ``ck``, ``damage()`` its step
    20, then --resume ``ck`` to ``iterations``: the run must take step 10 and finish.
    Returns (process, report, the "skipping a newer step" lines)."""
    from conftest import run_train
    run_train(tmp_path / "first", *SMALL, "--iterations", 20, "--checkpoint-every", 10,
              "--checkpoint-dir", ck)
    damage()
    p, rep = run_train(tmp_path / "second", *SMALL, "--iterations", iterations,
                       "--resume", ck, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"resuming from {ck}/step-00000010" in p.stdout, p.stdout
    return p, rep, [ln for ln in (p.stdout + p.stderr).splitlines()
                    if "skipping a newer step" in ln]


@pytest.mark.slow
def test_resume_skips_a_newest_step_without_a_sidecar_file_once(tmp_path):
    """Outside tester: --resume CKDIR stopped (exit 2, "cannot read .../sidecar-1.pt")
    when the newest step lacked a sidecar file, and the skip warning of a damaged step
    was printed twice. Now it resumes from the step before, with one warning."""
    ck = tmp_path / "ck"
    p, rep, skips = _resume_past_a_damaged_step(
        tmp_path, ck, lambda: os.unlink(ck / "step-00000020" / "sidecar-1.pt"), 20)
    assert len(skips) == 1, skips
    assert f"{ck}/step-00000020/sidecar-1.pt: No such file or directory" in skips[0]
    assert rep["iterations"] == 20


def _recorded_step(root: str, step: int, world: int = 2, rounds: int | None = None) -> str:
    """Step folder ``step`` under ``root`` whose small files record what dgt train's do:
    each trainer file its rank, workers, step and rounds (``rounds``: fedavg's, else
    ``step``), each sidecar file its rank, workers and pushes (the rounds)."""
    d = checkpoint.step_dir(root, step)
    os.makedirs(d)
    rounds = step if rounds is None else rounds
    for r in range(world):
        checkpoint.save({"format": checkpoint.FORMAT, "writer": "dgt train", "rank": r,
                         "world": world, "step": step, "rounds": rounds},
                        checkpoint.trainer_file(d, r))
        checkpoint.save({"format": checkpoint.FORMAT, "rank": r, "world": world,
                         "iterations": rounds}, checkpoint.sidecar_file(d, r))
    return d


@pytest.mark.parametrize("copy, named", [
    (("step-00000010/trainer-0.pt", "step-00000020/trainer-0.pt"),
     "step-00000020/trainer-0.pt is of step 10, not of its folder's step 20"),
    (("step-00000010/sidecar-1.pt", "step-00000020/sidecar-1.pt"),
     "step-00000020/sidecar-1.pt is of step 10, its trainer-1.pt of step 20"),
    # a rank's file as another's: the file copied is named, not the rank it starts
    (("step-00000020/trainer-1.pt", "step-00000020/trainer-0.pt"),
     "step-00000020/trainer-0.pt is rank 1's file, not rank 0's"),
    (("step-00000020/sidecar-0.pt", "step-00000020/sidecar-1.pt"),
     "step-00000020/sidecar-1.pt is rank 0's file, not rank 1's"),
    (("w3/step-00000020/sidecar-1.pt", "step-00000020/sidecar-1.pt"),
     "step-00000020/sidecar-1.pt is rank 1's file of 3 workers, not rank 1's of 2"),
], ids=["trainer-of-another-step", "sidecar-of-another-step", "trainer-of-another-rank",
        "sidecar-of-another-rank", "sidecar-of-another-world"])
def test_a_step_with_a_file_of_another_step_or_rank_is_skipped(tmp_path, caplog, copy,
                                                                named):
    """Outside tester: step-6's sidecar files replaced by step 4's made --resume CKDIR
    start every process and end in a traceback ("step 6 out of order"); step 4's
    trainer-0.pt there blamed rank 1. Each file records its step (or pushes) and rank:
    a step whose files disagree with its folder is skipped with one warning naming the
    file, as a damaged one is."""
    root = str(tmp_path / "ck")
    _recorded_step(root, 10)
    _recorded_step(root, 20)
    _recorded_step(str(tmp_path / "w3"), 20, world=3)
    src, dst = copy
    base = str(tmp_path) if src.startswith("w3/") else root
    import shutil
    shutil.copyfile(os.path.join(base, src), os.path.join(root, dst))
    with caplog.at_level("WARNING", logger="dgt.checkpoint"):
        assert checkpoint.resolve(root, 2) == checkpoint.step_dir(root, 10)
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skips) == 1 and f"{root}/{named}" in skips[0], skips
    assert checkpoint.damaged(checkpoint.step_dir(root, 20), 2).startswith(
        f"{root}/{named}")
    assert checkpoint.latest(root, 2) == checkpoint.step_dir(root, 10)
    # the same file in the only step: no step to resume from, the file named
    shutil.rmtree(checkpoint.step_dir(root, 10))
    with pytest.raises(ValueError, match="no step in it can be resumed from") as e:
        checkpoint.resolve(root, 2)
    assert f"{root}/{named}" in str(e.value) and "\n" not in str(e.value)


def test_fedavg_files_agree_on_rounds_and_files_without_the_fields_still_load(tmp_path):
    root = str(tmp_path)
    d = _recorded_step(root, 6, rounds=3)   # fedavg: a push a round, 2 steps a round
    assert checkpoint.damaged(d, 2) is None
    _recorded_step(str(tmp_path / "old"), 4, rounds=2)
    os.replace(checkpoint.sidecar_file(checkpoint.step_dir(str(tmp_path / "old"), 4), 0),
               checkpoint.sidecar_file(d, 0))
    assert checkpoint.damaged(d, 2) == (f"{checkpoint.sidecar_file(d, 0)} is of round 2, "
                                        f"its trainer-0.pt of round 3 (copied from "
                                        f"another step?)")
    # files that record none of it (older formats, other writers) are not refused
    assert checkpoint.damaged(_dummy_step(root, 8, writer="dgt train"), 2) is None


def test_a_file_given_to_resume_is_named_a_file(tmp_path):
    """Outside tester: --resume FILE said "no such folder" for a file that is there."""
    d = _recorded_step(str(tmp_path), 10)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError) as e:
        checkpoint.resolve(str(tmp_path / "notes.txt"), 2)
    assert str(e.value) == (f"--resume {tmp_path}/notes.txt: is a file, not a checkpoint "
                            f"folder; give a checkpoint folder (--checkpoint-dir) or one "
                            f"of its step-<t> folders")
    with pytest.raises(ValueError) as e:   # a step's file: its folder is what to give
        checkpoint.resolve(checkpoint.trainer_file(d, 0), 2)
    assert str(e.value) == (f"--resume {d}/trainer-0.pt: is a file, not a checkpoint "
                            f"folder; give its step folder, --resume {d}")
    with pytest.raises(ValueError, match="no such folder"):
        checkpoint.resolve(str(tmp_path / "nope"), 2)
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "2",
                        "--resume", str(tmp_path / "notes.txt")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "is a file, not a checkpoint folder" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_named_step_folder_with_a_file_of_another_step_is_one_line(tmp_path):
    """--resume D/step-<t> is used as it is: a file of another step in it is refused
    before anything starts, in one line naming the file (not a rank that is fine)."""
    root = tmp_path / "ck"
    d10, d20 = _recorded_step(str(root), 10), _recorded_step(str(root), 20)
    os.replace(checkpoint.trainer_file(d10, 0), checkpoint.trainer_file(d20, 0))
    p = _train("--workers", 2, "--iterations", 30, "--run-dir", tmp_path / "run",
               "--resume", d20, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"dgt train: error: {d20}/trainer-0.pt is of step 10, not of its folder's step "
        f"20 (copied from another step?); resume from another step (--resume {root} "
        f"takes the newest whose files agree) (see 'dgt train --help')"], p.stderr
    assert not (tmp_path / "run" / "pids.json").exists()   # nothing was started


@pytest.mark.slow
def test_resume_from_a_step_with_files_of_another_step_takes_the_one_before(tmp_path):
    """Outside tester: step 20's sidecar files replaced by step 10's; --resume CKDIR
    started eight processes that ended in tracebacks ("step 20 out of order"), the
    launcher blaming rank 1. Now step 20 is skipped with one warning naming the file,
    and the job resumes from step 10 and finishes."""
    import shutil
    ck = tmp_path / "ck"

    def copy_in():
        for r in (0, 1):
            shutil.copyfile(ck / "step-00000010" / f"sidecar-{r}.pt",
                            ck / "step-00000020" / f"sidecar-{r}.pt")
    p, rep, skips = _resume_past_a_damaged_step(tmp_path, ck, copy_in, 30)
    assert skips == [f"--resume {ck}: skipping a newer step: {ck}/step-00000020/"
                     f"sidecar-0.pt is of step 10, its trainer-0.pt of step 20 (copied "
                     f"from another step?)"], skips
    assert "Traceback" not in p.stdout + p.stderr
    assert rep["iterations"] == 30 and rep["replicas_identical"]


@pytest.mark.slow
def test_checkpoints_in_the_temporary_run_dir_outlive_the_run(tmp_path):
    """Breaker round, stop 40: --checkpoint-every without --run-dir or --checkpoint-dir
    wrote its checkpoints into the temporary run dir, which a successful run removes:
    nothing was left to --resume from. They stay now, and the rest goes."""
    p = _train(*SMALL, "--iterations", 4, "--checkpoint-every", 2)
    out = p.stdout + p.stderr
    kept = re.search(r"checkpoints kept in (\S+) \(--resume", out)
    assert p.returncode == 0 and kept, out
    kept = kept.group(1)
    try:
        assert "(kept after the run; --checkpoint-dir picks the folder)" in out, out
        assert os.listdir(os.path.dirname(kept)) == ["checkpoints"]
        assert checkpoint.latest(kept, 2).endswith("step-00000004")
        again = _train(*SMALL, "--iterations", 6, "--resume", kept,
                       "--run-dir", tmp_path / "again")
        assert again.returncode == 0, again.stderr
        assert "resuming from" in again.stdout + again.stderr
    finally:
        shutil.rmtree(os.path.dirname(kept), ignore_errors=True)


def test_a_checkpoint_dir_in_use_by_another_job_is_refused(tmp_path):
    """Breaker round 6: two dgt train jobs with one --checkpoint-dir both ran, each
    removing the other's steps as it kept its newest two (5 of one job's checkpoints
    lost, a step mixing both jobs' files). A job takes the folder as it takes its run
    dir: an exclusive flock on <checkpoint-dir>/lock, its pid written there. Here this
    test holds it, as a running job does."""
    import fcntl
    ck = tmp_path / "ck"
    ck.mkdir()
    with open(ck / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(str(os.getpid()))
        held.flush()
        p = _train("--workers", 2, "--hidden", 32, "--iterations", 4, "--checkpoint-every",
                   2, "--checkpoint-dir", ck, "--run-dir", tmp_path / "run")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"dgt train: --checkpoint-dir {ck} is in use by another "
                                f"dgt train (pid {os.getpid()}); give each job its own "
                                f"--checkpoint-dir"), p.stderr
    p = _train("--workers", 2, "--hidden", 32, "--iterations", 4, "--checkpoint-every", 2,
               "--checkpoint-dir", ck, "--run-dir", tmp_path / "run")
    assert p.returncode == 0, p.stderr
    assert checkpoint.latest(str(ck), 2) is not None


def _sidecar_of_one(tmp_path, name: str):
    """A hand-started sidecar of a one-worker job; (process, its socket)."""
    import socket as _socket
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / name
    run.mkdir(mode=0o700)
    sock = str(run / "s.sock")
    out = open(tmp_path / f"{name}.out", "wb")
    p = subprocess.Popen([sys.executable, "-m", "dgt.cli", "sidecar", "--rank", "0",
                          "--world", "1", "--master-port", str(port), "--socket", sock,
                          "--run-dir", str(run), "--peer-timeout-s", "5"],
                         stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return p, sock


def _stop_all(procs: list) -> None:
    """Kill what still runs of ``procs`` (a sidecar lingers after a failure) and check
    that none left its buffers in /dev/shm: a sidecar names them
    ``dgt-<its pid>-...`` (dgt.ipc.buffer_name) and removes them once the job is over,
    before any linger."""
    import glob
    for q in procs:
        if q.poll() is None:
            q.kill()
        q.wait(timeout=30)
    left = [f for q in procs for f in glob.glob(f"/dev/shm/dgt-{q.pid}-*")]
    for f in left:
        os.unlink(f)
    assert not left, left


def _save_a_state(tmp_path, model, state: str, procs: list) -> None:
    """Register ``model`` with a hand-started one-worker sidecar (added to ``procs``),
    push one step of gradients of ones and save its state in ``state``."""
    from dgt import Client
    p, sock = _sidecar_of_one(tmp_path, "a")
    procs.append(p)
    c = Client(sock, timeout_s=30, connect_timeout_s=60)
    c.register(model)
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    c.push_pull(0)
    c.save_state(state)
    c.close()
    assert p.wait(timeout=60) == 0


def test_a_sidecar_state_of_another_model_of_as_many_blocks_is_refused(tmp_path):
    """Breaker round 17: the sidecar's checkpoint held its blocks' count and size only,
    so a state saved for a Linear(10, 2) (22 gradient elements) resumed a Linear(10, 3)
    (33: one block either way) and ran on."""
    from dgt import Client
    from dgt.errors import PeerFailure
    state = str(tmp_path / "other.pt")
    procs = []
    try:
        _save_a_state(tmp_path, torch.nn.Linear(10, 2), state, procs)
        p, sock = _sidecar_of_one(tmp_path, "b")
        procs.append(p)
        c = Client(sock, timeout_s=30, connect_timeout_s=60)
        with pytest.raises(PeerFailure, match="n_params 22, this sidecar's is 33"):
            c.register(torch.nn.Linear(10, 3), resume=state)
        c.close()
    finally:
        _stop_all(procs)


def test_a_sidecar_state_of_another_model_of_as_many_parameters_is_refused(tmp_path):
    """A state saved for a Linear(4, 6) without bias (a [6, 4] weight: 24 gradient
    elements) resumed a Linear(6, 4) without bias ([4, 6]: 24 too): the checkpoint
    recorded n_params only. The state now records the parameters' shapes (a digest),
    and register() refuses another layout in one line naming the file and what
    differs; a state without the field (written before it) still resumes."""
    from dgt import Client
    from dgt.errors import PeerFailure
    state = str(tmp_path / "other.pt")
    procs = []
    try:
        _save_a_state(tmp_path, torch.nn.Linear(4, 6, bias=False), state, procs)
        p, sock = _sidecar_of_one(tmp_path, "b")
        procs.append(p)
        c = Client(sock, timeout_s=30, connect_timeout_s=60)
        with pytest.raises(PeerFailure) as e:
            c.register(torch.nn.Linear(6, 4, bias=False), resume=state)
        c.close()
        msg = str(e.value)
        assert "\n" not in msg and f"cannot resume from {state}: " in msg, msg
        assert "other parameter shapes (as many parameters, 24" in msg, msg
        # a state written before the field existed resumes the model of as many
        old = checkpoint.load(state)
        del old["shapes_sha256"]
        torch.save(old, str(tmp_path / "old.pt"))
        p, sock = _sidecar_of_one(tmp_path, "c")
        procs.append(p)
        c = Client(sock, timeout_s=30, connect_timeout_s=60)
        c.register(torch.nn.Linear(6, 4, bias=False), resume=str(tmp_path / "old.pt"))
        assert c.next_step == 1
        c.close()
        assert p.wait(timeout=60) == 0
    finally:
        _stop_all(procs)
