"""Reads from a peer bounded by one deadline for the whole exchange, not per read.

A socket timeout bounds each read: a peer that sends a few bytes now and then (an HTTP
page at 4 bytes a second) restarts it every time and is waited on forever. Every read
from a peer (``dgt top``'s scrape, ``dgt replay``'s drain of a receiver, a trainer's
hello to its sidecar) instead sets the socket's timeout to what is left of one deadline
on the monotonic clock, and fails with ``TimeoutError(why)`` once it has passed.

Example::

    deadline = time.monotonic() + 2.0
    sock = bounded(socket.create_connection(addr, 2.0), deadline, "no answer in 2 s")
    line = sock.makefile("rb").readline()    # TimeoutError past the deadline
"""
from __future__ import annotations

import socket
import time


def arm(sock: socket.socket, deadline: float, why: str) -> None:
    """Give ``sock`` what is left until ``deadline`` (``time.monotonic()``) as its
    timeout. Raises ``TimeoutError(why)`` when nothing is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(why)
    sock.settimeout(left)


class DeadlineSocket(socket.socket):
    """A socket whose reads and writes all end by one deadline (:func:`bounded`), also
    those of a file from ``makefile()`` or of ``http.client`` on top of it."""

    deadline: float = 0.0
    why: str = "timed out"

    def _bounded(self, op, *args):
        arm(self, self.deadline, self.why)
        try:
            return op(*args)
        except TimeoutError:
            raise TimeoutError(self.why) from None

    def recv(self, *args):
        return self._bounded(super().recv, *args)

    def recv_into(self, *args):
        return self._bounded(super().recv_into, *args)

    def sendall(self, *args):
        return self._bounded(super().sendall, *args)


def bounded(sock: socket.socket, deadline: float, why: str) -> DeadlineSocket:
    """``sock``'s connection as a :class:`DeadlineSocket` ending at ``deadline``
    (``time.monotonic()``); ``sock`` is taken over (detached): use the one returned."""
    out = DeadlineSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
    out.deadline, out.why = deadline, why
    return out


def http_get(hostport: str, path: str, seconds: float, max_bytes: int,
             why: str = "") -> tuple[int, str, bytes]:
    """``GET http://HOSTPORT/PATH`` (``HOST:PORT``, ``[V6]:PORT``), done within
    ``seconds`` from connect to the body's last byte: ``(status, reason, body)``, at
    most ``max_bytes`` of the body. No proxy, no redirect: what answers at that address
    is what is read. Raises OSError (``TimeoutError(why)`` once ``seconds`` pass) and
    ``http.client.HTTPException`` (not an HTTP answer)."""
    import http.client
    why = why or f"timed out: no whole answer within {seconds:g} s"
    deadline = time.monotonic() + seconds
    conn = http.client.HTTPConnection(hostport, timeout=seconds)
    try:
        try:
            sock = socket.create_connection((conn.host, conn.port), seconds)
        except TimeoutError:
            raise TimeoutError(why) from None
        conn.sock = bounded(sock, deadline, why)
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        return resp.status, str(resp.reason), resp.read(max_bytes)
    finally:
        conn.close()
