"""The sidecar's side of the trainer's Unix socket (dgt.ipc): one trainer per sidecar,
one JSON line per message, ``register`` / ``part`` / ``push`` / ``save`` / ``bye`` /
``failed`` in,
``registered`` / ``pulled`` / ``saved`` / ``error`` out.

A connection becomes the trainer with its first line, and only when that line is a
well-formed ``register`` (:func:`not_a_register`). Any other connection fails nobody: one
that closes before its first line is a probe (another sidecar checking whether this
socket is live: dgt.unixsock); ``{"op": "hello"}`` is answered with who this sidecar is;
anything else (not JSON, not an object, another op, a ``register`` with a missing or bad
field) and a second trainer get one ``error`` line (``rank`` null) and are closed, so a
local process that connects before the trainer cannot take its place with garbage. A
first line ``bye`` or ``failed`` from this user's process, though, is a trainer that gave
up before registering (its ``register()`` raised on its own side): that fails the job
naming it, as a registered trainer's would, rather than leave the sidecar waiting. Once
a trainer has registered it is ours: its own bad line, or a disconnect without ``bye``,
fails the job, and so does a bug of ours while serving it: the job fails cleanly, it
never lingers.

A connection from another user's process (SO_PEERCRED, unix(7)) is refused before its
first line is read, with one ``error`` line that says whose sidecar this is, and the
sidecar waits on for its own trainer (breaker round 7: a process of uid 65534 that
reached a root sidecar's socket, in a folder it could write with umask 000, registered
and then disconnected, and so stopped the sidecar: ``trainer of rank 0 disconnected``).
The client checks the same the other way round (dgt.unixsock.check_peer).
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable

from . import ipc, unixsock
from .errors import PeerFailure, one_line
from .failure import FailureReason
from .process import running
from .registration import check_model_size

log = logging.getLogger("dgt.sidecar")


class TrainerLink:
    """``ops``: op name -> coroutine taking the message (dict); it may raise
    PeerFailure, which fails the job through ``fail(message, rank)``. ``bye()``: the
    trainer closed cleanly. ``done``: set when the sidecar stops. ``whoami``: the
    answer to a first line ``{"op": "hello"}`` (rank, world, job)."""

    def __init__(self, rank: int, ops: dict[str, Callable[[dict], Awaitable[None]]],
                 fail: Callable[..., None], bye: Callable[[], None],
                 done: asyncio.Event, whoami: dict | None = None):
        self.rank, self.ops, self.fail, self.bye, self.done = rank, ops, fail, bye, done
        self.whoami = {"op": "hello", "rank": rank, **(whoami or {})}
        self.writer: asyncio.StreamWriter | None = None
        self.foreign_uids: set[int] = set()   # uids refused (:meth:`_foreign`)

    def send(self, msg: dict) -> None:
        """One message to the trainer, if one is connected."""
        w = self.writer
        if w is not None and not w.is_closing():
            w.write(ipc.encode_msg(msg))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _gave_up(self, line: bytes) -> str | None:
        """The failure line when a first ``line`` is ``bye`` or ``failed`` from our own
        user's process while no trainer is attached and the sidecar runs: its trainer
        gave up before registering (dgt.Client.close after a register() that raised on
        the trainer's side, e.g. a float64 model). Else None. Before, such a line was
        refused as "not a trainer", and a hand-started sidecar waited for ever (breaker
        round 17)."""
        if self.writer is not None or self.done.is_set():
            return None
        try:
            msg = ipc.decode_msg(line)
        except ValueError:
            return None
        if msg["op"] == "bye":
            return (f"trainer of rank {self.rank} closed before it registered (its own "
                    f"output says why)")
        if msg["op"] == "failed":
            what = one_line(str(msg.get("error") or "an error"), "an error")
            return f"trainer of rank {self.rank} failed before it registered ({what})"
        return None

    async def _ended_without_a_word(self, pid: int) -> None:
        """A connection of our own user's process ``pid`` closed before its first line:
        when that process has ended too (within ENDED_WAIT_S) while no trainer is
        attached, it was our trainer, killed (or gone without dgt.Client's goodbye)
        before it registered, and the job fails naming it. Before, a hand-started
        sidecar waited for ever (breaker round 19). A process that closes such a
        connection and lives on changes nothing."""
        if pid <= 0 or self.writer is not None or self.done.is_set():
            return
        if await ended_soon(lambda: not running(pid)) and self.writer is None:
            self.fail(f"trainer of rank {self.rank} (pid {pid}) ended before it registered, "
                      f"without a word (it was killed, or exited before dgt.Client could "
                      f"say goodbye)", self.rank, why=FailureReason.OWN_TRAINER)

    def _refuse(self, line: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer and close a connection whose first ``line`` does not make it the
        trainer; False when it does (a well-formed ``register`` while no trainer is
        attached). ``{"op": "hello"}`` asks who this sidecar is (dgt.ddp checks the job
        and world size before it attaches) and gets ``whoami``; any other line gets one
        ``error`` line saying why. Either way nobody is failed."""
        try:
            msg = ipc.decode_msg(line)
        except ValueError as e:
            msg, why = None, f"bad control message: {e}"
        if msg is not None and msg["op"] == "hello":
            reply = self.whoami
        elif self.writer is not None:
            reply = {"op": "error", "rank": None,
                     "message": "this sidecar already has a trainer"}
        else:
            why = not_a_register(msg, self.rank) if msg is not None else why
            if not why:
                return False
            log.debug("rank %d: a connection that is not a trainer refused: %s",
                      self.rank, why)
            reply = {"op": "error", "rank": None,
                     "message": f"not a trainer: {why}; a trainer's first message is "
                                f'{{"op": "register", "n_params": N, ...}}'}
        writer.write(ipc.encode_msg(reply))
        writer.close()
        return True

    def _foreign(self, writer: asyncio.StreamWriter) -> bool:
        """Refuse, answer and close a connection from a process of another uid (its
        credentials at connect, SO_PEERCRED); True when it was refused. Logged once per
        uid."""
        try:
            pid, uid, _ = unixsock.peer_creds(writer.get_extra_info("socket"))
        except (OSError, AttributeError, TypeError, ValueError):
            return False
        if uid == os.getuid():
            return False
        if uid not in self.foreign_uids:
            log.warning("rank %d: a connection from uid %d (pid %d) refused: only a "
                        "trainer of this sidecar's user (uid %d) may connect",
                        self.rank, uid, pid, os.getuid())
        self.foreign_uids.add(uid)
        writer.write(ipc.encode_msg({"op": "error", "rank": None,
                                     "message": f"this sidecar serves uid "
                                                f"{os.getuid()}'s trainer only"}))
        writer.close()
        return True

    async def serve(self, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        """asyncio.start_unix_server's callback: serve one connection to its end."""
        if self._foreign(writer):
            return
        try:   # now, while the connection is open (uvloop's socket of a closed one
            # raises ValueError "negative file descriptor": CI of 74a875d)
            trainer_pid = unixsock.peer_creds(writer.get_extra_info("socket"))[0]
        except (OSError, ValueError, TypeError):
            trainer_pid = 0
        try:
            line = await reader.readline()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            line = b""
        except ValueError:   # a first line over the reader's limit: no trainer of ours
            writer.write(ipc.encode_msg({"op": "error", "rank": None,
                                         "message": "control line too long"}))
            line = b""
        if not line:
            writer.close()
            await self._ended_without_a_word(trainer_pid)
            return
        gave_up = self._gave_up(line)
        if gave_up is not None:
            writer.close()
            self.fail(gave_up, self.rank, why=FailureReason.OWN_TRAINER)
            return
        if self._refuse(line, writer):
            return
        self.writer = writer
        clean = False
        try:
            while not self.done.is_set():
                if line is None:
                    line = await _read_line(reader, self.rank)
                if not line:
                    break
                try:
                    msg = ipc.decode_msg(line)
                except ValueError as e:
                    self.send({"op": "error", "rank": self.rank,
                               "message": f"bad control message: {e}"})
                    break
                line = None
                op = msg["op"]
                if op == "bye":
                    clean = True
                    break
                if op in self.ops:
                    await self.ops[op](msg)
                else:
                    self.send({"op": "error", "rank": self.rank,
                               "message": f"unknown op {op!r}"})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # shutting down
            return
        except PeerFailure as e:
            self.fail(str(e), e.rank, why=e.reason, blamed=e.ranks)
        except Exception as e:  # a bug of ours: fail the job cleanly, never linger
            # its traceback goes to this sidecar's log, the evidence of a bug of ours
            # (breaker round 12's IndexError left only its one-line repr)
            log.error("rank %d: internal error; please report this traceback with dgt's "
                      "version", self.rank, exc_info=True)
            self.fail(f"rank {self.rank}: internal error: {e!r}", self.rank)
        if clean:
            self.bye()
        elif not self.done.is_set():
            # its connection ends as its process does: say so when it has ended
            pid = trainer_pid
            ended = pid > 0 and await ended_soon(lambda: not running(pid))
            if not self.done.is_set():
                self.fail(trainer_ended(self.rank, pid) if ended else
                          f"trainer of rank {self.rank} disconnected", self.rank,
                          why=FailureReason.OWN_TRAINER)


async def _read_line(reader: asyncio.StreamReader, rank: int) -> bytes:
    """Our registered trainer's next control line (b"" at its end). Raises PeerFailure
    naming it for a line over the reader's limit (asyncio's ValueError; breaker round 19:
    it failed the job as an internal error of ours, with a traceback)."""
    try:
        return await reader.readline()
    except ValueError:
        raise PeerFailure(f"rank {rank}'s trainer sent a control line over "
                          f"{ipc.MAX_LINE} bytes (dgt.ipc: one JSON object per line)", rank,
                          FailureReason.OWN_TRAINER) from None


#: s: how long a sidecar waits for its trainer's process to be seen ended after its
#: connection closed or its parent-death signal came
ENDED_WAIT_S = 0.5


def trainer_ended(rank: int, pid: int) -> str:
    """The failure line of a trainer (process ``pid``) that ended without closing."""
    return f"trainer of rank {rank} (pid {pid}) ended without closing (it exited or was killed)"


async def ended_soon(gone: Callable[[], bool], wait_s: float = ENDED_WAIT_S) -> bool:
    """Whether ``gone()`` holds within ``wait_s`` seconds (polled, without blocking the
    event loop)."""
    loop = asyncio.get_running_loop()
    t_end = loop.time() + wait_s
    while not gone():
        if loop.time() >= t_end:
            return False
        await asyncio.sleep(0.02)
    return True


def not_a_register(msg: dict, rank: int) -> str:
    """Why the control message ``msg`` (decoded by dgt.ipc.decode_msg) is not a
    well-formed ``register`` ("" when it is): op ``register``, ``n_params`` as
    dgt.registration.check_model_size takes it and, where present, ``dtype``
    ``"float32"`` and ``resume`` / ``param_sha256`` / ``shapes_sha256`` strings
    (dgt.Client sends exactly that). The reason is one line, fit to send back."""
    if msg["op"] != "register":
        return f"the first message must be 'register', not {_short(msg['op'])}"
    try:
        check_model_size(msg.get("n_params"), rank)
    except PeerFailure as e:
        return str(e)
    if msg.get("dtype", "float32") != "float32":
        return f"'register' has 'dtype' {_short(msg['dtype'])}; only 'float32' moves"
    for key in ("resume", "param_sha256", "shapes_sha256"):
        if key in msg and not isinstance(msg[key], str):
            return f"'register' needs {key!r} as a string, not {_short(msg[key])}"
    return ""


def _short(value) -> str:
    """``repr(value)``, cut to 40 characters (a stranger's value goes into a reply)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
