"""This trainer's sidecar under torchrun: start one (or attach to one), stop it with the job.

One sidecar per trainer (dgt rank = torch rank, dgt world = torch world size), so
``--nproc-per-node P`` runs P sidecars on the node, as ``dgt train`` does (docs/ddp.md
says why). The sidecars rendezvous on a store of their own, hosted by rank 0's sidecar;
its address goes through torch.distributed's default store (torchrun's, at
``MASTER_ADDR:MASTER_PORT``) under a key named by the run (``TORCHELASTIC_RUN_ID``) and
its restart count (``TORCHELASTIC_RESTART_COUNT``), so no port is guessed and a
restarted generation never reads the last one's.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta

from .. import ipc
from ..child_argv import module_argv
from ..client import Client, uncaught_exception
from ..process import exit_text, running, stop
from ..config import default_run_dir
from ..deadline import bounded
from ..unixsock import NotOurs, owned_dir, private_dir, say_hello
from ..errors import PeerFailure
from ..jsonparse import is_port, loads
from ..rendezvous import QUIET_TORCH_ENV
from ..run_files import (check_run_dir, lock_holder, open_lock, rank_of, read_json,
                         share_lock)
from . import generation

#: how long close() waits for the sidecar to end on its own before SIGTERM
CLOSE_GRACE_S = 30.0
#: how long a restarted generation waits for the failed one's sidecar to end by itself
REAP_GRACE_S = 10.0
#: how long a trainer stopped by SIGTERM waits for its sidecar to end before SIGKILL
SIGTERM_GRACE_S = 3.0

#: sidecars this process has started (every rank starts them in the same order)
_spawned = 0


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (torch.distributed.run) tells each worker, from its environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int

    @classmethod
    def from_environ(cls, environ=os.environ) -> "TorchrunEnv":
        """Raises ValueError naming the variable that is missing or malformed."""
        def get(name, typ, default=None):
            raw = environ.get(name)
            if raw is None:
                if default is None:
                    raise ValueError(f"{name} is not set: start the script with torchrun "
                                     f"(or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
                return default
            try:
                return typ(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a{'n integer' if typ is int else ''} "
                                 f"valid value") from None
        return cls(rank=get("RANK", int), world=get("WORLD_SIZE", int),
                   local_rank=get("LOCAL_RANK", int, 0),
                   local_world=get("LOCAL_WORLD_SIZE", int, 1),
                   master_addr=get("MASTER_ADDR", str), master_port=get("MASTER_PORT", int),
                   run_id=get("TORCHELASTIC_RUN_ID", str, "none"),
                   restart_count=get("TORCHELASTIC_RESTART_COUNT", int, 0))

    @property
    def tag(self) -> str:
        """The run and its generation, safe in a file name: ``<run_id>-g<restart>``."""
        return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.run_id)[:40]}-g{self.restart_count}"


def route_source(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (where peers reach us): the source
    address the kernel picks for a UDP "connect" (no packet is sent)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def hello(path: str, timeout_s: float = 5.0) -> dict:
    """Ask the sidecar on ``path`` who it is: ``{"rank", "world", "job"}``. Raises
    PeerFailure when nothing answers there."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        # the whole answer within timeout_s, not each read (dgt.deadline): a process
        # there that sends a byte now and then is not waited on for ever
        s = bounded(s, time.monotonic() + timeout_s, f"no whole answer within "
                    f"{timeout_s:g} s")
        s.sendall(ipc.encode_msg({"op": "hello"}))
        line = s.makefile("rb").readline(ipc.MAX_LINE)
        msg = ipc.decode_msg(line) if line else {}
    except (OSError, ValueError) as e:
        raise PeerFailure(f"no dgt sidecar answers on {path} ({e}); start 'dgt sidecar' "
                          f"there, or unset DGT_SOCKET to let dgt start one") from None
    finally:
        s.close()
    if msg.get("op") != "hello":
        raise PeerFailure(f"the sidecar on {path} does not answer hello (an older dgt?); "
                          f"restart it with this dgt")
    return msg


def check_node_variables(rank: int, world: int) -> None:
    """Refuse ``DGT_RANK`` or ``DGT_WORLD`` that contradicts torch.distributed's
    ``rank`` or ``world`` (ValueError, one line). Under DDP the dgt rank and world are
    the process group's; such a variable, left from a ``dgt sidecar`` set-up, was read
    by nobody and said nothing (breaker round 12). Equal values are taken."""
    for var, what, want in (("DGT_RANK", "rank", rank), ("DGT_WORLD", "world size", world)):
        given = os.environ.get(var)
        if given is None:
            continue
        if not given.strip():   # as dgt train and dgt sidecar refuse an empty value
            raise ValueError(f"{var} is set but empty; unset it (under DDP, dgt's {what} "
                             f"is torch.distributed's, {want})")
        try:
            got = int(given)   # the forms dgt sidecar takes: ' 2', '02'
        except ValueError:
            got = None
        if got != want:
            raise ValueError(f"{var}={given!r} is not torch.distributed's {what} "
                             f"({want}): under DDP, dgt's {what} is the process group's; "
                             f"unset {var}")


