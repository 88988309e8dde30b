"""A folder that dgt writes into by name (``dgt train --run-dir`` and
``--checkpoint-dir``, a hand-started sidecar's ``--run-dir``, the DDP hook's
``DGT_RUN_DIR``) must be this user's alone: owned by this uid, not writable by group or
others (dgt.unixsock.owned_dir). Breaker round, stop 33: in a --run-dir that another
user could write, that user planted ``trainer-0.log`` as a symbolic link to a root file,
and a root job truncated the file and wrote its log through the link."""
import os
import socket
import subprocess
import sys

import pytest

JOB = ("--workers", 2, "--iterations", 2, "--hidden", 32)


def _dgt(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgt.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    return lines[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a folder of uid 65534)")
def test_a_run_dir_of_another_user_is_refused_before_anything_is_written(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("root's file\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    link = theirs / "trainer-0.log"   # what user 65534 would plant
    link.symlink_to(victim)
    os.lchown(link, 65534, 65534)
    line = _one_line(_dgt("train", *JOB, "--run-dir", theirs))
    assert line.startswith(f"dgt train: --run-dir {theirs} is owned by uid 65534"), line
    # not ours to chmod, and a subfolder there that user could swap: neither is advised
    assert "chmod" not in line and "mkdir" not in line, line
    assert victim.read_text() == "root's file\n"
    assert os.listdir(theirs) == ["trainer-0.log"]   # no lock, no log, nothing


@pytest.mark.parametrize("mode", [0o1777, 0o777])
@pytest.mark.parametrize("flag", ["--run-dir", "--checkpoint-dir"])
def test_a_folder_other_users_can_write_is_refused(tmp_path, flag, mode):
    """...with advice that is right for the folder and, followed, gives a folder that is
    used: ``chmod go-w`` for a folder of ours; for a sticky one like /tmp (shared by
    design, even when root owns it and runs the job) a subfolder instead. The breaker
    was told to ``chmod go-w /tmp``, which breaks the system's /tmp."""
    from dgt.unixsock import owned_dir
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    extra = ("--checkpoint-every", 1) if flag == "--checkpoint-dir" else ()
    line = _one_line(_dgt("train", *JOB, flag, shared, *extra))
    assert line.startswith("dgt train: "), line
    assert f"{flag} {shared} is writable by other users (mode {mode:o})" in line, line
    assert os.listdir(shared) == []
    if mode & 0o1000:
        assert "chmod" not in line, line
        assert f"(mkdir -m 700 {shared}/NAME and give that)" in line, line
        os.mkdir(shared / "NAME", 0o700)
        assert owned_dir(str(shared / "NAME"), flag)   # the advice, followed, is enough
    else:
        assert f"(chmod go-w {shared})" in line, line
        shared.chmod(mode & ~0o022)
        assert owned_dir(str(shared), flag)


def test_a_folder_of_ours_that_only_we_can_write_is_used(tmp_path):
    # the check refuses only what it must: a 0755 folder of ours, made by hand, is fine
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    p = _dgt("train", *JOB, "--run-dir", mine, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (mine / "sidecar-0.json").exists()


def test_a_hand_started_sidecar_refuses_such_a_run_dir(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    port = _free_port()
    line = _one_line(_dgt("sidecar", "--rank", 0, "--world", 1, "--master-port", port,
                          "--socket", tmp_path / "s.sock", "--run-dir", shared))
    assert f"--run-dir {shared} is writable by other users (mode 777)" in line, line
    assert os.listdir(shared) == []


def test_the_ddp_hook_refuses_such_a_dgt_run_dir(tmp_path, monkeypatch):
    import torch.distributed as dist

    from dgt.ddp import DgtState
    from dgt.unixsock import NotOurs
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    port = _free_port()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "TORCHELASTIC_RUN_ID": "job-a", "DGT_RUN_DIR": str(shared)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DGT_SOCKET", raising=False)
    dist.init_process_group("gloo")
    try:
        with pytest.raises(NotOurs, match="DGT_RUN_DIR .* is writable by other users"):
            DgtState(timeout_s=30)
    finally:
        dist.destroy_process_group()
    assert os.listdir(shared) == []
