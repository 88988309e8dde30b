"""The rendezvous store (``torch.distributed.TCPStore``) in a process of its own, which
rank 0's sidecar starts and talks to as one more client.

Why: the store's server accepts every connection made to its port, for the whole run,
and has no cap and no login. In rank 0's sidecar (where it ran before) a connection
flood on that port took the sidecar's own descriptors: with the hard limit at 20,000,
36,000 idle connections from another process made 13 of 16 of rank 0's checkpoints
fail ("Too many open files"), and under ``ulimit -n 1024`` 3,000 connections stopped
the job at start-up, the failure naming rank 0's sidecar (the sixth breaker round,
docs/security.md). Here a flood can use up only this process's descriptors: the
sidecars, their peers' connections, checkpoints and logs are out of its reach, and the
ranks that have joined keep their store connections. What a flood can still do is
refuse ranks that connect after it filled this process (docs/security.md says how to
size ``ulimit -n`` against it); this process then logs how many descriptors it holds.

The process (``python -m dgt.store_host``, started by :func:`start`) inherits the
listening socket rank 0's sidecar was given or bound (``--listen-fd``; -1: TCPStore
binds ``--port`` itself), raises its soft RLIMIT_NOFILE to the hard limit, serves the
store, writes one line to its stdout (``ready``, or ``error: <why>``), and ends when its
parent does (PR_SET_PDEATHSIG with SIGKILL, and a look at getppid(2) every ``WATCH_S``)
or on SIGTERM. It freezes with its parent: when the sidecar is stopped (SIGSTOP, a
debugger) the store's process stops itself, and the sidecar continues it once it runs
again, so the other ranks still see a frozen rank 0 as a store that does not answer
(docs/architecture.md, "Processes and failure").
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

from .child_argv import module_argv
from .process import die_with_parent, exit_text, state, stop
from .store_shed import SILENT_S, our_fds, shed

log = logging.getLogger("dgt.store_host")

#: s: how often the store's process looks whether its parent (rank 0's sidecar) lives,
#: and counts its descriptors
WATCH_S = 0.25
#: a warning is logged when the descriptors in use reach this fraction of the limit
CROWDED = 0.9
#: s: at most one such warning per this interval while the flood lasts
WARN_EVERY_S = 10.0
#: s: how long rank 0 waits for the store's process to serve, whatever the rendezvous's
#: own timeout: it imports torch first (1.3 s on this project's 2-core VM idle, 6 s
#: while a test run shared its cores)
START_S = 60.0
#: process states (proc(5)) of a frozen process: stopped by a signal, or by a debugger
FROZEN = ("T", "t")


class StoreHostError(Exception):
    """The store's process did not come up; the message is one line for the user."""


class StoreHost:
    """Rank 0's handle on the store's process (:func:`start`)."""

    def __init__(self, argv: list[str], pass_fds: list[int], host: str, port: int):
        """Start ``argv`` from a thread of its own that lives until :meth:`close`:
        PR_SET_PDEATHSIG fires when the *thread* that started a child ends (prctl(2)),
        and the caller's thread may be a short one (an executor's, a test's). Raises
        OSError when the child cannot be started."""
        self.host, self.port = host, port
        self._closed = threading.Event()
        started: queue.Queue = queue.Queue(1)
        threading.Thread(target=self._run, args=(argv, pass_fds, started),
                         name="dgt-store-host", daemon=True).start()
        got = started.get()
        if isinstance(got, OSError):
            raise got
        self.proc: subprocess.Popen = got

    def _run(self, argv: list[str], pass_fds: list[int], started: queue.Queue) -> None:
        """Start the child, then, while this process runs, continue it when it is
        stopped: it stops itself when it sees us frozen (so the other ranks see rank 0
        frozen, as they did when the store ran in its sidecar), and we continue it once
        we are continued (SIGCONT). This thread does not run while we are frozen."""
        try:   # SIGINT ignored (kept across exec; Python then installs no handler):
            # a terminal's Ctrl-C reaches the sidecar's whole process group, and the
            # store's process must end when its sidecar has finished with it, not
            # before, with a KeyboardInterrupt traceback (it did, breaker round 7)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    pass_fds=pass_fds, close_fds=True,
                                    preexec_fn=_ignore_sigint)
        except OSError as e:
            started.put(e)
            return
        started.put(proc)
        while not self._closed.wait(WATCH_S):
            if state(proc.pid) in FROZEN:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    return

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ended(self) -> str | None:
        """How the store's process ended (``was killed by SIGKILL``), after up to 0.5 s
        for it to be reaped; None while it runs."""
        return exit_text(self.proc, 0.5)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the store serves (the child's ``ready`` line), up to
        ``timeout_s`` s. Raises StoreHostError with the child's own reason (the port
        taken, say), or saying that it exited or did not answer in time."""
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline().decode(errors="replace").strip() if ready else ""
        out.close()
        if line == "ready":
            return
        if line.startswith("error: "):
            self.close()
            raise StoreHostError(line[len("error: "):])
        if not ready:
            self.close()
            raise StoreHostError(f"its process (pid {self.proc.pid}) did not serve within "
                                 f"{timeout_s:.0f} s")
        code = self.proc.wait()
        raise StoreHostError(f"its process (pid {self.proc.pid}) exited with status {code} "
                             f"before serving")

    def close(self) -> None:
        """Stop the store's process (SIGTERM, then SIGKILL after 2 s) and reap it."""
        self._closed.set()
        if self.proc.poll() is None:
            stop(self.proc, 2.0)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(listen_fd: int, host: str, port: int, world: int, timeout_s: float) -> StoreHost:
    """Start the store's process on the listening socket ``listen_fd`` (inherited under
    the same number; -1: it binds ``host:port``), for ``world`` ranks, with TCPStore's
    ``timeout_s``. Returns at once; call :meth:`StoreHost.wait_ready`. The caller keeps
    its copy of ``listen_fd`` and should close it: the child holds the port from now
    on. Its log lines go to this process's stderr. Raises OSError when it cannot be
    started."""
    argv = module_argv("dgt.store_host") + [
        "--listen-fd", str(listen_fd), "--host", host, "--port", str(port),
        "--world", str(world), "--timeout-s", repr(timeout_s),
        "--parent", str(os.getpid())]
    return StoreHost(argv, [listen_fd] if listen_fd >= 0 else [], host, port)


