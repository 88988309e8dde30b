"""Netlink messages for every profile, built and decoded without sending.

prio-dscp and htb-netem need qdiscs this kernel lacks; their requests are still checked
byte for byte here.
"""
import socket
import struct

import pytest
from pyroute2.netlink.rtnl import (RTM_DELQDISC, RTM_NEWQDISC, RTM_NEWTCLASS,
                                   RTM_NEWTFILTER, TC_H_ROOT)

from dgt.tc_profiles.plan import (ROOT_HANDLE, build_delete_root, build_message,
                                  compile_profile, decode, encode)
from dgt.tc_profiles.schema import list_profiles, load_profile


def built(name, rate=None):
    p = load_profile(name)
    out = []
    for op in compile_profile(p, rate):
        t, f, m = build_message(op, 7)
        data = encode(m, t, f)
        out.append((op, t, data, decode(data)))
    return p, out


def u32_key(data):
    """(off, mask, val) of the single key in an encoded u32 filter message."""
    # find struct tc_u32_sel by its NLA type TCA_U32_SEL (5) inside TCA_OPTIONS
    i = data.find(struct.pack("=H", 5), 20) - 2
    ln = struct.unpack_from("=H", data, i)[0]
    assert ln == 4 + 16 + 16
    mask, val = struct.unpack_from(">II", data, i + 20)
    off, offmask = struct.unpack_from("=ii", data, i + 28)
    return off, mask, val


def test_prio_dscp_messages():
    p, msgs = built("prio-dscp")
    op, t, data, m = msgs[0]
    assert t == RTM_NEWQDISC and m["parent"] == TC_H_ROOT and m["handle"] == ROOT_HANDLE
    assert m["index"] == 7
    assert m.get_attr("TCA_KIND") == "prio"
    opts = m.get_attr("TCA_OPTIONS")
    assert opts["bands"] == 9
    assert list(opts["priomap"]) == [6] * 16            # unmatched -> best effort band
    leaves = [x for x in msgs if x[1] == RTM_NEWQDISC][1:]
    assert [x[3]["parent"] for x in leaves] == [ROOT_HANDLE | (i + 1) for i in range(9)]
    assert all(x[3].get_attr("TCA_KIND") == "bfifo" for x in leaves)
    assert leaves[0][3].get_attr("TCA_OPTIONS")["limit"] == 2097152   # EF: TCP_QUEUE_BYTES
    assert not [x for x in msgs if x[1] == RTM_NEWTCLASS]   # prio bands are implicit
    filters = [x for x in msgs if x[1] == RTM_NEWTFILTER]
    ef4 = [x for x in filters if x[0].params["dscp"] == 46
           and x[0].params["protocol"] == 0x0800][0]
    fm = ef4[3]
    assert fm.get_attr("TCA_KIND") == "u32"
    assert socket.ntohs(fm["info"] & 0xFFFF) == 0x0800 and fm["info"] >> 16 == 1
    assert fm.get_attr("TCA_OPTIONS").get_attr("TCA_U32_CLASSID") == ROOT_HANDLE | 1
    assert u32_key(ef4[2]) == (1, 0xFC000000, 0xB8000000)   # '0xb8/0xfc+1'
    ef6 = [x for x in filters if x[0].params["dscp"] == 46
           and x[0].params["protocol"] == 0x86DD][0]
    assert u32_key(ef6[2]) == (0, 0x0FC00000, 46 << 22)


def test_htb_netem_messages():
    p, msgs = built("htb-netem")
    netem = [x for x in msgs if x[1] == RTM_NEWQDISC and x[3].get_attr("TCA_KIND") == "netem"]
    assert len(netem) == len(p.bands)
    opts = netem[0][3].get_attr("TCA_OPTIONS")
    assert opts["loss"] == int((2**32 - 1) * 1.0 / 100)       # 1 %
    assert opts["delay"] > 0 and opts["jitter"] == 0
    # limit: the band's bytes in packets plus the packets the 5 ms delay holds at 1 Gbit/s
    assert opts["limit"] == 2097152 // 1514 + -(-10**9 // 8 * 5 // 1000 // 1514)
    root = msgs[0][3]
    assert root.get_attr("TCA_KIND") == "htb"


@pytest.mark.parametrize("name", list_profiles())
def test_every_profile_builds(name):
    p, msgs = built(name)
    kinds = {x[3].get_attr("TCA_KIND") for x in msgs}
    assert p.root_kind in kinds and "u32" in kinds
    for op, t, data, m in msgs:
        assert len(data) == m["header"]["length"]


def test_htb_classes_and_default():
    p, msgs = built("htb-prio", rate=950_000_000)
    root = msgs[0][3].get_attr("TCA_OPTIONS").get_attr("TCA_HTB_INIT")
    assert root["defcls"] == 0x16                       # band 'be' (index 6) is the default
    classes = [x[3] for x in msgs if x[1] == RTM_NEWTCLASS]
    parms = [c.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS") for c in classes]
    assert parms[0]["rate"] == parms[0]["ceil"] == 950_000_000 // 8
    assert [q["prio"] for q in parms[1:]] == [b.priority for b in p.bands]
    assert all(q["ceil"] == 950_000_000 // 8 for q in parms[1:])
    assert all(q["rate"] < q["ceil"] // 50 for q in parms[1:])   # tiny guaranteed rates


def test_delete_root_message():
    t, f, m = build_delete_root(3)
    d = decode(encode(m, t, f))
    assert t == RTM_DELQDISC and d["parent"] == TC_H_ROOT and d["index"] == 3
