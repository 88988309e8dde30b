"""Owning the trainer's Unix socket: never take over a live one, never unlink another's.

A sidecar listens on a Unix socket path (``--socket``). Before binding it probes the
path: a socket that accepts a connection belongs to a running process, which is named
(its pid from SO_PEERCRED, unix(7)) and the new sidecar refuses to start; a socket file
nobody listens on (ECONNREFUSED: its process died without cleaning up) is stale and is
reclaimed. The path is then bound by us, not replaced (bind(2) fails with EADDRINUSE if
another process won a race). On exit the file is unlinked only if it is still the one we
bound (same device and inode), so a sidecar never removes a socket it does not own.

The other side: a trainer (``dgt.Client``) trusts a socket only when the process
listening on it runs as the trainer's own user (:func:`check_peer`, SO_PEERCRED), so a
process of another user that took the path cannot pose as the sidecar. The default
socket lives in a per-user folder (:func:`private_dir`: mode 0700, owned by the user)
where no other user can create a file.
"""
from __future__ import annotations

import os
import socket
import stat
import struct


#: the longest Unix socket path Linux binds: sun_path is 108 bytes, NUL included (unix(7))
MAX_PATH_BYTES = 107


def fits(path: str) -> bool:
    """True when ``path`` is short enough to bind as a Unix socket (MAX_PATH_BYTES)."""
    return len(os.fsencode(path)) <= MAX_PATH_BYTES


class SocketInUse(OSError):
    """The path is a live socket, or not a socket at all. The message says what to do."""


class NotOurs(PermissionError):
    """A path (socket or folder) belongs to another user. The message says what to do."""


def private_dir(path: str) -> str:
    """Create the folder ``path`` (mode 0700) if missing and check that it is ours: a
    real folder (not a symbolic link), owned by this process's uid, not writable by group
    or others. Returns ``path``; raises NotOurs (a message that names the folder and its
    owner uid) when another user made it, e.g. to squat the sidecar's socket."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise NotOurs(f"cannot create {path} ({e.strerror}); set XDG_RUNTIME_DIR to a "
                      f"folder of yours, or give --socket and --run-dir") from None
    what = _not_ours(os.lstat(path))
    if what:
        raise NotOurs(f"{path} {what}; dgt keeps its sockets and spilled records in a "
                      f"folder only this user (uid {os.getuid()}) can write: remove it, or "
                      f"set XDG_RUNTIME_DIR, or give --socket and --run-dir")
    return path


def owned_dir(path: str, flag: str) -> str:
    """Create the folder ``path`` given by ``flag`` (e.g. ``--run-dir``) if missing, mode
    0700, and check that no other user can put a file in it: a folder (a symbolic link
    to one is followed), owned by this process's uid, not writable by group or others.
    dgt writes its logs, traces and records there by name; in a folder that another
    user can write, that user could plant a symbolic link under one of those names and
    have this process (root, perhaps) write through it to any file. Returns ``path``.
    Raises NotOurs (the message names ``flag``, the folder, and what to do: see
    :func:`_remedy`), or OSError from mkdir(2)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_owned(path, flag)
    return path


def check_owned(path: str, flag: str) -> None:
    """The check of :func:`owned_dir` on the existing folder ``path``, creating
    nothing. Raises NotOurs, or OSError from stat(2)."""
    st = os.stat(path)
    what = _not_ours(st)
    if what:
        raise NotOurs(f"{flag} {path} {what}: another user could put links there that "
                      f"this job would write through; give a folder only this user "
                      f"(uid {os.getuid()}) can write{_remedy(path, st)}")


