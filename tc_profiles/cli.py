"""``dgt tc`` and ``dgt testbed``: argparse subcommands for the main ``dgt`` CLI.

``register(subparsers)`` adds both; each leaf parser sets ``func=handler(args) -> int``
and ``parser`` (itself). Errors print one line to stderr, ``<prog>: error: <message>``
(e.g. ``dgt testbed up: error: --hosts must be >= 1, got 0``), and return 2; never a
traceback. Not root is one line from :mod:`.needs_root`, which says only what that
subcommand offers instead.

Ctrl-C is not caught here: the ``KeyboardInterrupt`` reaches ``dgt.cli``, which prints
``<prog>: interrupted[; what was undone]`` (the exception's argument, given where the
cleanup ran, e.g. testbed.up) and exits 128 + the signal. The subcommands that change
state (``tc apply``, ``tc clear``, ``testbed up``, ``down``, ``load``, ``priority``) set
``owns_cleanup``: ``dgt.cli`` then turns SIGTERM and SIGHUP into Ctrl-C for them too
(dgt.interrupt, which this layer may not import), so a killed ``testbed up`` removes its
half-built testbed. From a command's commit point on (:func:`.stopping.hold_stop_signals`:
``tc apply``'s last netlink message, ``up`` once it has said what it built, ``clear``'s
and ``down``'s start, ``load`` once measured) the stop signals are blocked: it
completes and exits 0, never "applied" and 130.
``testbed exec`` becomes its command (``ip netns exec``): a signal is the command's.

Every ``dgt testbed`` subcommand that takes ``--prefix`` checks it before anything else
(``priority`` builds a testbed of its own, named by its pid, and takes none). A flag
value that does not parse (``--loss-dscp abc``) is argparse's error, naming the flag
and what it takes.

Example::

    ap = argparse.ArgumentParser(prog="dgt")
    sub = ap.add_subparsers(dest="command", required=True)
    dgt.tc_profiles.cli.register(sub)
    args = ap.parse_args()
    sys.exit(args.func(args))
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from . import names
from .bounds import MAX_LOAD_SECONDS, seconds_problem
from .lazy import OnFirstUse
from .needs_root import not_root
from .schema import ProfileError, list_profiles, load_profile
from .stopping import hold_stop_signals

applier = OnFirstUse(".applier")   # pyroute2: loaded by the commands that use it
testbed = OnFirstUse(".testbed")


def _command(args) -> str:
    """The subcommand as ``dgt`` words (``dgt testbed up``), whatever the parser's prog."""
    words = [getattr(args, k, None) for k in ("command", "tc_command", "testbed_command")]
    return " ".join(["dgt"] + [w for w in words if w])


def _prog(args) -> str:
    """The subcommand's name as its parser shows it (``dgt testbed up``)."""
    parser = getattr(args, "parser", None)
    return parser.prog if parser is not None else _command(args)


def _fail(args, msg: str) -> int:
    """One line on stderr in argparse's form, ``<prog>: error: <msg>``; returns 2."""
    print(f"{_prog(args)}: error: {msg}", file=sys.stderr)
    return 2


def _guard(fn):
    def handler(args) -> int:
        try:
            if getattr(args, "testbed_command", None) and hasattr(args, "prefix"):
                testbed.check_prefix(args.prefix, "--prefix")  # before anything is made
            return fn(args)
        except KeyboardInterrupt:   # first: the lazy names below would import pyroute2,
            raise                   # whose import it may have cut short (dgt.cli says it)
        except (ProfileError, applier.TcError, testbed.TestbedError, ValueError,
                IndexError, OSError) as e:
            return _fail(args, str(e).splitlines()[0] if str(e) else type(e).__name__)
    handler.__name__ = fn.__name__
    return handler


# ------------------------------------------------------------------------ tc


