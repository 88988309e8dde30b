"""``dgt capture``, ``dgt pcap summary`` and ``dgt replay``.

The main CLI (``dgt.cli``) calls :func:`register` with its subparsers; each subcommand
sets ``func(args) -> int``. Failures print one line to stderr and return 2; they never
show a traceback.

Example::

    import argparse
    from dgt.tools import cli
    p = argparse.ArgumentParser(prog="dgt")
    cli.register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["pcap", "summary", "run.pcap"])
    raise SystemExit(args.func(args))
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from pathlib import Path

from dgt import outpath
from dgt.config import whole
from dgt.interrupt import interrupted, received_name, stop_on_signals

log = logging.getLogger("dgt.tools")


def _add_port_args(p: argparse.ArgumentParser, required: bool = False,
                   layout: bool = True) -> None:
    g = p.add_argument_group("which ports are dgt (pick one; default: any port, "
                             "recognised by the magic number)" if not required else
                             "which ports to capture (pick one)")
    m = g.add_mutually_exclusive_group(required=required)
    m.add_argument("--ports", metavar="LIST",
                   help="TCP and UDP ports, e.g. 47000-47040,5000")
    m.add_argument("--report", metavar="REPORT.json",
                   help="a 'dgt train' report; its 'sidecars' table gives the ports")
    if not layout:
        p.set_defaults(layout_base=None)
        return
    m.add_argument("--base-port", type=port, metavar="B", dest="layout_base",
                   help="the job's --base-port: rank r uses TCP B+10r, UDP B+10r+c")
    g.add_argument("--ranks", type=int, default=2,
                   help="with --base-port: number of ranks")
    g.add_argument("--udp-channels", type=int, default=3,
                   help="with --base-port: UDP channels per rank")


def _port_spec(args, required: bool = False, report=None):
    """The ports to decode as dgt: --ports, else --report's sidecars table (``report``:
    that file's document, when the caller has read it already), else --base-port's
    layout; None when none is given (unless ``required``). Raises PortSpecError."""
    from dgt.tools import ports
    if args.ports:
        return ports.from_ports(args.ports)
    if args.report:
        if report is None:
            return ports.from_report(args.report)
        return ports.from_sidecars(ports.sidecars_from_doc(report, args.report))
    if args.layout_base is not None:
        if args.ranks < 1:
            raise ports.PortSpecError(f"--ranks must be >= 1, got {args.ranks}")
        if not 1 <= args.udp_channels <= 7:
            raise ports.PortSpecError(f"--udp-channels must be 1..7, got {args.udp_channels}")
        return ports.from_base_port(args.layout_base, args.ranks, args.udp_channels)
    if required:
        raise ports.PortSpecError("give --ports, --report or --base-port")
    return None


def _positive(flag: str, value, integer: bool = False) -> None:
    """Raise ValueError unless ``value`` (when given) is finite and > 0 (``integer``:
    >= 1)."""
    if value is None:
        return
    if integer:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    elif not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a finite number > 0, got {value}")


#: what each output flag writes (dgt.outpath), --json and the like: JSON
_KIND = {"-w": "pcap", "--plot": "png"}


def check_output(flag: str, path: str | None) -> None:
    """The output-path policy of every command (``-w``, ``--json``, ``--plot``),
    checked before any work: the path must not be a folder, its folder must exist (it
    is not created: a typo must not make folders, as root anywhere), and the file must
    really be writable there: it is opened for writing (created and removed again when
    new; an existing file is neither truncated nor changed), so a read-only file
    system, a folder the user cannot write, or a place no file can be made (``/proc``)
    fails here, not after the work; and an existing file must hold what the flag
    writes (dgt.outpath: JSON, a PNG, a pcap), so a typo never replaces another
    file. None: the flag was not given. Raises ValueError, one line: ``cannot write
    PATH (FLAG): why``, or ``FLAG is empty; ...`` for "" (breaker round 25: ``-w ''``
    was "cannot write .: Is a directory; 0 packets ... were written", as if a capture
    had started)."""
    if path is None:
        return
    if not path:
        raise ValueError(f"{flag} is empty; give a file name")
    p = Path(path)

    def bad(why: str) -> ValueError:
        return ValueError(f"cannot write {path} ({flag}): {why}")
    if p.is_dir():
        raise bad("is a folder, give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise bad(f"{parent} is not a folder")
    try:
        _probe_writable(p)
    except FileNotFoundError as e:   # in /proc, a file cannot be made where one is not
        raise bad(f"{e.strerror} (" + (f"no file can be made in {parent}"
                                        if parent.is_dir() else f"no folder {parent}")
                  + ")") from None
    except NotADirectoryError as e:
        raise bad(f"{e.strerror} (a part of {parent} is not a folder)") from None
    except OSError as e:
        raise bad(e.strerror or str(e)) from None
    why = outpath.refusal(path, _KIND.get(flag, "json"))
    if why is not None:
        raise bad(why)


def _probe_writable(p: Path) -> None:
    """Open ``p`` for writing the way the command will, and undo it. Raises OSError."""
    import errno
    import stat
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # a FIFO or a device: opening may block (a pipe waits for its reader) or have
        # effects, so only the permission is checked; write errors come later
        if not os.access(p, os.W_OK):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(p))
        return
    if st is not None:
        os.close(os.open(p, os.O_WRONLY | os.O_APPEND))    # no O_TRUNC: left as it is
        return
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:   # made meanwhile, or a dangling symlink: the writer decides
        return
    os.close(fd)
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


_SESSION_RE = re.compile(r"^(0x)?[0-9a-fA-F]{1,16}$")


def parse_session(text: str, where: str = "--session") -> int:
    """A session id: up to 16 hex digits (as the report and the summary print it,
    e.g. 3f2a9c0d11e4b7a8). Raises ValueError (one line)."""
    t = str(text).strip()
    if not _SESSION_RE.match(t):
        raise ValueError(f"bad {where} {text!r}: a session id is 16 hex digits, "
                         f"e.g. 3f2a9c0d11e4b7a8")
    return int(t, 16)


#: seconds between dgt capture's progress lines when stderr is not a terminal
LOG_EVERY_S_NOT_TTY = 30.0


def _logging(quiet: bool = False) -> None:
    """dgt's own INFO lines (not with ``quiet``) and every library's warnings on stderr;
    not the libraries' INFO (matplotlib's "generated new fontManager", …)."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
        logging.getLogger("dgt").setLevel(logging.WARNING if quiet else logging.INFO)
    elif quiet:
        logging.getLogger("dgt").setLevel(logging.WARNING)


