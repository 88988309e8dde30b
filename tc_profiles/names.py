"""Testbed names: the prefix rule and every name derived from it (namespaces, host
addresses, ports, the state file). Pure string work, no pyroute2, so flag validation
(``dgt train --testbed-prefix``) stays cheap and imports no netlink library."""
from __future__ import annotations

import re

DEFAULT_PREFIX = "dgt"
SUBNET = "10.77"
MAX_HOSTS = 250


class TestbedError(RuntimeError):
    """The testbed could not be built, found or used; the message says what to do."""


class PrefixError(TestbedError, ValueError):
    """A testbed name prefix that cannot name namespaces (also a ValueError, so flag
    validators that catch ValueError report it as a bad flag)."""


def router_netns(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}-sw"


def host_netns(i: int, prefix: str = DEFAULT_PREFIX) -> str:
    """Netns name of host ``i`` (``dgt-h<i>``)."""
    return f"{prefix}-h{int(i)}"


_NETNS_RE = re.compile(r"(?P<prefix>[A-Za-z0-9][A-Za-z0-9_-]*)-(?:h\d+|sw)")


def prefix_of(netns: str) -> str | None:
    """The testbed prefix a namespace name carries (``brk-h0``, ``brk-sw`` -> ``brk``),
    or None for a name no testbed makes."""
    m = _NETNS_RE.fullmatch(netns)
    return m.group("prefix") if m else None


def host_addr(i: int) -> str:
    """IPv4 address of host ``i`` (``10.77.<i>.2``); the same in every testbed."""
    return f"{SUBNET}.{int(i)}.2"


def router_addr(i: int) -> str:
    return f"{SUBNET}.{int(i)}.1"


def router_port(i: int) -> str:
    return f"p{int(i)}"


def state_name(prefix: str) -> str:
    """File name of the testbed's state file (under ``/run/dgt``)."""
    return f"testbed-{prefix}.json"


# Every name derived from the prefix is a file name: the namespaces <prefix>-sw and
# <prefix>-h<i> (bind mounts under /run/netns) and the state file testbed-<prefix>.json.
# Interface names (eth0, p<i>, t<i>) do not contain it, so IFNAMSIZ does not limit it;
# NAME_MAX (255 bytes) does. A '/' would make pyroute2 and `ip netns` take the name as a
# path (relative to the current folder), and a leading '-' reads as an option to `ip`.
NAME_MAX = 255
MAX_PREFIX_LEN = NAME_MAX - max(len(state_name("")), len(router_netns("")),
                                len(host_netns(MAX_HOSTS - 1, "")))
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def check_prefix(prefix, what: str = "testbed prefix") -> str:
    """Return ``prefix`` if it can name a testbed, else raise :class:`PrefixError`.

    Allowed: 1..MAX_PREFIX_LEN (242) ASCII letters, digits, '-' and '_', starting with
    a letter or digit. ``what`` names the flag in the message (e.g. ``--prefix``).
    Call it before anything is created: every public function here that takes a
    prefix does.
    """
    rule = (f"use 1..{MAX_PREFIX_LEN} letters, digits, '-' or '_', starting with a letter "
            f"or digit (it names the namespaces <prefix>-sw and <prefix>-h<i>)")
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise PrefixError(f"bad {what} {prefix!r}: {rule}")
    if len(prefix) > MAX_PREFIX_LEN:
        raise PrefixError(f"bad {what} {prefix[:24]!r}... ({len(prefix)} characters): "
                          f"too long; {rule}")
    return prefix
