"""Which ports carry dgt traffic: port lists, a train report's sidecar table, base ports.

A dgt job uses, per sidecar rank r, one TCP port (channel 0) and one UDP port per
unreliable channel c = 1..C. ``dgt train --base-port B`` gives rank r TCP port
``B + 10 r`` and UDP channel c port ``B + 10 r + c``; a report JSON lists them as
``"sidecars": [{"rank": 0, "host": "127.0.0.1", "tcp_port": P, "udp_ports": [..]}]``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dgt.run_files import RefusedFile, read_json
from dgt.jsonparse import is_port
from dgt.config import whole   # ASCII digits: int() also reads '1_0', '١٠'

#: Port stride between ranks under ``--base-port`` (rank r uses B + 10 r; docs/tools.md).
RANK_STRIDE = 10


class PortSpecError(ValueError):
    """A port list, report or mapping could not be read; the message says what to fix."""


@dataclass(frozen=True)
class Sidecar:
    """One sidecar's listening endpoints, as a train report lists them."""

    rank: int
    host: str
    tcp_port: int
    udp_ports: tuple[int, ...]


@dataclass(frozen=True)
class PortSpec:
    """The ports to treat as dgt traffic.

    ``tcp``/``udp`` are port sets; ``None`` means "any port" (decode by magic number).
    ``udp_channel`` maps a UDP port to its channel when the layout is known (report or
    base port), which lets ``capture --channel`` filter in BPF.
    """

    tcp: frozenset[int] | None = None
    udp: frozenset[int] | None = None
    udp_channel: dict[int, int] = field(default_factory=dict)
    sidecars: tuple[Sidecar, ...] = ()

    @property
    def any_port(self) -> bool:
        return self.tcp is None and self.udp is None

    def endpoint_ranks(self) -> dict[tuple[str, int], int]:
        """(host, port) -> rank for every listening endpoint in the sidecar table."""
        out: dict[tuple[str, int], int] = {}
        for s in self.sidecars:
            out[(s.host, s.tcp_port)] = s.rank
            for p in s.udp_ports:
                out[(s.host, p)] = s.rank
        return out


def parse_port_list(text: str) -> list[int]:
    """Parse ``"47000-47040,5000"`` into a sorted list of ports.

    Raises :class:`PortSpecError` for a malformed item or a port outside 1..65535.
    """
    ports: set[int] = set()
    for item in str(text).replace(" ", "").split(","):
        if not item:
            continue
        try:
            if "-" in item:
                a, b = item.split("-", 1)
                lo, hi = whole(a), whole(b)
            else:
                lo = hi = whole(item)
        except ValueError:
            raise PortSpecError(f"bad port item {item!r}; use e.g. 47000-47040,5000") from None
        if not (1 <= lo <= hi <= 65535):
            raise PortSpecError(f"bad port range {item!r}; ports are 1..65535, low-high")
        ports.update(range(lo, hi + 1))
    if not ports:
        raise PortSpecError(f"no ports in {text!r}")
    return sorted(ports)


