"""Whether a process of ours still runs, read from /proc (proc(5)): one answer for the
trainer's client (its sidecar ended?), the DDP launcher (a previous generation's
sidecar), ``dgt train``'s lock (the job named in it alive?) and the rendezvous store's
process (its parent frozen?); and how a child ends with its parent."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """In a child (before exec, or first thing after it): ``sig`` to us when the parent
    dies (prctl(2) PR_SET_PDEATHSIG), so a parent killed with SIGKILL leaves no child
    running; exec keeps the setting. Exits at once if the parent ``parent`` is already
    gone. SIGKILL ends a stopped child too; SIGTERM waits until it is continued."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (prctl(2) PR_GET_PDEATHSIG;
    :func:`die_with_parent` set it), 0 when none is set or it cannot be read."""
    import ctypes
    sig = ctypes.c_int(0)
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig)) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return sig.value


def state(pid: int) -> str:
    """Process ``pid``'s state letter (proc(5) /proc/PID/stat: R, S, D, T stopped, t
    traced, Z zombie, ...), or "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return ""


def running(pid: int) -> bool:
    """True while process ``pid`` runs (proc(5); a zombie, dead but not yet reaped,
    counts as ended)."""
    return state(pid) not in ("", "Z")


def ended(pid: int, wait_s: float) -> bool:
    """Whether process ``pid`` has ended (:func:`running`), waiting up to ``wait_s``
    seconds for it."""
    t_end = time.monotonic() + wait_s
    while running(pid):
        if time.monotonic() >= t_end:
            return False
        time.sleep(0.02)
    return True


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """End child ``proc``: SIGTERM (and SIGCONT, so that a stopped child takes it at
    once), then SIGKILL if it still runs after ``grace_s`` seconds; reaped either way."""
    proc.terminate()
    try:
        proc.send_signal(signal.SIGCONT)
    except OSError:
        pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_text(proc: subprocess.Popen, wait_s: float) -> str | None:
    """How the child ``proc`` ended (``was killed by SIGKILL``, ``exited with status
    3``), waiting up to ``wait_s`` seconds for it; None while it runs."""
    try:
        rc = proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return None
    if rc >= 0:
        return f"exited with status {rc}"
    try:
        return f"was killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"was killed by signal {-rc}"


def exit_now(code: int) -> None:
    """End this process with status ``code`` at once, after flushing its logs and
    standard streams: no interpreter finalisation, no C++ static destructors.

    For ``dgt sidecar`` once it has stopped (its records written, sockets and the
    store's process closed): a thread still inside torch's TCPStore, a rendezvous
    connect that completed just as the sidecar gave up on it, made the C++ runtime
    abort at exit ("terminate called without an active exception", SIGABRT instead of
    status 3: CI of e96b01b, 5 sidecars at load average 6 on 2 cores)."""
    import logging
    import sys
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):   # closed, or a broken pipe
            pass
    os._exit(code)
