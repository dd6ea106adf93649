"""Placeholder until the rollback branch lands (interface only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

INTENT_FILENAME = ".verl_ckpt_rollback.json"
ARCHIVE_PREFIX = "rolled_back_"


@dataclass(frozen=True)
class RollbackIntent:
    to: int
    archive: str
    steps: tuple[int, ...]
    delete: bool


def read_rollback_intent(root: str | Path) -> RollbackIntent | None:
    return None


def complete_interrupted_rollback(root: str | Path) -> RollbackIntent | None:
    return None
