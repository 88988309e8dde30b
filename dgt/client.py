"""The trainer API: ``dgt.Client``.

Example::

    client = dgt.Client()   # rank 0's sidecar at its default socket (dgt.config)
    client.register(model)
    for step, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        client.push_pull(step, loss=loss.item())  # p.grad <- the aggregate, in place
        optimizer.step()
    client.close()

Gradients go to the sidecar through shared memory (never through the socket). CUDA
gradients are gathered on the GPU and copied through a pinned host buffer.
"""
from __future__ import annotations

import atexit
import bisect
import itertools
import numbers
import os
import re
import socket
import sys
import time
import weakref
from typing import Callable

import numpy as np
import torch

from . import failure, ipc, unixsock
from .config import (LAUNCHED_ENV, MAX_WORLD, default_socket, hand_started_grace,
                     peer_timeout_of, trainer_timeout_s)
from .errors import PeerFailure, one_line, printable
from .failure import FailureReason
from .process import ended
from .scheduler.assign import loss_value, number_or_nan


#: s: how long a trainer whose sidecar closed the connection waits for that process to
#: end, to tell the user it exited (its socket closes a moment before its exit is done)
GONE_WAIT_S = 1.0



def _reported(msg: dict) -> PeerFailure:
    """The failure an ``error`` line of our sidecar reports: a relay (``PEER_REPORTED``)
    of what the sidecar saw, blaming the rank it names, or nobody when it names none;
    never this trainer's own rank (that is for a sidecar gone or silent)."""
    rank = msg.get("rank")
    return PeerFailure(msg.get("message", "unknown error"), rank,
                       FailureReason.PEER_REPORTED)

def no_sidecar(path: str, waited_s: float, why: str, rank: int = 0) -> str:
    """The message for a sidecar socket ``path`` still missing after ``waited_s``; it
    quotes the failure record that rank ``rank``'s last sidecar left beside the socket
    (:func:`last_failure`), when there is one."""
    if os.environ.get(LAUNCHED_ENV):
        return (f"this rank's sidecar did not open {path} within {waited_s:.0f} s ({why}): "
                f"it is not ready (still waiting at the rendezvous, frozen or dead); see "
                f"its log sidecar-<rank>.log in the run dir")
    last = last_failure(os.path.dirname(os.path.abspath(path)), rank)
    return (f"no sidecar at {path} after {waited_s:.0f} s ({why}); "
            + (f"{last}; start 'dgt sidecar' again" if last else
               "start 'dgt sidecar' first"))


def last_failure(run_dir: str, rank: int) -> str:
    """``the last sidecar of rank 1 there failed at 18:02:11 UTC: <its message>`` from
    ``failure-sidecar-<rank>.json`` in ``run_dir`` (a hand-started sidecar removes its
    rank's record when it starts, so the record is the last one's); "" when there is
    none or it cannot be read. A trainer started after its sidecar gave up learns why,
    not only that no sidecar is there."""
    path = failure.record_path(run_dir, "sidecar", rank)
    rec = failure.read(path)
    if rec is None or rec.rank != rank:
        return ""
    try:
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.stat(path).st_mtime))
    except OSError:
        return ""
    return (f"the last sidecar of rank {rank} there failed at {at}: "
            f"{one_line(rec.message)}")


#: s: the longest timeout a Client takes (a socket's timeout overflows the platform's
#: time_t from about 9.2e9 s: breaker round 18's timeout_s=1e10); about 31 years
MAX_TIMEOUT_S = 1e9


def _seconds(name: str, value, what: str) -> float:
    """``value`` of the Client argument ``name`` as float seconds. Raises ValueError,
    naming the argument and ``what`` the seconds are for, unless it is a number > 0 and
    at most :data:`MAX_TIMEOUT_S` (not a bool or a str)."""
    v = number_or_nan(value)
    if not 0.0 < v <= MAX_TIMEOUT_S:   # NaN too
        raise ValueError(f"Client({name}={value!r}): give the seconds {what}, a number "
                         f"> 0 and <= {MAX_TIMEOUT_S:g}")
    return v


