"""tc profile schema: load, validate and describe the YAML profiles.

A profile says which root qdisc a port gets, which bands (classes) hang under it, which
DSCP code points go to which band, which band takes unmatched traffic, and optionally a
netem impairment (delay, loss). The schema is documented in ``docs/tc_profiles.md``;
:func:`validate` enforces it and raises :class:`ProfileError` whose message names the
field and the rule that was broken.

DSCP: RFC 2474 (field), RFC 3246 (EF), RFC 2597 (AF), RFC 3662/8622 (LE, scavenger).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

SCHEMA_VERSION = 1
ROOT_KINDS = ("htb", "prio")
HTB_MAX_PRIO = 7          # TC_HTB_NUMPRIO - 1 (include/uapi/linux/pkt_sched.h)
PRIO_MAX_BANDS = 16       # TCQ_PRIO_BANDS
NETEM_PACKET_BYTES = 1514  # used to turn a byte limit into netem's packet limit
#: DSCP of dgt's reliable channel (EF, RFC 3246)
RELIABLE_DSCP = 46
#: the smallest queue (bytes) a band that carries TCP should have: the band of dgt's
#: reliable channel (DSCP 46) and the default band (every unmarked flow: a tenant, gloo).
#: TSQ keeps about two 64 KB TSO packets of each TCP socket in the qdisc, so 2 MiB holds 16
#: connections. A segment our own qdisc drops while nothing else of its connection is in
#: flight arms the zero-window probe at the kernel's fixed 200 ms (tcp_probe0_base uses
#: TCP_RTO_MIN, whatever the socket's TCP_RTO_MIN_US): a 200 ms stall
#: (docs/tc_profiles.md, "The TCP bands' queue")
TCP_QUEUE_BYTES = 2 << 20

_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ProfileError(ValueError):
    """A profile breaks the schema; the message names the field and the rule."""


def parse_rate(rate: str | int | float) -> int:
    """Rate in tc notation ("1gbit", "950mbit", "10mbps") -> bits per second (int).

    A bare number is bits per second. Units follow tc(8): ``bit kbit mbit gbit tbit``
    are bits, ``bps kbps mbps gbps`` are bytes per second. Raises ValueError.
    """
    if isinstance(rate, bool):
        raise ValueError(f"rate {rate!r} is not a rate like '1gbit'")
    if isinstance(rate, (int, float)):
        value, unit = float(rate), "bit"
    else:
        m = _RATE_RE.match(str(rate))
        if not m:
            raise ValueError(f"rate {rate!r} is not a rate like '1gbit' or '950mbit'")
        value, unit = float(m.group(1)), (m.group(2).lower() or "bit")
    if unit not in _RATE_UNITS:
        raise ValueError(f"rate {rate!r}: unit {unit!r} is not one of {', '.join(_RATE_UNITS)}")
    if not math.isfinite(value * _RATE_UNITS[unit]) or value * _RATE_UNITS[unit] >= 2**64:
        raise ValueError(f"rate {rate!r} is too large: tc rates stop below 2^64 bit/s")
    bits = int(value * _RATE_UNITS[unit])
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be > 0")
    return bits


def format_rate(rate_bit: int) -> str:
    """bits/s -> tc notation, exact ("950mbit", "10mbit", "1500kbit", "123bit")."""
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if rate_bit % mult == 0:
            return f"{rate_bit // mult}{unit}"
    return f"{rate_bit}bit"


@dataclass(frozen=True)
class Band:
    """One band: an HTB class or a prio band, with its leaf queue.

    ``rate_pct``/``ceil_pct`` are shares (percent) of the root rate (HTB only).
    Exactly one of ``limit_bytes`` (bfifo leaf) or ``limit_packets`` (pfifo leaf).
    """
    name: str
    priority: int
    dscp: tuple[int, ...]
    rate_pct: float | None = None
    ceil_pct: float | None = None
    limit_bytes: int | None = None
    limit_packets: int | None = None

    @property
    def leaf_kind(self) -> str:
        return "bfifo" if self.limit_bytes is not None else "pfifo"

    @property
    def queue_bytes(self) -> int:
        """The leaf's limit in bytes (a pfifo leaf: packets of 1,514 B)."""
        return self.limit_bytes if self.limit_bytes is not None \
            else (self.limit_packets or 0) * NETEM_PACKET_BYTES


