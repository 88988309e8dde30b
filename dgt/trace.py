"""Per-iteration trace: one JSON line per iteration per sidecar, ``trace-<rank>.jsonl``
in the run directory.

Each line (``"kind": "iteration"``) holds, for iteration ``t`` of this node's worker:

- ``push_start_s``, ``first_sent_s``, ``reliable_sent_s``, ``end_s``, ``pull_s``
  (``{shard: s}``), ``apply_s``: wall-clock times (``time.time()``, seconds since the
  epoch) of the trainer's push (when the trainer called ``push_pull``, or the DDP hook
  got the last bucket; it passes its clock along), the iteration's first block sent to
  a remote shard (with a push in parts, dgt.parts, during backward, before
  ``push_start_s``; null on one node), the last reliable frame handed to TCP, END sent to every shard, each shard's PULL taken,
  and the aggregate applied (the trainer told);
- ``comm_s``: the communication time, ``apply - push_start`` on CLOCK_MONOTONIC (host-
  wide: the trainer and its sidecar share it, also in testbed namespaces);
- ``pull_wait_s``: from END sent to the last PULL;
- ``cpu_s``, ``cpu_sys_s``: the CPU seconds this sidecar process used (all its threads;
  user + system, and the system part; getrusage(2), in µs) since its previous line (the
  first line: since the sidecar started its trace, registration included). The kernel
  splits user from system time at its ticks, so one line's system part may be all of
  it or none; medians over many lines are what it is for;
- ``k``: the reliable fraction used; ``lost``: this worker's blocks that did not reach
  their shard (from the PULL bitmaps; blocks mode topk never sent are not lost);
- with ``--time-budget-ms`` (dgt.push_meter): ``budget_cut``, the remote blocks this
  push did not send for the budget (channel -1; also in ``blocks_unsent``);
  ``budget_allowance_bytes``, the bytes it was planned with (null before the first
  measurement); ``push_bytes`` and ``push_send_s``, what it sent and how long that
  took to leave this node (the budget's next measurement);
- ``channels``: per channel, how much each counter of ``dgt.transport.counters``
  grew since the previous line (blocks and bytes sent, delivered, late, lost, ...);
  ``blocks_unsent``, ``blocks_local``, ``tail_markers``, ``blocks_non_finite``,
  ``rejected``: the same for the node-wide counters.

At shutdown the sidecar appends one ``"kind": "final"`` line with what the counters
grew after the last iteration (late blocks, BYE-time rejects). So the sum of a file's
``channels`` deltas equals that sidecar's report counters exactly, and ``dgt train``'s
report takes its comm time from rank 0's ``comm_s`` (``comm_times_ms``): both come from
the same records (``docs/metrics.md``).
"""
from __future__ import annotations

import json
import logging
import os
import resource
import time

from .jsonparse import loads
from .metrics import TimeHistogram
from .run_files import RefusedFile, of_job, open_regular
from .transport.counters import FIELDS

log = logging.getLogger("dgt.trace")

NODE_FIELDS = ("blocks_unsent", "blocks_local", "tail_markers", "blocks_non_finite")


def trace_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"trace-{rank}.jsonl")


