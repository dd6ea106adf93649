"""What a participant tells the finalizer: that it begins a step (protocol step 1,
BeginRequest, as aggregators batch it), and how its write for a step ended (step 4,
RankReport)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from verl_ckpt.protocol import Failure

__all__ = [
    "BeginRequest",
    "FileEntry",
    "GlobalMetadataCache",
    "Participant",
    "RankReport",
    "ReportBatch",
    "StepStatus",
    "batch_begins",
    "batch_reports",
    "begin_rows",
]

# (role, rank): who takes part in a step. The driver is role "driver", rank 0.
Participant = tuple[str, int]


class StepStatus(StrEnum):
    """Where a step stands in the finalizer's ledger (and in the remote tier's view of it)."""

    COLLECTING = "collecting"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"
    LOST = "lost"


@dataclass(frozen=True)
class FileEntry:
    """One file of a committed step, relative to the step directory."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)
class BeginRequest:
    """One participant's begin_step of one step (protocol step 1), as an aggregator batches
    it with its node's others: begin_step's arguments."""

    step: int
    role: str
    rank: int
    world_size: int
    timeout_s: float
    save_id: str | None

    @property
    def participant(self) -> Participant:
        return (self.role, self.rank)

    @property
    def urgent(self) -> bool:
        """Nothing makes a begin leave before its node's others (see RankReport.urgent)."""
        return False


def begin_rows(requests: list[BeginRequest]) -> list[tuple]:
    """Begins as one Ray call carries them: rows of plain values, which Ray pickles as one
    C-level structure; a list of BeginRequest objects it pickles object by object, which
    the receivers' one event loop pays for once per rank. Same trust as ReportBatch: they
    come over Ray from the job's own aggregators, never from a root or a bucket."""
    return [(r.step, r.role, r.rank, r.world_size, r.timeout_s, r.save_id) for r in requests]


def batch_begins(batch: list[BeginRequest] | list[tuple]) -> list[BeginRequest]:
    """The begins of a batch a finalizer or an aggregator was sent: rows (begin_rows) or
    BeginRequest objects."""
    return [r if isinstance(r, BeginRequest) else BeginRequest(*r) for r in batch]


@dataclass
class RankReport:
    """One participant's outcome for one step; reports are idempotent by (step, role, rank).

    `files` are relative to the step directory. `write_results` are DCP WriteResults and
    `global_metadata` the DCP Metadata (coordinator rank only) that the finalizer turns into
    the role's `.metadata`. `failure` set means this participant failed and the step will
    not commit.
    """

    step: int
    role: str
    rank: int
    world_size: int
    save_id: str
    files: list[FileEntry] = field(default_factory=list)
    write_results: list[Any] = field(default_factory=list)
    global_metadata: Any = None
    failure: Failure | None = None
    # In transit (pack/unpack), as plain pickles: about half of what Ray's own serialisation
    # of a hundred WriteResult dataclasses costs on the report's round trip. The global
    # metadata arrives pickled already (once per save plan: megatron_compat.PreparedSave).
    # Trust boundary: these bytes come over Ray from the job's own ranks, as trusted as
    # Ray's own pickling of every call between them; never from a root or a bucket (what is
    # read from those goes through format/safe_load.py).
    packed_write_results: bytes | None = None
    packed_global_metadata: bytes | None = None
    # What was wrong with its files on disk when they were checked on their way ("" when
    # nothing; commit.reported_files_problem). None: not checked, and the commit checks them.
    # Checked by the rank's node aggregator, on the node that wrote them, which sets
    # `files_checked_on` to that node's id; otherwise by the finalizer as the report
    # arrives, which also checks one report per checking node again (commit.intake).
    # A rank's own report() has both reset by the finalizer, whatever it put there.
    files_on_arrival: str | None = None
    files_checked_on: str | None = None

    def pack(self) -> RankReport:
        """Before sending: write_results as one pickled blob, and the global metadata
        pickled if a sender set it unpickled (ranks send it pickled already)."""
        if self.write_results:
            self.packed_write_results = pickle.dumps(self.write_results, pickle.HIGHEST_PROTOCOL)
            self.write_results = []
        if self.global_metadata is not None and self.packed_global_metadata is None:
            self.packed_global_metadata = pickle.dumps(
                self.global_metadata, pickle.HIGHEST_PROTOCOL
            )
        return self

    def unpack(self, metadata_cache: GlobalMetadataCache | None = None) -> RankReport:
        """On receipt, at the finalizer's intake: the global metadata back, from
        `metadata_cache` when its bytes are the ones unpickled last for this role (shared,
        never to be changed). The write results stay packed until a commit needs them
        (unpacked_write_results): with a forecast `.metadata` it does not, and the bytes are
        what the forecast is checked against (metadata_forecast)."""
        if self.packed_global_metadata is not None:
            packed = self.packed_global_metadata
            if metadata_cache is None:
                self.global_metadata = pickle.loads(packed)
            else:
                self.global_metadata = metadata_cache.unpickle(self.role, packed)
        return self

    def unpacked_write_results(self) -> list:
        """The DCP write results, unpickled now if they arrived packed."""
        if self.packed_write_results is None:
            return self.write_results
        return pickle.loads(self.packed_write_results)

    @property
    def participant(self) -> Participant:
        return (self.role, self.rank)

    @property
    def urgent(self) -> bool:
        """A failure fails its step now: its batch leaves without waiting for the node."""
        return self.failure is not None


