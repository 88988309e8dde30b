"""Rendezvous through ``torch.distributed.TCPStore`` (rank 0 hosts it).

Waits poll the store instead of blocking in ``get`` so that a failure anywhere in the
job (published under ``dgt/failed``) ends every wait at once with the failed rank named,
and so that no wait outlives ``timeout_s``. All methods block: call them from a thread
(``loop.run_in_executor``), never on the event loop.
"""
from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

from .errors import PeerFailure
from .failure import FailureReason

FAILED = "dgt/failed"
POLL_S = 0.05
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


def wait_for_listener(host: str, port: int, timeout_s: float,
                      bound_s: float | None = None) -> None:
    """Poll until ``host:port`` accepts a TCP connection; raise PeerFailure (rank 0)
    after ``timeout_s`` (the message names ``bound_s``, the whole wait since start-up). A plain connect, so that a store that is not up yet costs no
    TCPStore retry loop (which overshoots its timeout and prints C++ frames)."""
    t_end = time.monotonic() + timeout_s
    while True:
        left = t_end - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))):
                return
        except OSError as e:
            if time.monotonic() >= t_end:
                raise PeerFailure(f"rendezvous store at {host}:{port} did not come up within "
                                  f"{bound_s or timeout_s:.0f} s of start-up ({e.strerror or e}); start rank 0's "
                                  f"sidecar, with the same --master-addr/--master-port", 0,
                                  FailureReason.STORE_LOST) \
                    from None
        time.sleep(min(4 * POLL_S, max(0.0, t_end - time.monotonic())))


class Rendezvous:
    def __init__(self, host: str, port: int, world: int, rank: int, timeout_s: float,
                 listen_fd: int = -1):
        """``listen_fd`` (rank 0): a listening socket to host the store on, passed down
        by the launcher, which bound it, so no other process can take the port between
        its choice and the bind (TCPStore's ``master_listen_fd``); -1: bind ``port``."""
        self.host, self.port, self.world, self.rank = host, port, world, rank
        self.timeout_s = timeout_s
        self.listen_fd = listen_fd
        self._own_listener = None
        self.store = self._connect(is_master=rank == 0)

    def _connect(self, is_master: bool):
        from torch.distributed import TCPStore
        if not is_master:   # bounded by timeout_s from our start (imports included),
            # whatever TCPStore's own retries would do
            wait_for_listener(self.host, self.port,
                              max(1.0, self.timeout_s - process_age_s()), self.timeout_s)
            return self._bounded(lambda: self._connect_store(TCPStore, False))
        return self._connect_store(TCPStore, True)

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
                              f"did not answer within {self.timeout_s:.0f} s of start-up",
                              0, FailureReason.PEER_SILENT, [0])
        return out["store"]

    def _connect_store(self, TCPStore, is_master: bool):
        if is_master and self.listen_fd < 0:
            self._own_listener = self._listen()
            if self._own_listener is not None:   # the store owns the descriptor now
                self.listen_fd = self._own_listener.detach()
        try:
            extra = {"master_listen_fd": self.listen_fd} if is_master and \
                self.listen_fd >= 0 else {}
            return TCPStore(self.host, self.port, self.world, is_master=is_master,
                            timeout=timedelta(seconds=self.timeout_s),
                            wait_for_workers=False, **extra)
        except Exception as e:  # DistStoreError / RuntimeError: one line for the user
            raise PeerFailure(f"rendezvous store at {self.host}:{self.port} unreachable: "
                              f"{str(e).splitlines()[0]}", 0 if not is_master else None,
                              FailureReason.STORE_LOST) from None

    def _listen(self):
        """Rank 0: a listening socket on ``host:port`` only. Left to itself TCPStore
        listens on every interface, and the store is unauthenticated: it hands the
        session id to anyone who asks. None when ``host`` is not an address of this
        host (behind NAT, say): TCPStore then binds every interface, with a warning.
        Raises PeerFailure when the port is taken."""
        import errno
        import logging
        import socket
        try:
            return socket.create_server((self.host, self.port), backlog=1024,
                                        family=socket.AF_INET6 if ":" in self.host
                                        else socket.AF_INET)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PeerFailure(f"--master-port {self.port} is in use on {self.host}; "
                                  f"pick another port (or stop what holds it)", None) from None
            logging.getLogger("dgt.rendezvous").warning(
                "--master-addr %s is not an address of this host (%s); the rendezvous "
                "store listens on every interface", self.host, e.strerror)
            return None

    def set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except Exception as e:
            raise PeerFailure(f"rendezvous store lost (rank 0 died?): {e}".splitlines()[0],
                              0, FailureReason.STORE_LOST) from None

    def gather(self, prefix: str) -> dict[int, str]:
        """Wait until every rank has set ``prefix/<rank>``; return the values.
        Raises PeerFailure naming a failed rank, or the ranks missing at the timeout."""
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        self.wait(keys)
        try:
            return {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        except Exception as e:
            raise PeerFailure(f"rendezvous store lost (rank 0 died?): {e}".splitlines()[0],
                              0, FailureReason.STORE_LOST) from None

    def wait(self, keys: list[str]) -> None:
        t_end = time.monotonic() + self.timeout_s
        while True:
            try:
                if self.store.check([FAILED]):
                    info = json.loads(self.store.get(FAILED))
                    raise PeerFailure(info["message"], info.get("rank"),
                                      FailureReason.PEER_REPORTED)
                if self.store.check(keys):
                    return
            except PeerFailure:
                raise
            except Exception as e:
                raise PeerFailure(f"rendezvous store lost (rank 0 died?): "
                                  f"{str(e).splitlines()[0]}", 0,
                                  FailureReason.STORE_LOST) from None
            if time.monotonic() > t_end:
                missing = [k for k in keys if not self.store.check([k])]
                ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
                raise PeerFailure(f"rank(s) {ranks} did not reach rendezvous step "
                                  f"'{keys[0].rsplit('/', 1)[0]}' within {self.timeout_s:.0f} s",
                                  ranks[0] if ranks else None, FailureReason.PEER_SILENT,
                                  ranks)
            time.sleep(POLL_S)

    def publish_failure(self, message: str, rank: int | None) -> None:
        """Best effort: tell ranks still in a rendezvous wait that the job failed."""
        try:
            self.store.set(FAILED, json.dumps({"message": message, "rank": rank}))
        except Exception:
            pass