class Trace:
    """One sidecar's trace writer and the histograms its metrics endpoint serves.

    ``counters``: the sidecar's ``Counters``; ``n_channels``: unreliable channels. The
    file is opened at the first iteration (a sidecar that never trained writes none)."""

    def __init__(self, run_dir: str, rank: int, counters, n_channels: int):
        self.path = trace_path(run_dir, rank)
        self.rank, self.counters, self.n_channels = rank, counters, n_channels
        self.file = None
        self.failed = False
        self.error: str | None = None   # why the trace stopped (a report warning)
        self.prev = self._snapshot()
        self.comm_hist = TimeHistogram()
        self.pull_wait_hist = TimeHistogram()
        self.last_iteration = -1
        self.lost_total = 0
        self.t = None
        self.start_mono = self.start_wall = 0.0
        self.cpu_prev = resource.getrusage(resource.RUSAGE_SELF)

    def _snapshot(self) -> dict:
        ctr = self.counters
        snap = {c: [getattr(ctr.channels[c], f) for f in FIELDS]
                for c in range(self.n_channels + 1)}
        snap.update({k: getattr(ctr, k) for k in NODE_FIELDS})
        snap["rejected"] = dict(ctr.rejected)
        return snap

    def _deltas(self) -> dict:
        from .transport.channels import channel_name
        now = self._snapshot()
        prev, self.prev = self.prev, now
        out = {"channels": {channel_name(c): dict(zip(FIELDS, (a - b for a, b in
                                                               zip(now[c], prev[c]))))
                            for c in range(self.n_channels + 1)}}
        out.update({k: now[k] - prev[k] for k in NODE_FIELDS})
        out["rejected"] = {r: n - prev["rejected"].get(r, 0)
                           for r, n in now["rejected"].items()
                           if n != prev["rejected"].get(r, 0)}
        return out

    def begin(self, t: int, trainer_start_mono: float | None) -> None:
        """The trainer's push of iteration ``t`` arrived; ``trainer_start_mono``: its
        CLOCK_MONOTONIC when it called push_pull (None: now)."""
        now = time.monotonic()
        start = trainer_start_mono if trainer_start_mono is not None and \
            0 <= now - trainer_start_mono < 60 else now
        self.t, self.start_mono = t, start
        self.start_wall = time.time() - (now - start)

    def end(self, agent, k: float) -> None:
        """Iteration ``t`` is applied and the trainer told: write its line."""
        mono, wall = time.monotonic(), time.time()
        comm_s = mono - self.start_mono
        marks, pulls = agent.marks, agent.pull_at
        end_s = marks.get("end_s")
        pull_wait = max(pulls.values()) - end_s if pulls and end_s is not None else 0.0
        d = self._deltas()
        cpu, prev = resource.getrusage(resource.RUSAGE_SELF), self.cpu_prev
        self.cpu_prev = cpu
        lost = max(0, agent.not_arrived - d["blocks_unsent"])
        self.lost_total += lost
        self.last_iteration = self.t
        self.comm_hist.observe(comm_s)
        self.pull_wait_hist.observe(max(0.0, pull_wait))
        line = {"kind": "iteration", "rank": self.rank, "t": self.t,
                "push_start_s": self.start_wall,
                "first_sent_s": marks.get("first_sent_s"),
                "reliable_sent_s": marks.get("reliable_sent_s"), "end_s": end_s,
                "pull_s": {str(s): v for s, v in sorted(pulls.items())},
                "apply_s": wall, "comm_s": comm_s, "pull_wait_s": pull_wait,
                # in µs as getrusage gives them: the system part of an iteration spent
                # all in the kernel equals its total, not 1e-16 above it
                "cpu_s": round(cpu.ru_utime + cpu.ru_stime - prev.ru_utime - prev.ru_stime, 6),
                "cpu_sys_s": round(cpu.ru_stime - prev.ru_stime, 6),
                "k": k, "lost": lost, **d}
        if agent.meter is not None:   # --time-budget-ms: what it cut, what it measured
            line.update(agent.meter.last)
        self._write(line)

    def close(self) -> None:
        """Append the final line (counters' growth after the last iteration) and close.
        Writes nothing when no iteration ran."""
        if self.file is None or self.failed:
            return
        self._write({"kind": "final", "rank": self.rank, "t": self.last_iteration,
                     "time_s": time.time(), **self._deltas()})
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None

    def _write(self, line: dict) -> None:
        """Append ``line``. A run dir that is gone or full stops the trace (one warning),
        never the job: training does not depend on it."""
        if self.failed:
            return
        try:
            if self.file is None:   # a new file per run: a reused run dir starts afresh
                self.file = open(self.path, "w", buffering=1)
            self.file.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as e:
            self.failed = True
            self.error = (f"per-iteration trace {self.path} stopped at iteration "
                          f"{self.t}: {e.strerror or e}")
            log.warning("rank %d: %s", self.rank, self.error)


# -- reading ---------------------------------------------------------------------------
def parse_line(raw: bytes) -> dict | None:
    """One trace line (bytes, without its newline) as a dict, or None when it is not a
    line a sidecar writes: not UTF-8, not JSON, not an object, an iteration line whose
    fields are not numbers, or ``channels`` that are not counters (a damaged or foreign
    file; the readers skip and count it)."""
    try:
        line = loads(raw.decode("utf-8"))
    except ValueError:   # UnicodeDecodeError is one
        return None
    if not isinstance(line, dict):
        return None
    chans = line.get("channels", {})
    if not isinstance(chans, dict) or not all(
            isinstance(ch, dict) and all(_number(v) for v in ch.values())
            for ch in chans.values()):
        return None
    if line.get("kind") == "iteration" and not all(
            _number(line.get(k)) for k in _ITERATION_NUMBERS):
        return None
    return line


_ITERATION_NUMBERS = ("t", "push_start_s", "apply_s", "comm_s", "k", "lost")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: the longest trace line read (bytes): a sidecar's is a few KiB, some 2 MB with the
#: PULL times of 65536 shards; a longer one (a file that is not a trace, a sparse file of
#: zeros) is an unreadable line, counted once and never held whole
MAX_LINE = 16 << 20
#: how much of a trace is read at a time (bytes)
CHUNK = 1 << 20


