"""A star testbed of network namespaces: N hosts around one router, every port shaped.

Layout (prefix ``dgt``)::

    dgt-h0 [eth0 10.77.0.2/24] ---- [p0 10.77.0.1/24]
    dgt-h1 [eth0 10.77.1.2/24] ---- [p1 10.77.1.1/24]  dgt-sw (router, ip_forward=1)
    ...                              ...

Each host has a default route via its router port. Every port (the host's ``eth0`` and
the router's ``p<i>``) is a NIC shaped at ``rate`` with the tc profile applied on
egress, so the queue for traffic *to* host i forms on router port ``p<i>`` and the queue
for traffic *from* host i on its ``eth0``. Random loss, where the kernel has no netem,
is an nftables ``numgen random`` drop in the router's forward hook, optionally only for
some DSCPs. The addresses (10.77.0.0/16) exist only inside these namespaces.

Links, addresses, routes and tc go through pyroute2 netlink; nftables through
``nft -f -``; commands in a host through ``ip netns exec``.

Example::

    from dgt.tc_profiles import testbed
    tb = testbed.up(hosts=3, rate="1gbit", profile="htb-prio")
    try:
        tb.exec_in(0, ["ping", "-c1", tb.host_addr(1)])
    finally:
        testbed.down()
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import netns as _netns

from . import applier, system
from .bounds import MAX_LOAD_SECONDS, iperf_seconds, seconds_problem
from ._nl import create_netns, is_root, open_ipr
from .needs_root import not_root
from .plan import compile_profile
from .names import (DEFAULT_PREFIX, MAX_HOSTS, MAX_PREFIX_LEN, NAME_MAX, SUBNET,  # noqa: F401
                    PrefixError, TestbedError, check_prefix, host_addr, host_netns,
                    router_addr, router_netns, router_port, state_name)
from .schema import Profile, load_profile, parse_rate

log = logging.getLogger(__name__)

STATE_DIR = Path("/run/dgt")
HOST_DEV = "eth0"
NFT_TABLE = "dgt_testbed"
NOT_ROOT = f"the testbed {not_root('dgt testbed up')}"




def _state_file(prefix: str) -> Path:
    return STATE_DIR / state_name(prefix)


def built_since(prefix: str, t: float) -> bool:
    """Whether testbed ``prefix`` was built (its state file written, the last step of
    :func:`up`) at or after ``t`` (``time.time()`` seconds)."""
    try:
        return _state_file(prefix).stat().st_mtime >= t
    except OSError:
        return False


#: prefix -> [open lock file, depth]: the locks this process holds (up() calls down())
_held: dict[str, list] = {}


@contextlib.contextmanager
def _exclusive(prefix: str):
    """Hold ``/run/dgt/testbed-<prefix>.lock`` (flock(2), LOCK_EX) while a testbed of
    this prefix is built or removed, so that two commands on one prefix do not build
    the same namespaces at once (breaker round 7: two ``dgt testbed up --prefix P`` at
    once ended in tracebacks, ``LookupError: netns 'P-sw' does not exist``, ``[Errno
    17] File exists``, and a testbed of either size). Raises TestbedError naming the
    other process's pid; re-entrant within this process.

    The lock file goes when nothing of the prefix is left at the end (taken down, a
    build that failed, or a ``down`` of a prefix never built): it is unlinked while
    still locked, and a process that locked the unlinked file meanwhile sees that
    (:func:`_lock`) and locks the new one. An outside tester found 482 lock files,
    one per prefix ever used."""
    if prefix in _held:
        _held[prefix][1] += 1
        try:
            yield
        finally:
            _held[prefix][1] -= 1
        return
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    f = _lock(prefix)
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        _held[prefix] = [f, 1]
        try:
            yield
        finally:
            del _held[prefix]
            if not _our_netns(prefix):   # before the lock goes: no one else holds it
                with contextlib.suppress(FileNotFoundError):
                    _lock_path(prefix).unlink()
    finally:
        f.close()   # the lock goes with it


def _lock(prefix: str):
    """The prefix's lock file, open and locked (LOCK_EX), the one at its path now.

    flock(2) locks the open file, not the name: a holder that unlinks the file before
    it releases it (:func:`_exclusive`) lets a process that opened it before the unlink
    lock a file no one else will see. So after the lock, the file must still be the one
    at the path (same device and inode), else it is closed and the path opened again.
    Raises TestbedError (another process holds it, naming its pid)."""
    path = _lock_path(prefix)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read(20).strip() or "?"
            f.close()
            raise TestbedError(f"testbed {prefix} is being built or removed by another "
                               f"process (pid {pid}); wait for it to finish, or give "
                               f"another --prefix") from None
        if _same_file(f, path):
            return f
        f.close()


def _same_file(f, path: Path) -> bool:
    """Whether the open file ``f`` is the file at ``path`` now (not unlinked, not
    replaced)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _lock_path(prefix: str) -> Path:
    return STATE_DIR / (state_name(prefix)[:-len(".json")] + ".lock")