@_guard
def tc_apply(args) -> int:
    if args.dry_run:
        print("\n".join(applier.dry_run(args.profile, args.dev, args.netns, args.rate)))
        return 0
    if (rc := _root(args)) is not None:
        return rc
    # interrupted before the last netlink message: rolled back, 128 + the signal;
    # after it: applied, exit 0 (hold_stop_signals)
    p = applier.apply(args.profile, args.dev, args.netns, args.rate, force=args.force,
                      before_commit=hold_stop_signals)
    print(f"applied profile '{p.name}' on {args.dev}"
          + (f" (netns {args.netns})" if args.netns else ""))
    for warning in p.tcp_queue_warnings():
        print(f"{_prog(args)}: warning: {warning}", file=sys.stderr)
    return 0


@_guard
def tc_show(args) -> int:
    if args.netns and (rc := _root(args)) is not None:
        return rc
    state = applier.show(args.dev, args.netns)
    print(json.dumps(state, indent=2) if args.json else applier.render_table(state))
    return 0


@_guard
def tc_clear(args) -> int:
    if (rc := _root(args)) is not None:
        return rc
    # its commit point is its start, as down's: a stop signal before it, nothing
    # cleared (128 + the signal); once it clears, it says so and exits 0 (a signal
    # meanwhile gave 130 after "cleared DEV", or SIGTERM killed it without a word:
    # re-check of breaker round 14)
    hold_stop_signals()
    done = applier.clear(args.dev, args.netns, force=args.force)
    print(f"cleared {args.dev}" if done else f"nothing of ours on {args.dev}")
    return 0


@_guard
def tc_list(args) -> int:
    for name in list_profiles():
        p = load_profile(name)
        rate = f" {p.rate_bit / 1e6:g} Mbit/s" if p.rate_bit else ""
        print(f"{name:<12} {p.root_kind}{rate}, {len(p.bands)} bands, "
              f"qdiscs {','.join(p.qdisc_kinds())}: {p.description}")
    return 0


# ------------------------------------------------------------------- testbed


def _root(args) -> int | None:
    """None as root; else the subcommand's own not-root line (needs_root) and 2."""
    return None if os.geteuid() == 0 else _fail(args, not_root(_command(args)))


def _index(text: str) -> bool:
    """Whether ``text`` is a host index: ASCII digits only."""
    return text.isascii() and text.isdecimal()


def dscp_list(text: str) -> tuple[int, ...]:
    """``--loss-dscp``: DSCPs 0..63, comma-separated. Raises ArgumentTypeError."""
    items = [x.strip() for x in text.split(",")]
    if not all(_index(x) and int(x) <= 63 for x in items):
        raise argparse.ArgumentTypeError(f"give DSCPs 0..63, comma-separated (e.g. "
                                         f"34,18,10), got {text!r}")
    return tuple(int(x) for x in items)


def host_pairs(text: str) -> list[tuple[int, int]]:
    """``--pairs``: ``src:dst`` host indexes, comma-separated. Raises
    ArgumentTypeError."""
    pairs = [tuple(x.strip() for x in item.split(":")) for item in text.split(",")]
    if not all(len(p) == 2 and _index(p[0]) and _index(p[1]) for p in pairs):
        raise argparse.ArgumentTypeError(f"give src:dst host indexes, comma-separated "
                                         f"(e.g. 0:1,1:0), got {text!r}")
    same = [f"{a}:{b}" for a, b in pairs if int(a) == int(b)]
    if same:   # its traffic never leaves the host: it crosses no shaped port
        raise argparse.ArgumentTypeError(f"pair {same[0]} is a host to itself; give "
                                         f"two hosts, src:dst (e.g. 0:1)")
    return [(int(a), int(b)) for a, b in pairs]


