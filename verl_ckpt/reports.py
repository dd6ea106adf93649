"""What a participant tells the finalizer once its write for a step ended."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_ckpt.commit_record import FileEntry

__all__ = ["RankReport"]


@dataclass
class RankReport:
    """One participant's outcome for one step; reports are idempotent by (step, role, rank).

    `files` are relative to the step directory. `write_results` are DCP WriteResults and
    `global_metadata` the DCP Metadata (coordinator rank only) that the finalizer turns into
    the role's `.metadata`. `error` set means this participant failed and the step will not
    commit.
    """

    step: int
    role: str
    rank: int
    world_size: int
    save_id: str
    files: list[FileEntry] = field(default_factory=list)
    write_results: list[Any] = field(default_factory=list)
    global_metadata: Any = None
    error: str | None = None

    @property
    def participant(self) -> tuple[str, int]:
        return (self.role, self.rank)