@dataclass(frozen=True)
class ReportBatch:
    """The reports of several participants as one Ray call carries them (an aggregator's
    batch: commit/aggregator.py): packed as columns of plain values, one pickle for the
    whole batch. Ray pickles a list of RankReports object by object, which took the sending
    aggregator and the receiving finalizer about twice as long per report; the finalizer's
    intake is serial, so that is on the commit's path once per batch.

    Trust boundary: as RankReport's packed fields, these bytes come over Ray from the job's
    own aggregators and drivers (FinalizerClient.report_batch), as trusted as Ray's own
    pickling of every call between them; never from a root or a bucket."""

    packed: bytes
    count: int

    @classmethod
    def of(cls, reports: list[RankReport]) -> ReportBatch:
        reports = [r.pack() for r in reports]
        columns = (
            [r.step for r in reports],
            [r.role for r in reports],
            [r.rank for r in reports],
            [r.world_size for r in reports],
            [r.save_id for r in reports],
            [[(f.path, f.size, f.checksum) for f in r.files] for r in reports],
            [r.packed_write_results for r in reports],
            [r.packed_global_metadata for r in reports],
            [r.failure for r in reports],
            [r.files_on_arrival for r in reports],
            [r.files_checked_on for r in reports],
        )
        return cls(pickle.dumps(columns, pickle.HIGHEST_PROTOCOL), len(reports))

    def reports(self) -> list[RankReport]:
        """The reports, as their participants sent them (write results still packed)."""
        columns = pickle.loads(self.packed)
        if len(columns) != 11 or any(len(column) != self.count for column in columns):
            raise ValueError(f"a report batch of {self.count} holds columns of other lengths")
        # Every field positionally, in one call: keywords, default factories and setting the
        # packed fields afterwards cost more than the fields themselves, once per report on
        # the finalizer's serial intake. The order is RankReport's fields' (a test sends
        # every field through a batch and back).
        return [
            RankReport(
                step,
                role,
                rank,
                world,
                save_id,
                [FileEntry(*f) for f in files],
                [],
                None,
                failure,
                results,
                metadata,
                checked,
                checked_on,
            )
            for (
                step,
                role,
                rank,
                world,
                save_id,
                files,
                results,
                metadata,
                failure,
                checked,
                checked_on,
            ) in zip(*columns, strict=True)
        ]


def batch_reports(batch: ReportBatch | list[RankReport]) -> list[RankReport]:
    """The reports of a batch a finalizer or an aggregator was sent: packed (ReportBatch),
    or a plain list (in-process callers)."""
    return batch.reports() if isinstance(batch, ReportBatch) else list(batch)


class GlobalMetadataCache:
    """The finalizer's last unpickled global metadata of each role.

    A save group whose plan is cached sends the same bytes at every step (pickled once per
    plan), and unpickling them is most of the coordinator rank's report intake: on the
    commit's path whenever that report comes last. One entry per role, replaced when the
    plan changes; the objects handed out are shared between steps and never changed.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[bytes, Any]] = {}

    def unpickle(self, role: str, packed: bytes) -> Any:
        last = self._last.get(role)
        if last is not None and last[0] == packed:
            return last[1]
        metadata = pickle.loads(packed)
        self._last[role] = (packed, metadata)
        return metadata
