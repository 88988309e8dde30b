"""Benchmark: what one batched UDP send costs, and what the IP_RECVERR toggle adds.

:class:`dgt.transport.udp_batch.BatchSender` sends ``--rows`` datagrams of ``--size``
bytes (one GSO ``sendmsg`` per up to 64) to a receiver on loopback, ``--repeat`` times,
with the ``IP_RECVERR`` toggle (``send``, what the sidecar runs) and without it
(``_send``), interleaved so that both see the same machine::

    python -m dgt.tools.bench_udp_send [--rows 44] [--size 1400] [--repeat 2000] [--json out.json]

Prints the median µs per call of each and their difference. Timing belongs here, never
in tests.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import numpy as np

from dgt.launch import write_report
from dgt.transport import sockopts
from dgt.transport.udp_batch import BatchSender


def bench(rows: int = 44, size: int = 1400, repeat: int = 2000, rounds: int = 5) -> dict:
    """Median seconds per call, with and without the toggle; ``rounds`` interleaved
    rounds of ``repeat`` calls each. Raises OSError if loopback UDP cannot be used."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = sockopts.udp_socket("127.0.0.1", 0, 34)
    try:
        data = np.zeros((rows, size), np.uint8)
        sender = BatchSender(tx)
        addr = rx.getsockname()

        def drain():
            try:
                while True:
                    rx.recv(65536)
            except BlockingIOError:
                pass

        def one_round(fn) -> float:
            t = time.perf_counter()
            for i in range(repeat):
                fn(data, addr)
                if i % 16 == 0:
                    drain()
            drain()
            return (time.perf_counter() - t) / repeat

        with_toggle, without = [], []
        for _ in range(rounds):
            with_toggle.append(one_round(sender.send))
            without.append(one_round(sender._send))
        return dict(rows=rows, size=size, repeat=repeat, rounds=rounds, gso=sender.gso,
                    send_s=float(np.median(with_toggle)),
                    send_without_toggle_s=float(np.median(without)),
                    toggle_s=float(np.median(with_toggle) - np.median(without)))
    finally:
        tx.close()
        rx.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgt.tools.bench_udp_send",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=44, help="datagrams per call (1..64k)")
    p.add_argument("--size", type=int, default=1400, help="bytes per datagram (1..65000)")
    p.add_argument("--repeat", type=int, default=2000, help="calls per round")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    if not 1 <= a.rows <= 65536 or not 1 <= a.size <= 65000 or a.repeat < 1:
        p.error("need --rows 1..65536, --size 1..65000 and --repeat >= 1")
    r = bench(a.rows, a.size, a.repeat)
    r["load"] = [round(x, 2) for x in os.getloadavg()]
    print(f"{r['rows']} datagrams of {r['size']} B per call (GSO {'on' if r['gso'] else 'off'}), "
          f"{r['rounds']} x {r['repeat']} calls, load {r['load']}")
    print(f"  with IP_RECVERR toggle     {r['send_s'] * 1e6:8.1f} µs/call")
    print(f"  without                    {r['send_without_toggle_s'] * 1e6:8.1f} µs/call")
    print(f"  toggle                     {r['toggle_s'] * 1e6:8.1f} µs/call")
    if a.json:
        write_report(a.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
