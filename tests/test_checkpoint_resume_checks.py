"""What ``dgt train --resume`` says before anything starts (dgt.checkpoint.resolve,
check_resume), on a checkpoint folder made once by a real short run: a folder this user
cannot read is said as it is (not "no complete checkpoint"), a checkpoint at or past
--iterations or --epochs is refused (the job ran no iteration and exited 0), a newer
step that a rank never finished writing is skipped with a warning naming its files, a
file damaged on disk (its SHA-256) or holding NaN/inf is refused naming it, and a run
whose replicas end different exits 1."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dgt import checkpoint
from dgt.config import JobConfig, TransmissionConfig

#: the fixture's run: 2 workers, a small MLP, one epoch, a checkpoint after every
#: iteration (rank 0 keeps the newest two: the epoch's last iteration and the one before)
RUN = ("--workers", 2, "--hidden", 32, "--seed", 3, "--deadline-ms", 3000)


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dgt.cli", "train", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """(checkpoint folder, N): one epoch of N iterations, steps N-1 and N kept. Tests
    copy it before changing it."""
    tmp = tmp_path_factory.mktemp("ck-run")
    ck = tmp / "ck"
    p = _train(*RUN, "--epochs", 1, "--checkpoint-every", 1, "--checkpoint-dir", ck,
               "--run-dir", tmp / "run", "--report", os.devnull)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [s for s, _ in checkpoint.complete_steps(str(ck), 2)]
    assert len(steps) == 2 and steps[0] == steps[1] - 1, steps
    return ck, steps[1]


def _job(**kw) -> JobConfig:
    return JobConfig(workers=2, hidden=32, seed=3, **kw)


def _check(folder, **kw) -> None:
    """The checks --resume makes before anything starts, for step ``folder``."""
    checkpoint.check_resume(str(folder), 2, _job(**kw), TransmissionConfig())


# -- F5: a checkpoint that leaves nothing to train ---------------------------------------
def test_a_checkpoint_at_or_past_iterations_is_refused_before_anything_starts(ck, tmp_path):
    """Outside tester: --iterations 30 --resume ck, ck's newest step 60, exited 0 having
    run no iteration (the summary said "iterations 60"). Now one line, exit 2."""
    root, n = ck
    last, before = checkpoint.step_dir(str(root), n), checkpoint.step_dir(str(root), n - 1)
    for iterations in (n, n - 1, 1):
        with pytest.raises(ValueError) as e:
            _check(last, iterations=iterations, epochs=5)
        assert str(e.value) == (
            f"--resume {last}: the checkpoint is at iteration {n}, at or past "
            f"--iterations {iterations}: nothing is left to train; give a larger "
            f"--iterations")
    _check(last, iterations=n + 1, epochs=5)   # one iteration left: fine
    _check(before, iterations=n, epochs=5)
    p = _train(*RUN, "--iterations", n - 1, "--epochs", 5, "--resume", root,
               "--run-dir", tmp_path / "run", timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        f"dgt train: error: --resume {last}: the checkpoint is at iteration {n}, at or "
        f"past --iterations {n - 1}: nothing is left to train; give a larger --iterations "
        f"(see 'dgt train --help')"], p.stderr
    assert not (tmp_path / "run" / "pids.json").exists()   # nothing was started


def test_a_checkpoint_at_the_end_of_the_last_epoch_is_refused(ck):
    """The same with --epochs: step N ends epoch 1 (each trainer file records the
    epoch's iterations), so --epochs 1 leaves nothing; step N-1 leaves one."""
    root, n = ck
    last, before = checkpoint.step_dir(str(root), n), checkpoint.step_dir(str(root), n - 1)
    with pytest.raises(ValueError) as e:
        _check(last, epochs=1)
    assert str(e.value) == (
        f"--resume {last}: the checkpoint is at the end of epoch 1 (iteration {n}), at "
        f"or past --epochs 1: nothing is left to train; give a larger --epochs")
    _check(last, epochs=2)
    _check(before, epochs=1)


# -- F6: a newer step that a rank never finished writing ---------------------------------
def test_a_newer_step_without_a_ranks_files_is_skipped_with_a_warning_naming_them(
        ck, tmp_path, caplog):
    """Outside tester: a sidecar SIGKILLed during --checkpoint-every 1 left the newest
    step without rank 2's files; --resume said only "resuming from" the step before.
    docs/ddp.md: such a step "is skipped with a warning naming the file"."""
    src, n = ck
    root = tmp_path / "ck"
    shutil.copytree(src, root)
    newest = checkpoint.step_dir(str(root), n)
    os.unlink(checkpoint.trainer_file(newest, 1))
    os.unlink(checkpoint.sidecar_file(newest, 1))
    with caplog.at_level("WARNING", logger="dgt.checkpoint"):
        assert checkpoint.resolve(str(root), 2) == checkpoint.step_dir(str(root), n - 1)
    skips = [r.getMessage() for r in caplog.records]
    assert skips == [f"--resume {root}: skipping a newer step: {newest} has no "
                     f"trainer-1.pt, sidecar-1.pt (cut short: a rank's files were never "
                     f"written)"], skips
    # the only step cut short: the refusal names what it lacks
    shutil.rmtree(checkpoint.step_dir(str(root), n - 1))
    with pytest.raises(ValueError) as e:
        checkpoint.resolve(str(root), 2)
    assert str(e.value) == (
        f"--resume {root}: no complete checkpoint of 2 workers in it ({newest} has no "
        f"trainer-1.pt, sidecar-1.pt (cut short: a rank's files were never written)); "
        f"take one with --checkpoint-every N --checkpoint-dir {root}")


# -- F4: a folder this user cannot read ----------------------------------------------
def _resolve_as_nobody(path: str) -> str:
    """checkpoint.resolve(path, 2) in a child process running as uid/gid 65534 (forked:
    this interpreter may live where that user cannot start it again, e.g. under /root):
    "ok <folder>" or "error <message>". Skips when not root."""
    if os.geteuid() != 0:
        pytest.skip(reason="needs root: the test runs a process as another user (uid 65534)")
    import torch  # noqa: F401 - imported here: the child could not read its library
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never back into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                out = "ok " + checkpoint.resolve(path, 2)
            except ValueError as e:
                out = f"error {e}"
            except BaseException as e:   # noqa: BLE001 - said to the parent
                out = f"raised {type(e).__name__}: {e}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return b"".join(chunks).decode()


def test_a_resume_folder_this_user_cannot_read_is_said_as_it_is(ck, shared_tmp):
    """Outside tester (a normal user): --resume DIR, another user's 0700 folder, said
    "no complete checkpoint of 4 workers in it; take one with --checkpoint-every N". Any
    OSError looking at the folder, its steps or their files is now said as itself."""
    src, n = ck
    os.chmod(shared_tmp, 0o755)
    theirs = os.path.join(shared_tmp, "theirs")
    shutil.copytree(src, theirs)
    for folder, _, files in os.walk(theirs):   # readable by all, then taken away below
        os.chmod(folder, 0o755)
        for f in files:
            os.chmod(os.path.join(folder, f), 0o644)
    newest = checkpoint.step_dir(theirs, n)
    assert _resolve_as_nobody(theirs) == f"ok {newest}"
    os.chmod(theirs, 0o700)   # root's, 0700: uid 65534 cannot list it
    assert _resolve_as_nobody(theirs) == (
        f"error --resume {theirs}: cannot read it: Permission denied; give a checkpoint "
        f"folder this user can read")
    # a step inside it: not "no such folder"
    assert _resolve_as_nobody(newest) == (
        f"error --resume {newest}: cannot read it: Permission denied; give a checkpoint "
        f"folder this user can read")
    os.chmod(theirs, 0o755)   # listed, but its newest step's folder is 0700
    os.chmod(newest, 0o700)
    assert _resolve_as_nobody(theirs) == (   # the folder, not its first file (stop 42)
        f"error --resume {theirs}: cannot read {newest}: Permission denied; give a "
        f"checkpoint folder this user can read")
    assert _resolve_as_nobody(newest) == (
        f"error --resume {newest}: cannot read it: Permission denied; give a checkpoint "
        f"folder this user can read")
    os.chmod(newest, 0o755)   # a file of the newest step is 0600: said, not skipped
    os.chmod(checkpoint.trainer_file(newest, 1), 0o600)
    assert _resolve_as_nobody(theirs) == (
        f"error --resume {theirs}: cannot read {checkpoint.trainer_file(newest, 1)}: "
        f"Permission denied; give a checkpoint folder this user can read")
    # the step given by name: said at --resume too (it was said later, by the load,
    # without the flag; second breaker round of stop 41)
    assert _resolve_as_nobody(newest) == (
        f"error --resume {newest}: cannot read {checkpoint.trainer_file(newest, 1)}: "
        f"Permission denied; give a checkpoint folder this user can read")


def test_a_checkpoint_of_another_number_of_workers_names_the_workers_to_give(ck, tmp_path):
    """Breaker round 2, stop 41: --workers 3 on a checkpoint of 2 said "cut short: a
    rank's files were never written" (the folder) or "taken with fewer --workers, or cut
    short; give the checkpoint folder" (a step), whose advice led back to the first.
    Both now say how many workers the checkpoint is of; a step that is really cut short
    names the files it lacks."""
    root, n = ck
    last = checkpoint.step_dir(str(root), n)
    for path, shown in ((root, last), (last, last)):
        with pytest.raises(ValueError) as e:
            checkpoint.resolve(str(path), 3)
        assert str(e.value) == (f"--resume {path}: step {os.path.basename(shown)} is a "
                                f"checkpoint of 2 workers, not 3; resume with --workers 2")
    cut = tmp_path / "ck"
    shutil.copytree(root, cut)
    step = checkpoint.step_dir(str(cut), n)
    os.remove(checkpoint.sidecar_file(step, 1))
    with pytest.raises(ValueError) as e:
        checkpoint.resolve(step, 2)
    assert str(e.value) == (f"--resume {step}: {step} has no sidecar-1.pt (cut short); "
                            f"give the checkpoint folder to use its newest complete step")


# -- a checkpoint file damaged on disk, NaN/inf in its state, replicas that differ --------
def _flip(path, xor: int) -> None:
    """The outside tester's damage: every 7th byte of 2000 in the middle of tensor data
    in ``path`` (its largest tensor: the file still loads as a torch archive, no zip
    header is hit) XORed with ``xor``. 0x01 keeps every float finite (a mantissa's or
    the exponent's lowest bit of values far from float32's range); 0xff may not."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        entry = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(open(path, "rb").read())
    head = entry.header_offset   # the local header: 30 bytes, the name, the extra field
    start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + \
        int.from_bytes(data[head + 28:head + 30], "little")
    mid = start + max(0, entry.file_size // 2 - 1000)
    for i in range(mid, min(mid + 2000, start + entry.file_size), 7):
        data[i] ^= xor
    with open(path, "wb") as f:
        f.write(data)


def _drop_digests(step) -> None:
    """Remove step folder ``step``'s sha256-<r>.txt: a step as a version before them
    wrote it."""
    for name in os.listdir(step):
        if name.startswith("sha256-"):
            os.unlink(os.path.join(step, name))


def test_a_checkpoint_file_damaged_on_disk_is_refused_naming_it(ck, tmp_path, caplog):
    """Outside tester: trainer-0.pt of a step with bytes flipped in rank 0's Adam
    moments (still a loadable archive) was resumed silently: exit 0, replicas not
    identical, no warning. Each rank's sha256-<r>.txt records its files' SHA-256 when
    the step is written; a file that no longer matches is refused naming it (a step
    given by name), or its step skipped with a warning naming it (the folder)."""
    src, n = ck
    root = tmp_path / "ck"
    shutil.copytree(src, root)
    newest = checkpoint.step_dir(str(root), n)
    before = checkpoint.step_dir(str(root), n - 1)
    bad = checkpoint.trainer_file(newest, 0)
    _flip(bad, 0x01)
    checkpoint.load(bad)   # loads, every value finite: only the digest can tell
    why = (f"{bad} does not match the SHA-256 that sha256-0.txt recorded when it was "
           f"written (damaged on disk, or changed since)")
    assert checkpoint.damaged(newest, 2) == why
    with pytest.raises(ValueError) as e:   # the step given by name: refused
        _check(newest, iterations=n + 5)
    assert str(e.value) == (f"{why}; resume from another step (--resume {root} takes the "
                            f"newest whose files are intact)")
    with caplog.at_level("WARNING", logger="dgt.checkpoint"):   # the folder: skipped
        assert checkpoint.resolve(str(root), 2) == before
    assert [r.getMessage() for r in caplog.records] == [
        f"--resume {root}: skipping a newer step: {why}"]
    assert checkpoint.latest(str(root), 2) == before   # --max-restarts' choice too
    # the tester's own damage, from the command line: one line, exit 2, nothing started
    _flip(bad, 0x01)
    _flip(bad, 0xff)
    p = _train(*RUN, "--iterations", n + 5, "--resume", newest, "--run-dir",
               tmp_path / "run", timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dgt train: error: {bad}"), lines
    assert not (tmp_path / "run" / "pids.json").exists()
    for r in (0, 1):   # sha256sum's format, checkable by hand (sha256sum -c)
        lines = open(os.path.join(before, f"sha256-{r}.txt")).read().splitlines()
        assert [ln[64:] for ln in lines] == [f"  sidecar-{r}.pt", f"  trainer-{r}.pt"]
    # a digest file that is not one is damage too
    with open(checkpoint.digest_file(newest, 0), "w") as f:
        f.write("junk\n")
    assert checkpoint.damaged(newest, 2) == (f"{checkpoint.digest_file(newest, 0)} is not "
                                             f"a list of this rank's SHA-256 digests "
                                             f"(damaged)")
    # a step written before the digests (no sha256-<r>.txt) still resumes, unchecked
    _drop_digests(before)
    assert checkpoint.damaged(before, 2) is None
    _check(before, iterations=n + 5)


def _nan_in(path, keys: tuple, value) -> None:
    """Fill the tensor at ``keys`` (a path of keys) of checkpoint file ``path`` with
    ``value`` and save it again, as a user with torch.load/torch.save would."""
    import torch
    state = torch.load(path, weights_only=True)
    d = state
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]].fill_(value)
    torch.save(state, path)


def test_nan_or_inf_in_a_checkpoint_state_is_refused_naming_the_file_and_field(
        ck, tmp_path, caplog):
    """Outside tester: rank 1's residual set to NaN (and ``empty`` False) in
    sidecar-1.pt was resumed: exit 0, no warning, another final hash, and all of rank
    1's blocks dropped as non-finite in every iteration. A NaN or inf in a floating
    tensor of either file (residual, scores, model, optimiser) is now refused at load,
    naming the file and the field, whether or not the step has digests."""
    import torch
    src, n = ck
    root = tmp_path / "ck"
    shutil.copytree(src, root)
    newest = checkpoint.step_dir(str(root), n)
    before = checkpoint.step_dir(str(root), n - 1)
    _drop_digests(newest)   # a step of a version without them: the load refuses
    side = checkpoint.sidecar_file(newest, 1)
    state = torch.load(side, weights_only=True)
    state["residual"]["residual"].fill_(float("nan"))
    state["residual"]["empty"] = False
    torch.save(state, side)
    size = state["residual"]["residual"].numel()
    why = (f"{side}: residual.residual holds {size} NaN or inf values (of {size}): the "
           f"file is damaged, or was saved from a broken run")
    with pytest.raises(ValueError) as e:
        checkpoint.load(side)
    assert str(e.value) == why
    with pytest.raises(ValueError) as e:
        _check(newest, iterations=n + 5)
    assert str(e.value) == (f"{why}; resume from another step (--resume {root} takes the "
                            f"newest whose files are intact)")
    with caplog.at_level("WARNING", logger="dgt.checkpoint"):
        assert checkpoint.resolve(str(root), 2) == before
    assert [r.getMessage() for r in caplog.records] == [
        f"--resume {root}: skipping a newer step: {why}"]
    p = _train(*RUN, "--iterations", n + 5, "--resume", newest, "--run-dir",
               tmp_path / "run", timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        f"dgt train: error: {why}; resume from another step (--resume {root} takes the "
        f"newest whose files are intact) (see 'dgt train --help')"], p.stderr
    # the trainer's model and optimiser state, and the sidecar's scores, likewise
    trainer = checkpoint.trainer_file(before, 0)
    st = torch.load(trainer, weights_only=True)
    moment, param = next(iter(st["optimizer"]["state"])), next(iter(st["model"]))
    for path, keys, value in (
            (trainer, ("optimizer", "state", moment, "exp_avg"), float("inf")),
            (trainer, ("model", param), float("-inf")),
            (checkpoint.sidecar_file(before, 0), ("scores", "scores"), float("nan"))):
        field = ".".join(map(str, keys))
        saved = open(path, "rb").read()
        _nan_in(path, keys, value)
        with pytest.raises(ValueError) as e:
            checkpoint.load(path)
        assert str(e.value).startswith(f"{path}: {field} holds "), str(e.value)
        with open(path, "wb") as f:
            f.write(saved)
    checkpoint.load(trainer)


def test_a_run_whose_replicas_end_different_warns_and_exits_1(ck, tmp_path):
    """Outside tester: a resumed run whose rank 0 started from other Adam moments ended
    "replicas identical False", exit 0, report warnings []. Such a run now ends with a
    warning on stderr, in the summary and the report, and exit status 1. The moments
    differ here in a step without digests (as an older version wrote it), finite: no
    check before the start can tell."""
    import torch
    src, n = ck
    step = tmp_path / "step" / os.path.basename(checkpoint.step_dir(str(src), n - 1))
    shutil.copytree(checkpoint.step_dir(str(src), n - 1), step)
    _drop_digests(step)
    path = checkpoint.trainer_file(str(step), 0)
    state = torch.load(path, weights_only=True)
    for moments in state["optimizer"]["state"].values():
        moments["exp_avg"].mul_(3.0)
    torch.save(state, path)
    report = tmp_path / "r.json"
    p = _train(*RUN, "--epochs", 1, "--resume", step, "--run-dir", tmp_path / "run",
               "--report", report, timeout=180)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(report.read_text())
    assert not r["replicas_identical"] and r["iterations"] == n
    a, b = r["param_sha256"]
    msg = (f"the replicas are not identical at the end: 2 different parameter SHA-256 "
           f"over 2 ranks (rank [0] {a[:16]}…, rank [1] {b[:16]}…); the ranks did not "
           f"train the same model (resumed from a damaged checkpoint?), so the numbers of "
           f"this run describe no single model")
    assert r["warnings"] == [msg]
    assert f"warning: {msg}" in p.stdout
    assert p.stderr.strip().splitlines()[-1] == f"dgt train: warning: {msg}; exit status 1"


@pytest.mark.timeout(60)
def test_a_digest_file_that_is_a_fifo_is_damage_not_a_hang(tmp_path):
    """sha256-<r>.txt is read only when it is a regular file: a FIFO there blocked the
    resume for ever (found reviewing the digests' first version)."""
    os.mkfifo(tmp_path / "sha256-0.txt")
    why = checkpoint.tampered(str(tmp_path), 0)
    assert why == f"{tmp_path}/sha256-0.txt: a FIFO, not a regular file (damaged)", why
