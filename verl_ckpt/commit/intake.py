"""The finalizer's intake of reports (protocol page, step 4): it counts each participant's
outcome in the step ledger, checks the files a counted report names, and hands a step whose
last report arrived to the committer (committer.py, steps 5-7).

It runs on the finalizer actor's one event loop, as the committer does (the ledger needs no
lock). A common batch (one node's successes, their files checked on that node) is taken in
one pass over its columns; any other batch report by report, with the same outcome.
"""

from __future__ import annotations

import logging
from operator import attrgetter
from pathlib import Path

from verl_ckpt.commit.committer import Committer
from verl_ckpt.commit.ledger import Recorded, StepLedger
from verl_ckpt.commit.steps import reported_files_problem
from verl_ckpt.protocol.errors import CheckpointError, StepNotCommittedError
from verl_ckpt.protocol.event_loop import Changes
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.store.commit_record import is_committed
from verl_ckpt.store.layout import step_dir

__all__ = ["ReportIntake"]

logger = logging.getLogger(__name__)

_FILES = attrgetter("files")
_FILES_ON_ARRIVAL = attrgetter("files_on_arrival")
_FILES_CHECKED_ON = attrgetter("files_checked_on")


def _all_found_by_their_nodes(reports: list[RankReport]) -> bool:
    """Whether every report names files, checked and found as reported by its node's
    aggregator (the batch then needs one check per node, not per report)."""
    return (
        all(map(_FILES, reports))
        and list(map(_FILES_ON_ARRIVAL, reports)).count("") == len(reports)
        and None not in map(_FILES_CHECKED_ON, reports)
    )


def _check_files(report: RankReport, step_path: str, confirmed: set[str]) -> None:
    """Set `report.files_on_arrival`: what is wrong on disk with the files it names.

    Each report's files are checked on their way, not all of them at the commit: with
    thousands of ranks their stats were most of the commit's time after the last report.
    A reported file is final (the rank wrote and closed it before reporting, and a second
    save of a reported step is refused at begin_step); a problem found here fails the
    commit, as one found at the commit does. A node aggregator checks its ranks' files on
    the node that wrote them, in parallel with the other nodes: the finalizer then checks
    one counted report of each such node per batch again (`confirmed`), which finds a root
    that is not the same directory on that node and here, and trusts the node for the
    others. A file that cannot be looked at (not a missing one) fails the commit too.
    """
    node = report.files_checked_on
    if node is not None and report.files_on_arrival is not None and node in confirmed:
        return
    try:
        problem = reported_files_problem(step_path, report)
    except OSError as exc:  # not a missing file: one that cannot be looked at (EACCES, EIO)
        problem = (
            f"{exc.filename or step_path}: the files of {report.role} rank {report.rank} could "
            f"not be checked ({exc.strerror or exc})"
        )
    if node is None or report.files_on_arrival is None:
        report.files_on_arrival = problem
        return
    if report.files:
        confirmed.add(node)
    if problem and not report.files_on_arrival:
        problem += f" (its node {node} found it as reported: is the root shared by every node?)"
    report.files_on_arrival = report.files_on_arrival or problem


