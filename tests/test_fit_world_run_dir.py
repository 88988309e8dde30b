"""Outside tester, faults F2, F8, F9 and a nit: each a one-line refusal that says what
works, before anything is written.

F2: with a Fashion-MNIST --data-dir of 2 training images, ``dgt train`` said "use
--batch-size <= 1"; following it gave the same error again (4 workers need 4 samples).
F8: ``dgt sidecar --world 100000`` was accepted, and after 30 s printed one 689 kB ERROR
line naming ranks 1..99999. F9: ``dgt train --run-dir /etc`` (as root) exited 0 and
left 26 files in /etc. Nit: ``--dataset digits --data-dir X`` ignored --data-dir
silently.
"""
import gzip
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from dgt.config import JobConfig
from dgt.failure import FailureReason, FailureRecord
from dgt.job import check_workload
from dgt.workloads import datasets


def _dgt(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "dgt.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def _one_line(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmnist(folder, n: int, n_test: int = 4):
    """Fashion-MNIST's four IDX files with ``n`` training images (labels 0, 1, ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for key, base in datasets._FMNIST_FILES.items():
        m = n if key.endswith("train") else n_test
        arr = rng.integers(0, 256, (m, 28, 28)) if key.startswith("x") else np.arange(m) % 10
        magic = 0x803 if key.startswith("x") else 0x801
        head = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big")
                                                   for d in arr.shape)
        with gzip.open(folder / (base + ".gz"), "wb") as f:
            f.write(head + arr.astype(np.uint8).tobytes())
    return folder


# ------------------------------------------------------------------ F2: advice that fits


def _options(message: str) -> list[dict]:
    """The alternatives of a refusal's advice ("use A or B"), each as the flags to set."""
    advice = message.rpartition("; use ")[2]
    out = []
    for alt in advice.split(" or "):
        flags = {}
        for flag, value in re.findall(r"--(workers|batch-size) (?:<= )?(\d+)", alt):
            flags[flag.replace("-", "_")] = int(value)
        m = re.search(r"--partition (shards:\d+)", alt)
        if m:
            flags["partition"] = m.group(1)
        out.append(flags)
    return out


@pytest.mark.parametrize("n,workers,batch,part", [
    (2, 4, 32, "iid"),      # the tester's: even batch 1 is too many for 4 workers
    (2, 4, 1, "iid"),       # the advice it gave, followed
    (3, 64, 32, "iid"),
    (1, 2, 5, "iid"),
    (5, 4, 2, "iid"),       # the batch alone, or the workers alone, fixes it
    (100, 4, 32, "iid"),
    (7, 3, 3, "dirichlet:1"),
    (4, 2, 1, "shards:3"),  # fits the batch, not the shards: 2 x 3 > 4
    (9, 4, 2, "shards:4"),
])
def test_following_the_advice_fits(tmp_path, n, workers, batch, part):
    data = _fmnist(tmp_path / "fm", n)
    job = JobConfig(dataset="fashion-mnist", data_dir=str(data), workers=workers,
                    batch_size=batch, partition=part)
    with pytest.raises(ValueError) as e:
        check_workload(job)
    message = str(e.value)
    assert "\n" not in message
    options = _options(message)
    assert options and all(options), message   # every alternative names numbers
    for flags in options:
        fixed = JobConfig(**{**job.__dict__, **flags})
        check_workload(fixed)   # no ValueError: the advice works as given
        fixed.validate()


def test_the_testers_command_gets_advice_that_works(tmp_path):
    data = _fmnist(tmp_path / "fm", 2)
    base = ("train", "--dataset", "fashion-mnist", "--data-dir", data, "--iterations", 2)
    line = _one_line(_dgt(*base))
    assert "exceeds the 2 training samples" in line
    assert "use --workers <= 2 with --batch-size 1" in line, line
    line = _one_line(_dgt(*base, "--batch-size", 1))   # half the advice: the other half
    assert line.endswith("use --workers <= 2 (see 'dgt train --help')"), line


# ------------------------------------------------------------------ F8: at most 64 ranks


@pytest.mark.parametrize("args,env", [
    (["--rank", 0, "--world", 100000], {}),
    (["--rank", 0], {"DGT_WORLD": "65"}),
    ([], {"WORLD_SIZE": "100000", "RANK": "0"}),
], ids=["flag", "DGT_WORLD", "WORLD_SIZE"])
def test_sidecar_world_is_capped_as_train_workers(tmp_path, args, env):
    run = tmp_path / "run"
    run.mkdir()
    env_ = {k: v for k, v in os.environ.items()
            if k not in ("DGT_WORLD", "DGT_RANK", "WORLD_SIZE", "RANK")}
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "sidecar", *map(str, args),
                        "--master-port", str(_free_port()), "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=20, env={**env_, **env})
    line = _one_line(p)
    assert "--world must be 1..64 (the flag, env DGT_WORLD or torchrun's WORLD_SIZE)" \
        in line, line
    assert len(line) < 300 and os.listdir(run) == []
    assert "must be 1..64" in _one_line(_dgt("train", "--workers", 65))


def test_messages_that_list_ranks_abbreviate_long_lists():
    from dgt.rank_list import rank_list
    assert rank_list([2]) == "[2]" and rank_list([0, 1, 3]) == "[0, 1, 3]"
    long = rank_list(range(1, 100000))
    assert long == "[1, 2, 3, 4, 5, …, 99999] (99999 ranks)", long
    rec = FailureRecord("sidecar", 0, FailureReason.PEER_SILENT, "x",
                        blamed=list(range(1, 64)))
    head = rec.headline_blame(0)
    assert head == "rank(s) [1, 2, 3, 4, 5, …, 63] (63 ranks) stopped answering (dead " \
                   "or frozen)", head
    from dgt.report import _warnings
    [w] = _warnings([{"rank": r, "warnings": ["w"]} for r in range(40)])
    assert w == "rank(s) [0, 1, 2, 3, 4, …, 39] (40 ranks): w", w


# ------------------------------------------------------------- F9: a run dir of dgt's own


@pytest.fixture
def foreign_dir(tmp_path):
    """A folder as /etc or a home folder is: files that are not dgt's, and none of dgt's
    run files as a regular file (a link of such a name does not make it a run dir)."""
    d = tmp_path / "etc"
    d.mkdir()
    (d / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (d / "trainer-0.log").symlink_to(d / "passwd")
    return d


def _listing(folder):
    return sorted((p.name, p.read_bytes()) for p in folder.iterdir())


def test_train_refuses_a_run_dir_with_foreign_files(foreign_dir):
    before = _listing(foreign_dir)
    line = _one_line(_dgt("train", "--run-dir", foreign_dir, "--workers", 2,
                          "--iterations", 1, "--hidden", 16, timeout=240))
    assert f"--run-dir {foreign_dir} holds files that are not dgt's (passwd); give a " \
           f"new or empty folder" in line, line
    assert _listing(foreign_dir) == before   # no lock, no log, nothing truncated


def test_sidecar_refuses_a_run_dir_with_foreign_files(foreign_dir, tmp_path):
    before = _listing(foreign_dir)
    line = _one_line(_dgt("sidecar", "--rank", 0, "--world", 1, "--master-port",
                          _free_port(), "--socket", tmp_path / "s.sock", "--run-dir",
                          foreign_dir, timeout=20))
    assert f"--run-dir {foreign_dir} holds files that are not dgt's (passwd)" in line
    assert _listing(foreign_dir) == before


def test_many_foreign_files_are_named_in_one_short_line(tmp_path):
    from dgt.run_files import check_run_dir
    for i in range(500):
        (tmp_path / f"f{i:03d}").write_text("")
    (tmp_path / ".hidden").write_text("")
    with pytest.raises(ValueError) as e:
        check_run_dir(str(tmp_path))
    assert f"--run-dir {tmp_path} holds files that are not dgt's (f000, f001, f002 and " \
           f"498 more); give a new or empty folder" in str(e.value)


def test_an_earlier_jobs_run_dir_with_its_checkpoints_is_accepted(tmp_path):
    """What dgt leaves (the names clear_previous removes, and what it keeps: lock, a
    report, checkpoints, attempt folders, a socket) passes the rule; a run of dgt train
    uses such a folder, its own --checkpoint-dir and --report inside it."""
    from dgt.run_files import JOB_FILES, KEPT_FILES, RANK_FILES, foreign
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run / "attempt-1").mkdir()
    (run / "ck" / "step-00000002").mkdir(parents=True)   # --checkpoint-dir run/ck
    for name in [t.format(r) for t in RANK_FILES for r in (0, 1, 12)] + \
            list(JOB_FILES) + list(KEPT_FILES) + [".pids.json.k3x_9a1q.tmp"]:
        (run / name).write_text("old")
    for name in KEPT_FILES:   # an earlier dgt plot's figures are PNGs (dgt plot
        if name.endswith(".png"):   # replaces nothing else: dgt.plot.save_png)
            (run / name).write_bytes(b"\x89PNG\r\n\x1a\n" + b"old")
    (run / "my-report.json").write_text("{}")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(run / "x.sock"))
    assert foreign(str(run), keep=(str(run / "ck"), str(run / "my-report.json"))) == []
    # an earlier job's run dir (its run files there): the rest is the user's
    assert foreign(str(run)) == []
    (run / "x.sock").unlink()
    p = _dgt("train", "--run-dir", run, "--workers", 2, "--iterations", 1, "--hidden", 16,
             "--checkpoint-every", 1, "--checkpoint-dir", run / "ck",
             "--report", run / "my-report.json", timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (run / "ck" / "step-00000001").is_dir()
    # dgt plot RUN_DIR writes its figures there: still a run dir of dgt's
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "plot", str(run)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and (run / "comm_time.png").exists(), p.stderr
    assert foreign(str(run), keep=(str(run / "ck"), str(run / "my-report.json"))) == []


# --------------------------------------------------------------------- nit: digits' --data-dir


def test_digits_with_a_data_dir_warns_in_one_line(tmp_path):
    p = _dgt("train", "--dataset", "digits", "--data-dir", tmp_path,
             "--report", tmp_path / "no-such-folder" / "r.json")   # stops after the warning
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[0] == (f"dgt train: warning: --data-dir {tmp_path} (or DGT_DATA_DIR) is "
                        f"ignored: --dataset digits ships with scikit-learn"), p.stderr
    assert len(lines) == 2 and "--report" in lines[1]


# ------------------------------------------- outside tester: reusing an earlier job's run dir


def test_a_new_folder_holds_only_dgts_names_and_the_jobs_own_paths(tmp_path):
    """A folder with none of dgt's run files passes with dgt's other names and the paths
    the job itself names there (``keep``), and no others."""
    from dgt.run_files import check_run_dir, foreign
    run = tmp_path / "run"
    (run / "ck").mkdir(parents=True)
    (run / "sidecar-0.log").symlink_to(run / "lock")   # a link: not a run file of a job
    for name in ("lock", "report.json", "my-report.json"):
        (run / name).write_text("x")
    assert foreign(str(run), keep=(str(run / "ck"), str(run / "my-report.json"))) == []
    assert foreign(str(run)) == ["ck", "my-report.json"]
    with pytest.raises(ValueError) as e:
        check_run_dir(str(run))
    assert str(e.value) == (
        f"--run-dir {run} holds files that are not dgt's (ck, my-report.json); give a new "
        f"or empty folder, or the run dir of an earlier dgt job (one that holds a file it "
        f"wrote, e.g. pids.json or sidecar-0.log)")


@pytest.mark.parametrize("own", ["sidecar-0.log", "endpoints-0.json", "pids.json",
                                 "failure.json", "trace-3.jsonl"])
def test_an_earlier_jobs_run_dir_keeps_the_users_files(tmp_path, own):
    """One of dgt's run files as a regular file makes a folder an earlier job's run dir:
    its other files (a report, checkpoints, a DDP script's outputs) are the user's, and
    the folder passes as it is (DGT_RUN_DIR of dgt.ddp.node reads the same rule)."""
    from dgt.run_files import check_run_dir, foreign
    run = tmp_path / "d2"
    (run / "ck" / "step-1").mkdir(parents=True)
    (run / "rep").write_text("{}")
    (run / "myreport.json").write_text("{}")
    (run / own).write_text("old")
    assert foreign(str(run)) == []
    check_run_dir(str(run), flag="DGT_RUN_DIR")


def test_the_same_train_command_runs_again_in_its_run_dir(tmp_path):
    """The tester's g4/g2: a job gave its --report and --checkpoint-dir inside its run
    dir; the next job in that run dir (without them) was refused, 'not dgt's
    (ck, myreport.json)'. Now it runs, and leaves the user's files alone."""
    run = tmp_path / "g4"
    run.mkdir()
    common = ("train", "--workers", 2, "--iterations", 2, "--hidden", 16, "--run-dir", run)
    p = _dgt(*common, "--report", run / "myreport.json", "--checkpoint-every", 1,
             "--checkpoint-dir", run / "ck", timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    report = (run / "myreport.json").read_bytes()
    steps = sorted(os.listdir(run / "ck"))
    p = _dgt(*common, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (run / "myreport.json").read_bytes() == report
    assert sorted(os.listdir(run / "ck")) == steps


# ----------------------------------------- outside tester: the run dir's lock, a dangling link


def _launcher_line(p) -> str:
    """The one line the launcher says when it refuses to start: on stderr, nothing on
    stdout (a user who sent stdout to a file still sees it)."""
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and not p.stdout, (p.stdout, p.stderr)
    return lines[0]


def test_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim" / "v.txt"
    victim.parent.mkdir()
    victim.write_text("important\n")
    run = tmp_path / "f6"
    run.mkdir()
    (run / "lock").symlink_to(victim)
    line = _launcher_line(_dgt("train", "--workers", 2, "--iterations", 2, "--hidden",
                               16, "--run-dir", run, timeout=240))
    assert line == f"dgt train: --run-dir {run}: its lock ({run / 'lock'}) is a symbolic " \
                   f"link; remove it", line
    assert victim.read_text() == "important\n"
    assert sorted(os.listdir(run)) == ["lock"] and (run / "lock").is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_lock_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, kind):
    run = tmp_path / "f7"
    run.mkdir()
    if kind == "fifo":
        os.mkfifo(run / "lock")
    else:
        (run / "lock").mkdir()
    (run / "sidecar-0.log").write_text("old")   # an earlier job's run dir: rule passes
    line = _launcher_line(_dgt("train", "--workers", 2, "--iterations", 2, "--hidden",
                               16, "--run-dir", run, timeout=240))
    assert line == f"dgt train: --run-dir {run}: its lock ({run / 'lock'}) is not a " \
                   f"regular file; remove it", line
    assert sorted(os.listdir(run)) == ["lock", "sidecar-0.log"]


def test_a_dangling_run_dir_link_is_named_as_one(tmp_path):
    link = tmp_path / "dlink"
    link.symlink_to(tmp_path / "nowhere")
    p = _dgt("train", "--workers", 2, "--iterations", 2, "--hidden", 16, "--run-dir", link)
    line = _one_line(p)
    assert f"--run-dir {link} is a dangling symbolic link to {tmp_path / 'nowhere'}; " \
           f"remove it, or create the folder it names" in line, line
    assert not (tmp_path / "nowhere").exists()


def test_a_restart_moves_files_into_the_run_dir_never_through_a_link(tmp_path):
    """restart_from moves the failed attempt's files to attempt-<i>/: an attempt-1 that
    is a link to another folder had them moved (over same-named files) there."""
    from dgt.config import JobConfig, TransmissionConfig
    from dgt.launch import Job
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (elsewhere / "trainer-0.log").write_text("not the job's\n")
    (run / "attempt-1").symlink_to(elsewhere)
    (run / "trainer-0.log").write_text("attempt 1\n")
    j = Job(JobConfig(run_dir=str(run), workers=2), TransmissionConfig(), log=lambda *a: None)
    j.restart_from("")
    assert (elsewhere / "trainer-0.log").read_text() == "not the job's\n"
    assert not (run / "attempt-1").is_symlink()
    assert (run / "attempt-1" / "trainer-0.log").read_text() == "attempt 1\n"


def test_a_port_that_cannot_be_bound_is_not_blamed_on_the_run_dir(tmp_path):
    """Breaker round 6 left this host's ephemeral ports used up (36,000 loopback
    connections) while a CI run went on: its jobs failed with 'RUN_DIR: Address already
    in use (...); children stopped (is --run-dir RUN_DIR still there, with free
    space?)', blaming the run dir. The error of a bind that found no port says so."""
    import socket

    from dgt.launch import launch_failure
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        try:
            b.bind(a.getsockname())
        except OSError as e:
            busy = e
    text = launch_failure(busy, str(tmp_path))
    assert text.startswith("no local port could be bound (Address already in use)"), text
    assert "run-dir" not in text and "\n" not in text
    full = launch_failure(OSError(28, "No space left on device", "/r/x.log"), "/r")
    assert full == ("/r/x.log: No space left on device (is --run-dir /r still there, "
                    "with free space?)"), full
