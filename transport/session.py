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
import math
import numbers
import operator
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
#: a GRO run's per-datagram outcome (ShardSession._settle): 0 passed the header checks,
#: then late, duplicate, delivered, then the rejection reasons
_REASONS = ("", "late", "duplicate", "", "bad_magic", "bad_version", "bad_channel",
            "too_long", "bad_length", "bad_coding", "bad_udp_message", "stray",
            "wrong_shard", "bad_sender", "stale", "future", "bad_block", "no_mac",
            "bad_mac")
_LATE, _DUP, _NEW = 1, 2, 3
_BLOCKS = int(MsgType.BLOCKS)
_CODE = {r: i for i, r in enumerate(_REASONS) if i > _NEW}


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
    from it instead of ``deadline_s``. ``key``: the job's MAC key (1 to 64 bytes), or
    None. Counters are in ``self.counters`` (per channel, plus ``rejected[reason]``).

    Raises ValueError, naming the argument, for ``n_workers`` < 1 or over 65536 (a
    sender is a u16), ``shard`` outside 0..``n_workers``-1 (one shard per worker),
    ``lo`` < 0 or ``hi`` < ``lo`` or ``hi`` over 2**32 (a block index is a u32),
    ``block_elems`` < 1,
    ``deadline_s`` that is not a finite number >= 0 (NaN would never finalise a worker),
    ``session`` outside a u64, or an empty ``key``; TypeError, naming the argument, for
    an integer argument that is not an integer (a bool included) or a ``deadline_s``
    that is not a real number (a str, a bool, None).
    """

    def __init__(self, *, session: int, shard: int, lo: int, hi: int, block_elems: int,
                 n_workers: int, deadline_s: float, key: bytes | None = None,
                 counters: Counters | None = None, deadline_policy=None):
        _check_args(session=session, shard=shard, lo=lo, hi=hi, block_elems=block_elems,
                    n_workers=n_workers, deadline_s=deadline_s)
        wire.check_key(key)
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
                return self._receive_coalesced(buf, now, size, True)
        elif len(buf) > size and size:
            run = self._receive_small_run(buf, now)
            return run if run is not None else self._receive_coalesced(buf, now, size)
        try:
            h, payload = wire.decode(buf)   # the MAC comes after the cheap checks
        except WireError as e:
            run = self._receive_small_run(buf, now)
            return run if run is not None else [self._reject(e.reason)]
        if h.type == MsgType.BLOCKS:   # the checks in the order a GRO run's are made
            pre, post = self._header_problems(h, len(buf))
            if pre:
                return [self._reject(pre)]
            if not self.lo <= h.block < self.hi:
                return [self._reject("bad_block")]
            if post:
                return [self._reject(post)]
            if self._mac is not None and not udpmac.match_one(self._mac, buf):
                return [self._reject("bad_mac")]   # decode checked len(buf)
            return self._block(h, payload, len(buf), wire.coding_of(h.flags), True)
        if self._mac is not None:   # every cheap check first: a forgery costs no hash
            bad = self._check_addressing(h) or self._outside_window(h) \
                or self._check_udp_shape(h)
            if bad:
                return [self._reject(bad)]
            if not h.flags & _MAC:
                return [self._reject("no_mac")]
            if not udpmac.match_one(self._mac, buf):   # decode checked len(buf)
                return [self._reject("bad_mac")]
            return self._tail_marker(h, len(payload), True)   # _check_udp_shape: END
        if h.flags & _MAC:   # no secret here: a MAC-flagged datagram is no job's, as
            return [self._reject("bad_udp_message")]   # in a GRO run (_receive_run)
        if wire.udp_shape_problem(h):
            return [self._reject("bad_udp_message")]
        return self._tail_marker(h, len(payload))   # END on a UDP channel

    def _header_problems(self, h: wire.Header, nbytes: int) -> tuple[str | None, str | None]:
        """A BLOCKS datagram of ``nbytes`` with the decoded header ``h``: the first check
        it fails before its block's range is checked, and the first after it (before
        the MAC), each None when it passes. One datagram and a GRO run (vectorised in
        ``_run_prefix``) make the checks in this order (docs/wire.md, "What a shard
        accepts"): without a key, the kind (a MAC flag, a TCP or multi-block kind:
        ``bad_udp_message``), the coding and its length, session, shard, sender | the
        block | the window (``stale``, ``future``); with a key, the coding and its
        length, session, shard, sender, the window, the kind | the block | ``no_mac``,
        then the MAC."""
        if wire.frame_size(h) != nbytes:
            return "bad_length", None
        payload = self.coded_payload[wire.coding_of(h.flags)]
        coded = "bad_coding" if payload < 0 else \
            "bad_length" if h.length != payload else None
        if self._mac is None:
            if h.flags & _MAC or wire.udp_shape_problem(h):
                return "bad_udp_message", None
            return coded or self._check_addressing(h), self._outside_window(h)
        return (coded or self._check_addressing(h) or self._outside_window(h)
                or wire.udp_shape_problem(h)), None if h.flags & _MAC else "no_mac"

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

    def _receive_coalesced(self, buf, now: float, size: int, block_first: bool = False
                           ) -> list:
        """Vectorised path for n datagrams of ``size`` bytes each (plus a possibly
        shorter tail, handled alone): one numpy pass over all headers, no per-block
        Python work unless a MAC must be checked. ``block_first``: the first datagram
        is a BLOCKS message of ``size`` bytes by its header."""
        n = len(buf) // size
        rows = np.frombuffer(buf, np.uint8, n * size).reshape(n, size)
        events = self._receive_run(rows, now, block_first)
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

    def _receive_run(self, rows: np.ndarray, now: float, block_first: bool = False) -> list:
        """``rows``: (n, size) uint8, n datagrams of one GRO run. Gives the events that
        the same datagrams give one by one, in their order (consecutive datagrams with
        one outcome share an event): a prefix at a time, cut after a datagram that
        finalises its worker, since those after it see the new state."""
        events: list = []
        while rows.shape[0]:
            ev, used = self._run_prefix(rows, now, block_first)
            events += ev
            rows, block_first = rows[used:], False
        return events

    def _run_prefix(self, rows: np.ndarray, now: float, block_first: bool = False
                    ) -> tuple[list, int]:
        """Take or refuse the first datagrams of ``rows``; (events, how many).
        ``block_first``: the first is a BLOCKS message of the rows' size (checked)."""
        n, size = rows.shape
        first = rows[0]
        if not block_first:
            rsize = wire.HEADER_BYTES + int.from_bytes(
                first[_LENGTH_OFFSET:_LENGTH_OFFSET + 4].tobytes(), "big") + (
                wire.MAC_BYTES if first[_FLAGS_OFFSET] & _MAC else 0)
            block_first = int(first[_TYPE_OFFSET]) == _BLOCKS and rsize >= size
        if not block_first:
            # not a block datagram of this run's size: read alone, exactly as it would
            # be if it came alone (its own header may cut it further)
            return self.receive_datagram(memoryview(first), now), 1
        head = rows[:, :wire.HEADER_BYTES]
        if not (head != head[0]).any(axis=0)[_NOT_BLOCK].any():
            return self._receive_uniform(rows, now)
        hdr = head.copy().view(wire.HEADER_DTYPE).reshape(n)
        length = hdr["length"].astype(np.int64)
        flags = hdr["flags"]
        rsizes = wire.HEADER_BYTES + length + np.where(flags & _MAC, wire.MAC_BYTES, 0)
        odd = (hdr["type"] != MsgType.BLOCKS) | (rsizes < size)
        if odd.any():   # the datagrams before the first odd one, vectorised
            k = int(np.argmax(odd))
            rows, hdr, length, flags, rsizes, n = (rows[:k], hdr[:k], length[:k],
                                                   flags[:k], rsizes[:k], k)
        coding = ((flags & wire.CODING_MASK) >> wire.CODING_SHIFT).astype(np.int64)
        payload = self.coded_payload[coding]
        channel = hdr["channel"].astype(np.int64)
        w = hdr["sender"].astype(np.int64)
        it = hdr["iteration"].astype(np.int64)
        block = hdr["block"].astype(np.int64)
        shape = (channel == RELIABLE) | ((flags & _INDEXED) != 0) | (hdr["count"] != 1)
        addressing = (("stray", hdr["session"] != self.session),
                      ("wrong_shard", hdr["shard"] != self.shard),
                      ("bad_sender", w >= self.n_workers))
        window = (("stale", it < self.iteration - 1), ("future", it > self.iteration))
        coded = (("bad_coding", payload < 0), ("bad_length", length != payload))
        bad_block = (("bad_block", (block < self.lo) | (block >= self.hi)),)
        # the order of one datagram's checks (receive_datagram, _header_problems)
        checks = [("bad_magic", hdr["magic"] != wire.MAGIC),
                  ("bad_version", hdr["version"] != wire.VERSION),
                  ("bad_channel", channel >= wire.MAX_CHANNELS),
                  ("too_long", length > wire.MAX_FRAME_PAYLOAD),
                  ("bad_length", rsizes != size)]
        if self._mac is None:
            checks += [("bad_udp_message", shape | ((flags & _MAC) != 0)), *coded,
                       *addressing, *bad_block, *window]
        else:
            checks += [*coded, *addressing, *window, ("bad_udp_message", shape),
                       *bad_block, ("no_mac", (flags & _MAC) == 0)]
        code = np.zeros(n, np.int64)
        for reason, bad in checks:
            code[(code == 0) & bad] = _CODE[reason]
        if self._mac is not None:
            idx = np.flatnonzero(code == 0)
            if idx.size:   # the run's MACs in one native call (transport.udpmac)
                good = udpmac.match(self._mac, rows, None if idx.size == n else idx)
                code[idx[~good]] = _CODE["bad_mac"]
        return self._settle(rows, code, w, it, channel, block - self.lo, coding)

    def _receive_uniform(self, rows: np.ndarray, now: float) -> tuple[list, int]:
        """Fast path for a GRO run whose headers are equal but for ``block`` (one sender,
        iteration and channel: what one GSO send produces), its first datagram a block
        of the run's size: the header is checked once, as a scalar, in the order of one
        datagram (:meth:`_header_problems`), and only the block column and the MACs are
        vectorised. Returns (events, datagrams used)."""
        n, size = rows.shape
        try:
            h = wire.decode_header(rows[0])
        except WireError as e:
            return [self._reject(e.reason, n)], n
        pre, post = self._header_problems(h, size)
        if pre:
            return [self._reject(pre, n)], n
        off = _BLOCK_OFFSET
        r = rows[:, off:off + 4].copy().view(">u4").reshape(n).astype(np.int64) - self.lo
        inside = (r >= 0) & (r < self.hi - self.lo)
        if not post and inside.all() and (self._mac is None
                                          or udpmac.match(self._mac, rows).all()):
            events = self._uniform_news(rows, r, h)   # the hot path: all new blocks
            if events is not None:
                return events, n
        code = np.where(inside, _CODE[post] if post else 0, _CODE["bad_block"])
        if self._mac is not None and not post:
            idx = None if inside.all() else np.flatnonzero(inside)
            if idx is None or idx.size:
                good = udpmac.match(self._mac, rows, idx)
                if not good.all():
                    code[(np.arange(n) if idx is None else idx)[~good]] = _CODE["bad_mac"]
        return self._settle(rows, code, np.full(n, h.sender, np.int64),
                            np.full(n, h.iteration, np.int64),
                            np.full(n, h.channel, np.int64), r,
                            np.full(n, wire.coding_of(h.flags), np.int64), h.sender)

    def _uniform_news(self, rows: np.ndarray, r: np.ndarray, h: wire.Header
                      ) -> list | None:
        """Events for a uniform run (header ``h``, shard rows ``r``) that passed every
        header check, when each of its blocks is new for the current iteration and
        only its last one (if any) completes the worker: one BlocksArrived (then the
        finalisation). None when that is not so (:meth:`_settle` then takes it)."""
        w = h.sender
        if h.iteration != self.iteration or self.finalised[w]:
            return None
        n = r.size
        first, order = self._scratch, np.arange(n)
        first[r[::-1]] = order[::-1]
        if not (first[r] == order).all() or self.received[w, r].any():
            return None
        if self.end_counts[w] is not None:
            j = self._completes_at(w, order, np.full(n, h.channel, np.int64))
            if j is not None and j != n - 1:
                return None
        coding = wire.coding_of(h.flags)
        events: list = [self._accept(w, r, h.channel, rows, coding)]
        if self.end_counts[w] is not None and self._complete(w):
            events += self._finalise(w, "complete")
        return events

    def _settle(self, rows: np.ndarray, code: np.ndarray, w: np.ndarray, it: np.ndarray,
                ch: np.ndarray, r: np.ndarray, coding: np.ndarray,
                one_worker: int | None = None) -> tuple[list, int]:
        """The state part of a run's datagrams ``rows`` ((m, size) uint8) whose header
        checks gave ``code`` ((m,) int64: 0 passed, else ``_CODE[reason]``); ``w``,
        ``it``, ``ch``, ``r`` (shard row), ``coding``: (m,) int64 per datagram;
        ``one_worker``: the sender of them all, when known. Late, duplicate (already
        received, or an earlier copy in the run) or delivered, in row order, each
        counted as one by one; the events follow the rows' order, one per stretch of
        rows with one outcome. Stops after the datagram that completes its worker
        (the rest see it finalised). Returns (events, datagrams used)."""
        m = code.size
        pend = code == 0
        stop = m
        done_by: int | None = None
        if pend.any():
            ws = np.where(pend, w, 0)
            late = pend & ((it < self.iteration) | self.finalised[ws])
            if late.any():
                li = np.flatnonzero(late)
                code[li] = np.where(self._already(w[li], it[li], r[li]), _DUP, _LATE)
            cur = np.flatnonzero(pend & ~late)
            if cur.size:
                wc, rc = w[cur], r[cur]
                order = np.arange(cur.size)
                if one_worker is not None or (wc == wc[0]).all():
                    first = self._scratch
                    first[rc[::-1]] = order[::-1]   # the first copy of a row wins
                    firsts = first[rc] == order
                else:
                    _, at = np.unique(wc * (self.hi - self.lo) + rc, return_index=True)
                    firsts = np.zeros(cur.size, bool)
                    firsts[at] = True
                fresh = firsts & ~self.received[wc, rc]
                code[cur] = np.where(fresh, _NEW, _DUP)
                news = cur[fresh]
                workers = (one_worker,) if one_worker is not None else \
                    set(w[news].tolist())
                for wk in workers:
                    if not news.size or self.end_counts[wk] is None or self.finalised[wk]:
                        continue
                    j = self._completes_at(wk, news if one_worker is not None
                                           else news[w[news] == wk], ch)
                    if j is not None and (done_by is None or j + 1 < stop):
                        stop, done_by = j + 1, wk
        if stop < m:
            code = code[:stop]
        events: list = []
        brk = code[1:] != code[:-1]
        new = code[1:] == _NEW
        if new.any():
            brk |= new & ((w[1:stop] != w[:stop - 1]) | (ch[1:stop] != ch[:stop - 1])
                          | (coding[1:stop] != coding[:stop - 1]))
        bounds = [0, *(np.flatnonzero(brk) + 1).tolist(), stop]
        lates = None
        for a, b in zip(bounds[:-1], bounds[1:]):
            k = int(code[a])
            if k == _NEW:
                events.append(self._accept(int(w[a]), r[a:b], int(ch[a]), rows[a:b],
                                           int(coding[a])))
            elif k == _DUP or k == _LATE:
                per = np.bincount(ch[a:b], minlength=wire.MAX_CHANNELS)
                for c in np.flatnonzero(per):
                    cc = self.counters.channels[c]
                    if k == _DUP:
                        cc.blocks_duplicate += int(per[c])
                    else:
                        cc.blocks_late += int(per[c])
                if k == _LATE:
                    lates = (lates or set()) | set(zip(w[a:b].tolist(), it[a:b].tolist()))
                events.append(Rejected("duplicate" if k == _DUP else "late"))
            else:
                events.append(self._reject(_REASONS[k], b - a))
        for wk, itk in sorted(lates or ()):
            self._observe_late(wk, itk)   # once per (worker, iteration) of the run
        if done_by is not None and self._complete(done_by):
            events += self._finalise(done_by, "complete")
        return events, stop

    def _completes_at(self, w: int, pos: np.ndarray, ch: np.ndarray) -> int | None:
        """The first of the run positions ``pos`` (ascending: ``w``'s new blocks in the
        run, on channels ``ch[pos]``) after which ``w`` is complete (:meth:`_complete`);
        None if it is not complete after all of them."""
        counts = self.end_counts[w]
        per = self.per_channel[w]
        done = (per >= counts) | (self.tail[w] == counts)
        done[RELIABLE] = True
        j = int(pos[0])
        chp = ch[pos]
        for c in np.flatnonzero(~done):
            pc = pos[chp == c]
            k = int(counts[c] - per[c])
            if pc.size < k:
                return None
            j = max(j, int(pc[k - 1]))
        return j

    def _accept(self, w: int, r: np.ndarray, c: int, rows: np.ndarray,
                coding: int) -> BlocksArrived:
        """Deliver worker ``w``'s new blocks ``rows`` ((m, size) uint8 datagrams coded as
        ``coding``) for shard rows ``r`` on channel ``c``: count them, emit them."""
        size = rows.shape[1]
        self.received[w, r] = True
        self.channel_of[w, r] = c
        self.coding_of[w, r] = coding
        self.per_channel[w, c] += r.size
        cc = self.counters.channels[c]
        cc.blocks_delivered += r.size
        cc.bytes_delivered += r.size * size
        data = rows[:, wire.HEADER_BYTES:wire.HEADER_BYTES + self.coded_payload[coding]]
        return BlocksArrived(w, self.iteration, c, r, data if coding else data.view("<f4"),
                             coding)

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


