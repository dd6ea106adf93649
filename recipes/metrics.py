"""The toy PPO recipe's per-step metrics file (JSON Lines, `trainer.metrics_path`).

Each step's line carries its rewards and losses, `prompt_ids` (the data set indices trained
at that step), `policy_version` (the updates the generating weights had seen) and, on a
save step, the save's blocking figures. A save's background write figures come later, in a
line of their own for that step; `read_metrics` merges a file's lines by step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "WRITE_FIGURES",
    "MetricsLog",
    "is_write_figures",
    "metrics_path_problem",
    "read_metrics",
]

# The keys of a save's write-figures line, besides `step`.
WRITE_FIGURES = ("ckpt_write_s", "ckpt_bytes")


class MetricsLog:
    """Per-step JSON Lines: a step's line when the step ends, and a save step's write
    figures in a later line once its background write ended (usually during the next step,
    for the last save at shutdown).

    Why the step's line does not wait for its save's write figures: the save may commit
    before they are known, and a job killed in between would lose the line of a step that
    a resume never trains again.
    """

    def __init__(self, path: str | None) -> None:
        self._file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def add(self, record: dict[str, Any]) -> None:
        self._write(record)

    def set_write_figures(self, step: int, write_s: float, nbytes: int) -> None:
        self._write({"step": step, "ckpt_write_s": write_s, "ckpt_bytes": nbytes})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            # Flushed line by line: a killed job keeps every line written before the kill.
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()


def metrics_path_problem(path: str | None) -> str | None:
    """Why the metrics file cannot be written (its directory made, the file opened for
    appending, as MetricsLog does), or None: checked before Ray starts, where a bad path
    was a traceback after Ray and the workers had started."""
    if not path:
        return None
    refused = f"trainer.metrics_path={path!r} cannot be written"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except FileExistsError:  # mkdir's, of a directory that is something else
        return f"{refused}: {Path(path).parent} is no directory"
    except OSError as exc:
        return f"{refused}: {exc.strerror or exc}"
    return None


def is_write_figures(record: dict[str, Any]) -> bool:
    """Whether a line of the file is a save's write figures rather than a step's line."""
    return set(record) == {"step", *WRITE_FIGURES}


def read_metrics(path: str | Path) -> dict[int, dict[str, Any]]:
    """{step: its line, with its save's write figures merged in}; step lines must come in
    step order, each step once."""
    merged: dict[int, dict[str, Any]] = {}
    last = None
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        record = json.loads(line)
        step = record["step"]
        if is_write_figures(record):
            if step not in merged:
                raise ValueError(f"{path}:{number}: write figures of step {step} before its line")
            merged[step].update(record)
            continue
        if step in merged or (last is not None and step < last):
            raise ValueError(f"{path}:{number}: step {step} after step {last}")
        merged[step] = record
        last = step
    return merged
