"""Apply, show and clear tc profiles on a device, over netlink (pyroute2).

Never shells out to ``tc``. Synchronous on purpose: pyroute2 netlink must not run inside
a uvloop loop (docs/architecture.md), so call these from a thread or outside the event loop.

Example::

    from dgt.tc_profiles import applier
    applier.apply("htb-prio", "eth0", rate="950mbit")
    print(applier.render_table(applier.show("eth0")))
    applier.clear("eth0")
"""
from __future__ import annotations

import errno
import logging
import socket
import struct

from pyroute2.netlink import NLM_F_DUMP, NLM_F_REQUEST
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_GETQDISC, RTM_GETTCLASS, RTM_GETTFILTER, TC_H_ROOT
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from . import kernel
from ._nl import open_ipr, request
from .plan import (ETH_P_IP, ETH_P_IPV6, HTB_PARENT_CLASS, LEAF_MAJOR_BASE, ROOT_HANDLE,
                   ROOT_MAJOR, build_delete_root, build_message, compile_profile, encode,
                   fmt_handle, render_tc)
from .schema import Profile, ProfileError, format_rate, load_profile, parse_rate

log = logging.getLogger(__name__)


class TcError(RuntimeError):
    """Applying, showing or clearing failed; the message is one line saying what to do."""


class MissingQdiscError(TcError):
    """The profile needs a qdisc this kernel lacks. Raised before anything changes."""


class ForeignQdiscError(TcError):
    """The device's root qdisc is someone else's (neither dgt's nor the kernel's
    default; one with dgt's handle ``d6:`` but not dgt's tree too); apply keeps it
    unless forced, and clear keeps one with handle ``d6:``. Raised before anything
    changes."""


#: root qdiscs the kernel gives a device of its own (net.core.default_qdisc and the
#: multiqueue mq): replacing one loses no one's configuration
KERNEL_DEFAULT_KINDS = frozenset({"noqueue", "pfifo_fast", "mq", "fq_codel"})


def _profile(profile: Profile | str) -> Profile:
    return profile if isinstance(profile, Profile) else load_profile(profile)


def _rate_bit(rate: str | int | None) -> int | None:
    if rate is None:
        return None
    try:
        return parse_rate(rate)
    except ValueError as e:
        raise TcError(str(e)) from None


def check_kernel(profile: Profile | str) -> None:
    """Raise MissingQdiscError when this kernel lacks a qdisc the profile needs.

    The message is one line: ``qdisc 'prio' is not in this kernel; use profile
    'htb-prio'``. Probes the kernel (kernel.missing_qdiscs); needs root.
    """
    p = _profile(profile)
    try:
        missing = kernel.missing_qdiscs(p.qdisc_kinds())
    except kernel.KernelProbeError as e:
        raise TcError(str(e)) from None
    if missing:
        alt = p.fallback or "htb-prio"
        raise MissingQdiscError(f"qdisc '{missing[0]}' is not in this kernel; "
                                f"use profile '{alt}' (profile '{p.name}' needs it)")


def dry_run(profile: Profile | str, dev: str, netns: str | None = None,
            rate: str | int | None = None) -> list[str]:
    """The ``tc`` command lines equivalent to :func:`apply`. Changes nothing, needs no root.

    Raises ProfileError (bad profile) or TcError (bad rate).
    """
    p = _profile(profile)
    ops = _compile(p, rate)
    _prebuild(ops, 1)
    return render_tc(ops, dev, netns)


def _compile(p: Profile, rate) -> list:
    try:
        return compile_profile(p, _rate_bit(rate))
    except ValueError as e:
        raise TcError(str(e).splitlines()[0]) from None


def _prebuild(ops, ifindex: int) -> list:
    """Build and encode every message before anything changes: a value that does not
    fit its netlink field fails here, with the device untouched."""
    msgs = []
    for op in ops:
        try:
            t, f, m = build_message(op, ifindex)
            encode(m, t, f)
            m = build_message(op, ifindex)[2]  # a fresh, unencoded copy to send
        except (struct.error, OverflowError, ValueError, TypeError) as e:
            where = f"band '{op.band}'" if op.band else f"{op.obj} {fmt_handle(op.handle)}"
            raise TcError(f"{where}: {op.kind} {op.obj} cannot be encoded for netlink "
                          f"({e}); nothing was changed") from None
        msgs.append((t, f, m))
    return msgs


def _ifindex(ipr, dev: str, netns: str | None) -> int:
    idx = ipr.link_lookup(ifname=dev)
    if not idx:
        where = f" in netns '{netns}'" if netns else ""
        raise TcError(f"device '{dev}' not found{where}")
    return idx[0]


