"""The state of :func:`dgt.ddp.dgt_hook`: what a checkpoint saves, and the live link to
the node's sidecar (which it does not)."""
from __future__ import annotations

import math
import os
import time

from ..config import (STARTUP_GRACE_S, peer_timeout_of, startup_grace_here,
                      startup_grace_of, trainer_timeout_s)

#: version of :meth:`DgtState.state_dict`'s layout; load_state_dict refuses others
STATE_VERSION = 1
#: bucket timings kept for :attr:`DgtState.timings` (the last this many iterations)
TIMINGS_KEPT = 1000
#: the refusal of a second live DgtState in one process (its sidecar would take the
#: first one's socket, lock and store key)
ONE_PER_PROCESS = ("DgtState(): this process already has a live DgtState; dgt trains one "
                   "DDP model per process: train another model with DDP's own all-reduce "
                   "(no register_comm_hook), or close() the first DgtState before making "
                   "another")

#: the NodeLink of this process's connected DgtState (None before the first)
_live_link = None


class DgtState:
    """State of :func:`dgt.ddp.dgt_hook` for one ``DistributedDataParallel`` model.

    Construct it after ``torch.distributed.init_process_group`` and before the first
    backward, on every rank, for one DDP model per process: a second DgtState while
    one is connected raises RuntimeError (a second model trains with DDP's own
    all-reduce, or after the first state's :meth:`close`). Under torchrun it starts
    this rank's sidecar (one per trainer: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``), or attaches to the one listening on ``socket_path`` (or
    ``$DGT_SOCKET``) when given. What the sidecars do with a push (``--mode``, ``--k``,
    channels, error feedback, …) comes from ``DGT_*`` env vars and ``sidecar_args``
    (``dgt sidecar`` flags, e.g. ``["--mode", "tcp"]``). The sidecar stops when
    :meth:`close` is called, at the latest when the process exits.

    Picklable: its pickled form holds :meth:`state_dict` and the constructor's
    arguments, never a socket or a process; an unpickled state is detached (it does not
    start a sidecar until :meth:`connect`).

    ``timeout_s``: every wait for the sidecar (its start, each push-pull), in seconds;
    on expiry :class:`dgt.PeerFailure` is raised rather than hanging. Default (None):
    ``dgt.config.trainer_timeout_s`` of the sidecar's ``--peer-timeout-s`` (from
    ``sidecar_args``, else ``DGT_PEER_TIMEOUT_S``, else 20 s) and of its
    ``--startup-grace-s`` (from ``sidecar_args``, else ``DGT_STARTUP_GRACE_S``, else
    grown with this node's ``LOCAL_WORLD_SIZE`` per CPU and its load average, as ``dgt
    train``'s): 100 s on an idle machine, longer than the sidecar's own wait on the
    first push (peer timeout + max(40 s, grace)), so a peer that never comes is named
    by the sidecar rather than reported as a sidecar that did not answer.

    ``overlap``: push each bucket's blocks as DDP hands the bucket over, while backward
    goes on (wait-free backpropagation; the default). False: push the whole vector
    after the last bucket, ranked all together, as ``dgt.Client.push_pull`` does.

    The arguments are checked here, in one line naming the argument: TypeError for
    ``sidecar_args`` that is not a list or tuple of str (a str such as ``"--mode tcp"``
    included), ``socket_path`` that is not None, a str or an os.PathLike,
    ``overlap`` or ``connect`` that is not a bool, ``process_group`` that is not None or
    a ``torch.distributed.ProcessGroup``; ValueError for a ``timeout_s`` that is not a
    finite number > 0, a bad ``--peer-timeout-s`` or ``--startup-grace-s`` in
    ``sidecar_args`` (or ``DGT_STARTUP_GRACE_S``), or a flag there
    that DgtState sets itself (``--rank``, ``--world``, ``--host``: ``DGT_HOST``,
    ``--run-dir``: ``DGT_RUN_DIR``, ``--socket``, ``--job``, ``--master-*``). With
    ``connect``: what :meth:`connect` raises. After :meth:`close`, a backward through
    the hook and :meth:`save_sidecar` raise RuntimeError.

    Example::
        >>> # xdoctest: +SKIP
        >>> import torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> from dgt.ddp import DgtState, dgt_hook
        >>> dist.init_process_group("gloo")          # torchrun's env
        >>> model = DDP(net)
        >>> state = DgtState()                       # starts this rank's sidecar
        >>> model.register_comm_hook(state, dgt_hook)
        >>> for x, y in loader:
        >>>     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        >>> state.save_sidecar("sidecar-0.pt")      # residual, scores, ... (the sidecar's)
        >>> torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
        >>>             "dgt": state.state_dict()}, "ckpt.pt")
        >>> state.close()
        >>> # resume (a new process): load_state_dict() before the first backward
        >>> state = DgtState()
        >>> state.load_state_dict(torch.load("ckpt.pt", weights_only=True)["dgt"])
    """

    def __init__(self, process_group=None, socket_path: str | None = None,
                 sidecar_args: list[str] | tuple[str, ...] = (), timeout_s: float | None = None,
                 connect: bool = True, overlap: bool = True):
        self.process_group = _process_group(process_group)
        self.socket_path = _socket_path(socket_path)
        self.sidecar_args = _sidecar_args(sidecar_args)
        #: the sidecar's --startup-grace-s (sidecar_args, else DGT_STARTUP_GRACE_S, else
        #: grown with this node's processes per CPU and its load, as dgt train's)
        self.startup_grace_s = _startup_grace(self.sidecar_args)
        if timeout_s is None:
            timeout_s = trainer_timeout_s(peer_timeout_of(self.sidecar_args),
                                          self.startup_grace_s)
        try:
            self.timeout_s = float(timeout_s)
        except (TypeError, ValueError):
            self.timeout_s = math.nan
        if isinstance(timeout_s, bool) or not 0.0 < self.timeout_s < math.inf:   # NaN too
            raise ValueError(f"DgtState(timeout_s={timeout_s!r}): give the seconds every "
                             f"wait for the sidecar may take, a finite number > 0")
        self.overlap = _flag("overlap", overlap)
        connect = _flag("connect", connect)
        #: DDP iterations whose buckets were all averaged (the next push's iteration)
        self.iteration = 0
        #: parameter sizes in the flat vector's order (fixed at the first iteration)
        self.layout_numels: list[int] | None = None
        #: the file the sidecar last wrote its state to (:meth:`save_sidecar`), or the
        #: one it resumes from at the first iteration (:meth:`load_state_dict`)
        self.sidecar_state: str | None = None
        #: per iteration: {"iteration", "buckets": [[index, handed_s, elements]],
        #: "part_s" (the first part handed over; absent without one), "push_s" (the last
        #: bucket's push), "first_sent_s" (the sidecar's first block sent; None on one
        #: node), "pulled_s"} on CLOCK_MONOTONIC (time.monotonic(), the sidecar's clock
        #: too); the last TIMINGS_KEPT iterations
        self.timings: list[dict] = []
        self._reset_live()
        if connect:
            self.connect()

    def _reset_live(self) -> None:
        self._closed = False    # close() was called: no more buckets
        self._node = None       # dgt.ddp.node.NodeLink: Client + our sidecar process
        self._flat = None       # dgt.ddp.hook.FlatLayout, built at the first iteration
        self._pending: list = []   # this iteration's buckets waiting for the push
        self._first: list = []     # iteration 0's buckets, staged until the layout exists
        self._current: dict | None = None

    # -- checkpoint ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resuming needs from the hook: ``{"version", "iteration",
        "layout_numels", "sidecar_state"}`` (ints and a path; picklable,
        ``torch.save``-able). The sidecar-side state (residual, contribution scores,
        adaptive k, generator, iterations pushed) is model-sized: the sidecar writes it
        to its own file (:meth:`save_sidecar`) and this dict names that file."""
        return {"version": STATE_VERSION, "iteration": int(self.iteration),
                "layout_numels": None if self.layout_numels is None
                else [int(n) for n in self.layout_numels],
                "sidecar_state": self.sidecar_state}

    def save_sidecar(self, path: str) -> None:
        """Have this rank's sidecar write its state to ``path`` now, with ``torch.save``
        (atomically), between two iterations: after the first iteration, before the
        next backward. :meth:`state_dict` then names ``path`` (absolute), and a state
        loaded from it resumes the sidecar from there. Raises RuntimeError before the
        first iteration, OSError when the sidecar could not write it (a full disk: it
        goes on), :class:`dgt.PeerFailure` when the sidecar fails."""
        if self._flat is None:
            raise RuntimeError("save_sidecar() after the first iteration: the sidecar "
                               "has no model laid out before it")
        path = os.path.abspath(path)
        self.node.client.save_state(path)
        self.sidecar_state = path

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned, before the first backward: the
        sidecar resumes from the file it names at the first iteration (bitwise where
        the checkpoint's run would have gone on). Raises ValueError for another version,
        a layout that differs from this model's (a different model), or any state once
        this state's sidecar has started pushing (after the first backward)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a dgt hook state of version {STATE_VERSION}: "
                             f"{type(state).__name__} {getattr(state, 'get', dict)('version')}; "
                             f"save it with DgtState.state_dict()")
        if self._flat is not None:   # breaker round 24: taken, its iteration rewound
            raise ValueError(f"load the hook state before the first backward: this "
                             f"state's sidecar has already pushed {self.iteration} "
                             f"iteration(s)")
        numels = state.get("layout_numels")
        if self.layout_numels is not None and numels is not None and \
                list(numels) != self.layout_numels:
            raise ValueError(f"the checkpoint's model has {len(numels)} parameters "
                             f"({sum(numels)} elements), this one "
                             f"{len(self.layout_numels)} ({sum(self.layout_numels)}); load "
                             f"the checkpoint of this model")
        sidecar_state = state.get("sidecar_state")
        self.iteration = int(state["iteration"])
        self.layout_numels = None if numels is None else [int(n) for n in numels]
        self.sidecar_state = sidecar_state

    def __getstate__(self) -> dict:
        return {"process_group": None, "socket_path": self.socket_path,
                "sidecar_args": self.sidecar_args, "timeout_s": self.timeout_s,
                "startup_grace_s": self.startup_grace_s,
                "overlap": self.overlap, "state": self.state_dict()}

    def __setstate__(self, d: dict) -> None:
        self.process_group = d["process_group"]
        self.socket_path = d["socket_path"]
        self.sidecar_args = list(d["sidecar_args"])
        self.timeout_s = d["timeout_s"]
        self.startup_grace_s = d.get("startup_grace_s", STARTUP_GRACE_S)
        self.overlap = d.get("overlap", True)
        self.iteration, self.layout_numels, self.timings = 0, None, []
        self.sidecar_state = None
        self._reset_live()
        self.load_state_dict(d["state"])

    # -- the sidecar -----------------------------------------------------------------
    def connect(self) -> None:
        """Start (or attach to) this rank's sidecar, if not done yet. Needs
        ``torch.distributed`` initialised. Raises RuntimeError (not initialised, after
        :meth:`close`, or while another DgtState of this process is connected) and
        :class:`dgt.PeerFailure` (the sidecar did not come up, or is another job's)."""
        global _live_link
        self._check_open()
        if self._node is None:
            if _live_link is not None and not _live_link.closed:
                raise RuntimeError(ONE_PER_PROCESS)
            from .node import NodeLink
            args = self.sidecar_args
            if startup_grace_of(args, {}) is None:   # ours, not the user's flag
                args = args + ["--startup-grace-s", repr(self.startup_grace_s)]
            self._node = NodeLink.start(self.socket_path, args, self.timeout_s,
                                        self.process_group)
            _live_link = self._node

    @property
    def run_dir(self) -> str | None:
        """The folder of this rank's sidecar files (``sidecar-<rank>.log``, its socket),
        kept after a failed or interrupted run; None before :meth:`connect`."""
        return None if self._node is None else self._node.run_dir

    @property
    def node(self):
        """The live :class:`dgt.ddp.node.NodeLink`; connects when detached. Raises
        RuntimeError after :meth:`close`."""
        self.connect()
        return self._node

    def close(self, failed: str | None = None) -> None:
        """Say goodbye to the sidecar and wait (bounded) until it has stopped; it
        leaves no process, socket or shared memory behind. Idempotent. The state takes
        no more buckets after it (:func:`dgt.ddp.dgt_hook` and :meth:`save_sidecar`
        raise RuntimeError).

        ``failed``: this trainer's error, one line (e.g. ``"ValueError: bad batch"``),
        for a script that catches its own error and exits: the sidecar fails the job
        naming it, as at an exit by an uncaught exception, instead of the other ranks
        reading an orderly end with fewer steps (an exit function cannot see
        ``sys.exit``'s status). Raises TypeError when it is not a str or None."""
        if failed is not None and not isinstance(failed, str):
            raise TypeError(f"DgtState.close(failed={failed!r}): give the error as a "
                            f"str (one line), or None for an orderly end")
        self._closed = True
        if self._node is not None:
            self._node.close(failed)

    def _check_open(self) -> None:
        """Raise RuntimeError when :meth:`close` was called."""
        if self._closed:
            raise RuntimeError("the DgtState was closed (DgtState.close()); it takes no "
                               "more buckets: close it after the last backward, or train "
                               "on with a new DDP model and a new DgtState")

    def _record(self, key: str, value, first: bool = False) -> None:
        """Note ``value`` under ``key`` in this iteration's timings (``first``: only
        the first value)."""
        if self._current is None:
            self._current = {"iteration": self.iteration, "buckets": []}
        if key == "bucket":
            self._current["buckets"].append(value)
        elif not first or key not in self._current:
            self._current[key] = value
        if key == "pulled_s":
            self.timings.append(self._current)
            del self.timings[:-TIMINGS_KEPT]
            self._current = None

    @staticmethod
    def now() -> float:
        return time.monotonic()


#: ``dgt sidecar`` flags that DgtState sets itself, and where to set what they set
_SET_BY_STATE = {"--rank": " (torch.distributed's rank)",
                 "--world": " (torch.distributed's world size)",
                 "--master-addr": " (its sidecars' store)",
                 "--master-port": " (its sidecars' store)",
                 "--master-listen-fd": " (its sidecars' store)",
                 "--host": " (set DGT_HOST instead)", "--socket": " (in the run dir)",
                 "--run-dir": " (set DGT_RUN_DIR instead)",
                 "--job": " (torchrun's run id, --rdzv-id)"}


def _sidecar_args(args) -> list[str]:
    """``DgtState(sidecar_args=…)`` as a list of str. Raises TypeError for anything but
    a list or tuple of str (or os.PathLike) items, ValueError for a flag that DgtState
    sets itself (``_SET_BY_STATE``)."""
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"DgtState(sidecar_args={args!r}): give a list of 'dgt sidecar' "
                        f"flags, one string each, e.g. [\"--mode\", \"tcp\"]")
    out = []
    for i, a in enumerate(args):
        a = os.fspath(a) if isinstance(a, os.PathLike) else a
        if not isinstance(a, str):
            raise TypeError(f"DgtState(sidecar_args={args!r}): item {i} is "
                            f"{type(a).__name__}; give each flag and each value as a "
                            f"string, e.g. [\"--k\", \"0.1\"]")
        out.append(a)
    for a in out:
        flag = a.split("=", 1)[0]
        if flag in _SET_BY_STATE:
            raise ValueError(f"DgtState(sidecar_args={args!r}): DgtState sets {flag} "
                             f"itself{_SET_BY_STATE[flag]}; leave it out")
    return out


