"""JSON that someone else wrote: a file the user names, a run dir's record, a trace
line, a line on a socket, a value in the rendezvous store.

``json.loads`` raises RecursionError, not ValueError, on a document nested deeper than
Python's recursion limit (``'[' * 100000``), and a reader that catches ValueError for
malformed JSON let it through as a traceback (a crashed process, where it came from a
stranger). :func:`loads` makes it the ValueError every reader already handles.
:func:`is_port` checks a decoded value that should be a port (a record, a report's
``sidecars`` table, a store's value).
"""
from __future__ import annotations

import json


def loads(data: str | bytes, what: str = "JSON"):
    """``json.loads(data)``. Raises ValueError when ``data`` is not JSON, including JSON
    nested too deeply to decode (``what`` names it in the message: ``<what> nested too
    deeply``), UnicodeDecodeError (a ValueError) for bytes that are not UTF-8."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{what} nested too deeply") from None


def is_port(v) -> bool:
    """Whether ``v``, a decoded JSON value, is a port: an integer 1..65535; not a float
    (5.0, 1e400), a bool, a string."""
    return type(v) is int and 0 < v < 1 << 16
