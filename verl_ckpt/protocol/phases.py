"""The phases of the protocol: where something failed, and where a fault can be injected.

`Phase` is the only list of them: protocol/__init__.py (the page), protocol/faults.py
(VERL_CKPT_FAULT), docs/ and the README name these values, and tests/test_protocol_page.py
checks that they agree.
"""

from __future__ import annotations

import errno as errno_codes
from collections.abc import Container, Iterable
from dataclasses import dataclass
from enum import StrEnum
from itertools import groupby

__all__ = ["Failure", "Phase", "describe_failures", "participant_label", "participants_text"]


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


# participants_text: runs of at least this many consecutive ranks are shown as one range,
# and at most this many pieces of a role (a step missing every rank of 16,384 is one line).
_RANGE_MIN = 3
_PIECES_MAX = 24


def participants_text(participants: Iterable[tuple[str, int]], declared: Container[str]) -> str:
    """Participants in role and rank order, as messages name them (participant_label), with
    runs of consecutive ranks shown as ranges: "actor ranks 0-4095, critic rank 2",
    "rollout[0-7]"; a role of more than _PIECES_MAX pieces cut short with its count (every
    role is named)."""
    by_role: dict[str, list[int]] = {}
    for role, rank in sorted(set(participants)):
        by_role.setdefault(role, []).append(rank)
    text = []
    for role, ranks in by_role.items():
        pieces = []
        # Consecutive ranks share rank - position: one group per run.
        for _, pairs in groupby(enumerate(ranks), key=lambda pair: pair[1] - pair[0]):
            run = [rank for _, rank in pairs]
            if len(run) < _RANGE_MIN:
                pieces.extend(participant_label(role, rank, role in declared) for rank in run)
            elif role in declared:
                pieces.append(f"{role}[{run[0]}-{run[-1]}]")
            else:
                pieces.append(f"{role} ranks {run[0]}-{run[-1]}")
        if len(pieces) > _PIECES_MAX:
            pieces = [*pieces[:_PIECES_MAX], f"... ({len(ranks)} of {role} in all)"]
        text.extend(pieces)
    return ", ".join(text)


def describe_failures(failures: list[Failure]) -> str:
    """Failures in role and rank order, one clause each: what a user reads first."""
    ordered = sorted(failures, key=lambda f: (f.role, -1 if f.rank is None else f.rank))
    return "; ".join(failure.describe() for failure in ordered)
