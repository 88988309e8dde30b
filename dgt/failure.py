"""Typed failure records: who failed, why, as data rather than log text.

When a sidecar or a trainer of ``dgt train`` fails, it writes
``<run-dir>/failure-<kind>-<rank>.json`` (``kind`` is ``sidecar`` or ``trainer``)
*before* it tells anyone else, so the record of the process that saw the fault first is
on disk by the time the others stop. The launcher (``dgt.launch``) names the failed
rank from these records, never from a log line: rewording a message changes nothing.

A record holds:

- ``kind``, ``rank``: the process that wrote it;
- ``blamed``: the ranks at fault as that process saw them (``[]``: none known, e.g. the
  store vanished, or the cause was a stranger's message, which is never a rank's fault);
- ``reason``: a ``FailureReason`` value;
- ``message``: the human sentence (free wording).
"""
from __future__ import annotations

import enum
import glob
import os
from dataclasses import asdict, dataclass, field

from .atomic import write_json
from .rank_list import rank_list
from .run_files import read_json


class FailureReason(str, enum.Enum):
    """Why a process of a job gave up (``str`` valued: the value is the record's key)."""

    #: ranks that did not answer within the timeout (PULL wait, rendezvous step): dead
    #: or frozen
    PEER_SILENT = "peer_silent"
    #: a peer's connection closed or a send to it failed: it is gone
    PEER_GONE = "peer_gone"
    #: a peer is alive, but what it sent was refused (its END did not add up): broken,
    #: or forged by someone holding the session id
    PEER_REFUSED = "peer_refused"
    #: a peer said the job failed (an ERROR frame on a verified connection, or the
    #: rendezvous store): the blamed ranks are the ones it named
    PEER_REPORTED = "peer_reported"
    #: the ranks disagree (model size, initial parameters, iteration numbers)
    MISMATCH = "mismatch"
    #: the rendezvous store is unreachable or lost (rank 0 hosts it)
    STORE_LOST = "store_lost"
    #: this node's own trainer disconnected or misbehaved
    OWN_TRAINER = "own_trainer"
    #: a shard refused this rank's own connection: another one that knew the session id
    #: held the rank's place there (a stranger, not a rank: nobody is blamed)
    IMPERSONATED = "impersonated"
    #: stopped by a signal (the launcher relays the first failure in failure.json)
    STOPPED = "stopped"
    #: a trainer of ``dgt train`` whose own code raised (an uncaught exception, e.g. its
    #: optimiser's overflow): ``message`` is the exception's one line, ``Type: message``,
    #: as the last line of the traceback in its log says it
    RAISED = "raised"
    #: a sidecar of a ``dgt train`` job stopped by a signal the launcher did not send
    #: (no failure.json): someone outside the job stopped this rank, which is the cause
    SIGNALLED = "signalled"
    #: anything else (a bug of ours, a local resource)
    OTHER = "other"


#: reasons that only repeat what another process saw first
RELAYED = (FailureReason.PEER_REPORTED, FailureReason.STOPPED)

#: what the launcher's headline says about the blamed ranks, per reason
BLAME_TEXT = {FailureReason.PEER_SILENT: "stopped answering (dead or frozen)",
              FailureReason.PEER_GONE: "went away (connection closed)",
              FailureReason.PEER_REFUSED: "sent an END that was refused (a broken or "
                                          "forged peer)",
              FailureReason.MISMATCH: "disagree with the others",
              FailureReason.STORE_LOST: "(the rendezvous store's host) went away",
              FailureReason.OWN_TRAINER: "lost their trainer",
              FailureReason.SIGNALLED: "were stopped by a signal from outside the job"}


@dataclass
class FailureRecord:
    kind: str
    rank: int
    reason: FailureReason
    message: str
    blamed: list[int] = field(default_factory=list)

    def headline_blame(self, exited_rank: int | None) -> str:
        """``rank(s) [2] stopped answering (dead or frozen)``, or "" when the record
        blames nobody but ``exited_rank`` (the rank whose exit the headline reports, when
        this is that rank's own record; None: another process's record, which names
        whom it blames even when that is the exiting rank), or only relays."""
        others = [r for r in self.blamed if r != exited_rank]
        if not others or self.reason in RELAYED:
            return ""
        return f"rank(s) {rank_list(others)} {BLAME_TEXT.get(self.reason, 'failed')}"


