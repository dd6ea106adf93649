"""The toy PPO recipe's per-step metrics file (JSON Lines, `trainer.metrics_path`).

Each step's line carries its rewards and losses, `prompt_ids` (the data set indices trained
at that step), `policy_version` (the updates the generating weights had seen) and, on a
save step, the checkpoint's figures.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog"]


class MetricsLog:
    """Per-step JSON Lines, in step order, one object per step.

    The line of a save step also carries that save's background write figures
    (`ckpt_write_s`, `ckpt_bytes`), so it is held back until they are known: usually at the
    next step, for the last save at shutdown. Lines after a held one wait behind it.
    """

    def __init__(self, path: str | None) -> None:
        self._file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._queue: deque[dict[str, Any]] = deque()
        self._held: dict[int, dict[str, Any]] = {}

    def add(self, record: dict[str, Any], hold_for_write: bool = False) -> None:
        self._queue.append(record)
        if hold_for_write:
            self._held[record["step"]] = record
        self._flush()

    def set_write_figures(self, step: int, write_s: float, nbytes: int) -> None:
        record = self._held.pop(step, None)
        if record is not None:
            record.update(ckpt_write_s=write_s, ckpt_bytes=nbytes)
            self._flush()

    def close(self) -> None:
        """Write everything still held; a save whose figures never came gets nulls."""
        for record in self._held.values():
            record.setdefault("ckpt_write_s", None)
            record.setdefault("ckpt_bytes", None)
        self._held.clear()
        self._flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _flush(self) -> None:
        while self._queue and self._queue[0]["step"] not in self._held:
            record = self._queue.popleft()
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
