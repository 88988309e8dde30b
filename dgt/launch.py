"""``dgt train``: start N sidecars and N trainers, watch them, and report.

On loopback (the default) every process runs on this machine without root. With
``--testbed`` node r runs inside testbed host r's network namespace, so every gradient
crosses the shaped links (``dgt testbed up`` first).

Failure: when any process exits non-zero, the others get up to ``GRACE_S`` to exit on
their own (the launcher SIGTERMs the sidecars with the reason in failure.json, and
they tell their trainers), then SIGKILL.
The launcher names the failed rank, and leaves no process behind. With
``--max-restarts M`` it then starts every sidecar and trainer again, from the newest
complete checkpoint (dgt.checkpoint), up to M times, as torchrun's elastic agent
restarts its worker group; the failed attempt's files move to ``<run-dir>/attempt-<i>/``.
Before it starts, the files a previous job left in the run dir are removed
(dgt.run_files.clear_previous): the report holds this job's ranks alone.

Supervision is this module's own, not ``torch.distributed.elastic.multiprocessing.
start_processes``: rank 0's sidecar inherits the rendezvous store's listening socket
(``--master-listen-fd``) and every child gets PR_SET_PDEATHSIG before exec, and that
API's ``Popen`` takes neither ``pass_fds`` nor ``preexec_fn`` (torch 2.13).
"""
from __future__ import annotations

import functools
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


from . import checkpoint, failure, outpath, records, run_files, unixsock
from .transport import udpmac
from .atomic import write_json, writes_through
from .child_argv import module_argv
from .interrupt import exit_status, raise_keyboard_interrupt_on
from .tc_profiles.stopping import hold_stop_signals
from .process import die_with_parent, running
from .config import (DIGITS_TRAIN_SAMPLES, LAUNCHED_ENV, CheckpointConfig,
                     JobConfig, TransmissionConfig, default_run_dir, to_argv,
                     startup_grace_here, trainer_timeout_s)
from .rendezvous import QUIET_TORCH_ENV
from .report import build_report, diverged, print_summary, replicas_differ

GRACE_S = 5.0
#: anonymous + shared memory of one dgt process (Python, torch, numpy) before the
#: model's own arrays: peak RssAnon+RssShmem of a sidecar and a trainer, --hidden 32,
#: 155 and 265 MiB (2-core VM, 2026-12-01); half their sum
PROCESS_BASE_BYTES = 210 * 2**20
#: fp32 model-sized arrays per worker (trainer: parameters, gradient, Adam's moments,
#: autograd buffers; sidecar: shared gradient buffer, work copy, residual, scores, its
#: shard's receive buffers and aggregate, PULL frames): --hidden 2500 (24.6 MiB of fp32)
#: peaked at 421 + 513 MiB, 514 MiB over --hidden 32, i.e. 20.9 copies
MODEL_COPIES_PER_WORKER = 21


def say(line: str) -> None:
    """One line of the launcher's console output (stdout), flushed at once: rank 0's
    trainer writes its progress lines to the same file, so a line left in this
    process's buffer (stdout is block-buffered when it is a file or a pipe, unless the
    user set PYTHONUNBUFFERED; the children are started with it) would come out after
    theirs."""
    print(line, flush=True)


