"""The shipped profiles agree with transport/channels.py on every channel's DSCP."""
import pytest

from dgt.tc_profiles.schema import list_profiles, load_profile
from dgt.transport import channels


@pytest.mark.parametrize("name", list_profiles())
@pytest.mark.parametrize("c", range(1, channels.MAX_UDP_CHANNELS + 1))
def test_every_channel_dscp_has_its_own_band_in_channel_order(name, c):
    p = load_profile(name)
    order = [b.name for b in p.bands]
    dscps = channels.channel_dscp(c)
    bands = []
    for d in dscps:
        mapped = [b for b in p.bands if d in b.dscp]
        assert len(mapped) == 1, f"{name}: DSCP {d} (C={c}) maps to no band"
        bands.append(mapped[0])
    idx = [order.index(b.name) for b in bands]
    # channel order (reliable first, then udp1..udpC) is band order, highest first
    assert idx == sorted(idx) and len(set(idx)) == len(idx), (name, c, idx)
    prios = [b.priority for b in bands]
    assert prios == sorted(prios), (name, c, prios)
    # the reliable channel (EF) is strictly above every UDP channel
    assert all(prios[0] < q for q in prios[1:])


@pytest.mark.parametrize("name", list_profiles())
def test_best_effort_is_default_and_scavengers_below_it(name):
    p = load_profile(name)
    be = p.band(p.default_band)
    assert 0 in be.dscp
    order = [b.name for b in p.bands]
    for d in (channels.DSCP_CS1, channels.DSCP_LE):
        b = p.band_for_dscp(d)
        assert order.index(b.name) > order.index(be.name)
        assert b.priority > be.priority
    for d in (channels.DSCP_EF, channels.DSCP_AF41, channels.DSCP_AF31, channels.DSCP_AF21,
              channels.DSCP_CS2, channels.DSCP_AF11):
        assert p.band_for_dscp(d).priority < be.priority


def test_default_channels_sit_above_best_effort_and_only_six_and_seven_add_scavengers():
    """Every channel of C = 1..5 (C = 3 is the default: AF41, AF21, AF11) is above best
    effort: in BSP a band below it would make a bulk tenant's load part of every
    iteration. C = 6 and 7 add CS1 and LE, below best effort, as their lowest channels."""
    p = load_profile("htb-prio")
    be = p.band(p.default_band).priority
    assert channels.channel_dscp(3) == (channels.DSCP_EF, channels.DSCP_AF41,
                                        channels.DSCP_AF21, channels.DSCP_AF11)
    for c in range(1, channels.MAX_UDP_CHANNELS + 1):
        below = [d for d in channels.channel_dscp(c) if p.band_for_dscp(d).priority > be]
        assert below == {6: [channels.DSCP_CS1],
                         7: [channels.DSCP_CS1, channels.DSCP_LE]}.get(c, []), (c, below)
