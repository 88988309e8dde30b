"""Sans-IO control protocol of a node's TCP connections: HELLO and its timeout, the
connection slots, BYE, ERROR, and which frames go where (PULL to the worker side, BLOCKS
and END to the shard session).

Modelled on aioquic's ``QuicConnection`` and h11: it never touches a socket and never
reads a clock. The adapter (``dgt.sidecar.Sidecar``) numbers its connections, feeds in
what happened (:meth:`accepted`, :meth:`connected`, :meth:`receive_frame`,
:meth:`bad_frame`, :meth:`lost`) with the time, applies the typed events it gets back,
and calls :meth:`handle_timer` once :meth:`next_timer` has passed.

Connection model (``docs/wire.md``, "Connections"): every worker opens one TCP
connection to every remote shard and says HELLO first; the shard sends that worker's
PULLs back on it; BYE goes both ways. An accepted connection is *pending* until its
HELLO, then a *candidate* of the rank the HELLO names, and *established* once the shard
accepted a BLOCKS or END frame on it (:meth:`confirm`). Rules, each one a defence:

- **Slots.** At most ``max_pending`` pending connections; when full, the *oldest*
  pending one from no peer's published address (else the oldest) is closed
  (``evicted_pending``) rather than the new one refused, so idle connections of a
  stranger cannot keep a peer out: a peer says HELLO in its first segment and leaves
  the pending set within a round trip. A pending connection closes after
  ``hello_timeout_s`` (``no_hello``).
- **HELLO** must carry this job's session id (a per-job random token from the
  rendezvous store), a sender other than us and below the world size, and ``shard`` =
  our rank. A HELLO that arrives before we know the session is held until we do. A
  valid HELLO for a rank that has a connection already does not replace it: both are
  candidates, and the one the shard accepts traffic on gets the PULLs. At most
  ``max_candidates`` per rank: beyond, the oldest from another address than the rank's
  published one is closed, else the newcomer (``evicted_candidate``).
- **ERROR and BYE** change state only on a *verified* connection: one we dialled
  ourselves (to the endpoint the rendezvous store gave), or any connection when frames
  carry a MAC (``--secret``). Elsewhere they are ``unverified_control``. Every node
  sends its ERROR and BYE on every connection it accepted from a peer, so a peer's real
  ERROR/BYE always arrives on the connection we dialled to it.
- **Losing a connection** fails the job (naming the rank) only for a connection we
  dialled or one that is established; a pending or candidate connection that drops is
  a stranger's (or a superseded one) and costs nothing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from . import wire
from .reasons import Event, Reason, Rejected
from .messages import REFUSED
from .wire import MsgType

#: an accepted TCP connection must send HELLO within this many seconds
HELLO_TIMEOUT_S = 10.0
#: accepted connections without HELLO at once; the oldest is evicted beyond it
MAX_PENDING_HELLO = 128
#: connections that said a valid HELLO for one rank and await its traffic
MAX_CANDIDATES_PER_RANK = 4
#: characters of a peer's ERROR text that reach the failure message
MAX_ERROR_TEXT = 500
#: a peer's lost connection fails the job this many seconds later, unless an ERROR
#: says why first: a failing peer sends ERROR on its own connection and closes the
#: other, and the two sockets' events may come in either order; without the wait a
#: survivor could blame the peer that relayed a failure instead of the one that failed
LOST_GRACE_S = 0.25


class ConnState(enum.Enum):
    PENDING = "pending"          # accepted, no valid HELLO yet
    CANDIDATE = "candidate"      # valid HELLO for ``rank``, no traffic accepted yet
    ESTABLISHED = "established"  # the shard accepted traffic on it (or we dialled it)


@dataclass(frozen=True, slots=True)
class PeerFailed(Event):
    """The job fails because of ``rank`` (None: nobody to blame). ``reported``: learnt
    from the peer's ERROR (do not send ERROR on about it)."""

    rank: int | None
    reason: str
    reported: bool = False


