"""``dgt top RUN_DIR``: a live terminal view of a running job, every rank, with rich.

It follows the sidecars' per-iteration traces (``trace-<rank>.jsonl``, ``dgt.trace``) in
the job's run directory (``dgt train --run-dir``), or scrapes their Prometheus
endpoints (``--endpoints HOST:PORT,...``, ``dgt.metrics``), and shows per rank: the
iterations done, iterations per second, comm time (last and median of the window), k, this
worker's lost blocks, and per channel the blocks per second sent and the share of blocks
its shard lost; the test accuracy when the trainer has printed one. ``q`` quits (also
Ctrl-C). Without a terminal (``--once``) it prints the table once and exits; a rate
needs two scrapes of an endpoint, so there it is ``-``. An endpoint that does not
answer, or answers with something other than a dgt sidecar's metrics page (a web page,
forged labels), is named in the table's caption; with ``--once`` and no endpoint left,
in one error line (exit 2). A scrape has one deadline (``SCRAPE_S``, connect to last
byte, ``dgt.deadline``): an endpoint that sends a byte now and then times out too.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import re
import select
import sys
import time

from .run_files import RefusedFile, in_job, job_world, open_regular, read_json
from .trace import LineReader, iterations, parse_line, skipped_note, unread

#: trace lines per rank the rates and medians are taken over
WINDOW = 20

_ACC = re.compile(r"test acc ([0-9]+(?:\.[0-9]+)?)")


class TraceFollower:
    """Reads the new lines of every ``trace-<rank>.jsonl`` in a run dir (in chunks: a
    line over dgt.trace.MAX_LINE is counted unreadable, never held). A trace that is
    not a regular file (a FIFO, a device, a directory: dgt.run_files.open_regular) or
    cannot be read is not read, and named in :meth:`notes` while it is so."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.offsets: dict[int, int] = {}
        self.lines: dict[int, collections.deque] = {}
        self.readers: dict[int, LineReader] = {}
        self.skipped: dict[str, int] = {}   # trace file -> unreadable lines skipped
        self.refused: dict[str, str] = {}   # path -> why it was not read (last poll)
        self.world_notes: list[str] = []   # a pids.json not read (last poll)

    def poll(self) -> None:
        try:
            names = os.listdir(self.run_dir)
        except OSError:
            return
        self.refused, self.world_notes = {}, []
        # a previous job's traces of more ranks: not shown
        world = job_world(self.run_dir, self.world_notes)
        for name in names:
            m = re.fullmatch(r"trace-(\d+)\.jsonl", name)
            if not m or not in_job(int(m.group(1)), world):
                continue
            r = int(m.group(1))
            path = os.path.join(self.run_dir, name)
            reader = self.readers.setdefault(r, LineReader())
            q = self.lines.setdefault(r, collections.deque(maxlen=WINDOW))
            try:
                with open_regular(path) as f:
                    f.seek(self.offsets.get(r, 0))   # what was appended since
                    for raw in reader.feed(f):
                        self._take(name, q, raw)
                    self.offsets[r] = f.tell()
            except FileNotFoundError:   # gone since listdir
                continue
            except OSError as e:
                self.refused[path] = unread(e)
                continue
            if not reader.partial.isascii():   # a sidecar writes ASCII: not torn, damaged
                self._take(name, q, reader.partial)
                reader.partial = b""

    def _take(self, name: str, q: collections.deque, raw: bytes | None) -> None:
        """Add trace line ``raw`` (None: one over MAX_LINE) of file ``name`` to ``q``,
        or count it in ``skipped`` when it is unreadable."""
        line = None if raw is None else parse_line(raw)
        if line is not None:
            q.append(line)
        elif raw is None or raw.strip():
            self.skipped[name] = self.skipped.get(name, 0) + 1

    def notes(self) -> list[str]:
        """What was skipped, once per file, and each file not read
        (``dgt.trace.skipped_note``)."""
        return self.world_notes + skipped_note(self.skipped, self.refused)

    def rows(self) -> dict[int, dict]:
        out = {}
        for r, q in sorted(self.lines.items()):
            its = iterations(list(q))
            if not its:
                continue
            last = its[-1]
            span = last["apply_s"] - its[0]["push_start_s"]
            row = {"iterations": last["t"] + 1, "comm_ms": last["comm_s"] * 1e3,
                   "comm_ms_median": sorted(x["comm_s"] for x in its)[len(its) // 2] * 1e3,
                   "k": last["k"], "lost": sum(x["lost"] for x in its),
                   "rate": len(its) / span if span > 0 else 0.0, "channels": {}}
            for name in last["channels"]:
                sent = sum(x["channels"][name]["blocks_sent"] for x in its)
                got = sum(x["channels"][name]["blocks_delivered"] for x in its)
                lost = sum(x["channels"][name]["blocks_lost"] for x in its)
                row["channels"][name] = {
                    "blocks_per_s": sent / span if span > 0 else 0.0,
                    "loss": lost / (got + lost) if got + lost else 0.0}
            out[r] = row
        return out


#: the most ranks a job has: a rank is a 16-bit field on the wire (dgt.transport.wire)
MAX_WORLD = 1 << 16
#: the longest metrics page read from an endpoint (a sidecar's is a few KiB)
MAX_BODY = 4 << 20
#: the most one scrape of an endpoint takes, from connect to the page's last byte
SCRAPE_S = 2.0


class NotMetrics(ValueError):
    """Something answered at an endpoint, but not a dgt sidecar's metrics page."""


def _quote(text: str, n: int = 60) -> str:
    """A stranger's text for one line of ours: its first ``n`` characters, quoted, no
    control character (a page could hold terminal escapes)."""
    return repr(text[:n] + ("..." if len(text) > n else ""))


def fetch(ep: str) -> str:
    """The page at ``http://EP/metrics``, whole within :data:`SCRAPE_S` from connect to
    its last byte (``dgt.deadline.http_get``: an endpoint that sends a byte now and
    then is not waited on forever). Raises OSError when nothing answers there or the
    page is not whole by then (``TimeoutError``, ``timed out: ...``), and NotMetrics
    when what answers is not HTTP 200 with a UTF-8 page."""
    import http.client

    from .deadline import http_get
    try:
        status, reason, body = http_get(
            ep, "/metrics", SCRAPE_S, MAX_BODY + 1,
            why=f"timed out: no whole page within {SCRAPE_S:g} s")
    except http.client.HTTPException as e:
        raise NotMetrics(f"not an HTTP answer: {_quote(str(e) or type(e).__name__)}") \
            from None
    except UnicodeError:   # idna: a host name no resolver takes ('a..b')
        raise OSError(f"{ep.rsplit(':', 1)[0]} is not a host name") from None
    if status != 200:
        raise NotMetrics(f"HTTP {status} {_quote(reason)}")
    if len(body) > MAX_BODY:
        raise NotMetrics(f"a page over {MAX_BODY >> 20} MiB")
    try:
        return body.decode()
    except UnicodeDecodeError:
        raise NotMetrics("the page is not UTF-8 text") from None


def parse_page(text: str) -> tuple[int, dict]:
    """``(rank, {(name, channel or le): value})`` of a dgt sidecar's metrics page;
    values that are not finite are left out. Raises NotMetrics: not Prometheus text,
    no ``dgt_sidecar_info``, or one whose rank and world are not 0 <= rank < world <=
    MAX_WORLD."""
    from prometheus_client.parser import text_string_to_metric_families
    values: dict = {}
    info = None
    try:
        for fam in text_string_to_metric_families(text):
            for x in fam.samples:
                if x.name == "dgt_sidecar_info":
                    info = x.labels
                elif math.isfinite(x.value):
                    values[(x.name, x.labels.get("channel", x.labels.get("le", "")))] = \
                        x.value
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise NotMetrics(f"not Prometheus text: {_quote(str(e))}") from None
    if info is None:
        raise NotMetrics("no dgt_sidecar_info metric")
    rank, world = info.get("rank", ""), info.get("world", "")
    if not (_whole(rank) and _whole(world) and int(rank) < int(world) <= MAX_WORLD):
        raise NotMetrics(f"dgt_sidecar_info has rank {_quote(rank, 12)}, world "
                         f"{_quote(world, 12)}")
    return int(rank), values


def _whole_or_none(value: float | None) -> int | None:
    """A counter's value as an int; None when missing or negative."""
    return None if value is None or value < 0 else int(value)


def _whole(label: str) -> bool:
    """Whether a label is a whole number written in ASCII digits (no sign, no space)."""
    return label.isascii() and label.isdecimal() and len(label) <= 6


class EndpointPoller:
    """Scrapes each ``HOST:PORT`` endpoint and turns counters into the same rows. A rate
    needs two scrapes: until an endpoint's second, its rates are None (shown ``-``)."""

    def __init__(self, endpoints: list[str]):
        self.endpoints = endpoints
        self.prev: dict[str, tuple[float, dict]] = {}
        self.last: dict[int, dict] = {}
        #: endpoint -> (whether something answered, why its last scrape failed)
        self.errors: dict[str, tuple[bool, str]] = {}

    def poll(self) -> None:
        for ep in self.endpoints:
            try:
                rank, s = parse_page(fetch(ep))
            except NotMetrics as e:
                self.errors[ep] = (True, str(e))
                continue
            except OSError as e:
                self.errors[ep] = (False, str(getattr(e, "reason", None) or e.strerror
                                              or e))
                continue
            self.errors.pop(ep, None)
            self.last[rank] = self._row(ep, rank, s)

    def _row(self, ep: str, rank: int, s: dict) -> dict:
        """Rank ``rank``'s row from scrape ``s`` of ``ep`` and the one before it."""
        now = time.monotonic()
        t0, p = self.prev.get(ep, (now, None))
        self.prev[ep] = (now, s)
        dt = now - t0
        if p is None or dt <= 0:   # one sample: no rate yet
            dt, p = 0.0, s

        def d(key):
            return s.get(key, 0.0) - p.get(key, 0.0)

        def per_s(key):
            return d(key) / dt if dt else None
        n = d(("dgt_comm_seconds_count", ""))
        chans = sorted({k[1] for k in s if k[0] == "dgt_channel_blocks_sent_total"},
                       key=lambda c: (c != "tcp", c))
        # a value left out (not finite, breaker round 25: NaN and +Inf showed as iter 0
        # and k 0.00) or out of its range (round 26: k 7.00, iter 1e23) is shown "-",
        # as a rate of one sample is
        it = s.get(("dgt_iteration", ""))
        k = s.get(("dgt_reliable_fraction", ""))
        row = {"iterations": int(it) + 1 if it is not None and 0 <= it < 2**32 else None,
               "comm_ms": d(("dgt_comm_seconds_sum", "")) / n * 1e3 if n else
               self.last.get(rank, {}).get("comm_ms"),
               "comm_ms_median": None,
               "k": k + 0.0 if k is not None and 0 <= k <= 1 else None,   # not -0.00
               "lost": _whole_or_none(s.get(("dgt_blocks_lost_own_total", ""))),
               "rate": per_s(("dgt_comm_seconds_count", "")), "channels": {}}
        for c in chans:
            got = d(("dgt_channel_blocks_delivered_total", c))
            lost = d(("dgt_channel_blocks_lost_total", c))
            row["channels"][c] = {
                "blocks_per_s": per_s(("dgt_channel_blocks_sent_total", c)),
                "loss": None if not dt else lost / (got + lost) if got + lost else 0.0}
        return row

    def notes(self) -> list[str]:
        """Each endpoint whose last scrape failed, and why."""
        return [error_line(ep, answered, why)
                for ep, (answered, why) in self.errors.items()]

    def rows(self) -> dict[int, dict]:
        return dict(sorted(self.last.items()))


def error_line(ep: str, answered: bool, why: str) -> str:
    """Why endpoint ``ep`` gave no row: not a dgt metrics endpoint, or no answer."""
    if answered:
        return f"{ep} is not a dgt metrics endpoint ({why})"
    return f"{ep} does not answer ({why})"


#: how much of the end of ``trainer-0.log`` accuracy() reads (bytes)
LOG_TAIL = 20000


def accuracy(run_dir: str | None, notes: list[str] | None = None) -> float | None:
    """The last test accuracy rank 0's trainer reported (``trainer-0.json``) or printed
    (the last :data:`LOG_TAIL` bytes of ``trainer-0.log``), or None. A file not read
    for what it is (not a regular file, a record over dgt.run_files.MAX_RECORD, not a
    trainer's report) and an accuracy outside 0 to 1 are said in ``notes`` when given,
    and the log is read instead (breaker round 25: a report's 5.0 was shown as it was,
    a damaged report left out in silence)."""
    if not run_dir:
        return None
    path = os.path.join(run_dir, "trainer-0.json")
    if os.path.exists(path):
        try:
            doc = read_json(path)
            if not isinstance(doc, dict):
                raise ValueError(f"a JSON {type(doc).__name__}, not an object")
            acc = doc.get("final_test_accuracy")
            if _an_accuracy(acc):
                return float(acc)
            if acc is not None:   # None: the run evaluated nothing
                raise ValueError(f"final_test_accuracy = {str(acc)[:40]} is outside 0 "
                                 f"to 1")
        except RefusedFile as e:
            _refused(e, notes)
        except (OSError, ValueError) as e:
            _note(notes, f"{path}: unreadable ({str(e)[:80]}); skipped")
    try:
        with open_regular(os.path.join(run_dir, "trainer-0.log")) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL))
            found = _ACC.findall(f.read(LOG_TAIL).decode(errors="replace"))
        found = [v for v in found if _an_accuracy(float(v))]
        return float(found[-1]) if found else None
    except RefusedFile as e:
        _refused(e, notes)
    except OSError:
        pass
    return None