@dataclass(frozen=True)
class Netem:
    """netem impairment on the leaves of ``bands`` (all bands when empty)."""
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    bands: tuple[str, ...] = ()


@dataclass(frozen=True)
class Profile:
    """A validated tc profile. Bands are listed highest priority first."""
    name: str
    description: str
    root_kind: str
    rate_bit: int | None
    bands: tuple[Band, ...]
    default_band: str
    netem: Netem | None = None
    fallback: str | None = None
    source: str = ""

    def band(self, name: str) -> Band:
        for b in self.bands:
            if b.name == name:
                return b
        raise KeyError(name)

    def band_for_dscp(self, dscp: int) -> Band:
        """The band a packet with this DSCP lands in (the default band if unmapped)."""
        for b in self.bands:
            if dscp in b.dscp:
                return b
        return self.band(self.default_band)

    def tcp_queue_warnings(self) -> list[str]:
        """One line for each band that carries TCP and queues less than
        :data:`TCP_QUEUE_BYTES` (a pfifo leaf: packets of 1,514 B): the band of DSCP 46
        (dgt's reliable channel) and the default band (unmarked TCP: tenants, gloo).
        Empty when both are long enough."""
        out, seen = [], set()   # DSCP 46 unmapped lands in the default band: named once
        for b, what in ((self.band_for_dscp(RELIABLE_DSCP),
                         f"DSCP {RELIABLE_DSCP}, dgt's reliable channel"),
                        (self.band(self.default_band), "the default band, unmarked TCP")):
            if b.name not in seen and b.queue_bytes < TCP_QUEUE_BYTES:
                out.append(f"profile '{self.name}': band '{b.name}' ({what}) queues "
                           f"{b.queue_bytes} bytes; give it at least {TCP_QUEUE_BYTES} "
                           f"(limit_bytes): a TCP segment this qdisc drops can stall its "
                           f"connection 200 ms (docs/tc_profiles.md)")
            seen.add(b.name)
        return out

    def netem_bands(self) -> tuple[str, ...]:
        if self.netem is None:
            return ()
        return self.netem.bands or tuple(b.name for b in self.bands)

    def qdisc_kinds(self) -> tuple[str, ...]:
        """Every qdisc kind this profile needs, root first (for the kernel check)."""
        kinds = [self.root_kind]
        nb = set(self.netem_bands())
        for b in self.bands:
            kinds.append("netem" if b.name in nb else b.leaf_kind)
        return tuple(dict.fromkeys(kinds))


_TOP_KEYS = {"schema", "name", "description", "root", "bands", "default_band", "netem",
             "fallback"}
_ROOT_KEYS = {"kind", "rate"}
_BAND_KEYS = {"name", "priority", "dscp", "rate_pct", "ceil_pct", "limit_bytes",
              "limit_packets"}
_NETEM_KEYS = {"delay_ms", "jitter_ms", "loss_pct", "bands"}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def _err(profile: str, where: str, rule: str) -> ProfileError:
    return ProfileError(f"profile '{profile}': {where}: {rule}")


