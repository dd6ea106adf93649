"""The finalizer: one Ray actor per checkpoint root that commits steps.

Call order of one step (who runs each part):
  0) driver: `start_finalizer()` once, with the expected participants; the finalizer writes
     a marker into the root that every rank and the driver read back (one shared
     filesystem, checked at start-up).
  1) every rank: `begin_step(step)` (inside `save()`) - the finalizer creates the step
     directory, removing an uncommitted leftover of an earlier run first.
  2) every rank: writes its files in the background, then `report(RankReport)`.
  3) finalizer, when every participant reported success: completes each role's torch_dist
     directory (.metadata, metadata.json), writes the commit record, then the tracker, then
     deletes old steps. Each is durable before the next starts.
  4) driver (optional): `wait_for_commit(step)`.

The finalizer learns completion from reports, never from collectives (invariant I6). Its
state is rebuilt from disk when it (re)starts: committed steps are the directories holding a
readable commit record. Reports are kept in memory only: after a restart, steps that were in
flight are marked lost, never committed, and a rank that reports one is told so.

Crash recovery at (re)start, by where the previous instance died:
  - before the commit record: the step is lost (uncommitted; ignored, reported);
  - after the commit record, before or during the tracker's rename: the step is committed,
    so the restarted finalizer completes it by moving the tracker (forward only);
  - during retention: the step had already left the `global_step_<N>` namespace by an
    atomic rename; the leftover `.deleting_*` directory is removed at start.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from verl_ckpt import faults
from verl_ckpt.commit_record import (
    CommitRecord,
    FileEntry,
    is_committed,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.fsio import (
    atomic_write_bytes,
    file_checksum,
    fsync_dir,
    remove_stale_temporaries,
)
from verl_ckpt.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_ROLE,
    ROOT_MARKER_FILENAME,
    TRACKER_FILENAME,
    list_step_dirs,
    role_dir,
    step_dir,
)
from verl_ckpt.reports import RankReport
from verl_ckpt.retention import delete_step_dir, purge_deleted_steps, steps_to_delete
from verl_ckpt.tracker import read_tracker, write_tracker

__all__ = [
    "FINALIZER_NAMESPACE",
    "call_finalizer",
    "check_shared_root",
    "finalizer_name",
    "get_finalizer",
    "start_finalizer",
]

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
        self,
        root_dir: str,
        participants: dict[str, int],
        max_ckpt_to_keep: int | None,
        max_in_flight: int = 1,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self._root = Path(root_dir)
        self._participants = dict(participants)
        self._keep = max_ckpt_to_keep
        self._max_in_flight = max_in_flight
        self._expected = [
            (role, rank) for role, size in sorted(participants.items()) for rank in range(size)
        ]
        self._steps: dict[int, _StepState] = {}
        self._commit_lock = asyncio.Lock()
        self._commit_tasks: set[asyncio.Task] = set()
        # Reports carry DCP metadata whose classes live in torch and megatron-core: import
        # them now, at start-up, not while unpickling the first report (seconds during which
        # this actor would answer nobody, the driver's begin_step included).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex)")
            import verl_ckpt.megatron_compat  # noqa: F401

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
        # Finish deletions and tracker writes that a crash interrupted (the tracker itself
        # holds the old or the new step: the rename is atomic).
        purge_deleted_steps(self._root)
        remove_stale_temporaries(self._root, TRACKER_FILENAME)
        self._repair_lagging_tracker(restarted)
        # Every node must see this directory: ranks and the driver check this token.
        self._marker_token = uuid.uuid4().hex
        atomic_write_bytes(self._root / ROOT_MARKER_FILENAME, self._marker_token.encode())
        self._apply_retention()

    # ---- queries -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "root_dir": str(self._root),
            "participants": dict(self._participants),
            "max_ckpt_to_keep": self._keep,
            "max_in_flight": self._max_in_flight,
        }

    def marker_token(self) -> str:
        """The token this finalizer wrote into the root's marker file at start-up."""
        return self._marker_token

    def _repair_lagging_tracker(self, restarted: bool) -> None:
        """A committed step newer than the tracker: finish its commit, or leave it.

        After a restart of this actor it is our own commit, interrupted between the commit
        record (the commit point) and the tracker: completing it moves the tracker forward,
        never backward. At a fresh start it may be a tracker rolled back by hand, which we
        respect: resume follows the tracker, and the newer step stays on disk until retention
        removes it after the next commit.
        """
        committed = self.committed_steps()
        tracker = self._safe_tracker()
        if not committed or (tracker is not None and committed[-1] <= tracker):
            return
        if restarted:
            logger.warning("completing the commit of step %d: moving the tracker", committed[-1])
            write_tracker(self._root, committed[-1])
        elif tracker is not None:
            logger.warning(
                "step %d under %s is committed but the tracker names step %d; resume follows "
                "the tracker (a manual rollback?)",
                committed[-1],
                self._root,
                tracker,
            )

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

    async def begin_step(
        self, step: int, role: str, rank: int, world_size: int, timeout_s: float
    ) -> str:
        """Make sure the step's directories exist; return the participant's directory.

        Back-pressure first: a new step starts only while fewer than `max_in_flight` steps
        are uncommitted, so that at most `max_ckpt_to_keep + max_in_flight` step directories
        ever exist. Then, without awaiting (so that the ranks' calls are serialised), the
        directories. Every rank of a step gets the same answer whatever the order of their
        calls (ranks told different things would wait for each other in their planning
        collectives): only a committed step is refused; a failed or lost step is written
        again and then refused at report time.
        """
        self._check_participant(role, rank, world_size)
        await self._wait_for_room(step, timeout_s)
        path = step_dir(self._root, step)
        state = self._steps.get(step)
        # Only this step's own record is read: listing every committed step here would make
        # each save's first begin_step grow with the steps kept on disk.
        if (state is not None and state.committed) or (state is None and is_committed(path)):
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

    async def _wait_for_room(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while step not in self._steps:
            pending = {s: st for s, st in self._steps.items() if not st.done.is_set()}
            if len(pending) < self._max_in_flight:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = "; ".join(
                    f"step {s}: " + describe_participants(self.missing(s)) for s in sorted(pending)
                )
                raise CommitTimeoutError(
                    f"step {step} cannot start under {self._root}: {len(pending)} step(s) still "
                    f"uncommitted after {timeout_s:.0f}s (max_in_flight={self._max_in_flight}); "
                    f"missing reports: {missing}"
                )
            waits = [asyncio.ensure_future(st.done.wait()) for st in pending.values()]
            _, unfinished = await asyncio.wait(
                waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            for task in unfinished:
                task.cancel()

    async def report(self, report: RankReport) -> None:
        """Record one participant's outcome; commit when the last one arrives."""
        self._check_participant(report.role, report.rank, report.world_size)
        if report.step in self._lost:
            raise StepNotCommittedError(
                f"step {report.step}: report of {report.role} rank {report.rank} refused, the "
                "finalizer restarted while the step was in flight and lost the other reports"
            )
        state = self._steps.get(report.step)
        if state is None and is_committed(step_dir(self._root, report.step)):
            return  # late: committed before a restart of this actor
        state = self._steps.setdefault(report.step, _StepState(report.step))
        if state.done.is_set():
            return  # a duplicate or late report of a finished step changes nothing
        state.reports[report.participant] = report
        if report.error:
            state.failures.append(f"{report.role} rank {report.rank}: {report.error}")
            logger.error("step %d will not commit: %s", report.step, state.failures[-1])
            state.done.set()
            return
        # Reports are keyed by participant, each checked above: counting them is enough (a
        # scan of the expected participants per report would be quadratic in the ranks).
        if len(state.reports) < len(self._expected):
            return
        # The commit runs on its own: the last reporter (often the driver, in its training
        # loop) is not kept waiting for fsyncs it does not need to see.
        task = asyncio.create_task(self._commit_in_background(state))
        self._commit_tasks.add(task)
        task.add_done_callback(self._commit_tasks.discard)

    async def _commit_in_background(self, state: _StepState) -> None:
        async with self._commit_lock:
            try:
                await asyncio.to_thread(self._commit, state)
                state.committed = True
            except Exception as exc:  # noqa: BLE001 - any failure means "not committed"
                logger.exception("commit of step %d failed", state.step)
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
        faults.inject("commit")
        record = CommitRecord(step=step, participants=dict(self._participants), files=files)
        write_commit_record(path, record)
        # The tracker moves only after the record is durable (I1), and never backwards (I2):
        # a late commit of an older step leaves it on the newer one.
        current = self._safe_tracker()
        if current is None or step > current:
            try:
                write_tracker(self._root, step)
            except OSError:
                # A step reported as failed must not be committed on disk: take the record
                # back (unlinking needs no space), so that disk and report agree.
                (path / COMMIT_RECORD_FILENAME).unlink(missing_ok=True)
                fsync_dir(path)
                raise
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
    max_in_flight: int = 1,
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
            # On the driver's node, which must see the root anyway (the driver writes its own
            # state there); the job ends with that node, so a hard affinity costs nothing.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        .remote(root, dict(participants), max_ckpt_to_keep, max_in_flight)
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
        "max_in_flight": max_in_flight,
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


def check_shared_root(
    root_dir: str | os.PathLike, finalizer: ray.actor.ActorHandle, timeout_s: float, who: str
) -> None:
    """Fail unless this process sees the marker the finalizer wrote into the root.

    Ranks, driver and finalizer may run on different nodes; a root that is not one shared
    filesystem would scatter a step's files over several disks and never commit correctly.
    """
    token = ray.get(finalizer.marker_token.remote(), timeout=timeout_s)
    marker = Path(root_dir) / ROOT_MARKER_FILENAME
    try:
        seen = marker.read_text()
    except OSError:
        seen = None
    if seen != token:
        raise CheckpointError(
            f"{who} on node {ray.util.get_node_ip_address()} does not see the checkpoint root "
            f"{root_dir} that the finalizer writes to (marker {marker.name} "
            f"{'missing' if seen is None else 'differs'}): checkpoint.root_dir must be one "
            "filesystem shared by every node"
        )


def call_finalizer(
    finalizer: ray.actor.ActorHandle, method: str, *args: Any, deadline: float, who: str
) -> Any:
    """Call `method` on the finalizer and wait for the answer until `deadline` (monotonic).

    Where the finalizer itself waits (begin_step, wait_for_commit) it applies the caller's
    timeout and names what is missing; this deadline only bounds the call, so callers give
    it some slack beyond their own timeout.
    """
    ref = getattr(finalizer, method).remote(*args)
    try:
        return ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise CommitTimeoutError(f"{who}: the finalizer did not answer {method} in time") from None
