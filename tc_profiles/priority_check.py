"""Measure DSCP priority on a shaped testbed port under bulk best-effort TCP load.

Three hosts: h1 sends bulk TCP (DSCP 0, iperf3, 2 streams) to h0, h2 offers UDP with one
DSCP at a fixed rate to h0. Both meet on router port p0 (egress to h0), shaped at
``rate`` with the profile. The port's class counters give what the qdisc sent and
dropped for the probe's class; a sink on h0 gives what the receiving application got.

The UDP load comes from :func:`udp_offer`, a Python generator run inside h2's netns:
UDP GSO (``UDP_SEGMENT``), so one ``send`` of up to 44 x 1400 B becomes 44 datagrams
in the kernel, paced by a token bucket in those large bursts, IP_TOS = dscp << 2. One
syscall per 44 datagrams lets a 2-core machine offer 600 Mbit/s next to the bulk flow
(iperf3's one-datagram-per-send managed ~350). h2's ``eth0`` has UDP segmentation
offload turned off, so the GSO bursts are cut into 1442 B frames when they leave h2
(as a real NIC puts them on the wire) and the router's port queues, counts and drops
single datagrams. Where the kernel lacks UDP GSO the generator sends one datagram per
syscall and says so (``gso`` false, ``note``).

Run it: ``python -m dgt.tc_profiles.priority_check [--rate 1gbit] [--seconds 3]``
(or ``dgt testbed priority``). Prints a table and, with ``--json``, a JSON report.
Needs root; iperf3 for the bulk TCP.

Expected on htb-prio (docs/tc_profiles.md): EF keeps >= 90 % of what it offers up to the link
rate; CS1 (scavenger, below best effort) gets only the leftover.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from typing import TYPE_CHECKING

from .bounds import MAX_OFFER_MBIT, MAX_PRIORITY_SECONDS, iperf_seconds, seconds_problem
from .lazy import OnFirstUse
from .needs_root import not_root
from .schema import load_profile, parse_rate

if TYPE_CHECKING:
    from .testbed import Testbed

applier = OnFirstUse(".applier")   # pyroute2: not for 'dgt testbed priority --help'
testbed = OnFirstUse(".testbed")

UDP_PAYLOAD_BYTES = 1400
GSO_SEGMENTS = 44                      # 44 x 1400 B = 61600 B per send (< 64 KB)
SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104
DEFAULT_CASES = (("EF", 46, 200), ("EF", 46, 400), ("EF", 46, 600),
                 ("CS1", 8, 300), ("CS1", 8, 600))
RX, BULK_SRC, UDP_SRC = 0, 1, 2
UDP_PORT = 5202
_BUCKET_BURSTS = 4                     # token bucket depth, in sends
BUSY_FRAC = 0.9                        # port sends >= 90 % of its rate: saturated
CPU_SHORT = 0.97                       # offered < 97 % of asked: the sender ran out of CPU


# ------------------------------------------------------------------ UDP generator


def udp_offer(dst: str, port: int, dscp: int, mbit: float, seconds: float,
              payload: int = UDP_PAYLOAD_BYTES, segments: int = GSO_SEGMENTS,
              gso: bool = True) -> dict:
    """Offer ``mbit`` Mbit/s of UDP payload to ``dst:port`` for ``seconds``; DSCP ``dscp``.

    Runs in the calling process (call it in the sender's netns, e.g. ``tb.run_in``).
    With ``gso`` each ``send`` carries ``segments`` datagrams of ``payload`` bytes
    (UDP_SEGMENT); a token bucket (depth four bursts, 246 KB, under the 256 KB band
    queues) paces the sends, so a sender descheduled for longer offers less rather than
    catching up in one long burst. Where the kernel
    refuses UDP_SEGMENT (OSError) it falls back to one datagram per send and says so.

    Returns {datagrams, payload_bytes, elapsed_s, offered_mbit, gso, note, sends,
    send_errors, cpu_s, in_send_s}: ``offered_mbit`` is payload bits handed to the
    kernel per second of the run; ``cpu_s`` the generator's user + system CPU time;
    ``in_send_s`` the wall time spent inside ``send`` (blocked on a full socket buffer
    or copying).  Little CPU and little time in ``send`` with a short offer means the
    process waited for a CPU: the machine was busy.
    """
    import resource
    import socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    note = ""
    try:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(dscp) << 2)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.connect((dst, port))
        n = max(1, int(segments)) if gso else 1
        if n > 1:
            try:
                s.setsockopt(SOL_UDP, UDP_SEGMENT, payload)
            except OSError as e:
                note = f"no UDP GSO in this kernel ({e.strerror}); 1 datagram per send"
                n = 1
        elif gso:
            note = "segments=1: 1 datagram per send"
        else:
            note = "GSO off (asked): 1 datagram per send"
        buf = bytes(payload * n)
        rate = mbit * 1e6 / 8                      # payload bytes per second
        depth = _BUCKET_BURSTS * len(buf)
        tokens = float(len(buf))
        sent = sends = errors = 0
        in_send = 0.0
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = last = time.monotonic()
        end = t0 + seconds
        while True:
            now = time.monotonic()
            if now >= end:
                break
            tokens = min(depth, tokens + (now - last) * rate)
            last = now
            if tokens < len(buf):
                time.sleep(min((len(buf) - tokens) / rate, end - now))
                continue
            t_send = time.monotonic()
            try:
                s.send(buf)
            except OSError as e:
                if sends == 0 and n > 1:           # GSO accepted as option, refused on send
                    s.setsockopt(SOL_UDP, UDP_SEGMENT, 0)
                    n, buf = 1, bytes(payload)
                    depth, tokens = _BUCKET_BURSTS * payload, float(payload)
                    note = f"UDP GSO send refused ({e.strerror}); 1 datagram per send"
                    continue
                errors += 1                        # ENOBUFS: our own qdisc was full
                tokens -= len(buf)
                continue
            tokens -= len(buf)
            sent += len(buf)
            sends += 1
            in_send += time.monotonic() - t_send
        elapsed = time.monotonic() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        s.close()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return dict(datagrams=sent // payload, payload_bytes=sent, elapsed_s=round(elapsed, 3),
                offered_mbit=round(sent * 8 / elapsed / 1e6, 1), gso=n > 1, note=note,
                sends=sends, send_errors=errors, cpu_s=round(cpu, 3),
                in_send_s=round(in_send, 3))


# A UDP sink for the receiving host, run as ``python -c`` inside its netns: binds,
# prints "ready", counts payload bytes until a line (or EOF) on stdin, prints JSON.
# UDP_GRO lets one recv take several datagrams where the kernel coalesced them. Its
# first line drops the current folder ('' first on sys.path under -c), so a socket.py
# or json.py in the folder the check was started in cannot stand in for the library's.
_SINK = r"""
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
import json, select, socket, time
addr, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
try:
    s.setsockopt(17, 104, 1)
    gro = True
except OSError:
    gro = False
s.bind((addr, port))
s.setblocking(False)
print("ready", flush=True)
buf = bytearray(1 << 16)
nbytes = recvs = 0
stdin = sys.stdin.fileno()
while True:
    r, _, _ = select.select([s, stdin], [], [], 1.0)
    if s in r:
        while True:
            try:
                k = s.recv_into(buf)
            except BlockingIOError:
                break
            nbytes += k
            recvs += 1
    if stdin in r:
        break
print(json.dumps({"bytes": nbytes, "recvs": recvs, "gro": gro}), flush=True)
"""


def _no_tx_udp_segmentation(dev: str) -> bool:
    """Turn UDP segmentation offload off on ``dev`` (this netns): GSO bursts are then cut
    into datagrams when they leave this host, as a NIC does. False if it cannot."""
    try:
        from pyroute2.ethtool import Ethtool
        e = Ethtool()
        try:
            f = e.get_features(dev)
            feat = f.features.get("tx-udp-segmentation")
            if feat is None:
                return True                    # device cannot keep GSO packets anyway
            if feat.enable:
                feat.enable = False
                e.set_features(dev, f)
            return not e.get_features(dev).features["tx-udp-segmentation"].enable
        finally:
            e.close()
    except Exception:                          # pyroute2 ethtool variants differ
        return False


# --------------------------------------------------------------------------- cases


def _class_of(tb: Testbed, dscp: int) -> str:
    prof = load_profile(tb.profile)
    i = [b.name for b in prof.bands].index(prof.band_for_dscp(dscp).name)
    from .plan import band_classid, fmt_handle
    return fmt_handle(band_classid(prof, i))


def run_case(tb: Testbed, name: str, dscp: int, offered_mbit: float, seconds: float = 3,
             bulk: bool = True, warmup_s: float = 1.0, gso: bool = True) -> dict:
    """One measurement: UDP at ``offered_mbit`` with ``dscp`` (plus bulk TCP if ``bulk``).

    Returns offered/delivered figures in Mbit/s (UDP payload) and the port's class
    counters: {case, dscp, cls, asked_mbit, offered_mbit, cpu_limited, gso, note,
    gen_cpu_s, gen_in_send_s, delivered_frac, delivered_mbit, port_pkts, port_drops,
    src_drops, rx_app_mbit, rx_rcvbuf_errors, bulk_mbit, be_port_mbit, port_mbit,
    port_busy, load1}.

    ``delivered_frac`` = datagrams p0 sent / (sent + dropped) for the probe's class;
    ``src_drops`` = the probe class's drops on h2's own eth0 (should be 0);
    ``rx_app_mbit`` = payload the sink on h0 read; ``bulk_mbit`` = iperf3's bulk goodput
    over its whole run; ``be_port_mbit`` = what p0 sent for best effort while the probe
    ran (frame bytes, Ethernet header included); ``port_mbit`` the same for every
    class; ``port_busy`` = port_mbit >= 90 % of the port rate (saturated: without it,
    as on a machine too busy to run the bulk flow, a low band simply gets the idle link
    and its fraction says nothing about priority); ``cpu_limited`` = the generator offered
    < 97 % of ``asked_mbit``; ``load1`` = 1-minute load average when the case started.
    """
    cid = _class_of(tb, dscp)
    port = ("p0", tb.router)
    src_port = (testbed.HOST_DEV, tb.host_netns(UDP_SRC))
    load1 = os.getloadavg()[0]
    procs: list[subprocess.Popen] = []
    try:
        bulk_cli = None
        if bulk:
            procs.append(tb.popen_in(RX, ["iperf3", "-s", "-1", "-p", "5201",
                                          "-B", testbed.host_addr(RX)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        sink = tb.popen_in(RX, [sys.executable, "-c", _SINK, testbed.host_addr(RX), str(UDP_PORT)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        procs.append(sink)
        if sink.stdout.readline().strip() != "ready":
            raise testbed.TestbedError(f"UDP sink on h{RX} did not start: "
                               f"{sink.stderr.read()[-300:]}")
        if bulk:
            _wait_port(tb, RX, [5201])
            bulk_cli = tb.popen_in(BULK_SRC, ["iperf3", "-c", testbed.host_addr(RX), "-p", "5201",
                                              "-P", "2", "-t", str(iperf_seconds(seconds + warmup_s + 1)),
                                              "-J"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)
            procs.append(bulk_cli)
            time.sleep(warmup_s)          # let TCP fill the queue before the probe starts
        state = applier.show(*port)
        leaves = [c["classid"] for c in state["classes"] if c.get("leaf")]
        before = applier.class_counters(state)
        t_before = time.monotonic()
        src0 = applier.class_counters(applier.show(*src_port))[cid]
        udp0 = _udp_snmp(tb, RX)
        gen = tb.run_in(UDP_SRC, udp_offer, testbed.host_addr(RX), UDP_PORT, dscp, offered_mbit,
                        seconds, gso=gso, timeout_s=seconds + 20)
        time.sleep(0.2)                   # let the port drain what it still queues
        after = applier.class_counters(applier.show(*port))
        window_s = time.monotonic() - t_before
        src1 = applier.class_counters(applier.show(*src_port))[cid]
        udp1 = _udp_snmp(tb, RX)
        out, err = sink.communicate(input="stop\n", timeout=10)
        try:
            rx = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise testbed.TestbedError(f"UDP sink on h{RX} failed: {err.strip()[-300:]}") from None
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
    be = _class_of(tb, 0)
    be_bytes = after[be]["bytes"] - before[be]["bytes"]
    port_bytes = sum(after[c]["bytes"] - before[c]["bytes"] for c in leaves)
    port_mbit = port_bytes * 8 / window_s / 1e6
    after, before = after[cid], before[cid]
    pkts = after["packets"] - before["packets"]
    drops = after["drops"] - before["drops"]
    frac = pkts / (pkts + drops) if pkts + drops else 0.0
    return dict(case=name, dscp=dscp, cls=cid, asked_mbit=offered_mbit,
                offered_mbit=gen["offered_mbit"],
                cpu_limited=gen["offered_mbit"] < CPU_SHORT * offered_mbit,
                gso=gen["gso"], note=gen["note"], gen_cpu_s=gen["cpu_s"],
                gen_in_send_s=gen["in_send_s"],
                delivered_frac=round(frac, 4),
                delivered_mbit=round(gen["offered_mbit"] * frac, 1), port_pkts=pkts,
                port_drops=drops, src_drops=src1["drops"] - src0["drops"],
                rx_app_mbit=round(rx["bytes"] * 8 / gen["elapsed_s"] / 1e6, 1),
                rx_rcvbuf_errors=udp1["RcvbufErrors"] - udp0["RcvbufErrors"],
                bulk_mbit=None if bulk_mbit is None else round(bulk_mbit, 1),
                be_port_mbit=round(be_bytes * 8 / window_s / 1e6, 1),
                port_mbit=round(port_mbit, 1),
                port_busy=port_mbit >= BUSY_FRAC * parse_rate(tb.rate) / 1e6,
                load1=round(load1, 2))


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
                   queue_bytes: int | None = None, gso: bool = True) -> list[dict]:
    """Build a 3-host testbed, run every (name, dscp, offered_mbit) case, tear it down
    (also when a case fails).

    Returns one dict per case (see :func:`run_case`). Raises TestbedError.
    """
    prefix = prefix or f"dgtpc{os.getpid()}"
    tb = testbed.up(3, rate=rate, profile=profile, prefix=prefix, queue_bytes=queue_bytes)
    try:
        why = ""
        if gso and not tb.run_in(UDP_SRC, _no_tx_udp_segmentation, testbed.HOST_DEV, timeout_s=20):
            # GSO bursts would reach the port whole (one drop = 44 datagrams): no GSO then
            gso, why = False, (f"tx-udp-segmentation stays on at h{UDP_SRC} {testbed.HOST_DEV}: "
                               f"1 datagram per send")
        res = [run_case(tb, n, d, m, seconds, bulk, gso=gso) for n, d, m in cases]
        for r in res:
            r["note"] = why or r["note"]
        return res
    except KeyboardInterrupt:   # what is undone (the finally), for the one line
        raise KeyboardInterrupt(f"its testbed '{prefix}' was removed") from None
    finally:
        testbed.down(prefix)


def parse_cases(text: str) -> tuple:
    """``"EF:46:600,CS1:8:300"`` -> (("EF", 46, 600.0), ("CS1", 8, 300.0)).
    Raises ValueError."""
    out = []
    for item in text.split(","):
        try:
            name, dscp, mbit = item.strip().split(":")
            out.append((name, int(dscp), float(mbit)))
        except ValueError:
            raise ValueError(f"bad case '{item}': use NAME:DSCP:MBIT, "
                             f"e.g. EF:46:600") from None
        if not (0 <= out[-1][1] <= 63 and 0 < out[-1][2] <= MAX_OFFER_MBIT):
            raise ValueError(f"bad case '{item}': DSCP 0..63, 0 < Mbit/s <= "
                             f"{MAX_OFFER_MBIT}")
    return tuple(out)


def render(results: list[dict]) -> str:
    """Table: case, DSCP, class, asked, offered, delivered at the port, drops, app rx,
    bulk TCP goodput, best effort and everything sent by the port. A ``*`` after offered marks a case
    whose sender's CPU could not offer what was asked, a ``!`` after port one whose port
    was not saturated."""
    lines = [f"{'case':<5} {'dscp':>4} {'class':<6} {'asked':>6} {'offered':>9} "
             f"{'delivered':>10} {'frac':>6} {'port pkts':>10} {'drops':>8} {'app rx':>8} "
             f"{'bulk TCP':>9} {'BE port':>8} {'port':>7}",
             f"{'':<5} {'':>4} {'':<6} {'Mbit/s':>6} {'Mbit/s':>9} {'Mbit/s':>10} {'':>6} "
             f"{'':>10} {'':>8} {'Mbit/s':>8} {'Mbit/s':>9} {'Mbit/s':>8} {'Mbit/s':>7}"]
    notes = []
    for r in results:
        bulk = "-" if r["bulk_mbit"] is None else f"{r['bulk_mbit']:.0f}"
        star = "*" if r.get("cpu_limited") else " "
        lines.append(f"{r['case']:<5} {r['dscp']:>4} {r['cls']:<6} {r['asked_mbit']:>6g} "
                     f"{r['offered_mbit']:>8.1f}{star} "
                     f"{r['delivered_mbit']:>10.1f} {r['delivered_frac']:>6.3f} "
                     f"{r['port_pkts']:>10} {r['port_drops']:>8} {r['rx_app_mbit']:>8.1f} "
                     f"{bulk:>9} {r.get('be_port_mbit', 0):>8.1f} "
                     f"{r.get('port_mbit', 0):>6.0f}{' ' if r.get('port_busy') else '!'}")
        if r.get("note") and r["note"] not in notes:
            notes.append(r["note"])
    if any(r.get("cpu_limited") for r in results):
        notes.append("* the machine's CPU could not offer what was asked "
                     "(gen_cpu_s, gen_in_send_s)")
    if any(not r.get("port_busy", True) for r in results):
        notes.append("! the port sent < 90 % of its rate: not saturated, no priority test")
    return "\n".join(lines + notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgt.tc_profiles.priority_check",
                                 description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.set_defaults(parser=ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rate", default="1gbit", help="port rate (default 1gbit)")
    ap.add_argument("--profile", default="htb-prio")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help=f"probe duration per case, 0 < S <= {MAX_PRIORITY_SECONDS}")
    ap.add_argument("--queue-bytes", type=int, default=None)
    ap.add_argument("--no-bulk", action="store_true", help="no bulk TCP (baseline)")
    ap.add_argument("--no-gso", action="store_true",
                    help="one UDP datagram per send (shows the CPU limit without GSO)")
    ap.add_argument("--cases", type=_cases, default=None, metavar="NAME:DSCP:MBIT,...",
                    help="default EF:46:200,EF:46:400,EF:46:600,CS1:8:300,CS1:8:600")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def _cases(text: str) -> tuple:
    """``--cases`` (:func:`parse_cases`). Raises ArgumentTypeError."""
    try:
        return parse_cases(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_flags(args) -> str:
    """Why the flags of a run cannot work ("" when they can): checked before root and
    before a testbed is built."""
    why = seconds_problem(args.seconds, MAX_PRIORITY_SECONDS)
    if why:
        return why
    if args.queue_bytes is not None and args.queue_bytes < 1500:
        return f"--queue-bytes must be >= 1500 (one packet), got {args.queue_bytes}"
    try:
        parse_rate(args.rate)
    except ValueError as e:
        return f"--rate: {e}"
    return ""


def _fail(args, msg: str) -> int:
    """One line on stderr, ``<prog>: error: <msg>`` (the CLI's form); returns 2."""
    parser = getattr(args, "parser", None)
    prog = parser.prog if parser is not None else "dgt testbed priority"
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    why = check_flags(args)
    if why:
        return _fail(args, why)
    if os.geteuid() != 0:
        return _fail(args, not_root("dgt testbed priority"))
    from shutil import which
    if not args.no_bulk and which("iperf3") is None:
        return _fail(args, "the priority check needs iperf3 for the bulk TCP; install it "
                           "(apt-get install iperf3) or use --no-bulk")
    try:
        cases = args.cases or DEFAULT_CASES
        res = priority_check(args.rate, args.seconds, args.profile, cases=cases,
                             bulk=not args.no_bulk, queue_bytes=args.queue_bytes,
                             gso=not args.no_gso)
    except (testbed.TestbedError, applier.TcError, ValueError) as e:
        return _fail(args, str(e).splitlines()[0] if str(e) else type(e).__name__)
    print(f"priority check: profile {args.profile}, port rate {args.rate}, "
          f"{'bulk TCP h1->h0' if not args.no_bulk else 'no bulk load'}, "
          f"UDP h2->h0 ({'GSO' if not args.no_gso else 'no GSO'}), "
          f"{args.seconds:g} s per case")
    print(render(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "profile": args.profile, "seconds": args.seconds,
                       "bulk": not args.no_bulk, "gso": not args.no_gso,
                       "cases": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
