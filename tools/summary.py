"""``dgt pcap summary``: per-channel totals, DSCP, loss, late arrivals and a
per-iteration timeline from a capture.

Definitions (the same as the sidecar's report counters, so the two can be compared):

- ``blocks``/``bytes``/``messages`` count ``BLOCKS`` messages per channel; ``bytes`` is
  the message bytes (header + payload + MAC): the UDP payload of a datagram, the frame
  length of a TCP frame.
- ``dscp``: the DSCP values (IP TOS >> 2) seen on packets carrying that channel's
  messages.
- ``lost``: from ``END`` (blocks sent per channel per (session, sender, shard,
  iteration)) minus the blocks of that key seen in the capture; it is loss *before the
  capture point*.
- ``late``: blocks of iteration t seen after that shard's ``PULL(t)`` to that worker.
- ``undecodable``: malformed datagrams / stream chunks (see ``dgt.tools.dissect``).
- ``udp_refused``: datagrams every receiver drops, among them a block whose length fits
  its coding but not its session's block size: the size most of that session's block
  datagrams have (:func:`block_elems_of`; a capture that holds another size is read
  twice, the second time with the sizes known).
- ``iterations_out_of_range``: messages of iterations more than ``MAX_ITERATION_GAP``
  above the iterations below them (from the median up): a forged far-future iteration
  gets no row in ``iterations``; a real capture's iterations follow one another.

Example::

    from dgt.tools import summary
    s = summary.summarize(["run.pcap"], ports=None)
    print(s["channels"]["udp1"]["blocks"], s["channels"]["udp1"]["lost"])
"""
from __future__ import annotations

from collections import Counter, defaultdict

from dgt.transport import wire
from dgt.transport.channels import channel_name
from dgt.tools.dissect import Dissector, Message
from dgt.tools.ports import PortSpec


#: an iteration more than this above the next lower one in the capture (from the median
#: iteration up) and every one above it are out of range: no row (a real capture's
#: iterations follow one another, BSP)
MAX_ITERATION_GAP = 1000


