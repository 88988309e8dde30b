"""The sidecar: one process per node, hosting the worker agent and the node's shard.

It listens on TCP (reliable channel, END, PULL), on one UDP socket per unreliable channel
(each with its channel's DSCP), and on a Unix socket for the local trainer. Rendezvous
goes through ``torch.distributed.TCPStore`` (MASTER_ADDR/MASTER_PORT when set).

Failure handling: a peer whose connection drops without BYE, a trainer that disconnects,
or a PULL that does not come within ``peer_timeout_s`` fails the job: the sidecar sends
ERROR (naming the rank) to every peer and to its trainer, then exits with status 3.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import faulthandler
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import asdict

import numpy as np

from . import buffers, checkpoint, ipc, unixsock
from .agent import TCP_BACKLOG_SLACK, Links, WorkerAgent
from .errors import PeerFailure
from .config import (PACE_AUTO, MetricsConfig, NodeConfig, OneLineParser,
                     TransmissionConfig, add_sidecar_arguments, from_args)
from .link_rate import auto_pace_mbit
from .layout import BlockLayout
from .rendezvous import POLL_S, Rendezvous, check_resolves
from .scheduler.deadline import AdaptiveDeadline, DeadlinePolicy
from .scheduler.pacing import HeldPulls, OwnQueueGate, flow_share
from .shard import ServerShard
from .transport import pmtu, sockopts, wire
from .transport.aio import DatagramProtocol, FrameProtocol
from .transport.channels import channel_dscp
from .transport.control import (HELLO_TIMEOUT_S, MAX_PENDING_HELLO, CloseConnection,
                                ControlProtocol, PeerFailed, PeerLeft, PullArrived,
                                ShardFrame)
from .transport.counters import Counters
from .transport.reasons import Rejected
from .transport.session import ShardSession
from .transport.udp_batch import BatchSender, enable_gro
from .transport.wire import MsgType
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


#: rendezvous waits allow --peer-timeout-s plus this for start-up (imports, the dataset)
STARTUP_GRACE_S = 10.0


class Sidecar:
    def __init__(self, cfg: TransmissionConfig, node: NodeConfig,
                 metrics: MetricsConfig | None = None):
        self.cfg, self.node = cfg, node
        self.metrics_cfg = metrics or MetricsConfig()
        self.endpoint = None   # dgt.metrics.Endpoint, when --metrics-port is set
        self.rank, self.world = node.rank, node.world
        self.key = cfg.secret.encode() if cfg.secret else None
        self.dscp = channel_dscp(cfg.channels)
        self.counters = Counters()
        self.trace = Trace(node.run_dir, node.rank, self.counters, cfg.channels)
        self.out_conns: dict[int, FrameProtocol] = {}   # to peer shards (we are worker)
        # HELLO, slots, BYE, ERROR, PULL checks: transport.control, fed by _on_frame
        self.control = ControlProtocol(rank=self.rank, world=self.world,
                                       authenticated=self.key is not None,
                                       rejected=self.counters.rejected)
        self.conns: dict[int, FrameProtocol] = {}       # connection id -> protocol
        self._conn_ids = 0
        self._control_timer: asyncio.TimerHandle | None = None
        self.left = self.control.left
        self.closed_after: dict[int, int] = {}   # rank -> iterations it pushed (its BYE)
        self.pushing: int | None = None          # the iteration our push is in
        self.udp: dict[int, tuple[asyncio.DatagramTransport, DatagramProtocol]] = {}
        self.udp_senders: dict[int, BatchSender] = {}
        self.gro = False
        self.peers: dict[int, dict] = {}
        # (address, port) of every peer's UDP sockets; None: a peer's address is a wildcard
        self.udp_sources: dict[tuple[str, int], int] | None = None
        self.session_id = 0
        self.rdv: Rendezvous | None = None
        self.agent: WorkerAgent | None = None
        self.shard: ServerShard | None = None
        self.layout: BlockLayout | None = None
        self.buffers: list[ipc.ShmBuffer] = []
        self.trainer_writer: asyncio.StreamWriter | None = None
        self.failed: PeerFailure | None = None
        self.done = asyncio.Event()
        self.finishing = False
        self.rendezvoused = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.pushes = 0
        self.pulls_held = 0   # PULLs that waited for our push to their worker
        self.pace_source = "--pace-mbit"
        self.held_pulls: HeldPulls | None = None   # on a paced port, after register
        self.own_udp: OwnQueueGate | None = None   # PULLs after our queued UDP, too
        self._flush_timer: asyncio.TimerHandle | None = None
        self._published: asyncio.Future | None = None   # failure written to the store
        self.socket_owned: tuple[int, int] | None = None   # (dev, inode) we bound
        self.warnings: list[str] = []   # for the summary and report (dgt.buffers)
        self.adaptive: AdaptiveDeadline | None = None   # the shard's wait after END
        self.deadline_floor_s = self.cfg.deadline_ms / 1000.0

    # -- startup ----------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        await self._bind()
        await self._rendezvous()
        await self.done.wait()
        if self._published is not None:
            # the others' rendezvous waits read the failure from the store; rank 0 hosts
            # it, so it stays up for a few of their polls (they would only see it vanish)
            await asyncio.wait([self._published], timeout=2.0)
            if self.rank == 0:
                await asyncio.sleep(5 * POLL_S)
        await self._drain(5.0)  # let PULL/BYE/ERROR frames reach the kernel
        self._write_report()
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
        """SIGTERM/SIGINT: stop; if the launcher left the reason (failure.json), pass it on."""
        try:
            with open(os.path.join(self.node.run_dir, "failure.json")) as f:
                info = json.load(f)
            self.fail(f"job stopped: {info['message']}", info.get("rank"), propagate=False,
                      level=logging.WARNING)
        except (OSError, ValueError, KeyError):
            # a normal stop (the launcher, systemd, Ctrl-C): not an error of ours
            self.fail("stopped by signal", None, level=logging.WARNING)

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        base = self.node.base_port + 10 * self.rank if self.node.base_port else 0
        self.tcp_sock = sockopts.tcp_listener(self.node.host, base, self.dscp[0])
        self.tcp_server = await loop.create_server(self._accepted_protocol,
                                                   sock=self.tcp_sock)
        for c in range(1, self.cfg.channels + 1):
            s = sockopts.udp_socket(self.node.host, base + c if base else 0, self.dscp[c],
                                    self.cfg.udp_buffer_bytes, self.cfg.udp_buffer_bytes)
            for w in buffers.check(s, self.cfg.udp_buffer_bytes):
                if w not in self.warnings:   # the same on every channel: once
                    self.warnings.append(w)
                    log.warning("rank %d: %s", self.rank, w)
            # GRO hands us coalesced runs of datagrams; receive-side loss emulation
            # must drop single datagrams, so it runs without GRO
            self.gro = enable_gro(s) if not self.cfg.drop_udp else False
            self.udp_senders[c] = BatchSender(s)
            tr, proto = await loop.create_datagram_endpoint(
                lambda c=c: DatagramProtocol(lambda d, a, now, c=c: self._on_datagram(c, d, a, now),
                                             self.cfg.drop_udp,
                                             seed=self.node.seed * 131 + self.rank * 7 + c),
                sock=s)
            self.udp[c] = (tr, proto)
        path = self.node.socket
        usock, self.socket_owned = unixsock.claim(path)   # refuses a live socket
        self.unix_server = await asyncio.start_unix_server(self._serve_trainer, sock=usock)
        log.info("rank %d listening: tcp %d, udp %s, unix %s", self.rank, self.tcp_port,
                 self.udp_ports, path)

    @property
    def tcp_port(self) -> int:
        return self.tcp_sock.getsockname()[1]

    @property
    def udp_ports(self) -> list[int]:
        return [self.udp[c][0].get_extra_info("sockname")[1] for c in sorted(self.udp)]

    async def _rendezvous(self) -> None:
        """Publish our endpoints and get everybody's (blocking store calls in a thread)."""
        loop = asyncio.get_running_loop()
        me = {"rank": self.rank, "host": self.node.host, "tcp_port": self.tcp_port,
              "udp_ports": self.udp_ports, "pid": os.getpid()}

        def exchange():
            rdv = Rendezvous(self.node.master_addr, self.node.master_port, self.world,
                             self.rank, self.cfg.peer_timeout_s + STARTUP_GRACE_S,
                             listen_fd=self.node.master_listen_fd)
            # from here on, a failure is published in the store (the others' waits end
            # with it, naming the rank) and the store lives until we exit
            self.rdv = rdv
            if self.rank == 0:
                rdv.set("dgt/session/0", str(random.SystemRandom().getrandbits(64)))
            rdv.set(f"dgt/ep/{self.rank}", json.dumps(me))
            rdv.wait(["dgt/session/0"])
            session = int(rdv.store.get("dgt/session/0"))
            peers = {r: json.loads(v) for r, v in rdv.gather("dgt/ep").items()}
            return rdv, session, peers, udp_sources(peers, self.rank)

        try:
            self.rdv, self.session_id, self.peers, self.udp_sources = \
                await loop.run_in_executor(None, exchange)
        except PeerFailure as e:
            self.fail(str(e), e.rank)
            return
        with open(os.path.join(self.node.run_dir, f"endpoints-{self.rank}.json"), "w") as f:
            json.dump(me, f)
        hosts: dict[int, set[str]] = {}
        for (addr, _), r in (self.udp_sources or {}).items():
            hosts.setdefault(r, set()).add(addr)
        self._apply(self.control.set_session(self.session_id, time.monotonic(), hosts))
        self.rendezvoused.set()
        print(f"dgt sidecar: rank {self.rank}/{self.world} ready: tcp {self.tcp_port}, "
              f"udp {self.udp_ports}, socket {self.node.socket}, run dir "
              f"{self.node.run_dir}", flush=True)

    # -- trainer ----------------------------------------------------------------------
    async def _serve_trainer(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        try:   # a connection that closes before its first line is a probe (another
            # sidecar checking whether this socket is live: dgt.unixsock), not a trainer
            line = await reader.readline()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            line = b""
        except ValueError:   # a first line over the reader's limit: no trainer of ours
            writer.write(ipc.encode_msg({"op": "error", "rank": None,
                                         "message": "control line too long"}))
            line = b""
        if line and self._hello(line, writer):
            return
        if not line or self.trainer_writer is not None:
            if line:
                writer.write(ipc.encode_msg({"op": "error", "rank": None,
                                             "message": "this sidecar already has a trainer"}))
            writer.close()
            return
        self.trainer_writer = writer
        clean = False
        try:
            while not self.done.is_set():
                if line is None:
                    line = await reader.readline()
                if not line:
                    break
                try:
                    msg = ipc.decode_msg(line)
                except ValueError as e:
                    self._to_trainer({"op": "error", "rank": self.rank,
                                      "message": f"bad control message: {e}"})
                    break
                line = None
                op = msg["op"]
                if op == "register":
                    await self._register(msg)
                elif op == "push":
                    await self._push(msg)
                elif op == "save":
                    await self._save(msg)
                elif op == "bye":
                    clean = True
                    break
                else:
                    self._to_trainer({"op": "error", "rank": self.rank,
                                      "message": f"unknown op {op!r}"})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # shutting down
            return
        except PeerFailure as e:
            self.fail(str(e), e.rank)
        except Exception as e:  # a bug of ours: fail the job cleanly, never linger
            log.debug("internal error", exc_info=True)
            self.fail(f"rank {self.rank}: internal error: {e!r}", self.rank)
        if clean:
            self.finish()
        elif not self.done.is_set():
            self.fail(f"trainer of rank {self.rank} disconnected", self.rank)

    def _hello(self, line: bytes, writer: asyncio.StreamWriter) -> bool:
        """A first line ``{"op": "hello"}`` asks who this sidecar is (dgt.ddp checks the
        job and world size before it attaches): answered, then closed, without taking
        the trainer's place. False for any other line."""
        try:
            if ipc.decode_msg(line).get("op") != "hello":
                return False
        except ValueError:
            return False
        writer.write(ipc.encode_msg({"op": "hello", "rank": self.rank, "world": self.world,
                                     "job": self.node.job}))
        writer.close()
        return True

    def _to_trainer(self, msg: dict) -> None:
        w = self.trainer_writer
        if w is not None and not w.is_closing():
            w.write(ipc.encode_msg(msg))

    async def _register(self, msg: dict) -> None:
        loop = asyncio.get_running_loop()
        n_params = msg.get("n_params")
        if self.agent is not None:
            raise PeerFailure(f"rank {self.rank}: register sent twice", self.rank)
        if not isinstance(n_params, int) or not 0 < n_params < 1 << 31:
            raise PeerFailure(f"rank {self.rank} registered a model of {n_params!r} "
                              f"parameters; need 1..2^31-1", self.rank)
        await self.rendezvoused.wait()
        rank = self.rank

        sha = msg.get("param_sha256")
        sha = sha if isinstance(sha, str) else ""   # "": a client that sends none
        resume = msg.get("resume")
        state = None
        if isinstance(resume, str) and resume:   # dgt.checkpoint: this node's part
            try:
                state = await loop.run_in_executor(None, checkpoint.load, resume)
            except (OSError, ValueError) as e:
                raise PeerFailure(f"rank {rank}: cannot resume from {resume}: {e}",
                                  rank) from None
        start = state["iterations"] if state else 0

        def agree():
            self.rdv.set(f"dgt/n_params/{rank}", f"{n_params} {sha} {start}")
            return {r: v.split(" ") for r, v in self.rdv.gather("dgt/n_params").items()}

        agreed = await loop.run_in_executor(None, agree)
        sizes = {r: int(v[0]) for r, v in agreed.items()}
        if len(set(sizes.values())) != 1:
            raise PeerFailure(f"trainers registered different model sizes: {sizes}; every "
                              f"rank must train the same model", None)
        starts = {r: v[2] if len(v) > 2 else "0" for r, v in agreed.items()}
        if len(set(starts.values())) != 1:
            raise PeerFailure(f"ranks resume from different iterations: {starts}; give "
                              f"every rank the same checkpoint step", None)
        shas = {r: v[1] if len(v) > 1 else "" for r, v in agreed.items()}
        apart = [r for r, h in sorted(shas.items()) if h and shas[0] and h != shas[0]]
        if apart:
            raise PeerFailure(f"rank(s) {apart} start from different parameters than rank "
                              f"0 (SHA-256 {shas[apart[0]][:12]}… vs {shas[0][:12]}…); the "
                              f"replicas would never agree: seed the model alike on every "
                              f"rank (torch.manual_seed) or load the same checkpoint before "
                              f"register()", apart[0])
        if self.cfg.pace_mbit == PACE_AUTO:
            hosts = [ep["host"] for r, ep in sorted(self.peers.items()) if r != rank]
            # pyroute2's sync API cannot run inside a running event loop: use a thread
            pace, self.pace_source = await loop.run_in_executor(None, auto_pace_mbit, hosts)
            self.cfg = dataclasses.replace(self.cfg, pace_mbit=pace)
            log.info("rank %d: UDP pacing %s (%s)", rank,
                     f"{pace:g} Mbit/s" if pace else "off", self.pace_source)
        lay = BlockLayout.from_bytes(n_params, self.cfg.block_bytes, self.world)
        self.layout = lay
        self.control.set_layout({r: (lay.shard_lo(r), lay.shard_blocks(r))
                                 for r in range(self.world)}, lay.block_elems)
        self._check_pace(lay)
        tag = f"dgt-{os.getpid()}-{self.session_id & 0xffffffff:08x}-r{rank}"
        # one buffer: the push reads the gradient out (plan) before any PULL of that
        # iteration can arrive, and the PULLs write the aggregate over it
        grad = ipc.ShmBuffer(os.path.join(ipc.shm_dir(), tag + "-grad"), lay.padded, True)
        self.buffers = [grad]
        policy = DeadlinePolicy(min_s=self.cfg.deadline_ms / 1000.0,
                                rate_mbit=self.cfg.pace_mbit or 1000.0)
        floor = self.deadline_floor_s = policy.after_end_s()
        self.adaptive = AdaptiveDeadline(floor, self.cfg.deadline_max_ms / 1000.0) \
            if self.cfg.adaptive_deadline else None
        session = ShardSession(session=self.session_id, shard=rank, lo=lay.shard_lo(rank),
                               hi=lay.shard_hi(rank), block_elems=lay.block_elems,
                               n_workers=self.world, deadline_s=floor,
                               key=self.key, counters=self.counters,
                               deadline_policy=self.adaptive)
        self.shard = ServerShard(lay, rank, session, self._send_pull)
        links = Links(send_tcp=self._send_tcp, send_udp=self._send_udp,
                      local_push=self.shard.local_push,
                      waiting_for=self.shard.session.waiting_for,
                      tcp_backlog=self._tcp_backlog, push_sent=self._flush_pulls)
        self.agent = WorkerAgent(self.cfg, lay, rank, self.session_id, self.key, grad.array,
                                 grad.array, links, self.counters, seed=self.node.seed)
        if state is not None:
            try:
                checkpoint.load_sidecar_state(self, state)
            except (ValueError, KeyError) as e:
                raise PeerFailure(f"rank {rank}: cannot resume from {resume}: {e}",
                                  rank) from None
        if self.cfg.pace_mbit > 0 and self.world > 1:
            self.held_pulls = HeldPulls(flow_share(self.cfg.pace_mbit, self.world - 1),
                                        TCP_BACKLOG_SLACK)
            self.own_udp = OwnQueueGate(flow_share(self.cfg.pace_mbit, 1))
        await self._connect_peers()

        def barrier():
            self.rdv.set(f"dgt/ready/{rank}", "1")
            self.rdv.gather("dgt/ready")

        await loop.run_in_executor(None, barrier)
        self._to_trainer({"op": "registered", "grad": grad.path, "aggregate": grad.path,
                          "padded": lay.padded, "block_elems": lay.block_elems,
                          "n_blocks": lay.n_blocks, "iterations": self.pushes})

    async def _push(self, msg: dict) -> None:
        if self.agent is None:
            self._to_trainer({"op": "error", "rank": self.rank, "message": "push before register"})
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
        k = await self.agent.push(t, float(loss) if loss is not None else None,
                                  self.cfg.peer_timeout_s)
        self.pushing = None
        self.pushes += 1
        self._to_trainer({"op": "pulled", "t": t, "k": k})
        self.trace.end(self.agent, k)

    async def _save(self, msg: dict) -> None:
        """``{"op": "save", "path": P}`` between two iterations: write this node's state
        (dgt.checkpoint.sidecar_state_dict) to P with torch.save, then answer
        ``saved``. The agent is idle until our trainer's next push, which waits for it."""
        path = msg.get("path")
        if self.agent is None or not isinstance(path, str) or not path:
            self._to_trainer({"op": "error", "rank": self.rank,
                              "message": "save needs a registered model and a path"})
            return
        state = checkpoint.sidecar_state_dict(self)
        try:
            await asyncio.get_running_loop().run_in_executor(None, checkpoint.save,
                                                             state, path)
        except OSError as e:
            raise PeerFailure(f"rank {self.rank}: cannot write checkpoint {path}: "
                              f"{e.strerror or e}", self.rank) from None
        self._to_trainer({"op": "saved", "path": path, "iterations": self.pushes})

    def _check_closed(self, t: int) -> None:
        """Fail at once when a peer's trainer closed before iteration ``t`` (its BYE
        carries how many iterations it pushed): it will never push ``t``, and waiting
        for it would end --peer-timeout-s later blaming it as dead or frozen."""
        early = sorted(r for r, n in self.closed_after.items() if n <= t)
        if early:
            r, n = early[0], self.closed_after[early[0]]
            when = f"after step {n - 1}" if n else "before its first step"
            msg = (f"rank {r} closed {when}; rank {self.rank} is at step {t}: every rank "
                   f"must run the same number of steps")
            if self.pushing is None:   # before our push: the push fails
                raise PeerFailure(msg, r)
            self.fail(msg, r)          # a BYE during our push: fail now

    # -- peers ------------------------------------------------------------------------
    async def _connect_peers(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.cfg.peer_timeout_s
        for r, ep in self.peers.items():
            if r == self.rank:
                continue
            while True:
                sock = sockopts.tcp_client(self.dscp[0], sockopts.family_of(ep["host"]))
                try:
                    await loop.sock_connect(sock, (ep["host"], ep["tcp_port"]))
                    break
                except OSError as e:
                    sock.close()
                    if time.monotonic() > deadline:
                        raise PeerFailure(f"cannot reach rank {r} at {ep['host']}:"
                                          f"{ep['tcp_port']}: {e}", r) from None
                    await asyncio.sleep(0.1)
            _, proto = await loop.create_connection(
                lambda r=r: self._protocol(outgoing_to=r), sock=sock)
            proto.send(wire.encode(MsgType.HELLO, session=self.session_id, sender=self.rank,
                                   shard=r, key=self.key))
            self.out_conns[r] = proto
            self.control.connected(proto.conn_id, r, time.monotonic())
            self._pace(proto)

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
        self._arm_control_timer()

    @property
    def in_conns(self) -> dict[int, FrameProtocol]:
        """rank -> the accepted connection that rank's PULLs go on."""
        return {r: self.conns[i] for r, i in self.control.incoming().items()
                if i in self.conns}

    def _arm_control_timer(self) -> None:
        if self._control_timer is not None:
            return
        at = self.control.next_timer()
        if at is not None:
            self._control_timer = asyncio.get_running_loop().call_later(
                max(0.0, at - time.monotonic()), self._on_control_timer)

    def _on_control_timer(self) -> None:
        self._control_timer = None
        self._apply(self.control.handle_timer(time.monotonic()))
        self._arm_control_timer()

    def _send_tcp(self, shard: int, frame: bytes) -> None:
        conn = self.out_conns.get(shard)
        if conn is None or conn.transport.is_closing():
            raise PeerFailure(f"connection to rank {shard} is closed", shard)
        conn.send(frame)

    def _check_pace(self, lay: BlockLayout) -> None:
        """Refuse a pacing rate at which one iteration (push, then PULL, of the N-1
        remote shards' bytes) cannot fit in --peer-timeout-s: the job would otherwise
        fail later with a timeout that seems to blame a peer."""
        if self.cfg.pace_mbit <= 0 or self.world < 2:
            return
        share = flow_share(self.cfg.pace_mbit, self.world - 1) * (self.world - 1)
        need_s = 2 * 4 * lay.padded * (self.world - 1) / self.world / share
        if need_s > self.cfg.peer_timeout_s:
            raise PeerFailure(
                f"--pace-mbit {self.cfg.pace_mbit:g} moves one iteration of this model "
                f"({4 * lay.padded / 1e6:.3g} MB of gradient, {self.world} nodes) in about "
                f"{need_s:.0f} s, more than --peer-timeout-s {self.cfg.peer_timeout_s:g}; "
                f"raise --pace-mbit (or auto) or --peer-timeout-s", self.rank)

    def _tcp_backlog(self, peer: int) -> int:
        """Bytes our push connection to ``peer`` has not sent yet: in the transport's
        buffer plus the kernel's unsent queue."""
        conn = self.out_conns.get(peer)
        if conn is None or conn.transport is None:
            return 0
        sock = conn.transport.get_extra_info("socket")
        return conn.transport.get_write_buffer_size() + (sockopts.tcp_unsent(sock)
                                                         if sock is not None else 0)

    def _own_udp_wait(self, iteration: int, now: float) -> float:
        """Seconds the PULLs of ``iteration`` wait for our queued UDP blocks to leave
        this host (scheduler.pacing.OwnQueueGate)."""
        backlog = sum(sockopts.udp_unsent(b.sock) for b in self.udp_senders.values())
        return self.own_udp.wait(backlog, iteration, now)

    def _flush_pulls(self) -> None:
        """Send the held PULLs whose worker's share of our port is free again (our push
        to it has left); look again when the others' backlog should have drained."""
        self._flush_timer = None
        if self.held_pulls is None or self.agent is None or self.agent.sending:
            return   # push_sent() calls again when our push has left
        now = time.monotonic()
        wait = self._own_udp_wait(self.agent.iteration, now)
        if wait:
            self._flush_timer = asyncio.get_running_loop().call_later(wait, self._flush_pulls)
            return
        ready, wait = self.held_pulls.release(self._tcp_backlog, now)
        for worker, frame in ready:
            conn = self.in_conns.get(worker)
            if conn is not None and not conn.transport.is_closing():
                conn.send(frame)
        if wait is not None:
            self._flush_timer = asyncio.get_running_loop().call_later(wait,
                                                                      self._flush_pulls)

    def _pace(self, conn: FrameProtocol) -> None:
        """Cap a reliable connection at one peer's share of the port (kernel TCP pacing,
        SO_MAX_PACING_RATE): N-1 senders into one port then add up to its rate, so the
        port's queue does not overflow into retransmission timeouts (incast)."""
        if self.cfg.pace_mbit > 0 and not conn.paced and conn.transport is not None:
            sockopts.set_pacing_rate(conn.transport.get_extra_info("socket"),
                                     flow_share(self.cfg.pace_mbit, self.world - 1))
            conn.paced = True

    def _send_udp(self, channel: int, shard: int, rows: np.ndarray) -> int:
        ep = self.peers[shard]
        try:
            return self.udp_senders[channel].send(rows, (ep["host"],
                                                         ep["udp_ports"][channel - 1]))
        except OSError as e:
            if e.errno in (errno.EMSGSIZE, errno.EINVAL):   # EINVAL: a GSO segment
                too_big = self._mtu_advice(rows.shape[1], shard, ep)
                if too_big is not None:
                    raise PeerFailure(too_big, self.rank) from None
            raise PeerFailure(f"UDP send to rank {shard} failed: {e}", shard) from None

    def _mtu_advice(self, size: int, shard: int, ep: dict) -> str | None:
        """The line for a ``size`` B datagram to ``shard`` that the kernel refused: the
        --block-bytes that fits the path MTU it reports now (transport.pmtu), or None
        when the datagram fits that MTU (the error had another cause)."""
        found = pmtu.path_mtu(ep["host"], ep["udp_ports"][0])
        mtu, ip_udp = found if found else (1500, pmtu.IPV4_UDP_BYTES)
        if found and size + ip_udp <= mtu:
            return None
        fit = pmtu.max_block_bytes(mtu, ip_udp, mac=self.key is not None)
        where = f"the path MTU to rank {shard} is {mtu} B" if found else \
            "the path MTU is unknown (assumed 1500 B)"
        return (f"a {size} B datagram (--block-bytes {self.cfg.block_bytes}"
                f"{' + MAC' if self.key else ''}) does not fit: {where}; use --block-bytes "
                f"{fit} or less (IP+UDP {ip_udp} B + header {wire.HEADER_BYTES} B"
                f"{f' + MAC {wire.MAC_BYTES} B' if self.key else ''} + block <= {mtu} B)")

    def _send_pull(self, worker: int, iteration: int, aggregate: np.ndarray,
                   received: np.ndarray) -> None:
        if worker == self.rank:
            self.agent.on_pull(self.rank, iteration, aggregate, received)
            return
        conn = self.in_conns.get(worker)
        if conn is None:
            self.fail(f"rank {worker} has no connection to shard {self.rank}", worker)
            return
        lay = self.layout
        # the aggregate goes out as a view (no copy per worker): the shard allocates a
        # new one every iteration and never writes this one again
        frame = wire.encode_parts(
            MsgType.PULL, session=self.session_id, sender=self.rank, shard=self.rank,
            iteration=iteration, block=lay.shard_lo(self.rank),
            count=lay.shard_blocks(self.rank), parts=wire.pull_parts(aggregate, received),
            key=self.key)
        self._pace(conn)
        if self.held_pulls is not None and (
                self.agent.sending or self._tcp_backlog(worker) > TCP_BACKLOG_SLACK
                or self._own_udp_wait(iteration, time.monotonic())):
            # our push is still on the port (other shards wait for it), on that
            # worker's share of it, or in our own egress queue: the push goes first
            # (scheduler.pacing.HeldPulls, OwnQueueGate)
            self.held_pulls.hold(worker, frame)
            self.pulls_held += 1
            if not self.agent.sending and self._flush_timer is None:
                self._flush_pulls()
            return
        conn.send(frame)

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
                    self.control.confirm(e.conn)
                self._arm_timer()
            elif isinstance(e, PullArrived):
                if self.agent is None or not self.agent.on_pull(
                        e.shard, e.iteration, e.aggregate, e.received):
                    self.counters.rejected["bad_pull"] += 1
            elif isinstance(e, CloseConnection):
                p = self.conns.get(e.conn)
                if p is not None and p.transport is not None:
                    p.transport.abort()
            elif isinstance(e, PeerLeft):
                if not e.clean:
                    log.warning("rank %d: rank %d left without BYE", self.rank, e.rank)
                if e.pushed is not None:   # its BYE: how many iterations it pushed
                    self.closed_after[e.rank] = e.pushed
                    if self.pushing is not None:
                        self._check_closed(self.pushing)
                self._check_finished()
            elif isinstance(e, PeerFailed) and not self.done.is_set():
                self.fail(e.reason, e.rank, propagate=not e.reported)

    def _on_bad(self, proto: FrameProtocol, reason: str) -> None:
        self._apply(self.control.bad_frame(proto.conn_id, reason))

    def _on_lost(self, proto: FrameProtocol, exc) -> None:
        self.conns.pop(proto.conn_id, None)
        if self.done.is_set():
            return   # we are shutting down
        self._apply(self.control.lost(proto.conn_id, time.monotonic()))

    def _arm_timer(self) -> None:
        """Keep one timer armed for the shard's earliest post-END deadline."""
        d = self.shard.session.next_deadline()
        if d is None or (self.timer is not None and self.timer_at <= d):
            return
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = d
        self.timer = asyncio.get_running_loop().call_later(
            max(0.0, d - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.shard is not None:
            self.shard.handle(self.shard.session.poll(time.monotonic()))
            self._arm_timer()

    # -- shutdown ---------------------------------------------------------------------
    def fail(self, message: str, rank: int | None, propagate: bool = True,
             level: int = logging.ERROR) -> None:
        """Fail the job: tell peers (ERROR, block = failed rank) and the trainer; stop.
        ``level``: how the line is logged (a signal's stop is WARNING, not ERROR)."""
        if self.done.is_set():
            return
        self.failed = PeerFailure(message, rank)
        log.log(level, "rank %d: %s", self.rank, message)
        try:   # telling the others is best effort; stopping is not
            if propagate:
                frame = wire.encode(MsgType.ERROR, session=self.session_id,
                                    sender=self.rank,
                                    block=rank if rank is not None else 0xFFFFFFFF,
                                    payload=message.encode()[:1000], key=self.key)
                for conn in self._peer_conns():
                    conn.send(frame)
            self._to_trainer({"op": "error", "rank": rank, "message": message})
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
        bye = wire.encode(MsgType.BYE, session=self.session_id, sender=self.rank,
                          count=self.pushes, key=self.key)
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
        peers = set(self.peers) - {self.rank}
        if self.finishing and self.left >= peers:
            self.done.set()

    def _finish_timeout(self) -> None:
        if not self.done.is_set():
            log.warning("rank %d: no BYE from rank(s) %s within %.0f s; stopping", self.rank,
                        sorted(set(self.peers) - {self.rank} - self.left),
                        self.cfg.peer_timeout_s)
            self.done.set()

    async def _drain(self, timeout_s: float) -> None:
        """Wait until every connection's send buffer is empty (PULLs, BYE, ERROR)."""
        t_end = time.monotonic() + timeout_s
        conns = list(self.out_conns.values()) + list(self.in_conns.values())
        while time.monotonic() < t_end and any(
                c.transport is not None and not c.transport.is_closing()
                and c.transport.get_write_buffer_size() for c in conns):
            await asyncio.sleep(0.01)

    def _write_report(self) -> None:
        report = {
            "rank": self.rank, "host": self.node.host, "tcp_port": self.tcp_port,
            "udp_ports": self.udp_ports, "session": f"{self.session_id:016x}",
            "pushes": self.pushes, "pulls_held": self.pulls_held,
            "failed": str(self.failed) if self.failed else None,
            "warnings": self.warnings,
            "config": {k: v for k, v in asdict(self.cfg).items() if k != "secret"},
            "deadline_finalised": self.shard.finalised_by_deadline if self.shard else 0,
            "tail_finalised": self.shard.finalised_by_tail if self.shard else 0,
            "deadline_ms_highest": 1000.0 * (self.adaptive.highest_s if self.adaptive
                                             else self.deadline_floor_s),
            "deadline_beyond_floor": self.adaptive.beyond_floor if self.adaptive else 0,
            "emulated_drops": sum(p.emulated_drops for _, p in self.udp.values()),
            "udp_gso": all(b.gso for b in self.udp_senders.values()),
            "udp_gro": self.gro,
            "pace_mbit": self.cfg.pace_mbit, "pace_source": self.pace_source,
            "udp_send_syscalls": sum(b.syscalls for b in self.udp_senders.values()),
            "udp_send_backoffs": sum(b.backoffs for b in self.udp_senders.values()),
            "udp_icmp_errors": sum(b.icmp_errors for b in self.udp_senders.values()),
            "k_mean": float(np.mean(self.agent.k_history)) if self.agent and
            self.agent.k_history else None,
            **self.counters.to_dict(self.cfg.channels),
        }
        path = os.path.join(self.node.run_dir, f"sidecar-{self.rank}.json")
        self.trace.close()   # its last line: what the counters grew since the last push
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        if self.endpoint is not None:   # the final exposition, beside the report
            from .metrics import metrics_path
            try:
                self.endpoint.write_textfile(metrics_path(self.node.run_dir, self.rank))
            except OSError as e:
                log.warning("rank %d: cannot write metrics-%d.prom: %s", self.rank,
                            self.rank, e.strerror or e)
        if self.agent is not None and self.agent.raw_sum is not None:
            np.savez(os.path.join(self.node.run_dir, f"conservation-{self.rank}.npz"),
                     raw_sum=self.agent.raw_sum.numpy(),
                     applied_sum=self.agent.applied_sum.numpy(),
                     residual=(self.agent.residual.residual.double().numpy()
                               if self.cfg.error_feedback else
                               np.zeros(self.layout.padded)))

    def _close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        for conn in list(self.out_conns.values()) + list(self.in_conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        for tr, _ in self.udp.values():
            tr.close()
        self.tcp_server.close()
        self.unix_server.close()
        if self.trainer_writer is not None:
            self.trainer_writer.close()
        for b in self.buffers:
            b.close()
        unixsock.release(self.node.socket, self.socket_owned)


def main(argv: list[str] | None = None, prog: str = "dgt sidecar") -> int:
    p = OneLineParser(prog=prog, description="Run one node's sidecar "
                      "(worker agent + colocated server shard).")
    add_sidecar_arguments(p)
    return run_from_args(p.parse_args(argv), p)


def run_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.enable()   # a crash in native code leaves its Python stack in the log
    try:
        cfg = from_args(TransmissionConfig, ns)
        node = from_args(NodeConfig, ns)
        check_resolves(node.master_addr)
        mcfg = from_args(MetricsConfig, ns)
    except ValueError as e:
        parser.error(str(e))
    if node.base_port < 0 or (node.base_port and
                              node.base_port + 10 * node.rank + cfg.channels > 65535):
        parser.error(f"--base-port {node.base_port} leaves no room for rank {node.rank}'s "
                     f"ports (base + 10*rank + {cfg.channels} must be <= 65535)")
    sock_dir = os.path.dirname(os.path.abspath(node.socket))
    if not os.path.isdir(sock_dir):
        parser.error(f"--socket: directory {sock_dir} does not exist")
    if os.path.exists(node.run_dir) and not os.path.isdir(node.run_dir):
        parser.error(f"--run-dir {node.run_dir} is a file; give a folder")
    try:
        os.makedirs(node.run_dir, mode=0o700, exist_ok=True)
    except OSError as e:
        parser.error(f"--run-dir: cannot create {node.run_dir}: {e.strerror}")
    if not os.access(node.run_dir, os.W_OK):
        parser.error(f"--run-dir {node.run_dir} is not writable")
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
        what = {errno.EADDRINUSE: f"a port of rank {node.rank} is in use (--base-port "
                                  f"{node.base_port}: TCP base+10*rank, UDP base+10*rank+c); "
                                  f"pick another --base-port or 0 for free ports",
                errno.EADDRNOTAVAIL: f"--host {node.host} is not an address of this host",
                errno.EAFNOSUPPORT: f"--host {node.host}: this host has IPv6 turned off "
                                    f"(sysctl net.ipv6.conf.all.disable_ipv6=1); give an "
                                    f"IPv4 address"}
        msg = what.get(e.errno) or (f"--host {node.host}: {e.strerror}" if isinstance(
            e, socket.gaierror) else str(e))
        print(f"dgt sidecar: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(prog="python -m dgt.sidecar"))
