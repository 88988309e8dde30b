"""What an output flag may replace: nothing, or a file of the kind it writes.

``dgt train --report notes.txt`` used to replace ``notes.txt`` with a JSON report
without a word (and, run as root, ``--report /etc/passwd`` replaced that). Every output
flag that names a file (``--report``, ``--json``, ``--plot``, ``-w``) now replaces an
existing file only when it already holds what the flag writes (JSON, a PNG, a pcap):
an earlier run's output, so a rerun still overwrites its own report. Anything else is
refused before any work, with one line that says what to do
(tests/test_outpath.py).
"""
from __future__ import annotations

import os
import stat

from .jsonparse import loads

#: the largest existing JSON file read to see whether it is JSON (a report is KBs)
MAX_JSON_BYTES = 64 << 20
#: leading bytes of each binary kind (PNG: its signature, RFC 2083; pcap: the classic
#: file's magic in either byte order, micro- or nanosecond, and pcapng's block type)
_MAGIC = {
    "png": (b"\x89PNG\r\n\x1a\n",),
    "pcap": (b"\xd4\xc3\xb2\xa1", b"\xa1\xb2\xc3\xd4", b"\x4d\x3c\xb2\xa1",
             b"\xa1\xb2\x3c\x4d", b"\x0a\x0d\x0d\x0a"),
}
KINDS = ("json", *_MAGIC)


def foreign(path: str, kind: str) -> str | None:
    """Why an output of ``kind`` (one of :data:`KINDS`) must not replace ``path``, or
    None when it may: ``path`` does not exist, is not a regular file (a FIFO or
    ``/dev/stdout``: written through, not replaced), is empty, or already holds
    ``kind`` (JSON text that parses; a PNG or pcap signature); also None when ``path``
    cannot be looked at (the writer then fails with its own reason). A file that exists
    but cannot be read is foreign. Raises ValueError for an unknown ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}; one of {', '.join(KINDS)}")
    try:
        st = os.stat(path)
    except OSError:   # no such file, or no way to it (a part is a file, no access):
        return None   # nothing to replace; the writer's own checks name the cause
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return None
    what = {"json": "a JSON", "png": "a PNG", "pcap": "a pcap"}[kind]
    refuse = (f"it exists and is not {what} file (an earlier output would be); "
              f"remove it or give another path")
    if kind == "json" and st.st_size > MAX_JSON_BYTES:
        return refuse
    try:
        with open(path, "rb") as f:
            head = f.read(MAX_JSON_BYTES if kind == "json" else 8)
    except OSError as e:
        return f"cannot read it to see what it holds: {e.strerror or e}"
    if kind == "json":
        try:
            loads(head)
        except (ValueError, UnicodeDecodeError):
            return refuse
        return None
    return None if head.startswith(_MAGIC[kind]) else refuse


def unreplaceable(path: str) -> str | None:
    """Why this user cannot replace the existing regular file ``path`` the way dgt
    writes its outputs (dgt.atomic: a new file renamed over it), or None. In a sticky
    folder (``/tmp``, mode 1777) rename(2) over another user's file fails with EPERM
    unless this user owns the file or the folder, or is root (CAP_FOWNER): an outside
    tester's ``--report /tmp/x.json``, root's file, as uid 65534 failed only after the
    whole training run. None also when ``path`` does not exist, is not a regular file
    (written through, not replaced) or cannot be looked at."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st, fst = os.lstat(path), os.stat(folder)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or not fst.st_mode & stat.S_ISVTX:
        return None
    if os.geteuid() in (0, st.st_uid, fst.st_uid):
        return None
    return (f"it is another user's file (uid {st.st_uid}) in a sticky folder ({folder}), "
            f"which only its owner may replace; remove it as that user, or give another "
            f"path")


def refusal(path: str, kind: str) -> str | None:
    """Why an output of ``kind`` must not replace ``path`` (:func:`foreign`, then
    :func:`unreplaceable`), or None: the one check every output writer makes."""
    return foreign(path, kind) or unreplaceable(path)


def folder_problem(path: str) -> str | None:
    """Why no folder can be at ``path`` or be made there by ``os.makedirs``, as one
    phrase naming the part of the path at fault, or None when one is there or can be
    made (checked without making it: a folder is made and removed in the nearest one
    that exists, where the permission bits say nothing to root, e.g. in /proc).
    ``X is not a folder``, ``X: Too many levels of symbolic links`` (a link loop),
    ``X is a dangling symbolic link to T``, ``no folder can be made in X (why)``.
    Breaker round 11: a regular file on the path read as ``File exists`` or ``Not a
    directory``, a loop as a dangling link, /proc as a folder that does not exist."""
    import errno
    import tempfile
    def loop(at: str) -> str:   # the shortest part of ``at`` that loops
        while os.path.dirname(at) != at:
            try:
                os.stat(os.path.dirname(at))
                break
            except OSError as e:
                if e.errno != errno.ELOOP:
                    break
            at = os.path.dirname(at)
        return f"{at}: {os.strerror(errno.ELOOP)} (a symbolic link loop)"
    try:
        return None if stat.S_ISDIR(os.stat(path).st_mode) else f"{path} is not a folder"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return loop(path)
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            return f"{path}: {e.strerror or e}"
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"{path} is a dangling symbolic link to {target}"
    probe = os.path.dirname(os.path.abspath(path))
    while True:   # the nearest part of the path that is there
        try:
            os.stat(probe)
            break
        except OSError as e:
            if e.errno == errno.ELOOP:
                return loop(probe)
            if os.path.islink(probe):
                return f"{probe} is a dangling symbolic link"
            probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".dgt-probe-"))
    except OSError as e:
        return f"no folder can be made in {probe} ({e.strerror or e})"
    return None
