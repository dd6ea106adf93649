"""The path of one save (which thread runs which step) and the participant protocol, as
pure decisions: no Ray, no files.

I4 needs a deferred snapshot only where the plan is cached and a save thread copies it;
I6 needs every participant's failure reported, even before it began the step."""

from __future__ import annotations

import pytest

from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.protocol import Phase
from verl_ckpt.protocol.errors import CheckpointConfigError
from verl_ckpt.rank.save_job import SavePath, chosen_snapshot


@pytest.mark.parametrize(
    ("save_thread", "plan_reused", "snapshot", "path"),
    [
        (False, False, "now", SavePath.INLINE),
        (False, True, "now", SavePath.INLINE),
        (True, False, "now", SavePath.PLAN_NOW),
        # The first save, and a save after a structure change, copy now even if a deferred
        # or live snapshot was asked for: their planning needs the group.
        (True, False, "deferred", SavePath.PLAN_NOW),
        (True, False, "live", SavePath.PLAN_NOW),
        (True, True, "now", SavePath.CACHED_PLAN),
        (True, True, "deferred", SavePath.DEFERRED),
        (True, True, "live", SavePath.LIVE),
    ],
)
def test_I4_a_save_is_deferred_only_on_a_cached_plan_with_a_save_thread(
    save_thread, plan_reused, snapshot, path
):
    chosen = SavePath.choose(save_thread, plan_reused, snapshot)
    assert chosen is path
    background = (SavePath.CACHED_PLAN, SavePath.DEFERRED, SavePath.LIVE)
    assert chosen.plans_in_background == (path in background)
    assert chosen.deferred == (path in (SavePath.DEFERRED, SavePath.LIVE))
    assert chosen.live == (path is SavePath.LIVE)


def test_a_deferred_snapshot_without_a_save_thread_is_a_config_error_naming_the_fix():
    assert chosen_snapshot("now", "deferred", save_thread=True) == "deferred"
    assert chosen_snapshot("deferred", "now", save_thread=True) == "now"
    assert chosen_snapshot("deferred", None, save_thread=True) == "deferred"
    assert chosen_snapshot("now", "live", save_thread=True) == "live"
    for mode in ("deferred", "live"):
        with pytest.raises(CheckpointConfigError, match=f"snapshot='{mode}'.*async_save=true"):
            chosen_snapshot("now", mode, save_thread=False)
    with pytest.raises(CheckpointConfigError, match="choose one of 'now', 'deferred', 'live'"):
        chosen_snapshot("later", None, save_thread=True)


class _Client:
    """A finalizer client that records reports, or fails to deliver them."""

    who = "actor rank 1 of /ckpt"

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.reports = []

    def report(self, report, *, deadline=None) -> None:
        if self.fails:
            raise TimeoutError("no answer")
        self.reports.append(report)


def test_I6_a_participant_that_will_not_save_a_step_reports_its_failure_at_once():
    client = _Client()
    link = ParticipantLink(client, "actor", 1, 2, timeout_s=5.0)
    link.withdraw(7, ValueError("bad state"))
    (report,) = client.reports
    assert (report.step, report.role, report.rank, report.world_size) == (7, "actor", 1, 2)
    assert report.failure.phase is Phase.PLAN and "bad state" in report.failure.message


def test_I6_an_undelivered_report_is_the_participants_failure_of_phase_report(caplog):
    link = ParticipantLink(_Client(fails=True), "actor", 1, 2, timeout_s=5.0)
    report = link.new_report(7, "save-id")
    failure = link.deliver(report)
    assert failure is not None and failure.phase is Phase.REPORT
    # A failure report that cannot be delivered is logged once; the caller raises its own.
    link.report_failure(7, "save-id", Phase.WRITE, OSError("disk full"))
    assert "could not report the failure of step 7" in caplog.text
