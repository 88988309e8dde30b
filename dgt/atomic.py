"""One way to write a file so that it is either whole or absent."""
from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def write_atomic(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a temporary file in ``path``'s folder, fsync it, then
    rename(2) it to ``path``: a full disk or a process killed mid-write never leaves a
    truncated file (the temporary one is removed). Raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