def say_error(line: str) -> None:
    """One line of the launcher's errors and warnings (stderr), flushed at once: a
    job that failed or was refused says so where a user who sent stdout (the progress
    and the summary) to a file still sees it, as the flag errors do."""
    print(line, file=sys.stderr, flush=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _write_pid(f) -> None:
    """Write this process's pid over lock file ``f`` (what a refused job names). Raises
    OSError."""
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()


class Job:
    def __init__(self, job: JobConfig, tx: TransmissionConfig, log=say, metrics=None,
                 ckpt: CheckpointConfig | None = None, warn=None):
        self.job, self.tx, self.log = job, tx, log
        #: errors and warnings: stderr beside the console's stdout, else the caller's log
        self.warn = warn or (say_error if log is say else log)
        self.ckpt = ckpt or CheckpointConfig()
        #: each sidecar's --startup-grace-s: the job's 2 * workers + 1 processes (the
        #: store's too) start at once on this machine's CPUs (loopback or testbed),
        #: beside the load it already has
        self.startup_grace_s = startup_grace_here(2 * job.workers + 1)
        self.restarts = 0
        self.metrics = metrics   # dgt.metrics.MetricsConfig: rank r serves on port + r
        self.progress = None     # dgt.progress.TrainProgress, on a terminal
        self.procs: list[tuple[str, int, subprocess.Popen]] = []
        self.own_run_dir = not job.run_dir
        self.run_dir = job.run_dir or tempfile.mkdtemp(prefix="dgt-run-")
        os.makedirs(self.run_dir, exist_ok=True)
        self._lock = None
        self._ck_lock = None   # lock_checkpoints()
        self.spill = ""   # dgt.records: where a child's record goes when the run dir is full
        self.checkpoint_dir = self.ckpt.checkpoint_dir or \
            os.path.join(self.run_dir, "checkpoints")

    def lock_checkpoints(self) -> None:
        """Take the checkpoint dir for this job (an exclusive flock on
        ``<checkpoint-dir>/lock``, held until we exit): two jobs writing one
        --checkpoint-dir removed each other's steps as they kept their newest two, and
        either job's files could end in one step (breaker round 6). Raises RuntimeError
        naming the other job's pid, or ValueError for a ``lock`` that is a link or not a
        regular file (dgt.run_files.open_lock)."""
        import fcntl
        f = os.fdopen(run_files.open_lock(self.checkpoint_dir, "--checkpoint-dir"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            other = f.read().strip() or "?"
            f.close()
            raise RuntimeError(f"--checkpoint-dir {self.checkpoint_dir} is in use by "
                               f"another dgt train (pid {other}); give each job its own "
                               f"--checkpoint-dir") from None
        try:
            _write_pid(f)
        except OSError:   # a full disk: the flock holds all the same
            pass
        self._ck_lock = f

    def lock(self) -> None:
        """Take the run dir for this job (an exclusive flock on ``<run-dir>/lock``, held
        until we exit): a second job with the same --run-dir would share its socket
        paths and logs and connect its trainers to our sidecars. Raises RuntimeError
        naming the other job's pid, or ValueError when ``lock`` is a symbolic link or
        not a regular file (a link would have us write our pid through it, truncating
        its target: any file, as root; a FIFO would block): nothing is touched then."""
        import fcntl
        path = os.path.join(self.run_dir, "lock")
        f = os.fdopen(run_files.open_lock(self.run_dir), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            other = f.read().strip() or "?"
            trainer = run_files.lock_holder(f.fileno())   # a torchrun job's rank
            f.close()
            what = f"a torchrun job (its trainer pid {trainer})" if trainer else \
                f"another dgt train (pid {other})"
            if not trainer and not (other.isdigit() and running(int(other))):
                # a restart's trainers hold it, and so does a sidecar started by hand
                what = "a torchrun job (DGT_RUN_DIR) or a 'dgt sidecar' started by hand"
            raise RuntimeError(f"--run-dir {self.run_dir} is in use by {what}; give each "
                               f"job its own --run-dir") from None
        try:
            _write_pid(f)
        except OSError as e:   # a full disk: leave no empty lock file behind
            os.unlink(path)
            try:
                f.close()   # flushes the pid again: fails again
            except OSError:
                pass
            raise OSError(e.errno, e.strerror, path) from None
        self._lock = f

    def _hosts(self) -> list[tuple[str, list[str]]]:
        """(listen address, argv prefix) per rank."""
        n = self.job.workers
        if not self.job.testbed:
            return [("127.0.0.1", []) for _ in range(n)]
        from .tc_profiles import testbed
        if os.geteuid() != 0:
            raise RuntimeError("--testbed needs root (network namespaces); run as root, "
                               "or drop --testbed to train over loopback")
        tb = testbed.current(self.job.testbed_prefix)
        if tb is None or tb.hosts < n:
            have = 0 if tb is None else tb.hosts
            raise RuntimeError(f"--testbed needs {n} testbed hosts with prefix "
                               f"'{self.job.testbed_prefix}', found {have}; run "
                               f"'dgt testbed up --hosts {n} --prefix "
                               f"{self.job.testbed_prefix}' first")
        tb._need_ip()
        return [(tb.host_addr(i), ["ip", "netns", "exec", tb.host_netns(i)])
                for i in range(n)]

    def start(self, resume: str = "") -> None:
        """Start every sidecar and trainer; the trainers resume from the step folder
        ``resume`` when given."""
        n, j = self.job.workers, self.job
        self.procs = []
        hosts = self._hosts()
        master_addr = hosts[0][0]
        store_fd: list[int] = []   # rank 0 hosts the store on a socket we bound
        if j.testbed:
            master_port = testbed_master_port(os.getpid(), self._rank0_ports())
        else:   # bound and listening here, inherited by rank 0: no other process can
            # take the port between our choice and the store's start (a free_port race)
            self._store_sock = socket.create_server((master_addr, 0), backlog=128)
            self._store_sock.set_inheritable(True)
            master_port = self._store_sock.getsockname()[1]
            store_fd = [self._store_sock.fileno()]
        # torch's C++ log lines and stack frames never reach the user (our line does)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **QUIET_TORCH_ENV)
        env[LAUNCHED_ENV] = "1"   # a trainer's missing sidecar is ours to start, not theirs
        if self.tx.secret:
            env["DGT_SECRET"] = self.tx.secret
        self.spill = self.spill or records.make_spill_dir()
        env[records.SPILL_ENV] = self.spill
        tx_argv = to_argv(self.tx)   # the secret goes by environment, never by argv
        at = tx_argv.index("--secret")
        del tx_argv[at:at + 2]
        for r in range(n):
            host, prefix = hosts[r]
            sock = self._socket_path(r)
            side = prefix + module_argv("dgt.sidecar") + [
                "--rank", str(r), "--world", str(n),
                "--master-addr", master_addr, "--master-port", str(master_port),
                "--host", host, "--base-port", str(j.base_port),
                "--socket", sock, "--run-dir", self.run_dir,
                "--seed", str(j.seed),
                "--register-timeout-s", repr(j.register_timeout_s),
                "--startup-grace-s", repr(self.startup_grace_s)] + \
                tx_argv + \
                self._metrics_argv(r)
            fds = store_fd if r == 0 else []
            if fds:
                side += ["--master-listen-fd", str(fds[0])]
            self._spawn("sidecar", r, side, env, pass_fds=fds)
            if fds:   # rank 0 has its own copy; ours would keep a dead store's port open
                self._store_sock.close()
            trainer = prefix + module_argv("dgt.job") + [
                "--rank", str(r), "--world", str(n),
                "--socket", sock, "--epochs", str(j.epochs),
                "--iterations", str(j.iterations),
                "--eval-every", str(j.eval_every),
                "--result", os.path.join(self.run_dir, f"trainer-{r}.json"),
                "--batch-size", str(j.batch_size), "--lr", str(j.lr),
                "--hidden", str(j.hidden), "--seed", str(j.seed),
                "--device", j.device,
                "--target-accuracy", str(j.target_accuracy),
                *workload_argv(j), *self._checkpoint_argv(resume),
                "--timeout-s", str(trainer_timeout_s(self.tx.peer_timeout_s,
                                                     self.startup_grace_s))]
            self._spawn("trainer", r, trainer, env,
                        to_terminal=(r == 0 and not self._progress_bar()))
        # atomic: a reader polling for the file never sees it empty
        write_json(os.path.join(self.run_dir, "pids.json"),
                   [{"kind": k, "rank": r, "pid": p.pid} for k, r, p in self.procs])

    def _checkpoint_argv(self, resume: str) -> list[str]:
        every = self.ckpt.checkpoint_every
        return (["--checkpoint-every", str(every), "--checkpoint-dir", self.checkpoint_dir]
                if every else []) + (["--resume", resume] if resume else [])

    def restart_from(self, resume: str) -> str:
        """After a failed attempt (every process gone): move its files to
        ``attempt-<i>/`` and return where the next attempt resumes: the newest complete
        checkpoint, else ``resume`` (where this one started; "" = the beginning)."""
        self.restarts += 1
        self.remove_spill()   # the failed attempt's records
        folder = os.path.join(self.run_dir, f"attempt-{self.restarts}")
        if os.path.islink(folder):   # the files go in the run dir, never through a link
            os.unlink(folder)
        os.makedirs(folder, exist_ok=True)   # a previous job's, with a file not ours
        for name in os.listdir(self.run_dir):
            path = os.path.join(self.run_dir, name)
            if name != "lock" and os.path.isfile(path):
                os.replace(path, os.path.join(folder, name))
        return checkpoint.latest(self.checkpoint_dir, self.job.workers) or resume

    def _progress_bar(self) -> bool:
        """On a terminal: a progress bar over rank 0's trace (its epoch lines go to
        trainer-0.log and are shown above the bar); else the plain lines as before."""
        from .progress import TrainProgress, on_terminal
        if self.progress is None and on_terminal():
            j = self.job
            total = j.epochs * max(1, DIGITS_TRAIN_SAMPLES // (j.workers * j.batch_size)) \
                if getattr(j, "dataset", "digits") == "digits" else None
            if j.iterations:
                total = min(total, j.iterations) if total else j.iterations
            self.progress = TrainProgress(self.run_dir, total)
        return self.progress is not None

    def _rank0_ports(self) -> set[int]:
        """The TCP ports rank 0's flags give it: its sidecar's (--base-port) and its
        metrics endpoint's (--metrics-port); 0 for each that the kernel picks."""
        return {self.job.base_port, self.metrics.port_of(0) if self.metrics else 0}

    def _metrics_argv(self, rank: int) -> list[str]:
        m = self.metrics
        if m is None or not m.metrics_port:
            return []
        return ["--metrics-port", str(m.port_of(rank)), "--metrics-host", m.metrics_host,
                "--metrics-linger-s", str(m.metrics_linger_s)]

    def _spawn(self, kind: str, rank: int, argv: list[str], env: dict,
               to_terminal: bool = False, pass_fds=()) -> None:
        # O_NOFOLLOW: clear_previous removed a link of this name; one put there since
        # is refused (ELOOP), never written through
        path = os.path.join(self.run_dir, f"{kind}-{rank}.log")
        logf = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                                 os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), "wb")
        out = None if to_terminal else logf
        p = subprocess.Popen(argv, stdout=out, stderr=logf, env=env, start_new_session=True,
                             pass_fds=tuple(pass_fds),
                             preexec_fn=functools.partial(_child_setup, os.getpid(),
                                                          kind == "trainer"))
        logf.close()
        self.procs.append((kind, rank, p))

    def wait(self, timeout_s: float | None = None) -> tuple[int, str | None]:
        """Wait for all; on the first failure give the rest GRACE_S, then kill.
        Returns (exit code, failure message or None)."""
        failure: str | None = None
        fail_at = None
        t_end = time.monotonic() + timeout_s if timeout_s else None
        while True:
            alive = [(k, r, p) for k, r, p in self.procs if p.poll() is None]
            if failure is None:
                # a process killed by a signal is the cause, not one that saw it go
                dead = sorted(((p.returncode >= 0, k, r, p.returncode) for k, r, p in
                               self.procs if p.returncode not in (None, 0)))
                if dead:
                    _, k, r, code = dead[0]
                    failure, blamed = self._describe_failure(k, r, code)
                    fail_at = time.monotonic()
                    self._stop_sidecars(failure, blamed)
            if self.progress is not None:
                self.progress.update()
            if not alive:
                break
            now = time.monotonic()
            if (fail_at is not None and now - fail_at > GRACE_S) or (t_end and now > t_end):
                if failure is None:
                    failure = f"timed out after {timeout_s:.0f} s"
                self.kill()
                break
            time.sleep(0.05)
        self.remove_shared_memory()
        if self.progress is not None:
            self.progress.close()
        return (0 if failure is None else 1), failure

    def _stop_sidecars(self, message: str, rank: int | None) -> None:
        """Tell the surviving sidecars why they stop (they relay it to their trainers,
        which exit naming the failed rank): write failure.json, then SIGTERM."""
        try:   # a run dir gone or full must not keep the sidecars running
            write_json(os.path.join(self.run_dir, "failure.json"),
                       {"message": message, "rank": rank})
        except OSError:
            pass   # they stop anyway, saying "stopped by signal"
        for kind, _, p in self.procs:
            if kind == "sidecar" and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _describe_failure(self, kind: str, rank: int, code: int
                          ) -> tuple[str, int | None]:
        """The headline of the first failure, ``kind`` of ``rank`` exiting with ``code``,
        and the rank it blames (None: its own record blames no rank). Who is at fault
        comes from the processes' failure records (``dgt.failure``), never from their
        log text."""
        if self.job.testbed:
            from .tc_profiles import testbed
            if testbed.taken_down(self.job.testbed_prefix, self.job.workers):
                # 'dgt testbed down' (or 'up' again) stops what runs in the namespaces:
                # no rank is to blame (breaker round 7: "trainer of rank 0 was killed
                # by signal 15", nothing more)
                how = (f"was killed by signal {-code}" if code < 0 else
                       f"exited with status {code}")
                return (f"{kind} of rank {rank} {how}: the testbed "
                        f"'{self.job.testbed_prefix}' was taken down under the job "
                        f"('dgt testbed down' stops what runs in its namespaces)"), None
        if code < 0:
            hint = (" (SIGKILL from outside the job: the kernel's OOM killer if memory ran "
                    f"out, see 'dmesg'; try fewer --workers or a smaller "
                    f"{'--hidden' if self.job.model == 'mlp' else '--width'})"
                    if -code == signal.SIGKILL else
                    f" (a crash in native code: its stack is in "
                    f"{os.path.join(self.run_dir, f'{kind}-{rank}.log')})"
                    if -code in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT,
                                 signal.SIGFPE, signal.SIGILL) else "")
            return f"{kind} of rank {rank} was killed by signal {-code}{hint}", rank
        records = failure.read_all(self.run_dir)
        own = failure.own_record(records, kind, rank)
        cause = failure.first_cause(records) or own
        tail = own.message[:300] if own is not None else \
            _last_line(os.path.join(self.run_dir, f"{kind}-{rank}.log"))
        what = f"{kind} of rank {rank} exited with status {code}" + (f": {tail}" if tail
                                                                     else "")
        if cause is not None and cause.reason is failure.FailureReason.RAISED:
            # a trainer's own code raised first: its exception, and where its traceback is
            # (the exiting trainer's own, when it raised too: each one a cause)
            if own is not None and own.reason is cause.reason and \
                    (own.kind, own.rank) == (kind, rank):
                cause = own
            raised = f"{cause.message[:300]} (its log: " \
                f"{os.path.join(self.run_dir, f'{cause.kind}-{cause.rank}.log')})"
            if (cause.kind, cause.rank) == (kind, rank):
                return f"{kind} of rank {rank} exited with status {code}: {raised}", rank
            # another process of the job exited first, on what the exception caused
            return f"{cause.kind} of rank {cause.rank} raised {raised}; {what}", cause.rank
        # the exiting rank's own record does not blame it again; another process's
        # record names whom it blames, the exiting rank too (a frozen trainer's sidecar
        # may be the first process to exit, on the ERROR that blames its rank)
        if cause is not None and cause.reason is failure.FailureReason.IMPERSONATED:
            # a stranger's doing: its words first, and no rank is to blame
            return f"{cause.message[:400]}; {kind} of rank {rank} exited with status " \
                f"{code}", None
        exited = rank if cause is not None and cause.rank == rank else None
        blame = cause.headline_blame(exited) if cause is not None else ""
        # a rank that hung is named first, not the rank whose wait for it ran out
        if blame:
            return f"{blame}; {what}", next(r for r in cause.blamed if r != exited)
        if own is not None and not own.blamed and cause is not None and not cause.blamed:
            # its own record blames no rank (a stranger's values in the store), nor does
            # the first cause, its own or an older one of another rank's that saw the
            # same: the others are not told that this rank failed, only that it exited
            return what, None
        return what, rank

    def kill(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for _, _, p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and any(p.poll() is None for *_, p in self.procs):
                time.sleep(0.05)
        self.remove_shared_memory()

    def _socket_path(self, rank: int) -> str:
        """Rank ``rank``'s sidecar socket: ``sidecar-<rank>.sock`` in the run dir, or,
        when that path is too long to bind (a deep --run-dir; unix(7): 107 bytes),
        ``job-<our pid>-<rank>.sock`` in the per-user runtime folder
        (dgt.config.default_run_dir, checked by dgt.unixsock.private_dir). Raises
        dgt.unixsock.NotOurs when that folder is another user's."""
        path = os.path.join(self.run_dir, f"sidecar-{rank}.sock")
        if unixsock.fits(path):
            return path
        return os.path.join(unixsock.private_dir(default_run_dir()),
                            f"job-{os.getpid()}-{rank}.sock")

    def remove_shared_memory(self) -> None:
        """A sidecar killed by SIGKILL cannot unlink its /dev/shm buffers; we can."""
        from .ipc import shm_dir
        for kind, _, p in self.procs:
            if kind == "sidecar" and p.poll() is not None:
                for path in glob.glob(os.path.join(shm_dir(), f"dgt-{p.pid}-*")) + \
                        glob.glob(os.path.join(self.run_dir, "*.sock")) + \
                        glob.glob(os.path.join(default_run_dir(), f"job-{os.getpid()}-*.sock")):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def cleanup(self) -> str:
        """Remove the run dir when it is ours (a temporary folder), but for the
        checkpoints written there (``--checkpoint-every`` without ``--checkpoint-dir``):
        they stay, the rest goes. Returns the checkpoint folder kept, or ""."""
        if not self.own_run_dir:
            return ""
        kept = self.checkpoint_dir
        if self.ckpt.checkpoint_every and os.path.dirname(kept) == self.run_dir and \
                checkpoint.latest(kept, self.job.workers):
            for name in os.listdir(self.run_dir):
                path = os.path.join(self.run_dir, name)
                if path == kept:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            return kept
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return ""

    def remove_spill(self) -> None:
        if self.spill:
            shutil.rmtree(self.spill, ignore_errors=True)
            self.spill = ""


def _last_line(path: str) -> str:
    """For a child that left no failure record (e.g. an uncaught exception outside a
    trainer's loop, which records its own: dgt.job.main): the last line of its log that
    looks like an error, for the user to read (never to decide who failed); never a C++
    stack frame that a library printed on its way out."""
    try:
        with open(path, "rb") as f:
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()
                     if ln.strip()]
    except OSError:
        return ""
    lines = [ln for ln in lines if not ln.startswith(("frame #", "Exception raised from",
                                                      "<omitting", "[W", "[E"))]
    errs = [ln for ln in lines if "failed" in ln or "Error" in ln or "error" in ln]
    return (errs or lines or [""])[-1][:300]


def workload_argv(job: JobConfig) -> list[str]:
    """The trainer flags of the job's workload (model, dataset, partition, algorithm)."""
    argv = ["--model", job.model, "--width", repr(job.width), "--dataset", job.dataset,
            "--data-dir", job.data_dir, "--partition", job.partition, "--algo", job.algo,
            "--local-steps", str(job.local_steps), "--eval-samples", str(job.eval_samples)]
    return argv + (["--stop-at-target"] if job.stop_at_target else []) + \
        ([] if job.pipeline_pulls else ["--no-pipeline-pulls"])


def check_memory(job: JobConfig, meminfo: str = "/proc/meminfo") -> None:
    """Refuse a job that would not fit in this machine's memory: every sidecar and
    trainer runs here (on loopback and on the testbed alike), about
    ``PROCESS_BASE_BYTES`` each (and the rendezvous store's process, dgt.store_host) plus ``MODEL_COPIES_PER_WORKER`` fp32 copies of the model
    per worker; the kernel's OOM killer would otherwise end the run, and maybe other
    programs, minutes in. ``job.n_params()`` is the chosen model's real parameter count.
    Raises ValueError naming --workers and the model's size flag. No check where
    /proc/meminfo has no MemAvailable (proc(5))."""
    try:
        with open(meminfo) as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f
                         if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    per_worker = 2 * PROCESS_BASE_BYTES + MODEL_COPIES_PER_WORKER * 4 * job.n_params()
    need = job.workers * per_worker + PROCESS_BASE_BYTES   # and the store's process
    if need > 0.9 * avail:
        fit = int((0.9 * avail - PROCESS_BASE_BYTES) // per_worker)
        size = f"--hidden {job.hidden}" if job.model == "mlp" else \
            f"--model {job.model} --width {job.width:g}"
        smaller = "--hidden" if job.model == "mlp" else "--width"
        if fit < 1:   # fewer workers cannot help: only a smaller model
            raise ValueError(f"{size} needs about {per_worker / 2**30:.2f} GiB of memory "
                             f"per worker (a sidecar and a trainer), but "
                             f"{avail / 2**30:.1f} GiB is available here: not even "
                             f"--workers 1 fits; use a smaller {smaller}")
        raise ValueError(f"--workers {job.workers} {size} needs about "
                         f"{need / 2**30:.1f} GiB of memory here (a sidecar and a trainer "
                         f"per worker, {per_worker / 2**30:.2f} GiB together), but "
                         f"{avail / 2**30:.1f} GiB is available; use --workers {fit} or "
                         f"fewer, or a smaller {smaller}")


def check_ports(job: JobConfig, metrics) -> None:
    """The metrics endpoints (``metrics``: a dgt.metrics.MetricsConfig; rank r on
    metrics-port + r) against the job's own TCP ports, before anything starts: rank r's
    sidecar listens on base-port + 10 r (its UDP channels on base-port + 10 r + c are
    another port space, free to share a number with an endpoint). On loopback every
    rank binds on this host; with --testbed each in its own namespace, so only a rank's
    own two can clash. (The rendezvous store's port is no flag's: the kernel picks it on
    loopback, and on the testbed it steps past rank 0's: testbed_master_port.) Raises
    ValueError naming both flags; nothing when either is 0 (the kernel's ports)."""
    m, b, n = (metrics.metrics_port if metrics else 0), job.base_port, job.workers
    if not m or not b:
        return
    for r in range(n):
        s = (m + r - b) // 10
        if (m + r - b) % 10 == 0 and 0 <= s < n and (s == r or not job.testbed):
            free = b + 10 * n if b + 11 * n - 1 <= 65535 else max(1, b - n)
            raise ValueError(f"--metrics-port {m} overlaps --base-port {b}: port {m + r} "
                             f"would be rank {r}'s metrics endpoint (metrics-port + rank) "
                             f"and rank {s}'s TCP listener (base-port + 10 x rank); use "
                             f"e.g. --metrics-port {free}")


def _child_setup(launcher: int, trainer: bool) -> None:
    """In a child before exec: dies with the launcher (dgt.process.die_with_parent); a
    trainer also starts with SIGINT ignored, so that Python installs no KeyboardInterrupt
    for it: dgt.job then gives it the default action. A SIGINT from outside the job (the
    children run in sessions of their own, out of the terminal's Ctrl-C) ends a trainer
    as SIGTERM does, named by the launcher (``was killed by signal 2``), where it was a
    KeyboardInterrupt traceback in its log and "trainer of rank 1 disconnected" (breaker
    round 8)."""
    if trainer:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(launcher)


def testbed_master_port(pid: int, taken: set[int]) -> int:
    """The rendezvous store's port on the testbed, in rank 0's namespace: 29400 + ``pid``
    mod 500 (two launchers seldom share it), moved up past the ``taken`` TCP ports (rank
    0's --base-port and --metrics-port), which would otherwise fail rank 0 as in use."""
    port = 29400 + pid % 500
    while port in taken:
        port += 1
    return port


def check_paths(job: JobConfig, ckpt: CheckpointConfig | None = None) -> None:
    """Fail before training, not after: --report's folder and --run-dir must be usable,
    and --run-dir new, empty or the run dir of an earlier dgt job, not a dangling link
    (dgt.run_files.check_run_dir: the job's own --report and checkpoints of ``ckpt``
    may be in a new one). Raises ValueError with a
    message that names the flag."""
    # a --report in the --run-dir it names: that folder is made first (breaker round
    # 10: refused as a folder that does not exist, which dgt would have made)
    in_run_dir = bool(job.report and job.run_dir) and os.path.dirname(
        os.path.abspath(job.report)) == os.path.abspath(job.run_dir)
    if job.report and not in_run_dir:
        _check_report(job.report)
    if job.run_dir:
        # a link that leads nowhere: run_files.check_run_dir names it (dangling, loop)
        why = None if os.path.islink(job.run_dir) else outpath.folder_problem(job.run_dir)
        if why is not None:   # breaker round 11: a file on the path read as errno text
            raise ValueError(f"--run-dir {job.run_dir}: {why}; give another folder")
        run_files.check_run_dir(job.run_dir, keep=_own_paths(job, ckpt))
        try:
            os.makedirs(job.run_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--run-dir: cannot create {job.run_dir}: {e.strerror}") from None
    if in_run_dir:
        _check_report(job.report)
    if job.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"--device {job.device}: no CUDA device here (torch "
                             f"{torch.__version__}); use --device cpu")


def _own_paths(job: JobConfig, ckpt: CheckpointConfig | None) -> tuple[str, ...]:
    """The paths this job names that may lie in its run dir: --report, and with
    ``ckpt`` --checkpoint-dir and --resume."""
    ckpt = ckpt or CheckpointConfig()
    return (job.report, ckpt.checkpoint_dir, ckpt.resume)


def _check_report(report: str) -> None:
    """--report can be written: a new or JSON file in a folder where a file can be
    made, or a device or FIFO this user may write (/dev/null, /dev/stdout: written
    through, dgt.atomic). Raises ValueError naming the flag."""
    folder = os.path.dirname(os.path.abspath(report))
    if not os.path.isdir(folder):   # a typo must not leave a tree of new folders
        why = outpath.folder_problem(folder)
        if why is None or why.startswith("no folder can be made"):
            raise ValueError(f"--report {report}: folder {folder} does not exist; "
                             f"create it first or give another path")
        raise ValueError(f"--report {report}: {why}; give another path")
    if os.path.isdir(report):
        raise ValueError(f"--report {report} is a directory; give a file path")
    why = outpath.refusal(report, "json")
    if why is not None:
        raise ValueError(f"--report {report}: {why}")
    if writes_through(report):   # no new file there: the folder may be /dev
        if not os.access(report, os.W_OK):
            raise ValueError(f"--report {report}: permission denied")
        return
    try:   # create a file there, as the report will be (os.access says yes to root
        # on /proc and on a read-only mount's permission bits)
        with tempfile.TemporaryFile(dir=folder, prefix=".dgt-report-"):
            pass
    except OSError as e:
        raise ValueError(f"--report {report}: no file can be made in {folder} "
                         f"({e.strerror or e})") from None


def resume_from(ckpt: CheckpointConfig, job: JobConfig, tx: TransmissionConfig) -> str:
    """``--resume``'s step folder ("" when not given), its files checked against this
    run's flags (dgt.checkpoint.resolve, check_resume). Raises ValueError naming the
    flag."""
    if not ckpt.resume:
        return ""
    folder = checkpoint.resolve(ckpt.resume, job.workers)
    checkpoint.check_resume(folder, job.workers, job, tx)
    return folder


def check_checkpoint_dir(path: str) -> None:
    """--checkpoint-dir can be made and written, before anything starts. Raises
    ValueError naming the flag."""
    why = outpath.folder_problem(path)
    if why is not None:   # breaker round 11: a file there read as 'File exists'
        raise ValueError(f"--checkpoint-dir {path}: {why}; give another folder")
    try:
        unixsock.owned_dir(path, "--checkpoint-dir")
        with tempfile.TemporaryFile(dir=path):
            pass
    except unixsock.NotOurs as e:
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {path}: {e.strerror or e}") from None


def run_job(job: JobConfig, tx: TransmissionConfig, log=say, metrics=None,
            ckpt: CheckpointConfig | None = None) -> tuple[int, dict | None]:
    """Run ``dgt train``. Returns (exit code, report dict or None). ``metrics``: a
    ``dgt.metrics.MetricsConfig`` (the endpoints; None = off). ``ckpt``: checkpoints,
    resume and restarts (None = none).

    SIGTERM, SIGINT and SIGHUP stop every child process and clean up (even when the
    launcher was started in the background with SIGINT ignored), until every rank has
    ended well: from there (the commit point) they are ignored, and the report, the
    summary and the cleanup complete."""
    t0 = time.monotonic()
    raise_keyboard_interrupt_on(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    j = Job(job, tx, log, metrics, ckpt)
    try:
        return _run(j, t0)
    finally:
        j.remove_spill()


def _run(j: Job, t0: float) -> tuple[int, dict | None]:
    job, tx, log, warn = j.job, j.tx, j.log, j.warn
    try:   # a busy run dir, a missing testbed or root: say so before anything starts
        unixsock.owned_dir(j.run_dir, "--run-dir")
        # before the lock file: a folder of someone else's files gets none of ours
        run_files.check_run_dir(j.run_dir, keep=_own_paths(job, j.ckpt) +
                                (j.checkpoint_dir,))
        j.lock()
        j._hosts()
        resume = resume_from(j.ckpt, job, tx)
        if j.ckpt.checkpoint_every:
            check_checkpoint_dir(j.checkpoint_dir)
            j.lock_checkpoints()
        # ours now (the lock): a previous job's files must not mix into this one's report
        cleared = run_files.clear_previous(j.run_dir, keep=(j.checkpoint_dir, j.ckpt.resume))
    except (RuntimeError, ValueError, unixsock.NotOurs) as e:
        j.cleanup()
        warn(f"dgt train: {e}")
        return 2, None
    except OSError as e:   # e.g. a full disk: making the folder needed no data block
        j.cleanup()
        warn(f"dgt train: --run-dir {j.run_dir}: {e.strerror or e}")
        return 2, None
    used = tx.resolve_codecs(loopback=not job.testbed)
    band, pull = used.band_codec, used.pull_codec
    share = "PULLs" if tx.pull_coded_fraction >= 1.0 else \
        f"the lowest {tx.pull_coded_fraction:g} of each PULL"
    coded = (f" ({tx.channels} UDP channels in {band}, {share} in {pull})"
             if tx.mode in ("dgt", "random") else "")
    if used.reliable_codec != "fp32":
        coded += f" (reliable channel in {used.reliable_codec})"
    log(f"dgt train: {job.workers} workers, mode {tx.mode}{coded}, k {tx.k}, block "
        f"{tx.block_bytes} B, {'testbed' if job.testbed else 'loopback'}, "
        f"{'MAC on every message' if tx.secret else 'no --secret (messages unauthenticated)'}; "
        f"logs in {j.run_dir}" + (" (a temporary folder: removed after a successful run, "
                                  "kept on failure; --run-dir keeps it)"
                                  if j.own_run_dir else ""))
    if cleared:
        log(f"dgt train: removed {cleared} file(s) of a previous job from {j.run_dir} "
            f"(its logs, records and traces)")
    if tx.secret and not udpmac.NATIVE:
        warn(f"dgt train: warning: {udpmac.NOT_NATIVE}")
    if resume or j.ckpt.checkpoint_every:
        log("dgt train: " + (f"resuming from {resume}; " if resume else "") +
            (f"a checkpoint every {j.ckpt.checkpoint_every} iterations in "
             f"{j.checkpoint_dir}" + (" (kept after the run; --checkpoint-dir picks the "
                                      "folder)" if j.own_run_dir and not
                                      j.ckpt.checkpoint_dir else "")
             if j.ckpt.checkpoint_every else "no checkpoints") +
            (f"; up to {j.ckpt.max_restarts} restart(s)" if j.ckpt.max_restarts else ""))
    try:
        j.start(resume)
        code, failure = j.wait()
        while failure and j.restarts < j.ckpt.max_restarts:   # torchrun --max-restarts
            resume = j.restart_from(resume)
            warn(f"dgt train: {failure}; restart {j.restarts}/{j.ckpt.max_restarts} from "
                f"{resume or 'the beginning'} (the failed attempt's logs: "
                f"{os.path.join(j.run_dir, f'attempt-{j.restarts}')})")
            j.start(resume)
            code, failure = j.wait()
    except RuntimeError as e:
        j.kill()
        kept = j.cleanup()
        warn(f"dgt train: {e}" + (f"; checkpoints kept in {kept}" if kept else ""))
        return 2, None
    except OSError as e:   # the run dir removed or full while the job ran
        j.kill()
        if cannot_run_python(e):   # nothing ran: no log worth keeping
            j.cleanup()
        warn(f"dgt train: failed: {launch_failure(e, j.run_dir)}; children stopped")
        return 1, None
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        j.kill()
        warn(f"dgt train: interrupted; children stopped, logs kept in {j.run_dir}")
        return exit_status(), None
    except BaseException:
        j.kill()
        raise
    wall_s = time.monotonic() - t0
    if not failure:   # the commit point: every rank ended well; the report, the summary
        hold_stop_signals()   # and the cleanup complete, exit 0 (a signal before: 130)
    if failure:
        warn(f"dgt train: failed: {failure}")
        warn(f"dgt train: logs kept in {j.run_dir}" if os.path.isdir(j.run_dir) else
             f"dgt train: the run dir {j.run_dir} is gone (removed or renamed while the "
             f"job ran), and its logs with it")
        return code, None
    if j.ckpt.checkpoint_every:   # every trainer has ended: no rank writes there now
        checkpoint.remove_empty_steps(j.checkpoint_dir)
    report = build_report(j.run_dir, job, tx, wall_s, j.spill)
    report["restarts"] = j.restarts
    print_summary(report, log)
    if job.report:
        try:
            write_report(job.report, report)
        except OSError as e:
            warn(f"dgt train: cannot write --report {job.report}: {e.strerror or e}; the "
                f"summary above has its numbers; logs kept in {j.run_dir}")
            return 1, report
        log(f"report: {job.report}")
    kept = j.cleanup()
    if kept:
        log(f"dgt train: checkpoints kept in {kept} (--resume {kept} goes on from the "
            f"newest; the rest of the temporary folder is removed)")
    differ = replicas_differ(report)
    if differ is not None:   # in the summary too; a script reads the status
        warn(f"dgt train: warning: {differ}; exit status 1")
    unsaved = checkpoint.none_written(j.checkpoint_dir, job.workers, report["warnings"]) \
        if j.ckpt.checkpoint_every else None
    if unsaved is not None:   # asked for checkpoints, has none: a restart would be from 0
        warn(f"dgt train: error: {unsaved}; exit status 1")
    return (1 if diverged(report) or differ is not None or unsaved is not None else 0), \
        report


def launch_failure(e: OSError, run_dir: str) -> str:
    """What an OSError while the job starts or runs says (one line): a socket's (no
    port free to bind: the ephemeral range used up by other connections, as an outside
    tester's 36,000 loopback connections did in a CI run, breaker round 6), else the
    run dir's (removed, or full)."""
    import errno
    if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return (f"no local port could be bound ({e.strerror or e}): this host's free "
                f"ports are used up by other connections (ss -s counts them); try again "
                f"when they are closed")
    if cannot_run_python(e):
        return (f"cannot run the Python interpreter {e.filename}: {e.strerror} (this user "
                f"may not execute it, or enter a folder on its way: a virtual environment "
                f"made from another user's Python, one under /root say, is not this "
                f"user's to run; make one from a Python this user can run, e.g. "
                f"/usr/bin/python3)")
    return (f"{e.filename or run_dir}: {e.strerror or e} (is --run-dir {run_dir} still "
            f"there, with free space?)")


def cannot_run_python(e: OSError) -> bool:
    """Whether ``e`` is a child's exec of this interpreter failing (subprocess raises it
    with the program as its filename): an outside tester, as uid 65534, ran root's
    virtual environment, whose ``python3`` links into /root (mode 0700), and was told to
    look at the run dir (breaker round 8)."""
    import errno
    return e.errno in (errno.EACCES, errno.ENOENT, errno.ENOEXEC, errno.ELOOP) and \
        bool(e.filename) and os.path.abspath(str(e.filename)) == \
        os.path.abspath(sys.executable)


def write_report(path: str, report: dict) -> None:
    """Write the JSON report atomically: a temporary file in the same folder, then
    rename(2), so a full disk or a failed write never leaves a truncated report (the
    temporary file is removed). Raises OSError."""
    write_json(path, report, indent=1, fsync=True)
