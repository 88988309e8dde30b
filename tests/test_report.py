"""The report's own checks (dgt.report): a channel that delivered more blocks than the
ranks sent is a warning (breaker round, stop 33: a forged datagram with the session id
and no --secret was delivered, and only the counters showed it, as 176,226 of 176,225)."""
import pytest

from dgt.report import strangers_accepted


def _ch(sent, delivered, duplicate=0):
    return {"blocks_sent": sent, "blocks_delivered": delivered,
            "blocks_duplicate": duplicate, "bytes_sent": 0}


def test_more_delivered_than_sent_is_a_warning_naming_the_channel_and_the_cure():
    w = strangers_accepted({"tcp": _ch(10, 10), "udp1": _ch(176225, 176226, 26),
                            "udp2": _ch(5, 3)})
    assert w == ["channel udp1 delivered 1 more block(s) than the ranks sent: datagrams "
                 "that no rank sent were accepted (forged with this job's session id); "
                 "run every rank with --secret"]


def test_loss_and_duplicates_alone_are_no_warning():
    assert strangers_accepted({"udp1": _ch(100, 90, 5), "tcp": _ch(7, 7)}) == []


@pytest.mark.slow
def test_kernel_drops_from_a_full_receive_buffer_are_not_blamed_on_strangers(tmp_path):
    """An outside tester's run: a receive buffer too small for a burst makes the kernel
    drop real peer datagrams (udp1..udp3 lose blocks), which SK_MEMINFO_DROPS counts
    with the filter's refusals; the summary said they came from no peer."""
    from conftest import run_train
    p, r = run_train(tmp_path, "--workers", 2, "--hidden", 1024, "--iterations", 10,
                     "--udp-buffer-bytes", 4096)
    assert r["udp_kernel_drops"] > 0, r
    assert sum(ch["blocks_lost"] for name, ch in r["channels"].items() if name != "tcp")
    line = next(ln for ln in p.stdout.splitlines() if "datagrams dropped" in ln)
    assert (f"at least {r['udp_kernel_drops']} datagrams dropped in the kernel (the "
            f"channel filter's refusals or a full receive buffer: --udp-buffer-bytes)"
            in line), line
    assert "no peer" not in p.stdout, line


def test_non_finite_pushes_are_a_warning_naming_the_ranks():
    # an outside tester's DDP job: one NaN step of rank 1 went unmentioned
    from dgt.report import non_finite_pushed
    sidecars = [{"rank": 0, "blocks_non_finite": 0}, {"rank": 1, "blocks_non_finite": 2},
                {"rank": 2, "blocks_non_finite": 0}, {"rank": 3, "blocks_non_finite": 5}]
    w = non_finite_pushed({"sidecars": sidecars})
    assert w.startswith("rank(s) [1, 3] pushed 7 gradient block(s) holding NaN or inf"), w
    assert "lower --lr" in w and "\n" not in w
    one = non_finite_pushed({"sidecars": sidecars[:2]})
    assert one.startswith("rank(s) [1] pushed 2 gradient block(s)"), one
    assert non_finite_pushed({"sidecars": [{"rank": 0}, {"rank": 1,
                                                         "blocks_non_finite": 0}]}) is None