@_guard
def tb_up(args) -> int:
    if args.hosts < 1:
        return _fail(args, f"--hosts must be >= 1, got {args.hosts}")
    if args.loss_deprecated is not None:
        print(f"{args.parser.prog}: warning: --loss is deprecated, use --loss-pct (the "
              f"same percent)", file=sys.stderr)
        args.loss_pct = args.loss_deprecated
    if not (math.isfinite(args.loss_pct) and 0 <= args.loss_pct <= 100):
        return _fail(args, f"--loss-pct must be a percentage 0..100, got {args.loss_pct}")
    if args.queue_bytes is not None and args.queue_bytes < 1500:
        return _fail(args, f"--queue-bytes must be >= 1500 (one packet), got "
                           f"{args.queue_bytes}")
    try:   # every flag is checked before root: a bad one is named whoever runs it
        testbed.parse_rate(args.rate)
    except ValueError as e:
        return _fail(args, f"--rate: {e}")
    if (rc := _root(args)) is not None:
        return rc
    started = time.time()
    try:
        tb = testbed.up(args.hosts, rate=args.rate, profile=args.profile,
                        queue_bytes=args.queue_bytes, loss_pct=args.loss_pct,
                        loss_dscp=args.loss_dscp,
                        prefix=args.prefix, tcp_congestion=args.tcp_congestion)
        print(f"testbed up: {tb.hosts} hosts, {tb.rate}, profile {tb.profile}, TCP "
              f"{tb.tcp_congestion or 'as this machine'}"
              + (f", loss {tb.loss_pct:g} %" if tb.loss_pct else ""))
        for i in range(tb.hosts):
            print(f"  host {i}: netns {tb.host_netns(i)}  addr {tb.host_addr(i)}")
        sys.stdout.flush()   # here, where a stop signal still removes the testbed
        hold_stop_signals()  # one that came meanwhile raises here; later ones: exit 0
    except KeyboardInterrupt as e:
        # stopped after the testbed was built (while it was said, or a blocked stdout):
        # an interrupted 'up' leaves nothing, as one stopped half-way does (breaker 7:
        # exit 130 with the testbed up). testbed.up removed a half-built one itself and
        # said so in the exception's argument.
        if e.args or not testbed.built_since(args.prefix, started):
            raise
        testbed.down(args.prefix)
        raise KeyboardInterrupt(f"the testbed '{args.prefix}' was removed") from None
    return 0


@_guard
def tb_down(args) -> int:
    if (rc := _root(args)) is not None:
        return rc
    # its commit point is its start: a stop signal before it, nothing removed (128 +
    # the signal); once it removes, it removes it all, says so and exits 0 (a signal
    # meanwhile gave 130 or 143 after "removed 3 namespaces", or killed it half-way
    # without a word: breaker round 14's re-check)
    hold_stop_signals()
    gone = testbed.down(args.prefix)
    print(f"removed {len(gone)} namespaces" + (f": {' '.join(gone)}" if gone else ""))
    return 0


@_guard
def tb_status(args) -> int:
    if (rc := _root(args)) is not None:
        return rc
    st = testbed.status(args.prefix)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print("\n\n".join(applier.render_table(s) for s in st.values()))
    return 0


EXEC_USAGE = "dgt testbed exec HOST [--prefix P] -- CMD ..."


def exec_split(rest: list[str]) -> tuple[dict, list[str]]:
    """What follows HOST in ``dgt testbed exec HOST ...`` -> (options, command).

    The first word decides: one that starts with '-' begins options (``--prefix P``,
    ``--prefix=P``, ``-h``), which run to the first ``--``, and the command is what
    follows that; any other word begins the command, which runs to the end (``exec 0
    ping -c1 10.77.1.2``, as before). Before, ``exec 0 --prefix P -- CMD`` ran
    ``--prefix P -- CMD`` in the default testbed's host 0 (an outside tester). Returns
    options as {"prefix": P} and/or {"help": True}. Raises ValueError, one line, for
    any other option, or options with no ``--`` after them."""
    if not rest[:1] or not rest[0].startswith("-"):
        return {}, rest
    end = rest.index("--") if "--" in rest else len(rest)
    words, cmd = rest[:end], rest[end + 1:]
    opts, it = {}, iter(words)
    for w in it:
        if w in ("-h", "--help"):
            opts["help"] = True
        elif w == "--prefix":
            opts["prefix"] = next(it, None)
            if opts["prefix"] is None:
                raise ValueError(f"--prefix after HOST needs a value: {EXEC_USAGE}")
        elif w.startswith("--prefix="):
            opts["prefix"] = w[len("--prefix="):]
        elif end == len(rest) and not w.startswith("-"):
            raise ValueError(f"no `--` before the command {w!r}: {EXEC_USAGE}")
        else:
            raise ValueError(f"{w!r} after HOST: only --prefix P goes between HOST and "
                             f"`--`, the command after it: {EXEC_USAGE}")
    if end == len(rest) and not opts.get("help"):
        raise ValueError(f"no `--` and no command after the options: {EXEC_USAGE}")
    return opts, cmd


