"""Which ``dgt`` commands need root, what for, and what each one offers instead: the one
place every command's not-root line comes from.

A not-root line suggests only what that command has: a flag of its own parser that
does the job without root (``dgt tc apply --dry-run``, ``dgt bench --loopback``), or
nothing but "run as root" (``dgt tc clear`` has no dry run, ``dgt testbed down`` no
loopback mode, and ``dgt bench goodput`` refuses ``--loopback``).
``tests/test_not_root.py`` holds every entry against its command's parser and runs the
suggestion as an unprivileged user. Plain strings, no import: ``dgt.tools`` (capture,
bench) asks here too.

Example::

    from dgt.tc_profiles.needs_root import not_root
    not_root("dgt tc apply")
    # 'needs root (CAP_NET_ADMIN: it replaces the device's root qdisc); run as root,
    #  or add --dry-run to print the tc commands only'
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RootNeed:
    """What ``command`` needs root for (``why``) and, when it has one, its way around it:
    ``verb`` ("add" or "drop") its own ``flag``, ``then`` saying what that does."""
    why: str
    verb: str = ""
    flag: str = ""
    then: str = ""

    def message(self) -> str:
        alt = f", or {self.verb} {self.flag} {self.then}" if self.flag else ""
        return f"needs root ({self.why}); run as root{alt}"


_TESTBED = "CAP_NET_ADMIN: the testbed's network namespaces"

#: command (as its parser's prog says it; ``dgt bench`` is the matrix) -> RootNeed
COMMANDS: dict[str, RootNeed] = {
    "dgt tc apply": RootNeed("CAP_NET_ADMIN: it replaces the device's root qdisc",
                             "add", "--dry-run", "to print the tc commands only"),
    "dgt tc clear": RootNeed("CAP_NET_ADMIN: it deletes the device's root qdisc"),
    "dgt tc show": RootNeed("CAP_SYS_ADMIN: --netns enters a network namespace",
                            "drop", "--netns", "to show a device of this namespace"),
    "dgt testbed up": RootNeed("CAP_NET_ADMIN: network namespaces, veth, tc"),
    "dgt testbed down": RootNeed(_TESTBED),
    "dgt testbed status": RootNeed(_TESTBED),
    "dgt testbed exec": RootNeed(_TESTBED),
    "dgt testbed load": RootNeed(_TESTBED),
    "dgt testbed priority": RootNeed("CAP_NET_ADMIN: it builds a testbed of its own"),
    "dgt capture": RootNeed("CAP_NET_RAW: a packet socket; with --netns also "
                            "CAP_SYS_ADMIN"),
    "dgt bench": RootNeed("network namespaces, tc, nftables: the shaped testbed", "add",
                          "--loopback", "for the overhead check over loopback, no "
                                        "testbed"),
    "dgt bench goodput": RootNeed("network namespaces, tc: one shaped testbed port"),
    "dgt bench tta": RootNeed("network namespaces, tc, nftables: the shaped testbed",
                              "add", "--loopback", "to run every cell over loopback, no "
                                                   "testbed"),
}


def not_root(command: str) -> str:
    """The one-line not-root message of ``command`` (a key of :data:`COMMANDS`, e.g.
    ``"dgt testbed up"``), without the ``<prog>: error:`` the command puts before it.
    Raises KeyError for a command not listed (a root check with no entry here)."""
    return COMMANDS[command].message()


__all__ = ["COMMANDS", "RootNeed", "not_root"]
