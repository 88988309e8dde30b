"""Bounds of the testbed commands' float flags, checked before anything is built.

A float flag takes ``1e9`` or ``inf`` as readily as ``10``; unbounded, such a value
reached ``Popen.communicate(timeout=seconds + 15)`` and ended in ``OverflowError:
timeout is too large`` (a traceback), or an ``iperf3 -t`` that iperf3 refuses. Pure
arithmetic: no pyroute2, so the CLI checks flags before it loads netlink.
"""
from __future__ import annotations

import math

#: s: the longest ``dgt testbed load`` (and ``Testbed.load``): iperf3's own limit for
#: ``-t`` ("test duration too long (maximum = 86400 seconds)", iperf 3.12)
MAX_LOAD_SECONDS = 86400
#: s: the longest probe per case of ``dgt testbed priority`` (its bulk iperf3 runs 2 s
#: longer, warm-up included; five cases by default)
MAX_PRIORITY_SECONDS = 3600
#: Mbit/s: the most a ``--cases`` UDP offer may ask (1 Tbit/s, above any port rate the
#: testbed's veths reach)
MAX_OFFER_MBIT = 1_000_000


def seconds_problem(seconds: float, most: float, flag: str = "--seconds") -> str:
    """Why ``seconds`` (s) cannot be a run's duration ("" when it can): it must be a
    finite number > 0 and at most ``most`` s. Never raises."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        return f"{flag} must be a finite number > 0, got {seconds}"
    if seconds > most:
        return f"{flag} must be at most {most:g} s, got {seconds}"
    return ""


def iperf_seconds(seconds: float) -> int:
    """``iperf3 -t``'s value for a run of ``seconds`` (s, > 0): whole seconds, rounded
    up. iperf3 reads ``-t`` as an integer, so ``-t 0.5`` was 0, which it runs for ever,
    and ``-t 5.5`` ran 5 s."""
    return max(1, math.ceil(seconds))
