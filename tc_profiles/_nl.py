"""Small pyroute2 helpers shared by the applier, the kernel probe and the testbed.

All synchronous: pyroute2 netlink must not run inside a uvloop loop (docs/architecture.md).
"""
from __future__ import annotations

import os

from pyroute2 import IPRoute, netns as _netns

from .stopping import deferred


def create_netns(name: str) -> None:
    """Create the network namespace ``name``, whole or not at all.

    pyroute2 makes it in a forked child and waits for it. A parent interrupted while it
    waited (Ctrl-C, or SIGTERM turned into it) went on to its cleanup, which listed the
    namespaces before the child had bound the new one: it was left behind (a killed
    ``dgt testbed up`` left ``<prefix>-h0``). So the stop signals wait (``deferred``,
    not lost) until the namespace is made; one that came meanwhile acts then.
    Raises OSError.
    """
    with deferred():
        _netns.create(name)


def open_ipr(netns: str | None = None) -> IPRoute:
    """IPRoute in the current namespace, or in the existing namespace ``netns``.

    Never creates a namespace (pyroute2 would, by default). Raises LookupError when
    ``netns`` does not exist.
    """
    if netns is None:
        ipr = IPRoute()
    else:
        if netns not in _netns.listnetns():
            raise LookupError(f"netns {netns!r} does not exist")
        ipr = IPRoute(netns=netns, flags=0)
    # pyroute2 0.9.7: the sync IPRoute leaves status['nlm_generator'] unset, which
    # nlm_request() reads.
    ipr.asyncore.status.setdefault("nlm_generator", False)
    return ipr


def request(ipr: IPRoute, msg, msg_type: int, msg_flags: int):
    """Send one prepared netlink message and wait for the answer (raises NetlinkError)."""
    return ipr.nlm_request(msg, msg_type, msg_flags)


def is_root() -> bool:
    return os.geteuid() == 0