def _open(netns: str | None):
    try:
        return open_ipr(netns)
    except LookupError as e:
        raise TcError(str(e)) from None


def _delete_root(ipr, ifindex: int) -> bool:
    t, f, m = build_delete_root(ifindex)
    try:
        request(ipr, m, t, f)
        return True
    except NetlinkError as e:
        # ENOENT/EINVAL: only the default root qdisc is there (nothing to delete).
        if e.code in (errno.ENOENT, errno.EINVAL):
            return False
        raise


def apply(profile: Profile | str, dev: str, netns: str | None = None,
          rate: str | int | None = None, force: bool = False,
          before_commit=None) -> Profile:
    """Install ``profile`` as the root qdisc tree of ``dev`` (in ``netns``), idempotently.

    The root qdisc ``dev`` had is deleted first (dgt's, or the kernel's default; any
    other only with ``force``, as :func:`clear`; dgt's is handle ``d6:`` with dgt's
    classes, :func:`_is_dgts`), then the profile's qdiscs, classes
    and u32 DSCP filters are created; applying twice gives the same state. ``rate``
    ("1gbit", bits/s as int) overrides the profile's link rate (HTB profiles only).
    ``before_commit``: called with no arguments just before the last netlink message,
    inside the transaction (an exception it raises, KeyboardInterrupt included, rolls
    back as any other); the CLI blocks the stop signals there, so that from then on
    the apply completes.

    Raises ProfileError (bad profile), MissingQdiscError (the kernel lacks a qdisc the
    profile needs), ForeignQdiscError (``dev``'s root qdisc is someone else's and not
    ``force``): both before anything changes; TcError (no such device or netns,
    netlink failure; the device is left with its default root qdisc).
    """
    p = _profile(profile)
    ops = _compile(p, rate)
    _prebuild(ops, 1)
    check_kernel(p)
    with _open(netns) as ipr:
        ifindex = _ifindex(ipr, dev, netns)
        msgs = _prebuild(ops, ifindex)
        if not force:
            _refuse_foreign_root(ipr, ifindex, dev, netns)
        done = 0
        changed = False
        try:
            changed = True
            _delete_root(ipr, ifindex)
            for t, f, m in msgs:
                if done == len(msgs) - 1 and before_commit is not None:
                    before_commit()
                request(ipr, m, t, f)
                done += 1
        except BaseException as e:
            # transactional: whatever went wrong once changes began (kernel refusal,
            # Python exception, Ctrl-C), remove our half-built root: the device is
            # back to the kernel's default root qdisc.
            if changed:
                try:
                    _delete_root(ipr, ifindex)
                except Exception:  # noqa: BLE001 - report the original failure
                    pass
            if isinstance(e, NetlinkError):
                bad = render_tc([ops[done]], dev, netns, delete_root_first=False)[0]
                raise TcError(f"kernel refused `{bad}`: {e.args[-1] if e.args else e} "
                              f"(errno {e.code}); root qdisc of {dev} reset") from None
            if isinstance(e, Exception):
                raise TcError(f"applying profile '{p.name}' failed at "
                              f"{ops[min(done, len(ops) - 1)].obj} "
                              f"{fmt_handle(ops[min(done, len(ops) - 1)].handle)}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              f"; root qdisc of {dev} reset") from None
            if changed and isinstance(e, KeyboardInterrupt):   # for the one line
                raise KeyboardInterrupt(f"root qdisc of {dev} reset") from None
            raise
    log.info("applied tc profile %s on %s%s", p.name, dev, f" (netns {netns})" if netns else "")
    return p


def _root_qdisc(ipr, ifindex: int):
    """The root qdisc message of ``ifindex``, or None (a device with none listed)."""
    root = [q for q in _dump(ipr, RTM_GETQDISC, ifindex) if q["parent"] == TC_H_ROOT]
    return root[0] if root else None


def _is_dgts(ipr, ifindex: int, root) -> bool:
    """Whether root qdisc ``root`` (handle ``d6:``) is dgt's tree, as
    :func:`plan.compile_profile` builds it: under htb, class ``d6:1`` at the root and
    band classes ``d6:(10+i)`` under it; under prio, the kernel's band classes
    ``d6:(i+1)``; either way bands i = 0..n-1 (n >= 1), each with its leaf qdisc
    ``(10+i):``, and no other class. (Someone's ``tc qdisc add dev X root handle d6:
    htb`` has no class; dgt's handle alone does not make a qdisc dgt's.)"""
    kind = root.get_attr("TCA_KIND")
    if kind not in ("htb", "prio"):
        return False
    # class -> (its parent, its leaf qdisc's handle: 0 for an inner class)
    classes = {c["handle"]: (c["parent"], c["info"])
               for c in _dump(ipr, RTM_GETTCLASS, ifindex)}
    if kind == "htb" and classes.pop(HTB_PARENT_CLASS, None) != (TC_H_ROOT, 0):
        return False
    first = ROOT_HANDLE | (LEAF_MAJOR_BASE if kind == "htb" else 1)
    parent = HTB_PARENT_CLASS if kind == "htb" else TC_H_ROOT   # prio's bands: root
    bands = sorted(classes)
    return bool(bands) and bands == list(range(first, first + len(bands))) and all(
        classes[c] == (parent, (LEAF_MAJOR_BASE + i) << 16) for i, c in enumerate(bands))


def _not_dgts_text(q, dev: str, netns: str | None, force_does: str) -> str:
    """ForeignQdiscError's line for root qdisc ``q`` of handle ``d6:`` that is not
    dgt's tree: what is there, and what to do."""
    tc = f"tc{f' -n {netns}' if netns else ''} qdisc del dev {dev} root"
    return (f"the root qdisc of {dev} is {q.get_attr('TCA_KIND')} "
            f"{fmt_handle(q['handle'], True)}, dgt's handle but not dgt's classes "
            f"(d6:1 and its bands); nothing was changed (delete it yourself with "
            f"`{tc}`, or --force {force_does} it)")


def _refuse_foreign_root(ipr, ifindex: int, dev: str, netns: str | None = None) -> None:
    """Raise ForeignQdiscError when ``dev``'s root qdisc is neither dgt's (handle
    ``d6:`` with dgt's classes, :func:`_is_dgts`) nor the kernel's default (handle
    ``0:``, which only the kernel gives, or a kind in KERNEL_DEFAULT_KINDS): the rule
    :func:`clear` follows."""
    q = _root_qdisc(ipr, ifindex)
    if q is None or (q["handle"] >> 16) == 0:
        return
    if (q["handle"] >> 16) == ROOT_MAJOR:
        if _is_dgts(ipr, ifindex, q):
            return
        raise ForeignQdiscError(_not_dgts_text(q, dev, netns, "replaces"))
    kind = q.get_attr("TCA_KIND")
    if kind in KERNEL_DEFAULT_KINDS:
        return
    raise ForeignQdiscError(f"the root qdisc of {dev} is {kind} "
                            f"{fmt_handle(q['handle'], True)}, not dgt's; nothing was "
                            f"changed (--force replaces it)")


def clear(dev: str, netns: str | None = None, force: bool = False) -> bool:
    """Delete our root qdisc (handle ``d6:`` with dgt's classes, :func:`_is_dgts`)
    from ``dev``; the kernel's default returns.

    With ``force``, delete whatever root qdisc is there. Returns True when something
    was deleted, False when there was nothing of ours (another handle). Raises
    TcError; ForeignQdiscError, nothing deleted, for a root qdisc with handle ``d6:``
    that is not dgt's tree (someone else's, with dgt's handle).
    """
    with _open(netns) as ipr:
        ifindex = _ifindex(ipr, dev, netns)
        root = _root_qdisc(ipr, ifindex)
        if root is None:
            return False
        if not force and (root["handle"] >> 16) != ROOT_MAJOR:
            return False
        if not force and not _is_dgts(ipr, ifindex, root):
            raise ForeignQdiscError(_not_dgts_text(root, dev, netns, "deletes"))
        try:
            return _delete_root(ipr, ifindex)
        except NetlinkError as e:
            raise TcError(f"cannot delete the root qdisc of {dev}: errno {e.code}") from None


# ------------------------------------------------------------------------- show


def _dump(ipr, msg_type: int, ifindex: int, parent: int = 0) -> list:
    m = tcmsg()
    m["family"] = socket.AF_UNSPEC
    m["index"] = ifindex
    m["parent"] = parent
    return [x for x in request(ipr, m, msg_type, NLM_F_REQUEST | NLM_F_DUMP)
            if x["index"] == ifindex]


def _stats(msg) -> dict:
    out = {"bytes": 0, "packets": 0, "drops": 0, "overlimits": 0, "backlog": 0, "qlen": 0}
    st2 = msg.get_attr("TCA_STATS2")
    if st2 is not None:
        basic = st2.get_attr("TCA_STATS_BASIC")
        queue = st2.get_attr("TCA_STATS_QUEUE")
        if basic:
            out["bytes"], out["packets"] = basic["bytes"], basic["packets"]
        if queue:
            for k in ("drops", "overlimits", "backlog", "qlen"):
                out[k] = queue[k]
        return out
    st = msg.get_attr("TCA_STATS")
    if st:
        out.update(bytes=st["bytes"], packets=st["packets"], drops=st["drop"],
                   overlimits=st["overlimits"], backlog=st["backlog"], qlen=st["qlen"])
    return out


def _u32_keys(sel) -> list[tuple[int, int, int]]:
    """(offset, mask, value) of each u32 key, read from the raw TCA_U32_SEL bytes.

    pyroute2 0.9.7 decodes the keys 4 bytes off, so read them here: nla header (4) +
    struct tc_u32_sel (16), then nkeys x struct tc_u32_key {be32 mask, be32 val,
    int off, int offmask}.
    """
    base = sel.offset + 20
    keys = []
    for i in range(sel["nkeys"]):
        mask, val = struct.unpack_from(">II", sel.data, base + 16 * i)
        off, _ = struct.unpack_from("=ii", sel.data, base + 16 * i + 8)
        keys.append((off, mask, val))
    return keys


def _dscp_of(protocol: int, keys: list[tuple[int, int, int]]) -> int | None:
    """The DSCP a u32 filter matches, or None when it is not a plain DSCP match."""
    if len(keys) != 1:
        return None
    off, mask, val = keys[0]
    # normalise to (byte offset, mask byte, value byte) for single-byte masks
    nz = [(j, (mask >> (24 - 8 * j)) & 0xFF) for j in range(4)]
    nz = [(j, mb) for j, mb in nz if mb]
    if protocol == ETH_P_IP and len(nz) == 1 and off + nz[0][0] == 1 and nz[0][1] == 0xFC:
        j = nz[0][0]
        return ((val >> (24 - 8 * j)) & 0xFF) >> 2
    if protocol == ETH_P_IPV6 and off == 0 and mask == 0x0FC00000:
        return (val >> 22) & 0x3F
    return None


def show(dev: str, netns: str | None = None) -> dict:
    """The tc state of ``dev``: qdiscs, classes and filters with live counters.

    Returns ``{"dev", "netns", "qdiscs": [...], "classes": [...], "filters": [...]}``.
    Each qdisc and class has ``stats`` = {bytes, packets, drops, overlimits, backlog,
    qlen} (bytes in bytes, counters since creation). HTB classes carry ``rate_bit``,
    ``ceil_bit``, ``prio`` and the ``dscp`` list of the filters that point at them; the
    HTB root carries ``default`` and ``direct_packets_stat``. Raises TcError.
    """
    with _open(netns) as ipr:
        ifindex = _ifindex(ipr, dev, netns)
        qmsgs = _dump(ipr, RTM_GETQDISC, ifindex)
        cmsgs = _dump(ipr, RTM_GETTCLASS, ifindex)
        fmsgs = []
        for q in qmsgs:
            if q.get_attr("TCA_KIND") in ("htb", "prio"):
                fmsgs += _dump(ipr, RTM_GETTFILTER, ifindex, parent=q["handle"])
    qdiscs, classes, filters = [], [], []
    for q in qmsgs:
        kind = q.get_attr("TCA_KIND")
        d = {"kind": kind, "handle": fmt_handle(q["handle"], True),
             "parent": fmt_handle(q["parent"], True), "stats": _stats(q)}
        opts = q.get_attr("TCA_OPTIONS")
        try:
            if kind == "htb" and opts is not None:
                init = opts.get_attr("TCA_HTB_INIT")
                if init:
                    d["default"] = f"{q['handle'] >> 16:x}:{init['defcls']:x}"
                    d["direct_packets_stat"] = init["direct_pkts"]
            elif kind in ("bfifo", "pfifo") and opts is not None:
                d["limit"] = opts["limit"]
            elif kind == "prio" and opts is not None:
                d["bands"], d["priomap"] = opts["bands"], list(opts["priomap"])
            elif kind == "netem" and opts is not None:
                d["limit"] = opts["limit"]
        except (KeyError, TypeError):
            pass
        qdiscs.append(d)
    for c in cmsgs:
        kind = c.get_attr("TCA_KIND")
        d = {"kind": kind, "classid": fmt_handle(c["handle"]),
             "parent": fmt_handle(c["parent"], True),
             "leaf": fmt_handle(c["info"], True) if c["info"] else None,
             "stats": _stats(c), "dscp": []}
        opts = c.get_attr("TCA_OPTIONS")
        if kind == "htb" and opts is not None:
            parms = opts.get_attr("TCA_HTB_PARMS")
            if parms:
                rate = opts.get_attr("TCA_HTB_RATE64") or parms["rate"]
                ceil = opts.get_attr("TCA_HTB_CEIL64") or parms["ceil"]
                d.update(rate_bit=rate * 8, ceil_bit=ceil * 8, prio=parms["prio"],
                         quantum=parms["quantum"])
        classes.append(d)
    by_id = {c["classid"]: c for c in classes}
    for f in fmsgs:
        opts = f.get_attr("TCA_OPTIONS")
        if f.get_attr("TCA_KIND") != "u32" or opts is None:
            continue
        cid = opts.get_attr("TCA_U32_CLASSID")
        if cid is None:
            continue            # u32 hash-table nodes
        protocol = socket.ntohs(f["info"] & 0xFFFF)
        sel = opts.get_attr("TCA_U32_SEL")
        keys = _u32_keys(sel) if sel is not None else []
        dscp = _dscp_of(protocol, keys)
        d = {"kind": "u32", "parent": fmt_handle(f["parent"], True),
             "prio": f["info"] >> 16, "protocol": {ETH_P_IP: "ip", ETH_P_IPV6: "ipv6"}
             .get(protocol, hex(protocol)), "handle": f"{f['handle']:x}",
             "classid": fmt_handle(cid), "dscp": dscp,
             "keys": [f"0x{v:08x}/0x{m:08x}+{o}" for o, m, v in keys]}
        filters.append(d)
        if dscp is not None and d["protocol"] == "ip" and d["classid"] in by_id:
            by_id[d["classid"]]["dscp"].append(dscp)
    for c in classes:
        c["dscp"].sort()
    qdiscs.sort(key=lambda d: (d["parent"] != "root", d["handle"]))
    classes.sort(key=lambda d: int(d["classid"].split(":")[1], 16))
    filters.sort(key=lambda d: (d["prio"], d["handle"]))
    return {"dev": dev, "netns": netns, "qdiscs": qdiscs, "classes": classes,
            "filters": filters}


def strip_counters(state: dict) -> dict:
    """``state`` without live counters (for comparing two :func:`show` results)."""
    out = dict(state)
    out["qdiscs"] = [{k: v for k, v in q.items() if k not in ("stats", "direct_packets_stat")}
                     for q in state["qdiscs"]]
    out["classes"] = [{k: v for k, v in c.items() if k != "stats"} for c in state["classes"]]
    return out


def class_counters(state: dict) -> dict[str, dict]:
    """{classid: stats} from a :func:`show` result."""
    return {c["classid"]: c["stats"] for c in state["classes"]}


def render_table(state: dict) -> str:
    """A readable table of a :func:`show` result: root qdisc, then one row per class."""
    where = f" (netns {state['netns']})" if state.get("netns") else ""
    lines = [f"dev {state['dev']}{where}"]
    for q in state["qdiscs"]:
        extra = ""
        if "default" in q:
            extra = f" default {q['default']} direct_packets_stat {q['direct_packets_stat']}"
        elif "limit" in q:
            extra = f" limit {q['limit']}"
        elif "bands" in q:
            extra = f" bands {q['bands']}"
        lines.append(f"  qdisc {q['kind']} {q['handle']} parent {q['parent']}{extra}"
                     f"  sent {q['stats']['bytes']} B {q['stats']['packets']} pkt"
                     f" dropped {q['stats']['drops']}")
    if state["classes"]:
        hdr = (f"  {'class':<7} {'prio':>4} {'rate':>9} {'ceil':>9} {'dscp':<12} "
               f"{'bytes':>12} {'packets':>9} {'drops':>7} {'overlim':>8} {'backlog':>8}")
        lines.append(hdr)
        for c in state["classes"]:
            s = c["stats"]
            lines.append(
                f"  {c['classid']:<7} {c.get('prio', '-')!s:>4} "
                f"{format_rate(c['rate_bit']) if c.get('rate_bit') else '-':>9} "
                f"{format_rate(c['ceil_bit']) if c.get('ceil_bit') else '-':>9} "
                f"{','.join(map(str, c['dscp'])) or '-':<12} {s['bytes']:>12} "
                f"{s['packets']:>9} {s['drops']:>7} {s['overlimits']:>8} {s['backlog']:>8}")
    return "\n".join(lines)


__all__ = ["ForeignQdiscError", "MissingQdiscError", "ProfileError", "TcError", "apply", "check_kernel",
           "class_counters", "clear", "dry_run", "render_table", "show", "strip_counters"]
