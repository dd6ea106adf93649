"""The finalizer: one Ray actor per checkpoint root that commits steps.

Call order of one step (who runs each part):
  0) driver: `start_finalizer()` once, with the expected participants.
  1) every rank: `begin_step(step)` (inside `save()`) - the finalizer creates the step
     directory, removing an uncommitted leftover of an earlier run first.
  2) every rank: writes its files in the background, then `report(RankReport)`.
  3) finalizer, when every participant reported success: completes each role's torch_dist
     directory (.metadata, metadata.json), writes the commit record, then the tracker, then
     deletes old steps. Each is durable before the next starts.
  4) driver (optional): `wait_for_commit(step)`.

The finalizer learns completion from reports, never from collectives (invariant I6). Its
state is rebuilt from disk when it (re)starts: committed steps are the directories holding a
commit record. Reports are kept in memory only: after a restart, steps that were in flight
are marked lost, never committed, and a rank that reports one is told so.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from verl_ckpt.commit_record import (
    CommitRecord,
    FileEntry,
    is_committed,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.fsio import file_checksum, fsync_dir
from verl_ckpt.layout import DRIVER_ROLE, list_step_dirs, role_dir, step_dir
from verl_ckpt.reports import RankReport
from verl_ckpt.retention import delete_step_dir, purge_deleted_steps, steps_to_delete
from verl_ckpt.tracker import read_tracker, write_tracker

__all__ = ["FINALIZER_NAMESPACE", "finalizer_name", "get_finalizer", "start_finalizer"]

logger = logging.getLogger(__name__)

FINALIZER_NAMESPACE = "verl_ckpt"


def finalizer_name(root_dir: str | os.PathLike) -> str:
    """The actor name for a root: one finalizer per checkpoint root, found by every rank."""
    digest = hashlib.sha1(str(Path(root_dir).resolve()).encode()).hexdigest()[:16]
    return f"verl_ckpt_finalizer_{digest}"


def describe_participants(missing: list[tuple[str, int]]) -> str:
    return ", ".join(f"{role} rank {rank}" for role, rank in sorted(missing))


@dataclass
class _StepState:
    step: int
    started_at: float = field(default_factory=time.monotonic)
    reports: dict[tuple[str, int], RankReport] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    committed: bool = False
    commit_error: str | None = None


class CheckpointFinalizer:
    """Commits steps of one checkpoint root (see the module docstring for the call order)."""

    def __init__(
        self, root_dir: str, participants: dict[str, int], max_ckpt_to_keep: int | None
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self._root = Path(root_dir)
        self._participants = dict(participants)
        self._keep = max_ckpt_to_keep
        self._expected = [
            (role, rank) for role, size in sorted(participants.items()) for rank in range(size)
        ]
        self._steps: dict[int, _StepState] = {}
        self._commit_lock = asyncio.Lock()
        self._root.mkdir(parents=True, exist_ok=True)
        # Steps on disk without a commit record when we start. After a restart of this actor
        # they may be steps whose reports we lost: those are never committed and never
        # cleaned by begin_step (a rank may still be writing into them).
        uncommitted = set(self._uncommitted_steps())
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._lost = uncommitted if restarted else set()
        if uncommitted:
            logger.warning(
                "checkpoint root %s holds uncommitted step directories %s (ignored%s)",
                self._root,
                sorted(uncommitted),
                "; their reports were lost in a finalizer restart" if restarted else "",
            )
        # Finish deletions that a crash interrupted, then apply retention to what is on disk.
        purge_deleted_steps(self._root)
        self._apply_retention()

    # ---- queries -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "root_dir": str(self._root),
            "participants": dict(self._participants),
            "max_ckpt_to_keep": self._keep,
        }

    def committed_steps(self) -> list[int]:
        """Steps whose commit record is readable: a corrupt record never counts toward keep."""
        return sorted(
            step for step, path in list_step_dirs(self._root).items() if is_committed(path)
        )

    def _uncommitted_steps(self) -> list[int]:
        committed = set(self.committed_steps())
        return sorted(s for s in list_step_dirs(self._root) if s not in committed)

    def missing(self, step: int) -> list[tuple[str, int]]:
        state = self._steps.get(step)
        reported = state.reports if state else {}
        return [p for p in self._expected if p not in reported]

    # ---- protocol ------------------------------------------------------------------------

    def begin_step(self, step: int, role: str, rank: int, world_size: int) -> str:
        """Make sure the step's directories exist; return the participant's directory.

        Runs without awaiting, so the calls of the ranks of one step are serialised. It
        answers every rank of a step the same way whatever the order of their calls (ranks
        that were told different things would wait for each other in their planning
        collectives): only a committed step is refused; a failed or lost step is written
        again and then refused at report time.
        """
        self._check_participant(role, rank, world_size)
        path = step_dir(self._root, step)
        state = self._steps.get(step)
        if (state is not None and state.committed) or (
            state is None and step in self.committed_steps()
        ):
            raise CheckpointError(
                f"step {step} is already committed at {path}; refusing to overwrite it"
            )
        if state is None and step not in self._lost:
            if path.exists():
                # A leftover of an earlier run that never committed: its files must not mix
                # with the new save's, so it goes before anyone writes.
                logger.warning("removing uncommitted leftover %s before re-saving it", path)
                delete_step_dir(path)
            self._steps[step] = _StepState(step)
        target = role_dir(self._root, step, role) if role != DRIVER_ROLE else path
        target.mkdir(parents=True, exist_ok=True)
        return str(target)

    async def report(self, report: RankReport) -> None:
        """Record one participant's outcome; commit when the last one arrives."""
        self._check_participant(report.role, report.rank, report.world_size)
        if report.step in self._lost:
            raise StepNotCommittedError(
                f"step {report.step}: report of {report.role} rank {report.rank} refused, the "
                "finalizer restarted while the step was in flight and lost the other reports"
            )
        state = self._steps.setdefault(report.step, _StepState(report.step))
        if state.done.is_set():
            return  # a duplicate or late report of a finished step changes nothing
        state.reports[report.participant] = report
        if report.error:
            state.failures.append(f"{report.role} rank {report.rank}: {report.error}")
            logger.error("step %d will not commit: %s", report.step, state.failures[-1])
            state.done.set()
            return
        if self.missing(report.step):
            return
        async with self._commit_lock:
            try:
                await asyncio.to_thread(self._commit, state)
                state.committed = True
            except Exception as exc:  # noqa: BLE001 - any failure means "not committed"
                logger.exception("commit of step %d failed", report.step)
                state.commit_error = f"{type(exc).__name__}: {exc}"
            finally:
                state.done.set()

    async def wait_for_commit(self, step: int, timeout_s: float) -> dict[str, Any]:
        """Wait until `step` committed; raise naming who is missing or what failed."""
        deadline = time.monotonic() + timeout_s
        state = self._steps.get(step)
        if state is None and step in self.committed_steps():
            return self._summary(step)
        while state is None:
            if step in self._lost:
                raise StepNotCommittedError(
                    f"step {step} will not commit: its reports were lost in a finalizer restart"
                )
            if time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"step {step}: no participant reported within {timeout_s:.0f}s; missing: "
                    + describe_participants(self._expected)
                )
            await asyncio.sleep(0.05)
            state = self._steps.get(step)
        try:
            await asyncio.wait_for(state.done.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise CommitTimeoutError(
                f"step {step} not committed within {timeout_s:.0f}s under {self._root}; "
                f"missing reports from: " + describe_participants(self.missing(step))
            ) from None
        if state.failures:
            raise StepNotCommittedError(
                f"step {step} will not commit: " + "; ".join(state.failures)
            )
        if state.commit_error:
            raise StepNotCommittedError(f"step {step} failed to commit: {state.commit_error}")
        return self._summary(step)

    def status(self) -> dict[str, Any]:
        pending = {
            step: describe_participants(self.missing(step))
            for step, state in self._steps.items()
            if not state.done.is_set()
        }
        return {
            "committed": self.committed_steps(),
            "tracker": read_tracker(self._root),
            "pending": pending,
            "lost": sorted(self._lost),
        }

    # ---- commit --------------------------------------------------------------------------

    def _commit(self, state: _StepState) -> None:
        step = state.step
        path = step_dir(self._root, step)
        files = self._check_reported_files(path, state)
        # Each role's torch_dist directory is completed before the commit record exists:
        # a record naming an incomplete directory would make the step "committed" but
        # unloadable.
        for role in self._participants:
            if role == DRIVER_ROLE:
                continue
            files.extend(self._complete_role(path, role, state))
        fsync_dir(path)
        record = CommitRecord(step=step, participants=dict(self._participants), files=files)
        write_commit_record(path, record)
        # The tracker moves only after the record is durable (I1), and never backwards (I2):
        # a late commit of an older step leaves it on the newer one.
        current = self._safe_tracker()
        if current is None or step > current:
            write_tracker(self._root, step)
        logger.info("committed step %d under %s", step, self._root)
        # Old steps go only after the new one committed (I3): deleting first would leave no
        # committed step at all if this commit had failed.
        self._apply_retention()

    def _check_reported_files(self, path: Path, state: _StepState) -> list[FileEntry]:
        files = []
        for report in state.reports.values():
            for entry in report.files:
                actual = path / entry.path
                size = actual.stat().st_size if actual.exists() else None
                if size != entry.size:
                    raise CheckpointError(
                        f"{actual}: reported by {report.role} rank {report.rank} with "
                        f"{entry.size} bytes, found {size if size is not None else 'no file'}"
                    )
                files.append(entry)
        return files

    def _complete_role(self, path: Path, role: str, state: _StepState) -> list[FileEntry]:
        from verl_ckpt import megatron_compat

        reports = [r for (r_role, _), r in sorted(state.reports.items()) if r_role == role]
        metadata = [r.global_metadata for r in reports if r.global_metadata is not None]
        if len(metadata) != 1:
            raise CheckpointError(
                f"step {state.step} role {role}: expected the DCP metadata from exactly one "
                f"rank (rank 0 of the save group), got {len(metadata)}"
            )
        directory = path / role
        results = [r.write_results for r in reports]
        megatron_compat.complete_role_dir(directory, metadata[0], results)
        entries = []
        for name in megatron_compat.METADATA_FILENAMES:
            size, checksum = file_checksum(directory / name)
            entries.append(FileEntry(f"{role}/{name}", size, checksum))
        return entries

    def _safe_tracker(self) -> int | None:
        try:
            return read_tracker(self._root)
        except CheckpointError as exc:
            logger.warning("overwriting unreadable tracker: %s", exc)
            return None

    def _apply_retention(self) -> None:
        committed = self.committed_steps()
        in_flight = [s for s, st in self._steps.items() if not st.done.is_set()]
        protected = set(in_flight)
        tracker = self._safe_tracker()
        if tracker is not None:
            protected.add(tracker)
        for step in steps_to_delete(committed, self._keep, protected):
            logger.info("retention: deleting committed step %d", step)
            delete_step_dir(step_dir(self._root, step))

    def _summary(self, step: int) -> dict[str, Any]:
        record = read_commit_record(step_dir(self._root, step))
        return {
            "step": step,
            "files": len(record.files),
            "bytes": sum(f.size for f in record.files),
            "tracker": read_tracker(self._root),
        }

    def _check_participant(self, role: str, rank: int, world_size: int) -> None:
        expected = self._participants.get(role)
        if expected is None:
            raise CheckpointError(
                f"role {role!r} is not a participant of {self._root} "
                f"(expected roles: {sorted(self._participants)})"
            )
        if world_size != expected or not 0 <= rank < expected:
            raise CheckpointError(
                f"{role} rank {rank} of world size {world_size} does not match the finalizer "
                f"of {self._root}, which expects {expected} ranks of role {role!r}"
            )


def start_finalizer(
    root_dir: str | os.PathLike,
    participants: dict[str, int],
    max_ckpt_to_keep: int | None,
    timeout_s: float = 120.0,
) -> ray.actor.ActorHandle:
    """Start the finalizer of `root_dir`, or reconnect to the one already running.

    It restarts on failure (rebuilding its state from disk) and takes no CPU slot. A running
    finalizer of the same root with other participants is an error, not silently reused.
    """
    if not participants or any(size < 1 for size in participants.values()):
        raise CheckpointError(f"participants must map roles to world sizes >= 1: {participants}")
    root = str(Path(root_dir).resolve())
    actor = (
        ray.remote(CheckpointFinalizer)
        .options(
            name=finalizer_name(root),
            namespace=FINALIZER_NAMESPACE,
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=3,
            num_cpus=0,
        )
        .remote(root, dict(participants), max_ckpt_to_keep)
    )
    try:
        found = ray.get(actor.describe.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CommitTimeoutError(
            f"the finalizer of {root} did not start within {timeout_s:.0f}s"
        ) from None
    wanted = {
        "root_dir": root,
        "participants": dict(participants),
        "max_ckpt_to_keep": max_ckpt_to_keep,
    }
    if found != wanted:
        raise CheckpointError(
            f"a finalizer for {root} is already running with {found}, but {wanted} was asked "
            "for; use the same checkpoint config everywhere or stop the other job"
        )
    return actor


def get_finalizer(root_dir: str | os.PathLike, timeout_s: float) -> ray.actor.ActorHandle:
    """Find the finalizer of `root_dir` that the driver started, waiting up to `timeout_s`."""
    root = str(Path(root_dir).resolve())
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(finalizer_name(root), namespace=FINALIZER_NAMESPACE)
        except ValueError:
            if time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"no finalizer for checkpoint root {root} appeared within {timeout_s:.0f}s: "
                    "the driver must call CheckpointCoordinator (or start_finalizer) first"
                ) from None
            time.sleep(0.1)
