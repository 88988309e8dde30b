"""Sans-IO session logic of a shard's receive side: validation, reassembly into bitmaps,
END accounting, deadlines and counters.

Modelled on aioquic's ``QuicConnection``: it never touches a socket. Feed it datagrams
and TCP frames with the current time; it returns typed events. Call :meth:`poll` with the
time when :meth:`next_deadline` passes. Tests drive it with scripted packet sequences.

Rules (docs/architecture.md, "One BSP iteration"):
- A message with another session id is ``stray`` (replays of other runs land here).
- A BLOCKS message for the iteration before the current one, or for a worker already
  finalised, is *late*: counted per channel and dropped; but a late copy of a block that
  arrived in its iteration is a *duplicate* (a replay within the session, or the
  network's copy): it says nothing of lateness. One for an older iteration is
  ``stale`` (rejected): under BSP a datagram that trails by two iterations sat in a
  queue through a whole iteration of its sender's, or is a replay (the MAC cannot tell
  a replay within the session); the per-channel ``late`` counter stays a measure of the
  network's lateness. A later iteration is ``future``: dropped.
- After END(t) from worker w the shard finalises w when every counted block has arrived,
  or at ``now + deadline_s``; missing blocks are zero and reported in the bitmap.
- A UDP channel's tail marker (END on that channel, sent after its last block, in the same
  queue) says that channel's surviving blocks are all in: a channel whose marker came
  with the END's count needs no deadline. Queues are FIFO per band (tc-htb(8), one class
  per DSCP), so only a lost block, never a slow one, is missing when its marker arrives;
  a marker lost too falls back to the deadline.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import udpmac, wire
from .channels import RELIABLE
from .counters import Counters
from .reasons import Rejected
from .wire import INDEXED_BIT as _INDEXED, MAC_BIT as _MAC, MsgType, WireError


_BLOCK_OFFSET = wire.HEADER_DTYPE.fields["block"][1]
_TYPE_OFFSET = wire.HEADER_DTYPE.fields["type"][1]
_FLAGS_OFFSET = wire.HEADER_DTYPE.fields["flags"][1]
_LENGTH_OFFSET = wire.HEADER_DTYPE.fields["length"][1]   # the header's last field
_NOT_BLOCK = np.ones(wire.HEADER_BYTES, bool)   # header bytes every datagram of a run shares
_NOT_BLOCK[_BLOCK_OFFSET:_BLOCK_OFFSET + 4] = False


@dataclass(frozen=True, slots=True)
class BlocksArrived:
    """Blocks of ``sender`` for the current iteration. ``rows``: (n,) int64 shard-local
    block rows and ``data`` (n, block_elems) float32 LE view into the message; or, for
    one UDP block, ``rows`` an int and ``data`` (block_elems,). With a ``coding`` other
    than FP32 (wire.Coding) ``data`` holds the coded payloads instead, (n, coded bytes)
    or (coded bytes,) uint8, for the shard to decode (dgt.codec)."""

    sender: int
    iteration: int
    channel: int
    rows: np.ndarray | int
    data: np.ndarray
    coding: int = 0


@dataclass(frozen=True, slots=True)
class WorkerFinalised:
    """``sender``'s contribution to ``iteration`` is final. ``received``: (shard_blocks,)
    bool. ``reason``: 'complete' (every counted block arrived), 'tail' (the rest were
    lost: every short channel's tail marker came) or 'deadline'."""

    sender: int
    iteration: int
    received: np.ndarray
    reason: str


@dataclass(frozen=True, slots=True)
class IterationComplete:
    """Every worker is finalised for ``iteration``; the shard may aggregate and PULL."""

    iteration: int


class ShardSession:
    """Receive side of shard ``shard`` (blocks ``[lo, hi)``) for ``n_workers`` workers.

    ``deadline_s``: wait after END (see ``dgt.scheduler.deadline``). ``deadline_policy``:
    optional object with ``observe(spread_s, late)`` and ``deadline_s()`` (e.g.
    ``dgt.scheduler.deadline.AdaptiveDeadline``): the session feeds it each worker's
    arrival spread (END to last block; END to a late block) and takes each deadline
    from it instead of ``deadline_s``. ``key``: the job's MAC key, or None. Counters are in ``self.counters`` (per channel, plus
    ``rejected[reason]``).
    """

    def __init__(self, *, session: int, shard: int, lo: int, hi: int, block_elems: int,
                 n_workers: int, deadline_s: float, key: bytes | None = None,
                 counters: Counters | None = None, deadline_policy=None):
        self.session, self.shard, self.lo, self.hi = session, shard, lo, hi
        self.block_elems = block_elems
        self.block_payload = block_elems * 4
        self.datagram_bytes = wire.block_datagram_bytes(wire.Coding.FP32, block_elems,
                                                        key is not None)
        #: coding -> payload bytes of one block (-1: a coding this version does not know)
        n_codings = (wire.CODING_MASK >> wire.CODING_SHIFT) + 1
        self.coded_payload = np.array([wire.coded_payload_bytes(c, block_elems) or -1
                                       for c in range(n_codings)], np.int64)
        self.n_workers = n_workers
        self.deadline_s = deadline_s
        self.deadline_policy = deadline_policy
        self._queued = False   # inside queued(): no arrival spreads observed
        self.key = key
        # the UDP MAC's keys (transport.udpmac), derived once: a whole GRO run is
        # verified in one native call
        self._mac = udpmac.derive_keys(key) if key is not None else None
        self.counters = counters or Counters()
        self.iteration = 0
        n = hi - lo
        self.received = np.zeros((n_workers, n), bool)
        self.prev_received = np.zeros((n_workers, n), bool)   # the last iteration's
        # the channel each received row came on: a reliable copy displaces an unreliable one
        self.channel_of = np.zeros((n_workers, n), np.int8)
        self.coding_of = np.zeros((n_workers, n), np.int8)   # and its coding (wire.Coding)
        self.per_channel = np.zeros((n_workers, wire.MAX_CHANNELS), np.int64)
        self.end_counts: list[np.ndarray | None] = [None] * n_workers
        # worker -> why its last END of this iteration was refused (a live peer that
        # is not dead nor frozen: the failure names it so)
        self.end_refused: dict[int, str] = {}
        self.tail = np.full((n_workers, wire.MAX_CHANNELS), -1, np.int64)  # marker counts
        self.deadline: list[float | None] = [None] * n_workers
        self.finalised = np.zeros(n_workers, bool)
        # END arrival times (s) of this iteration and the last one; the current time
        self.end_at = np.full(n_workers, np.nan)
        self.prev_end_at = np.full(n_workers, np.nan)
        self.clock = 0.0
        self._scratch = np.zeros(n, np.int64)   # duplicate detection within one GRO run

    # -- input ------------------------------------------------------------------------
    def receive_datagram(self, buf, now: float) -> list:
        """One UDP datagram, or a GRO-coalesced run of equal-size datagrams (UDP_GRO,
        udp(7)). Never raises for bad input."""
        self.clock = now
        size = self.datagram_bytes
        if len(buf) > wire.HEADER_BYTES and buf[_TYPE_OFFSET] == MsgType.BLOCKS:
            # a GRO run of equal-size datagrams: the first one's size is the stride (each
            # row is checked against its coding's size); one message goes on below
            size = wire.HEADER_BYTES + int.from_bytes(
                buf[_LENGTH_OFFSET:_LENGTH_OFFSET + 4], "big") + (
                wire.MAC_BYTES if buf[_FLAGS_OFFSET] & _MAC else 0)
            if wire.HEADER_BYTES < size < len(buf):   # the hot path: vectorised reader
                return self._receive_coalesced(buf, now, size)
        elif len(buf) > size and size:
            run = self._receive_small_run(buf, now)
            return run if run is not None else self._receive_coalesced(buf, now, size)
        try:
            h, payload = wire.decode(buf)   # the MAC comes after the cheap checks
        except WireError as e:
            run = self._receive_small_run(buf, now)
            return run if run is not None else [self._reject(e.reason)]
        checked = self._mac is not None
        if checked:   # every cheap check first: a forgery that fails one costs no hash
            bad = self._check_addressing(h) or self._outside_window(h) \
                or self._check_udp_shape(h)
            if bad:
                return [self._reject(bad)]
            if not h.flags & _MAC:
                return [self._reject("no_mac")]
            if not udpmac.match_one(self._mac, buf):   # decode checked len(buf)
                return [self._reject("bad_mac")]
            if h.type != MsgType.BLOCKS:   # _check_udp_shape: a tail marker
                return self._tail_marker(h, len(payload), checked)
        elif h.flags & _MAC:   # no secret here: a MAC-flagged datagram is no job's, as
            return [self._reject("bad_udp_message")]   # in a GRO run (_receive_run)
        elif wire.udp_shape_problem(h):
            return [self._reject("bad_udp_message")]
        elif h.type == MsgType.END:   # a tail marker
            return self._tail_marker(h, len(payload))
        coding = wire.coding_of(h.flags)
        if self.coded_payload[coding] < 0:
            return [self._reject("bad_coding")]
        if len(payload) != self.coded_payload[coding]:
            return [self._reject("bad_length")]
        return self._block(h, payload, len(buf), coding, checked)

    def receive_frame(self, h: wire.Header, payload: memoryview, now: float) -> list:
        """One TCP frame already split by :class:`~dgt.transport.framing.Deframer`
        (header checked, MAC verified). Handles BLOCKS and END; other types are the
        adapter's business and are rejected here."""
        self.clock = now
        if h.type == MsgType.BLOCKS:
            if h.channel != RELIABLE or not h.flags & _INDEXED:
                return [self._reject("bad_tcp_blocks")]
            coding = wire.coding_of(h.flags)   # --reliable-codec: a reduced form
            try:
                idx, data = wire.unpack_indexed_blocks(payload, h.count, self.block_elems,
                                                       coding)
            except WireError as e:
                return [self._reject(e.reason)]
            rows = idx.astype(np.int64) - self.lo
            return self._blocks(h, rows, data, wire.frame_size(h), now, coding)
        if h.type == MsgType.END:
            try:
                counts = wire.unpack_end(payload)
            except WireError as e:
                return [self._reject(e.reason)]
            return self._end(h, counts, now)
        return [self._reject("unexpected_type")]

    def deliver_local(self, sender: int, iteration: int, mask: np.ndarray,
                      now: float) -> list:
        """The colocated worker's blocks were copied in-process; ``mask``:
        (shard_blocks,) bool, the blocks it sent. They are final at once."""
        if iteration != self.iteration or self.finalised[sender]:
            return [self._reject("bad_local")]
        self.received[sender] = mask
        return self._finalise(sender, "complete")

    def ends_refused(self, iteration: int) -> dict[int, str]:
        """Workers of :meth:`waiting_for` whose END of ``iteration`` came and was
        refused (a count that is not the shard's, another iteration): worker -> the
        reason counted. Empty unless ``iteration`` is the current one."""
        if iteration != self.iteration:
            return {}
        return {w: why for w, why in self.end_refused.items()
                if w in self.waiting_for(iteration)}

    def waiting_for(self, iteration: int) -> list[int]:
        """Workers whose END(iteration) has not arrived (nor been finalised): the ranks
        a stalled iteration is waiting on. Empty unless ``iteration`` is the current one."""
        if iteration != self.iteration:
            return []
        return [w for w in range(self.n_workers)
                if not self.finalised[w] and self.end_counts[w] is None]

    # -- time -------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        pending = [d for d, f in zip(self.deadline, self.finalised) if d is not None and not f]
        return min(pending) if pending else None

    def poll(self, now: float) -> list:
        """Finalise every worker whose post-END deadline has passed."""
        self.clock = now
        events: list = []
        for w in range(self.n_workers):
            d = self.deadline[w]
            if d is not None and not self.finalised[w] and now >= d:
                events += self._finalise(w, "deadline")
        return events

    def advance(self) -> None:
        """Start the next iteration (after the shard has sent its PULLs)."""
        self.iteration += 1
        self.prev_received, self.received = self.received, self.prev_received
        self.received[:] = False
        self.per_channel[:] = 0
        self.end_counts = [None] * self.n_workers
        self.end_refused = {}
        self.tail[:] = -1
        self.deadline = [None] * self.n_workers
        self.finalised[:] = False
        self.prev_end_at, self.end_at = self.end_at, self.prev_end_at
        self.end_at[:] = np.nan

    # -- internals --------------------------------------------------------------------
    def _reject(self, reason: str, n: int = 1) -> Rejected:
        """Count ``n`` messages rejected for ``reason``; one event for all of them."""
        self.counters.rejected[reason] += n
        return Rejected(reason)

    def _untimely(self, h: wire.Header, messages: int, blocks: int,
                  rows=None) -> Rejected | None:
        """The event for ``messages`` messages (``blocks`` blocks, shard rows ``rows``:
        an int or (blocks,) int64) under header ``h`` that are not for the open
        iteration, None when they are: ``stale`` (two or more behind: messages
        rejected), ``late`` (the last iteration, or this one once finalised for the
        sender: blocks counted per channel), ``future`` (messages rejected). A late
        copy of a block that arrived in its iteration is a ``duplicate`` instead, and
        says nothing of the network's lateness (:meth:`_already`). The module
        docstring says why stale is not late."""
        if h.iteration < self.iteration - 1:
            return self._reject("stale", messages)
        if h.iteration < self.iteration or (h.iteration == self.iteration
                                            and self.finalised[h.sender]):
            ch = self.counters.channels[h.channel]
            if rows is not None:
                dup = int(np.count_nonzero(self._already(h.sender, h.iteration, rows)))
                ch.blocks_duplicate += dup
                blocks -= dup
                if not blocks:
                    return Rejected("duplicate")
            ch.blocks_late += blocks
            self._observe_late(h.sender, h.iteration)
            return Rejected("late")
        if h.iteration > self.iteration:
            return self._reject("future", messages)
        return None

    def _already(self, w, iteration, rows):
        """Which of ``rows`` (int or int64 array; ``w`` and ``iteration`` scalars or
        arrays alike) of worker ``w`` already arrived in ``iteration`` (this one or the
        last): a late copy of one is a replay within the session (or a network
        duplicate), counted as a duplicate, never as late."""
        return np.where(np.asarray(iteration) == self.iteration, self.received[w, rows],
                        self.prev_received[w, rows])

    def _outside_window(self, h: wire.Header) -> str | None:
        """``stale`` or ``future`` for an iteration no message may carry now: checked
        before the MAC, so a flood of forged datagrams costs no keyed hash."""
        if h.iteration < self.iteration - 1:
            return "stale"
        if h.iteration > self.iteration:
            return "future"
        return None

    def _check_addressing(self, h: wire.Header) -> str | None:
        if h.session != self.session:
            return "stray"
        if h.shard != self.shard:
            return "wrong_shard"
        if h.sender >= self.n_workers:
            return "bad_sender"
        return None

    def _check_udp_shape(self, h: wire.Header) -> str | None:
        """The checks of a datagram's kind and block that need no key, made before its
        MAC (so a forgery that fails one costs no keyed hash): a one-block BLOCKS on a
        UDP channel within the shard's range, or a tail marker (END on a UDP channel)."""
        bad = wire.udp_shape_problem(h)
        if bad or h.type != MsgType.BLOCKS:
            return bad
        return None if self.lo <= h.block < self.hi else "bad_block"

    def _receive_coalesced(self, buf, now: float, size: int) -> list:
        """Vectorised path for n datagrams of ``size`` bytes each (plus a possibly
        shorter tail, handled alone): one numpy pass over all headers, no per-block
        Python work unless a MAC must be checked."""
        n = len(buf) // size
        rows = np.frombuffer(buf, np.uint8, n * size).reshape(n, size)
        events = self._receive_run(rows, now)
        if n * size < len(buf):   # last on the wire, so last here (a tail marker, often)
            events += self.receive_datagram(memoryview(buf)[n * size:], now)
        return events

    def _receive_small_run(self, buf, now: float) -> list | None:
        """A GRO run of equal-size datagrams that are not blocks (a tail marker and its
        copy): each on its own. None when ``buf`` is not one."""
        try:
            size = wire.frame_size(wire.decode_header(buf))
        except WireError:
            return None
        if size in (len(buf), self.datagram_bytes) or size > len(buf) or len(buf) % size:
            return None
        mv = memoryview(buf).cast("B")
        return [e for off in range(0, len(buf), size)
                for e in self.receive_datagram(mv[off:off + size], now)]

    def _receive_run(self, rows: np.ndarray, now: float) -> list:
        """``rows``: (n, size) uint8, n datagrams of one GRO run."""
        n, size = rows.shape
        events: list = []
        head = rows[:, :wire.HEADER_BYTES]
        if not (head != head[0]).any(axis=0)[_NOT_BLOCK].any():
            return events + self._receive_uniform(rows, now)
        hdr = head.copy().view(wire.HEADER_DTYPE).reshape(n)
        mac = _MAC if self.key else 0
        coding = (hdr["flags"] & wire.CODING_MASK) >> wire.CODING_SHIFT
        payload = self.coded_payload[coding]
        checks = (
            ("bad_magic", hdr["magic"] != wire.MAGIC),
            ("bad_version", hdr["version"] != wire.VERSION),
            ("bad_udp_message", (hdr["type"] != MsgType.BLOCKS) | (hdr["channel"] == RELIABLE)
             | (hdr["channel"] >= wire.MAX_CHANNELS) | (hdr["count"] != 1)
             | ((hdr["flags"] & (_INDEXED | _MAC)) != mac)),
            ("bad_coding", payload < 0),
            ("bad_length", (hdr["length"] != payload)
             | (wire.HEADER_BYTES + payload + (wire.MAC_BYTES if mac else 0) != size)),
            ("stray", hdr["session"] != self.session),
            ("wrong_shard", hdr["shard"] != self.shard),
            ("bad_sender", hdr["sender"] >= self.n_workers),
            ("bad_block", (hdr["block"] < self.lo) | (hdr["block"] >= self.hi)),
        )
        ok = np.ones(n, bool)
        for reason, bad in checks:
            bad &= ok
            if bad.any():
                self.counters.rejected[reason] += int(bad.sum())
                events.append(Rejected(reason))
                ok &= ~bad
        w_all = hdr["sender"].astype(np.int64)
        it = hdr["iteration"].astype(np.int64)
        ch_all = hdr["channel"].astype(np.int64)
        # the iteration window before the MAC: a forged run costs no keyed hash
        for reason, bad in (("future", ok & (it > self.iteration)),
                            ("stale", ok & (it < self.iteration - 1))):
            if bad.any():
                self.counters.rejected[reason] += int(bad.sum())
                events.append(Rejected(reason))
                ok &= ~bad
        if self._mac is not None and ok.any():
            # the run's MACs in one native call (transport.udpmac)
            idx = None if ok.all() else np.flatnonzero(ok)
            good = udpmac.match(self._mac, rows, idx)
            if not good.all():
                self.counters.rejected["bad_mac"] += int((~good).sum())
                events.append(Rejected("bad_mac"))
                if idx is None:
                    ok &= good
                else:
                    ok[idx[~good]] = False
        w_safe = np.where(ok, w_all, 0)
        late = ok & ((it < self.iteration) | ((it == self.iteration) & self.finalised[w_safe]))
        row_all = hdr["block"].astype(np.int64) - self.lo
        if late.any():   # a late copy of a block that arrived in its iteration: duplicate
            again = np.zeros(n, bool)
            again[late] = self._already(w_all[late], it[late], row_all[late])
            if again.any():
                for c, k in zip(*np.unique(ch_all[again], return_counts=True)):
                    self.counters.channels[c].blocks_duplicate += int(k)
                events.append(Rejected("duplicate"))
                ok &= ~again
                late &= ~again
        if late.any():
            for c, k in zip(*np.unique(ch_all[late], return_counts=True)):
                self.counters.channels[c].blocks_late += int(k)
            for wk, itk in np.unique(np.stack([w_all[late], it[late]]), axis=1).T:
                self._observe_late(int(wk), int(itk))   # once per (worker, iteration)
            events.append(Rejected("late"))
        cur = ok & ~late   # future and stale left ``ok`` before the MAC
        idx = np.flatnonzero(cur)
        # one coding per run in practice (one band, one socket); a mix is split
        for wk, ck in (np.unique(np.stack([w_all[idx], coding[idx]]), axis=1).T
                       if idx.size else ()):
            sel = idx[(w_all[idx] == wk) & (coding[idx] == ck)]
            events += self._deliver(int(wk), row_all[sel], ch_all[sel], rows[sel],
                                    int(ck))
        return events

    def _receive_uniform(self, rows: np.ndarray, now: float) -> list:
        """Fast path for a GRO run whose headers are equal but for ``block`` (one sender,
        iteration and channel: what one GSO send produces): the header is checked once,
        as a scalar, and only the block column is vectorised. With a key the MACs are
        checked after the window and before anything is counted as late or delivered."""
        n = rows.shape[0]
        try:
            h = wire.decode_header(rows[0])
        except WireError as e:
            return [self._reject(e.reason, n)]
        bad = self._check_addressing(h)
        if h.type != MsgType.BLOCKS or h.channel == RELIABLE or h.count != 1 \
                or h.flags & (_INDEXED | _MAC) != (_MAC if self._mac else 0):
            bad = "bad_udp_message"
        elif self.coded_payload[wire.coding_of(h.flags)] < 0:
            bad = "bad_coding"
        elif h.length != self.coded_payload[wire.coding_of(h.flags)] \
                or wire.frame_size(h) != rows.shape[1]:
            bad = "bad_length"
        if bad:
            return [self._reject(bad, n)]
        off = _BLOCK_OFFSET   # same order of checks as one datagram (_block)
        r = rows[:, off:off + 4].copy().view(">u4").reshape(n).astype(np.int64) - self.lo
        events: list = []
        inside = (r >= 0) & (r < self.hi - self.lo)
        if not inside.all():
            events.append(self._reject("bad_block", int(n - inside.sum())))
            rows, r = rows[inside], r[inside]
            if not r.size:
                return events
        w, ch = h.sender, h.channel
        if self._mac is not None:   # the window, then the MACs, before any counter moves
            bad = self._outside_window(h)
            if bad:
                return events + [self._reject(bad, r.size)]
            good = udpmac.match(self._mac, rows)
            if not good.all():
                events.append(self._reject("bad_mac", int((~good).sum())))
                rows, r = rows[good], r[good]
                if not r.size:
                    return events
        untimely = self._untimely(h, r.size, r.size, r)
        if untimely is not None:
            return events + [untimely]
        return events + self._deliver(w, r, np.full(r.size, ch, np.int64), rows,
                                      wire.coding_of(h.flags))

    def _deliver(self, w: int, r: np.ndarray, chs: np.ndarray, rows: np.ndarray,
                 coding: int = 0) -> list:
        """Accept worker ``w``'s datagrams ``rows`` ((m, size) uint8, coded as
        ``coding``) for shard rows ``r`` on channels ``chs`` (both (m,) int64): drop
        duplicates (already received, or twice in this run), count, and emit the
        blocks."""
        if not r.size:
            return []
        first, order = self._scratch, np.arange(r.size)
        first[r[::-1]] = order[::-1]   # the first copy of a row wins, as one by one
        fresh = (first[r] == order) & ~self.received[w, r]
        if not fresh.all():
            dup = np.bincount(chs[~fresh], minlength=wire.MAX_CHANNELS)
            for c in np.flatnonzero(dup):
                self.counters.channels[c].blocks_duplicate += int(dup[c])
            r, chs, rows = r[fresh], chs[fresh], rows[fresh]
            if not r.size:
                return [Rejected("duplicate")]
        size = rows.shape[1]
        self.received[w, r] = True
        self.channel_of[w, r] = chs
        self.coding_of[w, r] = coding
        per = np.bincount(chs, minlength=wire.MAX_CHANNELS)
        self.per_channel[w] += per
        for c in np.flatnonzero(per):
            cc = self.counters.channels[c]
            cc.blocks_delivered += int(per[c])
            cc.bytes_delivered += int(per[c]) * size
        data = rows[:, wire.HEADER_BYTES:wire.HEADER_BYTES + self.coded_payload[coding]]
        events: list = [BlocksArrived(w, self.iteration, int(chs[0]), r,
                                      data if coding else data.view("<f4"), coding)]
        if self.end_counts[w] is not None and not self.finalised[w] and self._complete(w):
            events += self._finalise(w, "complete")
        return events

    def _block(self, h: wire.Header, payload: memoryview, nbytes: int,
               coding: int = 0, checked: bool = False) -> list:
        """Fast path for one UDP block: scalar checks, no per-datagram array work.
        ``checked``: the addressing and the block's range were checked (before a MAC)."""
        row = h.block - self.lo
        if not checked:
            bad = self._check_addressing(h)
            if bad:
                return [self._reject(bad)]
            if not 0 <= row < self.hi - self.lo:
                return [self._reject("bad_block")]
        w = h.sender
        ch = self.counters.channels[h.channel]
        untimely = self._untimely(h, 1, 1, row)
        if untimely is not None:
            return [untimely]
        if self.received[w, row]:
            ch.blocks_duplicate += 1
            return [Rejected("duplicate")]
        self.received[w, row] = True
        self.channel_of[w, row] = h.channel
        self.coding_of[w, row] = coding
        self.per_channel[w, h.channel] += 1
        ch.blocks_delivered += 1
        ch.bytes_delivered += nbytes
        events: list = [BlocksArrived(w, h.iteration, h.channel, row, np.frombuffer(
            payload, np.uint8 if coding else "<f4"), coding)]
        if self.end_counts[w] is not None and self._complete(w):
            events += self._finalise(w, "complete")
        return events

    def _blocks(self, h: wire.Header, rows: np.ndarray, data: np.ndarray, nbytes: int,
                now: float, coding: int = 0) -> list:
        """One reliable BLOCKS frame's blocks: shard ``rows`` ((n,) int64), ``data``
        ((n, E) float32, or (n, P) uint8 payloads in ``coding``)."""
        bad = self._check_addressing(h)
        if bad:
            return [self._reject(bad)]
        if rows.size == 0 or rows.min() < 0 or rows.max() >= self.hi - self.lo:
            return [self._reject("bad_block")]
        ch = self.counters.channels[h.channel]
        w = h.sender
        untimely = self._untimely(h, 1, rows.size, rows)
        if untimely is not None:
            return [untimely]
        if not _distinct(rows):   # a sender never repeats a block in a frame
            return [self._reject("bad_block")]
        seen = self.received[w, rows]
        if seen.any():
            seen = self._displace(w, rows, seen)
        events: list = []
        if seen.any():   # only those rows: a stray copy must not cost the whole frame
            ch.blocks_duplicate += int(seen.sum())
            rows, data = rows[~seen], data[~seen]
            nbytes = nbytes * rows.size // seen.size
            events.append(Rejected("duplicate"))
        if not rows.size:
            return events
        self.received[w, rows] = True
        self.channel_of[w, rows] = RELIABLE
        self.coding_of[w, rows] = coding
        self.per_channel[w, h.channel] += rows.size
        ch.blocks_delivered += rows.size
        ch.bytes_delivered += nbytes
        events.append(BlocksArrived(w, h.iteration, h.channel, rows, data, coding))
        if self.end_counts[w] is not None and self._complete(w):
            events += self._finalise(w, "complete")
        return events

    def _displace(self, w: int, rows: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """TCP ``rows`` of worker ``w`` that ``seen`` says were received already: the
        ones that came on an unreliable channel are given up, so the reliable copy is
        stored instead (a sender puts a block on one channel only, so the UDP copy was a
        forgery or a stray; the reliable copy, on the connection that said HELLO, is the
        one to keep). Their UDP delivery is recounted as a duplicate on that channel.
        Returns the rows that stay duplicates (received over TCP already)."""
        chans = self.channel_of[w, rows].astype(np.int64)
        udp = seen & (chans != RELIABLE)
        if not udp.any():
            return seen
        gone = rows[udp]
        self.received[w, gone] = False
        per = np.bincount(chans[udp], minlength=wire.MAX_CHANNELS)
        size = (self.coded_payload[self.coding_of[w, gone]] + self.datagram_bytes
                - self.block_payload)   # each copy's datagram bytes, by its coding
        nbytes = np.bincount(chans[udp], weights=size, minlength=wire.MAX_CHANNELS)
        self.per_channel[w] -= per
        for c in np.flatnonzero(per):
            cc = self.counters.channels[c]
            cc.blocks_delivered -= int(per[c])
            cc.bytes_delivered -= int(nbytes[c])
            cc.blocks_duplicate += int(per[c])
        return seen & ~udp

    def _end(self, h: wire.Header, counts: np.ndarray, now: float) -> list:
        bad = self._check_addressing(h)
        if bad:
            return [self._reject(bad)]
        w = h.sender
        if h.iteration != self.iteration or self.end_counts[w] is not None \
                or self.finalised[w] or counts.sum() > self.hi - self.lo \
                or int(counts.sum()) != h.count:
            if self.end_counts[w] is None and not self.finalised[w]:
                self.end_refused[w] = "bad_end"   # still waited for: say why
            return [self._reject("bad_end")]
        self.end_counts[w] = counts
        self.end_at[w] = now
        if self._complete(w):
            return self._finalise(w, "complete")
        p = self.deadline_policy
        self.deadline[w] = now + (p.deadline_s() if p is not None else self.deadline_s)
        return []

    def _tail_marker(self, h: wire.Header, payload_bytes: int, checked: bool = False
                     ) -> list:
        """A UDP channel's tail marker: ``h.count`` blocks were sent on ``h.channel``.
        ``checked``: the addressing was checked (before a MAC)."""
        bad = None if checked else self._check_addressing(h)
        if bad:
            return [self._reject(bad)]
        w, c = h.sender, h.channel
        if payload_bytes or h.count > self.hi - self.lo:
            return [self._reject("bad_tail")]
        if h.iteration > self.iteration:
            return [self._reject("future")]
        if h.iteration < self.iteration or self.finalised[w]:
            return []   # its worker is final already (all blocks in, or the deadline)
        if self.tail[w, c] >= 0:   # the sender sends it twice (one may be lost)
            return [] if self.tail[w, c] == h.count else [self._reject("bad_tail")]
        self.tail[w, c] = h.count
        if self.end_counts[w] is not None and self._complete(w):
            return self._finalise(w, "complete")
        return []

    def _complete(self, w: int) -> bool:
        """Every counted block of ``w`` arrived, or the rest is known lost: its channel's
        tail marker came, with the count the END gave. The reliable channel is complete
        once END is in: TCP is in order and END follows the sender's reliable blocks on
        the same connection, so one not in by then (rejected) will not come."""
        counts = self.end_counts[w]
        done = (self.per_channel[w] >= counts) | (self.tail[w] == counts)
        done[RELIABLE] = True
        return bool(done.all())

    @contextlib.contextmanager
    def queued(self):
        """Messages received inside this block were read from this host's own receive
        queue when a deadline came (the sidecar's drain): they had arrived by then, and
        when they are read says nothing of the network. So they count as delivered but
        give the deadline policy no arrival spread; else each drain would stretch the
        next wait 1.5 times, up to the ceiling."""
        self._queued = True
        try:
            yield self
        finally:
            self._queued = False

    def _observe_late(self, w: int, iteration: int) -> None:
        """A block of ``w`` for ``iteration`` came after ``w`` was finalised: its
        lateness (now minus that iteration's END) is an arrival spread."""
        if self.deadline_policy is not None and not self._queued:
            end = self.end_at[w] if iteration == self.iteration else self.prev_end_at[w]
            self.deadline_policy.observe(self.clock - float(end), late=True)   # NaN: ignored

    def _finalise(self, w: int, reason: str) -> list:
        if self.deadline_policy is not None and reason == "complete" and not \
                self._queued and not np.isnan(self.end_at[w]):   # NaN: colocated worker
            # every counted block in (or known lost by its tail marker): the spread
            self.deadline_policy.observe(max(0.0, self.clock - float(self.end_at[w])))
        self.finalised[w] = True
        self.deadline[w] = None
        counts = self.end_counts[w]
        if counts is not None:
            lost = np.maximum(counts - self.per_channel[w], 0)
            for c in np.nonzero(lost)[0]:
                self.counters.channels[c].blocks_lost += int(lost[c])
            if reason == "complete" and lost.any():
                reason = "tail"   # complete thanks to tail markers: the rest was lost
        events: list = [WorkerFinalised(w, self.iteration, self.received[w].copy(), reason)]
        if self.finalised.all():
            events.append(IterationComplete(self.iteration))
        return events


def _distinct(rows: np.ndarray) -> bool:
    """No value twice in ``rows`` ((n,) int64, n >= 1). Ascending rows (what dgt's
    sender writes) are checked in one pass; any other order is sorted."""
    return bool((rows[1:] > rows[:-1]).all()) or np.unique(rows).size == rows.size
