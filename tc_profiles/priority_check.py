"""Measure DSCP priority on a shaped testbed port under bulk best-effort TCP load.

Three hosts: h1 sends bulk TCP (DSCP 0) to h0, h2 sends UDP with one DSCP at a fixed
offered rate to h0. Both meet on router port p0 (egress to h0), shaped at ``rate`` with
the profile. The port's class counters give what the qdisc delivered and dropped for
the probe's class; iperf3 gives the offered rate and what the receiving application
got (which can be lower when the receiver runs out of CPU, not the network).

Run it: ``python -m dgt.tc_profiles.priority_check [--rate 1gbit] [--seconds 3]``
(or ``dgt testbed priority``). Prints a table and, with ``--json``, a JSON report.
Needs root, iperf3.

Expected on htb-prio (DESIGN.md): EF keeps >= 90 % of what it offers up to the link
rate; CS1 (scavenger, below best effort) gets only the leftover.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from . import applier
from .schema import load_profile
from .testbed import TestbedError, Testbed, down, host_addr, up

UDP_PAYLOAD_BYTES = 1400
DEFAULT_CASES = (("EF", 46, 300), ("EF", 46, 600), ("CS1", 8, 300), ("CS1", 8, 600))
RX, BULK_SRC, UDP_SRC = 0, 1, 2


def _class_of(tb: Testbed, dscp: int) -> str:
    prof = load_profile(tb.profile)
    i = [b.name for b in prof.bands].index(prof.band_for_dscp(dscp).name)
    from .plan import band_classid, fmt_handle
    return fmt_handle(band_classid(prof, i))


def run_case(tb: Testbed, name: str, dscp: int, offered_mbit: float, seconds: float = 3,
             bulk: bool = True, warmup_s: float = 1.0) -> dict:
    """One measurement: UDP at ``offered_mbit`` with ``dscp`` (plus bulk TCP if ``bulk``).

    Returns offered/delivered figures in Mbit/s (UDP payload) and the port's class
    counters: {case, dscp, cls, asked_mbit, offered_mbit, delivered_frac, delivered_mbit,
    port_pkts, port_drops, rx_app_mbit, rx_rcvbuf_errors, bulk_mbit}. ``delivered_frac``
    = packets the port sent / (sent + dropped) for the probe's class; ``rx_app_mbit`` =
    UDP datagrams the receiving host accepted (its UDP MIB), which also counts what its
    socket buffer overflowed as lost (``rx_rcvbuf_errors``).
    """
    cid = _class_of(tb, dscp)
    port = ("p0", tb.router)
    procs: list[subprocess.Popen] = []
    try:
        bulk_cli = None
        if bulk:
            procs.append(tb.popen_in(RX, ["iperf3", "-s", "-1", "-p", "5201",
                                          "-B", host_addr(RX)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(tb.popen_in(RX, ["iperf3", "-s", "-1", "-p", "5202", "-B",
                                      host_addr(RX)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_port(tb, RX, [5201, 5202] if bulk else [5202])
        if bulk:
            bulk_cli = tb.popen_in(BULK_SRC, ["iperf3", "-c", host_addr(RX), "-p", "5201",
                                              "-P", "2", "-t", f"{seconds + warmup_s + 1:g}",
                                              "-J"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)
            procs.append(bulk_cli)
            time.sleep(warmup_s)          # let TCP fill the queue before the probe starts
        before = applier.class_counters(applier.show(*port))[cid]
        udp0 = _udp_snmp(tb, RX)
        udp = tb.exec_in(UDP_SRC, ["iperf3", "-c", host_addr(RX), "-p", "5202", "-u",
                                   "-b", f"{offered_mbit:g}M", "-l", str(UDP_PAYLOAD_BYTES),
                                   "--tos", str(dscp << 2), "-t", f"{seconds:g}", "-w", "4M",
                                   "-J"], timeout_s=seconds + 20)
        after = applier.class_counters(applier.show(*port))[cid]
        udp1 = _udp_snmp(tb, RX)
        bulk_mbit = None
        if bulk_cli is not None:
            out, _ = bulk_cli.communicate(timeout=seconds + warmup_s + 20)
            try:
                bulk_mbit = json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6
            except (ValueError, KeyError):
                bulk_mbit = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    try:
        s = json.loads(udp.stdout)["end"]["sum"]
    except (ValueError, KeyError):
        raise TestbedError(f"iperf3 UDP probe failed: {udp.stderr.strip() or udp.stdout[-200:]}")
    sent_mbit = s["bytes"] * 8 / s["seconds"] / 1e6
    pkts = after["packets"] - before["packets"]
    drops = after["drops"] - before["drops"]
    frac = pkts / (pkts + drops) if pkts + drops else 0.0
    rx_app = ((udp1["InDatagrams"] - udp0["InDatagrams"]) * UDP_PAYLOAD_BYTES * 8
              / s["seconds"] / 1e6)
    return dict(case=name, dscp=dscp, cls=cid, asked_mbit=offered_mbit,
                offered_mbit=round(sent_mbit, 1), delivered_frac=round(frac, 4),
                delivered_mbit=round(sent_mbit * frac, 1), port_pkts=pkts, port_drops=drops,
                rx_app_mbit=round(rx_app, 1),
                rx_rcvbuf_errors=udp1["RcvbufErrors"] - udp0["RcvbufErrors"],
                bulk_mbit=None if bulk_mbit is None else round(bulk_mbit, 1))


def _udp_snmp(tb: Testbed, host: int) -> dict[str, int]:
    """The receiving host's UDP MIB counters (/proc/net/snmp read inside its netns)."""
    rows = [ln.split() for ln in tb.exec_in(host, ["cat", "/proc/net/snmp"]).stdout.splitlines()
            if ln.startswith("Udp:")]
    return dict(zip(rows[0][1:], map(int, rows[1][1:])))