def block_elems_of(h: wire.Header) -> tuple[int, ...]:
    """The block sizes (values) that a one-block BLOCKS datagram's coding and length
    fit (two for int4, whose last byte may hold one value); () for none."""
    coding, n = wire.coding_of(h.flags), h.length
    if coding == wire.Coding.FP32:
        return (n // 4,) if n >= 4 and n % 4 == 0 else ()
    if coding in (wire.Coding.FP16, wire.Coding.BF16):
        return (n // 2,) if n >= 2 and n % 2 == 0 else ()
    if coding == wire.Coding.INT8:
        return (n - 4,) if n > 4 else ()
    if coding == wire.Coding.INT4:
        return (2 * (n - 4) - 1, 2 * (n - 4)) if n > 4 else ()
    return ()


class _Iter:
    __slots__ = ("first", "last", "blocks", "bytes", "ends", "pulls", "first_pull",
                 "last_pull", "late", "ch_first", "ch_last", "messages")

    def __init__(self):
        self.messages = 0
        self.first = self.last = None
        self.blocks = Counter()
        self.bytes = Counter()
        self.late = Counter()
        self.ends = self.pulls = 0
        self.first_pull = self.last_pull = None
        self.ch_first: dict[int, int] = {}
        self.ch_last: dict[int, int] = {}


class Summary:
    """Streaming accumulator: :meth:`add` each message in capture order, then
    :meth:`result`. Memory grows with iterations x keys, not with messages.
    ``block_elems``: {session: block size} (:meth:`block_sizes` of a first reading): a
    block datagram of another size is refused; None: every size is taken."""

    def __init__(self, dissector: Dissector, sessions=None, block_elems=None):
        self.d = dissector
        self.block_elems = block_elems
        #: {session: Counter(block size: block datagrams whose length fits it)}
        self.sizes_seen: dict[int, Counter] = defaultdict(Counter)
        self.size_datagrams = Counter()   # {session: block datagrams}
        self.only_sessions = None if not sessions else {int(x) for x in sessions}
        self.other_sessions = Counter()
        self.ch_messages = Counter()
        self.ch_blocks = Counter()
        self.ch_bytes = Counter()
        self.ch_dscp: dict[int, set] = defaultdict(set)
        self.ch_late = Counter()
        self.types = Counter()
        self.sessions: set[int] = set()
        self.seen: dict[tuple, Counter] = defaultdict(Counter)
        self.ends: dict[tuple, list[int]] = {}
        self.pull_ns: dict[tuple, int] = {}
        self.endpoint_rank: dict[tuple[str, int], int] = {}
        if dissector.ports is not None:
            self.endpoint_rank.update(dissector.ports.endpoint_ranks())
        self.pulls = 0
        self.pulls_unattributed = 0
        self.bad_end = 0
        self.tail_markers = 0
        self.udp_refused = 0   # datagrams of a shape no receiver takes
        self.iters: dict[int, _Iter] = defaultdict(_Iter)

    def add(self, m: Message) -> None:
        h = m.header
        if self.only_sessions is not None and h.session not in self.only_sessions:
            self.other_sessions[f"{h.session:016x}"] += 1
            return
        if m.proto == "udp" and (wire.udp_shape_problem(h) or (
                h.type == wire.MsgType.END and len(m.payload)) or (
                h.type == wire.MsgType.BLOCKS and wire.block_payload_problem(h))):
            # a PULL, HELLO, ... in a datagram (bad_udp_message), a tail marker with a
            # payload (bad_tail), or a block of an unknown coding or of a length no
            # block has in its coding: every receiver drops it, so it is no message of
            # its type (breaker round 11 and round 12's re-check)
            self.udp_refused += 1
            return
        if m.proto == "udp" and h.type == wire.MsgType.BLOCKS:
            fits = block_elems_of(h)
            self.size_datagrams[h.session] += 1
            for e in fits:
                self.sizes_seen[h.session][e] += 1
            want = None if self.block_elems is None else self.block_elems.get(h.session)
            if want is not None and want not in fits:
                self.udp_refused += 1   # bad_length at a receiver of this job
                return
        self.types[wire.MsgType(h.type).name] += 1
        self.sessions.add(h.session)
        self.ch_dscp[h.channel].add(m.dscp)
        it = self.iters[h.iteration] if h.type in (wire.MsgType.BLOCKS, wire.MsgType.END,
                                                   wire.MsgType.PULL) else None
        if it is not None:
            it.messages += 1
            it.first = m.ts_ns if it.first is None else it.first
            it.last = m.ts_ns
        if h.type != wire.MsgType.PULL:
            self.endpoint_rank.setdefault((m.src, m.sport), h.sender)
        if h.type == wire.MsgType.BLOCKS:
            ch = h.channel
            self.ch_messages[ch] += 1
            self.ch_blocks[ch] += h.count
            self.ch_bytes[ch] += len(m.data)
            key = (h.session, h.sender, h.shard, h.iteration)
            self.seen[key][ch] += h.count
            it.blocks[ch] += h.count
            it.bytes[ch] += len(m.data)
            it.ch_first.setdefault(ch, m.ts_ns)
            it.ch_last[ch] = m.ts_ns
            if key in self.pull_ns:
                self.ch_late[ch] += h.count
                it.late[ch] += h.count
        elif h.type == wire.MsgType.END and h.channel:
            self.tail_markers += 1   # a UDP channel's tail marker: its count is in END
        elif h.type == wire.MsgType.END:
            it.ends += 1
            try:
                counts = [int(x) for x in wire.unpack_end(m.payload)]
            except wire.WireError:
                self.bad_end += 1
                return
            key = (h.session, h.sender, h.shard, h.iteration)
            prev = self.ends.get(key)
            self.ends[key] = counts if prev is None else [a + b for a, b in zip(prev, counts)]
        elif h.type == wire.MsgType.PULL:
            self.pulls += 1
            it.pulls += 1
            it.first_pull = m.ts_ns if it.first_pull is None else it.first_pull
            it.last_pull = m.ts_ns
            worker = self.endpoint_rank.get((m.dst, m.dport))
            if worker is None:
                self.pulls_unattributed += 1
                return
            self.pull_ns.setdefault((h.session, worker, h.shard, h.iteration), m.ts_ns)

    def block_sizes(self) -> dict[int, int]:
        """{session: the block size most of its block datagrams fit (the smallest of
        a tie)}."""
        return {sess: min(c, key=lambda e: (-c[e], e)) for sess, c in self.sizes_seen.items()}

    def other_sizes(self) -> bool:
        """Whether some block datagram does not fit its session's :meth:`block_sizes`."""
        best = self.block_sizes()
        return any(self.sizes_seen[sess][e] < self.size_datagrams[sess]
                   for sess, e in best.items())

    def sizes_of_mixed_sessions(self) -> dict[str, dict[str, int]]:
        """{session: {block size: block datagrams that fit it}} of the sessions whose
        block datagrams do not all fit one size (JSON keys, most datagrams first): what
        the summary says, so that a flood of forged blocks of another size that
        outnumbers a session's own (and so takes the block size over: breaker round 20)
        is seen, not silently counted."""
        best = self.block_sizes()
        return {str(sess): {str(e): n for e, n in sorted(
                    self.sizes_seen[sess].items(), key=lambda en: (-en[1], en[0]))}
                for sess, e in best.items()
                if self.sizes_seen[sess][e] < self.size_datagrams[sess]}

    def in_range(self) -> tuple[list[int], int]:
        """(the iterations that get a row, ascending; the messages of the others):
        from the median iteration (by messages) up, an iteration more than
        ``MAX_ITERATION_GAP`` above the one below it ends the range."""
        ts = sorted(self.iters)
        total = sum(self.iters[t].messages for t in ts)
        seen, start = 0, 0
        for i, t in enumerate(ts):
            seen += self.iters[t].messages
            if 2 * seen >= total:
                start = i
                break
        end = len(ts)
        for i in range(start + 1, len(ts)):
            if ts[i] - ts[i - 1] > MAX_ITERATION_GAP:
                end = i
                break
        return ts[:end], sum(self.iters[t].messages for t in ts[end:])

    def result(self, files=()) -> dict:
        d = self.d
        t0 = d.first_ts_ns or 0
        expected, lost, excess, no_end = Counter(), Counter(), Counter(), Counter()
        it_lost: dict[int, Counter] = defaultdict(Counter)
        for key, counts in self.ends.items():
            seen = self.seen.get(key, Counter())
            for ch, n in enumerate(counts):
                expected[ch] += n
                lost[ch] += max(0, n - seen[ch])
                it_lost[key[3]][ch] += max(0, n - seen[ch])
                excess[ch] += max(0, seen[ch] - n)
        for key, seen in self.seen.items():
            if key not in self.ends:
                for ch, n in seen.items():
                    no_end[ch] += n
        chans = sorted(set(self.ch_messages) | set(self.ch_dscp) |
                       {c for c, n in expected.items() if n})
        total_blocks = sum(self.ch_blocks.values()) or 1
        total_bytes = sum(self.ch_bytes.values()) or 1
        channels = {}
        for ch in chans:
            channels[channel_name(ch)] = {
                "channel": ch,
                "messages": self.ch_messages[ch],
                "blocks": self.ch_blocks[ch],
                "bytes": self.ch_bytes[ch],
                "dscp": sorted(self.ch_dscp.get(ch, ())),
                "blocks_expected": expected[ch],
                "lost": lost[ch],
                "loss_rate": lost[ch] / expected[ch] if expected[ch] else 0.0,
                "late": self.ch_late[ch],
                "blocks_without_end": no_end[ch],
                "excess": excess[ch],
                "share_blocks": self.ch_blocks[ch] / total_blocks,
                "share_bytes": self.ch_bytes[ch] / total_bytes,
            }

        def rel(ns):
            return None if ns is None else (ns - t0) / 1e9

        iterations = []
        kept, out_of_range = self.in_range()
        for t in kept:
            it = self.iters[t]
            iterations.append({
                "iteration": t,
                "start_s": rel(it.first), "end_s": rel(it.last),
                "first_pull_s": rel(it.first_pull), "last_pull_s": rel(it.last_pull),
                "ends": it.ends, "pulls": it.pulls,
                "blocks": {channel_name(c): it.blocks[c] for c in sorted(it.blocks)},
                "bytes": {channel_name(c): it.bytes[c] for c in sorted(it.bytes)},
                "lost": {channel_name(c): n for c, n in sorted(it_lost[t].items()) if n},
                "late": {channel_name(c): n for c, n in sorted(it.late.items()) if n},
                "channel_span_s": {channel_name(c): [rel(it.ch_first[c]), rel(it.ch_last[c])]
                                   for c in sorted(it.ch_first)},
            })
        return {
            "files": [str(f) for f in files],
            **d.counters(),
            "duration_s": ((d.last_ts_ns or 0) - t0) / 1e9,
            "sessions": [f"{s:016x}" for s in sorted(self.sessions)],
            "types": dict(sorted(self.types.items())),
            "other_sessions_ignored": dict(self.other_sessions),
            "channels": channels,
            "totals": {"messages": sum(self.ch_messages.values()),
                       "blocks": sum(self.ch_blocks.values()),
                       "bytes": sum(self.ch_bytes.values()),
                       "blocks_expected": sum(expected.values()),
                       "lost": sum(lost.values()), "late": sum(self.ch_late.values())},
            "ends": len(self.ends), "bad_ends": self.bad_end,
            "tail_markers": self.tail_markers, "udp_refused": self.udp_refused,
            "pulls": self.pulls, "pulls_unattributed": self.pulls_unattributed,
            "iterations": iterations, "iterations_out_of_range": out_of_range,
        }


def summarize(files, ports: PortSpec | None = None, sessions=None) -> dict:
    """Summarise one or more pcap files (a capture ring, in order) as one capture.

    ``sessions``: only count messages of these session ids (others are tallied under
    ``other_sessions_ignored``: a concurrent job on the same ports).

    Returns the JSON-able dict described in the module docstring. Raises
    :class:`dgt.tools.dissect.PcapError` for a missing or non-pcap file.
    """
    if isinstance(files, (str, bytes)) or hasattr(files, "__fspath__"):
        files = [files]
    d = Dissector(ports)
    s = Summary(d, sessions)
    from dgt.tools.dissect import dissect_files
    truncated, records = dissect_files(d, files, s.add)
    check_truncated(truncated, records)
    mixed = {}
    if s.other_sizes():   # a block of another size than its session's: read again,
        d = Dissector(ports)   # refusing it (a real capture holds one size)
        mixed = s.sizes_of_mixed_sessions()
        s = Summary(d, sessions, block_elems=s.block_sizes())
        truncated, records = dissect_files(d, files, s.add)
    out = s.result(files)
    out["block_sizes_mixed"] = mixed
    out["records"] = records
    out["truncated"] = truncated
    return out


def truncation_text(t: dict) -> str:
    """``truncated at record N (byte offset X) in FILE: reason``."""
    return (f"truncated at record {t['record']} (byte offset {t['offset']}) in "
            f"{t['file']}: {t['reason']}")


def check_truncated(truncated: list, records: int) -> None:
    """Raise PcapError when a capture was cut off before a single readable record."""
    from dgt.tools.dissect import PcapError
    if truncated and records == 0:
        raise PcapError(f"no readable packets: {truncation_text(truncated[0])}")


def compare_with_report(summary: dict, report: dict) -> dict:
    """Per channel: capture ``blocks``/``bytes`` vs the report's ``blocks_sent``/
    ``bytes_sent``. Returns ``{name: {"blocks": (capture, report), "bytes": (...),
    "match": bool}}``."""
    out = {}
    rch = report.get("channels", {})
    for name in sorted(set(summary["channels"]) | set(rch)):
        c = summary["channels"].get(name, {})
        r = rch.get(name, {})
        pair_b = (c.get("blocks", 0), r.get("blocks_sent", 0))
        pair_y = (c.get("bytes", 0), r.get("bytes_sent", 0))
        out[name] = {"blocks": pair_b, "bytes": pair_y,
                     "match": pair_b[0] == pair_b[1] and pair_y[0] == pair_y[1]}
    return out


def format_table(s: dict) -> str:
    """The human-readable summary: one row per channel, then totals and counters."""
    cols = ["channel", "messages", "blocks", "bytes", "dscp", "expected", "lost",
            "loss%", "late"]
    rows = [cols]
    for name, c in s["channels"].items():
        rows.append([name, c["messages"], c["blocks"], c["bytes"],
                     ",".join(map(str, c["dscp"])) or "-", c["blocks_expected"],
                     c["lost"], f"{100 * c['loss_rate']:.2f}", c["late"]])
    t = s["totals"]
    rows.append(["total", t["messages"], t["blocks"], t["bytes"], "", t["blocks_expected"],
                 t["lost"], "", t["late"]])
    w = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(str(v).rjust(w[i]) if i else str(v).ljust(w[i])
                       for i, v in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    lines.append("")
    lines.append(f"packets {s['packets']}, dgt packets {s['dgt_packets']}, messages "
                 f"{s['messages']}, undecodable {s['undecodable']}"
                 + (f" {s['undecodable_reasons']}" if s["undecodable"] else ""))
    lines.append(f"iterations {len(s['iterations'])}, ENDs {s['ends']} (tail markers "
                 f"{s.get('tail_markers', 0)}), PULLs {s['pulls']}"
                 f" ({s['pulls_unattributed']} unattributed), duration {s['duration_s']:.3f} s,"
                 f" types {s['types']}")
    if s.get("udp_refused"):
        lines.append(f"datagrams no receiver takes (a PULL, HELLO, ERROR, BYE or TCP frame "
                     f"over UDP: bad_udp_message; a tail marker with a payload: bad_tail; "
                     f"a block of an undefined coding or of a length no block has: "
                     f"bad_coding, bad_length; a block of another size than its "
                     f"session's others): {s['udp_refused']}")
    for sess, sizes in (s.get("block_sizes_mixed") or {}).items():
        lines.append(f"session {sess}: block datagrams of {len(sizes)} sizes ("
                     + ", ".join(f"{e} values: {n}" for e, n in sizes.items())
                     + "); the most common is taken as its block size and the others "
                     "refused: if the other size is the job's, that session was "
                     "flooded with forged blocks")
    if s.get("iterations_out_of_range"):
        lines.append(f"messages of iterations out of range (more than {MAX_ITERATION_GAP} "
                     f"above the iterations below them; no row): "
                     f"{s['iterations_out_of_range']}")
    for t in s.get("truncated", ()):
        lines.append(truncation_text(t) + "; totals cover the records before it")
    if s.get("other_sessions_ignored"):
        lines.append(f"ignored messages of other sessions: {s['other_sessions_ignored']}")
    return "\n".join(lines)


def plot(s: dict, out_png: str, flag: str = "--plot") -> None:
    """Timeline (blocks per channel over time, PULL marks), blocks per iteration and
    per-channel shares, as one PNG (matplotlib, Agg backend) in ``out_png``
    (``dgt.tools.output``). Raises ValueError ``cannot write PATH (FLAG): why``."""
    from dgt.tools.output import write_file
    from dgt.plot import pyplot
    plt = pyplot()

    names = list(s["channels"])
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    for row in s["iterations"]:
        t = row["iteration"]
        for j, (name, (a, b)) in enumerate(row["channel_span_s"].items()):
            y = t + (j - len(names) / 2) * 0.12
            ax1.plot([a, b if b > a else a + 1e-6], [y, y], color=colors.get(name), lw=3,
                     label=name if t == s["iterations"][0]["iteration"] else None)
        if row["first_pull_s"] is not None:
            ax1.plot([row["first_pull_s"], row["last_pull_s"]], [t, t], "kx",
                     label="PULL" if t == s["iterations"][0]["iteration"] else None)
    ax1.set_xlabel("time since capture start (s)")
    ax1.set_ylabel("iteration")
    ax1.set_title("timeline: BLOCKS span per channel, PULLs")
    if s["iterations"]:
        ax1.legend(loc="best", fontsize=8)
    its = [r["iteration"] for r in s["iterations"]]
    bottom = [0] * len(its)
    for name in names:
        vals = [r["blocks"].get(name, 0) for r in s["iterations"]]
        ax2.bar(its, vals, bottom=bottom, color=colors[name], label=name)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("blocks seen")
    ax2.set_title("blocks per iteration")
    if names:
        ax2.legend(fontsize=8)
    x = range(len(names))
    ax3.bar([i - 0.2 for i in x], [s["channels"][n]["share_blocks"] for n in names], 0.4,
            label="blocks")
    ax3.bar([i + 0.2 for i in x], [s["channels"][n]["share_bytes"] for n in names], 0.4,
            label="bytes")
    ax3.set_xticks(list(x), names)
    ax3.set_ylabel("share")
    ax3.set_title("per-channel share")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    try:
        write_file(out_png, flag, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)


def write_json(s: dict, path: str, flag: str = "--json") -> None:
    """The summary as JSON in ``path`` (``dgt.tools.output``: whole or not at all).
    Raises ValueError ``cannot write PATH (FLAG): why``."""
    from dgt.tools.output import write_json as write
    write(path, flag, s)
