"""TCP stream framing (sans-IO): bytes in, whole messages out.

A TCP stream is a concatenation of wire messages (``dgt.transport.wire``). The deframer
never trusts a length beyond ``wire.MAX_FRAME_PAYLOAD``; a bad header cannot be
resynchronised, so it raises :class:`~dgt.transport.wire.WireError` and the adapter
closes the connection (and counts it).
"""
from __future__ import annotations

from . import wire


class Deframer:
    """Feed stream bytes; get ``(Header, payload memoryview)`` per complete message.

    With ``key`` every frame must carry a valid MAC. Payload views stay valid until the
    next :meth:`feed` call.
    """

    def __init__(self, key: bytes | None = None):
        self._buf = bytearray()
        self._need = wire.HEADER_BYTES  # bytes needed before parsing again
        self._key = key

    def feed(self, data) -> list[tuple[wire.Header, memoryview]]:
        """Raises WireError on the first malformed frame; already-complete earlier frames
        of the same call are discarded with it (the connection is unusable anyway).

        Cost is linear in the bytes fed: a partial frame is appended to a buffer and
        parsed once, when it is whole (no re-copy per segment).
        """
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            view = memoryview(bytes(buf))
            buf.clear()
        else:
            view = memoryview(data).cast("B")
        out = []
        pos = 0
        n = len(view)
        self._need = wire.HEADER_BYTES
        while n - pos >= wire.HEADER_BYTES:
            h = wire.decode_header(view[pos:])
            size = wire.frame_size(h)
            if n - pos < size:
                self._need = size
                break
            out.append(wire.decode(view[pos:pos + size], self._key))
            pos += size
        if pos < n:
            buf += view[pos:]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)
