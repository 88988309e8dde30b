"""Atomic file writes: a temporary file in the target's folder, then rename(2).

A reader never sees a truncated file, and a full disk, a failed write or a process
killed mid-write leaves the old file (or none) and no temporary file behind (rename(2)
is atomic within one file system; POSIX).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from typing import BinaryIO, Callable

from . import outpath


def write_atomic(path: str, write: Callable[[BinaryIO], None], fsync: bool = True) -> None:
    """Call ``write(f)`` on a temporary file in ``path``'s folder, then rename(2) it to
    ``path``. ``fsync``: flush it to the disk before the rename (checkpoints, reports:
    files that must survive a power cut). Raises OSError (its ``filename`` is ``path``
    when the system call named no file), or what ``write`` raises (the temporary file
    is removed)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as e:   # the error names the file we were asked to write
        raise OSError(e.errno, e.strerror, path) from None
    try:
        # mkstemp makes the file 0600: give it the mode the file had, or the one a plain
        # open() would give a new file (0666 less the umask)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            raise OSError(e.errno, e.strerror, path) from None   # e.g. ENOSPC in write()
        raise


def _umask() -> int:
    """This process's umask, read from /proc (os.umask would set it, racing other
    threads' file creation); 0o022 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_bytes(path: str, data: bytes, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (see ``write_atomic``). Raises OSError."""
    write_atomic(path, lambda f: f.write(data), fsync=fsync)


def write_json(path: str, obj, indent: int | None = None, fsync: bool = False,
               **kw) -> None:
    """``json.dumps(obj)`` written to ``path`` atomically (see ``write_atomic``), but
    never over a file that is not JSON (dgt.outpath: an earlier output is JSON).
    Raises OSError (FileExistsError for such a file), or TypeError/ValueError when
    ``obj`` is not JSON-serialisable (nothing is written then)."""
    data = json.dumps(obj, indent=indent, **kw).encode()
    why = outpath.foreign(path, "json")
    if why is not None:
        raise FileExistsError(errno.EEXIST, why, path)
    write_bytes(path, data, fsync=fsync)