class LineReader:
    """The whole lines of a trace file, read :data:`CHUNK` bytes at a time, so that no
    line longer than :data:`MAX_LINE` is held: ``feed(f)`` reads ``f`` from its
    position to its end. What follows the last newline waits in ``partial`` for the
    next ``feed`` (the sidecar is still writing it, or was killed mid-write)."""

    def __init__(self):
        self.partial = b""
        self.long = False   # in a line over MAX_LINE, already yielded as None

    def feed(self, f):
        """Yield each line of ``f`` that a newline ends (bytes, without it), and None
        once for a line longer than :data:`MAX_LINE` when it passes that length (its
        bytes are dropped as they are read). Raises OSError."""
        for chunk in iter(lambda: f.read(CHUNK), b""):
            *done, self.partial = (self.partial + chunk).split(b"\n")
            for raw in done:
                if self.long:   # the end of the long line
                    self.long = False
                else:
                    yield raw if len(raw) <= MAX_LINE else None
            if self.long:
                self.partial = b""
            elif len(self.partial) > MAX_LINE:
                self.partial, self.long = b"", True
                yield None


def read_trace(path: str, skipped: dict[str, int] | None = None) -> list[dict]:
    """The lines of one trace file (``parse_line``). A torn last line (the sidecar was
    killed while writing) is skipped; any other unreadable line (one over
    :data:`MAX_LINE` too) is skipped and counted in ``skipped[basename(path)]`` when
    ``skipped`` is given. Raises RefusedFile (an OSError) when ``path`` is not a
    regular file (dgt.run_files.open_regular: a FIFO, a device, a directory), OSError
    when it cannot be read."""
    out = []
    bad = 0
    reader = LineReader()
    with open_regular(path) as f:
        for raw in reader.feed(f):
            line = None if raw is None else parse_line(raw)
            if line is not None:
                out.append(line)
            elif raw is None or raw.strip():
                bad += 1
    last = reader.partial   # no newline after it: a whole line, or a torn one
    if last.strip():
        line = parse_line(last)
        if line is not None:
            out.append(line)
        elif not last.isascii():
            bad += 1
    if bad and skipped is not None:
        skipped[os.path.basename(path)] = bad
    return out


def skipped_note(skipped: dict[str, int], refused: dict[str, str] | None = None
                 ) -> list[str]:
    """One line per trace file with unreadable lines, e.g. ``trace-0.jsonl: 2
    unreadable lines skipped``, then one per file not read (``refused``: path -> why,
    e.g. ``run/trace-1.jsonl: a FIFO, not a regular file; skipped``)."""
    return [f"{name}: {n} unreadable line{'s' if n != 1 else ''} skipped"
            for name, n in sorted(skipped.items())] + \
        [f"{path}: {why}; skipped" for path, why in sorted((refused or {}).items())]


def read_run(run_dir: str, skipped: dict[str, int] | None = None,
             world: int | None = None, refused: dict[str, str] | None = None
             ) -> dict[int, list[dict]]:
    """{rank: trace lines} of every ``trace-<rank>.jsonl`` in ``run_dir`` (``read_trace``;
    ``skipped`` counts the unreadable lines per file); with ``world``, of ranks
    0..world-1 only (a previous job's traces of more ranks are not this job's). With
    ``refused`` (path -> why), a trace that cannot be read (not a regular file, no
    permission) is left out and said there; without it, raises that OSError
    (RefusedFile for a FIFO, a device, a directory)."""
    out = {}
    for path in of_job(os.path.join(run_dir, "trace-*.jsonl"), world):
        rank = os.path.basename(path)[len("trace-"):-len(".jsonl")]
        if not rank.isdigit():
            continue
        try:
            out[int(rank)] = read_trace(path, skipped)
        except OSError as e:
            if refused is None:
                raise
            refused[path] = unread(e)
    return dict(sorted(out.items()))


def unread(e: OSError) -> str:
    """Why a file was not read, for a note after its name: RefusedFile's ``a FIFO,
    not a regular file``, else the errno text (``Permission denied``)."""
    if isinstance(e, RefusedFile):
        return e.strerror
    return f"cannot be read ({e.strerror or e})"


def iterations(lines: list[dict]) -> list[dict]:
    return [ln for ln in lines if ln.get("kind") == "iteration"]


def comm_times_ms(lines: list[dict]) -> list[float]:
    """Comm time per iteration in ms (the report's ``comm_ms_median``/``p95`` source)."""
    return [ln["comm_s"] * 1e3 for ln in iterations(lines)]


def cpu_ms(lines: list[dict], field: str = "cpu_s") -> list[float]:
    """A sidecar's CPU per iteration in ms (``field``: ``cpu_s`` or ``cpu_sys_s``),
    without the first line (which holds the start-up); lines from before the field was
    written are left out."""
    return [ln[field] * 1e3 for ln in iterations(lines)[1:] if _number(ln.get(field))]


def channel_totals(lines: list[dict]) -> dict[str, dict[str, int]]:
    """Per channel, the sum of every line's deltas: one sidecar's counters."""
    out: dict[str, dict[str, int]] = {}
    for ln in lines:
        for name, ch in ln.get("channels", {}).items():
            acc = out.setdefault(name, dict.fromkeys(FIELDS, 0))
            for k, v in ch.items():
                acc[k] += v
    return out

