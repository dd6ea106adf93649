"""The finalizer's bookkeeping of steps in flight: pure state, no Ray, no files.

Each step the finalizer hears of moves through explicit states:

    collecting --(every expected report succeeded)--> committing --> committed
         |                                                 |
         +--(a participant reported a failure)--> failed <-+ (the commit itself failed)
    lost: the step was in flight when the finalizer restarted; its reports are gone.

A failed step's directory holds what its participants wrote (disk space a full disk needs
back). It may be deleted once nobody writes into it any more: every participant whose
begin_step was joined has reported, or the step's deadline passed (`discardable`).

A participant's begin_step registers the save id of its save (one per CheckpointManager), so
that a report of another save of the same participant (a restarted rank, an earlier attempt)
is never counted for this one, and a second save of a step the participant already reported
is refused before it writes. A collecting step whose reports do not all arrive by its
deadline (a participant that died, or never saved it) fails, naming who is missing, so that
back-pressure never waits on it forever.

Only open steps are held in full: collecting, committing, and committed until the
retention after its commit ran (`retire`), since until then the step it deletes still
occupies a directory and back-pressure must count it. A retired step is forgotten (its
commit record on disk is the truth from then on), and failed or lost steps are remembered
by number and failures only, the oldest dropped beyond a bound, so that the ledger's size
does not grow with the number of commits (protocol page, steps 4-7). That bounded table of
entries is the one the remote tier's ledger uses too (protocol.step_table.StepTable).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter
from typing import Any

from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.protocol.messages import Participant, RankReport, StepStatus
from verl_ckpt.protocol.phases import participant_label, participants_text
from verl_ckpt.protocol.step_table import StepTable, unreported

__all__ = ["Begun", "Recorded", "StepEntry", "StepLedger", "StepStatus"]


_PARTICIPANT = attrgetter("role", "rank")
_SAVE_ID = attrgetter("save_id")
_STEP = attrgetter("step")
_FAILURE = attrgetter("failure")

IN_FLIGHT = (StepStatus.COLLECTING, StepStatus.COMMITTING)
# Held in full (never forgotten): in flight, or committed and not yet retired.
OPEN = (*IN_FLIGHT, StepStatus.COMMITTED)


class Recorded(StrEnum):
    """What a report did to its step."""

    COUNTED = "counted"  # one more success; others still missing
    READY = "ready"  # the last expected success: the caller starts the commit
    FAILED = "failed"  # this report failed the step
    IGNORED = "ignored"  # a duplicate, or late: the step is committing or already decided
    STALE = "stale"  # from a save of this participant that a newer one replaced
    REFUSED_LOST = "refused_lost"  # the step's other reports were lost in a restart


class Begun(StrEnum):
    """What a participant's begin_step found (anything but JOINED refuses the save)."""

    JOINED = "joined"  # the step collects reports, this participant's save among them
    ALREADY_REPORTED = "already_reported"  # this participant reported it from another save
    DECIDED = "decided"  # committing or committed: every participant already reported
    FAILED = "failed"  # the step failed; a step number is saved once
    LOST = "lost"  # in flight when the finalizer restarted


@dataclass
class StepEntry:
    step: int
    status: StepStatus = StepStatus.COLLECTING
    reports: dict[Participant, RankReport] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    # The save id each participant's begin_step registered (while collecting).
    attempts: dict[Participant, str] = field(default_factory=dict)
    # The ranks of each role whose begin_step joined the step (with or without a save id).
    joined: dict[str, set[int]] = field(default_factory=dict)
    # time.monotonic() after which a collecting step fails for its missing reports.
    expires_at: float = math.inf
    # What the commit produced (commit.CommitSummary), kept until the step is retired.
    summary: Any = None
    # Failed steps: the saves (participant -> save id) that had begun and not reported when
    # the step failed; they may still write into its directory.
    writing: dict[Participant, str] = field(default_factory=dict)
    # Failed steps: whether `discardable` handed the directory out for deletion already.
    discarded: bool = False


