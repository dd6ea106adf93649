"""The finalizer's step ledger (verl_ckpt/commit/ledger.py): pure state, no Ray, no files.

I1: a step commits only once every expected participant reported success, exactly once;
duplicate and late reports change nothing. I5: failures are kept for whoever waits.
"""

from __future__ import annotations

import pytest

from verl_ckpt.commit.ledger import Begun, Recorded, StepLedger, StepStatus
from verl_ckpt.protocol import Failure, Phase, describe_failures
from verl_ckpt.protocol.messages import RankReport

PARTICIPANTS = {"actor": 2, "driver": 1}


def report(step, role, rank, failure=None, save_id="s"):
    return RankReport(step, role, rank, PARTICIPANTS[role], save_id, failure=failure)


def all_succeed(ledger, step):
    outcomes = [ledger.record(report(step, role, rank)) for role, rank in ledger.expected]
    return outcomes


def test_I1_step_is_ready_only_when_every_participant_reported():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    ledger.open(5)
    assert ledger.missing(5) == [("actor", 0), ("actor", 1), ("driver", 0)]
    assert all_succeed(ledger, 5) == [Recorded.COUNTED, Recorded.COUNTED, Recorded.READY]
    assert ledger.status(5) is StepStatus.COLLECTING
    ledger.begin_commit(5)
    assert ledger.status(5) is StepStatus.COMMITTING
    ledger.finish_commit(5)
    assert ledger.status(5) is StepStatus.COMMITTED and ledger.in_flight() == []
    ledger.retire(5)
    # Retired steps are forgotten: the commit record on disk answers from here on.
    assert ledger.status(5) is None and len(ledger) == 0


def test_I1_duplicate_and_late_reports_during_a_commit_change_nothing():
    """Issue "Trust": a duplicate report arriving while the step commits used to start a
    second commit (a success) or fail the committing step (an error)."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    all_succeed(ledger, 7)
    ledger.begin_commit(7)
    late_error = Failure("driver", 0, Phase.WRITE, "late and wrong")
    assert ledger.record(report(7, "driver", 0, failure=late_error)) is Recorded.IGNORED
    assert ledger.record(report(7, "actor", 1, save_id="retry")) is Recorded.IGNORED
    assert ledger.status(7) is StepStatus.COMMITTING and ledger.failures(7) == []
    ledger.finish_commit(7)
    assert ledger.record(report(7, "driver", 0)) is Recorded.IGNORED
    assert ledger.status(7) is StepStatus.COMMITTED


def test_I1_a_duplicate_while_collecting_is_ignored_and_counts_once():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    assert ledger.record(report(1, "actor", 0)) is Recorded.COUNTED
    assert ledger.record(report(1, "actor", 0, save_id="again")) is Recorded.IGNORED
    assert ledger.missing(1) == [("actor", 1), ("driver", 0)]


def test_I5_a_failed_report_fails_the_step_and_is_kept_for_waiters():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    ledger.record(report(3, "actor", 0))
    failure = Failure("actor", 1, Phase.WRITE, "OSError: disk full", errno=28)
    assert ledger.record(report(3, "actor", 1, failure=failure)) is Recorded.FAILED
    assert ledger.status(3) is StepStatus.FAILED
    assert ledger.record(report(3, "driver", 0)) is Recorded.IGNORED
    assert describe_failures(ledger.failures(3)) == "actor rank 1 [write ENOSPC] OSError: disk full"
    assert ledger.in_flight() == []  # a failed step does not hold back the next one


def test_I5_a_failed_commit_is_a_failed_step():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    all_succeed(ledger, 4)
    ledger.begin_commit(4)
    ledger.finish_commit(4, Failure("finalizer", None, Phase.TRACKER, "OSError: no space", 28))
    assert ledger.status(4) is StepStatus.FAILED
    assert "finalizer [tracker ENOSPC]" in describe_failures(ledger.failures(4))


def test_I1_lost_steps_refuse_reports():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1, lost=[9])
    assert ledger.record(report(9, "actor", 0)) is Recorded.REFUSED_LOST
    assert ledger.status(9) is StepStatus.LOST


def test_back_pressure_counts_only_steps_in_flight():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    ledger.open(1)
    assert ledger.has_room_for(1) and not ledger.has_room_for(2)
    all_succeed(ledger, 1)
    ledger.begin_commit(1)
    assert not ledger.has_room_for(2)  # committing is still in flight
    ledger.finish_commit(1)
    # Committed, but retention has not yet deleted the step it replaces: still no room.
    assert not ledger.has_room_for(2)
    ledger.retire(1)
    assert ledger.has_room_for(2)


def test_begin_and_finish_commit_refuse_wrong_states():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=2)
    ledger.record(report(1, "actor", 0))
    with pytest.raises(ValueError, match="not ready"):
        ledger.begin_commit(1)
    with pytest.raises(ValueError, match="not committing"):
        ledger.finish_commit(1)
    with pytest.raises(ValueError, match="unexpected participant"):
        ledger.record(RankReport(1, "critic", 0, 1, "s"))


def test_I5_memory_is_flat_over_many_commits_and_failures():
    """Only steps in flight are held; failures are remembered up to a bound."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1, remembered_outcomes=16)
    for step in range(1, 10_001):
        all_succeed(ledger, step)
        ledger.begin_commit(step)
        if step % 10 == 0:
            ledger.finish_commit(step, Failure("finalizer", None, Phase.COMMIT, "x"))
        else:
            ledger.finish_commit(step)
            ledger.retire(step)
    assert len(ledger) == 16 and ledger.in_flight() == []
    assert ledger.status(10_000) is StepStatus.FAILED and ledger.status(10) is None