def taken_down(prefix: str, hosts: int) -> bool:
    """Whether testbed ``prefix`` lost what a job of ``hosts`` hosts runs on: fewer
    host namespaces than that, or another process removing or rebuilding it now (its
    lock held: ``dgt testbed down`` stops the processes in its namespaces before it
    removes them). Never raises."""
    try:
        if _short(prefix, hosts):
            return True
        try:
            f = open(_lock_path(prefix))   # read-only: never makes one
        except FileNotFoundError:   # it goes with its testbed: a 'down' just ended?
            return _short(prefix, hosts)
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return prefix not in _held
        return False
    except (OSError, ValueError):
        return False


def _short(prefix: str, hosts: int) -> bool:
    """Whether testbed ``prefix`` has fewer than ``hosts`` hosts now (none: not up)."""
    tb = current(prefix)
    return tb is None or tb.hosts < hosts


def _our_netns(prefix: str) -> list[str]:
    pat = re.compile(rf"^{re.escape(prefix)}-(sw|h\d+)$")
    return sorted(n for n in _netns.listnetns() if pat.match(n))


@dataclass
class Testbed:
    """A running testbed. Build one with :func:`up`; find one with :func:`current`."""
    hosts: int
    rate: str = "1gbit"
    profile: str = "htb-prio"
    prefix: str = DEFAULT_PREFIX
    queue_bytes: int | None = None
    loss_pct: float = 0.0
    loss_dscp: tuple[int, ...] | None = None
    tcp_congestion: str = "cubic"

    # ---------------------------------------------------------------- names
    def host_netns(self, i: int) -> str:
        """Netns of host ``i`` (0..hosts-1). Raises IndexError."""
        self._check(i)
        return host_netns(i, self.prefix)

    def host_addr(self, i: int) -> str:
        """IPv4 address of host ``i``. Raises IndexError."""
        self._check(i)
        return host_addr(i)

    @property
    def router(self) -> str:
        return router_netns(self.prefix)

    def ports(self) -> list[tuple[str, str]]:
        """Every shaped port as (netns, dev): hosts' eth0, then the router's p<i>."""
        return ([(self.host_netns(i), HOST_DEV) for i in range(self.hosts)]
                + [(self.router, router_port(i)) for i in range(self.hosts)])

    def queue_drops(self) -> dict[str, dict[str, int]]:
        """Packets every band's queue has dropped since the testbed came up, summed over
        the hosts' egress (``"host"``: eth0) and over the router's ports (``"router"``:
        p<i>), keyed by the band's lowest DSCP as a string (``"46"``: dgt's reliable
        channel; ``"0"``: best effort). Classes without a DSCP filter are left out.
        Raises TcError."""
        out: dict[str, dict[str, int]] = {"host": {}, "router": {}}
        for ns, dev in self.ports():
            side = out["router" if ns == self.router else "host"]
            for c in applier.show(dev, ns)["classes"]:
                if c["dscp"]:
                    key = str(min(c["dscp"]))
                    side[key] = side.get(key, 0) + c["stats"]["drops"]
        return out

    def _check(self, i: int) -> None:
        if not 0 <= int(i) < self.hosts:
            raise IndexError(f"host {i} is not in 0..{self.hosts - 1}")

    def _ns(self, host: int | str) -> str:
        if isinstance(host, str) and not (host.isascii() and host.isdigit()):
            if host not in ([self.router] + [self.host_netns(i) for i in range(self.hosts)]):
                raise TestbedError(f"'{host}' is not a namespace of this testbed")
            return host
        return self.host_netns(int(host))

    # ------------------------------------------------------------- running
    def _need_ip(self) -> None:
        if not system.have("ip"):
            raise TestbedError(system.missing_message("ip", "running a command in a host"))

    def exec_in(self, host: int | str, argv: list[str], timeout_s: float | None = None,
                check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``host`` (index or netns name), wait, capture text output."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        self._need_ip()
        return subprocess.run(["ip", "netns", "exec", self._ns(host), *argv],
                              timeout=timeout_s, check=check, **kw)

    def popen_in(self, host: int | str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in host ``host`` without waiting (the caller reaps it)."""
        self._need_ip()
        return subprocess.Popen(["ip", "netns", "exec", self._ns(host), *argv], **kw)

    def run_in(self, host: int | str, fn, *args, timeout_s: float = 60, **kwargs):
        """Call ``fn(*args, **kwargs)`` in a forked child inside host's netns; return its
        result (must pickle). Raises TestbedError with the child's error, or on timeout.
        """
        return run_in_netns(self._ns(host), fn, *args, timeout_s=timeout_s, **kwargs)

    def status(self) -> dict[str, dict]:
        """{"<netns>:<dev>": applier.show(...)} for every port: live class counters."""
        return {f"{ns}:{dev}": applier.show(dev, ns) for ns, dev in self.ports()}

    def load(self, seconds: float = 5, pairs: list[tuple[int, int]] | None = None,
             port_base: int = 5301) -> list[dict]:
        """Best-effort bulk TCP (DSCP 0) from src to dst for each pair, for ``seconds``.

        Default pairs: i -> (i+1) mod N. Uses iperf3 when installed (whole seconds:
        ``seconds`` is rounded up, as iperf3's ``-t`` takes an integer and runs for
        ever at 0), else a Python socket blaster. Returns [{src, dst, mbit_s}]
        (receiver goodput in Mbit/s). Raises TestbedError for ``seconds`` not in
        (0, MAX_LOAD_SECONDS] or a pair from a host to itself (its traffic never
        leaves the host, so crosses no shaped port), IndexError for a host not here.
        """
        why = seconds_problem(seconds, MAX_LOAD_SECONDS, "seconds")
        if why:
            raise TestbedError(why)
        if pairs is None:
            pairs = [(i, (i + 1) % self.hosts) for i in range(self.hosts)] \
                if self.hosts > 1 else []
        for s, d in pairs:
            self._check(s), self._check(d)
            if int(s) == int(d):
                raise TestbedError(f"pair {s}:{d} is a host to itself; give two hosts, "
                                   f"src:dst (its traffic would cross no shaped port)")
        return bulk_tcp(self, pairs, seconds, port_base)

    def down(self) -> None:
        down(self.prefix)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.down()


# ----------------------------------------------------------------- netns exec


def _child(ns, fn, args, kwargs, conn):
    try:
        _netns.setns(ns, flags=0)
        conn.send((True, fn(*args, **kwargs)))
    except BaseException as e:       # report anything, including SystemExit
        conn.send((False, f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_in_netns(ns: str, fn, *args, timeout_s: float = 60, **kwargs):
    """Call ``fn(*args, **kwargs)`` in a forked child that entered netns ``ns``.

    Returns the (picklable) result. Raises TestbedError with the child's error, or when
    it runs past ``timeout_s`` (the child is killed).
    """
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(ns, fn, args, kwargs, child), daemon=True)
    p.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TestbedError(f"{getattr(fn, '__name__', fn)} in netns {ns} ran past "
                               f"{timeout_s} s")
        ok, value = parent.recv()
    except EOFError:
        raise TestbedError(f"{getattr(fn, '__name__', fn)} in netns {ns} died") from None
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)
        parent.close()
    if not ok:
        raise TestbedError(f"in netns {ns}: {value}")
    return value


# ----------------------------------------------------------------------- up/down


def _profile_with_queue(profile: Profile, queue_bytes: int | None) -> Profile:
    if queue_bytes is None:
        return profile
    if queue_bytes < 1500:
        raise TestbedError(f"queue_bytes {queue_bytes} is below one 1500 B packet")
    if queue_bytes > 1 << 31:
        raise TestbedError(f"queue_bytes {queue_bytes} is above {1 << 31} (2 GiB)")
    bands = tuple(dataclasses.replace(b, limit_bytes=int(queue_bytes), limit_packets=None)
                  for b in profile.bands)
    return dataclasses.replace(profile, bands=bands)


def nft_loss_ruleset(loss_pct: float, loss_dscp=None) -> str:
    """nftables ruleset dropping ``loss_pct`` % of forwarded IPv4 packets at random.

    ``loss_dscp``: only packets with these DSCPs (any protocol); None = every packet.
    Resolution 0.0001 % (``numgen random mod 1000000``).
    """
    ppm = int(round(loss_pct * 10_000))
    match = ""
    if loss_dscp:
        match = "ip dscp { " + ", ".join(str(int(d)) for d in loss_dscp) + " } "
    rand = f"numgen random mod 1000000 < {ppm} " if ppm < 1_000_000 else ""
    return (f"table ip {NFT_TABLE} {{\n"
            f"  chain forward {{\n"
            f"    type filter hook forward priority 0; policy accept;\n"
            f"    {match}{rand}counter drop\n"
            f"  }}\n"
            f"}}\n")


def missing_tools(loss: bool) -> list[str]:
    """One line per system tool a testbed needs and this machine lacks
    (dgt.tc_profiles.system: each names its package): ``ip`` (commands in its hosts),
    and with ``loss`` ``nft`` (the drop rule). Also what ``dgt bench`` checks first."""
    need = [("ip", "the testbed (ip netns exec)")] + (
        [("nft", "--loss-pct (an nftables drop rule)")] if loss else [])
    return [system.missing_message(t, what) for t, what in need if not system.have(t)]


def up(hosts: int, rate: str = "1gbit", profile: str = "htb-prio",
       queue_bytes: int | None = None, loss_pct: float = 0.0, loss_dscp=None,
       prefix: str = DEFAULT_PREFIX, tcp_congestion: str = "cubic") -> Testbed:
    """Build the star testbed and return it (:func:`_up`), holding the prefix's lock: a
    second command on the same prefix meanwhile is refused (TestbedError)."""
    check_prefix(prefix)
    if not is_root():
        raise TestbedError(NOT_ROOT)
    with _exclusive(prefix):
        return _up(hosts, rate, profile, queue_bytes, loss_pct, loss_dscp, prefix,
                   tcp_congestion)


def _up(hosts: int, rate: str, profile: str, queue_bytes: int | None, loss_pct: float,
        loss_dscp, prefix: str, tcp_congestion: str) -> Testbed:
    """Build the star testbed and return it. An old testbed with the same prefix goes first.

    ``rate``: every port's shaped rate (tc notation). ``profile``: tc profile on every
    port. ``queue_bytes``: overrides every band's queue limit (bfifo, bytes).
    ``loss_pct``: random drop in the router (nftables numgen), only for ``loss_dscp``
    when given. ``tcp_congestion``: every namespace's default TCP congestion control
    (net.ipv4.tcp_congestion_control, one of tcp_available_congestion_control; "" keeps
    the machine's), so that every TCP flow on the testbed, the job's, gloo's and the
    tenant's, runs the same algorithm whatever this machine's default is (Linux's is
    cubic; docs/tc_profiles.md, "Congestion control").
    Raises TestbedError (not root, bad arguments, kernel lacks a qdisc the
    profile needs: nothing is created then); on a failure half-way, everything built
    is removed before the error is raised. Interrupted half-way (Ctrl-C, or a signal
    dgt.interrupt turns into it), the same, then KeyboardInterrupt saying so.
    """
    check_prefix(prefix)
    if not is_root():
        raise TestbedError(NOT_ROOT)
    if not 1 <= int(hosts) <= MAX_HOSTS:
        raise TestbedError(f"hosts must be 1..{MAX_HOSTS}, got {hosts}")
    if not 0 <= float(loss_pct) <= 100:
        raise TestbedError(f"loss_pct must be 0..100, got {loss_pct}")
    missing = missing_tools(loss=float(loss_pct) > 0)   # before anything is built
    if missing:
        raise TestbedError("; ".join(missing))
    try:
        rate_bit = parse_rate(rate)
        prof = _profile_with_queue(load_profile(profile), queue_bytes)
        applier.check_kernel(prof)  # first: a missing qdisc says which profile to use
        compile_profile(prof, rate_bit)  # every value fits its netlink field
    except (ValueError, applier.TcError) as e:
        raise TestbedError(str(e)) from None
    if tcp_congestion and tcp_congestion not in available_congestion_controls():
        raise TestbedError(f"TCP congestion control '{tcp_congestion}' is not available "
                           f"here (net.ipv4.tcp_available_congestion_control: "
                           f"{' '.join(available_congestion_controls())}); pick one of "
                           f"those, or load its module (modprobe tcp_{tcp_congestion})")
    if loss_dscp is not None:
        loss_dscp = tuple(int(d) for d in loss_dscp)
        if any(not 0 <= d <= 63 for d in loss_dscp):
            raise TestbedError(f"loss_dscp values must be 0..63, got {loss_dscp}")
    tb = Testbed(int(hosts), str(rate), prof.name, prefix, queue_bytes, float(loss_pct),
                 loss_dscp, tcp_congestion or "")
    try:
        down(prefix)   # an old one of this name; inside: interrupted, it goes all the same
        _build(tb, prof)
    except BaseException as e:
        down(prefix)
        if isinstance(e, KeyboardInterrupt):   # what was undone, for the one line
            raise KeyboardInterrupt(f"the half-built testbed '{prefix}' was removed") \
                from None
        raise
    return tb


def _build(tb: Testbed, prof: Profile) -> None:
    t0 = time.monotonic()
    names = [tb.router] + [tb.host_netns(i) for i in range(tb.hosts)]
    for n in names:
        create_netns(n)
    with open_ipr(tb.router) as sw:
        sw.link("set", index=sw.link_lookup(ifname="lo")[0], state="up")
        for i in range(tb.hosts):
            port, hns = router_port(i), tb.host_netns(i)
            sw.link("add", ifname=port, kind="veth", peer={"ifname": f"t{i}"})
            peer = sw.link_lookup(ifname=f"t{i}")[0]
            sw.link("set", index=peer, net_ns_fd=hns)
            pidx = sw.link_lookup(ifname=port)[0]
            sw.addr("add", index=pidx, address=router_addr(i), prefixlen=24)
            sw.link("set", index=pidx, state="up")
            with open_ipr(hns) as h:
                h.link("set", index=h.link_lookup(ifname="lo")[0], state="up")
                idx = h.link_lookup(ifname=f"t{i}")[0]
                h.link("set", index=idx, ifname=HOST_DEV)
                h.addr("add", index=idx, address=host_addr(i), prefixlen=24)
                h.link("set", index=idx, state="up")
                h.route("add", dst="0.0.0.0/0", gateway=router_addr(i))
    _sysctl(tb.router, "net/ipv4/ip_forward", "1")
    if tb.tcp_congestion:
        allow_congestion_control(tb.tcp_congestion)
        for n in names:
            _sysctl(n, "net/ipv4/tcp_congestion_control", tb.tcp_congestion)
    for ns, dev in tb.ports():
        applier.apply(prof, dev, ns, rate=tb.rate)
    if tb.loss_pct > 0:   # nft is there: up() checked (missing_tools)
        r = subprocess.run(["ip", "netns", "exec", tb.router, "nft", "-f", "-"],
                           input=nft_loss_ruleset(tb.loss_pct, tb.loss_dscp), text=True,
                           capture_output=True)
        if r.returncode != 0:
            err = [ln for ln in r.stderr.splitlines() if "Error" in ln] or [r.stderr.strip()]
            raise TestbedError(f"nft refused the loss rule: {err[0]}")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _state_file(tb.prefix).write_text(json.dumps(dataclasses.asdict(tb)))
    log.info("testbed %s up: %d hosts, %s, profile %s, %.1f s", tb.prefix, tb.hosts,
             tb.rate, tb.profile, time.monotonic() - t0)


ALLOWED_CC = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


def allow_congestion_control(name: str) -> bool:
    """Add ``name`` to this (the initial) namespace's
    net.ipv4.tcp_allowed_congestion_control when it is not there; True if it was added.

    Linux lets a network namespace other than the initial one take as its default only
    an *allowed* algorithm (EPERM otherwise, even for root: tcp_cong.c,
    tcp_set_default_congestion_control). The allowed list starts as the boot default and
    reno, so on a machine that boots with bbr, cubic is available but not allowed, and
    no testbed namespace could run it. Adding it changes no default: only which
    algorithms unprivileged sockets may pick. Raises TestbedError when the list cannot
    be read or written."""
    try:
        with open(ALLOWED_CC) as f:
            allowed = f.read().split()
        if name in allowed:
            return False
        _write(ALLOWED_CC, " ".join(allowed + [name]))
    except OSError as e:
        raise TestbedError(f"cannot allow TCP congestion control '{name}' for the "
                           f"testbed's namespaces ({ALLOWED_CC}: {e.strerror}); pass "
                           f"--tcp-congestion '' to keep this machine's default") from None
    log.warning("added %s to net.ipv4.tcp_allowed_congestion_control (was: %s), so that "
                "the testbed's namespaces can run it", name, " ".join(allowed))
    return True


def available_congestion_controls() -> list[str]:
    """The TCP congestion controls this kernel has loaded
    (net.ipv4.tcp_available_congestion_control); [] where unreadable."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _sysctl(ns: str, key: str, value: str) -> None:
    run_in_netns(ns, _write, f"/proc/sys/{key}", value, timeout_s=10)


def current(prefix: str = DEFAULT_PREFIX) -> Testbed | None:
    """The testbed with this prefix that exists now, or None (found by its namespaces).
    Raises PrefixError for a prefix no testbed can have."""
    nss = _our_netns(check_prefix(prefix))
    if router_netns(prefix) not in nss:
        return None
    hosts = sum(1 for n in nss if n != router_netns(prefix))
    try:
        d = json.loads(_state_file(prefix).read_text())
        if d.get("hosts") == hosts:
            d["loss_dscp"] = tuple(d["loss_dscp"]) if d.get("loss_dscp") else None
            return Testbed(**d)
    except (OSError, ValueError, TypeError):
        pass
    return Testbed(hosts=hosts, prefix=prefix, profile="?", rate="?")


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace of the testbed with this prefix, and what lives in them.

    Works after a crash: the namespaces are found by name (``<prefix>-sw``,
    ``<prefix>-h<i>``). Processes still running inside them are stopped first, so the
    namespaces (and their veths) really go. Returns the namespaces removed.
    Raises PrefixError for a prefix no testbed can have (nothing is touched).
    """
    check_prefix(prefix)
    if not is_root():
        raise TestbedError(NOT_ROOT)
    with _exclusive(prefix):
        return _down(prefix)


def _down(prefix: str) -> list[str]:
    nss = _our_netns(prefix)
    for ns in nss:
        _kill_netns_pids(ns)
    for ns in nss:
        try:
            _netns.remove(ns)
        except OSError as e:
            log.warning("cannot remove netns %s: %s", ns, e)
    try:
        _state_file(prefix).unlink()
    except FileNotFoundError:
        pass
    return nss


def _netns_pids(ns: str) -> list[int]:
    """Processes in the named network namespace ``ns``: those whose /proc/PID/ns/net is
    the file ``ip netns`` bound under /run/netns (what ``ip netns pids`` reads; done
    here, so taking a testbed down needs no ``ip`` binary)."""
    try:
        want = os.stat(os.path.join("/run/netns", ns))
    except OSError:
        return []
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{name}/ns/net")
        except OSError:   # gone meanwhile, or a kernel thread
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            pids.append(int(name))
    return pids


def _kill_netns_pids(ns: str) -> None:
    pids = _netns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for p in pids:
            try:
                os.kill(p, sig)
                alive.append(p)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def status(prefix: str = DEFAULT_PREFIX) -> dict[str, dict]:
    """Per-port tc state (class counters) of the running testbed. Raises TestbedError."""
    tb = current(prefix)
    if tb is None:
        raise TestbedError(f"no testbed with prefix '{prefix}' is up; run `dgt testbed up`")
    return tb.status()


def exec_in(host: int | str, argv: list[str], prefix: str = DEFAULT_PREFIX,
            **kw) -> subprocess.CompletedProcess:
    """Run ``argv`` in host ``host`` of the running testbed (see Testbed.exec_in)."""
    tb = current(prefix)
    if tb is None:
        raise TestbedError(f"no testbed with prefix '{prefix}' is up; run `dgt testbed up`")
    return tb.exec_in(host, argv, **kw)


# -------------------------------------------------------------------- bulk load


def _have_iperf3() -> bool:
    from shutil import which
    return which("iperf3") is not None


def bulk_tcp(tb: Testbed, pairs, seconds: float, port_base: int = 5301) -> list[dict]:
    """Bulk TCP for each (src, dst) pair for ``seconds`` (s, checked by
    :meth:`Testbed.load`); receiver goodput in Mbit/s."""
    if not pairs:
        return []
    if not _have_iperf3():
        return [dict(src=s, dst=d, mbit_s=tb.run_in(
            d, _py_bulk_pair, tb.host_netns(s), host_addr(d), port_base + k, seconds,
            timeout_s=seconds + 30)) for k, (s, d) in enumerate(pairs)]
    servers, clients = [], []
    try:
        for k, (s, d) in enumerate(pairs):
            servers.append(tb.popen_in(d, ["iperf3", "-s", "-1", "-p", str(port_base + k),
                                           "-B", host_addr(d)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_listen(tb, pairs, port_base)
        whole = iperf_seconds(seconds)
        for k, (s, d) in enumerate(pairs):
            clients.append(tb.popen_in(s, ["iperf3", "-c", host_addr(d), "-p",
                                           str(port_base + k), "-t", str(whole), "-J"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True))
        out = []
        for (s, d), c in zip(pairs, clients):
            try:
                text, _ = c.communicate(timeout=whole + 15)
                j = json.loads(text)
                bits_per_s = j["end"]["sum_received"]["bits_per_second"]
            except (subprocess.TimeoutExpired, ValueError, KeyError):
                bits_per_s = 0.0
            out.append(dict(src=s, dst=d, mbit_s=round(bits_per_s / 1e6, 1)))
        return out
    finally:
        for p in servers + clients:
            if p.poll() is None:
                p.kill()
            p.wait()


def _wait_listen(tb: Testbed, pairs, port_base: int, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    for k, (s, d) in enumerate(pairs):
        while time.monotonic() < deadline:
            r = tb.exec_in(d, ["ss", "-Htln", f"sport = :{port_base + k}"])
            if r.stdout.strip():
                break
            time.sleep(0.05)


def _py_bulk_pair(src_ns: str, addr: str, port: int, seconds: float) -> float:
    """Fallback without iperf3: a receiver here, a sender forked into ``src_ns``."""
    import socket
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, port))
    ls.listen(1)
    pid = os.fork()
    if pid == 0:
        try:
            _netns.setns(src_ns, flags=0)
            c = socket.create_connection((addr, port))
            buf = b"\0" * (1 << 20)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                c.sendall(buf)
            c.close()
        finally:
            os._exit(0)
    conn, _ = ls.accept()
    n, t0 = 0, time.monotonic()
    while True:
        b = conn.recv(1 << 20)
        if not b:
            break
        n += len(b)
    dt = time.monotonic() - t0
    os.waitpid(pid, 0)
    return round(n * 8 / dt / 1e6, 1) if dt > 0 else 0.0


__all__ = ["MAX_PREFIX_LEN", "PrefixError", "Testbed", "TestbedError", "check_prefix",
           "current", "down", "exec_in", "host_addr", "host_netns", "nft_loss_ruleset",
           "run_in_netns", "status", "up"]
