"""JSON that someone else wrote: a file the user names, a run dir's record, a trace
line, a line on a socket, a value in the rendezvous store.

``json.loads`` raises RecursionError, not ValueError, on a document nested deeper than
Python's recursion limit (``'[' * 100000``), and a reader that catches ValueError for
malformed JSON let it through as a traceback (a crashed process, where it came from a
stranger). :func:`loads` makes it the ValueError every reader already handles.
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


def load(f, what: str = "JSON"):
    """:func:`loads` of what the open file ``f`` holds from its position."""
    return loads(f.read(), what)
