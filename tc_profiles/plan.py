"""Compile a profile into tc operations, render them as ``tc`` lines, build netlink.

One list of :class:`TcOp` drives everything: :func:`render_tc` prints the equivalent
``tc`` commands (the dry run), and :func:`build_message` turns each op into the exact
``tcmsg`` the applier sends. Tests build and decode the messages without sending them,
so profiles whose qdiscs this kernel lacks (prio, netem) are still checked.

Handles: root ``d6:``; HTB parent class ``d6:1``; band i is class ``d6:(10+i)`` (hex)
under HTB, or ``d6:(i+1)`` under prio (the kernel numbers prio bands from 1); band i's
leaf qdisc is ``(10+i):``. Filters: u32 on the IPv4 DSCP byte, key ``'0xb8/0xfc+1'``
for EF (offset 1 = TOS byte, mask 0xfc = the DSCP bits, RFC 2474), and on the IPv6
traffic class (``'0x0b800000/0x0fc00000+0'``).
"""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field

from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.rtnl import (RTM_DELQDISC, RTM_NEWQDISC, RTM_NEWTCLASS,
                                   RTM_NEWTFILTER, TC_H_ROOT)
from pyroute2.netlink.rtnl.tcmsg import (cls_u32, plugins, sched_htb, sched_netem,
                                         sched_pfifo, tcmsg)

from .schema import NETEM_PACKET_BYTES, Profile, format_rate

# pyroute2 0.9.7 has no 'bfifo' plugin; bfifo takes the same struct tc_fifo_qopt
# (one u32 limit, in bytes) as pfifo. Registering it also lets dumps decode bfifo.
plugins.setdefault("bfifo", sched_pfifo)

ROOT_MAJOR = 0xD6
ROOT_HANDLE = ROOT_MAJOR << 16
HTB_PARENT_CLASS = ROOT_HANDLE | 1
LEAF_MAJOR_BASE = 0x10
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
FILTER_PRIO_IPV4 = 1
FILTER_PRIO_IPV6 = 2
HZ = 1000            # burst = rate / HZ + MTU, as tc(8) computes its default
MTU_BYTES = 1600
R2Q = 10

CREATE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL


def fmt_handle(h: int, qdisc: bool = False) -> str:
    """0xd60010 -> 'd6:10'; a qdisc handle 0xd60000 -> 'd6:'; TC_H_ROOT -> 'root'."""
    if h == TC_H_ROOT:
        return "root"
    major, minor = h >> 16, h & 0xFFFF
    if qdisc and minor == 0:
        return f"{major:x}:"
    return f"{major:x}:{minor:x}"


def band_classid(profile: Profile, i: int) -> int:
    """Class id of band i (list order)."""
    if profile.root_kind == "prio":
        return ROOT_HANDLE | (i + 1)
    return ROOT_HANDLE | (LEAF_MAJOR_BASE + i)


def dscp_keys_ipv4(dscp: int) -> list[str]:
    """u32 key for the IPv4 DSCP bits: TOS byte at offset 1, mask 0xfc."""
    return [f"0x{dscp << 2:02x}/0xfc+1"]


def dscp_keys_ipv6(dscp: int) -> list[str]:
    """u32 key for the IPv6 traffic-class DSCP bits (bits 4..9 of the first word)."""
    return [f"0x{dscp << 22:08x}/0x0fc00000+0"]


@dataclass(frozen=True)
class TcOp:
    """One tc object to create: a qdisc, a class or a filter.

    ``params`` units: rates in bytes/s (``rate_Bps``), sizes in bytes, times in µs.
    """
    obj: str                 # 'qdisc' | 'class' | 'filter'
    kind: str                # 'htb' | 'prio' | 'bfifo' | 'pfifo' | 'netem' | 'u32'
    handle: int
    parent: int
    params: dict = field(default_factory=dict)
    band: str | None = None


