"""Placeholder until the lock branch lands (interface only, flock, no reentrancy)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from verl_ckpt.errors import RootLockedError

LOCK_FILENAME = ".verl_ckpt.lock"
_HELD: dict[Path, list] = {}


class RootLock:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._released = False

    @classmethod
    def acquire(cls, root, purpose: str, mode: str = "auto", lease_s: float = 30.0) -> RootLock:
        root = Path(root).resolve()
        if root in _HELD:
            _HELD[root][1] += 1
            return cls(root)
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RootLockedError(f"checkpoint root {root} is in use") from None
        _HELD[root] = [fd, 1]
        return cls(root)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        entry = _HELD[self.root]
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])
            del _HELD[self.root]
