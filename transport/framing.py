"""TCP stream framing (sans-IO): bytes in, whole messages out.

A TCP stream is a concatenation of wire messages (``dgt.transport.wire``). Lengths are
never trusted beyond ``wire.MAX_FRAME_PAYLOAD``; a bad header cannot be resynchronised,
so it is a :class:`~dgt.transport.wire.WireError` and the adapter closes the connection
(and counts it). What comes out does not depend on how the stream was cut into reads:
every whole, good message before the first malformed one comes out, in order, and then
the error (docs/wire.md, "Connections").
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
    """Parse whole messages at the start of ``view``: :func:`parse_frames` without its
    error, for a caller that parses again once it has more bytes.

    Returns ``(frames, consumed, need)``. Raises WireError when the first message of
    ``view`` is malformed; one after good messages ends the parse there: the good ones
    are returned (the same ones however the stream was cut), and a parse of the bytes
    from ``consumed`` on raises.
    """
    frames, used, need, error = parse_frames(view, key)
    if error is not None and not frames:
        raise error
    return frames, used, need


def parse_frames(view: memoryview, key: bytes | None = None):
    """Parse whole messages at the start of ``view``.

    Returns ``(frames, consumed, need, error)``: the ``(Header, payload view)`` pairs of
    the good messages, how many bytes they used, how many bytes the next (incomplete)
    message needs in total from ``consumed`` on, and the :class:`~.wire.WireError` of
    the first malformed message (None if none): parsing stops there, and the frames
    before it are returned all the same, so a caller acts on the same frames whatever
    the reads' boundaries. The stream is then dead (it cannot be resynchronised). Never
    raises WireError; ValueError for an empty ``key``.
    """
    out = []
    pos, n = 0, len(view)
    need = wire.HEADER_BYTES
    try:
        while n - pos >= wire.HEADER_BYTES:
            h = wire.decode_header(view[pos:])
            size = wire.frame_size(h)
            if n - pos < size:
                need = size
                break
            out.append(wire.decode(view[pos:pos + size], key))
            pos += size
    except wire.WireError as e:
        return out, pos, need, e
    return out, pos, need, None


class Deframer:
    """Feed stream bytes; get ``(Header, payload memoryview)`` per complete message.

    With ``key`` (1 to 64 bytes) every frame must carry a valid MAC. Cost is linear in
    the bytes fed: a partial frame is buffered and parsed once it is whole. (The asyncio
    adapter uses :func:`parse_frames` directly on a preallocated receive buffer.)

    The frames and the error do not depend on how the stream is cut into ``feed``
    calls: every good frame before the first malformed one is returned, in order, and
    the error is raised by the first call after them (the same call when it returns no
    frame), then by every later call (a stream cannot be resynchronised). Raises
    ValueError for an empty ``key``.
    """

    def __init__(self, key: bytes | None = None):
        wire.check_key(key)
        self._buf = bytearray()
        self._need = wire.HEADER_BYTES
        self._key = key
        self._error: wire.WireError | None = None

    def feed(self, data) -> list[tuple[wire.Header, memoryview]]:
        """The whole frames that ``data`` completes, in stream order. Raises
        :class:`~.wire.WireError` once the stream has a malformed frame and every good
        frame before it was returned: at once when this call would return none, else on
        the next call; and on every call after that."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            view = memoryview(bytes(buf))
            buf.clear()
        else:
            view = memoryview(data).cast("B")
        frames, used, self._need, error = parse_frames(view, self._key)
        if error is not None:
            self._error = error
            buf.clear()
            if not frames:
                raise error
            return frames
        if used < len(view):
            buf += view[used:]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)
