"""--band-codec, --pull-codec and --reliable-codec auto: int8 for the ranking modes across
a link, fp32 for the baselines and over loopback, resolved per node at registration."""
import json

import pytest

from dgt.config import TransmissionConfig
from dgt.link_rate import peers_on_loopback


@pytest.mark.parametrize("mode, link, loop", [("dgt", "int8", "fp32"),
                                              ("random", "int8", "fp32"),
                                              ("tcp", "fp32", "fp32"),
                                              ("topk", "fp32", "fp32")])
def test_auto_means_int8_across_a_link_for_the_ranking_modes_only(mode, link, loop):
    cfg = TransmissionConfig(mode=mode)
    for loopback, want in ((False, link), (True, loop)):
        got = cfg.resolve_codecs(loopback)
        assert (got.band_codec, got.pull_codec, got.reliable_codec) == (want,) * 3
        assert got.channel_codings()[0] == (3 if want == "int8" else 0)   # wire.Coding
        assert cfg.band_codec == "auto"   # a copy: the given config is left alone
        assert cfg.reliable_codec == "auto"


def test_a_codec_given_is_kept_on_loopback_and_across_a_link():
    cfg = TransmissionConfig(band_codec="2:bf16,3:int4", pull_codec="fp16",
                             reliable_codec="bf16")
    for loopback in (False, True):
        got = cfg.resolve_codecs(loopback)
        assert (got.band_codec, got.pull_codec, got.reliable_codec) == \
            ("2:bf16,3:int4", "fp16", "bf16")
    assert not cfg.auto_codecs()


def test_reliable_auto_alone_still_asks_where_the_peers_are():
    """Bands and PULLs given, --reliable-codec left auto: the node must still look up
    whether its peers are on loopback, or auto would code the reliable channel in int8
    over loopback (channel_codings resolves an unresolved auto by --mode alone)."""
    from dgt.registration import route_facts
    cfg = TransmissionConfig(pace_mbit=100.0, band_codec="fp32", pull_codec="fp32")
    assert cfg.auto_codecs()
    peers = {r: {"host": "127.0.0.1"} for r in range(3)}
    facts = route_facts(cfg, peers, 0)
    assert facts.loopback is True
    assert cfg.resolve_codecs(facts.loopback).channel_codings()[0] == 0


def test_loopback_peers_are_told_apart():
    assert peers_on_loopback(["127.0.0.1", "127.0.0.2"])
    assert peers_on_loopback([])   # no peer: no link either
    assert peers_on_loopback(["::1"])


@pytest.mark.slow
def test_a_loopback_job_runs_and_reports_fp32(train):
    _, r = train("--iterations", 4, "--hidden", 64)
    assert (r["band_codec"], r["pull_codec"], r["reliable_codec"]) == ("fp32",) * 3
    assert r["pull_blocks_coded"] == 0
    _, r = train("--iterations", 4, "--hidden", 64, "--band-codec", "int8",
                 "--pull-codec", "int8")
    assert (r["band_codec"], r["pull_codec"]) == ("int8", "int8")
    assert r["pull_blocks_coded"] > 0


def test_route_facts_look_up_only_what_an_auto_flag_needs():
    """registration.route_facts: what the sidecar looks up right after the rendezvous,
    before its trainer registers (pyroute2's cost off the register path)."""
    from dgt.registration import RouteFacts, route_facts
    peers = {r: {"host": "127.0.0.1"} for r in range(3)}
    auto = route_facts(TransmissionConfig(pace_mbit=-1.0), peers, 0)
    assert auto.loopback is True
    assert auto.pace is not None and auto.pace[0] == 0.0 and "loopback" in auto.pace[1]
    given = route_facts(TransmissionConfig(pace_mbit=100.0, band_codec="fp32",
                                           pull_codec="fp32", reliable_codec="fp32"),
                        peers, 0)
    assert given == RouteFacts(None, None)


def test_agree_resolves_the_auto_flags_from_the_facts_it_is_given():
    """agree() takes the facts looked up earlier, not a second lookup: loopback peers
    with facts that say 'across a link' resolve auto codecs to int8."""
    import asyncio
    import socket
    from dgt.registration import RouteFacts, agree
    from dgt.rendezvous import Rendezvous
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdv = Rendezvous("127.0.0.1", port, 1, 0, 30.0)   # a store of one rank: its own
    peers = {0: {"host": "127.0.0.1"}}
    for facts, want in ((RouteFacts(None, False), "int8"), (RouteFacts(None, True), "fp32"),
                            (None, "fp32")):   # None: looked up here (loopback)
        cfg, lay, source = asyncio.run(agree(rdv, TransmissionConfig(pace_mbit=0.0), peers,
                                             0, 1, 1000, "", 0, facts))
        assert (cfg.band_codec, cfg.pull_codec, cfg.reliable_codec) == (want,) * 3, facts
        assert lay.n_params == 1000 and source is None
