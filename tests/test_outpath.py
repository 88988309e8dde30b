"""An output flag replaces only a file of the kind it writes (dgt.outpath): breaker
round, stop 31, where ``dgt train --report notes.txt`` replaced the notes with a JSON
report, made it mode 0600, and as root ``--report /etc/passwd`` replaced that."""
import json
import os
import stat
import subprocess
import sys

import pytest

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