def _wait_port(tb: Testbed, host: int, ports, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while time.monotonic() < deadline:
            if tb.exec_in(host, ["ss", "-Htln", f"sport = :{port}"]).stdout.strip():
                break
            time.sleep(0.05)


def priority_check(rate: str = "1gbit", seconds: float = 3, profile: str = "htb-prio",
                   cases=DEFAULT_CASES, bulk: bool = True, prefix: str | None = None,
                   queue_bytes: int | None = None) -> list[dict]:
    """Build a 3-host testbed, run every (name, dscp, offered_mbit) case, tear it down.

    Returns one dict per case (see :func:`run_case`). Raises TestbedError.
    """
    prefix = prefix or f"dgtpc{os.getpid()}"
    tb = up(3, rate=rate, profile=profile, prefix=prefix, queue_bytes=queue_bytes)
    try:
        return [run_case(tb, n, d, m, seconds, bulk) for n, d, m in cases]
    finally:
        down(prefix)


def render(results: list[dict]) -> str:
    """Table: case, DSCP, class, offered, delivered at the port, drops, app rx, bulk."""
    lines = [f"{'case':<5} {'dscp':>4} {'class':<6} {'offered':>9} {'delivered':>10} "
             f"{'frac':>6} {'port pkts':>10} {'drops':>8} {'app rx':>8} {'bulk TCP':>9}",
             f"{'':<5} {'':>4} {'':<6} {'Mbit/s':>9} {'Mbit/s':>10} {'':>6} {'':>10} "
             f"{'':>8} {'Mbit/s':>8} {'Mbit/s':>9}"]
    for r in results:
        bulk = "-" if r["bulk_mbit"] is None else f"{r['bulk_mbit']:.0f}"
        lines.append(f"{r['case']:<5} {r['dscp']:>4} {r['cls']:<6} {r['offered_mbit']:>9.1f} "
                     f"{r['delivered_mbit']:>10.1f} {r['delivered_frac']:>6.3f} "
                     f"{r['port_pkts']:>10} {r['port_drops']:>8} {r['rx_app_mbit']:>8.1f} "
                     f"{bulk:>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgt.tc_profiles.priority_check",
                                 description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rate", default="1gbit", help="port rate (default 1gbit)")
    ap.add_argument("--profile", default="htb-prio")
    ap.add_argument("--seconds", type=float, default=3.0, help="probe duration per case")
    ap.add_argument("--queue-bytes", type=int, default=None)
    ap.add_argument("--no-bulk", action="store_true", help="no bulk TCP (baseline)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def run(args) -> int:
    if os.geteuid() != 0:
        print("dgt testbed needs root (CAP_NET_ADMIN); run as root or use loopback mode",
              file=sys.stderr)
        return 2
    from shutil import which
    if which("iperf3") is None:
        print("the priority check needs iperf3; install it (apt-get install iperf3)",
              file=sys.stderr)
        return 2
    try:
        res = priority_check(args.rate, args.seconds, args.profile, bulk=not args.no_bulk,
                             queue_bytes=args.queue_bytes)
    except (TestbedError, applier.TcError, ValueError) as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"priority check: profile {args.profile}, port rate {args.rate}, "
          f"{'bulk TCP h1->h0' if not args.no_bulk else 'no bulk load'}, UDP h2->h0, "
          f"{args.seconds:g} s per case")
    print(render(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "profile": args.profile, "seconds": args.seconds,
                       "bulk": not args.no_bulk, "cases": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
