"""The sidecars' data path joined through memory: N worker agents (dgt.agent) and N
server shards (dgt.shard over transport.session.ShardSession) of one block layout, no
sockets, no event-loop I/O. Every BLOCKS frame and END is the real wire bytes, read back
by the shard's session; UDP rows are held "in flight" and land, in seeded shuffled order
if asked, just before their sender's END, each dropped with probability ``drop``.

Used by the tests (tests/test_inprocess.py: conservation, determinism, loss) and by
``python -m dgt.tools.bench_datapath`` (CPU per push), which also asks for the UDP rows
as GRO runs of up to 64 (as the sidecars' sockets receive them), the shards' PULL
coders, and every remote PULL through the wire (transport.messages.pull, then
transport.wire and dgt.pull_codec.decode_pull, as transport.control and dgt.sidecar
do).
"""
from __future__ import annotations

import asyncio
import random

import numpy as np

from dgt.agent import Links, WorkerAgent
from dgt.config import TransmissionConfig
from dgt.datapath import pull_coder
from dgt.layout import BlockLayout
from dgt.pull_codec import decode_pull
from dgt.shard import ServerShard
from dgt.transport import messages, wire
from dgt.transport.control import PullArrived
from dgt.transport.counters import Counters
from dgt.transport.framing import Deframer
from dgt.transport.session import ShardSession

SESSION = 0x5EED
GRO_MAX = 64   # UDP_MAX_SEGMENTS: the most datagrams one GSO send (one GRO run) holds


class Fabric:
    """``grads[r]`` ((padded,) float32): rank r's gradient in; ``aggs[r]``: its applied
    aggregate out. ``frames``: TCP frames sent, by message type; ``bitmaps[w, s]``: the
    received bitmap of shard s's last PULL to worker w.

    ``gro``: UDP rows land as runs of up to :data:`GRO_MAX` datagrams, not one by one;
    ``pull_codecs``: each shard has its ``--pull-codec`` coder (dgt.datapath.pull_coder);
    ``wire_pulls``: a remote PULL goes through its wire bytes, not handed over as
    arrays."""

    def __init__(self, cfg: TransmissionConfig, n_params: int, world: int,
                 drop: float = 0.0, seed: int = 0, shuffle: bool = False, *,
                 gro: bool = False, pull_codecs: bool = False, wire_pulls: bool = False):
        self.cfg, self.world = cfg, world
        self.lay = lay = BlockLayout.from_bytes(n_params, cfg.block_bytes, world)
        self.rng = random.Random(seed)
        self.drop, self.shuffle, self.gro, self.wire_pulls = drop, shuffle, gro, wire_pulls
        self.pending: list[list[bytes]] = [[] for _ in range(world)]  # per shard
        self.grads = [np.zeros(lay.padded, np.float32) for _ in range(world)]
        self.aggs = [np.zeros(lay.padded, np.float32) for _ in range(world)]
        self.shards, self.agents = [], []
        self.frames: dict[int, int] = {}
        self.bitmaps: dict[tuple[int, int], np.ndarray] = {}
        for r in range(world):
            sess = ShardSession(session=SESSION, shard=r, lo=lay.shard_lo(r),
                                hi=lay.shard_hi(r), block_elems=lay.block_elems,
                                n_workers=world, deadline_s=0.0, counters=Counters())
            self.shards.append(ServerShard(lay, r, sess, self._pull_from(r),
                                           pull_coder(cfg, lay, r) if pull_codecs else None))
        for r in range(world):
            links = Links(send_tcp=self._tcp_to, send_udp=self._udp_to,
                          local_push=self.shards[r].local_push)
            self.agents.append(WorkerAgent(cfg, lay, r, SESSION, None, self.grads[r],
                                           self.aggs[r], links, Counters(), seed=seed))

    def _pull_from(self, s: int):
        def on_pull(w, it, agg, received):
            self.bitmaps[w, s] = received.copy()
            if self.wire_pulls and w != s:
                agg, received = self._through_wire(s, it, agg, received)
            else:   # the colocated worker takes it in-process, as in the sidecar
                agg, received = agg.copy(), received.copy()
            self.agents[w].on_pull(s, it, agg, received)
        return on_pull

    def _through_wire(self, s: int, it: int, agg: np.ndarray, received: np.ndarray):
        """Shard ``s``'s PULL encoded and read back as the worker's sidecar reads it."""
        lay, coded = self.lay, self.shards[s].coded_pull
        frame = b"".join(bytes(p) for p in messages.pull(
            SESSION, s, it, lay.shard_lo(s), agg, received, None,
            coded.wire_parts() if coded is not None else None))
        h, payload = wire.decode(frame)
        coding = wire.coding_of(h.flags)
        if not coding:
            return wire.unpack_pull(payload, h.count, lay.block_elems)
        a, rows, rec, mask = wire.unpack_coded_pull(payload, h.count, lay.block_elems,
                                                    coding)
        return decode_pull(PullArrived(s, it, a, rec, coding, mask, rows),
                           lay.block_elems), rec

    def _tcp_to(self, s: int, frame) -> None:
        if isinstance(frame, list):   # scatter-gather parts (wire.encode_parts)
            frame = b"".join(bytes(p) for p in frame)
        shard = self.shards[s]
        for h, payload in Deframer().feed(frame):
            self.frames[h.type] = self.frames.get(h.type, 0) + 1
            if h.type == wire.MsgType.END:   # UDP "in flight" lands before END is read
                rows, self.pending[s] = self.pending[s], []
                if self.shuffle:
                    self.rng.shuffle(rows)
                for d in rows:
                    shard.handle(shard.session.receive_datagram(d, 0.0))
            shard.handle(shard.session.receive_frame(h, payload, 0.0))
        shard.handle(shard.session.poll(1e9))  # deadline: finalise with what arrived

    def _udp_to(self, channel: int, s: int, rows: np.ndarray) -> int:
        sent = len(rows)   # the kernel takes every row; the network may drop it
        if self.drop:
            rows = rows[[self.rng.random() >= self.drop for _ in range(len(rows))]]
        if self.gro:   # one GRO run per GSO send
            self.pending[s] += [rows[i:i + GRO_MAX].tobytes()
                                for i in range(0, len(rows), GRO_MAX)]
        else:
            self.pending[s] += [row.tobytes() for row in rows]
        return sent

    async def step(self, t: int, grads: list[np.ndarray], parts=()) -> None:
        """Push ``t`` on every node with ``grads`` (one float32 array per rank, at most
        n_params long). ``parts``: lists of element ranges handed over (dgt.parts)
        before the push, in turn, as the DDP hook does bucket by bucket."""
        for r, g in enumerate(grads):
            self.grads[r][:g.size] = g

        async def one(agent):
            for ranges in parts:
                agent.parts.add(t, [list(r) for r in ranges])
                await asyncio.sleep(0)   # the other agents' parts go in between
            await agent.push(t, None, 30.0)
        await asyncio.gather(*(one(a) for a in self.agents))
