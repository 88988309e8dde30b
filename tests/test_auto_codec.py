"""--band-codec and --pull-codec auto: int8 for the ranking modes across a link, fp32 for
the baselines and over loopback, resolved per node at registration."""
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
        assert (got.band_codec, got.pull_codec) == (want, want)
        assert cfg.band_codec == "auto"   # a copy: the given config is left alone


def test_a_codec_given_is_kept_on_loopback_and_across_a_link():
    cfg = TransmissionConfig(band_codec="2:bf16,3:int4", pull_codec="fp16")
    for loopback in (False, True):
        got = cfg.resolve_codecs(loopback)
        assert (got.band_codec, got.pull_codec) == ("2:bf16,3:int4", "fp16")


def test_loopback_peers_are_told_apart():
    assert peers_on_loopback(["127.0.0.1", "127.0.0.2"])
    assert peers_on_loopback([])   # no peer: no link either
    assert peers_on_loopback(["::1"])


@pytest.mark.slow
def test_a_loopback_job_runs_and_reports_fp32(train):
    _, r = train("--iterations", 4, "--hidden", 64)
    assert (r["band_codec"], r["pull_codec"]) == ("fp32", "fp32")
    assert r["pull_blocks_coded"] == 0
    _, r = train("--iterations", 4, "--hidden", 64, "--band-codec", "int8",
                 "--pull-codec", "int8")
    assert (r["band_codec"], r["pull_codec"]) == ("int8", "int8")
    assert r["pull_blocks_coded"] > 0