def _startup_grace(sidecar_args: list[str]) -> float:
    """The --startup-grace-s for this rank's sidecar, in seconds: ``sidecar_args``'s,
    else ``DGT_STARTUP_GRACE_S``, else :func:`dgt.config.startup_grace_here` of the
    sidecars (``LOCAL_WORLD_SIZE``) and the store starting now on this node. Before,
    DDP's sidecars kept 10 s where ``dgt train`` had raised it (breaker round 10).
    Raises ValueError naming the flag or variable at fault."""
    given = startup_grace_of(sidecar_args)
    if given is not None:
        return given
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:   # TorchrunEnv names it where it matters
        local = 1
    return startup_grace_here(local + 1)


def _socket_path(path) -> str | None:
    """``DgtState(socket_path=…)`` as a str or None. Raises TypeError for anything but
    None, a str or an os.PathLike of a str."""
    got = os.fspath(path) if isinstance(path, os.PathLike) else path
    if got is not None and not isinstance(got, str):
        raise TypeError(f"DgtState(socket_path={path!r}): give the path of a 'dgt "
                        f"sidecar' socket (a str or os.PathLike), or None to start this "
                        f"rank's own sidecar")
    return got


def _process_group(group):
    """``DgtState(process_group=…)``: None or a torch.distributed.ProcessGroup, else
    TypeError."""
    if group is None:
        return None
    import torch.distributed as dist
    if not isinstance(group, getattr(dist, "ProcessGroup", ())):
        raise TypeError(f"DgtState(process_group={group!r}): give a "
                        f"torch.distributed.ProcessGroup (dist.new_group()), or None for "
                        f"the default group")
    return group


def _flag(name: str, value) -> bool:
    """``DgtState(<name>=value)``: a bool, else TypeError (``"no"`` is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"DgtState({name}={value!r}): give True or False")
    return value
