"""Writing a file the user named (``--json``, ``--plot``): all of it, or one error.

The file is written by ``dgt.atomic.write_atomic``: a regular (or new) file whole or
not at all, a device, FIFO or ``/dev/stdout`` in place. Any failure to write, flush or close
raises ``ValueError`` with one line, ``cannot write PATH (FLAG): why``: the commands
print it and exit 2 (``dgt.tools.cli``), never a summary of work that was not saved.

Example::

    from dgt.tools import output
    output.write_json("summary.json", "--json", {"messages": 3})
"""
from __future__ import annotations

import json
from typing import BinaryIO, Callable

from dgt.atomic import write_atomic


def write_file(path: str, flag: str, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` into ``path`` (atomically, or through a device or pipe:
    ``dgt.atomic.write_atomic``). Raises ValueError ``cannot write PATH (FLAG): why``."""
    try:
        write_atomic(path, write, fsync=False)
    except OSError as e:
        raise ValueError(f"cannot write {path} ({flag}): {e.strerror or e}") from None


def write_json(path: str, flag: str, obj, indent: int = 2, **kw) -> None:
    """``obj`` as JSON text (and a newline) into ``path``: :func:`write_file`."""
    data = (json.dumps(obj, indent=indent, **kw) + "\n").encode()
    write_file(path, flag, lambda f: f.write(data))
