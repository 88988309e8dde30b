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
    """A folder as /etc or a home folder is: files that are not dgt's."""
    d = tmp_path / "etc"
    d.mkdir()
    (d / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (d / "trainer-0.log").write_text("a file of that name, not dgt's to keep\n")
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
    (run / "my-report.json").write_text("{}")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(run / "x.sock"))
    assert foreign(str(run), keep=(str(run / "ck"), str(run / "my-report.json"))) == []
    assert foreign(str(run)) == ["ck", "my-report.json"]
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
