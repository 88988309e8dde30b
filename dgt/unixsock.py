"""Owning the trainer's Unix socket: never take over a live one, never unlink another's.

A sidecar listens on a Unix socket path (``--socket``). Before binding it probes the
path: a socket that accepts a connection belongs to a running process, which is named
(its pid from SO_PEERCRED, unix(7)) and the new sidecar refuses to start; a socket file
nobody listens on (ECONNREFUSED: its process died without cleaning up) is stale and is
reclaimed. The path is then bound by us, not replaced (bind(2) fails with EADDRINUSE if
another process won a race). On exit the file is unlinked only if it is still the one we
bound (same device and inode), so a sidecar never removes a socket it does not own.
"""
from __future__ import annotations

import os
import socket
import stat
import struct


class SocketInUse(OSError):
    """The path is a live socket, or not a socket at all. The message says what to do."""


def _listener_pid(path: str) -> int | None:
    """The pid listening on the Unix socket ``path``; None when nobody listens (stale).
    Raises SocketInUse when ``path`` exists and is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"--socket {path} exists and is not a socket; remove it or give "
                          f"--socket another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return None   # no listener: a dead process's file
    except OSError:
        return -1     # it exists and answers oddly (e.g. a full backlog): treat as live
    else:
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                 struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    finally:
        probe.close()


def claim(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """Bind and listen on ``path``; return (listening socket, (st_dev, st_ino)).

    Raises SocketInUse ("socket <path> in use by pid N") when a process listens there,
    reclaims a stale socket file, and re-raises other OSErrors (e.g. a missing folder)."""
    for _ in range(3):
        pid = _listener_pid(path)
        if pid is not None:
            who = f"pid {pid}" if pid > 0 else "another process"
            raise SocketInUse(f"socket {path} in use by {who} (another sidecar?); stop it "
                              f"or give --socket another path")
        if os.path.lexists(path):
            try:
                os.unlink(path)   # stale: its process is gone
            except FileNotFoundError:
                pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(path)
        except OSError as e:
            s.close()
            if e.errno == 98:   # EADDRINUSE: another process bound it meanwhile; probe again
                continue
            raise
        st = os.stat(path)
        s.listen(16)
        s.setblocking(False)
        return s, (st.st_dev, st.st_ino)
    raise SocketInUse(f"socket {path} is being taken by another process; give --socket "
                      f"another path")


def release(path: str, owned: tuple[int, int] | None) -> bool:
    """Unlink ``path`` if it is still the socket we bound (``owned`` from claim());
    True when removed. Never raises."""
    if owned is None:
        return False
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) != owned:
            return False   # another process's socket now: leave it
        os.unlink(path)
        return True
    except OSError:
        return False