def _an_accuracy(value) -> bool:
    """Whether ``value`` is a number (not a bool) in 0..1."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        0.0 <= value <= 1.0


def _note(notes: list[str] | None, line: str) -> None:
    if notes is not None:
        notes.append(line)


def _refused(e: RefusedFile, notes: list[str] | None) -> None:
    """Say in ``notes`` (when given) that a file was not read, and why."""
    _note(notes, f"{e}; skipped")


def is_run_dir(path: str) -> bool:
    """Whether ``path`` holds what ``dgt train`` or a sidecar leaves in its run dir: a
    ``lock``, a ``trace-<rank>.jsonl`` or ``sidecar-<rank>.*`` file."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n == "lock" or re.fullmatch(r"trace-\d+\.jsonl|sidecar-\d+\..+", n)
               for n in names)


def _cell(value: float | None, fmt: str) -> str:
    """``value`` formatted, or ``-`` where it is not known (a rate of one sample)."""
    return "-" if value is None else format(value, fmt)


def render(rows: dict[int, dict], source: str, acc: float | None,
           notes: list[str] | None = None, live: bool = True):
    """The rich Table of ``rows``; ``notes`` (e.g. lines skipped) go into its caption,
    and, when ``live`` (not ``--once``), how to quit."""
    from rich.table import Table
    chans: list[str] = []
    for row in rows.values():
        for c in row["channels"]:
            if c not in chans:
                chans.append(c)
    title = f"dgt top — {source} — {len(rows)} rank(s)" + \
        (f" — test acc {acc:.4f}" if acc is not None else "")
    from rich import box
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
              collapse_padding=True, pad_edge=False)
    for col in ("rank", "iter", "it/s", "comm\nms", "med\nms", "k", "lost"):
        # a number never wraps or turns into "140…": headers and channel cells take
        # two lines instead, so 4 ranks x 4 channels fit an 80-column terminal
        t.add_column(col, justify="right", no_wrap=True)
    for c in chans:
        t.add_column(f"{c}\nblk/s\nloss", justify="right", no_wrap=True)
    for r, row in rows.items():
        cells = [str(r), _cell(row["iterations"], "d"), _cell(row["rate"], ".1f"),
                 _cell(row["comm_ms"], ".1f"), _cell(row["comm_ms_median"], ".1f"),
                 _cell(row["k"], ".2f"), _cell(row["lost"], "d")]
        for c in chans:
            ch = row["channels"].get(c, {"blocks_per_s": 0.0, "loss": 0.0})
            cells.append(f"{_cell(ch['blocks_per_s'], '.0f')}\n{_cell(ch['loss'], '.0%')}")
        t.add_row(*cells)
    if live:
        notes = (notes or []) + [
            "waiting for the first iteration (q quits)" if not rows else "q quits"]
    elif not rows:
        notes = (notes or []) + ["no iteration yet"]
    t.caption = "; ".join(notes or [])
    return t


