"""The open-file limit (RLIMIT_NOFILE, ``ulimit -n``) a job's processes need.

A process of a job holds, besides Python's and torch's own: its listening sockets (TCP,
one UDP socket per channel, the trainer's Unix socket), a TCP connection to and from
every peer, its connection to the rendezvous store (whose server runs in a process
of its own, dgt.store_host, that raises its own limit), shared
memory and its log files; the launcher holds a log file per child. Below what that
takes the job failed with whatever ran out first (an outside tester at ``ulimit -n``
24 and 12: "Failed to init uv loop", a "Cannot close a running event loop" traceback,
"Too many open files"). So ``dgt train`` and ``dgt sidecar`` raise the soft limit to
what the job needs when the hard limit allows (their children inherit it), and refuse
in one line when it does not.
"""
from __future__ import annotations

import resource


def need(world: int) -> int:
    """Descriptors one process of a ``world``-rank job may hold at once, with room: 64
    plus 4 per rank (a 4-rank job: 80; a tester's ran at 64 and failed at 40)."""
    return 64 + 4 * world


def ensure(world: int) -> int | None:
    """Raise this process's soft RLIMIT_NOFILE to :func:`need` (``world``) when it is
    below and the hard limit allows. Returns the new soft limit, or None when nothing
    changed. Raises ValueError (one line, what to do) when the hard limit is below."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need(world)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    if hard != resource.RLIM_INFINITY and hard < want:
        raise ValueError(f"the open-file limit (ulimit -n) is {soft}, at most {hard} for "
                         f"this user; a job of {world} ranks needs {want}: raise it "
                         f"(ulimit -n {want}, as root or in limits.conf)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want
