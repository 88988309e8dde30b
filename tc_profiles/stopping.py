"""The stop signals as this layer sees them, and a command's commit point.

``dgt.cli`` turns SIGTERM and SIGHUP into Ctrl-C (KeyboardInterrupt) for a command that
sets ``owns_cleanup``, so its cleanup runs (dgt.interrupt, which this layer may not
import, takes :data:`STOP_SIGNALS` from here). No pyroute2 here: the CLI loads this for every command.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

#: what stops a command as Ctrl-C does: SIGTERM (kill, a CI runner, systemd), SIGINT
#: (Ctrl-C; also for a job started in the background, whose SIGINT the shell ignores)
#: and SIGHUP (its terminal went away). The one definition: dgt.interrupt takes it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def hold_stop_signals() -> None:
    """A command's commit point: from here it completes, says so and exits 0.

    A stop signal that came before is raised here as KeyboardInterrupt (its handler
    runs: ``signal.pthread_sigmask`` runs the pending handlers), so the caller still
    undoes its work; from here on STOP_SIGNALS are ignored (SIG_IGN) for the rest of
    the process. Without it, a signal just after ``dgt tc apply`` finished gave
    "applied profile ..." on stdout and exit 130/143 (an outside tester, 2 tries in
    60). Ignored, not blocked: a mask is one thread's, and the kernel hands a signal
    that the main thread blocks to any thread that does not, such as the OpenBLAS
    threads that importing numpy starts, where Python's handler still ran (a
    re-check of the commit point in ``dgt testbed down``). A child started after it
    inherits SIG_IGN. Main thread only."""
    signal.pthread_sigmask(signal.SIG_BLOCK, ())   # runs a handler still pending
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def deferred(signums=STOP_SIGNALS):
    """Record ``signums`` while the body runs and act on the first one that came as the
    body ends, with the handler they had before (``dgt.interrupt.stop_on_signals``'s
    raises KeyboardInterrupt there; SIG_DFL ends the process; SIG_IGN drops it).

    For work that must be whole: a set of output files written together (``dgt
    bench`` after each cell: a Ctrl-C between its JSON and its Markdown left the JSON
    alone, CI of e96b01b), an import that calls back into Python from C++ (torch's,
    where a KeyboardInterrupt aborts the process), a namespace pyroute2 makes in a
    forked child. The Python handler is what waits, not the signal (a mask, as before,
    is one thread's: the kernel handed a signal the main thread blocked to numpy's
    OpenBLAS threads, and Python's handler still ran). A forked copy of the process
    that gets one dies of it, as by default. Outside the main thread, where a handler
    cannot be set, the signals are blocked in that thread instead."""
    if threading.current_thread() is not threading.main_thread():
        before_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before_mask)
        return
    came: list[int] = []
    owner = os.getpid()

    def record(signum, frame):
        if os.getpid() != owner:   # a forked copy: dies of it, as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif not came:
            came.append(signum)

    before = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, record)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if came:
            handler = before[came[0]]
            if callable(handler):
                handler(came[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), came[0])
