"""Rendezvous through ``torch.distributed.TCPStore`` (rank 0's sidecar hosts it, in a
process of its own: dgt.store_host; every rank, rank 0 too, is a client).

Waits poll the store instead of blocking in ``get`` so that a failure anywhere in the
job (published under ``dgt/failed``) ends every wait at once with the failed rank named,
and so that no wait outlives ``timeout_s``. All methods block: call them from a thread
(``loop.run_in_executor``), never on the event loop.

The store has no login, and any process that reaches it can list, read, write and delete
its keys (TCPStore ``list_keys``, ``set``, ``delete_key``). So every value a rank acts on
is checked before use (``check``: its type and schema; a malformed one is counted in
``rejected["store_rejected"]``, logged once, and treated as absent), and with a job
secret (``--secret``) a key's name is derived from the secret and the job
(:func:`key_name`) and its value carries a keyed BLAKE2b-128 tag over name and value
(:func:`seal`), so that a stranger can neither find, forge nor move a value.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import time
from collections import Counter
from datetime import timedelta
from typing import Callable

from .errors import PeerFailure
from .failure import FailureReason
from .jsonparse import loads
from .rank_list import rank_list
from .transport.reasons import Reason
from .transport.wire import mac_tag

FAILED = "dgt/failed"
#: counter key of a store value that failed its check (tag or schema)
STORE_REJECTED = Reason.STORE_REJECTED.value
#: counter key of a value of this rank's own that another process deleted or changed,
#: written again (Rendezvous._heal)
STORE_REWRITTEN = Reason.STORE_REWRITTEN.value
#: a failure record's message is cut to this many characters (one line)
MESSAGE_CHARS = 500
log = logging.getLogger("dgt.rendezvous")
POLL_S = 0.05
#: s: how often a sidecar waiting for its own trainer (no store wait of its own under
#: way) polls the store for the job's failure (Rendezvous.job_failure)
WATCH_S = 4 * POLL_S
#: s: how long rank 0 keeps the store up after publishing its own failure: a few polls
#: of every wait (POLL_S), two of a waiting sidecar's watch (WATCH_S)
LINGER_S = 2 * WATCH_S + POLL_S
#: a wait looks whether this rank's own values are still in the store (Rendezvous._heal)
#: every this many polls: once per WATCH_S
HEAL_EVERY = round(WATCH_S / POLL_S)
#: s: a rank's first connection to the store, which tells a service that is not one
#: (Rendezvous._probe_store)
PROBE_S = 3.0
#: torch's C++ logging is ERROR-only in our processes, and never prints C++ stack frames
#: (set before torch is imported: the launcher puts it in its children's environment)
QUIET_TORCH_ENV = {"TORCH_CPP_LOG_LEVEL": "FATAL", "TORCH_SHOW_CPP_STACKTRACES": "0"}


def check_resolves(host: str, flag: str = "--master-addr",
                   hint: str = "give the name or address of rank 0's node") -> None:
    """Raise ValueError at once when ``host`` (given by ``flag``) does not resolve,
    instead of letting the store retry a name that will never connect (getaddrinfo(3)).
    The message names the flag and ends with ``hint``."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ValueError(f"{flag} {host} does not resolve ({why}); {hint}") from None


