"""What dgt train says when the process it starts in cannot work (breaker round 4): a
current folder that was removed (torch's libraries then fail to load, and oneMKL printed
'FATAL ERROR: Cannot load libtorch_cpu.so'), and an address-space limit below what
torch's start-up needs (a SystemError or MemoryError traceback from 'import torch')."""
import resource
import subprocess
import sys


def test_a_removed_current_folder_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    p = subprocess.run(["sh", "-c", f"cd {gone} && rmdir {gone} && exec {sys.executable} "
                        f"-m dgt.cli train --workers 2 --iterations 2 --hidden 16"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr == ("dgt: error: the current folder no longer exists (it was removed "
                        "after this shell entered it); cd to one that does\n"), p.stderr


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (400 << 20, resource.RLIM_INFINITY))


def test_too_little_address_space_for_torch_is_one_line(tmp_path):
    """400 MiB: enough for Python and the flags, not for torch's libraries (an outside
    tester's 600 MiB failed later in torch's start-up with a SystemError traceback, or
    in its threads, depending on the host's cores)."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "2",
                        "--iterations", "2", "--hidden", "16", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120, preexec_fn=_limit_address_space)
    assert p.returncode == 2, (p.stdout, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgt: error: import torch failed ("), \
        p.stderr[-2000:]
    assert lines[0].endswith("the address-space limit (ulimit -v) is 400 MiB and torch "
                             "needs more: raise it"), lines[0]


def _open_files(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_open_file_limit_too_low_to_raise_is_one_line(tmp_path):
    """ulimit -n 24 (hard 24): before, the job failed on whatever ran out first ('Failed
    to init uv loop', a traceback in a sidecar's log); now one line before it starts."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "4",
                        "--iterations", "2", "--hidden", "16", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120, preexec_fn=_open_files(24, 24))
    assert p.returncode == 2, (p.stdout, p.stderr[-2000:])
    assert p.stderr.startswith("dgt train: error: the open-file limit (ulimit -n) is 24, "
                               "at most 24 for this user; a job of 4 ranks needs 80: "
                               "raise it"), p.stderr[-2000:]
    assert not (tmp_path / "run").exists()   # nothing started


def test_a_low_soft_open_file_limit_is_raised_for_the_job(tmp_path):
    """ulimit -n 24 with a hard limit of 4096: the job raises its soft limit (its
    children inherit it) and runs."""
    p = subprocess.run([sys.executable, "-m", "dgt.cli", "train", "--workers", "4",
                        "--iterations", "2", "--hidden", "16", "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=240, preexec_fn=_open_files(24, 4096))
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert "replicas identical    True" in p.stdout, p.stdout[-2000:]


def test_a_sidecar_under_an_open_file_limit_too_low_is_one_line(tmp_path):
    """dgt sidecar (and python -m dgt.sidecar, which dgt.ddp starts) checks it too."""
    for argv in (["-m", "dgt.cli", "sidecar"], ["-m", "dgt.sidecar"]):
        p = subprocess.run([sys.executable, *argv, "--rank", "0", "--world", "4",
                            "--run-dir", str(tmp_path / "run"), "--socket",
                            str(tmp_path / "s.sock")], capture_output=True, text=True,
                           timeout=120, preexec_fn=_open_files(20, 20))
        assert p.returncode == 2, (argv, p.stdout, p.stderr[-2000:])
        assert "error: the open-file limit (ulimit -n) is 20, at most 20 for this user; " \
               "a job of 4 ranks needs 80: raise it" in p.stderr, p.stderr[-2000:]
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
