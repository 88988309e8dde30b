"""Profile schema: shipped profiles load; each broken rule gives a clear ProfileError."""
import copy

import pytest
import yaml

from dgt.tc_profiles import applier
from dgt.tc_profiles.schema import (RELIABLE_DSCP, TCP_QUEUE_BYTES, ProfileError,
                                    format_rate, list_profiles, load_profile, loads,
                                    parse_rate, validate)

BASE = {
    "schema": 1, "name": "t", "root": {"kind": "htb", "rate": "1gbit"},
    "bands": [
        {"name": "ef", "priority": 0, "dscp": [46], "rate_pct": 1, "limit_bytes": 65536},
        {"name": "be", "priority": 6, "dscp": [0], "rate_pct": 1, "limit_packets": 100},
    ],
    "default_band": "be",
}


def mutate(fn):
    d = copy.deepcopy(BASE)
    fn(d)
    return d


def test_shipped_profiles_load():
    names = list_profiles()
    assert {"prio-dscp", "htb-prio", "nic-1g", "htb-netem"} <= set(names)
    for n in names:
        p = load_profile(n)
        assert p.name == n
        assert p.band_for_dscp(0).name == p.default_band
    assert load_profile("nic-1g").rate_bit == 950_000_000
    assert load_profile("prio-dscp").fallback == "htb-prio"
    assert "netem" in load_profile("htb-netem").qdisc_kinds()


def test_base_is_valid():
    p = validate(BASE)
    assert [b.leaf_kind for b in p.bands] == ["bfifo", "pfifo"]


@pytest.mark.parametrize("fn, where", [
    (lambda d: d.update(color="red"), "unknown key(s) ['color']"),
    (lambda d: d.pop("default_band"), "missing required key(s) ['default_band']"),
    (lambda d: d.update(schema=2), "schema: must be 1"),
    (lambda d: d["root"].update(kind="cake"), "root.kind: 'cake' is not one of"),
    (lambda d: d["root"].pop("rate"), "kind 'htb' needs rate"),
    (lambda d: d["root"].update(rate="fast"), "root.rate"),
    (lambda d: d["bands"][0].update(dscp=[70]), "bands[0].dscp: 70 is outside 0..63"),
    (lambda d: d["bands"][1].update(dscp=[46]), "DSCP 46 is already mapped to band 'ef'"),
    (lambda d: d["bands"][1].update(priority=8), "bands[1].priority: 8 is outside 0..7"),
    (lambda d: d["bands"][0].update(priority=7), "listed highest priority first"),
    (lambda d: d["bands"][0].update(limit_packets=5), "exactly one of limit_bytes"),
    (lambda d: d["bands"][0].update(ceil_pct=0.5), "below rate_pct"),
    (lambda d: d["bands"][0].update(rate_pct=0), "rate_pct"),
    (lambda d: d["bands"][1].update(name="ef"), "used twice"),
    (lambda d: d.update(default_band="nope"), "default_band: 'nope' is not a band name"),
    (lambda d: d.update(netem={"loss_pct": 101}), "netem.loss_pct"),
    (lambda d: d.update(netem={"loss_pct": float("nan")}), "netem.loss_pct: nan"),
    (lambda d: d["bands"][0].update(rate_pct=float("nan")), "bands[0].rate_pct: nan"),
    (lambda d: d.update(netem={"bands": ["zz"]}), "netem.bands"),
    (lambda d: (d["root"].update(kind="prio"), d["root"].pop("rate")), "does not shape"),
])
def test_schema_errors_name_the_rule(fn, where):
    with pytest.raises(ProfileError) as e:
        validate(mutate(fn))
    assert where in str(e.value)
    assert str(e.value).startswith("profile 't': ") or "schema" in str(e.value)
    assert "\n" not in str(e.value)


def test_prio_needs_strictly_increasing_priorities():
    d = mutate(lambda d: None)
    d["root"] = {"kind": "prio"}
    for b in d["bands"]:
        b.pop("rate_pct")
    d["bands"][1]["priority"] = 0
    with pytest.raises(ProfileError, match="strictly increasing"):
        validate(d)


def test_yaml_errors_and_unknown_profile():
    with pytest.raises(ProfileError, match="not valid YAML"):
        loads("a: [1, 2")
    with pytest.raises(ProfileError, match="unknown profile 'nope'; shipped profiles"):
        load_profile("nope")
    assert loads(yaml.safe_dump(BASE)).name == "t"


def test_rates():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("950mbit") == 950 * 10**6
    assert parse_rate("1mbps") == 8 * 10**6
    assert parse_rate(12345) == 12345
    assert format_rate(950 * 10**6) == "950mbit"
    for bad in ("", "fast", "10 parsecs", "0mbit", True):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_dry_run_renders_tc_lines_without_root():
    lines = applier.dry_run("htb-prio", "eth0", netns="ns1", rate="950mbit")
    assert lines[0].startswith("tc -n ns1 qdisc del dev eth0 root")
    assert "tc -n ns1 qdisc add dev eth0 root handle d6: htb default 16 r2q 10" in lines
    assert any("classid d6:1 htb rate 950mbit ceil 950mbit" in ln for ln in lines)
    assert any("match ip dsfield 0xb8 0xfc flowid d6:10" in ln for ln in lines)
    prio = applier.dry_run("prio-dscp", "eth0")
    assert "tc qdisc add dev eth0 root handle d6: prio bands 9 priomap " + " ".join(["6"] * 16) \
        in prio
    with pytest.raises(applier.TcError, match="does not shape"):
        applier.dry_run("prio-dscp", "eth0", rate="1gbit")


@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_gives_the_tcp_bands_a_long_enough_queue(name):
    # a short queue on a band that carries TCP stalls a dropped-into connection 200 ms
    # (tc_profiles.schema.TCP_QUEUE_BYTES): dgt's reliable channel, and the default band
    # (a tenant, gloo: a baseline must not lose to our queue)
    p = load_profile(name)
    assert p.band_for_dscp(RELIABLE_DSCP).limit_bytes >= TCP_QUEUE_BYTES
    assert p.band(p.default_band).limit_bytes >= TCP_QUEUE_BYTES
    assert p.tcp_queue_warnings() == []


def test_a_short_tcp_queue_is_named_in_one_line():
    short = validate(BASE)   # ef: 65,536 bytes; be (the default band) likewise short
    ws = short.tcp_queue_warnings()
    assert len(ws) == 2 and all("\n" not in w for w in ws)
    assert "'ef'" in ws[0] and "65536" in ws[0] and "reliable" in ws[0]
    assert f"'{short.default_band}'" in ws[1] and "default band" in ws[1]
    pkts = validate(mutate(lambda d: d["bands"][0].update(limit_bytes=None,
                                                           limit_packets=100)))
    assert "151400" in pkts.tcp_queue_warnings()[0]
    long = validate(mutate(lambda d: [b.update(limit_bytes=TCP_QUEUE_BYTES, limit_packets=None)
                                      for b in d["bands"]]))
    assert long.tcp_queue_warnings() == []
    # DSCP 46 unmapped: it lands in the default band, named once
    unmapped = validate(mutate(lambda d: d["bands"][0].update(dscp=[34])))
    ws = unmapped.tcp_queue_warnings()
    assert len(ws) == 1 and f"'{unmapped.default_band}'" in ws[0]