class StepLedger:
    """Which participants reported for which step, and what the step's state is."""

    def __init__(
        self,
        participants: dict[str, int],
        max_in_flight: int,
        lost: Iterable[int] = (),
        remembered_outcomes: int = 256,
        state_participants: dict[str, int] | None = None,
    ) -> None:
        # Two kinds of participant, one table of expected reports: the roles' ranks and the
        # driver (`participants`), and those declared to the coordinator
        # (`state_participants`: one state file per index, no `.metadata`, named
        # "<name>[<index>]").
        self.state_participants = dict(state_participants or {})
        everyone = {**participants, **self.state_participants}
        self.expected: tuple[Participant, ...] = tuple(
            (role, rank) for role, size in sorted(everyone.items()) for rank in range(size)
        )
        self._expected_set = frozenset(self.expected)
        self._sizes = everyone
        self.max_in_flight = max_in_flight
        # Open steps in full; failed and lost steps are kept so that waiters and late
        # reporters get the real answer, bounded so that a long run's failures do not
        # accumulate.
        self._steps: StepTable[StepEntry] = StepTable(OPEN, remembered_outcomes)
        for step in lost:
            self._steps.add(StepEntry(step, StepStatus.LOST))

    # ---- queries -------------------------------------------------------------------------

    def status(self, step: int) -> StepStatus | None:
        """The step's state, or None when the ledger does not know it (never heard of it, or
        committed and retired: ask the disk)."""
        entry = self.entry(step)
        return entry.status if entry is not None else None

    def entry(self, step: int) -> StepEntry | None:
        return self._steps.get(step)

    def in_flight(self) -> list[int]:
        """Steps collecting reports or committing: what retention must never delete."""
        return sorted(e.step for e in self._steps.held() if e.status in IN_FLIGHT)

    def retiring(self) -> list[int]:
        """Committed steps whose retention has not ended: each still takes a max_in_flight
        slot (has_room_for) until it is retired."""
        return sorted(e.step for e in self._steps.held() if e.status is StepStatus.COMMITTED)

    def has_room_for(self, step: int) -> bool:
        """Whether `step` may start: it already has, or fewer than max_in_flight steps are
        open (back-pressure: at most keep + max_in_flight step directories exist, counting
        a committed step whose retention has not yet deleted the step it replaces)."""
        return self._steps.is_held(step) or self._steps.held_count() < self.max_in_flight

    def missing(self, step: int) -> list[Participant]:
        entry = self._steps.get(step) if self._steps.is_held(step) else None
        return unreported(self.expected, entry.reports if entry is not None else {})

    def label(self, participant: Participant) -> str:
        """How messages name `participant` (phases.participant_label)."""
        role, rank = participant
        return participant_label(role, rank, role in self.state_participants)

    def describe(self, participants: Iterable[Participant]) -> str:
        """`participants` as messages name them, runs of ranks as ranges (phases.
        participants_text): a step missing 4096 ranks is named in one short line."""
        return participants_text(participants, self.state_participants)

    def role_has_begun(self, step: int, role: str) -> bool:
        """Whether every rank of `role` joined `step`, which still collects reports."""
        entry = self.entry(step)
        return (
            entry is not None
            and entry.status is StepStatus.COLLECTING
            and len(entry.joined.get(role, ())) == self._sizes.get(role)
        )

    def failures(self, step: int) -> list[Failure]:
        entry = self.entry(step)
        return list(entry.failures) if entry is not None else []

    def __len__(self) -> int:
        return len(self._steps)

    # ---- transitions ---------------------------------------------------------------------

    def open(self, step: int) -> StepEntry:
        """Start collecting `step` (idempotent)."""
        entry = self.entry(step)
        if entry is None:
            entry = self._steps.add(StepEntry(step))
        return entry

    def begin(
        self, step: int, participant: Participant, save_id: str | None, expires_at: float
    ) -> Begun:
        """A participant's begin_step: open `step` if needed, register its save, and give
        the step until at least `expires_at` for every report."""
        entry = self.open(step)
        known = entry.attempts.get(participant)
        if entry.status is not StepStatus.COLLECTING:
            if save_id is not None and known == save_id:
                return Begun.JOINED  # the same save asking again (a retried call)
            return {StepStatus.FAILED: Begun.FAILED, StepStatus.LOST: Begun.LOST}.get(
                entry.status, Begun.DECIDED
            )
        if save_id is not None:
            if known not in (None, save_id) and participant in entry.reports:
                return Begun.ALREADY_REPORTED
            entry.attempts[participant] = save_id
        entry.joined.setdefault(participant[0], set()).add(participant[1])
        if math.isinf(entry.expires_at) or expires_at > entry.expires_at:
            entry.expires_at = expires_at  # the latest participant's deadline counts
        return Begun.JOINED

    def expire(self, now: float) -> list[StepEntry]:
        """Fail every collecting step whose deadline passed, naming who did not report."""
        overdue = [
            e
            for e in self._steps.held()
            if e.status is StepStatus.COLLECTING and e.expires_at < now
        ]
        for entry in overdue:
            missing = self.describe(self.missing(entry.step))
            failure = Failure(
                "finalizer", None, Phase.REPORT, f"no report by the step's deadline from {missing}"
            )
            self._decide(entry, StepStatus.FAILED, failure)
        return overdue

    def next_expiry(self) -> float:
        """The earliest deadline of a collecting step (inf when none)."""
        return min(
            (e.expires_at for e in self._steps.held() if e.status is StepStatus.COLLECTING),
            default=math.inf,
        )

    def record(self, report: RankReport) -> Recorded:
        """Take one participant's report; the caller checked that it is an expected one."""
        return self.record_batch([report])[0]

    def record_batch(self, reports: list[RankReport]) -> list[Recorded]:
        """record() of each report, in order: a batch of reports is a node's or a rank
        group's, of one step, and its step is looked up once, not per report."""
        outcomes = []
        step, entry = None, None
        for report in reports:
            if report.step != step:
                step = report.step
                entry = self.entry(step)
            outcomes.append(self._record(report, entry))
            if entry is None:
                entry = self.entry(step)  # opened by this report
        return outcomes

    def record_successes(self, reports: list[RankReport]) -> list[Recorded] | None:
        """record_batch's outcomes for the common batch, recorded in one pass over its
        columns (C-level maps and set operations, not a Python loop per report): every
        report a success of one collecting step, from an expected participant whose
        registered save it is, that had not reported. None, with nothing recorded, for any
        other batch (one of its reports calls for a decision of its own): record_batch then
        takes the batch report by report. Either way the outcomes are the same: COUNTED
        for each, READY for the last when it completes the step."""
        if not reports:
            return None
        step = reports[0].step
        entry = self.entry(step)
        if entry is None or entry.status is not StepStatus.COLLECTING:
            return None
        participants = list(map(_PARTICIPANT, reports))
        if (
            list(map(_FAILURE, reports)).count(None) != len(reports)
            or set(map(_STEP, reports)) != {step}
            or not self._expected_set.issuperset(participants)
            or not entry.reports.keys().isdisjoint(participants)
            or len(set(participants)) != len(participants)
            # A participant with no registered save, or another one (STALE), is decided
            # report by report.
            or list(map(entry.attempts.get, participants)) != list(map(_SAVE_ID, reports))
        ):
            return None
        entry.reports.update(zip(participants, reports))
        outcomes = [Recorded.COUNTED] * len(reports)
        if len(entry.reports) == len(self.expected):
            outcomes[-1] = Recorded.READY
        return outcomes

    def _record(self, report: RankReport, entry: StepEntry | None) -> Recorded:
        participant = (report.role, report.rank)
        if participant not in self._expected_set:
            raise ValueError(f"unexpected participant {participant}")
        if entry is not None and entry.status is StepStatus.LOST:
            return Recorded.REFUSED_LOST
        if entry is not None and entry.status is StepStatus.FAILED:
            # Too late to count, but this save has stopped writing into the directory.
            if entry.writing.get(participant) == report.save_id:
                del entry.writing[participant]
            return Recorded.IGNORED
        if entry is None:
            entry = self.open(report.step)
        # Committing means every participant already reported success: anything more is a
        # duplicate (Ray retried a call) and must neither start a second commit nor fail
        # the step that is committing.
        if entry.status is not StepStatus.COLLECTING or participant in entry.reports:
            return Recorded.IGNORED
        registered = entry.attempts.get(participant)
        if registered is not None and report.save_id != registered:
            # A save this participant replaced (a restarted rank's earlier one): its files
            # were overwritten by the registered save, whose report is the one that counts.
            return Recorded.STALE
        entry.reports[participant] = report
        if report.failure is not None:
            self._decide(entry, StepStatus.FAILED, report.failure)
            return Recorded.FAILED
        # Reports are keyed by expected participants: counting them is enough.
        if len(entry.reports) == len(self.expected):
            return Recorded.READY
        return Recorded.COUNTED

    def begin_commit(self, step: int) -> StepEntry:
        entry = self._steps[step]
        if entry.status is not StepStatus.COLLECTING or len(entry.reports) != len(self.expected):
            raise ValueError(f"step {step} is {entry.status.value}, not ready to commit")
        return self._steps.move(step, StepStatus.COLLECTING, StepStatus.COMMITTING)

    def finish_commit(self, step: int, failure: Failure | None = None, summary: Any = None) -> None:
        """The commit of `step` ended: committed (retire it once retention ran) or failed."""
        entry = self._steps[step]
        if entry.status is not StepStatus.COMMITTING:
            raise ValueError(f"step {step} is {entry.status.value}, not committing")
        if failure is None:
            self._steps.move(step, StepStatus.COMMITTING, StepStatus.COMMITTED)
            entry.summary = summary
            entry.reports.clear()  # DCP metadata can be large and is on disk now
            entry.joined.clear()
        else:
            self._decide(entry, StepStatus.FAILED, failure)

    def discardable(self, now: float) -> list[int]:
        """Failed steps whose directory nobody writes into any more (every save that began
        reported, or the step's deadline passed: a participant's own write deadline ends
        before it), each returned once: the caller deletes them."""
        settled = [
            entry
            for entry in self._steps.finished()
            if entry.status is StepStatus.FAILED
            and not entry.discarded
            and (not entry.writing or entry.expires_at < now)
        ]
        for entry in settled:
            entry.discarded = True
            entry.writing.clear()
        return [entry.step for entry in settled]

    def retire(self, step: int) -> None:
        """The retention after `step`'s commit ran: forget the step, free its slot."""
        entry = self._steps.get(step)
        if entry is None or entry.status is not StepStatus.COMMITTED:
            raise ValueError(f"step {step} is not committed: nothing to retire")
        self._steps.remove(step)

    def _decide(self, entry: StepEntry, status: StepStatus, failure: Failure) -> None:
        entry.failures.append(failure)
        # A begun save that has not reported may still write; begin_step refuses any other
        # from now on (a step number is saved once), so no one is added to this.
        entry.writing = {
            p: save_id for p, save_id in entry.attempts.items() if p not in entry.reports
        }
        entry.reports.clear()  # DCP metadata can be large; the failure is what is kept
        entry.attempts.clear()
        entry.joined.clear()
        # Last: the step becomes the newest decided one, and the oldest beyond the bound go.
        self._steps.move(entry.step, entry.status, status)