@_guard
def tb_exec(args) -> int:
    opts, cmd = exec_split(args.cmd)
    if opts.get("help"):
        args.parser.print_help()
        return 0
    if "prefix" in opts:   # after HOST, as before it: checked before anything else
        args.prefix = names.check_prefix(opts["prefix"], "--prefix")
    if (rc := _root(args)) is not None:
        return rc
    if not cmd:
        return _fail(args, f"give a command: {EXEC_USAGE}")
    if not _index(args.host):   # a namespace's name says its testbed
        named = names.prefix_of(args.host)
        if named is None:
            return _fail(args, f"'{args.host}' is neither a host index nor a testbed "
                               f"namespace (<prefix>-h<i>, <prefix>-sw)")
        if args.prefix not in (names.DEFAULT_PREFIX, named):
            return _fail(args, f"'{args.host}' is a namespace of testbed '{named}', not "
                               f"of --prefix {args.prefix}")
        args.prefix = named
    tb = testbed.current(args.prefix)
    if tb is None:
        return _fail(args, f"no testbed with prefix '{args.prefix}' is up; run "
                           f"`dgt testbed up`")
    host = int(args.host) if _index(args.host) else args.host
    tb._need_ip()
    # become the command (as 'ip netns exec' itself does): a signal reaches it, not a
    # parent whose death would leave it running in the host, and its exit status, a
    # signal's included (143 for SIGTERM), is this command's
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("ip", ["ip", "netns", "exec", tb._ns(host), *cmd])


@_guard
def tb_load(args) -> int:
    why = seconds_problem(args.seconds, MAX_LOAD_SECONDS)
    if why:
        return _fail(args, why)
    if (rc := _root(args)) is not None:
        return rc
    tb = testbed.current(args.prefix)
    if tb is None:
        return _fail(args, f"no testbed with prefix '{args.prefix}' is up; run "
                           f"`dgt testbed up`")
    try:
        loads = tb.load(args.seconds, args.pairs)
        hold_stop_signals()   # measured: from here it is said in full, exit 0
    except KeyboardInterrupt:   # bulk_tcp stopped its senders and receivers
        raise KeyboardInterrupt("the bulk TCP was stopped") from None
    for r in loads:
        print(f"h{r['src']} -> h{r['dst']}: {r['mbit_s']:.1f} Mbit/s")
    return 0


@_guard
def tb_priority(args) -> int:
    from . import priority_check
    return priority_check.run(args)