def process_age_s() -> float:
    """Seconds since this process started (proc(5): /proc/self/stat starttime against
    /proc/uptime); 0.0 where /proc is not readable."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return max(0.0, up - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def overloaded() -> str:
    """``"; or ... overloaded ..."`` when this machine's 1-minute load average exceeds
    twice its CPUs (start-up is then slow, not dead: breaker round 10 saw rank 0 named
    dead under 33 starting processes on 2 CPUs), else ``""``."""
    try:
        load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except OSError:
        return ""
    if load <= 2 * cpus:
        return ""
    return (f"; or it is slow: this machine is overloaded (load average {load:.1f} on "
            f"{cpus} CPUs), so start fewer processes or raise --peer-timeout-s")


def connected_to_itself(sock: socket.socket) -> bool:
    """True when ``sock``, a connected TCP socket, is connected to itself: on one host, a
    connect to a port with no listener in the ephemeral range can pick that very port
    as its source, and TCP's simultaneous open then connects it to itself. That is no
    listener (a store not up yet), whatever connect() said."""
    return sock.getsockname() == sock.getpeername()


def wait_for_listener(host: str, port: int, timeout_s: float,
                      bound_s: float | None = None) -> None:
    """Poll until ``host:port`` accepts a TCP connection; raise PeerFailure (rank 0)
    after ``timeout_s`` (the message names ``bound_s``, the whole wait since start-up). A plain connect, so that a store that is not up yet costs no
    TCPStore retry loop (which overshoots its timeout and prints C++ frames)."""
    t_end = time.monotonic() + timeout_s
    while True:
        left = t_end - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))) \
                    as s:
                if not connected_to_itself(s):
                    return
                raise ConnectionRefusedError(111, "no listener (connected to itself)")
        except OSError as e:
            if time.monotonic() >= t_end:
                raise PeerFailure(f"rendezvous store at {host}:{port} did not come up within "
                                  f"{bound_s or timeout_s:.0f} s of start-up ({e.strerror or e}); start rank 0's "
                                  f"sidecar, with the same --master-addr/--master-port", 0,
                                  FailureReason.STORE_LOST) \
                    from None
        time.sleep(min(4 * POLL_S, max(0.0, t_end - time.monotonic())))


def key_name(key: bytes | None, scope: str, logical: str) -> str:
    """The store key of ``logical`` (``dgt/ep/1``): itself without a secret ``key``;
    with one, ``dgt/`` and 16 hex digits of a keyed BLAKE2b-128 of ``scope`` (the job and
    the store's port) and ``logical``, so that only a job member can name it."""
    if key is None:
        return logical
    return "dgt/" + mac_tag(key, f"dgt-store-name\0{scope}\0{logical}".encode()).hex()[:16]


def seal(key: bytes | None, name: str, value: str) -> str:
    """``value`` as stored under ``name``: with a secret ``key``, prefixed by the hex
    keyed BLAKE2b-128 tag of the name and the value and a ``:``; else as it is."""
    if key is None:
        return value
    return mac_tag(key, f"dgt-store-value\0{name}\0{value}".encode()).hex() + ":" + value


def unseal(key: bytes | None, name: str, raw: bytes) -> str:
    """The value :func:`seal` stored under ``name``. Raises ValueError when ``raw`` is
    not UTF-8 or (with a ``key``) its tag is missing or wrong."""
    text = raw.decode("utf-8")          # UnicodeDecodeError is a ValueError
    if key is None:
        return text
    tag, sep, value = text.partition(":")
    if not sep or not hmac.compare_digest(tag, seal(key, name, value).partition(":")[0]):
        raise ValueError("bad or missing MAC")
    return value


def failure_record(world: int
                   ) -> Callable[[str, str], tuple[str, int | None, int | None]]:
    """The check of ``dgt/failed``: ``{"message": str, "rank": int in [0, world) or
    null, "by": the same, optional}`` -> (the message's first line, at most
    MESSAGE_CHARS, the rank it blames, the rank that published it or None)."""
    def is_rank(r) -> bool:
        return r is None or type(r) is int and 0 <= r < world

    def check(_key: str, text: str) -> tuple[str, int | None, int | None]:
        info = loads(text)
        message, rank, by = info["message"], info.get("rank"), info.get("by")
        if not isinstance(message, str) or not message.strip() or not (
                is_rank(rank) and is_rank(by)):
            raise ValueError("not a failure record")
        return message.strip().splitlines()[0][:MESSAGE_CHARS], rank, by
    return check


def _rank_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


class Rendezvous:
    def __init__(self, host: str, port: int, world: int, rank: int, timeout_s: float,
                 listen_fd: int = -1, secret: str = "", job: str = "",
                 rejected: Counter | None = None, answer_s: float | None = None):
        """``listen_fd`` (rank 0): a listening socket to host the store on, passed down
        by the launcher, which bound it, so no other process can take the port between
        its choice and the bind (TCPStore's ``master_listen_fd``); -1: bind ``port``.
        ``secret`` (``--secret``; "": none) names and tags every key (:func:`key_name`,
        :func:`seal`) within ``job``; ``rejected``: where a value that fails its check is
        counted (``store_rejected``). ``answer_s`` (default ``timeout_s``): how long one
        look at the store (:meth:`_call`) may take before rank 0 counts as frozen."""
        self.host, self.port, self.world, self.rank = host, port, world, rank
        self.answer_s = timeout_s if answer_s is None else answer_s
        self._stuck: PeerFailure | None = None   # a look that never came back
        self.timeout_s = timeout_s
        self.listen_fd = listen_fd
        self.key = secret.encode() if secret else None
        self.scope = f"{job}\0{port}"
        self.rejected = rejected if rejected is not None else Counter()
        self._seen_bad: set[tuple[str, bytes]] = set()   # each bad value counted once
        self._check_failed = failure_record(world)
        self._mine: dict[str, str] = {}   # logical key -> the sealed value this rank set
        self._healed: set[str] = set()    # keys whose rewrite was logged
        self.host_process = None   # rank 0: the store's process (dgt.store_host)
        try:
            self.store = self._connect(is_master=rank == 0)
        except BaseException:   # no one holds this object to close() it: stop the store
            self.close()
            raise

    def _connect(self, is_master: bool):
        from torch.distributed import TCPStore
        if is_master:
            self._start_host()
        else:   # bounded by timeout_s from our start (imports included), whatever
            # TCPStore's own retries would do
            wait_for_listener(self.host, self.port,
                              max(1.0, self.timeout_s - process_age_s()), self.timeout_s)
        return self._bounded(lambda: self._connect_store(TCPStore))

    def _start_host(self) -> None:
        """Rank 0: the store's server in a process of its own (dgt.store_host), on the
        listening socket we were given or bind here, so that a connection flood on the
        store port cannot use up this sidecar's descriptors. Raises PeerFailure."""
        from . import store_host
        fd = self.listen_fd
        if fd < 0:
            own = self._listen()
            fd = own.detach() if own is not None else -1
        try:
            self.host_process = store_host.start(fd, self.host, self.port, self.world,
                                                 self.timeout_s)
        except OSError as e:
            raise PeerFailure(f"cannot start the rendezvous store's process: "
                              f"{os.strerror(e.errno) if e.errno else e}", None) from None
        finally:
            if fd >= 0:   # the store's process holds the port from now on
                os.close(fd)
            self.listen_fd = -1
        try:
            self.host_process.wait_ready(max(self.timeout_s, store_host.START_S))
        except store_host.StoreHostError as e:
            if "EADDRINUSE" in str(e):   # TCPStore bound the port itself (see _listen)
                raise PeerFailure(f"--master-port {self.port} is in use on this host (the "
                                  f"store listens on every interface, --master-addr "
                                  f"{self.host} being none of its addresses); pick "
                                  f"another port (or stop what holds it)", None) from None
            raise PeerFailure(f"rendezvous store at {self.host}:{self.port} did not start: "
                              f"{e}", None, FailureReason.STORE_LOST) from None

    def _host_ended(self) -> str:
        """On rank 0, how the store's process ended (breaker round 7: killed alone, it
        read as rank 0 gone, in rank 0's own log too); "" while it runs, and on the
        other ranks."""
        how = self.host_process.ended() if self.host_process is not None else None
        return f"its process, pid {self.host_process.pid}, {how}" if how else ""

    def close(self) -> None:
        """Rank 0: stop the store's process (the others' stores are only clients)."""
        if self.host_process is not None:
            self.host_process.close()

    def _bounded(self, connect):
        """``connect()`` within what is left of timeout_s since start-up. A rank 0 that
        is frozen (SIGSTOP, a hung host) still has its listening socket accept in the
        kernel, and TCPStore's handshake then waits forever whatever its timeout; so
        the wait runs in a daemon thread and ends here naming rank 0."""
        import threading
        out: dict = {}

        def run():
            try:
                out["store"] = connect()
            except BaseException as e:   # handed to the caller's thread
                out["error"] = e
        t = threading.Thread(target=run, name="dgt-store-connect", daemon=True)
        t.start()
        t.join(max(1.0, self.timeout_s - process_age_s()))
        if "error" in out:
            raise out["error"]
        if "store" not in out:
            raise PeerFailure(f"rank 0 stopped answering (dead or frozen): its rendezvous "
                              f"store at {self.host}:{self.port} accepts connections but "
                              f"did not answer within {self.timeout_s:.0f} s of start-up"
                              + overloaded(), 0, FailureReason.PEER_SILENT, [0])
        return out["store"]

    def _connect_store(self, TCPStore):
        store = self._probe_store(TCPStore)
        if store is not None:
            return store
        try:
            return TCPStore(self.host, self.port, self.world, is_master=False,
                            timeout=timedelta(seconds=self.timeout_s),
                            wait_for_workers=False)
        except Exception as e:  # DistStoreError / RuntimeError: one line for the user
            raise PeerFailure(f"rendezvous store at {self.host}:{self.port} unreachable: "
                              f"{str(e).splitlines()[0]}", 0,
                              FailureReason.STORE_LOST) from None

    def _probe_store(self, TCPStore):
        """A first connection with a short timeout (PROBE_S), so that a service at
        ``host:port`` that is not a TCPStore is named as such at once: TCPStore's client
        retries a wrong reply to its ping until its whole timeout, which outlasts
        :meth:`_bounded`'s wait and would read as rank 0 frozen. Returns the store (its
        timeout then raised to timeout_s), or None when the probe only timed out (rank
        0 still starting: the caller connects again with the whole timeout). Raises
        PeerFailure when the reply is not a store's."""
        try:
            store = TCPStore(self.host, self.port, self.world, is_master=False,
                             timeout=timedelta(seconds=PROBE_S), wait_for_workers=False)
        except Exception as e:
            if "ping failed" not in str(e).lower():
                return None
            raise PeerFailure(f"{self.host}:{self.port} answers, but not as dgt's "
                              f"rendezvous store (its reply to a store's ping was "
                              f"something else): --master-addr and --master-port must "
                              f"name rank 0's store; another service holds this one",
                              0, FailureReason.STORE_LOST) from None
        store.set_timeout(timedelta(seconds=self.timeout_s))
        return store

    def _listen(self):
        """Rank 0: a listening socket on ``host:port`` only. Left to itself TCPStore
        listens on every interface, and the store is unauthenticated: it hands the
        session id to anyone who asks. None when ``host`` is not an address of this
        host (behind NAT, say): TCPStore then binds every interface, with a warning.
        Raises PeerFailure when the port is taken or this user may not bind it (a port
        below 1024 without root)."""
        import errno
        import logging
        import socket
        try:
            return socket.create_server((self.host, self.port), backlog=1024,
                                        family=socket.AF_INET6 if ":" in self.host
                                        else socket.AF_INET)
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)   # not Python's long strerror
            if e.errno == errno.EADDRINUSE:
                raise PeerFailure(f"--master-port {self.port} is in use on {self.host}; "
                                  f"pick another port (or stop what holds it)", None) from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PeerFailure(f"--master-port {self.port} on {self.host}: "
                                  f"{why} (ports below 1024 need root); "
                                  f"pick a port from 1024 up", None) from None
            if e.errno != errno.EADDRNOTAVAIL and not isinstance(e, socket.gaierror):
                raise PeerFailure(f"--master-addr {self.host} --master-port {self.port}: "
                                  f"cannot listen there: {why}",
                                  None) from None
            logging.getLogger("dgt.rendezvous").warning(
                "--master-addr %s is not an address of this host (%s); the rendezvous "
                "store listens on every interface (it has no login: give the job a "
                "--secret where the network is not yours)", self.host, e.strerror)
            return None

    def _call(self, op: Callable[[], object]):
        """``op()``, one look at the store, bounded by ``answer_s``. A rank 0 that is
        frozen (SIGSTOP, a hung host) keeps its connections open and never answers, and
        TCPStore's client then waits for ever whatever its timeout; so (on rank 0 too:
        the store runs in a process of its own, dgt.store_host) the look runs in a
        daemon thread of its own (a stuck one holds up no
        executor's shutdown nor the interpreter's exit), and past ``answer_s`` this
        raises PeerFailure (STORE_LOST) naming rank 0, as does every later look."""
        if self._stuck is not None:
            raise self._stuck
        import threading
        out: dict = {}
        done = threading.Event()

        def run():
            try:
                out["value"] = op()
            except BaseException as e:   # handed to the caller's thread
                out["error"] = e
            finally:
                done.set()
        threading.Thread(target=run, name="dgt-store-look", daemon=True).start()
        if not done.wait(self.answer_s):
            self._stuck = PeerFailure(
                f"the rendezvous store at {self.host}:{self.port} (rank 0) did not answer "
                f"within {self.answer_s:.0f} s (rank 0 frozen or its host unreachable)",
                0, FailureReason.STORE_LOST, [0])
            raise self._stuck
        if "error" in out:
            raise out["error"]
        return out["value"]

    def name(self, logical: str) -> str:
        """The store key of ``logical`` (:func:`key_name`)."""
        return key_name(self.key, self.scope, logical)

    def set(self, key: str, value: str) -> None:
        """Store ``value`` under the logical ``key`` (named and sealed with the secret).
        It is this rank's own from then on: written again if another process deletes or
        changes it (:meth:`_heal`)."""
        name = self.name(key)
        sealed = seal(self.key, name, value)
        self._mine[key] = sealed
        try:
            self._call(lambda: self.store.set(name, sealed))
        except PeerFailure:
            raise
        except Exception as e:
            lost = self._host_ended() or "rank 0 died?"
            raise PeerFailure(f"rendezvous store lost ({lost}): "
                              f"{str(e).splitlines()[0]}", 0,
                              FailureReason.STORE_LOST) from None

    def _heal(self) -> None:
        """Write again each value this rank set (:meth:`set`) that the store no longer
        holds as set: deleted or changed by another process (the store has no login).
        A peer waits for this rank's values, and one deleted after it was written
        stalled that wait until its bound, which then blamed this live rank (breaker
        round 6). Counted in ``rejected["store_rewritten"]``, logged once per key. Runs
        at every watch of a wait (:meth:`wait`) and of :meth:`job_failure`."""
        for logical, sealed in list(self._mine.items()):
            name = self.name(logical)
            raw = self._call(lambda: self.store.get(name) if self.store.check([name])
                             else None)
            if raw == sealed.encode():
                continue
            self._call(lambda: self.store.set(name, sealed))
            self.rejected[STORE_REWRITTEN] += 1
            if logical not in self._healed:
                self._healed.add(logical)
                log.warning("rank %d: rendezvous store value of %r %s by another process; "
                            "written again (%s)", self.rank, logical,
                            "deleted" if raw is None else "changed", STORE_REWRITTEN)

    def gather(self, prefix: str, check: Callable[[str, str], object],
               first_cause: str = "") -> dict[int, object]:
        """Wait until every rank has set ``prefix/<rank>`` to a value that passes
        ``check`` (``check(key, text)`` returns the parsed value, raises ValueError,
        TypeError or KeyError); return rank -> parsed value. Raises PeerFailure naming a
        failed rank, or the ranks missing at the timeout (``first_cause``: the usual
        reason a rank has not reached this step, said first, e.g. "its trainer has not
        registered")."""
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        got = self.wait(keys, check, first_cause)
        return {_rank_of(k): got[k] for k in keys}

    def _read(self, logical: str, check: Callable[[str, str], object]):
        """(True, parsed value) when ``logical`` is set and passes ``check``, (False,
        None) when absent or rejected (counted once per distinct bad value)."""
        name = self.name(logical)
        raw = self._call(lambda: self.store.get(name) if self.store.check([name]) else None)
        if raw is None:
            return False, None
        try:
            return True, check(logical, unseal(self.key, name, raw))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            if (logical, raw) not in self._seen_bad:
                self._seen_bad.add((logical, raw))
                self.rejected[STORE_REJECTED] += 1
                log.warning("rank %d: rendezvous store value of %r rejected (%s); another "
                            "process wrote to the store", self.rank, logical,
                            str(e).splitlines()[0][:80] if str(e) else type(e).__name__)
            return False, None

    def wait(self, keys: list[str], check: Callable[[str, str], object],
             first_cause: str = "") -> dict[str, object]:
        """Wait until every logical key of ``keys`` holds a value that passes ``check``;
        return key -> parsed value. A valid failure record (``dgt/failed``) ends the
        wait with PeerFailure naming its rank; at ``timeout_s``, PeerFailure naming the
        ranks whose keys are absent, or nobody when a rejected value was seen (another
        process wrote to the store)."""
        t_end = time.monotonic() + self.timeout_s
        got: dict[str, object] = {}
        polls = 0
        while True:
            try:
                if polls % HEAL_EVERY == 0:
                    self._heal()
                polls += 1
                ok, info = self._read(FAILED, self._check_failed)
                if ok:
                    raise PeerFailure(info[0], info[1], FailureReason.PEER_REPORTED)
                for k in keys:
                    if k not in got:
                        ok, value = self._read(k, check)
                        if ok:
                            got[k] = value
                if len(got) == len(keys):
                    return got
            except PeerFailure:
                raise
            except Exception as e:
                lost = self._host_ended() or "rank 0 died?"
                raise PeerFailure(f"rendezvous store lost ({lost}): "
                                  f"{str(e).splitlines()[0]}", 0,
                                  FailureReason.STORE_LOST) from None
            if time.monotonic() > t_end:
                ranks = [_rank_of(k) for k in keys if k not in got]
                step = keys[0].rsplit("/", 1)[0]
                bad = sorted({_rank_of(k) for k, _ in self._seen_bad if k in keys})
                if bad:
                    raise PeerFailure(
                        f"rendezvous step '{step}' did not complete within "
                        f"{self.timeout_s:.0f} s: the store held rejected values for "
                        f"rank(s) {rank_list(bad)} ({STORE_REJECTED}), written by another process; "
                        f"run with --secret, or keep other users off --master-port "
                        f"{self.port}", None, FailureReason.OTHER, [])
                if self.rejected[STORE_REWRITTEN]:   # breaker round 7: a deleting
                    # stranger's stall blamed a live rank, a different one each run
                    raise PeerFailure(
                        f"rendezvous step '{step}' did not complete within "
                        f"{self.timeout_s:.0f} s, the values of rank(s) "
                        f"{rank_list(ranks)} missing: another process kept deleting or "
                        f"changing values in the store (this rank wrote its own again "
                        f"{self.rejected[STORE_REWRITTEN]} times, {STORE_REWRITTEN}), so "
                        f"their absence blames nobody; keep other users off "
                        f"--master-port {self.port}", None, FailureReason.OTHER, [])
                plain = [r for r, k in zip(ranks, [k for k in keys if k not in got])
                         if self.key is not None and self._plain_set(k)]
                if plain:   # they published under plain names: they have no --secret
                    raise PeerFailure(
                        f"rank(s) {rank_list(plain)} reached rendezvous step '{step}' without "
                        f"--secret (their values are under plain names, which a rank with "
                        f"a secret never reads): every rank needs the same --secret",
                        None, FailureReason.OTHER, [])
                first = f"{first_cause}; or the rank is " if first_cause else ""
                raise PeerFailure(f"rank(s) {rank_list(ranks)} did not reach rendezvous step "
                                  f"'{step}' within {self.timeout_s:.0f} s ({first}dead, "
                                  f"frozen, or started with another --secret or none: "
                                  f"every rank needs the same one)",
                                  ranks[0] if ranks else None, FailureReason.PEER_SILENT,
                                  ranks)
            time.sleep(POLL_S)

    def _plain_set(self, logical: str) -> bool:
        """Whether ``logical`` is set under its plain name (a rank without --secret)."""
        try:
            return bool(self._call(lambda: self.store.check([logical])))
        except Exception:
            return False

    def publish_failure(self, message: str, rank: int | None) -> None:
        """Best effort: tell ranks still in a rendezvous wait, or waiting for their
        trainer (:meth:`job_failure`), that the job failed (``rank``: the rank blamed;
        the record also names this rank as its publisher). The first failure published
        stays: a rank that only relays it does not overwrite who saw it first."""
        try:
            if not self._read(FAILED, self._check_failed)[0]:
                self.set(FAILED, json.dumps({"message": message, "rank": rank,
                                             "by": self.rank}))
        except Exception:
            pass

    def job_failure(self) -> PeerFailure | None:
        """One look at the store, for a rank with no wait of its own under way (its
        sidecar waits for its trainer): the failure another rank published
        (PEER_REPORTED, ``rank N failed: <its message>``, blaming the rank it names), or
        None while the job is healthy. Raises PeerFailure (STORE_LOST, blaming rank 0)
        when the store does not answer: rank 0, its host, is gone, or (within
        ``answer_s``, :meth:`_call`) frozen."""
        try:
            self._heal()
            ok, info = self._read(FAILED, self._check_failed)
        except PeerFailure:
            raise
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            mine = self._host_ended()
            raise PeerFailure(f"the rendezvous store at {self.host}:{self.port} (rank 0) "
                              f"is gone ({mine + ': ' if mine else ''}{why})", 0,
                              FailureReason.STORE_LOST, [0]) from None
        if not ok:
            return None
        message, rank, by = info
        who = f"rank {by} failed" if by is not None else "the job failed"
        return PeerFailure(f"{who}: {message}", rank, FailureReason.PEER_REPORTED)