def test_a_role_has_begun_once_each_of_its_ranks_joined_while_the_step_collects():
    """What starts the finalizer's `.metadata` forecast (admission): every rank of the role
    joined, counted once each (a retried begin, a begin without a save id), and only while
    the step collects; what it kept is dropped when the step is decided, as reports are."""
    ledger = StepLedger({"actor": 3, "driver": 1}, max_in_flight=2)
    for rank, save_id in ((0, "a"), (0, "a"), (1, None)):
        assert ledger.begin(1, ("actor", rank), save_id, 100.0) is Begun.JOINED
        assert not ledger.role_has_begun(1, "actor")
    ledger.begin(1, ("actor", 2), "c", 100.0)
    assert ledger.role_has_begun(1, "actor") and not ledger.role_has_begun(1, "driver")
    assert not ledger.role_has_begun(2, "actor")
    for rank in range(3):
        ledger.begin(2, ("actor", rank), f"s{rank}", 100.0)
    ledger.record(RankReport(2, "actor", 0, 3, "s0", failure=Failure("actor", 0, Phase.WRITE, "x")))
    assert ledger.status(2) is StepStatus.FAILED and not ledger.role_has_begun(2, "actor")
    assert ledger.entry(2).joined == {}
    for role, rank in ledger.expected:
        ledger.begin(1, (role, rank), f"{role}{rank}", 100.0)
        ledger.record(RankReport(1, role, rank, 3 if role == "actor" else 1, f"{role}{rank}"))
    ledger.begin_commit(1)
    assert not ledger.role_has_begun(1, "actor")  # committing: no longer collects
    ledger.finish_commit(1)
    assert ledger.entry(1).joined == {}


# ---- saves of a participant (save ids), refusals and deadlines ---------------------------


def test_I1_a_report_from_a_save_that_was_replaced_is_never_counted():
    """A restarted rank saves the step again (new save id) before its first save reported:
    the late report of the first save must not be counted for the files the second wrote."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    assert ledger.begin(5, ("actor", 0), "first", 100.0) is Begun.JOINED
    assert ledger.begin(5, ("actor", 0), "second", 100.0) is Begun.JOINED
    assert ledger.record(report(5, "actor", 0, save_id="first")) is Recorded.STALE
    assert ledger.record(report(5, "actor", 0, save_id="second")) is Recorded.COUNTED
    assert ledger.missing(5) == [("actor", 1), ("driver", 0)]


def test_I1_a_second_save_of_a_step_the_participant_reported_is_refused():
    """Its files are the reported ones: a second save would overwrite them under the first
    save's checksums (the step would commit with a record its files fail)."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    ledger.begin(5, ("actor", 0), "first", 100.0)
    ledger.record(report(5, "actor", 0, save_id="first"))
    assert ledger.begin(5, ("actor", 0), "second", 100.0) is Begun.ALREADY_REPORTED
    assert ledger.begin(5, ("actor", 0), "first", 100.0) is Begun.JOINED  # a retried call


def test_a_failed_lost_or_committing_step_is_not_begun_again():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=2, lost=[9])
    ledger.record(report(4, "driver", 0, failure=Failure("driver", 0, Phase.WRITE, "full")))
    assert ledger.begin(4, ("driver", 0), "retry", 100.0) is Begun.FAILED
    assert ledger.begin(9, ("driver", 0), "retry", 100.0) is Begun.LOST
    all_succeed(ledger, 5)
    ledger.begin_commit(5)
    assert ledger.begin(5, ("driver", 0), "another", 100.0) is Begun.DECIDED


