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