def _keys(pname: str, where: str, d: Any, allowed: set[str], required: set[str]) -> dict:
    if not isinstance(d, dict):
        raise _err(pname, where, f"must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(map(str, d)) - allowed)
    if unknown:
        raise _err(pname, where, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(d))
    if missing:
        raise _err(pname, where, f"missing required key(s) {missing}")
    return d


def _int(pname, where, v, lo=None, hi=None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(pname, where, f"must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _err(pname, where, f"{v} is outside {lo}..{hi}")
    return v


def _num(pname, where, v, lo, hi, lo_open=False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(pname, where, f"must be a number, got {v!r}")
    if not lo <= v <= hi or (lo_open and v == lo):   # also true for nan
        op = "<" if lo_open else "<="
        raise _err(pname, where, f"{v} must satisfy {lo} {op} value <= {hi}")
    return float(v)


def validate(data: Any, source: str = "<dict>") -> Profile:
    """Check a parsed YAML document against the schema and return a :class:`Profile`.

    Raises ProfileError naming the field and the rule, e.g.
    ``profile 'x': bands[2].dscp: 70 is outside 0..63``.
    """
    pname = data.get("name", "?") if isinstance(data, dict) else "?"
    pname = str(pname)
    _keys(pname, "top level", data, _TOP_KEYS, {"schema", "name", "root", "bands",
                                                "default_band"})
    if data["schema"] != SCHEMA_VERSION:
        raise _err(pname, "schema", f"must be {SCHEMA_VERSION}, got {data['schema']!r}")
    if not isinstance(data["name"], str) or not _NAME_RE.match(data["name"]):
        raise _err(pname, "name", "must match [a-z][a-z0-9_-]* (at most 32 characters)")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _err(pname, "description", "must be a string")

    root = _keys(pname, "root", data["root"], _ROOT_KEYS, {"kind"})
    kind = root["kind"]
    if kind not in ROOT_KINDS:
        raise _err(pname, "root.kind", f"{kind!r} is not one of {list(ROOT_KINDS)}")
    rate_bit = None
    if "rate" in root:
        if kind != "htb":
            raise _err(pname, "root.rate", "only root kind 'htb' shapes; remove rate")
        try:
            rate_bit = parse_rate(root["rate"])
        except ValueError as e:
            raise _err(pname, "root.rate", str(e)) from None
    elif kind == "htb":
        raise _err(pname, "root", "kind 'htb' needs rate (the link rate, e.g. '1gbit')")

    raw_bands = data["bands"]
    if not isinstance(raw_bands, list) or not raw_bands:
        raise _err(pname, "bands", "must be a non-empty list, highest priority first")
    if kind == "prio" and not 2 <= len(raw_bands) <= PRIO_MAX_BANDS:
        raise _err(pname, "bands", f"root kind 'prio' needs 2..{PRIO_MAX_BANDS} bands, "
                                   f"got {len(raw_bands)}")
    bands: list[Band] = []
    seen_dscp: dict[int, str] = {}
    rate_sum = 0.0
    for i, rb in enumerate(raw_bands):
        w = f"bands[{i}]"
        _keys(pname, w, rb, _BAND_KEYS, {"name", "priority"})
        name = rb["name"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise _err(pname, f"{w}.name", "must match [a-z][a-z0-9_-]*")
        if any(b.name == name for b in bands):
            raise _err(pname, f"{w}.name", f"band name {name!r} is used twice")
        hi = HTB_MAX_PRIO if kind == "htb" else PRIO_MAX_BANDS - 1
        prio = _int(pname, f"{w}.priority", rb["priority"], 0, hi)
        if bands:
            prev = bands[-1].priority
            if kind == "prio" and prio <= prev:
                raise _err(pname, f"{w}.priority", f"prio bands need strictly increasing "
                                                   f"priority in list order ({prio} after {prev})")
            if prio < prev:
                raise _err(pname, f"{w}.priority", f"bands are listed highest priority first; "
                                                   f"{prio} after {prev}")
        dscps = rb.get("dscp", [])
        if isinstance(dscps, int):
            dscps = [dscps]
        if not isinstance(dscps, list):
            raise _err(pname, f"{w}.dscp", "must be a list of DSCP code points 0..63")
        for d in dscps:
            _int(pname, f"{w}.dscp", d, 0, 63)
            if d in seen_dscp:
                raise _err(pname, f"{w}.dscp", f"DSCP {d} is already mapped to band "
                                               f"{seen_dscp[d]!r}")
            seen_dscp[d] = name
        rate_pct = ceil_pct = None
        if kind == "htb":
            rate_pct = _num(pname, f"{w}.rate_pct", rb.get("rate_pct", 1), 0, 100,
                            lo_open=True)
            ceil_pct = _num(pname, f"{w}.ceil_pct", rb.get("ceil_pct", 100), 0, 100,
                            lo_open=True)
            if ceil_pct < rate_pct:
                raise _err(pname, f"{w}.ceil_pct", f"{ceil_pct} is below rate_pct {rate_pct}")
            rate_sum += rate_pct
        else:
            for k in ("rate_pct", "ceil_pct"):
                if k in rb:
                    raise _err(pname, f"{w}.{k}", "root kind 'prio' does not shape; "
                                                  "use root kind 'htb'")
        lb, lp = rb.get("limit_bytes"), rb.get("limit_packets")
        if (lb is None) == (lp is None):
            raise _err(pname, w, "needs exactly one of limit_bytes (bfifo) or "
                                 "limit_packets (pfifo)")
        if lb is not None:
            _int(pname, f"{w}.limit_bytes", lb, 1500, 1 << 31)
        if lp is not None:
            _int(pname, f"{w}.limit_packets", lp, 1, 1 << 31)
        bands.append(Band(name, prio, tuple(dscps), rate_pct, ceil_pct, lb, lp))
    if rate_sum > 100:
        raise _err(pname, "bands", f"rate_pct adds up to {rate_sum:g} > 100")

    default = data["default_band"]
    if default not in [b.name for b in bands]:
        raise _err(pname, "default_band", f"{default!r} is not a band name "
                                          f"({[b.name for b in bands]})")

    netem = None
    if data.get("netem") is not None:
        rn = _keys(pname, "netem", data["netem"], _NETEM_KEYS, set())
        nb = rn.get("bands", [])
        if not isinstance(nb, list) or any(n not in [b.name for b in bands] for n in nb):
            raise _err(pname, "netem.bands", f"must list band names from "
                                             f"{[b.name for b in bands]}")
        netem = Netem(
            delay_ms=_num(pname, "netem.delay_ms", rn.get("delay_ms", 0), 0, 60_000),
            jitter_ms=_num(pname, "netem.jitter_ms", rn.get("jitter_ms", 0), 0, 60_000),
            loss_pct=_num(pname, "netem.loss_pct", rn.get("loss_pct", 0), 0, 100),
            bands=tuple(nb),
        )
    fallback = data.get("fallback")
    if fallback is not None and (not isinstance(fallback, str) or not _NAME_RE.match(fallback)):
        raise _err(pname, "fallback", "must be a profile name")
    return Profile(
        name=data["name"], description=description.strip(), root_kind=kind,
        rate_bit=rate_bit, bands=tuple(bands), default_band=default, netem=netem,
        fallback=fallback, source=source,
    )


def _profiles_dir():
    return resources.files(__package__).joinpath("profiles")


def list_profiles() -> list[str]:
    """Names of the shipped profiles (package data ``profiles/*.yaml``), sorted."""
    return sorted(p.name[:-5] for p in _profiles_dir().iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a shipped profile by name (``"htb-prio"``) or any YAML file by path.

    Raises ProfileError when the name is unknown, the YAML does not parse, or the
    document breaks the schema.
    """
    s = str(name_or_path)
    if s.endswith((".yaml", ".yml")) or "/" in s:
        path = Path(s)
        if path.is_dir():
            raise ProfileError(f"profile file {s!r} is a folder; give a YAML file in it "
                               f"or a shipped profile's name")
        if not path.is_file():
            if path.exists():   # breaker round 25: /dev/zero "does not exist"
                raise ProfileError(f"profile file {s!r} is not a regular file (a device, "
                                   f"a FIFO or a socket); give a YAML file")
            raise ProfileError(f"profile file {s!r} does not exist")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProfileError(f"profile file {s!r} is not UTF-8 text (byte 0x"
                               f"{e.object[e.start]:02x} at offset {e.start}); "
                               f"a profile is a YAML file") from None
        except OSError as e:
            raise ProfileError(f"cannot read profile file {s!r}: {e.strerror or e}") from None
        source = str(path)
    else:
        res = _profiles_dir().joinpath(f"{s}.yaml")
        if not res.is_file():
            raise ProfileError(f"unknown profile {s!r}; shipped profiles: "
                               f"{', '.join(list_profiles())}")
        text, source = res.read_text(), f"dgt.tc_profiles/profiles/{s}.yaml"
    return loads(text, source)


def loads(text: str, source: str = "<string>") -> Profile:
    """Parse and validate a profile from YAML text. Raises ProfileError."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProfileError(f"{source}: not valid YAML: {str(e).splitlines()[0]}") from None
    except (ValueError, RecursionError) as e:  # e.g. a YAML int too big, deep nesting
        raise ProfileError(f"{source}: not a usable YAML document: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile must be a YAML mapping")
    return validate(data, source)


__all__ = ["Band", "Netem", "Profile", "ProfileError", "format_rate", "list_profiles",
           "load_profile", "loads", "parse_rate", "validate"]