def test_I5_a_step_missing_reports_fails_at_its_deadline_naming_who_is_missing():
    """A participant that died, or never saved the step, would otherwise keep it collecting
    for ever, and back-pressure would keep every later step from starting."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    ledger.begin(5, ("actor", 0), "a", 10.0)
    ledger.begin(5, ("actor", 1), "b", 12.0)  # the latest participant's deadline counts
    ledger.record(report(5, "actor", 0, save_id="a"))
    assert ledger.next_expiry() == 12.0
    assert ledger.expire(11.0) == [] and not ledger.has_room_for(6)
    assert [entry.step for entry in ledger.expire(12.5)] == [5]
    assert ledger.status(5) is StepStatus.FAILED
    assert "actor rank 1, driver rank 0" in describe_failures(ledger.failures(5))
    assert ledger.has_room_for(6) and ledger.next_expiry() == float("inf")


def test_I5_a_step_missing_thousands_of_ranks_names_them_in_one_short_line():
    """Issue 44's benchmark hit it: a begin held back by a step missing 4095 reports raised
    one error naming each rank ("actor rank 0, actor rank 1, ...", 60 KB). Runs of ranks are
    ranges now, and a scattered set is cut short with its count."""
    ledger = StepLedger(
        {"actor": 4096, "driver": 1}, max_in_flight=1, state_participants={"rollout": 8}
    )
    ledger.begin(5, ("actor", 0), "a", 10.0)
    ledger.record(RankReport(5, "actor", 7, 4096, "s"))
    ledger.expire(11.0)
    message = describe_failures(ledger.failures(5))
    assert message.endswith(
        "no report by the step's deadline from actor ranks 0-6, actor ranks 8-4095, "
        "driver rank 0, rollout[0-7]"
    )
    scattered = ledger.describe([("actor", r) for r in range(0, 4096, 2)] + [("driver", 0)])
    assert len(scattered) < 1000
    assert scattered.endswith("actor rank 46, ... (2048 of actor in all), driver rank 0")
    assert ledger.describe([("actor", 1), ("actor", 2), ("rollout", 3)]) == (
        "actor rank 1, actor rank 2, rollout[3]"
    )


def test_I3_a_failed_step_is_discardable_once_every_save_that_began_has_reported():
    """A failed step's directory held its files for ever (space a full disk needs back).
    It may go once nobody writes into it: every save that began reported, once."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    for participant, save_id in [(("actor", 0), "a"), (("actor", 1), "b"), (("driver", 0), "d")]:
        ledger.begin(6, participant, save_id, 100.0)
    ledger.record(report(6, "actor", 0, save_id="a"))
    ledger.record(
        report(6, "driver", 0, failure=Failure("driver", 0, Phase.WRITE, "full"), save_id="d")
    )
    assert ledger.status(6) is StepStatus.FAILED
    assert ledger.discardable(now=1.0) == []  # actor rank 1 may still be writing
    # A report from a save that the registered one replaced says nothing about the latter.
    assert ledger.record(report(6, "actor", 1, save_id="old")) is Recorded.IGNORED
    assert ledger.discardable(now=1.0) == []
    assert ledger.record(report(6, "actor", 1, save_id="b")) is Recorded.IGNORED
    assert ledger.discardable(now=1.0) == [6]
    assert ledger.discardable(now=1.0) == []  # handed out once


def test_I3_a_failed_step_whose_writer_never_reports_is_discardable_after_its_deadline():
    ledger = StepLedger(PARTICIPANTS, max_in_flight=1)
    ledger.begin(2, ("actor", 0), "a", 50.0)
    ledger.begin(2, ("actor", 1), "b", 60.0)  # dies without reporting
    ledger.record(
        report(2, "actor", 0, failure=Failure("actor", 0, Phase.WRITE, "EIO"), save_id="a")
    )
    assert ledger.discardable(now=59.0) == []
    assert ledger.discardable(now=61.0) == [2]
    # A step that failed at its deadline, or whose commit failed, has no writer left.
    ledger.begin(3, ("actor", 0), "a", 70.0)
    ledger.expire(71.0)
    all_succeed(ledger, 4)
    ledger.begin_commit(4)
    ledger.finish_commit(4, Failure("finalizer", None, Phase.TRACKER, "OSError: no space", 28))
    assert ledger.discardable(now=71.0) == [3, 4]
    # Committed and lost steps are never handed out.
    lost = StepLedger(PARTICIPANTS, max_in_flight=1, lost=[9])
    all_succeed(lost, 5)
    lost.begin_commit(5)
    lost.finish_commit(5)
    assert lost.discardable(now=1e9) == []