def _guard(fn):
    """Run a handler: known errors and OS errors become one line on stderr, exit 2."""
    def run(args) -> int:
        from dgt.tools.capture import CaptureError
        from dgt.tools.dissect import PcapError
        from dgt.tools.ports import PortSpecError
        from dgt.tools.replay import ReplayError
        try:
            return fn(args)
        except (CaptureError, PcapError, PortSpecError, ReplayError, ValueError) as e:
            print(f"dgt {args.command}: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            where = f" ({e.filename})" if getattr(e, "filename", None) else ""
            print(f"dgt {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return interrupted(f"dgt {args.command}")
    run.__name__ = fn.__name__
    return run


# ---------------------------------------------------------------------------------------

@_guard
def cmd_capture(args) -> int:
    from dgt.tools import capture, ports
    _logging(args.quiet)
    _positive("--seconds", args.seconds)
    _positive("--file-mb", args.file_mb)
    _positive("--count", args.count, integer=True)
    _positive("--ring", args.ring, integer=True)
    spec = _port_spec(args, required=True)
    # the file the capture opens first (with --file-mb: OUT.00001.pcap), tried before
    # the socket: a path that cannot be written is an error before capturing starts
    check_output("-w", args.write and (str(capture.ring_file(args.write, 1))
                                       if args.file_mb else args.write))
    check_output("--json", args.json)
    cfg = capture.CaptureConfig(
        out=args.write, ports=spec, interface=args.interface, netns=args.netns,
        seconds=args.seconds, count=args.count, ring=args.ring, file_mb=args.file_mb,
        channels=ports.parse_channels(args.channel) if args.channel else None,
        # a line a second on a terminal; in a log file (nohup, CI) one in 30 s
        log_every_s=1.0 if sys.stderr.isatty() else LOG_EVERY_S_NOT_TTY)
    # SIGTERM and SIGHUP stop it as Ctrl-C does, its documented end: the file is
    # completed and the stats printed (exit 0, as tcpdump's: what was recorded is the
    # result; "stopped by" names the signal)
    stop_on_signals()
    st = capture.run_capture(cfg)
    if st.stopped_by == "interrupt":
        st.stopped_by = received_name()
    print(capture.format_stats(st))
    if args.json:
        from dgt.tools import output
        output.write_json(args.json, "--json", st.as_dict())
    return 0


@_guard
def cmd_pcap_summary(args) -> int:
    from dgt.tools import ports, summary
    _logging()
    rep = ports.read_report(args.report) if args.report else None   # read once
    spec = _port_spec(args, report=rep)   # with --report: its sidecars table, checked
    check_output("--json", args.json)
    check_output("--plot", args.plot)
    sessions = ([parse_session(x) for x in args.session.split(",")]
                if args.session else None)
    if sessions is None and rep is not None:
        # with --ports the table was not checked: rows that are no object say nothing
        rows = rep.get("sidecars") if isinstance(rep, dict) else rep
        found = {parse_session(r["session"], f"session in {args.report}")
                 for r in (rows if isinstance(rows, list) else [])
                 if isinstance(r, dict) and r.get("session")}
        sessions = sorted(found) or None
    s = summary.summarize(args.files, spec, sessions)
    print(summary.format_table(s))
    if rep is not None:
        if isinstance(rep, dict) and rep.get("channels"):
            cmp = summary.compare_with_report(s, rep)
            s["report_comparison"] = {k: {"blocks": list(v["blocks"]),
                                          "bytes": list(v["bytes"]), "match": v["match"]}
                                      for k, v in cmp.items()}
            print("\ncapture vs report (blocks, bytes):")
            for k, v in cmp.items():
                print(f"  {k:6s} blocks {v['blocks'][0]} / {v['blocks'][1]}  bytes "
                      f"{v['bytes'][0]} / {v['bytes'][1]}  {'match' if v['match'] else 'DIFFER'}")
    if args.json:
        summary.write_json(s, args.json)
    if args.plot:
        summary.plot(s, args.plot)
        print(f"plot: {args.plot}")
    return 0


@_guard
def cmd_replay(args) -> int:
    from dgt.tools import ports, replay
    _logging(args.quiet)
    rate_pps = rate_mbit = None
    if args.rate:
        rate_pps, rate_mbit = replay.parse_rate(args.rate)
    _positive("--speed", args.speed)
    check_output("--json", args.json)
    _check_host("--to", args.to)
    cfg = replay.ReplayConfig(
        files=args.files, to_host=args.to, port_map=replay.parse_port_map(args.port_map),
        base_port=args.to_base_port, from_base_port=args.from_base_port,
        ports=_port_spec(args),
        iterations=replay.parse_iterations(args.iterations) if args.iterations else None,
        channels=set(ports.parse_channels(args.channels)) if args.channels else None,
        control=not args.no_control, speed=args.speed, rate_pps=rate_pps,
        rate_mbit=rate_mbit, keep_dscp=not args.no_dscp)
    sc = replay.scan(cfg)   # a first streaming pass: nothing is held in memory
    info = sc.info
    if not sc.messages:
        raise replay.ReplayError("nothing to send: no dgt messages pass the filters "
                                 f"(skipped {info['skipped']}); check --ports/--iterations/--channels")
    for t in info.get("truncated", ()):
        from dgt.tools.summary import truncation_text
        log.warning("%s; replaying the records before it", truncation_text(t))
    replay.check_schedule([sc.last_offset(cfg.speed, rate_pps, rate_mbit)])
    if args.dry_run:
        offs = replay.Offsets(speed=cfg.speed, rate_pps=rate_pps, rate_mbit=rate_mbit)
        for it in replay.iter_items(cfg, sc.from_base_port, dirs=sc.directions):
            h = it.header
            print(f"{offs.next(it):10.6f}  {it.proto}  {it.dst}:{it.dport}  {h.type!s:>2} "
                  f"ch={h.channel} it={h.iteration} {len(it.data)} B")
        if args.json:   # what would be sent: the scan's counts, nothing sent
            from dgt.tools import output
            output.write_json(args.json, "--json",
                              {"dry_run": True, "messages": sc.messages, **info},
                              default=str)
        return 0
    log.info("replaying %d messages from %s", sc.messages, ", ".join(args.files))
    rep = replay.replay(cfg, progress=lambda i, n: log.info("sent %d / %d", i, n),
                        scanned=sc)
    rep.update(info)
    print(replay.format_report(rep))
    if args.json:
        from dgt.tools import output
        output.write_json(args.json, "--json", rep)
    # A receiver that closes a stray session's connection (EPIPE/ECONNRESET), or a job
    # that ended mid-replay, is counted under send errors and the replay goes on; only
    # a replay that delivered nothing is a failure. Datagrams are never confirmed, so
    # when every TCP connection was refused nothing is known to have arrived either.
    failures = rep.get("tcp_connect_failures", [])
    if failures and not rep["tcp_connections"]:
        print(f"dgt replay: error: {failures[0]}; no TCP connection could be made "
              f"({len(failures)} refused); is the receiver listening? check "
              f"--to/--port-map", file=sys.stderr)
        return 2
    if rep["send_errors"] and not rep["totals"]["messages"]:
        print(f"dgt replay: error: nothing was delivered; send errors "
              f"{rep['send_errors']}", file=sys.stderr)
        return 2
    if failures:
        print(f"dgt replay: warning: {len(failures)} TCP connection(s) refused "
              f"(first: {failures[0]}); their messages are counted under send errors",
              file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------

def cmd_bench(args) -> int:
    from dgt.tools import bench
    logging.basicConfig(level=logging.WARNING)
    return bench.cmd_bench(args)


def port(text: str) -> int:
    """argparse type: a TCP/UDP port, 1..65535. Raises argparse.ArgumentTypeError."""
    try:
        value = whole(text)
    except ValueError:   # dgt.config.NotPlainNumber included
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 1..65535, got {text!r}")
    return value


def _check_host(flag: str, host: str) -> None:
    """``host`` must be an address or a name that resolves (no ``host:port``: ports
    come from the capture and the port flags). Raises ValueError naming the flag."""
    import ipaddress

    from dgt.rendezvous import check_resolves
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if ":" in host:
        raise ValueError(f"{flag} {host!r} is not an address; give a host only "
                         f"(ports come from the capture, --to-base-port or --port-map)")
    check_resolves(host, flag, "give the destination's name or address")


def register(subparsers) -> None:
    """Add ``capture``, ``pcap`` (``summary``), ``replay`` and ``bench`` to the ``dgt``
    CLI."""
    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = subparsers.add_parser(
        "bench", help="benchmark dgt against gloo all_reduce on the testbed (root)",
        description="Run gloo all_reduce and dgt --mode tcp/topk/dgt on the same shaped "
                    "netns testbed (built and removed by this command; root) under the "
                    "clean, tenant and lossy scenarios, at each --rates rate; write "
                    "results.json, README.md and plots to --out. 'dgt bench goodput': "
                    "dgt's reliable channel vs iperf3 through one port. --loopback: no "
                    "testbed, no root (the overhead check).")
    from dgt.tools.bench import add_arguments as _bench_args
    _bench_args(p)
    p.set_defaults(func=cmd_bench, owns_cleanup=True)

    p = subparsers.add_parser(
        "capture", formatter_class=fmt,
        help="record dgt traffic to pcap (root)",
        description="Record the dgt ports of an interface to pcap, streamed to disk, "
                    "bounded by --seconds and/or --count (else until Ctrl-C). Needs root.")
    p.add_argument("-w", "--write", default="dgt.pcap", metavar="OUT.pcap",
                   help="output file; with --file-mb: OUT.00001.pcap, ...")
    p.add_argument("-i", "--interface", default="lo", help="interface to capture on")
    p.add_argument("--netns", help="capture inside this network namespace (ip netns name)")
    _add_port_args(p, required=True)
    p.add_argument("--channel", metavar="LIST",
                   help="only these channels, e.g. 0,2 (0 = tcp)")
    p.add_argument("--seconds", type=float, help="stop after this many seconds")
    p.add_argument("--count", type=int, help="stop after this many packets")
    p.add_argument("--file-mb", type=float, help="rotate files at this size (MB)")
    p.add_argument("--ring", type=int, metavar="N",
                   help="keep only the newest N files (needs --file-mb)")
    p.add_argument("--json", metavar="OUT.json", help="write the capture stats as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_capture, owns_cleanup=True)

    p = subparsers.add_parser("pcap", help="analyse dgt captures",
                              description="Analyse dgt captures.")
    sub = p.add_subparsers(dest="pcap_command", metavar="{summary}", required=True)
    s = sub.add_parser(
        "summary", formatter_class=fmt, help="per-channel totals, DSCP, loss, late, timeline",
        description="Per channel: BLOCKS messages, blocks, bytes (message bytes), DSCP "
                    "seen, loss inferred from END counts, late arrivals (after the PULL), "
                    "undecodable packets, and a per-iteration timeline. With --report, "
                    "also compares the totals with the report's channel counters.")
    s.add_argument("files", nargs="+", metavar="FILE", help="pcap file(s), in order")
    _add_port_args(s)
    s.add_argument("--session", metavar="HEX[,HEX]",
                   help="only these session ids (default: the report's, else all)")
    s.add_argument("--json", metavar="OUT.json", help="write the summary as JSON")
    s.add_argument("--plot", metavar="OUT.png", help="draw timeline and channel shares")
    s.set_defaults(func=cmd_pcap_summary, command="pcap summary")

    p = subparsers.add_parser(
        "replay", formatter_class=fmt, help="re-send captured dgt messages",
        description="Re-send the dgt datagrams and TCP frames of a capture: UDP as "
                    "datagrams, TCP over a fresh connection per captured connection "
                    "(client-to-server direction only). Original timing by default.")
    p.add_argument("files", nargs="+", metavar="FILE", help="pcap file(s), in order")
    p.add_argument("--to", required=True, metavar="HOST", help="destination host")
    p.add_argument("--port-map", default="", metavar="OLD:NEW,...",
                   help="rewrite destination ports")
    p.add_argument("--base-port", type=port, metavar="B", dest="to_base_port",
                   help="map ports by base: B + (port - FROM_BASE_PORT)")
    p.add_argument("--from-base-port", type=port, metavar="A",
                   help="the captured job's base port (default: lowest captured server port)")
    _add_port_args(p, layout=False)
    p.add_argument("--iterations", metavar="A-B", help="only these iterations (inclusive)")
    p.add_argument("--channels", metavar="LIST", help="only BLOCKS of these channels, e.g. 1,2")
    p.add_argument("--no-control", action="store_true",
                   help="send BLOCKS only (no HELLO/END/PULL/BYE)")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--speed", type=float, default=1.0, help="original timing, F times faster")
    t.add_argument("--rate", metavar="R", help="fixed rate: e.g. 1000pps or 50Mbit")
    p.add_argument("--no-dscp", action="store_true", help="do not re-mark with captured DSCP")
    p.add_argument("--dry-run", action="store_true", help="print the schedule, send nothing")
    p.add_argument("--json", metavar="OUT.json", help="write the replay report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_replay)


def standalone(command: str | None = None, argv=None) -> int:
    """Run these subcommands without the main CLI (``python -m dgt.tools.capture``)."""
    parser = argparse.ArgumentParser(prog="dgt")
    register(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    if command:
        argv = [command] + argv
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(standalone())
