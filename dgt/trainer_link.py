"""The sidecar's side of the trainer's Unix socket (dgt.ipc): one trainer per sidecar,
one JSON line per message, ``register`` / ``part`` / ``push`` / ``save`` / ``bye`` in,
``registered`` / ``pulled`` / ``saved`` / ``error`` out.

A connection that closes before its first line is a probe (another sidecar checking
whether this socket is live: dgt.unixsock), not a trainer; a second trainer gets an
error line and is closed. A trainer that disconnects without ``bye`` fails the job, and
so does a bug of ours while serving it: the job fails cleanly, it never lingers.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from . import ipc
from .errors import PeerFailure
from .failure import FailureReason

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

    def send(self, msg: dict) -> None:
        """One message to the trainer, if one is connected."""
        w = self.writer
        if w is not None and not w.is_closing():
            w.write(ipc.encode_msg(msg))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _hello(self, line: bytes, writer: asyncio.StreamWriter) -> bool:
        """A first line ``{"op": "hello"}`` asks who this sidecar is (dgt.ddp checks the
        job and world size before it attaches): answered, then closed, without taking
        the trainer's place. False for any other line."""
        try:
            if ipc.decode_msg(line).get("op") != "hello":
                return False
        except ValueError:
            return False
        writer.write(ipc.encode_msg(self.whoami))
        writer.close()
        return True

    async def serve(self, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        """asyncio.start_unix_server's callback: serve one connection to its end."""
        try:
            line = await reader.readline()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            line = b""
        except ValueError:   # a first line over the reader's limit: no trainer of ours
            writer.write(ipc.encode_msg({"op": "error", "rank": None,
                                         "message": "control line too long"}))
            line = b""
        if line and self._hello(line, writer):
            return
        if not line or self.writer is not None:
            if line:
                writer.write(ipc.encode_msg({"op": "error", "rank": None,
                                             "message": "this sidecar already has a trainer"}))
            writer.close()
            return
        self.writer = writer
        clean = False
        try:
            while not self.done.is_set():
                if line is None:
                    line = await reader.readline()
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
            log.debug("internal error", exc_info=True)
            self.fail(f"rank {self.rank}: internal error: {e!r}", self.rank)
        if clean:
            self.bye()
        elif not self.done.is_set():
            self.fail(f"trainer of rank {self.rank} disconnected", self.rank,
                      why=FailureReason.OWN_TRAINER)
