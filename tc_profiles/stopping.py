"""The stop signals as this layer sees them, and a command's commit point.

``dgt.cli`` turns SIGTERM and SIGHUP into Ctrl-C (KeyboardInterrupt) for a command that
sets ``owns_cleanup`` (dgt.interrupt.STOP_SIGNALS, which this layer may not import), so
its cleanup runs. No pyroute2 here: the CLI loads this for every command.
"""
from __future__ import annotations

import signal

#: what stops a command as Ctrl-C does (dgt.interrupt.STOP_SIGNALS)
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def hold_stop_signals() -> None:
    """A command's commit point: from here it completes, says so and exits 0.

    Blocks (sigprocmask(2)) STOP_SIGNALS for the rest of the process: one that comes
    later stays pending and is discarded when the process exits. One that came before
    is raised here as KeyboardInterrupt (``signal.pthread_sigmask`` runs the pending
    handlers), with the mask as it was, so the caller still undoes its work. Without
    it, a signal just after ``dgt tc apply`` finished gave "applied profile ..." on
    stdout and exit 130/143 (an outside tester, 2 tries in 60). A child started after
    it inherits the mask. Main thread only."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())   # reads the mask
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    except KeyboardInterrupt:   # came before: the cleanup may start children
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        raise
