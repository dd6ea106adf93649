"""The finalizer's bookkeeping of uploads to the remote tier: pure state, no Ray, no I/O.

Each locally committed step the finalizer hears of gets a decision, then moves through:

    skipped                         (checkpoint.remote.every: not this one)
    uploading --(every expected rank reported, or the deadline)--> committing
        committing --> committed | failed

A rank asks for the decision of its step (`turn`) before uploading its own files, and
reports what it sent (`UploadReport`); the finalizer then uploads what no rank confirmed,
the commit record, the tracker. Steps uploading or committing are protected from local
retention (their files are being read) and from remote retention. Decided steps are kept
for a bounded number, the oldest dropped (protocol.step_table.StepTable, the table of
entries the local ledger uses too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from verl_ckpt.protocol.messages import Participant
from verl_ckpt.protocol.step_table import StepTable, unreported

__all__ = ["UploadEntry", "UploadLedger", "UploadReport", "UploadStatus"]


class UploadStatus(StrEnum):
    SKIPPED = "skipped"
    UPLOADING = "uploading"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"


IN_FLIGHT = (UploadStatus.UPLOADING, UploadStatus.COMMITTING)
_WHAT = "upload of step"


@dataclass
class UploadReport:
    """What one rank uploaded of one step: the paths it sent and verified against the commit
    record, and its failures (one line each). `node` is the uploader's node address."""

    step: int
    role: str
    rank: int
    paths: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    node: str = ""
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def participant(self) -> Participant:
        return (self.role, self.rank)


@dataclass
class UploadEntry:
    step: int
    status: UploadStatus
    expected: frozenset[Participant] = frozenset()
    reports: dict[Participant, UploadReport] = field(default_factory=dict)
    error: str | None = None


class UploadLedger:
    """Which steps are uploaded, which ranks reported, and each upload's outcome."""

    def __init__(self, every: int, remembered: int = 256) -> None:
        self.every = every
        self._commits = 0
        self._entries: StepTable[UploadEntry] = StepTable(IN_FLIGHT, remembered)

    # ---- queries -------------------------------------------------------------------------

    def status(self, step: int) -> UploadStatus | None:
        entry = self._entries.get(step)
        return entry.status if entry is not None else None

    def entry(self, step: int) -> UploadEntry | None:
        return self._entries.get(step)

    def in_flight(self) -> list[int]:
        return sorted(e.step for e in self._entries.held())

    def all_reported(self, step: int) -> bool:
        entry = self._entries[step]
        return entry.expected <= set(entry.reports)

    def missing(self, step: int) -> list[Participant]:
        entry = self._entries[step]
        return unreported(entry.expected, entry.reports)

    def confirmed_paths(self, step: int) -> set[str]:
        entry = self._entries[step]
        return {path for report in entry.reports.values() for path in report.paths}

    # ---- transitions ---------------------------------------------------------------------

    def decide(self, step: int, expected: set[Participant]) -> UploadStatus:
        """A step committed locally: upload it (every `every`th commit) or skip it."""
        upload = self._commits % self.every == 0
        self._commits += 1
        status = UploadStatus.UPLOADING if upload else UploadStatus.SKIPPED
        self._entries.add(UploadEntry(step, status, frozenset(expected) if upload else frozenset()))
        return status

    def found_committed(self, step: int) -> None:
        """`step` (this very save) is committed in the remote tier already, by an earlier
        run: nothing to upload, and its outcome is known."""
        if self._entries.get(step) is None:
            self._entries.add(UploadEntry(step, UploadStatus.COMMITTED))

    def upload_whole(self, step: int) -> None:
        """Upload `step` with no rank's help (the last step of a run, or a catch-up)."""
        self._entries.add(UploadEntry(step, UploadStatus.UPLOADING))

    def record(self, report: UploadReport) -> bool:
        """Take a rank's report; True when it is counted (an expected, first report)."""
        entry = self._entries.get(report.step)
        if (
            entry is None
            or entry.status is not UploadStatus.UPLOADING
            or report.participant not in entry.expected
            or report.participant in entry.reports
        ):
            return False
        entry.reports[report.participant] = report
        return True

    def begin_commit(self, step: int) -> None:
        self._entries.move(step, UploadStatus.UPLOADING, UploadStatus.COMMITTING, _WHAT)

    def finish_commit(self, step: int, error: str | None = None) -> None:
        after = UploadStatus.COMMITTED if error is None else UploadStatus.FAILED
        entry = self._entries.move(step, UploadStatus.COMMITTING, after, _WHAT)
        entry.error = error