def check_attach(info: dict, path: str, env: TorchrunEnv, world: int, rank: int) -> None:
    """Refuse a sidecar of another job, another world size or another rank, in one line
    (PeerFailure)."""
    if info.get("job") and env.run_id != "none" and info["job"] != env.run_id:
        raise PeerFailure(f"the sidecar on {path} belongs to job {info['job']!r}, this is "
                          f"torchrun job {env.run_id!r}; give this job its own DGT_SOCKET "
                          f"(or unset it to let dgt start one)")
    if info.get("world") != world:
        raise PeerFailure(f"the sidecar on {path} has world size {info.get('world')}, "
                          f"torch.distributed has {world}; start the sidecars with "
                          f"--world {world}")
    if info.get("rank") != rank:
        raise PeerFailure(f"the sidecar on {path} is rank {info.get('rank')}, this trainer "
                          f"is rank {rank}; point DGT_SOCKET at rank {rank}'s sidecar")


class NodeLink:
    """A :class:`dgt.Client` on this trainer's sidecar, and the sidecar process when we
    started it."""

    def __init__(self, client: Client, proc: subprocess.Popen | None, socket_path: str,
                 run_dir: str, rank: int, world: int):
        self.client, self.proc, self.socket_path = client, proc, socket_path
        self.run_dir, self.rank, self.world = run_dir, rank, world
        self.closed = False
        self.sigterm = None   # our SIGTERM handler while it is installed
        self.temporary = False   # run_dir is the default one, not DGT_RUN_DIR
        self.lock_fd: int | None = None   # this rank of the run dir (take_rank)
        self.job_lock_fd: int | None = None   # a restart's: DGT_RUN_DIR's, shared

    @classmethod
    def start(cls, socket_path: str | None, sidecar_args: list[str], timeout_s: float,
              process_group=None) -> "NodeLink":
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group() before "
                               "DgtState(): dgt's sidecars find each other through its store")
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        check_node_variables(rank, world)
        try:
            env = TorchrunEnv.from_environ()
        except ValueError:   # init_process_group without torchrun (tcp:// or file://)
            env = TorchrunEnv(rank, world, 0, 1, "127.0.0.1", 0, "none", 0)
        socket_path = socket_path or os.environ.get("DGT_SOCKET") or None
        if socket_path:   # attach to a sidecar started by 'dgt sidecar'
            check_attach(hello(socket_path), socket_path, env, world, rank)
            link = cls(Client(socket_path, timeout_s, connect_timeout_s=timeout_s), None,
                       socket_path, "", rank, world)
        else:
            link = cls._spawn(env, rank, world, sidecar_args, timeout_s)
        atexit.register(link.close_at_exit)
        return link

    @classmethod
    def _spawn(cls, env: TorchrunEnv, rank: int, world: int, sidecar_args: list[str],
               timeout_s: float) -> "NodeLink":
        import torch.distributed as dist
        from ..process import die_with_parent
        run_dir = os.environ.get("DGT_RUN_DIR")
        if run_dir is not None and not run_dir.strip():   # as dgt train's empty values
            raise ValueError("DGT_RUN_DIR is set but empty; give a folder, or unset it "
                             "for the default (a private temporary folder)")
        if not run_dir:
            run_dir = os.path.join(private_dir(default_run_dir()), f"torchrun-{env.tag}")
        elif env.restart_count:   # a failed generation's sidecars may still be stopping
            run_dir = os.path.join(run_dir, f"restart-{env.restart_count}")
        _own_run_dir(run_dir)
        if os.environ.get("DGT_RUN_DIR"):   # the user's folder: dgt's files alone
            check_run_dir(run_dir, "DGT_RUN_DIR")
        # before anything of the run dir is touched: another job's sidecar-<rank>
        # (its log, its socket) must be left alone
        lock_fd = take_rank(run_dir, rank, "DGT_RUN_DIR" if os.environ.get("DGT_RUN_DIR")
                            else "the run dir")
        job_fd = None   # a restart's folder is inside the job's: keep dgt train off both
        if os.environ.get("DGT_RUN_DIR") and env.restart_count:
            job_fd = _share_run_dir(open_lock(os.environ["DGT_RUN_DIR"], "DGT_RUN_DIR"),
                                    os.environ["DGT_RUN_DIR"], rank, "DGT_RUN_DIR")
        sock = os.path.join(run_dir, f"sidecar-{rank}.sock")
        for folder in {run_dir, _previous_run_dir(env)} - {None}:
            reap_sidecar(folder, rank, env.run_id)
        given = os.environ.get("DGT_HOST")
        if given is not None and not given.strip():
            raise ValueError("DGT_HOST is set but empty; give this host's address, or "
                             "unset it for the source address of the route to "
                             "MASTER_ADDR")
        host = given or route_source(env.master_addr, env.master_port or 9)
        store = dist.distributed_c10d._get_default_store()
        # a store of this generation's own (dgt.ddp.init_process_group) needs no restart
        # count in the key, which differs between hosts; torchrun's bare store does
        key = ("dgt/sidecar-store" if generation.current is not None
               else f"dgt/{env.tag}/sidecar-store")
        global _spawned   # a state made after close(): not the closed one's key
        _spawned += 1
        key += f"/{_spawned}" if _spawned > 1 else ""
        listener = None
        if rank == 0:   # rank 0's sidecar hosts the sidecars' store on a port bound here
            try:
                listener = socket.create_server((host, 0), backlog=1024,
                                                family=socket.AF_INET6 if ":" in host
                                                else socket.AF_INET)
            except OSError as e:   # breaker round 10: errno 99 that named no variable
                where = "DGT_HOST" if given else (f"the source address of the route to "
                                                  f"MASTER_ADDR {env.master_addr}")
                why = os.strerror(e.errno) if e.errno else str(e)
                raise OSError(e.errno, f"cannot listen on {host} ({where}): {why}; give "
                              f"DGT_HOST an address of this host") from None
            store.set(key, json.dumps([host, listener.getsockname()[1]]))
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except Exception as e:
            raise PeerFailure(f"rank 0 did not publish the dgt sidecars' store within "
                              f"{timeout_s:.0f} s ({str(e).splitlines()[0]}); construct "
                              f"DgtState() on every rank", 0) from None
        store_host, store_port = _sidecar_store(store.get(key), key)
        argv = module_argv("dgt.sidecar") + [
            "--rank", str(rank), "--world", str(world), "--master-addr", store_host,
            "--master-port", str(store_port), "--host", host, "--socket", sock,
            "--run-dir", run_dir]
        if env.run_id != "none":
            argv += ["--job", env.run_id]
        fds = ()
        if listener is not None:
            fds = (listener.fileno(),)
            argv += ["--master-listen-fd", str(fds[0])]
        argv += list(sidecar_args)
        penv = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **QUIET_TORCH_ENV)
        log_path = os.path.join(run_dir, f"sidecar-{rank}.log")
        with open(log_path, "wb") as logf:
            # same session as the trainer: torchrun's killpg stops it too; and SIGTERM
            # when the trainer dies (SIGKILL included)
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=penv,
                                    pass_fds=fds, preexec_fn=functools.partial(
                                        die_with_parent, os.getpid()))
        if listener is not None:
            listener.close()   # the sidecar's copy goes on to the store's process
        t_end = time.monotonic() + timeout_s
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > t_end:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
                raise PeerFailure(f"rank {rank}'s sidecar did not start (exit "
                                  f"{proc.returncode}): {_last_line(log_path)}", rank)
            time.sleep(0.02)
        client = Client(sock, timeout_s, connect_timeout_s=max(1.0, t_end - time.monotonic()))
        # if it goes without a word (SIGKILL, a crash), the trainer's error says so
        client.sidecar_exit = functools.partial(exit_text, proc)
        link = cls(client, proc, sock, run_dir, rank, world)
        link.temporary = not os.environ.get("DGT_RUN_DIR")   # our default folder
        # held for the trainer's life (closed with the process)
        link.lock_fd, link.job_lock_fd = lock_fd, job_fd
        link.sigterm = _end_sidecar_on_sigterm(proc)
        return link

    def close_at_exit(self) -> None:
        """:meth:`close` at interpreter exit (atexit): when an uncaught exception ends
        the interpreter, the sidecar is told so and fails the job naming it, rather
        than ending as after an orderly last step."""
        self.close(failed=uncaught_exception())

    def close(self, failed: str | None = None) -> None:
        """BYE to the sidecar, then wait for it to end (it waits for every peer's BYE,
        bounded by its --peer-timeout-s); SIGTERM, then SIGKILL, past CLOSE_GRACE_S.
        ``failed``: the trainer's error (one line) instead of BYE
        (:meth:`dgt.Client.close`): the sidecar fails the job naming it."""
        if self.closed:
            return
        self.closed = True
        self.client.close(failed)
        if self.proc is None:
            return
        if self.sigterm is not None and signal.getsignal(signal.SIGTERM) is self.sigterm:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)   # what it was before
            except ValueError:   # not the main thread
                pass
        try:
            self.proc.wait(CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            stop(self.proc, 5.0)
        _remove_shm(self.proc.pid)   # a sidecar killed before its first push
        _unlink_if_stale(self.socket_path)   # one killed by SIGKILL could not unlink it
        if self.temporary and failed is None and self.proc.returncode == 0:
            remove_rank_files(self.run_dir, self.rank)


def remove_rank_files(run_dir: str, rank: int) -> None:
    """After a successful run in the default run dir (no ``DGT_RUN_DIR``), as ``dgt
    train`` removes its temporary one: this rank's files there (dgt.run_files.rank_of),
    then the folder itself once only its ``lock`` is left (the last rank of the node to
    end removes it). Before, every torchrun job left a folder of about 100 KB (an outside
    tester). A failed run keeps everything for its logs; so does ``DGT_RUN_DIR``.
    Never raises."""
    try:
        for name in os.listdir(run_dir):
            path = os.path.join(run_dir, name)
            if rank_of(name) == rank and not os.path.isdir(path):
                os.unlink(path)
        left = os.listdir(run_dir)
        if set(left) <= {"lock"}:
            for name in left:
                os.unlink(os.path.join(run_dir, name))
            os.rmdir(run_dir)
    except OSError:   # another rank removed it first, or a file came meanwhile
        pass


def _end_sidecar_on_sigterm(proc: subprocess.Popen):
    """Make SIGTERM to this trainer end its sidecar ``proc`` first, then the trainer
    as before (the default action); returns the handler, or None where the trainer's
    SIGTERM is not the default (a handler of the user's, SIG_IGN: left alone) or this
    is not the main thread.

    torchrun ends a generation with SIGTERM to each trainer's process group, which
    holds its sidecar too, and then waits for the trainers only. A sidecar that is
    stopped (SIGSTOP, a debugger) keeps that SIGTERM pending, and PR_SET_PDEATHSIG's as
    well, for ever: it was left behind, under init, holding its ports (breaker round
    8). The handler sends SIGTERM and SIGCONT, so a stopped sidecar takes it at once,
    waits :data:`SIGTERM_GRACE_S` and SIGKILLs it past that."""
    import threading
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def handler(signum, frame):
        if proc.poll() is None:
            stop(proc, SIGTERM_GRACE_S)   # SIGTERM and SIGCONT, SIGKILL past the grace
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)   # dies of it, as without this handler

    signal.signal(signal.SIGTERM, handler)
    return handler