class ReportIntake:
    """Step 4 of one checkpoint root: the reports of each step, counted; the committer
    commits a step once its last report is in."""

    def __init__(
        self, root: Path, ledger: StepLedger, changes: Changes, committer: Committer
    ) -> None:
        self._root = root
        self._ledger = ledger
        self._changes = changes
        self._committer = committer

    def take(self, report: RankReport) -> None:
        """Record one participant's outcome (already checked to be a participant); start the
        commit when the last one arrives. Raises what take_batch would return."""
        error = self.take_batch([report])[0]
        if error is not None:
            raise error

    def take_batch(self, reports: list[RankReport]) -> list[CheckpointError | None]:
        """Record the outcomes of a batch of participants (one node's ranks, through
        commit/aggregator.py; already checked to be participants) in one pass; start a step's
        commit when its last report arrives. Each report's refusal, or None, in order.

        Per report only O(1) work (a ledger update, and the stat of its own files unless its
        node aggregator made them); what is per change (waking waiters, settling failed
        steps) runs once per batch: with 16,384 ranks the finalizer's intake grows with the
        number of batches, not of ranks."""
        taken = self._take_successes(reports)
        if taken is not None:
            return taken
        # The step's directory and state, looked up once per step of the batch (a node's
        # reports are of one step), not per report: pathlib alone was most of a report's cost.
        steps: dict[int, tuple[str, bool, bool]] = {}
        recorded, dropped = [], set()
        for report in reports:
            step = report.step
            if step not in steps:
                path = step_dir(self._root, step)
                unknown = self._ledger.status(step) is None
                # A step the ledger no longer knows may be committed and forgotten already.
                steps[step] = (str(path), unknown, unknown and is_committed(path))
            _, unknown, committed = steps[step]
            # Every save begins its step first (begin_step opens it, with a deadline): a
            # success for a step the ledger does not hold is a late duplicate (a retried
            # call, a batch sent again) of a step decided and forgotten. Recorded, it would
            # open the step with no deadline, waiting for reports that never come, holding
            # a max_in_flight slot and refusing every later step. A failure before
            # begin_step still opens its step, failed.
            if committed or (unknown and report.failure is None):
                dropped.add(id(report))
            else:
                recorded.append(report)
        outcomes = self._ledger.record_batch(recorded)
        # The files of the reports that count, checked after they were counted and before
        # anything acts on the counts: a commit (started below, by the last report counted)
        # reads what every check found. Only a counted report confirms its node's checks
        # (_check_files): one the ledger ignored or found stale is in no commit.
        confirmed: set[str] = set()
        for report, outcome in zip(recorded, outcomes, strict=True):
            if outcome in (Recorded.COUNTED, Recorded.READY):
                _check_files(report, steps[report.step][0], confirmed)
        counted = iter(outcomes)
        errors: list[CheckpointError | None] = []
        settle = False
        for report in reports:
            outcome = None if id(report) in dropped else next(counted)
            if outcome in (Recorded.STALE, Recorded.FAILED, Recorded.READY):
                self._act_on(report, outcome)
            if outcome is Recorded.REFUSED_LOST:
                errors.append(
                    StepNotCommittedError(
                        f"step {report.step}: report of {report.role} rank {report.rank} "
                        "refused, the finalizer restarted while the step was in flight and "
                        "lost the other reports"
                    )
                )
                continue
            errors.append(None)
            # This report failed its step, or may be the last one of a failed step. Only
            # then: every rank's report of every step passes here.
            settle = settle or outcome in (Recorded.FAILED, Recorded.IGNORED)
        if settle:
            self._committer.discard_settled_failures()
        self._changes.notify()
        return errors

    def _take_successes(self, reports: list[RankReport]) -> list[None] | None:
        """take_batch of the common batch, in one pass over its columns: every report a
        counted success (StepLedger.record_successes) whose files its node found as
        reported. Nothing for any other batch (None): take_batch decides report by report.
        What it does is what take_batch would: the same counts, the same one check per
        node (_check_files), the same commit started by the last report."""
        if not _all_found_by_their_nodes(reports):
            return None
        outcomes = self._ledger.record_successes(reports)
        if outcomes is None:
            return None
        # Each node's first report, checked as take_batch would check it (the others of
        # the node are trusted to the node once it is confirmed).
        firsts = dict(zip(map(_FILES_CHECKED_ON, reversed(reports)), reversed(reports)))
        path = str(step_dir(self._root, reports[0].step))
        confirmed: set[str] = set()
        for report in firsts.values():
            _check_files(report, path, confirmed)
        if outcomes[-1] is Recorded.READY:
            self._act_on(reports[-1], Recorded.READY)
        self._changes.notify()
        return [None] * len(reports)

    def _act_on(self, report: RankReport, outcome: Recorded) -> None:
        """What a report's outcome calls for: a log line, or the commit of its step."""
        step = report.step
        if outcome is Recorded.STALE:
            logger.warning(
                "step %d: ignored a report of %s rank %d from a save it replaced (%s)",
                step,
                report.role,
                report.rank,
                report.save_id,
            )
        elif outcome is Recorded.FAILED:
            logger.error("step %d will not commit: %s", step, report.failure.describe())
        elif outcome is Recorded.READY:
            self._committer.start_commit(step)
