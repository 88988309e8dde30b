"""The stop signals as this layer sees them, and a command's commit point.

``dgt.cli`` turns SIGTERM and SIGHUP into Ctrl-C (KeyboardInterrupt) for a command that
sets ``owns_cleanup``, so its cleanup runs (dgt.interrupt, which this layer may not
import, takes :data:`STOP_SIGNALS` from here). No pyroute2 here: the CLI loads this for every command.
"""
from __future__ import annotations

import signal

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