def _share_run_dir(fd: int, run_dir: str, rank: int, what: str) -> int:
    """``fd``, the run dir's lock (dgt.run_files.open_lock), with its shared flock taken
    (:func:`dgt.run_files.share_lock`). Raises PeerFailure, ``fd`` closed, when a ``dgt
    train`` job holds the run dir."""
    try:
        share_lock(fd, run_dir, what)
    except RuntimeError as e:
        os.close(fd)
        raise PeerFailure(str(e), rank) from None
    return fd


def take_rank(run_dir: str, rank: int, what: str) -> int:
    """Take ``rank`` of ``run_dir`` for this trainer: a write lock (fcntl(2), not
    inherited by the sidecar, released when this process ends) on byte ``rank`` of the
    run dir's ``lock``. Returns its descriptor. Raises PeerFailure, naming the other
    job's sidecar (or trainer) and its pid, when another job's trainer of that rank holds
    it: two jobs on one run dir would truncate each other's logs and take each other's
    sockets; or naming the ``dgt train`` job that holds the run dir (the shared flock of
    :func:`dgt.run_files.share_lock`). A dead generation's trainer holds nothing (its
    sidecar: reap_sidecar)."""
    import fcntl
    path = os.path.join(run_dir, "lock")
    fd = open_lock(run_dir, what)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank, os.SEEK_SET)
    except OSError:
        holder = lock_holder(fd, rank, 1)
        os.close(fd)
    else:
        return _share_run_dir(fd, run_dir, rank, what)
    who = f"its trainer of rank {rank}, pid {holder}, is alive" if holder else \
        f"its trainer of rank {rank} holds {path}"
    try:   # its sidecar, once past its rendezvous (no probe of its socket: a stranger)
        pid = int(read_json(os.path.join(run_dir, f"endpoints-{rank}.json"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):   # RefusedFile: not a regular file
        pid = None
    if pid and running(pid):
        who = f"its sidecar-{rank}, pid {pid}, is alive"
    raise PeerFailure(f"{what} {run_dir} is in use by another job ({who}); give another "
                      f"DGT_RUN_DIR", rank)


def _own_run_dir(run_dir: str) -> None:
    """Make ``run_dir`` (DGT_RUN_DIR) if missing and check it is this user's alone.
    Raises NotOurs (a folder another user can write), or the OSError of mkdir(2) with a
    message that names DGT_RUN_DIR."""
    try:
        owned_dir(run_dir, "DGT_RUN_DIR")
    except NotOurs:
        raise
    except OSError as e:
        raise type(e)(f"DGT_RUN_DIR {run_dir}: cannot create it ({e.strerror or e}); "
                      f"give a folder of yours") from None


def _remove_shm(pid: int) -> None:
    """Unlink the shared memory of sidecar ``pid`` (``/dev/shm/dgt-<pid>-*``)."""
    for name in os.listdir(ipc.shm_dir()):
        if name.startswith(f"dgt-{pid}-"):
            try:
                os.unlink(os.path.join(ipc.shm_dir(), name))
            except OSError:
                pass


def _previous_run_dir(env: TorchrunEnv) -> str | None:
    """The run folder of this host's last generation (None at the first)."""
    if not env.restart_count:
        return None
    run_dir = os.environ.get("DGT_RUN_DIR")
    if not run_dir:
        return os.path.join(default_run_dir(), f"torchrun-{env.tag[:env.tag.rindex('-g')]}"
                                               f"-g{env.restart_count - 1}")
    return run_dir if env.restart_count == 1 else \
        os.path.join(run_dir, f"restart-{env.restart_count - 1}")


def reap_sidecar(run_dir: str, rank: int, run_id: str,
                 timeout_s: float = REAP_GRACE_S) -> int | None:
    """Make sure the sidecar a failed generation of this job ran for ``rank`` in
    ``run_dir`` (its ``endpoints-<rank>.json``) is gone before this generation starts
    one: wait up to ``timeout_s`` seconds for it to end (torchrun's SIGTERM, or
    ``PR_SET_PDEATHSIG``, has told it to), SIGKILL it past that, then remove its Unix
    socket and shared memory. A pid that is not a dgt sidecar of this job on that socket
    (ended and reused) is left alone. Returns the pid it waited for, or None."""
    sock = os.path.join(run_dir, f"sidecar-{rank}.sock")
    try:
        pid = int(read_json(os.path.join(run_dir, f"endpoints-{rank}.json"))["pid"])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except (OSError, ValueError, KeyError, TypeError):   # no sidecar ran there, or it
        _unlink_if_stale(sock)   # ended: by SIGKILL, its socket is still there
        return None
    job = argv[argv.index("--job") + 1] if "--job" in argv[:-1] else "none"
    if "dgt.sidecar" not in argv or sock not in argv or job != run_id:
        return None
    t_end = time.monotonic() + timeout_s
    while running(pid) and time.monotonic() < t_end:
        time.sleep(0.02)
    if running(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        while running(pid) and time.monotonic() < t_end + 5.0:
            time.sleep(0.02)
    try:
        os.unlink(sock)
    except OSError:
        pass
    _remove_shm(pid)
    return pid


def _unlink_if_stale(sock: str) -> None:
    """Remove Unix socket ``sock`` when nothing listens on it any more (connect(2):
    ECONNREFUSED), as a sidecar killed by SIGKILL leaves it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock)
        say_hello(s)   # live: say who we are (never a trainer gone silent)
    except ConnectionRefusedError:
        try:
            os.unlink(sock)
        except OSError:
            pass
    except OSError:   # no such file, or not ours to test
        pass
    finally:
        s.close()


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return lines[-1] if lines else f"no output (log {path})"
    except OSError:
        return f"no log at {path}"


def _sidecar_store(raw: bytes, key: str) -> tuple[str, int]:
    """``[host, port]`` of the sidecars' store as rank 0 put it under ``key`` in
    torchrun's store. Raises PeerFailure (nobody blamed) when it is malformed: torchrun's
    store has no login, and another local process wrote there."""
    try:
        host, port = loads(raw)
        if isinstance(host, str) and host and is_port(port):
            return host, port
    except (ValueError, TypeError):
        pass
    raise PeerFailure(f"torchrun's store holds a malformed {key} ({raw[:40]!r}): another "
                      f"process wrote to it; keep other users off --master-port", None)
