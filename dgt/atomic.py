"""Atomic file writes: a temporary file in the target's folder, then rename(2).

A reader never sees a truncated file, and a full disk, a failed write or a process
killed mid-write leaves the old file (or none) and no temporary file behind (rename(2)
is atomic within one file system; POSIX).

A path that is a device or a pipe (``/dev/null``, ``/dev/stdout``, a FIFO) is written
through instead: there is no file to replace, and renaming over it would replace the
device node itself.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import time
from typing import BinaryIO, Callable

from . import outpath

#: how long a write to a FIFO waits for a process to open it for reading, s (an open
#: for writing blocks until one does: a report to a FIFO no one reads hung for ever
#: after the run, breaker round 5)
FIFO_READER_WAIT_S = 10.0


def write_atomic(path: str, write: Callable[[BinaryIO], None], fsync: bool = True) -> None:
    """Call ``write(f)`` on a temporary file in ``path``'s folder, then rename(2) it to
    ``path``. ``fsync``: flush it to the disk before the rename (checkpoints, reports:
    files that must survive a power cut). Raises OSError (its ``filename`` is ``path``
    when the system call named no file), or what ``write`` raises (the temporary file
    is removed). A ``path`` that exists and is not a regular file or a folder (a
    character device such as ``/dev/null`` or ``/dev/full``, a FIFO, ``/dev/stdout``)
    is written through, not replaced: renaming over it would put a regular file where
    the device was (as root, ``--report /dev/null`` replaced /dev/null)."""
    if writes_through(path):
        return _write_in_place(path, write)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as e:   # the error names the file we were asked to write
        raise OSError(e.errno, e.strerror, path) from None
    try:
        # mkstemp makes the file 0600: give it the mode the file had when it was ours,
        # or the one a plain open() would give a new file (0666 less the umask); never
        # another user's mode, nor a link's target's (an outside tester's 0666 file in
        # /tmp made root's report writable by all, breaker round 9)
        mode = 0o666 & ~_umask()
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                mode = stat.S_IMODE(st.st_mode) & 0o777
        except OSError:
            pass
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
        if isinstance(e, OSError):
            raise _naming(e, path) from None   # e.g. ENOSPC in write()
        raise


def writes_through(path: str) -> bool:
    """Whether :func:`write_atomic` writes ``path`` in place: it exists (links
    followed) and is neither a regular file nor a folder (a device, a FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _write_in_place(path: str, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` on ``path`` opened for writing as it is (no temporary file, no
    rename, no fsync: a device or a pipe has no disk copy to flush). Raises OSError
    naming ``path`` (e.g. ENOSPC from /dev/full, EPIPE from a closed pipe, ENXIO from
    a FIFO that no process opened for reading within :data:`FIFO_READER_WAIT_S`)."""
    try:
        with _open_through(path) as f:
            write(f)
    except OSError as e:
        raise _naming(e, path) from None


def _open_through(path: str) -> BinaryIO:
    """``path`` opened for writing as it is; a FIFO once a reader has it open (tried
    without blocking until :data:`FIFO_READER_WAIT_S` has passed, then ENXIO), its
    writes then blocking as a pipe's do. Raises OSError."""
    if not stat.S_ISFIFO(os.stat(path).st_mode):
        return open(path, "wb")
    deadline = time.monotonic() + FIFO_READER_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if time.monotonic() > deadline:
                raise OSError(errno.ENXIO, f"a FIFO that no process opened for reading "
                              f"within {FIFO_READER_WAIT_S:g} s", path) from None
            time.sleep(0.05)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "wb")


def _naming(e: OSError, path: str) -> OSError:
    """``e``, or the same error naming ``path`` when the system call named no file."""
    return OSError(e.errno, e.strerror, path) if e.errno is not None and \
        e.filename is None else e


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
