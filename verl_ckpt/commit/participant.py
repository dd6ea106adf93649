"""One participant's side of a step (protocol steps 1 and 4), for ranks, the driver and the
participants declared to the coordinator alike.

A participant (one rank of a role, or the driver with its own state) begins a step with a
save id, writes its files into the directory begin_step returned, and reports once: its
files, or a typed failure of the phase that failed. A participant that will not save a
step it was expected to save reports a failure at once, so that the step fails now and
not at its deadline. Who writes the files, and when, is the caller's; the order is this:

 1. begin(step, save_id)      the finalizer waits for room (max_in_flight), makes the
                              directory; a refusal (a failed or committed step) is raised.
 2. (the caller writes its files into the directory)
 3. deliver(report) / report(report)
                              the outcome, once. A failure before 1 or during 2 is reported
                              too (report_failure, withdraw): the finalizer learns
                              completion from reports only (I6).

With a node aggregator (commit/aggregator.py), steps 1 and 3 go through the node's batches:
begin returns once the finalizer admitted the node's batch of begins, and a report once the
finalizer recorded it, as direct calls do; each falls back to a direct call when the
aggregator is gone.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from verl_ckpt.commit.aggregator import AggregatorLost, AggregatorTimeout, NodeAggregator
from verl_ckpt.commit.client import FinalizerClient
from verl_ckpt.protocol import Failure, Phase, faults
from verl_ckpt.protocol.deadlines import RPC_SLACK_S, call_deadline, deadline_in, time_left
from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.protocol.messages import BeginRequest, RankReport

__all__ = ["ParticipantLink", "new_save_id"]

logger = logging.getLogger(__name__)


def new_save_id() -> str:
    """A save's id: a report of a save that a newer save of the participant replaced is
    ignored by the finalizer."""
    return uuid.uuid4().hex


class ParticipantLink:
    """`role` rank `rank` of `world_size` as a participant of the finalizer's steps.

    `inject_faults`: the report runs the `report` fault phase first (VERL_CKPT_FAULT, as
    ranks do); the driver's report has no fault phase of its own. `label`: how its failures
    name it, where not "<role> rank <rank>" (a declared participant: "rollout[1]").
    `aggregator`: reports go through the node's batch (commit/aggregator.py); None sends
    each straight to the finalizer.
    """

    def __init__(
        self,
        client: FinalizerClient,
        role: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        inject_faults: bool = False,
        label: str | None = None,
        aggregator: NodeAggregator | None = None,
    ) -> None:
        self.client = client
        self.role, self.rank, self.world_size = role, rank, world_size
        self._timeout_s = timeout_s
        self._inject_faults = inject_faults
        self._label = label
        self._aggregator = aggregator

    def begin(self, step: int, save_id: str, timeout_s: float | None = None) -> Path:
        """Step 1's begin_step: this participant's directory of `step`. `timeout_s`
        (default the link's) bounds the finalizer's wait for room to start the step."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        deadline = call_deadline(timeout)
        if self._aggregator is not None:
            request = BeginRequest(step, self.role, self.rank, self.world_size, timeout, save_id)
            try:
                return Path(self._aggregator.begin(request, deadline))
            except AggregatorLost as exc:
                # Its batch may have been answered before it died: then this is the same
                # save asking again, which the finalizer answers the same. The finalizer
                # gets what is left of this begin's wait, so that its refusal (naming who
                # holds the step back) still arrives before this caller's deadline.
                logger.warning("%s; beginning step %d directly", exc, step)
                timeout = max(0.0, time_left(deadline) - RPC_SLACK_S)
        return Path(
            self.client.begin_step(
                step, self.role, self.rank, self.world_size, timeout, save_id, deadline=deadline
            )
        )

    def new_report(self, step: int, save_id: str) -> RankReport:
        return RankReport(step, self.role, self.rank, self.world_size, save_id)

    def failure(self, phase: Phase, exc: BaseException) -> Failure:
        """This participant's failure in `phase`, as a report carries it."""
        return Failure.from_exception(self.role, self.rank, phase, exc, self._label)

    def report(self, report: RankReport, deadline: float | None = None) -> None:
        """Step 4: send `report` (its write results packed); raise if it was not delivered."""
        if self._inject_faults:
            faults.inject(Phase.REPORT, self.role, self.rank)
        self._send(report.pack(), deadline)

    def _send(self, report: RankReport, deadline: float | None) -> None:
        if self._aggregator is not None:
            last = deadline or call_deadline(self._timeout_s)
            # Part of the time is kept for a direct call: an aggregator that does not answer
            # (hung, its node overloaded) must not keep the report from the finalizer, whose
            # step would wait for it until its deadline and then blame this rank.
            through = last - min(RPC_SLACK_S, time_left(last) / 2)
            try:
                self._aggregator.report(report, through)
                return
            except (AggregatorLost, AggregatorTimeout) as exc:
                # Its batch may have been delivered all the same: then this report is a
                # duplicate, which the finalizer ignores.
                logger.warning("%s; reporting step %d directly", exc, report.step)
        self.client.report(report, deadline=deadline)

    def deliver(self, report: RankReport, deadline: float | None = None) -> Failure | None:
        """Step 4, never raising: send `report` and return this participant's failure of the
        step: the report's own, or the failure to deliver it (phase report), since the step
        cannot commit without this report."""
        try:
            self.report(report, deadline)
        except Exception as exc:  # noqa: BLE001 - the step cannot commit without this report
            if report.failure is None:
                report.failure = self.failure(Phase.REPORT, exc)
            if not isinstance(exc, CommitTimeoutError):
                # The report may never have left this process (packing it failed): the
                # finalizer is told in a call of its own, or the step waits for this report
                # until its deadline. One that reached it (a refusal) ignores this one. Not
                # after a call that timed out: a second would wait as long.
                self._send_failure(report.step, report.save_id, report.failure, RPC_SLACK_S)
        return report.failure

    def report_failure(self, step: int, save_id: str, phase: Phase, exc: BaseException) -> None:
        """Report that this participant's save of `step` failed in `phase` (even before
        begin): the step then fails for every participant now, instead of at its deadline.
        A report that cannot be delivered is logged: the original failure is what the
        caller raises."""
        self._send_failure(step, save_id, self.failure(phase, exc))

    def _send_failure(
        self, step: int, save_id: str, failure: Failure, within_s: float | None = None
    ) -> None:
        report = self.new_report(step, save_id)
        report.failure = failure
        try:
            self._send(report, None if within_s is None else deadline_in(within_s))
        except Exception as error:  # noqa: BLE001 - the original failure is what matters
            logger.warning(
                "%s: could not report the failure of step %d: %s", self.client.who, step, error
            )

    def withdraw(self, step: int, exc: BaseException) -> None:
        """This participant will not save `step` (its save failed before it began one):
        the other participants save it, so the step fails now (phase plan)."""
        self.report_failure(step, new_save_id(), Phase.PLAN, exc)
