"""The driver's side: start the finalizer, save the trainer's own state, wait for commits."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import ray
import torch

from verl_ckpt.commit_record import FileEntry, read_commit_record, verify_files
from verl_ckpt.config import CheckpointConfig, to_checkpoint_config
from verl_ckpt.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
)
from verl_ckpt.file_writer import write_checksummed
from verl_ckpt.finalizer import call_finalizer, check_shared_root, start_finalizer
from verl_ckpt.layout import DRIVER_ROLE, DRIVER_STATE_FILENAME
from verl_ckpt.reports import RankReport
from verl_ckpt.resume import resolve_resume_dir

__all__ = ["CheckpointCoordinator"]


def check_root_dir(root: Path) -> None:
    """Fail early, naming the path, when the checkpoint root cannot hold checkpoints."""
    if root.exists() and not root.is_dir():
        raise CheckpointConfigError(f"checkpoint.root_dir {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointConfigError(
            f"checkpoint.root_dir {root} cannot be created: {exc}"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointConfigError(f"checkpoint.root_dir {root} is not writable")


class CheckpointCoordinator:
    """Lives in the driver: one per checkpoint root and job.

    `roles` maps each role to its number of saving ranks, e.g. {"actor": 2, "critic": 1};
    with `save_driver_state` the driver's own state is one more participant of every step.
    """

    def __init__(
        self,
        config: CheckpointConfig | Any,
        roles: dict[str, int],
        save_driver_state: bool = True,
    ) -> None:
        self.config = to_checkpoint_config(config)
        if DRIVER_ROLE in roles:
            raise CheckpointConfigError(f"role name {DRIVER_ROLE!r} is reserved for the driver")
        self.root = Path(self.config.root_dir).resolve()
        check_root_dir(self.root)
        self.participants = dict(roles)
        if save_driver_state:
            self.participants[DRIVER_ROLE] = 1
        # Starting an actor is a process start: give it a minute even when saves have a
        # short deadline.
        self.finalizer = start_finalizer(
            self.root,
            self.participants,
            self.config.max_ckpt_to_keep,
            max(60.0, self.config.timeout_s),
            self.config.max_in_flight,
        )
        check_shared_root(self.root, self.finalizer, self.config.timeout_s, "the driver")

    def resume_dir(self) -> Path | None:
        """The committed step to resume from per `resume_mode`, or None for a fresh start."""
        return resolve_resume_dir(self.config)

    def should_save(self, step: int, last_step: int | None = None) -> bool:
        """verl's rule: every `save_freq` steps, and at the last step when saving is on."""
        freq = self.config.save_freq
        return freq > 0 and (step % freq == 0 or step == last_step)

    def save_driver_state(self, step: int, state: dict[str, Any]) -> None:
        """Write the trainer's own state for `step` and report it (synchronous: it is small)."""
        if DRIVER_ROLE not in self.participants:
            raise CheckpointError("this coordinator was built with save_driver_state=False")
        directory = Path(self._call("begin_step", step, DRIVER_ROLE, 0, 1, self.config.timeout_s))
        path = directory / DRIVER_STATE_FILENAME
        report = RankReport(step, DRIVER_ROLE, 0, 1, uuid.uuid4().hex)
        try:
            written = write_checksummed(path, lambda stream: torch.save(state, stream))
            report.files.append(FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum))
        except Exception as exc:  # noqa: BLE001 - reported, so that the step fails at once
            report.error = f"writing {path}: {exc}"
        self._call("report", report)
        if report.error:
            raise CheckpointError(f"driver state of step {step} not saved: {report.error}")

    def load_driver_state(self, step_path: str | Path) -> dict[str, Any]:
        path = Path(step_path)
        record = read_commit_record(path)
        if self.config.verify_checksums_on_load:
            problems = verify_files(path, record, prefix=DRIVER_STATE_FILENAME)
            if problems:
                raise CommitRecordError(f"{path} failed verification: " + "; ".join(problems))
        return torch.load(path / DRIVER_STATE_FILENAME, weights_only=False)

    def wait_for_commit(self, step: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until `step` committed; raise naming missing participants or failures."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        return self._call(
            "wait_for_commit", step, timeout, deadline=time.monotonic() + timeout + 30
        )

    def status(self) -> dict[str, Any]:
        return self._call("status")

    def close(self) -> None:
        """Stop the finalizer (after the steps you care about were waited for)."""
        ray.kill(self.finalizer, no_restart=True)

    def _call(self, method: str, *args: Any, deadline: float | None = None) -> Any:
        deadline = deadline or time.monotonic() + self.config.timeout_s + 30
        return call_finalizer(
            self.finalizer, method, *args, deadline=deadline, who=f"the driver of {self.root}"
        )
