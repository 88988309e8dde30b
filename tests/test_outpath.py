"""An output flag replaces only a file of the kind it writes (dgt.outpath): breaker
round, stop 31, where ``dgt train --report notes.txt`` replaced the notes with a JSON
report, made it mode 0600, and as root ``--report /etc/passwd`` replaced that."""
import errno
import json
import os
import stat
import subprocess
import sys

import pytest

from conftest import device_node

from dgt import atomic, outpath


def _dgt(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dgt.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_a_report_never_replaces_a_file_that_is_not_json(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    p = _dgt("train", "--workers", "2", "--iterations", "2", "--report", str(notes))
    assert p.returncode == 2
    assert f"--report {notes}: it exists and is not a JSON file" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert notes.read_text() == "my notes\n"


def test_a_rerun_replaces_its_own_report_and_keeps_its_mode(tmp_path):
    """An earlier report (JSON) is replaced; the file keeps its mode (0644 here), and a
    new report gets 0666 less the umask, not mkstemp's 0600."""
    old = tmp_path / "report.json"
    old.write_text('{"earlier": true}')
    os.chmod(old, 0o640)
    new = tmp_path / "new.json"
    for path in (old, new):
        p = _dgt("train", "--workers", "2", "--iterations", "2", "--report", str(path))
        assert p.returncode == 0, p.stderr
        assert "replicas_identical" in json.loads(path.read_text())
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a file of another uid)")
def test_root_replacing_another_users_file_does_not_take_its_mode(tmp_path):
    """Breaker round 9: as root, ``--report /tmp/o.json`` over uid 65534's JSON file of
    mode 0666 left root's report writable by every user (the old file's mode was
    copied). Only the mode of a file of our own is kept."""
    theirs = tmp_path / "o.json"
    theirs.write_text("{}")
    os.chown(theirs, 65534, 65534)
    os.chmod(theirs, 0o666)
    atomic.write_json(str(theirs), {"new": 1})
    st = theirs.stat()
    umask = os.umask(0o022)
    os.umask(umask)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o666 & ~umask & 0o777 \
        and not st.st_mode & 0o002, oct(st.st_mode)


@pytest.mark.parametrize("kind,good,bad", [
    ("json", b'{"a": 1}\n', b"root:x:0:0:root:/root:/bin/bash\n"),
    ("png", b"\x89PNG\r\n\x1a\n" + b"\0" * 8, b"GIF89a"),
    ("pcap", b"\xd4\xc3\xb2\xa1" + b"\0" * 20, b"#!/bin/sh\n"),
])
def test_each_kind_replaces_its_own_and_nothing_else(tmp_path, kind, good, bad):
    mine, other, empty = tmp_path / "mine", tmp_path / "other", tmp_path / "empty"
    mine.write_bytes(good)
    other.write_bytes(bad)
    empty.write_bytes(b"")
    assert outpath.foreign(str(mine), kind) is None
    assert outpath.foreign(str(empty), kind) is None
    assert outpath.foreign(str(tmp_path / "new"), kind) is None
    assert outpath.foreign(os.devnull, kind) is None   # not a regular file: written through
    assert "remove it or give another path" in outpath.foreign(str(other), kind)


def test_write_json_refuses_a_foreign_file_and_leaves_it(tmp_path):
    """The last line of defence, for every JSON writer (bench tools' --json, records)."""
    target = tmp_path / "script.sh"
    target.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(FileExistsError):
        atomic.write_json(str(target), {"a": 1})
    assert target.read_text() == "#!/bin/sh\necho hi\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_tool_output_flag_refuses_a_foreign_file(tmp_path):
    """dgt pcap summary --json and --plot (tools/cli.check_output) go by the same rule."""
    txt = tmp_path / "notes.txt"
    txt.write_text("keep me\n")
    for flag in ("--json", "--plot"):
        p = _dgt("pcap", "summary", "/nonexistent.pcap", flag, str(txt))
        assert p.returncode == 2, p.stderr
        assert f"cannot write {txt} ({flag}): it exists and is not a" in p.stderr
    assert txt.read_text() == "keep me\n"


def test_an_output_whose_folder_is_not_one_names_the_real_cause(tmp_path):
    """Breaker round 11: --report under a regular file, or under a symbolic link loop,
    said 'folder ... does not exist'; --json /proc/x.json said 'no folder /proc'."""
    from dgt.config import JobConfig
    from dgt.launch import check_paths
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for report, says in ((afile / "r.json", f"{afile} is not a folder"),
                         (tmp_path / "loop" / "r.json", "Too many levels of symbolic links"),
                         (tmp_path / "none" / "r.json", "does not exist")):
        with pytest.raises(ValueError) as e:
            check_paths(JobConfig(report=str(report)))
        assert says in str(e.value), str(e.value)
    p = _dgt("pcap", "summary", "/nonexistent.pcap", "--json", "/proc/x.json")
    assert p.returncode == 2 and "no file can be made in /proc" in p.stderr, p.stderr
    p = _dgt("pcap", "summary", "/nonexistent.pcap", "--json", str(tmp_path / "n" / "x.json"))
    assert p.returncode == 2 and f"no folder {tmp_path / 'n'}" in p.stderr, p.stderr


def _still_a_device(path: str) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


def test_a_device_is_written_through_never_replaced(tmp_path, dev_full):
    """Breaker round, stop 40: as root, ``--report /dev/full`` renamed the report over
    /dev/full (and a JSON output over /dev/null), leaving regular files where the
    devices were; and the write that should have failed (ENOSPC) was never made."""
    null, full = device_node(tmp_path, "null", 3), dev_full
    atomic.write_json(null, {"a": 1}, fsync=True)
    assert _still_a_device(null)
    with pytest.raises(OSError) as e:
        atomic.write_json(full, {"a": 1}, fsync=True)
    assert e.value.errno == 28 and e.value.filename == full, e.value   # ENOSPC
    assert _still_a_device(full)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_fifo_gets_the_bytes_and_stays_a_fifo(tmp_path):
    fifo = str(tmp_path / "out.fifo")
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", fifo], stdout=subprocess.PIPE)
    atomic.write_json(fifo, {"a": 1})
    assert json.loads(reader.communicate(timeout=30)[0]) == {"a": 1}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.timeout(60)
def test_a_fifo_no_one_reads_is_an_error_not_a_hang(tmp_path):
    # breaker round 5: dgt train --report FIFO trained, printed its summary, then
    # blocked in open() for ever (no reader)
    fifo = str(tmp_path / "out.fifo")
    os.mkfifo(fifo)
    with pytest.raises(OSError) as e:
        atomic.write_json(fifo, {"a": 1})
    assert e.value.errno == errno.ENXIO and e.value.filename == fifo, e.value
    assert "no process opened for reading within" in str(e.value)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.timeout(120)
def test_train_report_to_a_fifo_no_one_reads_is_one_line_and_exit_1(tmp_path):
    fifo = str(tmp_path / "report.fifo")
    os.mkfifo(fifo)
    p = _dgt("train", "--workers", "2", "--iterations", "2", "--report", fifo)
    assert p.returncode == 1, p.stderr
    assert f"cannot write --report {fifo}: a FIFO that no process opened for reading " \
        "within 10 s" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_train_report_to_a_full_device_is_one_line_and_exit_1(dev_full):
    full = dev_full
    p = _dgt("train", "--workers", "2", "--iterations", "2", "--report", full)
    assert p.returncode == 1, p.stderr
    out = p.stdout + p.stderr
    assert f"cannot write --report {full}: No space left on device" in out, out
    assert f"report: {full}" not in out
    assert _still_a_device(full)


def test_a_user_may_send_the_report_to_dev_null(shared_tmp):
    """/dev/null is written through, so the folder it is in (/dev, not this user's to
    write) is not asked to hold a new file: as uid 65534 --report /dev/null was refused
    with 'cannot create a file in /dev'. The paths are checked before --resume, so a
    --resume that does not exist is the first thing refused once --report passes (the
    job's children are not started: this interpreter may live where uid 65534 cannot
    start it again)."""
    from conftest import as_nobody
    nobody = as_nobody()
    os.chown(shared_tmp, 65534, 65534)   # theirs: tmp_path is 0700
    missing = os.path.join(shared_tmp, "no-such-checkpoint")
    p = subprocess.run(nobody + [sys.executable, "-m", "dgt.cli", "train", "--workers", "2",
                                 "--iterations", "2", "--report", os.devnull,
                                 "--resume", missing],
                       capture_output=True, text=True, timeout=300, cwd=shared_tmp)
    assert p.returncode == 2, p.stderr
    assert "--report" not in p.stderr and f"--resume {missing}" in p.stderr, p.stderr
    assert _still_a_device(os.devnull)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a file of another uid)")
