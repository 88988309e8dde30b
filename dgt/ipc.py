"""Trainer <-> sidecar plumbing on one node: shared-memory buffers and a small control
channel over a Unix socket.

Gradients and aggregates never go through the socket: they live in one file under
/dev/shm that both processes map (the sidecar takes the gradient out at push, then writes
the aggregate over it, so a CPU trainer's ``p.grad`` can *be* that memory: no copy either
way). The socket carries one JSON object per line:

    trainer -> sidecar: {"op": "register", "n_params": int, "dtype": "float32",
                         "param_sha256": str, "shapes_sha256": str (the parameters'
                         values and shapes, dgt.client; both optional),
                         "resume": path (optional: dgt.checkpoint's sidecar file)}
                        {"op": "push", "t": int, "loss": float}
                        {"op": "save", "path": str} (between iterations: checkpoint)
                        {"op": "bye"}
                        {"op": "failed", "error": str} (instead of bye: the trainer
                         ends on an error, e.g. an uncaught exception under dgt.ddp;
                         the sidecar fails the job naming it)
    sidecar -> trainer: {"op": "registered", "grad": path, "aggregate": path (the same),
                         "padded": int, "block_elems": int, "iterations": int}
                        {"op": "saved", "path": str, "iterations": int,
                         "error": str, "errno": int | null (both only when the file
                         could not be written)}
                        {"op": "pulled", "t": int, "k": float}
                        {"op": "error", "message": str, "rank": int | null}
"""
from __future__ import annotations

import json
import mmap
import os
import secrets
import stat

import numpy as np

from .jsonparse import loads

MAX_LINE = 1 << 16


class ShmBuffer:
    """A float32 vector of ``n`` values in a /dev/shm file, mapped into this process.

    ``create=True`` makes the file, which must not exist (O_EXCL, O_NOFOLLOW, mode
    0600: /dev/shm is every user's, and a name planted there by another user, a link
    or a file of theirs, is never written through or shared; :func:`buffer_name` makes
    names no one can guess); the creator unlinks it, in unlink() once the other side
    has mapped it (the mappings outlive the name, so nothing is left in /dev/shm
    whatever kills either process later), or at the latest in close(). The attaching
    side maps only a regular file of its own user that no other user may read or
    write. ``array``: (n,) float32 numpy view over the mapping (no copy).

    Raises OSError when the file cannot be made or opened (FileExistsError: the name
    is taken; ELOOP: it is a link) and ValueError when the attaching side finds
    another size, another owner or another user's access.
    """

    def __init__(self, path: str, n: int, create: bool = False):
        self.path, self.n, self.owner = path, n, False
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        self.owner = create
        try:
            if create:
                os.ftruncate(fd, n * 4)
            else:
                _check_ours(fd, path, n * 4)
            self.map = mmap.mmap(fd, n * 4)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, np.float32, n)

    def close(self) -> None:
        self.array = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive elsewhere; the OS frees it at exit
            pass
        self.unlink()

    def unlink(self) -> None:
        """Remove the file's name (the creator only; once); the mappings stay valid."""
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _check_ours(fd: int, path: str, size: int) -> None:
    """Raise ValueError unless ``fd`` is a regular file of ``size`` bytes owned by this
    process's user, with no access for group or others (what :class:`ShmBuffer` makes)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file; the sidecar named no buffer of its own")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"{path}: owned by uid {st.st_uid} with mode "
                         f"{stat.S_IMODE(st.st_mode):04o}; a sidecar's buffer is its "
                         f"user's alone (uid {os.geteuid()}, mode 0600): another user "
                         f"made it")
    if st.st_size != size:
        raise ValueError(f"{path}: size {st.st_size} B, expected {size} B")


def buffer_name(pid: int, session: int, rank: int) -> str:
    """The path of a sidecar's shared buffer: ``<shm_dir>/dgt-<pid>-<session, 8 hex
    digits>-r<rank>-<16 random hex digits>-grad``. The pid leads, so that whoever
    reaps a dead sidecar finds its buffers (``dgt-<pid>-*``); the random part, so that
    no other user can know the name in advance and plant it."""
    return os.path.join(shm_dir(), f"dgt-{pid}-{session & 0xffffffff:08x}-r{rank}-"
                                   f"{secrets.token_hex(8)}-grad")


def drop_name(path: str) -> None:
    """The attaching side's part of :class:`ShmBuffer`'s rule: once this process has
    mapped a buffer, its name is not needed, so it goes now (a sidecar killed by
    SIGKILL before its first push then leaves nothing in /dev/shm; the creator's own
    unlink finds it gone). Only a dgt buffer's name in :func:`shm_dir` is removed,
    whatever ``path`` the peer named."""
    if os.path.dirname(path) != shm_dir() or not os.path.basename(path).startswith("dgt-"):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def encode_msg(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def decode_msg(line: bytes) -> dict:
    """Raises ValueError for anything that is not one JSON object with an 'op'."""
    if len(line) > MAX_LINE:
        raise ValueError("control message too long")
    obj = loads(line, "control message")   # e.g. 60,000 '[': nested too deeply
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise ValueError("control message must be a JSON object with an 'op'")
    return obj