def no_endpoint(errors: dict[str, tuple[bool, str]]) -> str:
    """The one line for ``--once`` when no endpoint gave a row: the first one's reason
    (``EndpointPoller.errors``), and how many more failed."""
    (ep, (answered, why)), more = next(iter(errors.items())), len(errors) - 1
    tail = f"; {more} more endpoint(s) failed too" if more else ""
    if answered:
        return (f"{error_line(ep, answered, why)}{tail}; give the job's metrics "
                f"endpoints (dgt train --metrics-port P: 127.0.0.1:P+rank)")
    return (f"no metrics endpoint answered ({ep}: {why}){tail}; is the job running with "
            f"--metrics-port?")


def _quit_pressed(timeout_s: float) -> bool:
    r, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not r:
        return False
    return sys.stdin.read(1) in ("q", "Q")


def main(ns: argparse.Namespace) -> int:
    # without a terminal there is no live view to wait in: the table once, as --once
    ns.once = ns.once or not sys.stdin.isatty()
    if not 0.05 <= ns.interval_s <= 3600:
        ns.parser.error(f"--interval-s must be in 0.05..3600, got {ns.interval_s:g}")
    if ns.endpoints:
        eps = [e.strip() for e in ns.endpoints.split(",") if e.strip()]
        bad = [e for e in eps if not re.fullmatch(r"\[?[0-9A-Za-z.:-]+\]?:\d{1,5}", e)
               or not 1 <= int(e.rsplit(":", 1)[1]) <= 65535]
        if bad:
            ns.parser.error(f"--endpoints: {bad[0]!r} is not HOST:PORT (a port is "
                            f"1..65535)")
        twice = next((e for i, e in enumerate(eps) if e in eps[:i]), None)
        if twice:   # breaker round 26: shown as one rank, in silence
            ns.parser.error(f"--endpoints names {twice} twice; give each sidecar's once")
        source: TraceFollower | EndpointPoller = EndpointPoller(eps)
        label = ",".join(eps)
    else:
        if not ns.run_dir:
            ns.parser.error("give RUN_DIR (dgt train --run-dir) or --endpoints HOST:PORT,...")
        if os.path.exists(ns.run_dir) and not os.path.isdir(ns.run_dir):
            ns.parser.error(f"{ns.run_dir} is a file; give the job's --run-dir (a folder "
                            f"that does not exist yet is waited for)")
        if ns.once and not os.path.isdir(ns.run_dir):
            ns.parser.error(f"{ns.run_dir} does not exist; give the job's --run-dir "
                            f"(in a terminal and without --once, dgt top waits for it "
                            f"to appear)")
        if ns.once and not is_run_dir(ns.run_dir):
            ns.parser.error(f"{ns.run_dir} is not a run dir (no lock, trace-<rank>.jsonl "
                            f"or sidecar-<rank> files); give the job's --run-dir "
                            f"(in a terminal and without --once, dgt top waits for the "
                            f"job to start there)")
        source = TraceFollower(ns.run_dir)
        label = ns.run_dir
    from rich.console import Console
    console = Console()
    if ns.once:
        source.poll()
        if isinstance(source, EndpointPoller) and len(source.errors) == len(eps):
            ns.parser.error(no_endpoint(source.errors))
        notes = source.notes()
        acc = accuracy(ns.run_dir, notes)
        console.print(render(source.rows(), label, acc, notes, live=False))
        return 0
    import termios
    import tty
    from rich.live import Live
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        with Live(render({}, label, None), console=console, auto_refresh=False,
                  screen=False) as live:
            while True:
                source.poll()
                notes = source.notes()
                acc = accuracy(ns.run_dir, notes)
                live.update(render(source.rows(), label, acc, notes), refresh=True)
                if _quit_pressed(ns.interval_s):
                    break
    except KeyboardInterrupt:
        pass
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    return 0


def register(sub) -> None:
    """Add ``dgt top`` to the CLI."""
    p = sub.add_parser("top", help="live view of a running job, every rank",
                       description="Live view of a running dgt job: per rank iteration, "
                       "comm time, k, lost blocks, and per channel blocks/s and loss. "
                       "Reads the job's --run-dir traces, or its metrics endpoints. "
                       "q quits.")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", default="",
                   help="the job's run directory (dgt train --run-dir)")
    p.add_argument("--endpoints", default="", help="scrape these metrics endpoints "
                   "instead (HOST:PORT,...; dgt train --metrics-port P: 127.0.0.1:P+r)")
    p.add_argument("--interval-s", type=float, default=1.0, help="refresh period (s)")
    p.add_argument("--once", action="store_true", help="print the table once and exit")
    p.set_defaults(func=main, parser=p)