@dataclass(frozen=True, slots=True)
class PeerLeft(Event):
    """``rank`` is done: its BYE came (``clean``), or its connection dropped while we
    were finishing (``clean`` False). ``pushed``: the BYE's ``count``, the iterations
    that rank pushed (None without a BYE): a peer still pushing a later iteration fails
    at once naming it, instead of waiting for an END that never comes."""

    rank: int
    clean: bool
    pushed: int | None = None


@dataclass(frozen=True, slots=True)
class PullArrived(Event):
    """Shard ``shard``'s PULL of ``iteration``: ``aggregate`` (n_blocks * block_elems,)
    float32 view into the frame (copy what you keep), ``received`` (n_blocks,) bool.
    A coded PULL (``coding`` != 0, docs/wire.md "PULL") has in ``aggregate`` only the
    blocks not marked in ``coded`` ((n_blocks,) bool), in block order, and the others
    in ``payloads`` ((m, coded bytes) uint8 view, in block order), for the node side
    to decode (dgt.pull_codec.decode_pull)."""

    shard: int
    iteration: int
    aggregate: np.ndarray
    received: np.ndarray
    coding: int = 0
    coded: np.ndarray | None = None
    payloads: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class ShardFrame(Event):
    """A BLOCKS or END frame of worker ``h.sender`` for the shard session; call
    :meth:`ControlProtocol.confirm` with ``conn`` if the session accepted it."""

    conn: int
    header: wire.Header
    payload: memoryview


@dataclass(frozen=True, slots=True)
class CloseConnection(Event):
    """Abort connection ``conn`` (already counted under ``reason``)."""

    conn: int
    reason: str


@dataclass(frozen=True, slots=True)
class RefuseConnection(Event):
    """Send ERROR(``block`` = ``messages.REFUSED``, ``text``) on connection ``conn``,
    then close it once that is sent (already counted under ``reason``). It said a valid
    HELLO for ``rank``, which another connection holds: if it is that rank's own
    connection, the rank learns from the ERROR why it is cut off (``ConnectionRefused``
    there) instead of taking the close for our death."""

    conn: int
    reason: str
    rank: int
    text: str


@dataclass(frozen=True, slots=True)
class ConnectionRefused(Event):
    """Shard ``shard`` refused the connection we dialled to it (an ERROR with
    ``block`` = ``messages.REFUSED``): another connection holds our rank there, so
    someone else has this job's session id. ``text``: the shard's words."""

    shard: int
    text: str


@dataclass(slots=True)
class _Conn:
    id: int
    outgoing: bool
    opened: float
    state: ConnState
    rank: int | None = None
    held_hello: wire.Header | None = None   # came before the session id was known
    host: str | None = None                 # the source address, when known