def test_another_users_file_in_a_sticky_folder_is_refused_before_the_work():
    """Breaker round 8: as uid 65534, ``dgt train --report /tmp/x.json`` over root's
    file passed the check before training and failed after it (rename(2) over another
    user's file in a sticky folder: EPERM), exit 1 for a job that had succeeded. Now
    the check before the work refuses it (dgt train's and the tools' output flags), and
    the writer really cannot replace it. A child process drops to uid 65534."""
    import shutil
    import tempfile

    from dgt.launch import _check_report
    from dgt.tools.cli import check_output
    folder = tempfile.mkdtemp(prefix="dgt-sticky-", dir="/tmp")
    try:
        os.chmod(folder, 0o1777)
        theirs = os.path.join(folder, "r.json")
        with open(theirs, "w") as f:
            f.write("{}")
        os.chmod(theirs, 0o666)   # writable by all: only the rename is refused
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: uid 65534, then each writer's verdict
            said = []
            try:
                os.setresgid(65534, 65534, 65534)
                os.setgroups([])
                os.setresuid(65534, 65534, 65534)
                for check in (lambda: _check_report(theirs),
                              lambda: check_output("--json", theirs),
                              lambda: atomic.write_json(theirs, {"new": 1})):
                    try:
                        check()
                        said.append("accepted")
                    except (ValueError, OSError) as e:
                        said.append(str(e))
            finally:
                os.write(w, json.dumps(said).encode())
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            said = json.loads(f.read() or "[]")
        os.waitpid(pid, 0)
        assert len(said) == 3, said
        for line in said[:2]:
            assert "is another user's file (uid 0) in a sticky folder" in line, said
        assert "Operation not permitted" in said[2], said   # what the check foresaw
        with open(theirs) as f:
            assert f.read() == "{}"
    finally:
        shutil.rmtree(folder)


