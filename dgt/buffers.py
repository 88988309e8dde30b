"""Socket buffer sizes that the kernel granted, checked against what a channel needs.

The kernel silently caps SO_RCVBUF/SO_SNDBUF at net.core.rmem_max/wmem_max (socket(7);
it then doubles the value for its own bookkeeping). A UDP channel whose receive buffer
is smaller than one burst of datagrams drops the rest of the burst in the kernel, and
the job sees it only as UDP loss. So the sidecar reads back the effective sizes and
turns a shortfall into a warning that names the sizes and the sysctl to raise; the
warning goes to the sidecar's log, its ``sidecar-<rank>.json`` and the ``dgt train``
summary and report.
"""
from __future__ import annotations

import socket

#: bytes one UDP channel socket must hold: a burst of paced GSO batches from every peer
#: while the event loop is busy (half of the 4 MiB that the sidecar asks for by default)
UDP_BURST_BYTES = 2 << 20


def check(sock: socket.socket, asked_bytes: int, need_bytes: int = UDP_BURST_BYTES
          ) -> list[str]:
    """Warnings (empty when fine) for ``sock``'s effective receive and send buffers
    (bytes, as getsockopt reports them) below ``need_bytes``. Each names the effective
    size, the need and the sysctl that lifts the cap (net.core.rmem_max / wmem_max, in
    bytes; ``asked_bytes`` is what --udp-buffer-bytes asked for)."""
    out = []
    for opt, name, sysctl, effect in (
            (socket.SO_RCVBUF, "SO_RCVBUF", "net.core.rmem_max",
             "datagrams of a burst will be dropped in the receiver's kernel"),
            (socket.SO_SNDBUF, "SO_SNDBUF", "net.core.wmem_max",
             "sends will stall and back off")):
        got = sock.getsockopt(socket.SOL_SOCKET, opt)
        if got < need_bytes:
            want = max(need_bytes, asked_bytes)
            out.append(f"UDP {name} is {got} B, below the {need_bytes} B burst a channel "
                       f"must absorb (asked {asked_bytes} B): {effect}; raise it with 'sysctl -w {sysctl}={want}' (and "
                       f"--udp-buffer-bytes {want}), or lower --pace-mbit")
    return out
