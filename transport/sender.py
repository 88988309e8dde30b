"""Sans-IO push sender: one worker's push, as the messages to send and when to send them.

Modelled on aioquic's ``QuicConnection``: the caller passes in the clock, this class
returns what to send (:meth:`PushSender.datagrams_to_send`) and when to call again
(:meth:`PushSender.get_timer`), and the caller reports what the kernel took
(:meth:`PushSender.sent`). It opens no socket, never sleeps and never reads a clock, so
a test can replay any sequence of times and kernel refusals (tests/test_sender.py).

One push (docs/architecture.md, "One BSP iteration", step 2) to each remote shard:

1. the reliable blocks: one INDEXED ``BLOCKS`` frame per shard, channel 0 (TCP), from
   :meth:`PushSender.start`;
2. the unreliable blocks: one datagram per block on its channel (UDP, one DSCP per
   channel), in batches of at most 65,000 bytes (one GSO send). The shards go
   concurrently, each paced at its own share of the egress port, always the batch due
   first; a shard's UDP waits until our TCP bytes to it have left
   (``tcp_backlog``). Each channel ends with its tail marker (``END`` on that channel,
   ``TAIL_COPIES`` times, after its last block and in the same queue);
3. last, ``END`` per shard on TCP with the blocks sent on each channel.

A batch the kernel refuses (ENOBUFS, EAGAIN: a partial send) is retried after half a
batch's time at the share; a band that stays refused for ``refused_budget`` is starved
(e.g. CS1 under best-effort bulk traffic): the rest of that shard's band is dropped here,
counted as ``blocks_dropped_local`` and taken out of END's counts, so the shard does not
wait for it; error feedback keeps those blocks.

The wire bytes are byte for byte those of docs/wire.md (tests/test_wire_spec.py).

Example::

    sender = PushSender(session=sid, rank=0, key=None, counters=Counters(), pacing=p)
    for f in sender.start(t, chan, blocks, ranges, local=0, now=clock()):
        tcp[f.shard].write(f.frame)
    while not sender.done:
        for out in sender.datagrams_to_send(clock(), backlog):
            if isinstance(out, TcpFrame):
                tcp[out.shard].write(out.frame)
            else:
                sender.sent(out, udp_send(out.channel, out.shard, out.rows), clock())
        sleep_until(sender.get_timer())
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from . import wire
from .counters import Counters
from .udp_batch import MAX_GSO_BYTES
from .wire import INDEXED_BIT, MsgType

#: copies of each tail marker (dgt.transport.session: END on a UDP channel); one random
#: loss (1 % of 3 markers to each of N-1 nodes) would otherwise cost a whole deadline in
#: a third of the iterations of a 4-node job
TAIL_COPIES = 2
#: a batch due within this many seconds goes now (the event loop's timers have 1 ms
#: resolution)
SEND_EARLY_S = 0.0005
#: channel number of a block the sender drops (scheduler.assign.DROPPED, --mode topk)
DROPPED = -1


class Pacing(Protocol):
    """The pacing state the sender consults (dgt.scheduler.pacing.PortPacing).

    ``share``: bytes/s of the egress port per peer node, 0 when not paced."""

    share: float

    def delay(self, node: int, nbytes: int, now: float) -> float:
        """Take ``nbytes`` from ``node``'s bucket; seconds to wait before sending."""

    def hold(self, node: int, now: float, until: float, tokens: float = 0.0) -> None:
        """Keep at most ``tokens`` bytes and add none to ``node``'s bucket before
        ``until``."""

    def drain_wait(self, backlog: int, now: float,
                   give_up: float | None) -> tuple[float, float | None]:
        """(seconds to wait for ``backlog`` unsent TCP bytes, the give-up time)."""


@dataclass(frozen=True)
class TcpFrame:
    """A reliable message to ``shard``: ``frame`` is bytes or a list of buffers (one
    write, wire.encode_parts). ``kind``: ``"blocks"`` or ``"end"``."""

    shard: int
    frame: object
    kind: str


