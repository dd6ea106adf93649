"""What a participant tells the finalizer once its write for a step ended (protocol step 4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_ckpt.commit_record import FileEntry
from verl_ckpt.protocol import Failure

__all__ = ["Participant", "RankReport"]

# (role, rank): who takes part in a step. The driver is role "driver", rank 0.
Participant = tuple[str, int]


@dataclass
class RankReport:
    """One participant's outcome for one step; reports are idempotent by (step, role, rank).

    `files` are relative to the step directory. `write_results` are DCP WriteResults and
    `global_metadata` the pickled DCP Metadata (coordinator rank only; pickled once per save
    plan, megatron_compat.PreparedSave) that the finalizer turns into the role's
    `.metadata`. `failure` set means this participant failed and the step will not commit.
    """

    step: int
    role: str
    rank: int
    world_size: int
    save_id: str
    files: list[FileEntry] = field(default_factory=list)
    write_results: list[Any] = field(default_factory=list)
    global_metadata: bytes | None = None
    failure: Failure | None = None

    @property
    def participant(self) -> Participant:
        return (self.role, self.rank)
