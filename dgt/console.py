"""A closed stdout must not stop a job: ``dgt train | head -1`` ends the reader early,
and the next progress line would raise BrokenPipeError in the trainer (killing rank 0
and blaming it) or in the launcher (losing the report). Nor must a full disk under the
log stdout goes to (ENOSPC: the trainer's log in a run dir that filled up)."""
from __future__ import annotations

import errno
import os
import sys

#: a write that fails with one of these sends the rest of the output to /dev/null
_LOST = (errno.EPIPE, errno.ENOSPC)


def survive_closed_stdout() -> None:
    """From now on a write to a closed stdout (EPIPE) or to a full disk (ENOSPC) sends
    it, and all later output, to /dev/null instead of raising. The standard library's advice for SIGPIPE
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe), done on the first
    failed write rather than at exit, so the process goes on."""
    if not isinstance(sys.stdout, _EpipeSafe) and sys.stdout is not None:
        sys.stdout = _EpipeSafe(sys.stdout)


class _EpipeSafe:
    def __init__(self, stream):
        self._stream = stream

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            if e.errno not in _LOST:
                raise
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            if e.errno not in _LOST:
                raise
            self._to_devnull()
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)
