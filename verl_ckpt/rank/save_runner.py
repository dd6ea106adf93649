"""Steps 3 (write) and 4 (report) on one rank (protocol/__init__.py), and what steps 1-2 leave
to the save thread: the save thread, the writer, the writes still pending (back-pressure),
and the hand-off of reported files to the rank's uploads (step 8).

Completion is never polled with collectives (I6): the finalizer learns it from the report.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.format.file_writer import serialize_common, write_common
from verl_ckpt.hf.model_spec import write_model_spec
from verl_ckpt.protocol import RPC_SLACK_S, Failure, Phase
from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import CheckpointWriteError, StepNotCommittedError
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.rank.copy_progress import CopyFailed
from verl_ckpt.rank.pending_writes import PendingWrites
from verl_ckpt.rank.planner import StepPlanner
from verl_ckpt.rank.save_job import (
    DOING_DEFERRED_COPY,
    DOING_DONE,
    DOING_PLAN,
    DOING_REPORT,
    DOING_WRITE,
    SaveJob,
    SaveStats,
)
from verl_ckpt.rank.snapshot_plan import check_live_unchanged
from verl_ckpt.rank.snapshotter import Snapshotter
from verl_ckpt.rank.staging import StagingSlot
from verl_ckpt.rank.writers import Writer, WriteTimeout
from verl_ckpt.store.commit_record import FileEntry
from verl_ckpt.store.fsio import WriteOptions

if TYPE_CHECKING:
    from verl_ckpt.remote.rank_uploader import RankUploader

__all__ = ["SaveRunner"]

logger = logging.getLogger(__name__)


class SaveRunner:
    """Runs each save's background part on `save_thread` (None: inline, inside save()), at
    most config.max_in_flight at a time, each failure raised to the trainer once. After a
    report that succeeded, `uploads` (if any) uploads the rank's files."""

    def __init__(
        self,
        config: CheckpointConfig,
        root: Path,
        link: ParticipantLink,
        planner: StepPlanner,
        snapshotter: Snapshotter,
        writer: Writer,
        save_thread: DaemonPool | None,
        uploads: RankUploader | None,
    ) -> None:
        self._config = config
        self._root = root
        self._link = link
        self._role, self._rank = link.role, link.rank
        self._planner = planner
        self._snapshotter = snapshotter
        self._writer = writer
        self._thread = save_thread
        self._uploads = uploads
        # The save thread's queued jobs, until each ends or is cancelled (_left_the_queue).
        self._queued: dict[Future, SaveJob] = {}
        self._pending = PendingWrites(
            config.max_in_flight, f"{self._role} rank {self._rank}", float(config.timeout_s)
        )

    @property
    def has_thread(self) -> bool:
        return self._thread is not None

    # ---- before a save ------------------------------------------------------------------

    def wait_for_room(self) -> None:
        """Back-pressure: at most max_in_flight writes; an earlier failure is raised here,
        once, instead of saving this step. Then at most remote.max_in_flight uploads."""
        self._pending.wait_for_room()
        if self._uploads is not None:
            self._uploads.wait_for_room()

    def warm_up(self, slot: StagingSlot, deadline: float) -> None:
        """prepare(): start the writer (its process), and the save thread's first call to
        the finalizer, which costs a few hundred ms (Ray sets the thread up, classes are
        pickled the first time): paid now."""
        self._writer.warm_up(slot, deadline)
        if self._thread is not None:
            warm = self._thread.submit(self._link.client.describe, label="warm up")
            warm.result(timeout=time_left(deadline))

    # ---- a save's background part --------------------------------------------------------

    def hand_over(self, job: SaveJob) -> None:
        """A save on a cached plan: the save thread takes the job over before save()'s copy
        (job.started), and plans beside it."""
        job.started = self._submit(job)

    def hand_over_failed(self, job: SaveJob) -> None:
        """save()'s copy failed after the hand-over: the save thread's write fails on it,
        frees the slot and reports; until then it holds the staging slot, so it is in flight
        like any save (the next save() waits for it, as wait() and close() do), its failure
        already raised by save()."""
        self._pending.add(job.step, job.deadline, job.started, job.stats, raised=True)

    def launch(self, job: SaveJob) -> None:
        """Steps 3-4, and what 1-2 left, on the save thread (inline: here, now)."""
        if self._thread is None:
            self._write_and_report(job)
            self._pending.add(job.step, job.deadline, _done_future(), job.stats)
            self._pending.collect()
            return
        future = job.started
        if future is None:
            future = self._submit(job)
        self._pending.add(job.step, job.deadline, future, job.stats)
        if job.path.deferred:
            self._snapshotter.deferred(job)

    def _submit(self, job: SaveJob) -> Future:
        """`job`'s background part, queued on the save thread; a job cancelled there (close()
        while it still waited behind another) reports its step's failure."""
        future = self._thread.submit(self._in_background, job, label=f"save of step {job.step}")
        self._queued[future] = job
        future.add_done_callback(self._left_the_queue)
        return future

    def _left_the_queue(self, future: Future) -> None:
        job = self._queued.pop(future, None)
        if job is None or not future.cancelled():
            return
        # Never begun by this rank (a save on a cached plan begins on the save thread) or
        # never written: either way the step cannot commit, and its other participants
        # would wait for this rank until its deadline. The slot goes with the closing pool.
        phase = Phase.PLAN if job.path.plans_in_background else Phase.WRITE
        job.snapshot_taken.set()
        closed = self._failed(job, "its checkpoint manager closed before the save could run")
        self._link.report_failure(job.step, job.save_id, phase, closed)

    def _in_background(self, job: SaveJob) -> None:
        """On the save thread: a deferred copy (then fence() returns); for a save whose plan
        is reused, the agreement, begin_step and the plan (while save() copies, if save()
        handed the job over before its copy: job.copied); then steps 3-4."""
        try:
            if self._prepare_in_background(job):
                self._write_and_report(job)
        finally:
            # However the save thread's part ended (a KeyboardInterrupt, which no `except
            # Exception` sees, included): a snapshot that will not be taken now never will,
            # and a fence left waiting for it would wait out its deadline at every call.
            job.snapshot_taken.set()

    def _prepare_in_background(self, job: SaveJob) -> bool:
        """What steps 1-2 left to the save thread; whether the write goes ahead (False: the
        step failed elsewhere first)."""
        phase = Phase.STAGE
        try:
            if job.path.deferred:
                job.stats.doing = DOING_DEFERRED_COPY
                self._snapshotter.take_deferred(job)  # a failure is raised below
            if job.path.plans_in_background:
                phase = Phase.PLAN
                self._planner.agree_and_begin(job)
                job.stats.doing = DOING_PLAN
                self._planner.plan(job)
                live = [entry.tensor for entry in job.copy.live]
                if job.copied is not None and not job.copied.covers(
                    job.prepared.write_buckets, live
                ):
                    # The plan made a tensor of its own (a clone of a view) from a buffer
                    # the copy may not have filled yet: plan again once it has.
                    phase = Phase.STAGE
                    job.copied.wait_all(job.deadline)
                    phase = Phase.PLAN
                    self._planner.plan(job)
        except StepNotCommittedError as exc:
            # A peer withdrew at the agreement, or begin_step refused (the finalizer's only
            # StepNotCommittedError here): the step had already failed, another
            # participant's failure having reached the finalizer first, and nothing was
            # written. Not this rank's failure: raised at its next save(), it would fail the
            # next step for everyone.
            self.abandon(job, phase, exc)
            job.stats.error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: not saving step %d: %s", self._link.client.who, job.step, exc)
            return False
        except BaseException as exc:  # a KeyboardInterrupt too: the slot, the finalizer
            self.abandon(job, phase, exc)
            job.stats.error = f"{type(exc).__name__}: {exc}"
            raise self._failed(job, f"{type(exc).__name__}: {exc}") from exc
        return True

    def abandon(self, job: SaveJob, phase: Phase, exc: BaseException) -> None:
        """Steps 1-2 failed after the staging slot was taken: free it, and tell the
        finalizer, so that the step fails now rather than at the deadline."""
        if job.copy is not None:  # a deferred snapshot acquires its slot on the save thread
            self._snapshotter.give_back(job, True)
        job.snapshot_taken.set()  # a live snapshot's tensors will not be written: fence open
        # Reported even before begin_step (a copy that failed first): the step then fails
        # for every rank now, instead of at the deadline.
        self._link.report_failure(job.step, job.save_id, phase, exc)

    # ---- steps 3-4 -----------------------------------------------------------------------

    def _write_and_report(self, job: SaveJob) -> None:
        job.stats.doing = DOING_WRITE
        started = time.perf_counter()
        report = self._link.new_report(job.step, job.save_id)
        try:
            report.failure = self._write(job, report)
        except BaseException as exc:  # a KeyboardInterrupt (a sync save writes on the
            # trainer's thread), which _write's `except Exception` does not turn into a
            # failure: reported before it goes on, so that the step fails now, naming this
            # rank's write, instead of waiting for a report until its deadline.
            job.stats.error = f"{type(exc).__name__}: {exc}"
            self._link.report_failure(job.step, job.save_id, Phase.WRITE, exc)
            raise
        job.stats.doing = DOING_REPORT
        reporting = time.perf_counter()
        job.stats.write_s = reporting - started
        if job.copied is not None and job.copied.finished_at is not None:
            job.stats.write_before_copy_end_s = max(0.0, job.copied.finished_at - started)
        job.stats.bytes_written = sum(f.size for f in report.files)
        job.stats.files_written = len(report.files)
        failure = self._link.deliver(report, deadline=job.deadline + RPC_SLACK_S)
        job.stats.report_s = time.perf_counter() - reporting
        job.stats.doing = DOING_DONE
        if failure is None and self._uploads is not None:
            self._uploads.submit(job.step, report.files)
        if failure is not None:
            job.stats.error = failure.describe()
            raise self._failed(job, failure.describe())

    def _write(self, job: SaveJob, report: RankReport) -> Failure | None:
        """Step 3: write every file (fsynced, checksummed) into the report."""
        buffers_free = True
        try:
            copied = job.copied
            if copied is not None and not self._config.writer.write_while_copying:
                copied.wait_all(job.deadline)
                copied = None
            outcomes = self._writer.write(
                job.prepared.write_buckets,
                job.prepared.transforms,
                job.copy.slot,
                job.deadline,
                (self._role, self._rank),
                copied,
                live_storages=self._laid_out_by_memory(job),
            )
            check_live_unchanged(job.copy.live, job.path.live)
            self._fill_report(job, report, outcomes)
            return None
        except WriteTimeout as exc:
            buffers_free = not exc.buffers_in_use
            if not buffers_free and job.path.live and job.copy.live:
                self._keep_fenced(job, exc)
            return self._link.failure(Phase.WRITE, exc)
        except CopyFailed as exc:
            return self._link.failure(Phase.STAGE, exc)
        except Exception as exc:  # noqa: BLE001 - reported to the finalizer and the caller
            return self._link.failure(Phase.WRITE, exc)
        finally:
            # The buffers go back to the pool only when no writer can still read them (nor
            # a copy still write into them).
            self._snapshotter.give_back(job, buffers_free)
            job.copy.live = []
            # A live snapshot's tensors are written (or never will be): the trainer may
            # change them from here on, so its fence opens only now (where writer threads
            # outlasted the deadline, once they ended: _keep_fenced).
            job.snapshot_taken.set()

    @staticmethod
    def _laid_out_by_memory(job: SaveJob) -> frozenset[int]:
        """The storages laid out at their own offset within a page (WriteOptions): a live
        snapshot's only. A tensor that offload-aware staging writes in place (snapshot now
        or deferred) is re-allocated by its trainer between saves: laid out by its address,
        it would change the write results at every step, and the finalizer's forecast of
        `.metadata` (which compares them whole) would miss at every commit."""
        if not job.path.live:
            return frozenset()
        return frozenset(entry.tensor.untyped_storage().data_ptr() for entry in job.copy.live)

    def _keep_fenced(self, job: SaveJob, exc: WriteTimeout) -> None:
        """A live write timed out while writer threads still run: they cannot be stopped
        and may still read the trainer's tensors, which the fence must not hand back as free
        (I4) before the last of them ended (exc.reads_ended)."""
        job.fence_error = (
            f"{self._role} rank {self._rank}: the live snapshot of step {job.step} under "
            f"{self._root} is still being read by a writer thread (its write did not end "
            "within checkpoint.timeout_s, and writer threads cannot be stopped): the state "
            f"must not be changed until it ends ({exc})"
        )
        job.reads_ended = exc.reads_ended

    def _fill_report(self, job: SaveJob, report: RankReport, outcomes: list) -> None:
        """The rank's files (rank 0's common.pt and model spec written now), the DCP write
        results, and rank 0's global metadata."""
        files = [written for _, written in outcomes]
        # Below the root by names no link redirects, as the bucket files (fsio.WriteOptions).
        beneath = str(self._root)
        if job.common is not None:
            common = serialize_common(job.common)
            files.append(write_common(common, job.directory, WriteOptions(beneath=beneath)))
        if job.model_spec_bytes is not None:
            files.append(write_model_spec(job.model_spec_bytes, job.directory, beneath))
        for results, _ in outcomes:
            report.write_results.extend(results)
        report.files = [FileEntry(f"{self._role}/{f.name}", f.size, f.checksum) for f in files]
        job.stats.fsync_s = max((f.fsync_s for f in files), default=0.0)
        if self._rank == 0:
            report.packed_global_metadata = job.prepared.global_metadata

    def _failed(self, job: SaveJob, what: str) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"{self._role} rank {self._rank} failed to save step {job.step} under "
            f"{self._root}: {what}"
        )

    # ---- waits ---------------------------------------------------------------------------

    def drain(self, deadline: float) -> None:
        """Wait until every save in flight ended (CommitTimeoutError at `deadline`)."""
        self._pending.drain(deadline)

    def drain_zero_copy(self, deadline: float) -> None:
        """Wait for the writes that read host tensors in place (offload-aware staging). A
        live snapshot's are the fence's (fence() returns once they ended): not waited for
        here, nor the report behind them."""
        self._pending.drain_where(
            lambda stats: stats.bytes_zero_copy > 0 and stats.snapshot != "live", deadline
        )

    def finished(self, deadline: float) -> list[SaveStats]:
        """Drain, raise a failure (once), and return the figures of the saves that ended."""
        self._pending.drain(deadline)
        self._pending.raise_pending()
        return self._pending.take_completed()

    def close(self, deadline: float) -> list[str]:
        """Stop the uploads (pending ones go on until `deadline`), then the save thread;
        returns what the save thread still ran at the deadline."""
        if self._uploads is not None:
            self._uploads.close(deadline)
        if self._thread is None:
            return []
        still_running = self._thread.close(time_left(deadline))
        # The saves queued behind one that outlasted the deadline will not run: cancelled
        # now (their callback reports them), so that their steps fail at once.
        for future in list(self._queued):
            future.cancel()
        return still_running


def _done_future() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future
