"""The sidecar: one process per node, hosting the worker agent and the node's shard.

It listens on TCP (reliable channel, END, PULL), on one UDP socket per unreliable channel
(each with its channel's DSCP), and on a Unix socket for the local trainer. Rendezvous
goes through ``torch.distributed.TCPStore`` (MASTER_ADDR/MASTER_PORT when set).

Failure handling: a peer whose connection drops without BYE, a trainer that disconnects,
or a PULL that does not come within ``peer_timeout_s`` (``+ START_SKEW_S`` for the first
push) fails the job: the sidecar sends
ERROR (naming the rank) to every peer and to its trainer, then exits with status 3.
While it waits for its trainer's register (no peer connection yet), it watches the
rendezvous store instead: a failure another rank published there, or the store gone,
stops it the same way (``Sidecar._watch_job``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import faulthandler
import logging
import os
import signal
import socket
import sys
import time

import numpy as np

from . import checkpoint, datapath, failure, fdlimit, hugepages, ipc, parts, unixsock
from .agent import WorkerAgent
from .atomic import write_json
from .errors import PeerFailure, one_line, printable
from .failure import FailureReason
from .config import (LAUNCHED_ENV, START_SKEW_S, MetricsConfig, NodeConfig, OneLineParser,
                     hand_started_grace,
                     default_run_dir, TransmissionConfig, add_sidecar_arguments, from_args)
from .layout import BlockLayout
from .node_report import write_node_results
from .node_sockets import NodeSockets
from .peer_links import PeerLinks, drain
from .pull_codec import decode_pull
from .pull_sender import PullSender
from .registration import agree, barrier, check_model_size, exchange_endpoints, route_facts
from .rendezvous import LINGER_S, WATCH_S, Rendezvous, check_resolves
from .scheduler.deadline import AdaptiveDeadline
from .shard import ServerShard
from .trainer_link import TrainerLink, ended_soon, trainer_ended
from .transport import messages, wire
from .transport.aio import FrameProtocol
from .unixsock import private_dir
from .process import parent_death_signal, running
from .transport.channels import channel_dscp
from .transport.control import (HELLO_TIMEOUT_S, MAX_PENDING_HELLO,  # noqa: F401
                                CloseConnection, ConnectionRefused, ControlProtocol,
                                PeerFailed, PeerLeft, PullArrived, RefuseConnection,
                                ShardFrame)
from .transport.counters import Counters
from .transport.reasons import Rejected
from .trace import Trace

log = logging.getLogger("dgt.sidecar")

EXIT_PEER_FAILURE = 3


def udp_sources(peers: dict[int, dict], me: int) -> dict[tuple[str, int], int] | None:
    """(numeric address, port) -> rank of every peer's UDP channel sockets. A peer sends
    channel c's datagrams from its own channel-c socket (bound to its endpoint), so a
    datagram from any other source is no peer's: counted as ``unknown_source`` and
    dropped before it is decoded. This keeps out what merely reaches our ports (replays,
    scans, a stranger who learnt the session id); a sender that forges source addresses
    needs ``--secret`` (a MAC on every message). None when a peer's host is a wildcard
    (its source address is then the route's, not known here). Resolves host names
    (blocking: call it off the event loop)."""
    out: dict[tuple[str, int], int] = {}
    for r, ep in peers.items():
        if r == me:
            continue
        if ep["host"] in ("", "0.0.0.0", "::"):
            return None
        for port in ep["udp_ports"]:
            for *_, sa in socket.getaddrinfo(ep["host"], port, type=socket.SOCK_DGRAM):
                out[tuple(sa[:2])] = r
                if ":" not in sa[0]:   # as a dual-stack (::) socket sees an IPv4 peer
                    out[(f"::ffff:{sa[0]}", sa[1])] = r
    return out


class Sidecar:
    """One node: binds the sockets, rendezvouses, serves the trainer (dgt.trainer_link),
    and carries the messages between the sockets and the sans-IO pieces: the control
    protocol (transport.control), the shard's session (transport.session), the push
    sender (transport.sender, through dgt.agent) and the PULLs (dgt.pull_sender). One
    timer serves the control protocol's HELLO deadlines and the shard's deadlines."""

    def __init__(self, cfg: TransmissionConfig, node: NodeConfig,
                 metrics: MetricsConfig | None = None):
        self.cfg, self.node = cfg, node
        self.metrics_cfg = metrics or MetricsConfig()
        self.endpoint = None   # dgt.metrics.Endpoint, when --metrics-port is set
        self.rank, self.world = node.rank, node.world
        #: the process that started us, when it has us die with it (dgt.ddp: the
        #: trainer; dgt train: the launcher), else None (started by hand)
        self.parent_pid = os.getppid() if parent_death_signal() else None
        self._signal_task: asyncio.Task | None = None   # _on_signal_with_parent
        self.key = cfg.secret.encode() if cfg.secret else None
        self.dscp = channel_dscp(cfg.channels)
        self.counters = Counters()
        self.trace = Trace(node.run_dir, node.rank, self.counters, cfg.channels)
        self.sockets = NodeSockets(cfg, node, self.dscp)
        self.links = PeerLinks(cfg, self.rank, self.world, self.dscp, self.key)
        self.links.udp_senders = self.sockets.senders
        # HELLO, slots, BYE, ERROR, PULL checks: transport.control, fed by _on_frame
        self.control = ControlProtocol(rank=self.rank, world=self.world,
                                       authenticated=self.key is not None,
                                       rejected=self.counters.rejected)
        self.conns: dict[int, FrameProtocol] = {}       # connection id -> protocol
        self._conn_ids = 0
        self.left = self.control.left
        self.closed_after: dict[int, int] = {}   # rank -> iterations it pushed (its BYE)
        self.pushing: int | None = None          # the iteration our push is in
        # (address, port) of every peer's UDP sockets; None: a peer's address is a wildcard
        self.udp_sources: dict[tuple[str, int], int] | None = None
        self.session_id = 0
        self.rdv: Rendezvous | None = None
        self.agent: WorkerAgent | None = None
        self.shard: ServerShard | None = None
        self.pulls: PullSender | None = None
        self.layout: BlockLayout | None = None
        self.buffers: list[ipc.ShmBuffer] = []
        self.failed: PeerFailure | None = None
        self.done = asyncio.Event()
        self.trainer = TrainerLink(self.rank, {"register": self._register, "push": self._push,
                                    "part": lambda m: parts.part_op(self, m),
                                    "save": lambda m: checkpoint.save_op(self, m),
                                    "failed": self._trainer_failed},
                                   self.fail, self.finish, self.done,
                                   {"world": self.world, "job": self.node.job})
        self.finishing = False
        self.rendezvoused = asyncio.Event()
        # the routes to the peers (registration.route_facts), looked up right after the
        # rendezvous, in a thread, while the trainer still starts up
        self.route: asyncio.Future | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.drained = 0   # reads of queued datagrams made before a deadline (drain)
        self.pushes = 0
        self.registering = False   # our trainer's register came (--register-timeout-s)
        self.shapes_sha256 = None   # the register's model layout (dgt.checkpoint)
        self.pace_source = "--pace-mbit"
        self._published: asyncio.Future | None = None   # failure written to the store
        # the store watch while we wait for our trainer's register (_watch_job)
        self._watch: asyncio.Task | None = None
        self._unwatch = asyncio.Event()
        self.adaptive: AdaptiveDeadline | None = None   # the shard's wait after END
        self.deadline_floor_s = self.cfg.deadline_ms / 1000.0

    @property
    def pulls_held(self) -> int:
        """PULLs that waited for our push to their worker (dgt.pull_sender)."""
        return self.pulls.held if self.pulls is not None else 0

    # -- startup ----------------------------------------------------------------------
    async def run(self) -> int:
        try:
            return await self._run()
        finally:   # whatever ends us (a SIGKILL aside)
            self._unlink_buffers()

    def _unlink_buffers(self) -> None:
        """Remove our buffers' names from /dev/shm (their mappings stay): once the
        trainer mapped them, or once the job is over and it never will (no-ops after the
        first). Tests that stopped a lingering sidecar with SIGKILL after a refused
        register() left a name each in /dev/shm."""
        for b in self.buffers:
            b.unlink()

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        await self.sockets.bind(self._accepted_protocol, self._on_datagram, self.trainer.serve)
        # the socket is ours now: an earlier sidecar's record of this rank is stale
        failure.remove(self.node.run_dir, "sidecar", self.rank)
        await self._rendezvous()
        await self.done.wait()
        self._unlink_buffers()   # before any linger: a SIGKILL there left them in /dev/shm
        if self._published is not None:
            # the others' rendezvous waits read the failure from the store; rank 0 hosts
            # it, so it stays up for a few of their polls (they would only see it vanish)
            await asyncio.wait([self._published], timeout=2.0)
            if self.rank == 0:
                await asyncio.sleep(LINGER_S)
        # let PULL/BYE/ERROR frames reach the kernel
        await drain(list(self.links.out_conns.values()) + list(self.in_conns.values()), 5.0)
        write_node_results(self)
        self._close()   # no callback ran since the report: its counters are final
        if self.endpoint is not None:
            # the sockets are closed, so the counters stay the report's; the endpoint
            # lingers for a last scrape (--metrics-linger-s)
            await asyncio.sleep(self.metrics_cfg.metrics_linger_s)
            self.endpoint.stop()
        if self.failed:
            return EXIT_PEER_FAILURE
        return 0

    def _on_signal(self) -> None:
        """SIGTERM/SIGINT: stop; if the launcher left the reason (failure.json), pass it on
        (else a normal stop: the launcher, systemd, Ctrl-C, not an error of ours). A
        sidecar of a ``dgt train`` job of several ranks that the launcher did not stop
        was stopped from outside the job: that is the job's failure, and this rank is
        named as its cause (``SIGNALLED``; before, rank 0's sidecar, which lingers for
        the store, was outlived by the processes it stopped, and the launcher named one
        of them)."""
        if self.parent_pid is not None and not self.done.is_set() and \
                failure.job_stop(self.node.run_dir) is None:   # none: not the launcher's
            self._signal_task = asyncio.get_running_loop().create_task(
                self._on_signal_with_parent())
            return
        self._stopped_by_signal()

    async def _on_signal_with_parent(self) -> None:
        """A stop signal to a sidecar whose parent has it die with it: it may be the
        one the parent's death sends (PR_SET_PDEATHSIG). Under dgt.ddp the parent is our
        trainer, which then ended without closing (breaker round 10: named "stopped by
        signal"); under dgt train it is the launcher. The kernel sends it as the
        forking thread exits, which may be before the process is seen to end: wait a
        moment (trainer_link.ENDED_WAIT_S) for that."""
        pid = self.parent_pid

        def parent_gone() -> bool:
            return os.getppid() != pid or not running(pid)

        if await ended_soon(parent_gone):
            if os.environ.get(LAUNCHED_ENV):
                self.fail(f"dgt train (pid {pid}) ended without stopping this job", None,
                          level=logging.WARNING, why=FailureReason.STOPPED)
            else:
                self.fail(trainer_ended(self.rank, pid), self.rank,
                          level=logging.WARNING, why=FailureReason.OWN_TRAINER)
            return
        self._stopped_by_signal()

    def _stopped_by_signal(self) -> None:
        """A stop signal from the launcher (its reason in failure.json), a supervisor or
        the user."""
        stop = failure.job_stop(self.node.run_dir)
        if stop is None and self.world > 1 and os.environ.get(LAUNCHED_ENV):
            self.fail("stopped by a signal from outside the job", self.rank,
                      level=logging.WARNING, why=FailureReason.SIGNALLED)
            return
        self.fail(f"job stopped: {stop[0]}" if stop else "stopped by signal",
                  stop[1] if stop else None, propagate=stop is None,
                  level=logging.WARNING, why=FailureReason.STOPPED)

    async def _rendezvous(self) -> None:
        """Publish our endpoints and get everybody's (blocking store calls in a thread)."""
        me = {"rank": self.rank, "host": self.node.host, "tcp_port": self.sockets.tcp_port,
              "udp_ports": self.sockets.udp_ports, "pid": os.getpid()}

        def exchange():
            rdv, session, peers = exchange_endpoints(self.node, self.cfg, me,
                                                     lambda r: setattr(self, "rdv", r),
                                                     self.counters.rejected)
            return rdv, session, peers, udp_sources(peers, self.rank)

        try:
            self.rdv, self.session_id, self.links.peers, self.udp_sources = \
                await asyncio.get_running_loop().run_in_executor(None, exchange)
        except PeerFailure as e:
            self.fail(str(e), e.rank, why=e.reason, blamed=e.ranks)
            return
        if self.done.is_set():   # failed meanwhile (a trainer that gave up before it
            return               # registered): no "ready" line after the error
        # atomic: the launcher and tests poll for it and must never read it half-written
        write_json(os.path.join(self.node.run_dir, f"endpoints-{self.rank}.json"), me)
        hosts: dict[int, set[str]] = {}
        for (addr, _), r in (self.udp_sources or {}).items():
            hosts.setdefault(r, set()).add(addr)
        self._apply(self.control.set_session(self.session_id, time.monotonic(), hosts))
        self.route = asyncio.get_running_loop().run_in_executor(
            None, route_facts, self.cfg, self.links.peers, self.rank)
        self.rendezvoused.set()
        if self.world > 1:
            self._watch = asyncio.get_running_loop().create_task(self._watch_job())
        if self.node.register_timeout_s > 0:
            asyncio.get_running_loop().call_later(self.node.register_timeout_s,
                                                  self._register_overdue)
        print(f"dgt sidecar: rank {self.rank}/{self.world} ready: tcp {me['tcp_port']}, "
              f"udp {me['udp_ports']}, socket {self.node.socket}, run dir "
              f"{self.node.run_dir}", flush=True)

    async def _watch_job(self) -> None:
        """From the rendezvous until our trainer registers, look at the store every
        WATCH_S s (a blocking call, in a thread): a failure another rank published
        there, or the store gone (rank 0, its host, dead), fails this rank too, in one
        line naming it. No peer connection exists yet to say so (they are made at
        register), so without this a sidecar whose trainer never came stayed up for
        ever after the job failed elsewhere. Waiting for the trainer has no bound of
        its own while the job is healthy (trainers may start long after their
        sidecars). Ends when :meth:`_stop_watch` asks (the registration's own store
        waits take over) or the sidecar stops."""
        loop = asyncio.get_running_loop()
        while not (self._unwatch.is_set() or self.done.is_set()):
            try:
                failed = await loop.run_in_executor(None, self.rdv.job_failure)
            except PeerFailure as e:
                failed = e
            if failed is not None:
                self.fail(f"{failed}; stopping", failed.rank, propagate=False,
                          why=failed.reason, blamed=failed.ranks)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._unwatch.wait(), WATCH_S)

    async def _stop_watch(self) -> None:
        """End :meth:`_watch_job` and wait for its store call under way (at most one
        store round trip), so that one thread at a time uses the store."""
        self._unwatch.set()
        if self._watch is not None:
            await asyncio.wait([self._watch])

    # -- trainer ----------------------------------------------------------------------
    def _register_overdue(self) -> None:
        """``--register-timeout-s`` after the rendezvous: a trainer that has not sent
        its register by now is stuck or stopped before it connected (a frozen import,
        SIGSTOP), and nothing else would ever notice when every trainer is (the
        rendezvous steps' own timeouts start at the first register). Fails the job
        naming this rank."""
        if self.registering or self.done.is_set():
            return
        self.fail(f"rank {self.rank}'s trainer did not register within "
                  f"{self.node.register_timeout_s:g} s of the rendezvous (stuck or stopped "
                  f"before it connected; raise --register-timeout-s if loading its data "
                  f"takes longer)", self.rank, why=FailureReason.OWN_TRAINER)

    async def _register(self, msg: dict) -> None:
        loop = asyncio.get_running_loop()
        self.registering = True
        if self.agent is not None:
            raise PeerFailure(f"rank {self.rank}: register sent twice", self.rank)
        n_params = check_model_size(msg.get("n_params"), self.rank)
        self.shapes_sha256 = msg.get("shapes_sha256")
        state = await checkpoint.resume_state(msg.get("resume"), self.rank)
        await self.rendezvoused.wait()
        await self._stop_watch()   # agree's store waits watch for failures from here on
        if self.done.is_set():
            return   # the watch failed the job meanwhile
        rank = self.rank
        self.cfg, lay, source = await agree(self.rdv, self.cfg, self.links.peers, rank,
                                            self.world, n_params, msg.get("param_sha256"),
                                            state["iterations"] if state else 0,
                                            await self.route)
        self.links.cfg, self.layout = self.cfg, lay
        self.pace_source = source or self.pace_source
        self.control.set_layout({r: (lay.shard_lo(r), lay.shard_blocks(r))
                                 for r in range(self.world)}, lay.block_elems)
        path = datapath.build(self.cfg, lay, rank, self.session_id, self.key, self.counters,
                              self.links, self.node.seed, self._send_pull,
                              lambda r: self.in_conns.get(r))
        self.buffers, grad = [path.grad], path.grad
        self.shard, self.agent, self.pulls = path.shard, path.agent, path.pulls
        self.agent.residual.track_norm = self.endpoint is not None   # dgt_residual_norm
        self.adaptive, self.deadline_floor_s = path.adaptive, path.deadline_floor_s
        if state is not None:
            checkpoint.restore(self, state, msg["resume"])
        self.sockets.filter_udp(self.shard.session, self.world, None if self.udp_sources
                                is None else list(self.udp_sources))
        self.shard.on_advance = self.sockets.filter_iteration
        await self.links.connect(lambda r: self._protocol(outgoing_to=r), self.session_id,
                                 lambda p, r: self.control.connected(p.conn_id, r,
                                                                     time.monotonic()))
        await loop.run_in_executor(None, barrier, self.rdv, rank)
        self.trainer.send({"op": "registered", "grad": grad.path, "aggregate": grad.path,
                           "padded": lay.padded, "block_elems": lay.block_elems,
                           "n_blocks": lay.n_blocks, "iterations": self.pushes})

    async def _push(self, msg: dict) -> None:
        if self.agent is None:
            self.trainer.send({"op": "error", "rank": self.rank,
                               "message": "push before register"})
            return
        t = msg.get("t")
        expected = self.agent.iteration + 1 if self.pushes else 0
        if t != expected:
            raise PeerFailure(f"rank {self.rank} pushed iteration {t!r}, expected "
                              f"{expected}", self.rank)
        for b in self.buffers:   # the trainer mapped the buffer before it could push
            b.unlink()           # (once: a no-op after the first)
        loss = msg.get("loss")
        if loss is not None and not isinstance(loss, (int, float)):
            loss = None
        self._check_closed(t)
        self.pushing = t
        start = msg.get("start")
        self.trace.begin(t, float(start) if isinstance(start, (int, float)) else None)
        send = self.trainer.send
        # "ranges": the trainer applies each shard's range as its PULL lands
        on_range = (lambda lo, hi: send({"op": "range", "t": t, "lo": lo, "hi": hi})) \
            if msg.get("ranges") is True else None

        def pulled(k: float) -> None:   # before the residual is settled: they overlap
            self.pushing = None
            self.pushes += 1
            send({"op": "pulled", "t": t, "k": k, "first_sent": self.agent.parts.first_sent})
        # the first push also waits out the others' start-up (config.START_SKEW_S, or
        # --startup-grace-s where dgt train raised it)
        wait_s = self.cfg.peer_timeout_s + (max(START_SKEW_S, self.node.startup_grace_s)
                                            if self.pushes == 0 else 0.0)
        k = await self.agent.push(t, float(loss) if loss is not None else None,
                                  wait_s, pulled, on_range)
        self.trace.end(self.agent, k)

    async def _trainer_failed(self, msg: dict) -> None:
        """``{"op": "failed", "error": str}`` instead of ``bye``: the trainer is ending
        on an error (dgt.ddp says so at interpreter exit after an uncaught exception).
        Fails the job naming it and the step, so the others do not take it for an
        orderly close with fewer steps (dgt.failure.closed_early)."""
        what = one_line(str(msg.get("error") or "an error"), "an error")
        raise PeerFailure(f"rank {self.rank}'s trainer failed ({what}) at step "
                          f"{self.pushes}", self.rank, FailureReason.OWN_TRAINER)

    def _check_closed(self, t: int) -> None:
        """Fail at once when a peer's trainer closed before iteration ``t``
        (dgt.failure.closed_early)."""
        early = failure.closed_early(self.closed_after, self.rank, t)
        if early is not None:
            if self.pushing is None:   # before our push: the push fails
                raise PeerFailure(early[1], early[0], FailureReason.MISMATCH)
            self.fail(early[1], early[0], why=FailureReason.MISMATCH)   # during our push

    # -- connections ------------------------------------------------------------------
    def _protocol(self, outgoing_to: int | None = None) -> FrameProtocol:
        p = FrameProtocol(self._on_frame, self._on_lost, self._on_bad, key=self.key,
                          dscp=self.dscp[0], rto_min_ms=self.cfg.tcp_rto_min_ms)
        p.peer_rank = outgoing_to
        p.outgoing = outgoing_to is not None
        self._conn_ids += 1
        p.conn_id = self._conn_ids
        self.conns[p.conn_id] = p
        return p

    def _accepted_protocol(self) -> FrameProtocol:
        """An accepted connection: transport.control gives it a slot (evicting the
        oldest connection still without HELLO when all are taken) and a HELLO deadline."""
        p = self._protocol(None)
        p.on_made = self._on_accepted
        return p

    def _on_accepted(self, p: FrameProtocol) -> None:
        peer = p.transport.get_extra_info("peername")
        self._apply(self.control.accepted(p.conn_id, time.monotonic(),
                                          peer[0] if peer else None))
        self._arm_timer()

    @property
    def in_conns(self) -> dict[int, FrameProtocol]:
        """rank -> the accepted connection that rank's PULLs go on."""
        return {r: self.conns[i] for r, i in self.control.incoming().items()
                if i in self.conns}

    def _send_pull(self, worker: int, iteration: int, aggregate: np.ndarray,
                   received: np.ndarray) -> None:
        if worker == self.rank:
            self.agent.on_pull(self.rank, iteration, aggregate, received)
            return
        conn = self.in_conns.get(worker)
        if conn is None:
            self.fail(f"rank {worker} has no connection to shard {self.rank}", worker,
                      why=FailureReason.PEER_GONE)
            return
        self.pulls.send(conn, worker, iteration, aggregate, received)

    # -- input ------------------------------------------------------------------------
    def _on_datagram(self, channel: int, data: bytes, addr, now: float) -> None:
        if self.shard is None:
            self.counters.rejected["not_ready"] += 1
            return
        if self.udp_sources is not None and addr[:2] not in self.udp_sources:
            self.counters.rejected["unknown_source"] += 1
            return
        self.shard.handle(self.shard.session.receive_datagram(data, now))
        self._arm_timer()

    def _on_frame(self, proto: FrameProtocol, h: wire.Header, payload: memoryview,
                  now: float) -> None:
        self._apply(self.control.receive_frame(proto.conn_id, h, payload, now), now)
        if proto.peer_rank is None:   # after HELLO its receive buffer may grow
            proto.peer_rank = self.control.rank_of(proto.conn_id)

    def _apply(self, events: list, now: float | None = None) -> None:
        """Carry out transport.control's events."""
        for e in events:
            if isinstance(e, ShardFrame):
                if self.shard is None:
                    self.counters.rejected["not_ready"] += 1
                    continue
                out = self.shard.session.receive_frame(e.header, e.payload, now)
                self.shard.handle(out)
                if not any(isinstance(o, Rejected) for o in out):
                    self._apply(self.control.confirm(e.conn), now)
                self._arm_timer()
            elif isinstance(e, PullArrived):
                agg = e.aggregate
                if e.coding and self.agent is not None:   # --pull-codec of that shard
                    agg = decode_pull(e, self.layout.block_elems)
                    if agg is None:
                        self.counters.rejected["non_finite_pull"] += 1
                        continue
                if self.agent is None or not self.agent.on_pull(
                        e.shard, e.iteration, agg, e.received):
                    self.counters.rejected["bad_pull"] += 1
            elif isinstance(e, CloseConnection):
                p = self.conns.get(e.conn)
                if p is not None and p.transport is not None:
                    p.transport.abort()
            elif isinstance(e, RefuseConnection):   # the ERROR first, then the close
                p = self.conns.get(e.conn)
                if p is not None and p.transport is not None:
                    p.send(messages.error(self.session_id, self.rank, messages.REFUSED,
                                          e.text, self.key))
                    p.transport.close()
            elif isinstance(e, ConnectionRefused) and not self.done.is_set():
                hint = ("any process that can read the rendezvous store can do this "
                        "without --secret: run every rank with --secret"
                        if self.key is None else "this job's --secret has leaked")
                self.fail(f"rank {e.shard} refused rank {self.rank}'s connection: "
                          f"{e.text}; {hint}", None, why=FailureReason.IMPERSONATED,
                          blamed=[])
            elif isinstance(e, PeerLeft):
                if not e.clean:
                    log.warning("rank %d: rank %d left without BYE", self.rank, e.rank)
                if e.pushed is not None:   # its BYE: how many iterations it pushed
                    self.closed_after[e.rank] = e.pushed
                    if self.pushing is not None:
                        self._check_closed(self.pushing)
                self._check_finished()
            elif isinstance(e, PeerFailed) and not self.done.is_set():
                # transport.control raises it only for a verified peer: its ERROR, or
                # its lost connection; a stranger's frame is rejected, never blamed
                self.fail(e.reason, e.rank, propagate=not e.reported,
                          why=FailureReason.PEER_REPORTED if e.reported else
                          FailureReason.PEER_GONE)

    def _on_bad(self, proto: FrameProtocol, reason: str) -> None:
        self._apply(self.control.bad_frame(proto.conn_id, reason))

    def _on_lost(self, proto: FrameProtocol, exc) -> None:
        self.conns.pop(proto.conn_id, None)
        if self.done.is_set():
            return   # we are shutting down
        self._apply(self.control.lost(proto.conn_id, time.monotonic()))
        self._arm_timer()   # a peer's loss fails the job after its grace (transport.control)

    def _arm_timer(self) -> None:
        """Keep one timer armed for the earliest deadline: a connection's HELLO
        (transport.control) or the shard's wait after END (transport.session)."""
        times = [at for at in (self.control.next_timer(), self.shard.session.next_deadline()
                               if self.shard is not None else None) if at is not None]
        if not times or (self.timer is not None and self.timer_at <= min(times)):
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = min(times)
        self.timer = asyncio.get_running_loop().call_later(
            max(0.0, self.timer_at - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        now = time.monotonic()
        self._apply(self.control.handle_timer(now))
        if self.shard is not None:
            due = self.shard.session.next_deadline()
            if due is not None and due <= now:   # what already came is not lost
                with self.shard.session.queued():
                    self.drained += self.sockets.drain()
            self.shard.handle(self.shard.session.poll(time.monotonic()))
        self._arm_timer()

    # -- shutdown ---------------------------------------------------------------------
    def fail(self, message: str, rank: int | None, propagate: bool = True,
             level: int = logging.ERROR, why: FailureReason = FailureReason.OTHER,
             blamed: list[int] | None = None) -> None:
        """Fail the job: write the failure record (``dgt.failure``; ``why``, ``blamed``:
        default ``[rank]``), then tell peers (ERROR, block = failed rank) and the trainer;
        stop. ``level``: how the line is logged (a signal's stop is WARNING, not ERROR)."""
        if self.done.is_set():
            return
        self._unlink_buffers()   # before anyone hears of it: it may stop us with SIGKILL
        message = printable(message)   # UTF-8 on the wire and in the store, one log line
        self.failed = PeerFailure(message, rank, why, blamed)
        if why is not FailureReason.STOPPED or rank is not None:   # a plain stop: none
            failure.write(self.node.run_dir, failure.FailureRecord(
                "sidecar", self.rank, why, message, self.failed.ranks))
        # said once: some messages (a refused resume, a register sent twice) already
        # begin with our rank for the trainer's and the launcher's sake
        log.log(level, "%s", message if message.startswith(f"rank {self.rank}: ")
                else f"rank {self.rank}: {message}")
        try:   # telling the others is best effort; stopping is not
            if propagate:
                frame = messages.error(self.session_id, self.rank, rank, message, self.key)
                for conn in self._peer_conns():
                    conn.send(frame)
            self.trainer.send({"op": "error", "rank": rank, "message": message})
            if self.rdv is not None:  # ranks still in a rendezvous wait learn it there
                self._published = asyncio.get_running_loop().run_in_executor(
                    None, self.rdv.publish_failure, message, rank)
        except Exception as e:   # a bug of ours must not keep a failed sidecar alive
            log.error("rank %d: could not tell the others: %r", self.rank, e)
        finally:
            self.done.set()

    def finish(self) -> None:
        """Orderly end: BYE to every peer, then stop once every peer has said BYE too.

        A peer sends BYE only after its trainer applied its last aggregate, so once all
        BYEs are in nobody needs our PULLs any more; stopping earlier could cut a PULL
        still queued in a send buffer. Bounded by ``peer_timeout_s``."""
        if self.done.is_set() or self.finishing:
            return
        self.finishing = True
        # count: the iterations we pushed, so a peer still pushing knows at once
        bye = messages.bye(self.session_id, self.rank, self.pushes, self.key)
        self.control.finishing = True
        for conn in self._peer_conns():
            conn.send(bye)
        self._check_finished()
        asyncio.get_running_loop().call_later(self.cfg.peer_timeout_s, self._finish_timeout)

    def _peer_conns(self) -> list[FrameProtocol]:
        """The accepted connections that a HELLO tied to a rank: ERROR and BYE go on
        them (a peer trusts them only on a connection it dialled, transport.control)."""
        return [self.conns[i] for i in self.control.peer_conns() if i in self.conns]

    def _check_finished(self) -> None:
        peers = set(self.links.peers) - {self.rank}
        if self.finishing and self.left >= peers:
            self.done.set()

    def _finish_timeout(self) -> None:
        if not self.done.is_set():
            log.warning("rank %d: no BYE from rank(s) %s within %.0f s; stopping", self.rank,
                        sorted(set(self.links.peers) - {self.rank} - self.left),
                        self.cfg.peer_timeout_s)
            self.done.set()

    def _close(self) -> None:
        if self.pulls is not None:
            self.pulls.close()
        for conn in list(self.links.out_conns.values()) + list(self.in_conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        self.sockets.close()
        self.trainer.close()
        for b in self.buffers:
            b.close()
        if self.rdv is not None:   # rank 0: the store's process (dgt.store_host)
            self.rdv.close()


def main(argv: list[str] | None = None, prog: str = "dgt sidecar") -> int:
    p = OneLineParser(prog=prog, description="Run one node's sidecar "
                      "(worker agent + colocated server shard).")
    add_sidecar_arguments(p)
    return run_from_args(p.parse_args(argv), p)


#: a hand-started sidecar's shared hold of its run dir's lock (dgt.run_files.share_lock)
_run_dir_lock: int | None = None


def run_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    faulthandler.enable()   # a crash in native code leaves its Python stack in the log
    hugepages.keep_small_pages()   # no compaction stalls at the first push (dgt.hugepages)
    try:
        cfg = from_args(TransmissionConfig, ns)
        node = from_args(NodeConfig, ns)
        if ns.startup_grace_s is None:   # started by hand: dgt train, dgt.ddp give it
            node.startup_grace_s = hand_started_grace()
        node.check_listen_fd()
        check_resolves(node.master_addr)
        mcfg = from_args(MetricsConfig, ns)
        fdlimit.ensure(node.world)   # ulimit -n: raised to what the job needs, or refused
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=getattr(logging, node.log_level),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not os.environ.get(LAUNCHED_ENV):   # dgt train said them once for the job
        for line in cfg.warnings() + mcfg.warnings():
            parser.warning(line)
    if node.base_port < 0 or (node.base_port and
                              node.base_port + 10 * node.rank + cfg.channels > 65535):
        parser.error(f"--base-port {node.base_port} leaves no room for rank {node.rank}'s "
                     f"ports (base + 10*rank + {cfg.channels} must be <= 65535)")
    sock_dir = os.path.dirname(os.path.abspath(node.socket))
    if default_run_dir() in (sock_dir, os.path.abspath(node.run_dir)):
        try:   # the defaults: a per-user 0700 folder no other user can squat
            private_dir(default_run_dir())
        except PermissionError as e:
            parser.error(str(e))
    if not os.path.isdir(sock_dir):
        parser.error(f"--socket: directory {sock_dir} does not exist")
    if not unixsock.fits(node.socket):
        parser.error(f"--socket {node.socket} is {len(os.fsencode(node.socket))} bytes; a "
                     f"Unix socket path can have at most {unixsock.MAX_PATH_BYTES}: give a "
                     f"shorter one")
    if os.path.exists(node.run_dir) and not os.path.isdir(node.run_dir):
        parser.error(f"--run-dir {node.run_dir} is a file; give a folder")
    try:
        unixsock.owned_dir(node.run_dir, "--run-dir")
    except unixsock.NotOurs as e:
        parser.error(str(e))
    except OSError as e:
        parser.error(f"--run-dir: cannot create {node.run_dir}: {e.strerror}")
    if not os.access(node.run_dir, os.W_OK):
        parser.error(f"--run-dir {node.run_dir} is not writable")
    if not os.environ.get(LAUNCHED_ENV):   # started by hand, or by dgt.ddp
        # a running 'dgt train' holds its run dir alone (an outside tester's sidecar
        # wrote a failure record blaming rank 1 into a live job's run dir); a shared
        # hold for our life keeps a later 'dgt train' off ours in turn
        from .run_files import open_lock, share_lock
        try:
            global _run_dir_lock
            _run_dir_lock = open_lock(node.run_dir)
            share_lock(_run_dir_lock, node.run_dir, "--run-dir")
        except (ValueError, RuntimeError) as e:
            parser.error(str(e))
        except OSError as e:
            parser.error(f"--run-dir {node.run_dir}: {e.strerror} ({e.filename})")
    sidecar = Sidecar(cfg, node, mcfg)
    if mcfg.metrics_port:
        from .metrics import Endpoint, bind_error
        sidecar.endpoint = Endpoint(sidecar, mcfg.metrics_host, mcfg.metrics_port)
        try:
            sidecar.endpoint.start()
        except OSError as e:
            print(f"{parser.prog}: error: {bind_error(mcfg.metrics_host, mcfg.metrics_port, e)}",
                  file=sys.stderr)
            return 2
    try:
        import uvloop
        return uvloop.run(sidecar.run())
    except OSError as e:
        what = {errno.EADDRINUSE: f"{e.filename or 'a port'} of rank {node.rank} is in "
                                  f"use (--base-port "
                                  f"{node.base_port}: TCP base+10*rank, UDP base+10*rank+c); "
                                  f"pick another --base-port or 0 for free ports",
                errno.EACCES: f"{e.filename or 'a port'} of rank {node.rank}: permission "
                              f"denied (--base-port {node.base_port}: ports below 1024 "
                              f"need root); pick a --base-port from 1024 up, or 0 for "
                              f"free ports",
                errno.EADDRNOTAVAIL: f"--host {node.host} is not an address of this host",
                errno.EAFNOSUPPORT: f"--host {node.host}: this host has IPv6 turned off "
                                    f"(sysctl net.ipv6.conf.all.disable_ipv6=1); give an "
                                    f"IPv4 address",
                # breaker round 6: a link-local address without its scope was only
                # "[Errno 22] Invalid argument"
                errno.EINVAL: f"--host {node.host}: cannot listen there ({e.strerror})"
                              + ("; a link-local IPv6 address needs its interface, e.g. "
                                 f"{node.host}%eth0" if node.host.lower().startswith("fe80")
                                 and "%" not in node.host else "")}
        msg = what.get(e.errno) or (f"--host {node.host}: {e.strerror}" if isinstance(
            e, socket.gaierror) else str(e))
        print(f"dgt sidecar: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(prog="python -m dgt.sidecar"))