def parse_channels(text: str) -> list[int]:
    """Parse ``"0,2"`` into channel numbers 0..7 (raises :class:`PortSpecError`)."""
    try:
        chans = sorted({whole(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise PortSpecError(f"bad channel list {text!r}; use e.g. 0,2") from None
    if not chans or any(not 0 <= c <= 7 for c in chans):
        raise PortSpecError(f"bad channel list {text!r}; channels are 0 (tcp) .. 7")
    return chans


def from_ports(text: str) -> PortSpec:
    """Both TCP and UDP on the listed ports/ranges."""
    ports = frozenset(parse_port_list(text))
    return PortSpec(tcp=ports, udp=ports)


def read_report(path: str | Path):
    """The JSON document of the report file ``path``, read as every dgt reader reads a
    record (dgt.run_files.read_json: a regular file of at most MAX_RECORD bytes; JSON
    nested too deeply is malformed JSON, dgt.jsonparse). Raises :class:`PortSpecError`,
    one line, when it is missing, not a regular file, unreadable or not JSON."""
    p = str(path)
    try:
        return read_json(p)
    except FileNotFoundError:
        raise PortSpecError(f"report {p} not found") from None
    except RefusedFile as e:
        raise PortSpecError(f"report {e}") from None
    except OSError as e:
        raise PortSpecError(f"report {p} is not readable: {e.strerror or e}") from None
    except ValueError as e:
        raise PortSpecError(f"report {p} is not readable JSON: {e}") from None


def sidecars_from_report(path: str | Path) -> tuple[Sidecar, ...]:
    """Read the ``sidecars`` table of a ``dgt train`` report JSON.

    Raises :class:`PortSpecError` when the file is missing, not JSON, or lacks the table
    or it is malformed (:func:`sidecars_from_doc`).
    """
    return sidecars_from_doc(read_report(path), str(path))


def _shown(v) -> str:
    """A JSON value as an error line shows it: a number or literal as JSON writes it
    (``Infinity``, ``true``, ``5.0``), cut to 40 characters; a list or object by kind
    (it may be nested deep)."""
    if isinstance(v, (list, dict)):
        return "a list" if isinstance(v, list) else "an object"
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _sidecar(r) -> Sidecar:
    """One row of a ``sidecars`` table. Raises ValueError saying what is wrong."""
    if not isinstance(r, dict):
        raise ValueError(f"{_shown(r)}, not an object")
    for k in ("rank", "tcp_port"):
        if k not in r:
            raise ValueError(f"no {k!r}")
    rank, tcp, udp = r["rank"], r["tcp_port"], r.get("udp_ports", [])
    host = r.get("host", "127.0.0.1")
    if type(rank) is not int or rank < 0:
        raise ValueError(f"rank {_shown(rank)} is not a whole number >= 0")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host {_shown(host)} is not a host name or address")
    if not is_port(tcp):
        raise ValueError(f"tcp_port {_shown(tcp)} is not a port 1..65535")
    if type(udp) is not list:
        raise ValueError(f"udp_ports {_shown(udp)} is not a list of ports")
    bad = next((u for u in udp if not is_port(u)), None)
    if bad is not None:
        raise ValueError(f"udp_ports holds {_shown(bad)}, not a port 1..65535")
    return Sidecar(rank, host, tcp, tuple(udp))


def sidecars_from_doc(doc, where: str = "report") -> tuple[Sidecar, ...]:
    """The ``sidecars`` table of an already-loaded report dict (or a bare list of rows).
    Each row is ``{"rank": int >= 0, "host": str, "tcp_port": port, "udp_ports":
    [port, ...]}``, a port an integer 1..65535 (dgt.jsonparse.is_port).

    Raises :class:`PortSpecError` when the table is missing or malformed.
    """
    rows = doc.get("sidecars") if isinstance(doc, dict) else doc
    if not rows or not isinstance(rows, list):
        raise PortSpecError(f"{where} has no 'sidecars' table; pass --ports instead")
    out = []
    for i, r in enumerate(rows):
        try:
            out.append(_sidecar(r))
        except ValueError as e:
            raise PortSpecError(f"{where}: bad sidecars entry {i} ({e})") from None
    return tuple(out)


def from_sidecars(sidecars) -> PortSpec:
    sidecars = tuple(sidecars)
    tcp = frozenset(s.tcp_port for s in sidecars)
    udp = frozenset(p for s in sidecars for p in s.udp_ports)
    chan = {p: c for s in sidecars for c, p in enumerate(s.udp_ports, start=1)}
    return PortSpec(tcp=tcp, udp=udp, udp_channel=chan, sidecars=sidecars)


def from_report(path: str | Path) -> PortSpec:
    """PortSpec from a train report's ``sidecars`` table."""
    return from_sidecars(sidecars_from_report(path))


def from_base_port(base: int, ranks: int, udp_channels: int = 3,
                   host: str = "127.0.0.1") -> PortSpec:
    """PortSpec of a job started with ``--base-port base``: rank r TCP ``base+10r``,
    UDP channel c ``base+10r+c``."""
    if not 1 <= udp_channels <= 7:
        raise PortSpecError(f"--udp-channels must be 1..7, got {udp_channels}")
    if ranks < 1:
        raise PortSpecError(f"--ranks must be >= 1, got {ranks}")
    if base < 1 or base + RANK_STRIDE * ranks > 65535:
        raise PortSpecError(f"base port {base} with {ranks} ranks leaves 1..65535")
    return from_sidecars(Sidecar(r, host, base + RANK_STRIDE * r,
                                 tuple(base + RANK_STRIDE * r + c
                                       for c in range(1, udp_channels + 1)))
                         for r in range(ranks))


def _port_expr(ports) -> str:
    """Compact BPF port expression: runs of consecutive ports become portranges."""
    ports = sorted(ports)
    parts: list[str] = []
    i = 0
    while i < len(ports):
        j = i
        while j + 1 < len(ports) and ports[j + 1] == ports[j] + 1:
            j += 1
        parts.append(f"port {ports[i]}" if i == j else f"portrange {ports[i]}-{ports[j]}")
        i = j + 1
    return " or ".join(parts)


def _channel_byte(c: int) -> str:
    """The dgt header's channel byte equals ``c``: ``udp[12]`` (libpcap's ``udp[]`` is
    IPv4 only) or, on IPv6 without extension headers, byte 40 + 8 + 4 of the packet."""
    return f"udp[12] = {c} or ip6[52] = {c}"


def bpf_filter(spec: PortSpec, channels=None) -> str:
    """A libpcap filter for ``spec``, optionally limited to ``channels``.

    Channel 0 is TCP. UDP channels are selected by port when the layout is known, and
    otherwise by the header's channel byte (``udp[12]``: 8-byte UDP header + offset 4;
    ``ip6[52]`` on IPv6).
    """
    want = None if channels is None else set(channels)
    terms: list[str] = []
    if want is None or 0 in want:
        terms.append("tcp" if spec.tcp is None else f"(tcp and ({_port_expr(spec.tcp)}))")
    udp_ch = None if want is None else sorted(c for c in want if c > 0)
    if udp_ch is None or udp_ch:
        if spec.udp is None:
            base = "udp"
        elif udp_ch is not None and spec.udp_channel:
            ports = [p for p, c in spec.udp_channel.items() if c in udp_ch]
            base = f"(udp and ({_port_expr(ports)}))" if ports else ""
        else:
            base = f"(udp and ({_port_expr(spec.udp)}))"
        if base:
            if udp_ch is not None:
                base = f"({base} and ({' or '.join(_channel_byte(c) for c in udp_ch)}))"
            terms.append(base)
    if not terms:
        return "less 0"  # matches nothing
    return " or ".join(terms)
