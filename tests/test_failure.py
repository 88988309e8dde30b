"""Typed failure records (dgt.failure): the launcher names the failed rank from them,
whatever a message says."""
import json
import os

import pytest

from dgt import failure
from dgt.config import JobConfig, TransmissionConfig
from dgt.errors import PeerFailure
from dgt.failure import FailureReason, FailureRecord
from dgt.launch import Job


def _job(run_dir) -> Job:
    return Job(JobConfig(run_dir=str(run_dir)), TransmissionConfig())


@pytest.mark.parametrize("message", [
    "no PULL for iteration 7 from shard(s) [2] within 5 s; shard 0 never got END(7) "
    "from rank(s) [2] (dead or frozen)",
    "rank two is silent (any wording at all)",   # reworded: blame must not change
    ""])
def test_blame_comes_from_the_record_not_the_message(tmp_path, message):
    failure.write(str(tmp_path), FailureRecord("sidecar", 0, FailureReason.PEER_SILENT,
                                               message, [2]))
    # the log says something else entirely: it must not matter
    (tmp_path / "sidecar-0.log").write_text("ERROR from rank(s) [3] (dead or frozen)\n")
    text, blamed = _job(tmp_path)._describe_failure("sidecar", 0, 3)
    assert blamed == 2
    assert text.startswith("rank(s) [2] stopped answering (dead or frozen); sidecar of "
                           "rank 0 exited with status 3"), text
    assert "[3]" not in text


def test_a_relayed_failure_names_the_rank_the_first_record_blames(tmp_path):
    """Sidecar 1 stopped because sidecar 0 told it (ERROR frame); trainer 1 because its
    sidecar told it: the headline still names what sidecar 0 saw first."""
    run = str(tmp_path)
    failure.write(run, FailureRecord("sidecar", 0, FailureReason.PEER_SILENT, "x", [3]))
    failure.write(run, FailureRecord("sidecar", 1, FailureReason.PEER_REPORTED,
                                     "rank 0 reports: x", [3]))
    failure.write(run, FailureRecord("trainer", 1, FailureReason.PEER_REPORTED, "y", [3]))
    text, blamed = _job(tmp_path)._describe_failure("trainer", 1, 3)
    assert blamed == 3 and text.startswith("rank(s) [3] stopped answering"), text
    assert text.endswith("trainer of rank 1 exited with status 3: y"), text


def test_the_blamed_rank_is_named_when_its_own_sidecar_exits_first(tmp_path):
    """Trainer 2 frozen: sidecar 1 saw no END from rank 2 and blamed it; sidecar 2 (whose
    trainer is frozen) exits first, on the ERROR that names it. The headline names rank
    2 as the rank that stopped answering (the blame matrix, tools/blame.py, found it
    reporting only 'sidecar of rank 2 exited')."""
    run = str(tmp_path)
    failure.write(run, FailureRecord("sidecar", 1, FailureReason.PEER_SILENT,
                                     "no PULL for iteration 11", [2]))
    failure.write(run, FailureRecord("sidecar", 2, FailureReason.PEER_REPORTED,
                                     "rank 1 reports: no PULL for iteration 11", [2]))
    text, blamed = _job(tmp_path)._describe_failure("sidecar", 2, 3)
    assert blamed == 2
    assert text.startswith("rank(s) [2] stopped answering (dead or frozen); sidecar of "
                           "rank 2 exited with status 3"), text


def test_a_failure_with_nobody_to_blame_names_only_the_process(tmp_path):
    """A stranger's frame is rejected, never blamed: a record with no blamed rank (and
    one that blames only the exiting process) adds no 'rank(s) [...]' to the headline."""
    failure.write(str(tmp_path), FailureRecord("sidecar", 2, FailureReason.OTHER,
                                               "rank 2: internal error", [2]))
    text, blamed = _job(tmp_path)._describe_failure("sidecar", 2, 3)
    assert (text, blamed) == ("sidecar of rank 2 exited with status 3: rank 2: internal "
                              "error", 2)
    assert FailureRecord("sidecar", 1, FailureReason.PEER_REPORTED, "m", []
                         ).headline_blame(1) == ""


def test_the_first_record_of_a_process_wins_and_bad_files_are_ignored(tmp_path):
    run = str(tmp_path)
    failure.write(run, FailureRecord("sidecar", 0, FailureReason.PEER_GONE, "a", [1]))
    failure.write(run, FailureRecord("sidecar", 0, FailureReason.STOPPED, "b", []))
    (tmp_path / "failure-trainer-9.json").write_text("{not json")
    (tmp_path / "failure-trainer-8.json").write_text(json.dumps({"kind": "trainer"}))
    recs = failure.read_all(run)
    assert [(r.kind, r.rank, r.reason, r.message) for r in recs] == \
        [("sidecar", 0, FailureReason.PEER_GONE, "a")]
    assert not [f for f in os.listdir(run) if f.endswith(".tmp")]


def test_peer_failure_carries_reason_and_ranks():
    e = PeerFailure("m", 2, FailureReason.PEER_SILENT, [2, 3])
    assert (e.rank, e.reason, e.ranks) == (2, FailureReason.PEER_SILENT, [2, 3])
    assert PeerFailure("m", 1).ranks == [1] and PeerFailure("m").ranks == []
    assert PeerFailure("m").reason is FailureReason.OTHER


def test_an_unwritable_run_dir_never_raises(tmp_path):
    failure.write(str(tmp_path / "gone"), FailureRecord("sidecar", 0,
                                                        FailureReason.OTHER, "m", []))


def test_a_rank_whose_own_record_blames_nobody_is_not_blamed_when_it_exits_first(tmp_path):
    """Sidecar 1 ends because the store held a stranger's values for it (its record
    blames no rank) and exits first; the sidecars the launcher then stops must not
    blame rank 1 (tests/test_store_attack.py saw rank 0's record blame it, under load)."""
    failure.write(str(tmp_path), FailureRecord(
        "sidecar", 1, FailureReason.OTHER, "the store held rejected values for rank(s) "
        "[1] (store_rejected), written by another process", []))
    text, blamed = _job(tmp_path)._describe_failure("sidecar", 1, 3)
    assert blamed is None
    assert text.startswith("sidecar of rank 1 exited with status 3: the store held"), text
