"""The phases of the protocol: where something failed, and where a fault can be injected.

`Phase` is the only list of them: protocol/__init__.py (the page), protocol/faults.py
(VERL_CKPT_FAULT), docs/ and the README name these values, and tests/test_protocol_page.py
checks that they agree.
"""

from __future__ import annotations

import errno as errno_codes
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Failure", "Phase", "describe_failures", "participant_label"]


class Phase(StrEnum):
    """Where in the protocol something failed, and the fault-injection phases
    (VERL_CKPT_FAULT, protocol/faults.py), in the order a save meets them."""

    # A rank agrees with its save group and begins the step (no fault hook: a failure
    # here is a refusal or a disagreement, reported as such).
    PLAN = "plan"
    # A rank, before copying its tensors into the staging buffers: on the training thread,
    # or on the save thread for a deferred snapshot.
    STAGE = "stage"
    # A rank, before writing its files, in the writer thread or process.
    WRITE = "write"
    # A rank, before reporting to the finalizer.
    REPORT = "report"
    # The finalizer, after every report arrived and before the commit record.
    COMMIT = "commit"
    # The finalizer, after writing the tracker's temporary file, before the rename.
    TRACKER = "tracker"
    # The finalizer's retention, after a step left the `global_step_<N>` namespace and
    # before its files are removed.
    RETENTION = "delete"
    # A Hugging Face export, with the role, after its checks and before it writes.
    EXPORT = "export"
    # A rank, remote tier: after the finalizer said the step committed locally, before the
    # rank uploads its files.
    UPLOAD = "upload"
    # `verl-ckpt rollback`, after each step directory moved into the archive, before the
    # next move and before the tracker.
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class Failure:
    """What went wrong for one participant of one step: carried from the rank (or the
    finalizer) to whoever waits for the step, and shown aggregated by rank."""

    role: str
    rank: int | None  # None for the finalizer itself
    phase: Phase
    message: str
    errno: int | None = None
    # How the participant is named where not "<role> rank <rank>": a declared participant
    # is "<name>[<index>]" (participant_label).
    label: str | None = None

    @classmethod
    def from_exception(
        cls,
        role: str,
        rank: int | None,
        phase: Phase,
        exc: BaseException,
        label: str | None = None,
    ) -> Failure:
        code = exc.errno if isinstance(exc, OSError) else None
        return cls(role, rank, phase, f"{type(exc).__name__}: {exc}", code, label)

    def describe(self) -> str:
        code = f" {errno_codes.errorcode.get(self.errno, self.errno)}" if self.errno else ""
        who = self.label or (self.role if self.rank is None else f"{self.role} rank {self.rank}")
        return f"{who} [{self.phase.value}{code}] {self.message}"


def participant_label(role: str, rank: int, declared: bool) -> str:
    """How messages name a participant: "actor rank 3" for a rank (and the driver), and
    "rollout[1]" for index 1 of a participant declared to the coordinator."""
    return f"{role}[{rank}]" if declared else f"{role} rank {rank}"


def describe_failures(failures: list[Failure]) -> str:
    """Failures in role and rank order, one clause each: what a user reads first."""
    ordered = sorted(failures, key=lambda f: (f.role, -1 if f.rank is None else f.rank))
    return "; ".join(failure.describe() for failure in ordered)
