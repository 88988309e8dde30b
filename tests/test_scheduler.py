
import os

import pytest
import torch

from dgt.scheduler.assign import (DROPPED, AdaptiveK, assign_channels, rank_blocks,
                                  reliable_count)
from dgt.scheduler.deadline import DeadlinePolicy
from dgt.scheduler.pacing import TokenBucket


def test_top_k_reliable_rest_in_equal_bands():
    scores = torch.arange(100, dtype=torch.float32)   # block 99 is the best
    order = rank_blocks(scores)
    assert order[:3].tolist() == [99, 98, 97]
    ch = assign_channels(order, reliable_count(100, 0.5), 3)
    assert (ch[50:] == 0).all()                       # the top half is reliable
    counts = [(ch == c).sum().item() for c in range(4)]
    assert counts == [50, 17, 17, 16]
    assert (ch[33:50] == 1).all() and (ch[:16] == 3).all()  # better ranks, better band


def test_topk_mode_drops_the_unreliable_share():
    ch = assign_channels(rank_blocks(torch.rand(40)), 10, 3, drop_unreliable=True)
    assert (ch == 0).sum() == 10 and (ch == DROPPED).sum() == 30


def test_exploration_promotes_random_low_blocks():
    scores = torch.arange(1000, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    order = rank_blocks(scores, epsilon=0.1, n_reliable=500, generator=g)
    assert sorted(order.tolist()) == list(range(1000))  # still a permutation
    promoted = (order[:500] < 500).sum().item()
    assert promoted == 50


def test_ties_rank_deterministically():
    assert rank_blocks(torch.zeros(5)).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("k,n,want", [(0.5, 7, 4), (0, 7, 0), (1, 7, 7), (0.2, 10, 2)])
def test_reliable_count(k, n, want):
    assert reliable_count(n, k) == want


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        reliable_count(10, 1.5)
    with pytest.raises(ValueError):
        assign_channels(torch.arange(4), 2, 0)
    with pytest.raises(ValueError):
        AdaptiveK(0.1, 0.5)


def test_adaptive_k_follows_loss_with_floor():
    a = AdaptiveK(0.5, 0.2)
    assert a.update(2.0) == 0.5
    assert a.update(1.0) == pytest.approx(0.25)
    assert a.update(0.1) == 0.2
    assert a.update(float("nan")) == 0.2


def test_token_bucket_long_run_rate():
    b = TokenBucket(rate_mbit=8, burst_bytes=1000, now=0.0)  # 1e6 B/s
    t = 0.0
    for _ in range(1000):
        t += b.delay(1000, t)
    assert t == pytest.approx(0.999, rel=1e-3)   # 1 MB at 1 MB/s, first burst free
    assert TokenBucket(0).delay(10 ** 9, 0) == 0


def test_deadline_policy():
    assert DeadlinePolicy(min_s=0.05, queue_bytes=1 << 20, rate_mbit=1000).after_end_s() \
        == pytest.approx(max(0.05, 2 * 8 * (1 << 20) / 1e9))
    assert DeadlinePolicy(min_s=0.5).after_end_s() == 0.5


def test_flow_share_gives_every_receiving_port_exactly_its_rate():
    from dgt.scheduler.pacing import WIRE_HEADROOM, TokenBucket, flow_share
    share = flow_share(1000, 3)
    assert 3 * share == pytest.approx(1000e6 / 8 * WIRE_HEADROOM)
    assert flow_share(0, 3) == 0.0 and flow_share(1000, 0) == 0.0
    b = TokenBucket.bytes_per_s(share, burst_bytes=0, now=0.0)
    assert b.delay(int(share), 0.0) == pytest.approx(1.0)   # one second of debt
    assert TokenBucket.bytes_per_s(0.0).delay(10**9, 0.0) == 0.0


def test_pacing_rate_is_set_on_a_real_tcp_socket():
    import socket

    from dgt.transport import sockopts
    with socket.socket() as s:
        assert sockopts.set_pacing_rate(s, 12_345_678)
        assert s.getsockopt(socket.SOL_SOCKET, sockopts.SO_MAX_PACING_RATE) == 12_345_678
        assert sockopts.set_pacing_rate(s, 0)   # 0: uncapped again
        assert s.getsockopt(socket.SOL_SOCKET, sockopts.SO_MAX_PACING_RATE) in (-1, 0xFFFFFFFF)
        # past what the option holds, inf included: the highest cap, never an error
        # (--pace-mbit 1e308 made a sidecar fail: 'cannot convert float infinity')
        for rate in (float("inf"), 1e300, 2.0 ** 64):
            assert sockopts.set_pacing_rate(s, rate)
            assert s.getsockopt(socket.SOL_SOCKET, sockopts.SO_MAX_PACING_RATE) in \
                (-2, 0xFFFFFFFE)


def test_token_bucket_hold_saves_no_tokens_for_time_that_was_not_its_own():
    """The TCP bytes ahead of a node's datagrams use the share until ``until``; the
    bucket must not turn that time into a burst (it overflowed the egress queue)."""
    b = TokenBucket(rate_mbit=8.0, burst_bytes=100_000, now=0.0)   # 1 MB/s
    assert b.delay(0, now=10.0) == 0.0 and b.tokens == 100_000      # idle: full
    b.hold(now=10.0, until=10.05)                                    # TCP's until 10.05
    assert b.delay(1000, now=10.05) == pytest.approx(0.001)          # nothing saved up
    b2 = TokenBucket(rate_mbit=8.0, burst_bytes=100_000, now=0.0)
    b2.hold(now=5.0, until=5.0, tokens=20_000)                       # start: one batch
    assert b2.delay(20_000, now=5.0) == 0.0
    assert b2.delay(1000, now=5.0) == pytest.approx(0.001)
    # a debt from the last push is paid by the idle time before the next one
    b3 = TokenBucket(rate_mbit=8.0, burst_bytes=100_000, now=0.0)
    b3.delay(150_000, now=0.0)                                       # 50 kB in debt
    b3.hold(now=1.0, until=1.0, tokens=20_000)                       # 1 s idle since
    assert b3.delay(20_000, now=1.0) == 0.0


def test_held_pulls_wait_for_their_workers_push_and_not_forever():
    """A PULL to a worker goes once our push to that worker has left (backlog under the
    slack), the others stay; a worker whose backlog never drains gets its PULL after
    twice the drain time + 1 s; the next look is when the smallest backlog drains."""
    from dgt.scheduler.pacing import HeldPulls
    backlog = {1: 0, 2: 500_000, 3: 2_000_000}
    q = HeldPulls(share=1_000_000.0, slack=100_000)
    for w in (1, 2, 3):
        q.hold(w, f"pull-{w}")
    ready, wait = q.release(backlog.__getitem__, now=0.0)
    assert ready == [(1, "pull-1")] and len(q) == 2
    assert wait == pytest.approx(0.5)                 # worker 2's 500 kB at 1 MB/s
    backlog[2] = 50_000                               # drained to under the slack
    ready, wait = q.release(backlog.__getitem__, now=0.5)
    assert ready == [(2, "pull-2")] and wait == pytest.approx(2.0)
    # worker 3 never reads: its PULL goes at 2 * 2 s + 1 s after it was first held
    assert q.release(backlog.__getitem__, now=4.9)[0] == []
    ready, wait = q.release(backlog.__getitem__, now=5.0)
    assert ready == [(3, "pull-3")] and wait is None and len(q) == 0
    with pytest.raises(ValueError):
        HeldPulls(share=0.0, slack=1)


def test_own_queue_gate_waits_for_our_queued_udp_but_not_for_a_starved_band():
    """PULLs wait while our UDP blocks are still in our egress queue; a queue that does
    not drain (a starved band) holds them at most twice its drain time + the grace, once
    per iteration; the next iteration waits again."""
    from dgt.scheduler.pacing import OwnQueueGate
    g = OwnQueueGate(port_rate=100_000_000.0, grace_s=0.002)   # 100 MB/s
    assert g.wait(0, iteration=0, now=0.0) == 0.0
    assert g.wait(200_000, iteration=0, now=1.0) == pytest.approx(0.002)   # 200 kB drain
    # it does not drain: give up at 1.0 + 2 * 2 ms + 2 ms
    assert g.wait(200_000, iteration=0, now=1.005) == pytest.approx(0.001)
    assert g.wait(200_000, iteration=0, now=1.006) == 0.0
    assert g.wait(200_000, iteration=0, now=1.5) == 0.0    # given up for this iteration
    assert g.wait(200_000, iteration=1, now=2.0) > 0.0     # a new iteration waits again
    with pytest.raises(ValueError):
        OwnQueueGate(port_rate=0.0)


_UNSENT_PROBE = """
import socket, time
from dgt.transport import sockopts
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
idle = sockopts.udp_unsent(s)
for _ in range(20):   # 28 kB at 1 Mbit/s: 0.2 s in the qdisc
    s.sendto(b"x" * 1400, ("10.98.0.3", 9))
held = sockopts.udp_unsent(s)
time.sleep(0.6)
print(idle, held, sockopts.udp_unsent(s))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, tc)")
def test_udp_unsent_sees_datagrams_held_in_our_own_qdisc(veth):
    """What OwnQueueGate reads: datagrams the socket handed over that a slow qdisc still
    holds count in SIOCOUTQ; once they left, nothing does."""
    import subprocess
    import sys

    from dgt.tc_profiles._nl import open_ipr
    ns, dev = veth
    with open_ipr(ns) as ipr:
        idx = ipr.link_lookup(ifname=dev)[0]
        ipr.addr("add", index=idx, address="10.98.0.1", prefixlen=24)
        ipr.neigh("add", dst="10.98.0.3", lladdr="02:00:00:00:00:03", ifindex=idx,
                  state="permanent")
        ipr.tc("add", "tbf", index=idx, handle="1:", rate="1mbit", burst=1600,
               latency="2s")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _UNSENT_PROBE],
                         capture_output=True, text=True, timeout=60, check=True)
    idle, held, left = map(int, out.stdout.split())
    assert idle == 0 and held >= 10 * 1400 and left == 0, (idle, held, left)


def _kernel_has_rto_min() -> bool:
    import socket

    from dgt.transport import sockopts
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, sockopts.TCP_RTO_MIN_US, 200_000)
            return True
        except OSError:
            return False


@pytest.mark.skipif(not _kernel_has_rto_min(), reason="kernel < 6.15: no TCP_RTO_MIN_US")
def test_both_ends_of_a_reliable_connection_get_the_lower_rto_floor():
    """The sidecar's FrameProtocol lowers the minimum RTO on the connections it makes
    and on those it accepts (PULLs flow on those): read back from the kernel."""
    import asyncio
    import socket

    from dgt.transport import sockopts
    from dgt.transport.aio import FrameProtocol

    def proto():
        return FrameProtocol(lambda *a: None, lambda *a: None, lambda *a: None, dscp=46,
                             rto_min_ms=10.0)

    async def main():
        loop = asyncio.get_running_loop()
        accepted = []

        def on_accept():
            p = proto()
            accepted.append(p)
            return p

        server = await loop.create_server(on_accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        tr, client = await loop.create_connection(proto, "127.0.0.1", port)
        for _ in range(100):
            if accepted and accepted[0].transport is not None:
                break
            await asyncio.sleep(0.01)
        got = [p.transport.get_extra_info("socket").getsockopt(
            socket.IPPROTO_TCP, sockopts.TCP_RTO_MIN_US) for p in (client, accepted[0])]
        tr.close()
        server.close()
        return got

    for us in asyncio.run(main()):
        assert 10_000 <= us < 20_000   # 10 ms, rounded up to jiffies; default 200,000
    with socket.socket() as s:
        assert sockopts.set_rto_min(s, 0)                 # 0: the kernel's default
        assert s.getsockopt(socket.IPPROTO_TCP, sockopts.TCP_RTO_MIN_US) == 200_000
        assert not sockopts.set_rto_min(s, 1.0)           # below 2 jiffies: refused