def register(subparsers) -> None:
    """Add ``tc`` and ``testbed`` to the main CLI's subparsers (argparse)."""
    tc = subparsers.add_parser("tc", help="apply, show and clear tc profiles (DSCP bands)")
    tcs = tc.add_subparsers(dest="tc_command", required=True)
    p = tcs.add_parser("apply", help="install a profile as the root qdisc of a device")
    p.add_argument("profile", help="profile name (see `dgt tc list`) or a YAML path")
    p.add_argument("--dev", required=True)
    p.add_argument("--netns", default=None)
    p.add_argument("--rate", default=None, help="link rate override, e.g. 950mbit")
    p.add_argument("--dry-run", action="store_true", help="print the tc commands only")
    p.add_argument("--force", action="store_true",
                   help="replace a root qdisc that is not dgt's nor the kernel's default")
    p.set_defaults(func=tc_apply, parser=p, owns_cleanup=True)
    p = tcs.add_parser("show", help="qdiscs, classes, filters and counters of a device")
    p.add_argument("--dev", required=True)
    p.add_argument("--netns", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=tc_show, parser=p)
    p = tcs.add_parser("clear", help="remove our root qdisc from a device")
    p.add_argument("--dev", required=True)
    p.add_argument("--netns", default=None)
    p.add_argument("--force", action="store_true", help="delete any root qdisc")
    p.set_defaults(func=tc_clear, parser=p, owns_cleanup=True)   # SIGTERM: one line
    p = tcs.add_parser("list", help="shipped profiles")
    p.set_defaults(func=tc_list, parser=p)

    tb = subparsers.add_parser("testbed", help="netns star testbed with shaped ports")
    tbs = tb.add_subparsers(dest="testbed_command", required=True)

    def sub(name, help_, func, prefix=True, owns_cleanup=False):
        sp = tbs.add_parser(name, help=help_)
        if prefix:
            sp.add_argument("--prefix", default=names.DEFAULT_PREFIX,
                            help=f"the testbed's name prefix: namespaces <prefix>-sw, "
                                 f"<prefix>-h<i> (default {names.DEFAULT_PREFIX}; 1.."
                                 f"{names.MAX_PREFIX_LEN} letters, digits, '-', '_')")
        sp.set_defaults(func=func, parser=sp, owns_cleanup=owns_cleanup)
        return sp
    # owns_cleanup: SIGTERM and SIGHUP stop these as Ctrl-C does (see the module doc)
    p = sub("up", "build N hosts around a router; every port shaped", tb_up,
            owns_cleanup=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--profile", default="htb-prio")
    p.add_argument("--queue-bytes", type=int, default=None)
    p.add_argument("--tcp-congestion", default="cubic",
                   help="every namespace's default TCP congestion control (default cubic, "
                        "Linux's default; '' keeps this machine's)")
    p.add_argument("--loss-pct", type=float, default=0.0,
                   help="random loss in percent, 0..100 (nftables)")
    # the old spelling: still taken, with one deprecation line (names carry their unit)
    p.add_argument("--loss", type=float, dest="loss_deprecated", default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--loss-dscp", type=dscp_list, default=None, metavar="DSCP,...",
                   help="only these DSCPs, e.g. 34,18,10 (dgt's default UDP channels)")
    sub("down", "remove the testbed (found by name, also after a crash)", tb_down,
        owns_cleanup=True)
    p = sub("status", "per-port class counters", tb_status)
    p.add_argument("--json", action="store_true")
    p = sub("exec", f"run a command in a host: {EXEC_USAGE[12:]}", tb_exec)
    p.add_argument("host", help="host index, or a namespace's name (<prefix>-h<i>, "
                                "<prefix>-sw), which names its testbed: no --prefix needed")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub("load", "bulk best-effort TCP between hosts", tb_load, owns_cleanup=True)
    p.add_argument("--seconds", type=float, default=10.0,
                   help=f"how long, 0 < S <= {MAX_LOAD_SECONDS} (iperf3's limit); iperf3 "
                        f"runs whole seconds (rounded up)")
    p.add_argument("--pairs", type=host_pairs, default=None, metavar="SRC:DST,...",
                   help="host index pairs (default i -> i+1)")
    # its own testbed, named dgtpc<pid>, built and removed: a --prefix could name the
    # user's testbed, which 'up' would tear down first
    p = sub("priority", "measure EF/CS1 delivery under bulk load (own 3-host testbed)",
            tb_priority, prefix=False, owns_cleanup=True)
    from .priority_check import add_arguments
    add_arguments(p)


__all__ = ["register"]