def _remedy(path: str, st: os.stat_result) -> str:
    """What to do about the folder ``path`` (status ``st``) that :func:`owned_dir`
    refused, as " (…)", or "" when nothing better than "give a folder of yours" fits.
    ``chmod go-w`` only for a folder of this user that is not shared by design: a sticky
    folder (mode +t, like /tmp) is meant for everyone, even when root owns it and root
    runs the job, and another user's folder is not ours to chmod. In a sticky folder of
    root's or ours, a new subfolder is ours alone (only we, or root, may rename or
    remove it there); in another user's folder it is not (that user may swap it), so no
    subfolder is suggested there."""
    if not stat.S_ISDIR(st.st_mode):
        return ""
    sticky = st.st_mode & stat.S_ISVTX
    if st.st_uid == os.getuid() and not sticky:
        return f" (chmod go-w {path})"
    if sticky and st.st_uid in (0, os.getuid()) and os.access(path, os.W_OK | os.X_OK):
        return f" (mkdir -m 700 {os.path.join(path, 'NAME')} and give that)"
    return ""


def _not_ours(st: os.stat_result) -> str:
    """Why a folder with status ``st`` is not this user's alone ("" when it is)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of the connected Unix socket
    ``sock`` (SO_PEERCRED, unix(7)): the credentials it had when it called listen(2)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def check_peer(sock: socket.socket, path: str) -> None:
    """Raise NotOurs unless the process listening on ``path`` (``sock``: connected to
    it) runs as this process's uid. The rule is the same uid, for root too: a trainer
    never hands its gradients to, nor takes an aggregate from, another user's process."""
    pid, uid, _ = peer_creds(sock)
    if uid != os.getuid():
        raise NotOurs(f"socket {path} is served by uid {uid} (pid {pid}), not by this "
                      f"user (uid {os.getuid()}): it is not your sidecar; run 'dgt sidecar' "
                      f"as this user and give its --socket path (default "
                      f"$XDG_RUNTIME_DIR/dgt or /tmp/dgt-<uid>/sidecar-<rank>.sock)")


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
    except PermissionError:
        if st.st_uid != os.getuid():
            raise _foreign(path, st.st_uid) from None
        return -1
    except OSError:
        return -1     # it exists and answers oddly (e.g. a full backlog): treat as live
    else:
        say_hello(probe)
        return peer_creds(probe)[0]
    finally:
        probe.close()


#: the line a probe of a live sidecar's socket sends before it closes (dgt.ipc's
#: ``{"op": "hello"}``, answered and closed by dgt.trainer_link): a connection that
#: closes without a line from a process that then ends is taken for a trainer killed
#: before it registered, and fails the job
HELLO_LINE = b'{"op":"hello"}\n'


def say_hello(sock: socket.socket) -> None:
    """Send :data:`HELLO_LINE` on ``sock`` (best effort: the listener may be gone)."""
    try:
        sock.sendall(HELLO_LINE)
    except OSError:
        pass


def _foreign(path: str, uid: int) -> SocketInUse:
    return SocketInUse(f"socket {path} is owned by uid {uid}: a stale socket (or another "
                       f"user's live one) that this user (uid {os.getuid()}) cannot "
                       f"remove; ask its owner to remove it, or give --socket another path")


def claim(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """Bind and listen on ``path``; return (listening socket, (st_dev, st_ino)).

    Raises SocketInUse ("socket <path> in use by pid N") when a process listens there,
    reclaims a stale socket file, and raises SocketInUse naming ``path`` and the reason
    when it cannot be bound (a folder where no file can be made, say /proc)."""
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
            except PermissionError:
                raise _foreign(path, os.lstat(path).st_uid) from None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(path)
        except OSError as e:
            s.close()
            if e.errno == 98:   # EADDRINUSE: another process bound it meanwhile; probe again
                continue
            if isinstance(e, PermissionError):
                raise SocketInUse(f"--socket {path}: permission denied (this user cannot "
                                  f"create a file in {os.path.dirname(path) or '.'}); give "
                                  f"--socket a path in a folder of yours, or leave it out "
                                  f"for the default") from None
            # breaker round 7: '--socket /proc/x.sock' said only '[Errno 2] No such file
            # or directory', naming no path
            raise SocketInUse(f"--socket {path}: cannot create a socket there "
                              f"({e.strerror}); give --socket a path in a folder of "
                              f"yours, or leave it out for the default") from None
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