# ---- a batch recorded in one pass (record_successes) -------------------------------------


def _ledger_with_saves_begun() -> StepLedger:
    """Step 5 begun by every participant, each with its own save id ("<role><rank>")."""
    ledger = StepLedger(PARTICIPANTS, max_in_flight=2)
    for role, rank in ledger.expected:
        ledger.begin(5, (role, rank), f"{role}{rank}", 100.0)
    return ledger


def _actors(step: int = 5, **save_ids: str) -> list[RankReport]:
    return [report(step, "actor", r, save_id=save_ids.get(f"r{r}", f"actor{r}")) for r in (0, 1)]


def _failed_step(ledger: StepLedger) -> None:
    ledger.record(report(5, "driver", 0, Failure("driver", 0, Phase.WRITE, "x"), "driver0"))


def _committing(ledger: StepLedger) -> None:
    ledger.record_batch([*_actors(), report(5, "driver", 0, save_id="driver0")])
    ledger.begin_commit(5)


# name: (what happens to the ledger first, the batch, record_batch's outcomes)
_DECIDED_REPORT_BY_REPORT = {
    "a failure": (
        None,
        [_actors()[0], report(5, "actor", 1, Failure("actor", 1, Phase.WRITE, "x"), "actor1")],
        [Recorded.COUNTED, Recorded.FAILED],
    ),
    "a replaced save": (None, _actors(r1="earlier"), [Recorded.COUNTED, Recorded.STALE]),
    "no save begun": (
        lambda ledger: ledger.entry(5).attempts.pop(("actor", 1)),
        _actors(),
        [Recorded.COUNTED, Recorded.COUNTED],
    ),
    "a duplicate in the batch": (
        None,
        [_actors()[0], _actors()[0]],
        [Recorded.COUNTED, Recorded.IGNORED],
    ),
    "one reported already": (
        lambda ledger: ledger.record(_actors()[0]),
        _actors(),
        [Recorded.IGNORED, Recorded.COUNTED],
    ),
    "two steps": (
        lambda ledger: ledger.begin(6, ("actor", 1), "actor1", 100.0),
        [_actors()[0], _actors(step=6)[1]],
        [Recorded.COUNTED, Recorded.COUNTED],
    ),
    "a failed step": (_failed_step, _actors(), [Recorded.IGNORED, Recorded.IGNORED]),
    "a committing step": (_committing, _actors(), [Recorded.IGNORED, Recorded.IGNORED]),
    "a step never begun": (
        None,
        _actors(step=9),
        [Recorded.COUNTED, Recorded.COUNTED],
    ),
}


def _state(ledger: StepLedger) -> list:
    return [(s, ledger.status(s), ledger.missing(s), ledger.failures(s)) for s in (5, 6, 9)]


def test_I1_a_batch_of_registered_successes_is_recorded_in_one_pass():
    """The finalizer's intake of a node's or a rank group's batch: every report a success of
    the registered save, recorded at once; the batch that completes the step ends READY."""
    ledger = _ledger_with_saves_begun()
    assert ledger.record_successes(_actors()) == [Recorded.COUNTED, Recorded.COUNTED]
    assert ledger.missing(5) == [("driver", 0)]
    assert ledger.record_successes([report(5, "driver", 0, save_id="driver0")]) == [Recorded.READY]
    assert ledger.status(5) is StepStatus.COLLECTING and ledger.missing(5) == []


@pytest.mark.parametrize("case", sorted(_DECIDED_REPORT_BY_REPORT))
def test_I1_a_batch_with_any_other_report_is_left_to_record_batch_with_nothing_recorded(case):
    """A batch the one-pass intake does not take changes nothing, and record_batch then
    decides it report by report: the finalizer's two ways of taking a batch never differ."""
    before, batch, outcomes = _DECIDED_REPORT_BY_REPORT[case]
    ledgers = [_ledger_with_saves_begun(), _ledger_with_saves_begun()]
    for ledger in ledgers:
        if before is not None:
            before(ledger)
    untouched = _state(ledgers[0])
    assert ledgers[0].record_successes(batch) is None
    assert _state(ledgers[0]) == untouched
    assert ledgers[0].record_batch(batch) == outcomes
    assert ledgers[1].record_batch(batch) == outcomes
    assert _state(ledgers[0]) == _state(ledgers[1])