@dataclass
class ControlProtocol:
    """Control state of node ``rank`` in a job of ``world`` nodes. ``authenticated``:
    every frame carries a verified MAC (``--secret``). ``rejected``: the counter that
    rejections are added to (``Counters.rejected``)."""

    rank: int
    world: int
    authenticated: bool
    rejected: dict = field(default_factory=dict)
    hello_timeout_s: float = HELLO_TIMEOUT_S
    max_pending: int = MAX_PENDING_HELLO
    max_candidates: int = MAX_CANDIDATES_PER_RANK
    session: int | None = None
    finishing: bool = False
    left: set = field(default_factory=set)
    conns: dict = field(default_factory=dict)       # id -> _Conn, insertion = age order
    shard_ranges: dict = field(default_factory=dict)   # rank -> (first block, n blocks)
    hosts: dict = field(default_factory=dict)   # rank -> its published addresses
    block_elems: int = 0
    lost_grace_s: float = LOST_GRACE_S
    losses: dict = field(default_factory=dict)  # rank -> when its lost connection fails us

    # -- set-up -----------------------------------------------------------------------
    def set_session(self, session: int, now: float,
                    hosts: dict[int, set[str]] | None = None) -> list:
        """The job's session id is known (rendezvous done): handle held HELLOs.
        ``hosts``: rank -> the numeric addresses it published (its UDP sockets'), used
        to choose whom to evict: never a rank's connection from its own address while
        one from elsewhere can go."""
        self.session = session
        self.hosts = {r: set(v) for r, v in (hosts or {}).items()}
        events: list = []
        for c in list(self.conns.values()):
            if c.held_hello is not None:
                h, c.held_hello = c.held_hello, None
                events += self._hello(c, h)
        return events

    def set_layout(self, shard_ranges: dict[int, tuple[int, int]], block_elems: int) -> None:
        """Shard ``r`` owns blocks ``[first, first + n)``; PULLs are checked against it."""
        self.shard_ranges, self.block_elems = dict(shard_ranges), block_elems

    # -- connections ------------------------------------------------------------------
    def accepted(self, conn: int, now: float, host: str | None = None) -> list:
        """A connection from address ``host`` was accepted. May evict the oldest pending
        one (one from no peer's address first)."""
        events: list = []
        pending = [c for c in self.conns.values() if c.state is ConnState.PENDING]
        if len(pending) >= self.max_pending:
            events.append(self._close(self._victim(pending, None), Reason.EVICTED_PENDING))
        self.conns[conn] = _Conn(conn, False, now, ConnState.PENDING, host=_plain(host))
        return events

    def _victim(self, conns: list, rank: int | None) -> _Conn:
        """The one of ``conns`` (oldest first) to evict: the oldest whose address is not
        ``rank``'s (any peer's, for None), else the oldest."""
        if rank is None:
            known = set().union(*self.hosts.values()) if self.hosts else set()
        else:
            known = self.hosts.get(rank, set())
        return next((c for c in conns if c.host not in known), conns[0])

    def connected(self, conn: int, rank: int, now: float) -> None:
        """We dialled ``rank``'s shard on ``conn`` (and sent HELLO)."""
        self.conns[conn] = _Conn(conn, True, now, ConnState.ESTABLISHED, rank)

    def confirm(self, conn: int) -> list:
        """The shard accepted traffic on ``conn``: it is its rank's connection now, for
        good. dgt never reconnects, so once a rank's connection is established no other
        takes its place: the rank's other candidates are refused now, and a later HELLO
        for it too (``rank_taken``, :class:`RefuseConnection`)."""
        c = self.conns.get(conn)
        if c is None or c.state is not ConnState.CANDIDATE or \
                self._established(c.rank) is not None:
            return []
        c.state = ConnState.ESTABLISHED
        return [self._refuse(o, c.rank, Reason.RANK_TAKEN) for o in list(self.conns.values())
                if o.rank == c.rank and not o.outgoing and o.state is ConnState.CANDIDATE]

    def _established(self, rank: int | None) -> "_Conn | None":
        """The accepted connection established for ``rank``, if any."""
        for o in self.conns.values():
            if o.rank == rank and not o.outgoing and o.state is ConnState.ESTABLISHED:
                return o
        return None

    def lost(self, conn: int, now: float) -> list:
        """``conn`` closed (by the peer, by us, or by an error). A peer's: PeerLeft
        while finishing, else PeerFailed from :meth:`handle_timer` ``lost_grace_s``
        later (:data:`LOST_GRACE_S`), unless an ERROR of a peer fails the job first."""
        c = self.conns.pop(conn, None)
        if c is None or c.rank is None or c.rank in self.left:
            return []
        if not c.outgoing and c.state is not ConnState.ESTABLISHED:
            return []   # a stranger's, or superseded: nobody is blamed for it
        if self.finishing:   # our work is done; its own launcher reports the death
            self.left.add(c.rank)
            return [PeerLeft(c.rank, clean=False)]
        self.losses.setdefault(c.rank, now + self.lost_grace_s)
        return []

    def _lost_due(self, now: float) -> list:
        """The lost connections whose grace ended by ``now``: PeerFailed each (PeerLeft
        for one that said BYE meanwhile or while we finish)."""
        events: list = []
        for rank, due in sorted(self.losses.items(), key=lambda x: x[1]):
            if due > now:
                continue
            del self.losses[rank]
            if rank in self.left:
                continue
            if self.finishing:
                self.left.add(rank)
                events.append(PeerLeft(rank, clean=False))
            else:
                events.append(PeerFailed(rank, f"lost connection to rank {rank} "
                                               f"(process died or network down)"))
        return events

    def bad_frame(self, conn: int, reason: str) -> list:
        """The deframer refused ``conn``'s stream (``reason``, a WireError's); the
        adapter aborts it. Counted here."""
        return [self._reject(reason)]

    # -- frames -----------------------------------------------------------------------
    def receive_frame(self, conn: int, h: wire.Header, payload: memoryview,
                      now: float) -> list:
        """One whole frame (header checked, MAC verified by the deframer when keyed)."""
        c = self.conns.get(conn)
        if c is None:
            return []
        if c.state is ConnState.PENDING:
            return self._hello(c, h)
        if h.session != self.session:
            return [self._close(c, Reason.STRAY)]
        if h.sender != c.rank:
            return [self._reject(Reason.WRONG_SENDER)]
        t = h.type
        if t == MsgType.HELLO:
            return [self._reject(Reason.DUPLICATE_HELLO)]
        if t in (MsgType.ERROR, MsgType.BYE):
            if not (c.outgoing or self.authenticated):
                return [self._reject(Reason.UNVERIFIED_CONTROL)]
            if t == MsgType.BYE:
                if h.length:   # BYE's payload is empty (checked)
                    return [self._reject(Reason.BAD_LENGTH)]
                self.left.add(c.rank)
                return [PeerLeft(c.rank, clean=True, pushed=h.count)]
            text = bytes(payload[:4 * MAX_ERROR_TEXT]).decode("utf-8", "replace")
            text = "".join(ch if ch.isprintable() else "?" for ch in text[:MAX_ERROR_TEXT])
            if h.block == REFUSED and c.outgoing:   # our connection, cut off there
                return [ConnectionRefused(h.sender, text)]
            blamed = h.block if h.block < self.world else None
            return [PeerFailed(blamed, f"rank {h.sender} reports: {text}", reported=True)]
        if t == MsgType.PULL and c.outgoing:
            return self._pull(h, payload)
        if t in (MsgType.BLOCKS, MsgType.END) and not c.outgoing:
            if c.state is ConnState.CANDIDATE and self._established(c.rank) is not None:
                return [self._reject(Reason.RANK_TAKEN)]   # a rival: never applied
            return [ShardFrame(conn, h, payload)]
        return [self._reject(Reason.UNEXPECTED_TYPE)]

    def _hello(self, c: _Conn, h: wire.Header) -> list:
        if h.type != MsgType.HELLO or h.length:   # HELLO's payload is empty (checked)
            return [self._close(c, Reason.BAD_HELLO)]
        if self.session is None:
            if c.held_hello is not None:
                return [self._close(c, Reason.DUPLICATE_HELLO)]
            c.held_hello = h
            return []
        if h.session != self.session:
            return [self._close(c, Reason.STRAY)]
        if not 0 <= h.sender < self.world or h.sender == self.rank or h.shard != self.rank:
            return [self._close(c, Reason.BAD_HELLO)]
        if self._established(h.sender) is not None:
            # the rank's own connection carries its traffic already; dgt never
            # reconnects, so this is a stranger who learnt the session id (or the rank
            # itself, if a stranger's came first: the ERROR tells it why)
            return [self._refuse(c, h.sender, Reason.RANK_TAKEN)]
        events: list = []
        rivals = [o for o in self.conns.values() if o.rank == h.sender and not o.outgoing
                  and o.state is ConnState.CANDIDATE]
        if len(rivals) >= self.max_candidates:
            # a rival from elsewhere than the rank's address goes; else the newcomer:
            # the rank's own connection came at start-up, before any HELLO could be
            # forged with a sniffed session
            known = self.hosts.get(h.sender, set())
            foreign = [o for o in rivals if o.host not in known]
            if not foreign:
                return [self._refuse(c, h.sender, Reason.EVICTED_CANDIDATE)]
            events.append(self._refuse(foreign[0], h.sender, Reason.EVICTED_CANDIDATE))
        c.state, c.rank = ConnState.CANDIDATE, h.sender
        return events

    def _pull(self, h: wire.Header, payload: memoryview) -> list:
        rng = self.shard_ranges.get(h.shard)
        if rng is None:
            return [self._reject(Reason.NOT_READY)]
        if h.shard != h.sender or (h.block, h.count) != rng:
            return [self._reject(Reason.BAD_PULL)]
        coding = wire.coding_of(h.flags)
        try:
            if coding:   # --pull-codec: plain blocks, coded blocks, two bitmaps
                agg, payloads, received, coded = wire.unpack_coded_pull(
                    payload, h.count, self.block_elems, coding)
                return [PullArrived(h.shard, h.iteration, agg, received, coding, coded,
                                    payloads)]
            agg, received = wire.unpack_pull(payload, h.count, self.block_elems)
        except wire.WireError as e:
            return [self._reject(e.reason)]
        return [PullArrived(h.shard, h.iteration, agg, received)]

    # -- time -------------------------------------------------------------------------
    def next_timer(self) -> float | None:
        """When the oldest pending connection's HELLO time runs out, or a lost
        connection's grace (:meth:`lost`), whichever is first."""
        times = list(self.losses.values())
        for c in self.conns.values():
            if c.state is ConnState.PENDING:
                times.append(c.opened + self.hello_timeout_s)
                break
        return min(times) if times else None

    def handle_timer(self, now: float) -> list:
        return [self._close(c, Reason.NO_HELLO) for c in list(self.conns.values())
                if c.state is ConnState.PENDING and now >= c.opened + self.hello_timeout_s
                ] + self._lost_due(now)

    # -- queries ----------------------------------------------------------------------
    def incoming(self) -> dict[int, int]:
        """rank -> the connection its PULLs go on: the established one, else the newest
        candidate from the rank's own address, else the newest candidate."""
        out: dict[int, int] = {}
        for c in self.conns.values():   # oldest first: newer ones overwrite
            if c.outgoing or c.rank is None:
                continue
            if c.rank not in out or self._rank_pref(c) >= self._rank_pref(
                    self.conns[out[c.rank]]):
                out[c.rank] = c.id
        return out

    def _rank_pref(self, c: _Conn) -> int:
        return 2 * (c.state is ConnState.ESTABLISHED) + (c.host in self.hosts.get(c.rank, ()))

    def peer_conns(self) -> list[int]:
        """The connections our ERROR and BYE go on: every accepted one that a HELLO tied
        to a rank (candidate or established). The peer dialled them, so they are the
        ones it trusts them on without a MAC."""
        return [c.id for c in self.conns.values() if c.rank is not None and not c.outgoing]

    def rank_of(self, conn: int) -> int | None:
        """The rank a HELLO tied ``conn`` to (or that we dialled), else None."""
        c = self.conns.get(conn)
        return c.rank if c is not None else None

    def state(self, conn: int) -> ConnState | None:
        c = self.conns.get(conn)
        return c.state if c is not None else None

    # -- internals --------------------------------------------------------------------
    def _reject(self, reason: str) -> Rejected:
        key = Reason(reason).value
        self.rejected[key] = self.rejected.get(key, 0) + 1
        return Rejected(key)

    def _close(self, c: _Conn, reason: Reason) -> CloseConnection:
        self._reject(reason)
        self.conns.pop(c.id, None)
        return CloseConnection(c.id, reason.value)

    def _refuse(self, c: _Conn, rank: int, reason: Reason) -> RefuseConnection:
        """Close ``c``, which said a valid HELLO for ``rank``, with an ERROR that tells
        ``rank``, should ``c`` be its own connection, why."""
        self._reject(reason)
        self.conns.pop(c.id, None)
        if reason is Reason.RANK_TAKEN:
            text = (f"another connection that knows this job's session id holds rank "
                    f"{rank}'s place")
        else:
            text = (f"{self.max_candidates} other connections claim rank {rank}, all "
                    f"from its address: one that knows this job's session id may hold "
                    f"its place")
        return RefuseConnection(c.id, reason.value, rank, text)


def _plain(host: str | None) -> str | None:
    """An IPv4-mapped IPv6 address as its IPv4 form, so it compares with published ones."""
    if host is not None and host.startswith("::ffff:") and "." in host:
        return host[7:]
    return host
