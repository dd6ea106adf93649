"""Per-step entries of a ledger with a bounded memory of finished steps: the mechanics the
finalizer's two ledgers share (`commit.ledger.StepLedger` for the local tier, steps 4-7,
and `remote.ledger.UploadLedger` for the remote tier, steps 8-11).

Each ledger says which of its statuses are `held`: an entry in one of them (a step in
flight, or committed and not yet retired) is held in full and never forgotten. The other
entries are finished: remembered in the order they finished, the oldest forgotten once the
table holds more than `remembered` entries in all, so that a ledger's size does not grow
with the number of steps. Every status change goes through `move`, so that an entry is
always where its status says.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from enum import Enum
from typing import Generic, Protocol, TypeVar

from verl_ckpt.protocol.messages import Participant

__all__ = ["StepTable", "unreported"]


class _Entry(Protocol):
    step: int
    status: Enum


E = TypeVar("E", bound=_Entry)


class StepTable(Generic[E]):
    """The entries of one ledger, by step."""

    def __init__(self, held: Collection[Enum], remembered: int) -> None:
        self._held_statuses = frozenset(held)
        self._remembered = remembered
        self._held: dict[int, E] = {}
        self._finished: OrderedDict[int, E] = OrderedDict()

    def get(self, step: int) -> E | None:
        return self._held.get(step) or self._finished.get(step)

    def __getitem__(self, step: int) -> E:
        entry = self.get(step)
        if entry is None:
            raise KeyError(step)
        return entry

    def held(self) -> Iterable[E]:
        return self._held.values()

    def finished(self) -> Iterable[E]:
        return self._finished.values()

    def is_held(self, step: int) -> bool:
        return step in self._held

    def held_count(self) -> int:
        return len(self._held)

    def __len__(self) -> int:
        return len(self._held) + len(self._finished)

    def add(self, entry: E) -> E:
        """Insert `entry`, replacing any entry of its step."""
        self.remove(entry.step)
        self._place(entry)
        return entry

    def move(self, step: int, before: Enum, after: Enum, what: str = "step") -> E:
        """Change the status of `step` from `before` (ValueError otherwise) to `after`; an
        entry that stops being held becomes the newest finished one."""
        entry = self[step]
        if entry.status is not before:
            raise ValueError(f"{what} {step} is {entry.status.value}, not {before.value}")
        self.remove(step)
        entry.status = after
        self._place(entry)
        return entry

    def remove(self, step: int) -> None:
        self._held.pop(step, None)
        self._finished.pop(step, None)

    def _place(self, entry: E) -> None:
        if entry.status in self._held_statuses:
            self._held[entry.step] = entry
        else:
            self._finished[entry.step] = entry
        # Forget the oldest finished steps beyond the bound; a held step stays.
        while self._finished and len(self) > self._remembered:
            self._finished.popitem(last=False)


def unreported(expected: Iterable[Participant], reported: Collection[Participant]) -> list:
    """The expected participants that have not reported, in order."""
    return sorted(p for p in expected if p not in reported)
