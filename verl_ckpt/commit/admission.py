"""The finalizer's admission of steps (protocol page, step 1: begin_step): back-pressure,
removal of an uncommitted leftover before a step is saved again, refusals (a step number
is saved once), and the run markers that tell, after a restart of the finalizer, the steps
this job had in flight from the leftovers of earlier jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from operator import attrgetter
from pathlib import Path
from typing import Any

from verl_ckpt.commit.committer import Committer
from verl_ckpt.commit.ledger import Begun, StepLedger, StepStatus
from verl_ckpt.commit.metadata_forecast import MetadataForecast
from verl_ckpt.commit.waiters import Waiters
from verl_ckpt.protocol import RPC_SLACK_S, describe_failures
from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.event_loop import TaskSet
from verl_ckpt.protocol.messages import BeginRequest, RankReport
from verl_ckpt.store.commit_record import is_committed
from verl_ckpt.store.fsio import make_dir, read_regular, write_in_place
from verl_ckpt.store.layout import (
    DRIVER_ROLE,
    RUN_MARKER_FILENAME,
    role_dir,
    step_dir,
    step_number_problem,
)
from verl_ckpt.store.retention import delete_step

__all__ = ["Admission", "check_participant", "steps_lost_in_a_restart"]

logger = logging.getLogger(__name__)

# A run id is 32 hex characters: a longer marker is not ours (and is not read further).
_MARKER_MAX_BYTES = 256

_ROLE = attrgetter("role")
_RANK = attrgetter("rank")
_WORLD_SIZE = attrgetter("world_size")


class Admission:
    """begin_step for the steps of one checkpoint root."""

    def __init__(
        self,
        root: Path,
        participants: dict[str, int],
        run_id: str | None,
        ledger: StepLedger,
        waiters: Waiters,
        committer: Committer,
        tasks: TaskSet,
        forecast: MetadataForecast,
    ) -> None:
        self._root = root
        self._participants = participants
        self._run_id = run_id
        self._ledger = ledger
        self._waiters = waiters
        self._committer = committer
        self._tasks = tasks
        self._forecast = forecast
        # Leftover step directories being removed for a begin_step, by step.
        self._leftover_removals: dict[int, asyncio.Task] = {}

    async def begin_step(
        self,
        step: int,
        role: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        save_id: str | None,
    ) -> str:
        """CheckpointFinalizer.begin_step: the participant's directory, or a refusal."""
        self.check_participant(role, rank, world_size)
        status = await self._admit(step, timeout_s)
        # No await between the admission and the join: see _admit.
        made: dict[str, str] = {}
        return self._join(
            BeginRequest(step, role, rank, world_size, timeout_s, save_id), status, made
        )

    async def begin_steps(self, requests: list[BeginRequest]) -> list[str | CheckpointError]:
        """CheckpointFinalizer.begin_batch: several participants' begin_step of one step,
        admitted once (one wait for room, one removal of a leftover, up to the longest
        timeout asked) and joined one by one; each one's directory or refusal, in order. A
        refusal of the step itself (committed, no room in time) answers every participant,
        as each one's begin_step would have; so does an admission that took longer than a
        participant's own timeout, whose caller stopped waiting."""
        # None: not answered yet (an expected participant, to join).
        answers: list[Any] = [self._stranger(r) for r in requests]
        joining = [r for r, answer in zip(requests, answers, strict=True) if answer is None]
        if not joining:
            return answers
        if len({r.step for r in joining}) != 1:
            raise CheckpointError("a batch of begins holds several steps")
        step, started = joining[0].step, time.monotonic()
        try:
            status = await self._admit(step, max(r.timeout_s for r in joining))
        except CheckpointError as exc:
            return [exc if answer is None else answer for answer in answers]
        waited_s = time.monotonic() - started
        made: dict[str, str] = {}
        for i, request in enumerate(requests):
            if answers[i] is not None:
                continue
            if waited_s > request.timeout_s:
                answers[i] = CommitTimeoutError(
                    f"step {step} could start under {self._root} only after {waited_s:.1f}s "
                    f"(room under max_in_flight, or a leftover removed), past the "
                    f"{request.timeout_s:g}s of {self._ledger.label(request.participant)}; "
                    "refused"
                )
                continue
            try:
                answers[i] = self._join(request, status, made)
            except CheckpointError as exc:
                answers[i] = exc
            except Exception as exc:  # noqa: BLE001 - one participant's directory, not the batch's
                answers[i] = CheckpointError(
                    f"step {step} could not begin for {self._ledger.label(request.participant)} "
                    f"under {self._root}: {type(exc).__name__}: {exc}"
                )
        return answers

    def _stranger(self, request: BeginRequest) -> CheckpointError | None:
        """The refusal of a begin from anyone but an expected participant, or None."""
        try:
            self.check_participant(request.role, request.rank, request.world_size)
        except CheckpointError as exc:
            return exc
        return None

    async def _admit(self, step: int, timeout_s: float) -> StepStatus | None:
        """Wait for room to start `step` and remove its uncommitted leftover; its status in
        the ledger then. The caller joins its participants without awaiting after this: the
        step begins in the same turn of the event loop as the last check."""
        problem = step_number_problem(step)
        if problem is not None:
            # A directory no listing counts as a step (store/layout.py), whose tracker no
            # start could read: refused before anything is written.
            raise CheckpointError(f"a step cannot be saved under {self._root}: {problem}")
        # A failed step whose last writer died settles only at its deadline, which nothing
        # else may notice: a new step is when its space is wanted.
        self._committer.discard_settled_failures()
        path = step_dir(self._root, step)
        # One deadline for the whole call, removal of a leftover included: the caller's own
        # wait ends at timeout_s plus the call's slack, and it must hear why before that.
        deadline = deadline_in(timeout_s)
        while True:
            await self._waiters.wait_until(
                lambda: self._ledger.has_room_for(step),
                time_left(deadline),
                lambda: self._no_room_message(step, timeout_s),
            )
            status = self._ledger.status(step)
            # Retired steps are forgotten by the ledger: then the record on disk says so.
            if status is StepStatus.COMMITTED or (status is None and is_committed(path)):
                raise CheckpointError(
                    f"step {step} is already committed at {path}; refusing to overwrite it"
                )
            if status is None and path.exists():
                # A leftover of an earlier run that never committed: its files must not mix
                # with the new save's, so it goes before anyone writes. Its removal let other
                # calls run: everything above is checked again (room included) before the
                # step begins in the same turn of the event loop as the last check.
                await self._remove_leftover(step, path, deadline, timeout_s)
                continue
            return status

    def _join(self, request: BeginRequest, status: StepStatus | None, made: dict[str, str]) -> str:
        """`request`'s participant joins its admitted step (`status`: the step's status at
        the admission): its directory, or a refusal. `made`: the directories this admission
        made already, by role (a batch's ranks of a role share one)."""
        step, role, rank = request.step, request.role, request.rank
        # A participant reports at its own deadline (timeout_s after its save) plus the
        # report call's slack: after that, a missing report will not come.
        expires_at = deadline_in(request.timeout_s + 2 * RPC_SLACK_S)
        begun = self._ledger.begin(step, (role, rank), request.save_id, expires_at)
        if begun is Begun.FAILED:
            # Its own type: another participant's failure decided the step, and a rank
            # refused so has no failure of its own to raise (rank/save_runner.py).
            raise StepNotCommittedError(self._refusal(step, role, rank, begun))
        if begun is not Begun.JOINED:
            raise CheckpointError(self._refusal(step, role, rank, begun))
        directory = made.get(role)
        if directory is None:
            directory = self._make_directory(step, role, status, first=not made)
            made[role] = directory
        if (
            role != DRIVER_ROLE
            and role not in self._ledger.state_participants
            and self._ledger.role_has_begun(step, role)
        ):
            # The role's `.metadata` is made now, while its ranks copy and write, if it can be
            # foreseen; the commit checks it against what the ranks then report. Only once
            # the role's last rank joined: the forecast holds the GIL for most of its work,
            # and started at the first begin it would share the event loop with every other
            # begin of the step (and, run on an idle core only, may hold the GIL while it
            # waits for one). A retried begin finds it pending (begin is idempotent), and
            # once the commit took it the step no longer collects.
            self._forecast.begin(step, role, Path(directory))
        return directory

    def _make_directory(self, step: int, role: str, status: StepStatus | None, first: bool) -> str:
        """`role`'s directory of `step`, made; with the step's run marker if the step is new
        and this is the admission's `first` directory."""
        path = step_dir(self._root, step)
        if first and status is None and self._run_id is not None:
            make_dir(path, parents=True, exist_ok=True)
            _mark_run(path, self._run_id)
        target = role_dir(self._root, step, role) if role != DRIVER_ROLE else path
        make_dir(target, parents=True, exist_ok=True)
        return str(target)

    async def _remove_leftover(
        self, step: int, path: Path, deadline: float, timeout_s: float
    ) -> None:
        """Delete the uncommitted leftover `path` of `step`, once for every participant that
        finds it: the first starts the removal, the others wait for the same one, each until
        its begin_step's `deadline`."""
        removal = self._leftover_removals.get(step)
        if removal is None:
            logger.warning("removing uncommitted leftover %s before re-saving it", path)
            removal = self._tasks.spawn(self._delete_leftover(step, path))
            self._leftover_removals[step] = removal
        try:
            # Shielded: a participant's call that ends (cancelled, or at its deadline) leaves
            # the removal running for the others and for the next save of the step.
            await asyncio.wait_for(asyncio.shield(removal), time_left(deadline))
        except TimeoutError:
            raise CommitTimeoutError(
                f"step {step} cannot start under {self._root}: the uncommitted leftover {path} "
                f"was not removed within {timeout_s:.0f}s (a commit or retention holding the "
                "root's file work, or a slow delete)"
            ) from None

    async def _delete_leftover(self, step: int, path: Path) -> None:
        try:
            # Off the event loop (a large leftover takes long to delete, and every other call
            # would wait), and under the lock of commits and retention: retention purges
            # `.deleting_*` directories, and both would delete this one's at once.
            # The lease is checked anew right before (as for commits and retention): this
            # begin_step may have waited long for room, and a job that took the root over
            # meanwhile may be writing this very step.
            async with self._committer.file_work:
                await asyncio.to_thread(
                    self._committer.guarded, f"removal of the leftover {path}", delete_step, path
                )
        except OSError as exc:
            if not path.exists():
                # It left the step's name (the atomic rename) and only its files stayed: the
                # step can start; retention purges the `.deleting_*` directory later.
                logger.warning(
                    "leftover %s left the step namespace but not the disk: %s", path, exc
                )
                return
            raise CheckpointError(
                f"step {step} cannot start: its uncommitted leftover {exc.filename or path} "
                f"could not be removed: {exc.strerror or exc}"
            ) from None
        finally:
            self._leftover_removals.pop(step, None)

    def check_participant(self, role: str, rank: int, world_size: int) -> None:
        """Refuse a call from anyone but an expected participant of the root."""
        check_participant(self._root, self._participants, role, rank, world_size)

    def all_participants(self, reports: list[RankReport]) -> bool:
        """Whether check_participant passes every report of a batch of one role (an
        aggregator's): checked over the batch's columns at once. False says only that some
        report needs check_participant's own verdict."""
        if not reports:
            return False
        roles = list(map(_ROLE, reports))
        expected = self._participants.get(roles[0])
        return (
            expected is not None
            and roles.count(roles[0]) == len(roles)
            and list(map(_WORLD_SIZE, reports)).count(expected) == len(reports)
            # Each rank, as check_participant tests it (a min and a max would let a NaN by).
            and all(0 <= rank < expected for rank in map(_RANK, reports))
        )

    def _no_room_message(self, step: int, timeout_s: float) -> str:
        """What holds the max_in_flight slots: steps in flight (and whose reports they
        miss), and committed steps whose retention is still deleting older steps."""
        in_flight, retiring = self._ledger.in_flight(), self._ledger.retiring()
        holders = []
        if in_flight or not retiring:
            pending = "; ".join(
                f"step {s}: " + self._ledger.describe(self._ledger.missing(s)) for s in in_flight
            )
            holders.append(f"steps {in_flight} still uncommitted; missing reports: {pending}")
        if retiring:
            holders.append(
                f"the retention after committed steps {retiring} still deleting older steps"
            )
        return (
            f"step {step} cannot start under {self._root} within {timeout_s:.0f}s "
            f"(max_in_flight={self._ledger.max_in_flight}): {'; '.join(holders)}"
        )

    def _refusal(self, step: int, role: str, rank: int, begun: Begun) -> str:
        """Why `role rank` may not save `step` (ledger.Begun), in one line."""
        where = f"step {step} under {self._root}"
        if begun is Begun.ALREADY_REPORTED:
            return (
                f"{self._ledger.label((role, rank))} already reported {where} from another "
                "save: a second save "
                "would overwrite the files it reported; refused"
            )
        if begun is Begun.FAILED:
            failures = describe_failures(self._ledger.failures(step))
            return f"{where} failed and a step number is saved once: {failures}"
        if begun is Begun.LOST:
            return f"{where} was in flight when the finalizer restarted and will not commit"
        return f"{where} is committing (every participant reported it); refusing another save"