def uncaught_exception() -> str | None:
    """``"RuntimeError: boom"`` (one line, at most 300 characters) for the uncaught
    exception that is ending the interpreter, else None. Python's default handling of
    the main thread's uncaught exception sets ``sys.last_value`` before the atexit
    functions run (an interactive session sets it for each error it printed too)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return None if exc is None else failure_text(exc)


def failure_text(failed: object) -> str:
    """What :meth:`Client.close` sends for ``failed`` (not None): one line of at most
    300 printable characters (others as backslash escapes, a lone surrogate too), never
    empty, and never an exception of its own. An exception is ``"<its type>: <its
    message>"`` (its type alone when the message is empty), a str itself (``""``, e.g.
    ``str(AssertionError())``, is still a failure), anything else its repr. Breaker
    round 19: a ``__str__`` or ``__repr__`` that raised made close() raise before it
    said anything, and a 70,000-character text was over the control line's limit;
    either way the hand-started sidecar waited for ever. Round 20: one that raised
    SystemExit or KeyboardInterrupt did too, and a lone surrogate could not be sent on
    to the other ranks."""
    try:
        if isinstance(failed, BaseException):
            message = str(failed)
            text = f"{type(failed).__name__}: {message}" if message else \
                type(failed).__name__
        else:
            text = failed if isinstance(failed, str) else repr(failed)
        return one_line(text, "an error with no message")
    except BaseException as e:   # noqa: BLE001 - its __str__ or __repr__ raised
        try:
            name = printable(str.__str__(type(failed).__name__))[:100]
        except BaseException:   # noqa: BLE001 - its type's name too
            name = "an object"
        return f"{name} (its text could not be read: {type(e).__name__})"


def _close_at_exit(ref) -> None:
    """At interpreter exit (atexit), for a :class:`Client` that never registered and
    was not closed: it says goodbye, or names the uncaught exception ending the
    interpreter, so its sidecar ends at once naming this trainer (breaker round 18: a
    register() that raised, uncaught, left a hand-started sidecar waiting for ever). A
    registered one is left alone: its sidecar names the disconnect, as before."""
    c = ref()
    if c is not None and not c.closed and c.grad is None:
        c.close(failed=uncaught_exception())


def _an_int(v) -> bool:
    """An int (a numpy integer too), not a bool."""
    return not isinstance(v, bool) and isinstance(v, numbers.Integral)


def _a_path(path) -> bool:
    """Whether ``path`` is a file path the sidecar can be sent and open: a non-empty str
    or os.PathLike giving one, without a NUL byte (breaker round 19: save_state with a
    NUL failed the job with the sidecar's 'internal error: embedded null byte')."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:   # a PathLike whose __fspath__ gives an int, or raises
        path = os.fspath(path)
    except Exception:
        return False
    return isinstance(path, str) and path != "" and "\0" not in path


def _registered(model, resume) -> list[torch.Tensor]:
    """``model``'s trainable parameters, checked for :meth:`Client.register` (its
    docstring says what is refused). Raises TypeError, ValueError."""
    if resume is not None and not _a_path(resume):
        raise ValueError(f"register(resume={resume!r}): give the file save_state() wrote, "
                         f"a path, or None to start from step 0")
    if not callable(getattr(model, "parameters", None)):   # breaker round 23: an
        # AttributeError; what has parameters() will do (dgt.ddp's bucket views)
        raise TypeError(f"register(model=...): give a torch.nn.Module, got a "
                        f"{type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters; nothing to push")
    for p in params:
        if p.dtype != torch.float32:
            raise TypeError(f"dgt moves float32 gradients; got {p.dtype}")
    return params


def sidecar_log_of(path: str) -> str | None:
    """The log of the sidecar on socket ``path`` where dgt's launchers put it: beside a
    socket named ``sidecar-<rank>.sock``, ``sidecar-<rank>.log`` when it exists (else,
    started by a launcher, that name in the run dir; else None)."""
    m = re.fullmatch(r"sidecar-(0|[1-9][0-9]*)\.sock", os.path.basename(path))
    if m:
        log = os.path.join(os.path.dirname(os.path.abspath(path)),
                           f"sidecar-{m.group(1)}.log")
        if os.path.isfile(log):
            return log
    return "sidecar-<rank>.log in the run dir" if os.environ.get(LAUNCHED_ENV) else None


class Client:
    """Connects a trainer to its node's sidecar over the Unix socket ``path`` (default:
    ``dgt sidecar``'s default socket for ``rank``, ``$XDG_RUNTIME_DIR/dgt`` else
    ``/tmp/dgt-<uid>``, ``sidecar-<rank>.sock``).

    The sidecar must run as this process's user: the client reads the listening
    process's uid (SO_PEERCRED) and raises :class:`PeerFailure`, naming the socket and
    that uid, when it differs (another user's process squatting the path). ``timeout_s``
    bounds every wait for the sidecar, in seconds; on expiry :class:`PeerFailure` is
    raised rather than hanging. Default (None): ``dgt.config.trainer_timeout_s`` of
    ``DGT_PEER_TIMEOUT_S`` (else the sidecar's default, 20 s) and of the start-up grace
    a hand-started sidecar takes (``dgt.config.hand_started_grace``), 100 s on an idle
    machine, longer than the sidecar's wait on its first push, so that a peer that
    never comes is named.

    A sidecar that closes the connection without saying why (killed, crashed) is named
    by its socket and pid (SO_PEERCRED) in the :class:`PeerFailure`; whoever started it
    may set ``sidecar_exit`` (``wait_s`` -> how it ended, e.g. ``was killed by
    SIGKILL``, or None while it runs) for the message to say more (dgt.ddp does); its
    log is named where dgt's launchers put it (:func:`sidecar_log_of`).

    ``connect_timeout_s``: how long to wait for the sidecar's socket to accept (s).

    The arguments are checked first, in one line naming the argument: ValueError for a
    ``timeout_s`` (when given) or ``connect_timeout_s`` that is not a number > 0 and
    at most :data:`MAX_TIMEOUT_S` (NaN, inf, 0, a negative, a bool, a str), a ``rank``
    that is not an int >= 0, and an empty ``path``.
    Then PeerFailure when no sidecar accepts on ``path`` within ``connect_timeout_s``, or
    another user's process listens there.
    """

    def __init__(self, path: str | None = None, timeout_s: float | None = None,
                 connect_timeout_s: float = 60.0, rank: int = 0):
        if timeout_s is not None:
            timeout_s = _seconds("timeout_s", timeout_s,
                                 "every wait for the sidecar may take")
        connect_timeout_s = _seconds("connect_timeout_s", connect_timeout_s,
                                     "to wait for the sidecar's socket")
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or \
                not 0 <= rank < MAX_WORLD:
            raise ValueError(f"Client(rank={rank!r}): give this trainer's rank, an int "
                             f"in 0..{MAX_WORLD - 1}")
        rank = int(rank)
        if path is None:
            path = default_socket(rank)
        elif not _a_path(path):
            raise ValueError(f"Client(path={path!r}): give the sidecar's Unix socket, a "
                             f"path (None: dgt sidecar's default for the rank)")
        if timeout_s is None:
            timeout_s = trainer_timeout_s(peer_timeout_of(()), hand_started_grace())
        deadline = time.monotonic() + connect_timeout_s
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(path)
                unixsock.check_peer(self.sock, path)
                break
            except unixsock.NotOurs as e:
                self.sock.close()
                raise PeerFailure(str(e)) from None
            except (FileNotFoundError, ConnectionRefusedError) as e:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise PeerFailure(no_sidecar(path, connect_timeout_s, e.strerror,
                                                     rank)) \
                        from None
                time.sleep(0.05)
        self.sock.settimeout(timeout_s)
        self.timeout_s = timeout_s
        self.path = path
        #: the sidecar's pid (SO_PEERCRED) and how it ended (see above)
        self.sidecar_pid: int | None = unixsock.peer_creds(self.sock)[0] or None
        self.sidecar_exit: Callable[[float], str | None] | None = None
        atexit.register(_close_at_exit, weakref.ref(self))
        self.file = self.sock.makefile("rb")
        self.params: list[torch.Tensor] = []
        self.grad: np.ndarray | None = None
        self.aggregate: np.ndarray | None = None
        self.last_k: float | None = None
        #: CLOCK_MONOTONIC (s) when the last push's first block left the sidecar, None
        #: when none left it (one node)
        self.last_first_sent: float | None = None
        self.next_step = 0
        #: the [lo, hi) ranges push_part handed over in iteration next_step, sorted
        self._parts: tuple[int, list[tuple[int, int]]] = (-1, [])
        self.closed = False

    # -- control ----------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        try:
            self.sock.sendall(ipc.encode_msg(msg))
        except OSError as e:
            # the sidecar may have said why before it closed (a peer failed): prefer that
            reason = self._pending_error()
            if reason is not None:
                raise reason from None
            raise self._sidecar_gone(str(e)) from None

    def _sidecar_gone(self, detail: str) -> PeerFailure:
        """The PeerFailure for our sidecar's connection closed or broken without an
        ``error`` line (``detail``: what the socket said). It names the sidecar (socket,
        pid), says it exited or was killed once its process has ended (within
        GONE_WAIT_S s; how, where ``sidecar_exit`` knows) and where its log is."""
        pid = self.sidecar_pid
        who = f"this rank's sidecar ({f'pid {pid}, ' if pid else ''}socket {self.path})"
        how = self.sidecar_exit(GONE_WAIT_S) if self.sidecar_exit is not None else None
        if how is None and pid and ended(pid, GONE_WAIT_S):
            how = "exited or was killed"
        text = f"{who} closed the connection " + (
            f"without a word: it {how}" if how else f"({detail}); it still runs")
        log = sidecar_log_of(self.path)
        return PeerFailure(text + (f"; see its log {log}" if log else ""))

    def _pending_error(self) -> PeerFailure | None:
        """An ``error`` line the sidecar sent before closing, if one is buffered."""
        try:
            self.sock.settimeout(1.0)
            line = self.file.readline(ipc.MAX_LINE)
            msg = ipc.decode_msg(line) if line else None
        except (OSError, ValueError):
            return None
        finally:
            try:
                self.sock.settimeout(self.timeout_s)
            except OSError:
                pass
        if msg and msg.get("op") == "error":
            return _reported(msg)
        return None

    def _recv(self, want: str, also: str = "") -> dict:
        try:
            line = self.file.readline(ipc.MAX_LINE)
        except socket.timeout:
            raise PeerFailure(f"sidecar did not answer within {self.timeout_s:.0f} s") from None
        except OSError as e:
            raise self._sidecar_gone(str(e)) from None
        if not line:
            raise self._sidecar_gone("end of stream")
        msg = ipc.decode_msg(line)
        if msg["op"] == "error":
            raise _reported(msg)
        if msg["op"] != want and msg["op"] != also:
            raise PeerFailure(f"sidecar sent {msg['op']!r}, expected {want!r}")
        return msg

    # -- API --------------------------------------------------------------------------
    def register(self, model: torch.nn.Module, resume: str | None = None) -> None:
        """Lay out ``model``'s trainable parameters (float32, any memory format) as one
        flat vector, in ``model.parameters()`` order. Call once per client.

        Every rank must start from the same parameters (as with DDP, but checked rather
        than broadcast): the sidecars compare a SHA-256 of them, and refuse the job,
        naming the ranks that differ from rank 0, when they are not bitwise equal.

        ``resume``: a file that :meth:`save_state` wrote (``dgt.checkpoint``); the
        sidecar loads its state from it (residual, scores, adaptive k, generator,
        iteration) and the next ``push_pull`` step is the one after the checkpoint. Load
        the model's and optimiser's state first, from the same checkpoint.

        Raises TypeError for a ``model`` that has no ``parameters()`` (not a
        torch.nn.Module) or has non-float32 parameters, ValueError for a model without
        trainable parameters or a ``resume`` that is not a non-empty path (an empty
        one, from an unset variable, would start again from step 0), RuntimeError when
        already registered or closed, and PeerFailure when the sidecar refuses
        (different model sizes or parameters, a checkpoint of another rank or layout,
        or of a model of other parameter shapes).
        After a TypeError or ValueError the client is as before, and register() may be
        called again; should the interpreter end first (an uncaught exception), the
        sidecar is told at exit and ends naming it (``_close_at_exit``).
        """
        self._check_open()
        if self.grad is not None:
            raise RuntimeError("register() was already called; one model per Client")
        params = _registered(model, resume)
        n = sum(p.numel() for p in params)
        # the sidecars compare it across ranks: replicas that start apart stay apart
        self._send({"op": "register", "n_params": n, "dtype": "float32",
                    "param_sha256": param_sha256(params),
                    "shapes_sha256": shapes_sha256(params),
                    **({"resume": os.fspath(resume)} if resume is not None else {})})
        msg = self._recv("registered")
        self.next_step = int(msg.get("iterations", 0))
        self._maps = [ipc.ShmBuffer(msg["grad"], msg["padded"])]
        if msg["aggregate"] != msg["grad"]:
            self._maps.append(ipc.ShmBuffer(msg["aggregate"], msg["padded"]))
        for m in self._maps:   # mapped: the names can go (nothing left by a SIGKILL)
            ipc.drop_name(m.path)
        self.params = params
        self.grad, self.aggregate = self._maps[0].array, self._maps[-1].array
        self.n_params = n
        #: (P + 1,) element offsets of the parameters in the flat vector
        self._offsets = [0, *itertools.accumulate(p.numel() for p in params)]
        self.device = params[0].device
        if self.device.type == "cuda":
            self._dev_flat = torch.empty(n, dtype=torch.float32, device=self.device)
            self._pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)

    def push_pull(self, step: int, loss: float | None = None,
                  ready: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Push this step's gradients and replace each ``p.grad`` with the aggregate
        (the mean over workers). Blocks until it is applied. ``step`` must increase by
        one per call, from 0 (the BSP iteration).

        ``ready(params)``: PULLs pipelined per shard range. Each shard's PULL brings
        its range of the aggregate; as soon as every element of some parameters is in,
        their ``p.grad`` is set and ``ready`` is called with them (registered
        parameters, in order), so the caller can step its optimiser on them while
        later ranges are still on the way. Every parameter is passed exactly once per
        call, and all before ``push_pull`` returns. The values are the same as
        without ``ready``; only when they are applied changes.

        ``loss``: this step's training loss, for the sidecar's adaptive k
        (``--adaptive-k``): one real number (a Python number, a numpy scalar, a 0-dim or
        one-element tensor or array; sent as ``float(loss)``), or None. A NaN, inf or a
        loss <= 0 is sent as it is and the adaptive k ignores it
        (``scheduler.assign.AdaptiveK.update``).

        Raises RuntimeError before register() or after close(), TypeError for a step
        that is not an int or a ``ready`` that is not callable, ValueError for a step
        out of order, TypeError naming ``loss`` for a loss that is not one real number
        (a tensor of more elements, a str, a bool; nothing is sent, the step is still
        due), and PeerFailure when the job failed. What ``ready`` raises is
        raised unchanged, after the iteration's last PULL is in (the step counts as
        done; the parameters ``ready`` had not been given yet have their ``p.grad``
        set but were not passed to it).
        """
        start = time.monotonic()   # the sidecar's trace measures comm time from here
        step = self._due(step, "push_pull")
        if ready is not None and not callable(ready):   # before anything moves
            raise TypeError(f"push_pull(ready=...): give a function of the parameters "
                            f"that are ready, or None; got a {type(ready).__name__}")
        loss = loss_value(loss)   # TypeError before anything moves
        g = torch.from_numpy(self.grad)[: self.n_params]
        a = torch.from_numpy(self.aggregate)[: self.n_params]
        had_none = [p.grad is None for p in self.params]
        if self.device.type == "cuda":
            torch.cat([_grad(p).reshape(-1) for p in self.params], out=self._dev_flat)
            self._pinned.copy_(self._dev_flat)
            g.copy_(self._pinned)
        else:
            off = 0
            for p in self.params:
                n = p.numel()
                if not self._is_view(p, g, off):   # zero_grad(set_to_none=True) etc.
                    g[off:off + n].copy_(_grad(p).reshape(-1))
                off += n
        if ready is None:
            self._exchange(step, loss, start, None)
            self._apply(range(len(self.params)), had_none, a, 0, self.n_params)
            return
        pending = _Pending(self._offsets)

        def on_range(lo: int, hi: int) -> None:
            done = pending.take(lo, hi)
            if done:
                self._apply(done, had_none, a, self._offsets[done[0]],
                            self._offsets[done[-1] + 1])
                ready([self.params[i] for i in done])
        self._exchange(step, loss, start, on_range)
        rest = pending.rest()   # empty parameters (no element to wait for)
        if rest:
            self._apply(rest, had_none, a, 0, 0)
            ready([self.params[i] for i in rest])

    def _apply(self, idx, had_none: list[bool], a: torch.Tensor, lo: int, hi: int) -> None:
        """Set ``p.grad`` of parameters ``idx`` (indices into ``self.params``,
        ascending) from the aggregate ``a`` ((n_params,) float32 over shared memory);
        [lo, hi): the elements they span (CUDA: copied through the pinned buffer)."""
        if self.device.type == "cuda":
            if hi > lo:
                self._pinned[lo:hi].copy_(a[lo:hi])
                self._dev_flat[lo:hi].copy_(self._pinned[lo:hi], non_blocking=False)
            src = self._dev_flat
        else:
            src = a
        shared = self.device.type == "cpu" and self.aggregate is self.grad
        for i in idx:
            p, none, off = self.params[i], had_none[i], self._offsets[i]
            n = p.numel()
            view = src[off:off + n].view(p.shape)
            if none and not bool(view.any()):
                # no worker had a gradient for it (its mean is exactly 0): keep None, as
                # one process would, so momentum and weight decay leave it alone
                p.grad = None
            elif shared and p.is_contiguous():
                # p.grad becomes the shared memory itself: backward accumulates into it
                # (zero_grad(set_to_none=False)) and the next push reads it in place
                p.grad = view
            else:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                # view(p.shape) is the logical layout; copy_ writes any memory format
                p.grad.copy_(view)

    def save_state(self, path: str) -> None:
        """Have the sidecar write its state between two iterations (after a
        ``push_pull``, before the next) to ``path`` with ``torch.save``: what
        ``register(model, resume=path)`` needs to continue bitwise. The model's and
        optimiser's state are the caller's to save. Raises RuntimeError before
        register() or after close(); ValueError for a ``path`` that is empty or not a
        path (nothing is sent); OSError naming ``path`` when the sidecar could not
        write it (a full disk, EIO: nothing is left at ``path``, and the sidecar goes
        on); PeerFailure when the sidecar fails."""
        self._check_open()
        if self.grad is None:
            raise RuntimeError("call register(model) before save_state()")
        if not _a_path(path):
            raise ValueError(f"save_state({path!r}): give the file to write, a path")
        path = os.path.abspath(path)   # the sidecar's working folder may differ
        self._send({"op": "save", "path": path})
        msg = self._recv("saved")
        if msg.get("error"):
            code = msg.get("errno")
            raise OSError(code if type(code) is int else None, str(msg["error"]), path)

    def push_buffer(self, step: int, loss: float | None = None,
                    start: float | None = None,
                    on_range: Callable[[int, int], None] | None = None) -> None:
        """Push the flat gradient that ``self.grad`` (float32, ``n_params`` elements in
        register()'s order) holds, as iteration ``step``, and block until
        ``self.aggregate`` holds the mean over workers; ``p.grad`` is not touched (for
        callers that fill the buffer themselves: the DDP hook, :mod:`dgt.ddp`).
        ``start``: time.monotonic() when the iteration's communication began (the
        sidecar's trace counts comm time from it; default now). ``on_range(lo, hi)``:
        called as each shard's range [lo, hi) of ``self.aggregate`` (elements, clipped
        to ``n_params``) is final, before the call returns (PULLs pipelined per shard
        range). ``loss``: as :meth:`push_pull` takes it. Raises as :meth:`push_pull`
        does, before anything is sent: RuntimeError before register() or after close(),
        TypeError for a ``step`` that is not an int (a float, a bool), ValueError for one
        out of order, TypeError naming ``loss`` for a loss that is not one real number;
        then PeerFailure."""
        self._exchange(self._due(step, "push_buffer"), loss_value(loss), start, on_range)

    def _exchange(self, step: int, loss: float | None, start: float | None,
                  on_range: Callable[[int, int], None] | None) -> None:
        """:meth:`push_buffer` once its arguments are checked (push_pull checked them)."""
        self._send({"op": "push", "t": step, "loss": loss,
                    "start": time.monotonic() if start is None else start,
                    **({"ranges": True} if on_range is not None else {})})
        error = None   # what on_range raised: re-raised once the iteration is read
        while True:
            msg = self._recv("pulled", also="range")
            if msg["op"] == "pulled":
                break
            lo, hi = msg.get("lo"), msg.get("hi")
            if msg.get("t") != step or type(lo) is not int or type(hi) is not int:
                raise PeerFailure(f"sidecar sent a bad range message {msg!r} for step "
                                  f"{step}")
            lo, hi = max(0, lo), min(hi, self.n_params)
            if lo < hi and error is None:
                try:
                    on_range(lo, hi)
                except Exception as e:   # the caller's: the stream stays in step
                    error = e
        self.last_k, self.last_first_sent = msg.get("k"), msg.get("first_sent")
        self.next_step += 1
        if error is not None:
            raise error

    def push_part(self, step: int, ranges: list[tuple[int, int]]) -> None:
        """Hand over part of iteration ``step`` before its :meth:`push_buffer`: the
        element ranges ``ranges`` ([lo, hi) of ``self.grad``, ints, never one element
        twice in an iteration) are final in the shared buffer. The sidecar sends the
        blocks they complete at once (wait-free backpropagation, :mod:`dgt.parts`);
        ``push_buffer`` then sends the rest. Does not wait for an answer: a part the
        sidecar refuses fails the job, and the next ``push_buffer`` raises
        PeerFailure saying why. Raises, before anything is sent: RuntimeError before
        register() or after close(), TypeError or ValueError for a ``step`` that
        :meth:`push_buffer` would refuse, TypeError for ``ranges`` that are not pairs of
        ints (a float, inf, a bool), ValueError for none, a range that is not
        0 <= lo < hi <= n_params, or one that overlaps another of this iteration's
        (each would fail the job at the sidecar)."""
        step = self._due(step, "push_part")
        try:
            pairs = [[lo, hi] for lo, hi in ranges]
        except (TypeError, ValueError):
            raise TypeError("push_part(ranges=...): give (lo, hi) pairs of ints") from None
        if not all(_an_int(v) for pair in pairs for v in pair):
            raise TypeError(f"push_part(ranges=...): give (lo, hi) pairs of ints, got "
                            f"{one_line(repr(pairs))}")
        bad = next((p for p in pairs if not 0 <= p[0] < p[1] <= self.n_params), None)
        if not pairs or bad is not None:
            raise ValueError(f"push_part(ranges=...): give one or more [lo, hi) with "
                             f"0 <= lo < hi <= {self.n_params} (the parameters' "
                             f"elements), got {one_line(repr(bad or pairs))}")
        pairs = [(int(lo), int(hi)) for lo, hi in pairs]
        earlier = self._parts[1] if self._parts[0] == step else []
        every = sorted(earlier + pairs)
        clash = next((i for i in range(len(every) - 1) if every[i][1] > every[i + 1][0]),
                     None)
        if clash is not None:
            a, b = every[clash], every[clash + 1]
            raise ValueError(f"push_part(ranges=...): [{a[0]}, {a[1]}) and [{b[0]}, "
                             f"{b[1]}) overlap: each element is handed over once per "
                             f"iteration (step {step})")
        self._send({"op": "part", "t": step, "ranges": [[lo, hi] for lo, hi in pairs]})
        self._parts = (step, every)

    def _due(self, step, what: str) -> int:
        """``step`` as an int when it is the one due now; else raises as
        :meth:`push_pull` says (RuntimeError, TypeError, ValueError)."""
        self._check_open()
        if self.grad is None:
            raise RuntimeError(f"call register(model) before {what}()")
        if not _an_int(step):
            raise TypeError(f"step must be an int (the BSP iteration, from 0), got "
                            f"{step!r}")
        if step != self.next_step:
            raise ValueError(f"step {step} out of order: expected {self.next_step} "
                             f"(one push per iteration, counting from 0)")
        return int(step)

    @staticmethod
    def _is_view(p: torch.Tensor, g: torch.Tensor, off: int) -> bool:
        """True when ``p.grad`` is still the shared buffer's slice at ``off``."""
        return p.grad is not None and p.grad.is_contiguous() and \
            p.grad.data_ptr() == g.data_ptr() + 4 * off

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Client is closed")

    def close(self, failed: str | BaseException | None = None) -> None:
        """Say goodbye (the sidecar then ends cleanly) and unmap the buffers. Idempotent;
        never raises for ``failed``. ``failed``: this trainer is ending on an error, as
        text (e.g. ``"RuntimeError: boom"``) or the exception itself (sent as ``"<its
        type>: <its message>"``): the sidecar then fails the job naming it and this
        rank's step, rather than ending cleanly (which the others would take for fewer
        steps); anything but None is a failure, an empty text too, and what is sent is
        one line of at most 300 characters (:func:`failure_text`). Before register(), a
        bare close() also ends the sidecar, naming this trainer: it gave up before
        registering."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send({"op": "bye"} if failed is None else
                       {"op": "failed", "error": failure_text(failed)})
        except PeerFailure:
            pass
        self.grad = self.aggregate = None
        for m in getattr(self, "_maps", []):
            m.close()
        self.file.close()
        self.sock.close()


def param_sha256(params: list[torch.Tensor]) -> str:
    """SHA-256 (hex) of the parameters' float32 values, in order and in their logical
    (row-major) layout, whatever their device or memory format."""
    import hashlib
    h = hashlib.sha256()
    with torch.no_grad():
        for p in params:
            h.update(p.detach().reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def shapes_sha256(params: list[torch.Tensor]) -> str:
    """SHA-256 (hex) of the parameters' shapes, in order (the JSON text of the list of
    shapes, e.g. ``[[6,4],[6]]``): the model's layout, which a sidecar state records
    (dgt.checkpoint), so that a resume refuses a model of as many parameters laid out
    otherwise."""
    import hashlib
    import json
    text = json.dumps([list(p.shape) for p in params], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class _Pending:
    """Which parameters still wait for aggregate elements: ``offsets`` (P + 1,) where
    each begins in the flat vector, and where the last ends. :meth:`take` books a range
    of elements that arrived (ranges never overlap) and returns the parameters it
    completed."""

    def __init__(self, offsets: list[int]):
        self.offsets = offsets
        self.left = [b - a for a, b in zip(offsets, offsets[1:])]
        self.done = [False] * len(self.left)

    def take(self, lo: int, hi: int) -> list[int]:
        """Elements [lo, hi) arrived. Returns the indices (ascending) of the parameters
        whose last missing element was among them."""
        out = []
        i = max(0, bisect.bisect_right(self.offsets, lo) - 1)
        while i < len(self.left) and self.offsets[i] < hi:
            got = min(hi, self.offsets[i + 1]) - max(lo, self.offsets[i])
            if got > 0 and not self.done[i]:
                self.left[i] -= got
                if self.left[i] <= 0:
                    self.done[i] = True
                    out.append(i)
            i += 1
        return out

    def rest(self) -> list[int]:
        """The parameters :meth:`take` never completed (those without elements), now
        taken. Ascending."""
        out = [i for i, d in enumerate(self.done) if not d]
        self.done = [True] * len(self.done)
        return out


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
