"""Trainer <-> sidecar plumbing on one node: shared-memory buffers and a small control
channel over a Unix socket.

Gradients and aggregates never go through the socket: they live in one file under
/dev/shm that both processes map (the sidecar takes the gradient out at push, then writes
the aggregate over it, so a CPU trainer's ``p.grad`` can *be* that memory: no copy either
way). The socket carries one JSON object per line:

    trainer -> sidecar: {"op": "register", "n_params": int, "dtype": "float32",
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

import numpy as np

from .jsonparse import loads

MAX_LINE = 1 << 16


class ShmBuffer:
    """A float32 vector of ``n`` values in a /dev/shm file, mapped into this process.

    ``create=True`` makes (or truncates) the file; the creator unlinks it, in unlink()
    once the other side has mapped it (the mappings outlive the name, so nothing is left
    in /dev/shm whatever kills either process later), or at the latest in close().
    ``array``: (n,) float32 numpy view over the mapping (no copy).
    """

    def __init__(self, path: str, n: int, create: bool = False):
        self.path, self.n, self.owner = path, n, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, n * 4)
            elif os.fstat(fd).st_size != n * 4:
                raise ValueError(f"{path}: size {os.fstat(fd).st_size} B, expected {n * 4} B")
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