def check_participant(
    root: Path, participants: dict[str, int], role: str, rank: int, world_size: int
) -> None:
    """Refuse a call from anyone but an expected participant of the root."""
    expected = participants.get(role)
    if expected is None:
        raise CheckpointError(
            f"role {role!r} is not a participant of {root} (expected roles: {sorted(participants)})"
        )
    if world_size != expected or not 0 <= rank < expected:
        raise CheckpointError(
            f"{role} rank {rank} of world size {world_size} does not match the finalizer "
            f"of {root}, which expects {expected} ranks of role {role!r}"
        )


def steps_lost_in_a_restart(root: Path, uncommitted: list[int], run_id: str | None) -> list[int]:
    """After a restart of this actor, the steps this job had in flight (marked with its run
    id) lost their reports with the old instance: they are lost, never committed, and not
    cleaned by begin_step (a rank may still write). Leftovers of earlier jobs stay plain
    leftovers, re-saved over when their turn comes. Without a run id, a restart takes every
    uncommitted step for one of this job's."""
    if not _was_restarted():
        return []
    return [s for s in uncommitted if run_id is None or _run_of(step_dir(root, s)) == run_id]


def _mark_run(path: Path, run_id: str) -> None:
    """Mark a step directory as opened by this job (a hint for a restart, not fsynced: a
    crash that loses it takes the whole job with it); the step directory is reached below
    the root (its parent) without following a link."""
    write_in_place(path / RUN_MARKER_FILENAME, run_id.encode(), beneath=path.parent)


def _run_of(path: Path) -> str | None:
    try:
        # Bounded, a regular file only: a step directory may have been planted with a FIFO.
        data = read_regular(path / RUN_MARKER_FILENAME, _MARKER_MAX_BYTES)
    except OSError:
        return None
    return None if data is None else data.decode(errors="replace")


def _was_restarted() -> bool:
    """Whether Ray restarted this actor after a crash (False outside an actor)."""
    import ray

    # get_runtime_context() would start a whole local Ray in a process without one.
    if not ray.is_initialized():
        return False
    try:
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - a driver or task, not an actor: tests and benchmarks
        return False