def open_fds(limit: int) -> int:
    """Descriptors this process holds now (dgt.store_shed.our_fds: about ``limit`` when
    none is left to open /proc/self/fd with, EMFILE: a flood took them all)."""
    return len(our_fds(limit))


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class CrowdWatch:
    """Says when this process's descriptors run short: a connection flood on the store
    port. ``crowded(n)``: whether ``n`` descriptors in use are at or above ``CROWDED``
    of ``limit`` (then the caller sheds silent connections, dgt.store_shed, and adds
    how many to ``shed``). ``look(n, now)`` returns the warning to log, or None (at most
    one per ``WARN_EVERY_S`` while crowded)."""

    def __init__(self, limit: int, port: int, world: int, base: int):
        """``base``: the descriptors held once the store served, before any rank."""
        self.limit, self.port, self.world, self.base = limit, port, world, base
        self.last_warned = -WARN_EVERY_S
        self.shed = 0

    def crowded(self, n: int) -> bool:
        return self.limit > 0 and n >= CROWDED * self.limit

    def look(self, n: int, now: float) -> str | None:
        if not self.crowded(n) or now - self.last_warned < WARN_EVERY_S:
            return None
        self.last_warned = now
        return (f"the rendezvous store holds {n} descriptors of its limit of {self.limit} "
                f"(ulimit -n): {n - self.base} connections to port {self.port}, where the "
                f"job's {self.world} ranks make {self.world} (a connection flood?); "
                f"{self.shed} silent ones shut down so far (connected, sent less than "
                f"a store handshake, then nothing for {SILENT_S:g} s: no rank's); ranks "
                f"already connected, and the sidecars, "
                f"are not affected")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.store_host",
                                description="Serve the rendezvous store for rank 0's "
                                "sidecar (started by it; not for direct use).")
    p.add_argument("--listen-fd", type=int, required=True,
                   help="inherited listening socket; -1: bind --host:--port")
    p.add_argument("--host", required=True, help="the store's address")
    p.add_argument("--port", type=int, required=True, help="the store's port")
    p.add_argument("--world", type=int, required=True, help="ranks in the job")
    p.add_argument("--timeout-s", type=float, required=True, help="TCPStore's timeout, s")
    p.add_argument("--parent", type=int, required=True,
                   help="pid of rank 0's sidecar: this process ends when it does")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    die_with_parent(ns.parent, signal.SIGKILL)   # SIGKILL: even while we are stopped
    limit = raise_fd_limit()
    try:
        from torch.distributed import TCPStore
        extra = {"master_listen_fd": ns.listen_fd} if ns.listen_fd >= 0 else {}
        store = TCPStore(ns.host, ns.port, ns.world, is_master=True,
                         timeout=timedelta(seconds=ns.timeout_s), wait_for_workers=False,
                         **extra)
    except Exception as e:   # DistStoreError / RuntimeError: one line for rank 0
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              flush=True)
        return 3
    print("ready", flush=True)
    watch = CrowdWatch(limit, ns.port, ns.world, open_fds(limit))
    while os.getppid() == ns.parent:
        n = open_fds(limit)
        if watch.crowded(n):
            watch.shed += shed(ns.port, limit)
        warning = watch.look(n, time.monotonic())
        if warning:
            log.warning("%s", warning)
        if state(ns.parent) in FROZEN:   # freeze with rank 0's sidecar; it continues us
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(WATCH_S)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
