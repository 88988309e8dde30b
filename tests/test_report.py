"""The report's own checks (dgt.report): a channel that delivered more blocks than the
ranks sent is a warning (breaker round, stop 33: a forged datagram with the session id
and no --secret was delivered, and only the counters showed it, as 176,226 of 176,225)."""
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
