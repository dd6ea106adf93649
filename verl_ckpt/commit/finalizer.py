"""The finalizer: one Ray actor per checkpoint root, which commits steps (protocol.py).

It only connects the pieces: the step ledger (ledger.py) counts reports, the commit and
retention functions (commit.py) write the commit record, the tracker and delete old
steps, and recovery (recovery.py) rolls the root forward whenever the actor starts. Every
coroutine runs on the actor's one event loop, so the ledger needs no lock; file work runs in
a thread, one commit or retention at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from verl_ckpt.commit.ledger import Begun, Recorded, StepLedger, StepStatus
from verl_ckpt.commit.metadata_forecast import MetadataForecast, role_inputs
from verl_ckpt.commit.steps import (
    CommitPhaseError,
    CommitSummary,
    apply_retention,
    commit_step,
    discard_failed_steps,
    reported_files_problem,
    step_summary,
)
from verl_ckpt.hf.scheduler import ExportPlan, ExportQueue
from verl_ckpt.protocol import RPC_SLACK_S, Failure, Phase, describe_failures
from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.messages import GlobalMetadataCache, Participant, RankReport
from verl_ckpt.store.commit_record import committed_steps, is_committed
from verl_ckpt.store.fsio import atomic_write_bytes
from verl_ckpt.store.layout import (
    DRIVER_ROLE,
    ROOT_MARKER_FILENAME,
    RUN_MARKER_FILENAME,
    role_dir,
    step_dir,
)
from verl_ckpt.store.recovery import recover_root
from verl_ckpt.store.retention import delete_step_dir
from verl_ckpt.store.tracker import read_tracker

__all__ = ["CheckpointFinalizer", "describe_participants"]

logger = logging.getLogger(__name__)

_RECENT_SUMMARIES = 16


def describe_participants(participants: list[Participant]) -> str:
    return ", ".join(f"{role} rank {rank}" for role, rank in sorted(participants))


class CheckpointFinalizer:
    """Commits the steps of one checkpoint root; runs as a restartable Ray actor
    (finalizer_client.start_finalizer), or in-process for tests and benchmarks."""

    def __init__(
        self,
        root_dir: str,
        participants: dict[str, int],
        max_ckpt_to_keep: int | None,
        max_in_flight: int = 1,
        hf_exports: ExportPlan | None = None,
        remote: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self._root = Path(root_dir)
        # This job's finalizer, whatever its restarts (Ray passes a restarted actor the same
        # arguments): begin_step marks the steps it opens with it, so that a restart tells
        # the steps this job had in flight from the leftovers of earlier jobs. Without one,
        # a restart takes every uncommitted step for one of this job's.
        self._run_id = run_id
        self._participants = dict(participants)
        self._keep = max_ckpt_to_keep
        # Reports carry DCP metadata and write results, whose classes live in torch's DCP:
        # import it now, not while unpickling the first report (seconds of no answers). Not
        # megatron-core: nothing the finalizer unpickles or writes needs it (torch_dist_dir).
        import verl_ckpt.format.torch_dist_dir  # noqa: F401

        self._root.mkdir(parents=True, exist_ok=True)
        # Recovery rolls an interrupted commit forward and deletes nothing (retention runs
        # only after a new commit). After a restart of this actor, the steps this job had in
        # flight (marked with its run id) lost their reports with the old instance: they are
        # lost, never committed, and not cleaned by begin_step (a rank may still write).
        # Leftovers of earlier jobs stay plain leftovers, re-saved over when their turn comes.
        state = recover_root(self._root)
        lost = []
        if _was_restarted():
            lost = [
                s
                for s in state.uncommitted
                if run_id is None or _run_of(step_dir(self._root, s)) == run_id
            ]
        self._ledger = StepLedger(participants, max_in_flight, lost=lost)
        if state.uncommitted:
            logger.warning(
                "checkpoint root %s holds uncommitted step directories %s (ignored%s)",
                self._root,
                list(state.uncommitted),
                f"; the reports of {lost} were lost in a finalizer restart" if lost else "",
            )
        # The summaries of the last commits (with their timings), for waiters that ask after
        # the step was retired; bounded, like everything the finalizer keeps.
        self._recent: OrderedDict[int, CommitSummary] = OrderedDict()
        # Each role's plan metadata, unpickled once per plan rather than at every step, and
        # each role's `.metadata` made while its ranks write (both off the commit's path).
        self._metadata_cache = GlobalMetadataCache()
        self._forecast = MetadataForecast()
        self._changed = asyncio.Event()
        # One commit or retention at a time: two would race on the tracker and the listing.
        self._file_work = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        # Leftover step directories being removed for a begin_step, by step.
        self._leftover_removals: dict[int, asyncio.Task] = {}
        # Step E: Hugging Face exports of committed steps, off the commit path.
        self._hf_plan = hf_exports
        self._exports = ExportQueue(self._root, hf_exports)
        # Every node must see this directory: ranks and the driver check this token.
        self._marker_token = uuid.uuid4().hex
        atomic_write_bytes(self._root / ROOT_MARKER_FILENAME, self._marker_token.encode())
        # The steps the last retention after a commit of this finalizer left only because
        # they were being uploaded: the end of their upload finishes that retention. Empty
        # until this finalizer commits, so an upload alone (the end of a run that committed
        # nothing uploads its newest step) never deletes a step (I3: only after a commit).
        self._spared_for_uploads: set[int] = set()
        self._remote_settings = dict(remote) if remote else None
        self._remote = _open_remote_tier(
            remote, self._root, participants, self._ledger.status, self._retain_after_upload
        )

    # ---- queries -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "root_dir": str(self._root),
            "participants": dict(self._participants),
            "max_ckpt_to_keep": self._keep,
            "max_in_flight": self._ledger.max_in_flight,
            "hf_exports": asdict(self._hf_plan) if self._hf_plan else None,
            "remote": self._remote_settings,
        }

    def marker_token(self) -> str:
        """The token this finalizer wrote into the root's marker file at start-up."""
        return self._marker_token

    def status(self) -> dict[str, Any]:
        ledger = self._ledger
        pending = {step: describe_participants(ledger.missing(step)) for step in ledger.in_flight()}
        return {
            "committed": committed_steps(self._root),
            "tracker": read_tracker(self._root),
            "pending": pending,
            "ledger_size": len(ledger),
            "hf_exports": self._exports.outcomes(),
            "metadata_forecasts": {
                "used": self._forecast.used,
                "missed": self._forecast.missed,
                "late": self._forecast.late,
            },
        }

    # ---- protocol step 1: begin_step -----------------------------------------------------

    async def begin_step(
        self,
        step: int,
        role: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        save_id: str | None = None,
    ) -> str:
        """Make sure the step's directory exists; return the participant's directory.

        Back-pressure first: a new step starts only while fewer than max_in_flight steps are
        uncommitted. An uncommitted leftover of the step is removed (off the event loop, one
        removal for all participants) before anyone is told the directory. Then, without
        awaiting (so that participants' calls are serialised), the directory. Every
        participant of a step gets the same answer whatever the order of their calls (ranks
        told different things would wait for each other in their planning collectives).
        Refused: a committed step, a step that failed or was lost (a step number is saved
        once), and a second save (`save_id`) of a step the participant already reported,
        which would overwrite the files it reported. The step must have every report by
        `timeout_s` + slack after the last participant's begin_step.
        """
        self._check_participant(role, rank, world_size)
        # A failed step whose last writer died settles only at its deadline, which nothing
        # else may notice: a new step is when its space is wanted.
        self._discard_settled_failures()
        path = step_dir(self._root, step)
        # One deadline for the whole call, removal of a leftover included: the caller's own
        # wait ends at timeout_s plus the call's slack, and it must hear why before that.
        deadline = deadline_in(timeout_s)
        while True:
            await self._wait_until(
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
            break
        # A participant reports at its own deadline (timeout_s after its save) plus the
        # report call's slack: after that, a missing report will not come.
        expires_at = deadline_in(timeout_s + 2 * RPC_SLACK_S)
        begun = self._ledger.begin(step, (role, rank), save_id, expires_at)
        if begun is Begun.FAILED:
            # Its own type: another participant's failure decided the step, and a rank
            # refused so has no failure of its own to raise (manager._in_background).
            raise StepNotCommittedError(self._refusal(step, role, rank, begun))
        if begun is not Begun.JOINED:
            raise CheckpointError(self._refusal(step, role, rank, begun))
        if status is None and self._run_id is not None:
            path.mkdir(parents=True, exist_ok=True)
            _mark_run(path, self._run_id)
        target = role_dir(self._root, step, role) if role != DRIVER_ROLE else path
        target.mkdir(parents=True, exist_ok=True)
        if role != DRIVER_ROLE:
            # The role's `.metadata` is made now, while its ranks write, if it can be
            # foreseen; the commit checks it against what the ranks then report.
            self._forecast.begin(step, role, target)
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
            removal = self._spawn(self._delete_leftover(step, path))
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
            async with self._file_work:
                await asyncio.to_thread(delete_step_dir, path)
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

    # ---- protocol step 4: report ---------------------------------------------------------

    async def report(self, report: RankReport) -> None:
        """Record one participant's outcome; start the commit when the last one arrives."""
        report.unpack(self._metadata_cache)
        self._check_participant(report.role, report.rank, report.world_size)
        step = report.step
        path = step_dir(self._root, step)
        if self._ledger.status(step) is None and is_committed(path):
            return  # late: committed (and forgotten) already
        # Each report's files are checked as it arrives, not all of them at the commit: with
        # thousands of ranks their stats were most of the commit's time after the last
        # report. A reported file is final (the rank wrote and closed it before reporting,
        # and a second save of a reported step is refused at begin_step); a problem found
        # here fails the commit, as one found at the commit does.
        report.files_on_arrival = reported_files_problem(path, report)
        outcome = self._ledger.record(report)
        if outcome is Recorded.REFUSED_LOST:
            raise StepNotCommittedError(
                f"step {step}: report of {report.role} rank {report.rank} refused, the "
                "finalizer restarted while the step was in flight and lost the other reports"
            )
        if outcome is Recorded.STALE:
            logger.warning(
                "step %d: ignored a report of %s rank %d from a save it replaced (%s)",
                step,
                report.role,
                report.rank,
                report.save_id,
            )
        elif outcome is Recorded.FAILED:
            logger.error("step %d will not commit: %s", step, report.failure.describe())
        elif outcome is Recorded.READY:
            # Committing from here on: a duplicate report can no longer start a second commit.
            entry = self._ledger.begin_commit(step)
            # The commit runs on its own: the last reporter (often the driver, in its training
            # loop) is not kept waiting for fsyncs it does not need to see.
            self._spawn(self._commit(step, list(entry.reports.values()), time.time()))
        if outcome in (Recorded.FAILED, Recorded.IGNORED):
            # This report failed its step, or may be the last one of a failed step. Only
            # then: every rank's report of every step passes here.
            self._discard_settled_failures()
        self._notify()

    # ---- protocol steps 5-7: commit record, tracker, retention ----------------------------

    def _discard_settled_failures(self) -> None:
        """Delete, in the background, the directories of failed steps that nobody writes
        into any more (ledger.discardable). Called wherever a step may have settled: a
        failure, a late report of a failed step, an expiry, a begin_step."""
        steps = self._ledger.discardable(time.monotonic())
        if steps:
            self._spawn(self._discard(steps))

    async def _discard(self, steps: list[int]) -> None:
        # Under the lock of commits and retention: one of them lists the step directories.
        async with self._file_work:
            errors = await asyncio.to_thread(discard_failed_steps, self._root, steps)
        if errors:
            logger.error(
                "could not delete failed steps %s (removed before the step is saved again): %s",
                steps,
                "; ".join(errors),
            )

    async def _commit(self, step: int, reports: list[RankReport], ready_at: float) -> None:
        async with self._file_work:
            roles = [role for role in self._participants if role != DRIVER_ROLE]
            inputs = {role: role_inputs([r for r in reports if r.role == role]) for role in roles}
            # A role's `.metadata` made while its ranks wrote, where exactly these reports
            # make it (otherwise commit_step makes it).
            made = {
                role: self._forecast.take(
                    step, role, role_dir(self._root, step, role), inputs[role]
                )
                for role in roles
            }
            try:
                summary = await asyncio.to_thread(
                    commit_step, self._root, step, self._participants, reports, made
                )
            except Exception as exc:  # noqa: BLE001 - any failure means "not committed"
                logger.error("commit of step %d failed: %s", step, exc)
                phase = exc.phase if isinstance(exc, CommitPhaseError) else Phase.COMMIT
                code = exc.errno if isinstance(exc, (CommitPhaseError, OSError)) else None
                failure = Failure("finalizer", None, phase, str(exc), code)
                self._ledger.finish_commit(step, failure)
                self._notify()
                # Queued behind this commit's lock: it runs once the commit has let go.
                self._discard_settled_failures()
                return
            summary = replace(summary, ready_at=ready_at)
            for role in roles:
                self._forecast.committed(role, inputs[role])
            self._ledger.finish_commit(step, summary=summary)
            self._recent[step] = summary
            while len(self._recent) > _RECENT_SUMMARIES:
                self._recent.popitem(last=False)
            # Queued in the same turn of the event loop as the commit is recorded: a waiter
            # that saw the commit also sees its export pending, and retention below keeps it.
            self._exports.submit(step)
            # Waiters learn of the commit before retention runs: deleting old steps need not
            # delay wait_for_commit.
            self._notify()
            # Step 8 starts (in the background): the remote tier never delays a local commit.
            if self._remote is not None:
                self._remote.after_local_commit(step)
            # Taken in the same turn of the event loop as the steps retention keeps: an upload
            # that ends while retention runs still finds its step in the spared ones below.
            uploading = self._uploading()
            try:
                outcome = await asyncio.to_thread(
                    apply_retention, self._root, self._keep, self._retention_keeps()
                )
                errors = outcome.errors
                self._spared_for_uploads = uploading.intersection(outcome.spared)
            except Exception as exc:  # noqa: BLE001 - retention never un-commits a step
                errors = [f"{type(exc).__name__}: {exc}"]
                # What it left is unknown: the end of any of these uploads runs it again.
                self._spared_for_uploads = uploading
            # Only now may another step start (back-pressure counts the deleted step's
            # directory until it is gone), whether or not retention succeeded.
            self._ledger.retire(step)
            self._notify()
        if errors:
            logger.error(
                "retention after step %d failed (retried after the next commit; step %d stays "
                "committed): %s",
                step,
                step,
                "; ".join(errors),
            )

    # ---- waiting -------------------------------------------------------------------------

    async def wait_for_commit(self, step: int, timeout_s: float) -> dict[str, Any]:
        """Wait until `step` committed; raise naming who is missing or what failed."""
        deadline = deadline_in(timeout_s)
        while True:
            status = self._ledger.status(step)
            if status is StepStatus.COMMITTED or step in self._recent:
                return asdict(self._recent.get(step) or self._ledger.entry(step).summary)
            if status is None and is_committed(step_dir(self._root, step)):
                return asdict(step_summary(self._root, step))  # long retired: the record says
            if status in (StepStatus.FAILED, StepStatus.LOST):
                raise self._not_committed(step, status)
            remaining = time_left(deadline)
            if remaining <= 0:
                missing = self._ledger.missing(step)
                what = "missing reports from: " + describe_participants(missing)
                if status is StepStatus.COMMITTING:
                    what = "every report arrived; its commit is still running"
                raise CommitTimeoutError(
                    f"step {step} not committed within {timeout_s:.0f}s under {self._root}; {what}"
                )
            await self._changed_or_timeout(remaining)

    async def drain(self, timeout_s: float) -> list[int]:
        """Wait (up to `timeout_s`) for commits and retention already under way, so that a
        coordinator closing the job never kills the finalizer mid-commit; return the steps
        still collecting reports (those will not commit)."""
        pending = [task for task in self._background if not task.done()]
        if pending:
            _, unfinished = await asyncio.wait(pending, timeout=timeout_s)
            if unfinished:
                committing = [
                    s
                    for s in self._ledger.in_flight()
                    if self._ledger.status(s) is StepStatus.COMMITTING
                ]
                raise CommitTimeoutError(
                    f"the commit of steps {committing} under {self._root} did not end within "
                    f"{timeout_s:.0f}s; the next start rolls forward any commit that got as "
                    "far as its commit record"
                )
        # A finished task leaves _background in its done callback, which runs on the next
        # turn of the loop: let it, so that nothing finished looks pending (also when every
        # task had finished before this call: their callbacks may not have run yet).
        await asyncio.sleep(0)
        return self._ledger.in_flight()

    async def wait_for_exports(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait (up to `timeout_s`) for the Hugging Face exports queued or running; return
        the outcome of every export of this finalizer (step E)."""
        return await self._exports.wait(timeout_s)

    def cancel_exports(self) -> None:
        """Stop the running export and drop the waiting ones (the coordinator is closing)."""
        self._exports.cancel()

    # ---- protocol steps 8-11: the remote tier (verl_ckpt/remote/finalizer_tier.py) ---------

    async def upload_turn(self, step: int, timeout_s: float) -> bool:
        """A rank asks whether to upload its files of `step` (once committed locally)."""
        return await self._remote_tier().upload_turn(step, timeout_s)

    async def report_upload(self, report: Any) -> None:
        await self._remote_tier().report(report)

    async def drain_uploads(self, timeout_s: float) -> dict[str, Any]:
        """Upload the newest committed step if it is not in the remote tier yet, and wait for
        every upload under way; where the remote tier stands."""
        return await self._remote_tier().drain(timeout_s)

    def remote_status(self, step: int | None = None) -> dict[str, Any]:
        return self._remote_tier().status(step)

    def _remote_tier(self):
        if self._remote is None:
            raise CheckpointError(f"no remote tier is configured for {self._root}")
        return self._remote

    def _retain_after_upload(self) -> None:
        """An upload ended: finish the retention of a commit that left its step, if any."""
        if self._keep is not None:
            self._spawn(self._retain_again())

    async def _retain_again(self) -> None:
        # The spared steps are read under the lock: a commit's retention running when the
        # upload ended sets them once it is done, and this runs after it.
        async with self._file_work:
            uploading = self._uploading()
            if not self._spared_for_uploads - uploading:
                return  # no retention of this finalizer waits for an upload that ended
            try:
                outcome = await asyncio.to_thread(
                    apply_retention, self._root, self._keep, self._retention_keeps()
                )
            except Exception as exc:  # noqa: BLE001 - a background task: logged, retried later
                logger.error("retention after an upload failed: %s: %s", type(exc).__name__, exc)
                return
            self._spared_for_uploads = uploading.intersection(outcome.spared)
        if outcome.errors:
            logger.error("retention after an upload failed: %s", "; ".join(outcome.errors))

    def _uploading(self) -> set[int]:
        return set(self._remote.protected()) if self._remote is not None else set()

    # ---- internals -----------------------------------------------------------------------

    def _not_committed(self, step: int, status: StepStatus) -> StepNotCommittedError:
        if status is StepStatus.LOST:
            return StepNotCommittedError(
                f"step {step} will not commit: its reports were lost in a finalizer restart"
            )
        return StepNotCommittedError(
            f"step {step} will not commit: " + describe_failures(self._ledger.failures(step))
        )

    def _no_room_message(self, step: int, timeout_s: float) -> str:
        pending = "; ".join(
            f"step {s}: " + describe_participants(self._ledger.missing(s))
            for s in self._ledger.in_flight()
        )
        return (
            f"step {step} cannot start under {self._root}: steps {self._ledger.in_flight()} still "
            f"uncommitted after {timeout_s:.0f}s "
            f"(max_in_flight={self._ledger.max_in_flight}); missing reports: {pending}"
        )

    async def _wait_until(self, ready, timeout_s: float, message) -> None:
        deadline = deadline_in(timeout_s)
        while not ready():
            remaining = time_left(deadline)
            if remaining <= 0:
                raise CommitTimeoutError(message())
            await self._changed_or_timeout(remaining)

    async def _changed_or_timeout(self, timeout_s: float) -> None:
        """Wait for the next change, at most `timeout_s`; a step whose reports are overdue
        fails meanwhile (a change: its waiters and back-pressure see it)."""
        # Everything runs on one event loop: no change can slip in between a caller's check
        # and this wait, so no wake-up is lost.
        changed = self._changed
        until_expiry = self._ledger.next_expiry() - time.monotonic()
        try:
            await asyncio.wait_for(changed.wait(), max(0.0, min(timeout_s, until_expiry)))
        except TimeoutError:
            pass
        self._expire_overdue()

    def _expire_overdue(self) -> None:
        expired = self._ledger.expire(time.monotonic())
        for entry in expired:
            logger.error(
                "step %d will not commit: %s", entry.step, describe_failures(entry.failures)
            )
        if expired:
            self._discard_settled_failures()
            self._notify()

    def _refusal(self, step: int, role: str, rank: int, begun: Begun) -> str:
        """Why `role rank` may not save `step` (ledger.Begun), in one line."""
        where = f"step {step} under {self._root}"
        if begun is Begun.ALREADY_REPORTED:
            return (
                f"{role} rank {rank} already reported {where} from another save: a second save "
                "would overwrite the files it reported; refused"
            )
        if begun is Begun.FAILED:
            failures = describe_failures(self._ledger.failures(step))
            return f"{where} failed and a step number is saved once: {failures}"
        if begun is Begun.LOST:
            return f"{where} was in flight when the finalizer restarted and will not commit"
        return f"{where} is committing (every participant reported it); refusing another save"

    def _retention_keeps(self) -> list[int]:
        """Steps that retention must not delete whatever their age: steps in flight, steps
        queued for or under a Hugging Face export, and steps being uploaded (each is read
        by whoever works on it). One list for every retention run, so that none forgets one."""
        keep = {*self._ledger.in_flight(), *self._exports.protected()}
        if self._remote is not None:
            keep.update(self._remote.protected())
        return sorted(keep)

    def _notify(self) -> None:
        # Waiters hold the event they waited on: set it, and give later waits a fresh one.
        self._changed.set()
        self._changed = asyncio.Event()
        if getattr(self, "_remote", None) is not None:
            self._remote.notify()  # ranks waiting for an upload turn see a failed step

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

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


def _open_remote_tier(remote, root, participants, local_status, on_upload_end):
    """The remote tier of this root (protocol steps 8-11), or None without one; fsspec is
    imported only when there is one."""
    if not remote or not remote.get("url"):
        return None
    from verl_ckpt.remote.finalizer_tier import RemoteTier

    return RemoteTier(remote, root, participants, local_status, on_upload_end)


def _mark_run(path: Path, run_id: str) -> None:
    """Mark a step directory as opened by this job (a hint for a restart, not fsynced: a
    crash that loses it takes the whole job with it)."""
    (path / RUN_MARKER_FILENAME).write_text(run_id)


def _run_of(path: Path) -> str | None:
    try:
        return (path / RUN_MARKER_FILENAME).read_text()
    except OSError:
        return None


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