def compile_profile(profile: Profile, rate_bit: int | None = None,
                    check: bool = True) -> list[TcOp]:
    """The ops that build ``profile`` on one device, in creation order.

    ``rate_bit`` overrides the profile's link rate (HTB only). Raises ValueError when
    an override is given for a prio profile, or (``check``) when a computed value
    (rate, burst, cburst, quantum, limit) does not fit its netlink field.
    """
    if check:
        check_limits(profile, rate_bit)
    ops: list[TcOp] = []
    nbands = set(profile.netem_bands())
    names = [b.name for b in profile.bands]
    default_i = names.index(profile.default_band)
    if profile.root_kind == "htb":
        link = rate_bit or profile.rate_bit
        assert link
        ops.append(TcOp("qdisc", "htb", ROOT_HANDLE, TC_H_ROOT,
                        {"default": LEAF_MAJOR_BASE + default_i, "r2q": R2Q}))
        link_Bps = link // 8
        ops.append(TcOp("class", "htb", HTB_PARENT_CLASS, ROOT_HANDLE,
                        _htb_class(link_Bps, link_Bps, 0)))
    else:
        if rate_bit is not None:
            raise ValueError(f"profile '{profile.name}' (root prio) does not shape; "
                             "a rate needs an htb profile")
        link = None
        ops.append(TcOp("qdisc", "prio", ROOT_HANDLE, TC_H_ROOT,
                        {"bands": len(profile.bands), "priomap": [default_i] * 16}))
    for i, b in enumerate(profile.bands):
        cid = band_classid(profile, i)
        if profile.root_kind == "htb":
            link_Bps = link // 8
            ops.append(TcOp("class", "htb", cid, HTB_PARENT_CLASS,
                            _htb_class(max(1, int(link_Bps * b.rate_pct / 100)),
                                       max(1, int(link_Bps * b.ceil_pct / 100)),
                                       b.priority), band=b.name))
        leaf = (LEAF_MAJOR_BASE + i) << 16
        if b.name in nbands:
            ne = profile.netem
            pkts = b.limit_packets or max(1, b.limit_bytes // NETEM_PACKET_BYTES)
            if link and ne.delay_ms:   # room for the packets held back by the delay
                pkts += math.ceil(link / 8 * ne.delay_ms / 1000 / NETEM_PACKET_BYTES)
            ops.append(TcOp("qdisc", "netem", leaf, cid,
                            {"limit": pkts, "delay_us": int(ne.delay_ms * 1000),
                             "jitter_us": int(ne.jitter_ms * 1000),
                             "loss_pct": ne.loss_pct}, band=b.name))
        elif b.limit_bytes is not None:
            ops.append(TcOp("qdisc", "bfifo", leaf, cid, {"limit": b.limit_bytes},
                            band=b.name))
        else:
            ops.append(TcOp("qdisc", "pfifo", leaf, cid, {"limit": b.limit_packets},
                            band=b.name))
    for i, b in enumerate(profile.bands):
        cid = band_classid(profile, i)
        for d in b.dscp:
            ops.append(TcOp("filter", "u32", 0, ROOT_HANDLE,
                            {"protocol": ETH_P_IP, "prio": FILTER_PRIO_IPV4,
                             "keys": dscp_keys_ipv4(d), "target": cid, "dscp": d},
                            band=b.name))
            ops.append(TcOp("filter", "u32", 0, ROOT_HANDLE,
                            {"protocol": ETH_P_IPV6, "prio": FILTER_PRIO_IPV6,
                             "keys": dscp_keys_ipv6(d), "target": cid, "dscp": d},
                            band=b.name))
    return ops


U32_MAX = (1 << 32) - 1
_RTAB_MAX_SIZE = 2048   # largest packet size in pyroute2's rate table (256 cells << 3)


def op_limit_problems(op: TcOp) -> list[tuple[str, str]]:
    """What of ``op`` does not fit its netlink field: ``[(direction, text)]`` with
    direction ``'low'`` (the rate is too small: a transmit time overflows) or ``'high'``
    (a byte count overflows). Empty when everything fits. Mirrors what pyroute2
    encodes (``calc_xmittime`` ticks, the 256-entry rate tables) and what tc(8) shows
    (burst/cburst in bytes, u32)."""
    from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime
    out: list[tuple[str, str]] = []
    p = op.params
    if op.obj == "class" and op.kind == "htb":
        for rk, bk, name in (("rate_Bps", "burst", "burst"), ("ceil_Bps", "cburst", "cburst")):
            rate, burst = p[rk], p[bk]
            if rate < 1:
                out.append(("low", f"{rk[:-4]} {rate} B/s is below 1 B/s"))
                continue
            if burst > U32_MAX:
                out.append(("high", f"{name} {burst} B exceeds {U32_MAX}"))
            ticks = calc_xmittime(rate, burst)
            tab = calc_xmittime(min(rate, U32_MAX), _RTAB_MAX_SIZE)
            if ticks > U32_MAX or tab > U32_MAX:
                out.append(("low", f"{rk[:-4]} {format_rate(rate * 8)}: {name} time "
                                   f"{max(ticks, tab)} ticks exceeds {U32_MAX}"))
        if p["quantum"] > U32_MAX:
            out.append(("high", f"quantum {p['quantum']} exceeds {U32_MAX}"))
    elif op.obj == "qdisc" and op.kind in ("bfifo", "pfifo", "netem"):
        if p["limit"] > U32_MAX:
            out.append(("high", f"{op.kind} limit {p['limit']} exceeds {U32_MAX}"))
    return out


def _problems(profile: Profile, rate_bit: int | None) -> list[tuple[TcOp, str, str]]:
    return [(op, d, t) for op in compile_profile(profile, rate_bit, check=False)
            for d, t in op_limit_problems(op)]


def _search(profile: Profile, lo: int, hi: int, ok_at_hi: bool) -> int:
    """Boundary between failing and fitting link rates in [lo, hi] (bisection)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (not _problems(profile, mid)) == ok_at_hi:
            hi = mid
        else:
            lo = mid
    return hi if ok_at_hi else lo


def check_limits(profile: Profile, rate_bit: int | None = None) -> None:
    """Raise ValueError (one line, naming the profile, the band and the usable --rate
    range) when a computed netlink value of ``profile`` at ``rate_bit`` does not fit
    its field. Called by :func:`compile_profile`, so dry runs and applies agree."""
    probs = _problems(profile, rate_bit)
    if not probs:
        return
    op, direction, text = probs[0]
    link = rate_bit or profile.rate_bit
    where = f"profile '{profile.name}'" + (f", band '{op.band}'" if op.band else ", root class")
    ref = 10**9  # a rate every shipped profile fits
    if direction == "low":
        bound = (_search(profile, max(1, link), max(ref, link), True)
                 if not _problems(profile, max(ref, link)) else None)
        hint = (f"; the minimum usable --rate is {format_rate(_round_up(bound))}"
                if bound else "")
    else:
        bound = (_search(profile, min(ref, link), link, False)
                 if not _problems(profile, min(ref, link)) else None)
        hint = (f"; the maximum usable --rate is {format_rate(_round_down(bound))}"
                if bound else "")
    raise ValueError(f"{where}: rate {format_rate(link)} does not fit the kernel's "
                     f"32-bit fields ({text}){hint}")


def _round_up(bits: int) -> int:
    """A readable rate >= bits (whole kbit/mbit above 10 units)."""
    for mult in (10**9, 10**6, 10**3):
        if bits >= 10 * mult:
            return -(-bits // mult) * mult
    return bits


def _round_down(bits: int) -> int:
    for mult in (10**9, 10**6, 10**3):
        if bits >= 10 * mult:
            return bits // mult * mult
    return bits


def _htb_class(rate_Bps: int, ceil_Bps: int, prio: int) -> dict:
    return {
        "rate_Bps": rate_Bps, "ceil_Bps": ceil_Bps, "prio": prio,
        "burst": rate_Bps // HZ + MTU_BYTES, "cburst": ceil_Bps // HZ + MTU_BYTES,
        # quantum = rate / r2q as the kernel would pick, clamped to its sane range so
        # the kernel logs no "quantum is big/small" warning.
        "quantum": min(max(rate_Bps // R2Q, 1514), 200000),
    }


# --------------------------------------------------------------------- tc lines


def render_tc(ops: list[TcOp], dev: str, netns: str | None = None,
              delete_root_first: bool = True) -> list[str]:
    """The ``tc`` command lines equivalent to ``ops`` (what a dry run prints)."""
    tc = f"tc -n {netns}" if netns else "tc"
    lines = []
    if delete_root_first:
        lines.append(f"{tc} qdisc del dev {dev} root 2>/dev/null || true")
    for op in ops:
        p = op.params
        par = "root" if op.parent == TC_H_ROOT else f"parent {fmt_handle(op.parent, True)}"
        if op.obj == "qdisc":
            head = f"{tc} qdisc add dev {dev} {par} handle {fmt_handle(op.handle, True)}"
            if op.kind == "htb":
                lines.append(f"{head} htb default {p['default']:x} r2q {p['r2q']}")
            elif op.kind == "prio":
                pm = " ".join(str(x) for x in p["priomap"])
                lines.append(f"{head} prio bands {p['bands']} priomap {pm}")
            elif op.kind in ("bfifo", "pfifo"):
                lines.append(f"{head} {op.kind} limit {p['limit']}")
            elif op.kind == "netem":
                s = f"{head} netem limit {p['limit']}"
                if p["delay_us"]:
                    s += f" delay {p['delay_us']}us"
                    if p["jitter_us"]:
                        s += f" {p['jitter_us']}us"
                if p["loss_pct"]:
                    s += f" loss {p['loss_pct']:g}%"
                lines.append(s)
        elif op.obj == "class":
            lines.append(
                f"{tc} class add dev {dev} parent {fmt_handle(op.parent, True)} classid "
                f"{fmt_handle(op.handle)} htb rate {format_rate(p['rate_Bps'] * 8)} "
                f"ceil {format_rate(p['ceil_Bps'] * 8)} burst {p['burst']} "
                f"cburst {p['cburst']} prio {p['prio']} quantum {p['quantum']}")
        elif op.obj == "filter":
            d = p["dscp"]
            if p["protocol"] == ETH_P_IP:
                match = f"match ip dsfield 0x{d << 2:02x} 0xfc"
                proto = "ip"
            else:
                match = f"match ip6 priority 0x{d << 2:02x} 0xfc"
                proto = "ipv6"
            lines.append(f"{tc} filter add dev {dev} parent {fmt_handle(op.parent, True)} "
                         f"protocol {proto} prio {p['prio']} u32 {match} "
                         f"flowid {fmt_handle(p['target'])}")
    return lines


# ------------------------------------------------------------------ netlink


def build_message(op: TcOp, ifindex: int) -> tuple[int, int, tcmsg]:
    """(msg_type, msg_flags, tcmsg) that creates ``op`` on device ``ifindex``.

    The message is complete but not encoded; ``msg.encode()`` gives the bytes.
    """
    p = op.params
    msg = tcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = ifindex
    msg["handle"] = op.handle
    msg["parent"] = op.parent
    msg["info"] = 0
    if op.obj == "qdisc":
        if op.kind == "htb":
            opts = sched_htb.get_parameters({"default": p["default"], "r2q": p["r2q"]})
        elif op.kind == "prio":
            opts = {"bands": p["bands"], "priomap": tuple(p["priomap"])}
        elif op.kind in ("bfifo", "pfifo"):
            opts = {"limit": p["limit"]}
        elif op.kind == "netem":
            opts = sched_netem.get_parameters({"limit": p["limit"], "delay": p["delay_us"],
                                               "jitter": p["jitter_us"],
                                               "loss": p["loss_pct"]})
        else:
            raise ValueError(f"no netlink builder for qdisc kind {op.kind!r}")
        mtype = RTM_NEWQDISC
    elif op.obj == "class":
        opts = sched_htb.get_class_parameters({
            "rate": p["rate_Bps"], "ceil": p["ceil_Bps"], "prio": p["prio"],
            "burst": p["burst"], "cburst": p["cburst"], "quantum": p["quantum"],
            "mtu": MTU_BYTES})
        mtype = RTM_NEWTCLASS
    elif op.obj == "filter":
        opts = cls_u32.get_parameters({"target": p["target"], "keys": p["keys"]})
        msg["info"] = (socket.htons(p["protocol"]) & 0xFFFF) | ((p["prio"] << 16) & 0xFFFF0000)
        mtype = RTM_NEWTFILTER
    else:
        raise ValueError(op.obj)
    msg["attrs"] = [["TCA_KIND", op.kind], ["TCA_OPTIONS", opts]]
    return mtype, CREATE, msg


def build_delete_root(ifindex: int) -> tuple[int, int, tcmsg]:
    """(RTM_DELQDISC, flags, tcmsg) that deletes the root qdisc of ``ifindex``."""
    msg = tcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = ifindex
    msg["parent"] = TC_H_ROOT
    msg["handle"] = 0
    msg["attrs"] = []
    return RTM_DELQDISC, NLM_F_REQUEST | NLM_F_ACK, msg


def encode(msg: tcmsg, msg_type: int, msg_flags: int) -> bytes:
    """Encode a built message to its wire bytes (header included), without sending."""
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = msg_flags
    msg["header"]["sequence_number"] = 1
    msg["header"]["pid"] = 0
    msg.encode()
    return bytes(msg.data[: msg["header"]["length"]])


def decode(data: bytes) -> tcmsg:
    """Decode wire bytes back into a tcmsg (for tests and debugging)."""
    m = tcmsg(data)
    m.decode()
    return m


__all__ = ["ROOT_HANDLE", "TcOp", "band_classid", "build_delete_root", "build_message",
           "compile_profile", "decode", "dscp_keys_ipv4", "dscp_keys_ipv6", "encode",
           "fmt_handle", "render_tc"]