def record_path(run_dir: str, kind: str, rank: int) -> str:
    return os.path.join(run_dir, f"failure-{kind}-{rank}.json")


def write(run_dir: str, record: FailureRecord) -> None:
    """Write ``record`` atomically; the first record of a process wins (a later one, e.g.
    the launcher's SIGTERM after the fault, is not written). Never raises: a run dir that
    is gone or full must not keep a failing process alive."""
    path = record_path(run_dir, record.kind, record.rank)
    if os.path.exists(path):
        return
    d = asdict(record)
    d["reason"] = FailureReason(record.reason).value
    try:
        write_json(path, d)
    except OSError:
        pass


def remove(run_dir: str, kind: str, rank: int) -> None:
    """Remove ``kind`` of ``rank``'s record from ``run_dir``, if any: a sidecar does it
    once its sockets are bound, so that the record there is always its own (a
    hand-started sidecar reuses its run dir, which no launcher clears, and :func:`write`
    keeps the first record). Never raises."""
    try:
        os.unlink(record_path(run_dir, kind, rank))
    except OSError:
        pass


def read(path: str) -> FailureRecord | None:
    """One record, or None when the file is missing or malformed, or is not a regular
    file or too large (dgt.run_files.read_json: a FIFO is not waited on)."""
    try:
        d = read_json(path)
        return FailureRecord(kind=str(d["kind"]), rank=int(d["rank"]),
                             reason=FailureReason(d["reason"]), message=str(d["message"]),
                             blamed=[int(r) for r in d.get("blamed", [])])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_all(run_dir: str) -> list[FailureRecord]:
    """Every record in ``run_dir``, oldest first (by modification time)."""
    paths = sorted(glob.glob(os.path.join(run_dir, "failure-*-*.json")),
                   key=lambda p: (os.stat(p).st_mtime_ns, p))
    return [r for r in map(read, paths) if r is not None]


def own_record(records: list[FailureRecord], kind: str, rank: int
               ) -> FailureRecord | None:
    """``kind`` of ``rank``'s record, else its node's other process's (a trainer relays
    its sidecar's failure), else None."""
    return next((r for r in records if (r.kind, r.rank) == (kind, rank)), None) or \
        next((r for r in records if r.rank == rank), None)


def first_cause(records: list[FailureRecord]) -> FailureRecord | None:
    """The oldest record that does not only relay (an ERROR frame, the store, a
    signal): the process that saw the fault first wrote it before telling anyone, so it
    is older than every record it caused. None when every record relays."""
    return next((r for r in records if r.reason not in RELAYED), None)


def job_stop(run_dir: str) -> tuple[str, int | None] | None:
    """What the launcher left in ``run_dir/failure.json`` when it stopped the job for a
    failure: (its message, the failed rank or None); None when there is no such file (a
    normal stop: the launcher, systemd, Ctrl-C) or it cannot be read (not a regular
    file: dgt.run_files.read_json)."""
    try:
        info = read_json(os.path.join(run_dir, "failure.json"))
        return str(info["message"]), info.get("rank")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def closed_early(closed_after: dict[int, int], rank: int, t: int) -> tuple[int, str] | None:
    """(rank, message) of the first peer whose trainer closed before iteration ``t``
    (``closed_after``: rank -> iterations it pushed, from its BYE), as seen by ``rank``:
    it will never push ``t``, and waiting for it would end --peer-timeout-s later
    blaming it as dead or frozen. None when no peer closed early."""
    early = sorted(r for r, n in closed_after.items() if n <= t)
    if not early:
        return None
    r, n = early[0], closed_after[early[0]]
    when = f"after step {n - 1}" if n else "before its first step"
    return r, (f"rank {r} closed {when}; rank {rank} is at step {t}: every rank must run "
               f"the same number of steps")