def _check_args(*, session, shard, lo, hi, block_elems, n_workers, deadline_s) -> None:
    """ShardSession's argument checks (its docstring says which)."""
    ints = {}
    for name, v in (("session", session), ("shard", shard), ("lo", lo), ("hi", hi),
                    ("block_elems", block_elems), ("n_workers", n_workers)):
        try:
            if isinstance(v, (bool, np.bool_)):   # True is no count
                raise TypeError
            ints[name] = operator.index(v)
        except TypeError:
            raise TypeError(f"{name} must be an integer (not a bool), got "
                            f"{type(v).__name__} {v!r}") from None
    if not 0 <= ints["session"] < 1 << 64:
        raise ValueError(f"session {session} is outside a u64 (0..2**64-1)")
    if not 1 <= ints["n_workers"] <= 1 << 16:
        raise ValueError(f"n_workers {n_workers} must be 1..65536 (a sender is a u16)")
    if not 0 <= ints["shard"] < ints["n_workers"]:   # so a u16 header field too
        raise ValueError(f"shard {shard} must be 0..{ints['n_workers'] - 1} (one shard "
                         f"per worker, n_workers {n_workers})")
    if ints["lo"] < 0 or ints["hi"] < ints["lo"] or ints["hi"] > 1 << 32:
        raise ValueError(f"lo {lo}, hi {hi}: the shard's blocks [lo, hi) need "
                         "0 <= lo <= hi <= 2**32 (a block index is a u32)")
    if ints["block_elems"] < 1:
        raise ValueError(f"block_elems {block_elems} must be >= 1 (values per block)")
    if isinstance(deadline_s, numbers.Real) and not isinstance(deadline_s, (bool, np.bool_)):
        try:
            d = float(deadline_s)
        except OverflowError:   # an int beyond a float: not finite
            d = math.inf
    else:   # a str is not parsed, a bool is no number of seconds
        raise TypeError(f"deadline_s must be a number of seconds (not a bool or a str), "
                        f"got {type(deadline_s).__name__} {deadline_s!r}")
    if not (math.isfinite(d) and d >= 0):
        raise ValueError(f"deadline_s {deadline_s!r} must be a finite number of seconds "
                         ">= 0 (NaN or inf would never finalise a worker)")


def _distinct(rows: np.ndarray) -> bool:
    """No value twice in ``rows`` ((n,) int64, n >= 1). Ascending rows (what dgt's
    sender writes) are checked in one pass; any other order is sorted."""
    return bool((rows[1:] > rows[:-1]).all()) or np.unique(rows).size == rows.size
