"""System tools and libraries dgt runs, the Debian package of each, and one check.

Every command and test that needs one asks here, so a missing tool is always named
with the package to install (one line), never a traceback or an ``exec`` failure.
Lookups honour ``PATH`` (``shutil.which``) and, for libpcap, the same question scapy
asks (``ctypes.util.find_library("pcap")``, then loading it).

Example::

    from dgt.tc_profiles import system
    system.require("nft", "the loss rule")   # raises MissingToolError when absent
"""
from __future__ import annotations

import ctypes
import ctypes.util
import shutil

#: tool -> Debian package that ships it
PACKAGES = {
    "nft": "nftables",
    "ip": "iproute2",
    "tc": "iproute2",
    "iperf3": "iperf3",
    "tshark": "tshark",
    "tmux": "tmux",
    "setpriv": "util-linux",
    "unshare": "util-linux",
    "libpcap": "libpcap0.8",
}
#: Debian package of the Fashion-MNIST data, and where it puts the files
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


class MissingToolError(RuntimeError):
    """A system tool or library is not installed; the message names the package."""


def install_hint(tool: str) -> str:
    """``'apt-get install nftables'`` for ``'nft'``."""
    return f"apt-get install {PACKAGES.get(tool, tool)}"


def missing_message(tool: str, what: str | None = None) -> str:
    """One line: what needs ``tool``, that it is missing, and the package to install."""
    pkg = PACKAGES.get(tool, tool)
    who = f"{what} needs" if what else "needs"
    return f"{who} '{tool}', which is not installed (Debian package {pkg}: {install_hint(tool)})"


def have(tool: str) -> bool:
    """Whether ``tool`` is on ``PATH`` (``"libpcap"``: whether libpcap loads)."""
    if tool == "libpcap":
        return libpcap_path() is not None
    return shutil.which(tool) is not None


def require(tool: str, what: str | None = None) -> None:
    """Raise :class:`MissingToolError` (see :func:`missing_message`) when ``tool`` is
    missing."""
    if not have(tool):
        raise MissingToolError(missing_message(tool, what))


def libpcap_path() -> str | None:
    """The libpcap shared library, found and loadable the way scapy loads it
    (``find_library("pcap")`` + ``CDLL``), or None."""
    name = ctypes.util.find_library("pcap")
    if not name:
        return None
    try:
        ctypes.CDLL(name)
    except OSError:
        return None
    return name