@dataclass(frozen=True)
class UdpBatch:
    """Datagrams for ``shard`` on UDP channel ``channel``: ``rows`` (n, datagram bytes)
    uint8, one datagram per row, sent as one GSO batch. ``tail``: the channel's tail
    markers (best effort: not retried)."""

    channel: int
    shard: int
    rows: np.ndarray = field(repr=False)
    tail: bool = False


def _shard_payloads(coded: dict, channel: int, lo: int, hi: int, n: int,
                    shard: int) -> tuple[int, np.ndarray]:
    """(coding, payloads (n, coded bytes) uint8 view) of the ``n`` blocks [lo, hi) of
    ``shard`` that ``coded[channel]`` (PushSender.add's ``coded``) holds. Raises
    ValueError when it holds another number of them than the channel sends."""
    coding, cidx, payloads = coded[channel]
    a, b = np.searchsorted(cidx, (lo, hi))
    if b - a != n:
        raise ValueError(f"coded channel {channel} holds {b - a} blocks of shard {shard}, "
                         f"the channel {n}")
    return coding, payloads[a:b]


def batch_rows(datagram_bytes: int) -> int:
    """Datagrams per GSO send (one UDP payload of at most 65,000 bytes)."""
    return max(1, MAX_GSO_BYTES // datagram_bytes)


class _Stream:
    """One shard's UDP blocks: [(channel, (n, size) uint8 datagrams)], best band first."""

    __slots__ = ("shard", "segments", "seg", "pos", "charged", "give_up", "refused_since",
                 "tailed")

    def __init__(self, shard: int, segments: list):
        self.shard, self.segments = shard, segments
        self.seg = 0             # current segment
        self.pos = 0             # next row in it
        self.charged = 0         # rows whose tokens are taken, not yet sent
        self.give_up: float | None = None   # stop waiting for its TCP backlog then
        self.refused_since: float | None = None   # first refused send of this band
        self.tailed: set[int] = set()   # channels whose tail marker is out


class Unpaced:
    """:class:`Pacing` of a port that is not paced (tools, tests)."""

    share = 0.0

    def delay(self, node: int, nbytes: int, now: float) -> float:
        return 0.0

    def hold(self, node: int, now: float, until: float, tokens: float = 0.0) -> None:
        pass

    def drain_wait(self, backlog: int, now: float,
                   give_up: float | None) -> tuple[float, float | None]:
        return 0.0, give_up


class PushSender:
    """One node's push side. ``counters``: transport.counters.Counters, updated with
    what is sent, unsent, local and dropped here. ``pacing``: see :class:`Pacing`."""

    def __init__(self, *, session: int, rank: int, key: bytes | None, counters: Counters,
                 pacing: Pacing):
        self.session, self.rank, self.key = session, rank, key
        self.counters, self.pacing = counters, pacing
        self.iteration = 0
        self.counts = np.zeros((0, wire.MAX_CHANNELS), np.int64)   # END counts per shard
        self.remote: list[int] = []
        self.done = True
        self._streams: list[_Stream] = []
        self._due: dict[int, float] = {}     # stream -> when its next batch is due
        self._inflight: set[int] = set()     # streams with a batch out, not yet sent()
        self._tails: list[UdpBatch] = []
        self._wake: list[int] = []           # idle streams given new blocks
        self.final = True
        self.ranges: list[tuple[int, int]] = []
        self.local: int | None = None

    # -- one push ---------------------------------------------------------------------
    def start(self, iteration: int, chan: np.ndarray, blocks: np.ndarray,
              ranges: list[tuple[int, int]], local: int | None, now: float,
              coded: dict | None = None) -> list[TcpFrame]:
        """Begin push ``iteration`` of every block at once. ``chan``: (n_blocks,) int8
        channel per block (0 reliable, 1..7 UDP, -1 dropped); ``blocks``: (n_blocks,
        block_elems) float32, read (not copied) until END; ``ranges``: [lo, hi) blocks
        of each shard; ``local``: the shard fed in-process (not sent here), or None;
        ``coded``: the bands sent in a reduced form, as in :meth:`add`. Returns the
        reliable frames, to send first and in order. Raises RuntimeError when the last
        push is not done. The same as :meth:`begin`, :meth:`add` of all blocks and
        :meth:`finish`."""
        self.begin(iteration, ranges, local)
        frames = self.add(np.arange(chan.size), chan, blocks, coded)
        self.finish()
        return frames

    # -- a push in parts (wait-free backpropagation) ------------------------------------
    def begin(self, iteration: int, ranges: list[tuple[int, int]],
              local: int | None) -> None:
        """Open push ``iteration`` with no block yet: :meth:`add` hands over blocks as
        they become final, :meth:`finish` says that no more come (then the tail markers
        and END go once every block added is sent). Raises RuntimeError when the last
        push is not done."""
        if not self.done:
            raise RuntimeError(f"push {iteration} started before push {self.iteration} "
                               f"sent its END")
        self.iteration, self.done, self.final = iteration, False, False
        n_shards = len(ranges)
        self.ranges, self.local = ranges, local
        self.counts = np.zeros((n_shards, wire.MAX_CHANNELS), np.int64)
        self.remote = [s for s in range(n_shards) if s != local]
        # from rank+1 on: senders start apart
        order = [(self.rank + off) % n_shards for off in range(1, n_shards + 1)]
        self._streams = [_Stream(s, []) for s in order if s != local]
        self._due, self._inflight, self._tails, self._wake = {}, set(), [], []

    def add(self, rows: np.ndarray, chan: np.ndarray, blocks: np.ndarray,
            coded: dict | None = None) -> list[TcpFrame]:
        """Blocks ``rows`` ((m,) int64 block indices, ascending, none added before in
        this push) are final, on channels ``chan`` ((m,) int8, as in :meth:`start`);
        ``blocks``: (n_blocks, block_elems) float32, the whole push's blocks (rows read,
        not copied, until END); ``coded``: channel -> (coding, block indices (m,)
        sorted, payloads (m, coded bytes) uint8) for the channels sent in a reduced
        form (dgt.codec; docs/wire.md, "Block codings"; channel 0 with
        --reliable-codec), holding every block of ``rows`` on that channel to the
        remote shards. Returns their reliable frames (one INDEXED
        ``BLOCKS`` per remote shard), to send now and in order; their UDP blocks join
        each shard's stream behind what it still has to send. Raises ValueError when a
        coded channel does not hold exactly its blocks."""
        ctr, frames = self.counters, []
        for s, (lo, hi) in enumerate(self.ranges):   # reliable first: the important blocks
            a, b = np.searchsorted(rows, (lo, hi))
            if a == b:
                continue
            rs, sc = rows[a:b], chan[a:b]
            sent = int(np.count_nonzero(sc != DROPPED))
            ctr.blocks_unsent += sc.size - sent
            if s == self.local:
                ctr.blocks_local += sent
                continue
            rel = rs[sc == 0]
            self.counts[s, 0] += rel.size
            if rel.size:
                flags = INDEXED_BIT
                if coded and 0 in coded:   # --reliable-codec: coded already
                    coding, data = _shard_payloads(coded, 0, lo, hi, rel.size, s)
                    flags |= coding << wire.CODING_SHIFT
                    parts = wire.coded_indexed_blocks_parts(rel, data)
                else:   # contiguous (tcp mode): a view of ``blocks``, no gather
                    data = blocks[rel[0]:rel[-1] + 1] if rel[-1] - rel[0] + 1 == rel.size \
                        else blocks[rel]
                    parts = wire.indexed_blocks_parts(rel, data)
                frame = wire.encode_parts(
                    MsgType.BLOCKS, session=self.session, sender=self.rank, shard=s,
                    iteration=self.iteration, channel=0, block=int(rel[0]),
                    count=rel.size, flags=flags, key=self.key, parts=parts)
                frames.append(TcpFrame(s, frame, "blocks"))
                ctr.channels[0].blocks_sent += rel.size
                ctr.channels[0].bytes_sent += sum(memoryview(b).nbytes for b in frame)
        for j, st in enumerate(self._streams):
            lo, hi = self.ranges[st.shard]
            a, b = np.searchsorted(rows, (lo, hi))
            idle = st.seg == len(st.segments)
            for c in range(1, wire.MAX_CHANNELS):
                idx = rows[a:b][chan[a:b] == c]
                self.counts[st.shard, c] += idx.size
                if not idx.size:
                    continue
                coding, data = wire.Coding.FP32, None
                if coded and c in coded:   # the payloads, coded already: this shard's
                    coding, data = _shard_payloads(coded, c, lo, hi, idx.size, st.shard)
                dgrams = wire.encode_block_datagrams(
                    session=self.session, sender=self.rank, shard=st.shard,
                    iteration=self.iteration, channel=c, indices=idx,
                    blocks=blocks[idx] if data is None else data, key=self.key,
                    coding=coding)
                st.segments.append((c, dgrams))
                ctr.channels[c].blocks_sent += idx.size
                ctr.channels[c].bytes_sent += dgrams.size
            if idle and st.seg < len(st.segments) and j not in self._inflight:
                self._wake.append(j)   # started (or restarted) by datagrams_to_send
        return frames

    def finish(self) -> None:
        """No block comes after those added: each channel's tail marker goes after its
        last block (now, for a channel already through), then END per shard."""
        self.final = True
        for st in self._streams:
            through = {c for c, _ in st.segments[:st.seg]} - \
                {c for c, _ in st.segments[st.seg:]} - st.tailed
            for c in sorted(through):
                self._tail_after(st, c)

    def datagrams_to_send(self, now: float, tcp_backlog: Callable[[int], int]) -> list:
        """What to send at ``now`` (the first call after :meth:`start` starts the UDP
        streams: call it once the reliable frames are written): tail markers first, then each stream's batch that is
        due (a :class:`UdpBatch` each; report each with :meth:`sent`), and once every
        stream is through, END per shard (:class:`TcpFrame`, then :attr:`done`).
        ``tcp_backlog(shard)``: bytes our TCP connection to it has not sent yet."""
        for j in self._wake:
            st = self._streams[j]
            # a bucket idle since the last push (or part) is full; start with one batch
            # at most, so the N-1 first batches together fit the egress queue
            size = st.segments[st.seg][1].shape[1]
            self.pacing.hold(st.shard, now, now, batch_rows(size) * size)
            self._take(j, now, tcp_backlog)
        self._wake = []
        out: list = self._tails
        self._tails = []
        waited: set[int] = set()   # streams that looked at their backlog in this call
        while True:
            ready = [j for j, at in self._due.items() if at - now <= SEND_EARLY_S
                     and j not in self._inflight and j not in waited]
            if not ready:
                break
            j = min(ready, key=self._due.__getitem__)
            st = self._streams[j]
            if not st.charged:   # its next batch, or it waits for that node's TCP
                self._take(j, now, tcp_backlog)
                if not st.charged:
                    waited.add(j)
                continue
            c, dgrams = st.segments[st.seg]
            out.append(UdpBatch(c, st.shard, dgrams[st.pos:st.pos + st.charged]))
            self._inflight.add(j)
        if self.final and not self._due and not self._inflight and not self._tails \
                and not self.done:
            out += self._end_frames()
        return out

    def sent(self, batch: UdpBatch, n: int, now: float) -> None:
        """The kernel took the first ``n`` datagrams of ``batch`` (fewer than all: it
        refused the rest: ENOBUFS, EAGAIN)."""
        if batch.tail:
            self.counters.tail_markers += n
            return
        j = next(j for j in self._inflight if self._streams[j].shard == batch.shard)
        self._inflight.discard(j)
        st = self._streams[j]
        c, dgrams = st.segments[st.seg]
        st.pos += n
        st.charged -= n
        if n:
            st.refused_since = None
        if st.charged:   # socket buffer or our own qdisc full: let it drain
            if st.refused_since is None:
                st.refused_since = now
            if now - st.refused_since < self.refused_budget(dgrams.shape[1]):
                # retry after half a batch's time at our share: a queue that is draining
                # takes it then, and a starved one costs few syscalls
                self._due[j] = now + self.retry_after(dgrams.shape[1])
                return
            dropped = dgrams.shape[0] - st.pos   # the band is starved: drop its rest
            ctr = self.counters.channels[c]
            ctr.blocks_dropped_local += dropped
            ctr.blocks_sent -= dropped
            ctr.bytes_sent -= dropped * dgrams.shape[1]
            self.counts[st.shard, c] -= dropped
            st.charged, st.pos = 0, dgrams.shape[0]
        st.refused_since = None
        if st.pos == dgrams.shape[0]:
            st.seg, st.pos = st.seg + 1, 0
            if self.final and c not in {c2 for c2, _ in st.segments[st.seg:]}:
                self._tail_after(st, c)
        if st.seg < len(st.segments):
            self._due[j] = now   # the next batch: charged in datagrams_to_send
        else:
            del self._due[j]

    def get_timer(self) -> float | None:
        """When to call :meth:`datagrams_to_send` next (the clock's seconds; in the past:
        now), or None when the push is done."""
        if self.done:
            return None
        if self._tails or self._wake or (self.final and not self._due):
            return float("-inf")
        # +inf: nothing to send until more blocks are added (or finish)
        return min(self._due.values(), default=float("inf"))

    # -- rules ------------------------------------------------------------------------
    def retry_after(self, datagram_bytes: int) -> float:
        """Seconds before a refused batch is tried again: half a batch at the share."""
        share = self.pacing.share
        batch = batch_rows(datagram_bytes) * datagram_bytes
        return max(0.0005, batch / share / 2) if share > 0 else 0.0005

    def refused_budget(self, datagram_bytes: int) -> float:
        """Seconds a band may keep refusing sends before the rest of it is dropped:
        the time our share of the port takes for 4 GSO batches (at least 2 ms), i.e. a
        queue that does not drain while higher bands go first."""
        share = self.pacing.share
        batch = batch_rows(datagram_bytes) * datagram_bytes
        return max(0.002, 4 * batch / share) if share > 0 else 0.05

    def _take(self, j: int, now: float, tcp_backlog: Callable[[int], int] | None) -> None:
        """Charge stream ``j``'s next batch to its bucket, or wait for its TCP."""
        st = self._streams[j]
        n, size = st.segments[st.seg][1].shape
        if self.pacing.share > 0 and tcp_backlog is not None:
            # a paced port: that node's TCP bytes leave first; bounded, so a peer that
            # stopped reading cannot stall our push: END still goes and the PULL wait
            # names the peer
            wait, st.give_up = self.pacing.drain_wait(tcp_backlog(st.shard), now,
                                                      st.give_up)
            if wait:
                st.charged = 0
                self._due[j] = now + wait
                # the share is the TCP's until then: no tokens saved up meanwhile
                self.pacing.hold(st.shard, now, self._due[j])
                return
        st.charged = min(batch_rows(size), n - st.pos)
        self._due[j] = now + self.pacing.delay(st.shard, st.charged * size, now)

    def _tail_after(self, st: _Stream, channel: int) -> None:
        """Channel ``channel`` to ``st``'s shard is through: its tail marker is due."""
        st.tailed.add(channel)
        self._tails.append(self._tail(channel, st.shard, int(self.counts[st.shard, channel])))

    def _tail(self, channel: int, shard: int, count: int) -> UdpBatch:
        """Channel ``channel``'s tail marker to ``shard``: END on that channel, after its
        last block and in the same queue, so the shard need not wait out the deadline
        for blocks that were lost (transport.session). Best effort: a marker that is
        refused or lost leaves the deadline in charge."""
        frame = wire.encode(MsgType.END, session=self.session, sender=self.rank,
                            shard=shard, iteration=self.iteration, channel=channel,
                            count=count, key=self.key)
        rows = np.frombuffer(frame, np.uint8)[None].repeat(TAIL_COPIES, axis=0)
        return UdpBatch(channel, shard, rows, tail=True)

    def _end_frames(self) -> list[TcpFrame]:
        """END per remote shard (TCP): the blocks sent on each channel."""
        self.done = True
        return [TcpFrame(s, wire.encode(
            MsgType.END, session=self.session, sender=self.rank, shard=s,
            iteration=self.iteration, count=int(self.counts[s].sum()),
            payload=wire.pack_end(self.counts[s]), key=self.key), "end")
            for s in self.remote]
