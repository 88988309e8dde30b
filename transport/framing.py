"""TCP stream framing (sans-IO): bytes in, whole messages out.

A TCP stream is a concatenation of wire messages (``dgt.transport.wire``). Lengths are
never trusted beyond ``wire.MAX_FRAME_PAYLOAD``; a bad header cannot be resynchronised,
so it raises :class:`~dgt.transport.wire.WireError` and the adapter closes the connection
(and counts it).
"""
from __future__ import annotations

from . import wire

#: SO_RCVLOWAT, the bytes the kernel gathers before it wakes a reader (socket(7)): at
#: most this much of a message's rest, so a 400 KB BLOCKS frame arriving at line rate
#: wakes its reader two or three times instead of once per few segments
WAKE_MAX_BYTES = 256 * 1024
#: a message's rest below this is read as it comes (1): not worth a system call
WAKE_MIN_BYTES = 64 * 1024


def wake_bytes(need: int, have: int) -> int:
    """The SO_RCVLOWAT for a reader that holds ``have`` bytes of a message that needs
    ``need`` in all: the rest (``need - have``) up to :data:`WAKE_MAX_BYTES`, or 1 (wake on
    any byte) when the rest is under :data:`WAKE_MIN_BYTES`. Never more than the rest, so
    the message's last byte always wakes the reader; a closed or reset connection wakes
    it whatever the mark (tcp(7))."""
    rest = need - have
    return min(rest, WAKE_MAX_BYTES) if rest >= WAKE_MIN_BYTES else 1


def split_frames(view: memoryview, key: bytes | None = None):
    """Parse whole messages at the start of ``view``.

    Returns ``(frames, consumed, need)``: the ``(Header, payload view)`` pairs, how many
    bytes they used, and how many bytes the next (incomplete) message needs in total
    from ``consumed`` on. Raises WireError on a malformed message.
    """
    out = []
    pos, n = 0, len(view)
    need = wire.HEADER_BYTES
    while n - pos >= wire.HEADER_BYTES:
        h = wire.decode_header(view[pos:])
        size = wire.frame_size(h)
        if n - pos < size:
            need = size
            break
        out.append(wire.decode(view[pos:pos + size], key))
        pos += size
    return out, pos, need


class Deframer:
    """Feed stream bytes; get ``(Header, payload memoryview)`` per complete message.

    With ``key`` every frame must carry a valid MAC. Cost is linear in the bytes fed: a
    partial frame is buffered and parsed once it is whole. (The asyncio adapter uses
    :func:`split_frames` directly on a preallocated receive buffer.)
    """

    def __init__(self, key: bytes | None = None):
        self._buf = bytearray()
        self._need = wire.HEADER_BYTES
        self._key = key

    def feed(self, data) -> list[tuple[wire.Header, memoryview]]:
        """Raises WireError on the first malformed frame."""
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            view = memoryview(bytes(buf))
            buf.clear()
        else:
            view = memoryview(data).cast("B")
        frames, used, self._need = split_frames(view, self._key)
        if used < len(view):
            buf += view[used:]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)