def test_every_folder_flag_names_the_part_of_the_path_at_fault(tmp_path):
    """Breaker round 11 (re-check): --run-dir, --checkpoint-dir, dgt plot --out and
    dgt bench --out gave errno text for a folder path through a regular file ('File
    exists', 'Not a directory'), called a link loop dangling or took it, and said 'No
    such file or directory' for /proc. One rule (outpath.folder_problem) now names the
    part of the path at fault, for each flag, before any work."""
    from dgt.outpath import folder_problem
    afile = tmp_path / "afile"
    afile.write_text("x")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert folder_problem(str(tmp_path / "new" / "sub")) is None   # makedirs can
    assert folder_problem(str(afile)) == f"{afile} is not a folder"
    assert folder_problem(str(afile / "x")) == f"{afile} is not a folder"
    assert folder_problem(str(loop / "x" / "y")).startswith(
        f"{loop}: Too many levels of symbolic links")
    assert folder_problem("/proc/dgt-x/y") == \
        "no folder can be made in /proc (No such file or directory)"
    report = str(tmp_path / "r.json")
    cases = [
        (["train", "--run-dir", afile / "rd", "--report", report],
         f"--run-dir {afile / 'rd'}: {afile} is not a folder"),
        (["train", "--run-dir", "/proc/dgt-x", "--report", report],
         "--run-dir /proc/dgt-x: no folder can be made in /proc"),
        (["train", "--run-dir", loop], f"--run-dir {loop}: Too many levels of symbolic "
                                       f"links (a symbolic link loop)"),
        (["train", "--checkpoint-every", "1", "--checkpoint-dir", afile],
         f"--checkpoint-dir {afile}: {afile} is not a folder"),
        (["train", "--checkpoint-every", "1", "--checkpoint-dir", "/proc/dgt-ck"],
         "--checkpoint-dir /proc/dgt-ck: no folder can be made in /proc"),
        (["bench", "--loopback", "--estimate", "--out", loop / "x"],
         f"--out {loop / 'x'}: {loop}: Too many levels of symbolic links"),
        (["bench", "--loopback", "--estimate", "--out", afile / "x"],
         f"--out {afile / 'x'}: {afile} is not a folder"),
    ]
    for args, says in cases:
        p = _dgt(*map(str, args))
        assert p.returncode == 2 and says in p.stderr, (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["afile", "loop"]   # nothing made
