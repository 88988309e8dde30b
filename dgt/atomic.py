"""Atomic file writes: a temporary file in the target's folder, then rename(2).

A reader never sees a truncated file, and a full disk or a failed write leaves the old
file (or none) and no temporary file behind (rename(2) is atomic within one file
system; POSIX).
"""
from __future__ import annotations

import json
import os
import tempfile


def write_bytes(path: str, data: bytes, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically. ``fsync``: also flush it to the disk before
    the rename (for files that must survive a power cut, e.g. the report).
    Raises OSError (the temporary file is removed)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: str, obj, indent: int | None = None, fsync: bool = False,
               **kw) -> None:
    """``json.dumps(obj)`` written to ``path`` atomically (see ``write_bytes``).
    Raises OSError, or TypeError/ValueError when ``obj`` is not JSON-serialisable
    (nothing is written then)."""
    write_bytes(path, json.dumps(obj, indent=indent, **kw).encode(), fsync=fsync)
