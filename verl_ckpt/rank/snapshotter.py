"""Step 2 (stage) on one rank (protocol/__init__.py): the staging pool, the copy of the live
tensors into it (now, in save(), or deferred, on the save thread), and the fence a deferred
copy opens for the trainer (I4: a save writes the state as it was at save()).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from verl_ckpt.commit.participant import new_save_id
from verl_ckpt.format.object_copy import snapshot_copy
from verl_ckpt.protocol import Phase, faults
from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.rank.save_job import Layout, SaveJob, SavePath, SaveStats
from verl_ckpt.rank.snapshot_plan import (
    SaveTimeMarks,
    SnapshotPlan,
    bind_buffers,
    check_copied_unchanged,
    hold_tensors,
    live_bytes,
    live_candidates,
    split_live,
)
from verl_ckpt.rank.staging import StagingPool, StagingSlot, copy_into
from verl_ckpt.rank.writers import Writer

__all__ = ["Snapshotter"]

# After a live save's deadline, how long its save thread may take to see the write end (or
# time out) and open the fence: the fence waits for that outcome rather than end first.
_LIVE_FENCE_SLACK_S = 5.0


class Snapshotter:
    """The staging pool of one rank (up to max_in_flight slots of reused host buffers) and
    the copies into it. `writer` is told of slots dropped from the pool."""

    def __init__(
        self, config: CheckpointConfig, writer: Writer, role: str, rank: int, root: Path
    ) -> None:
        self._config = config
        self._writer = writer
        self._role, self._rank = role, rank
        self._root = root
        self._timeout_s = float(config.timeout_s)
        self.pool = StagingPool(
            config.max_in_flight, config.staging.pin_memory, shared_memory=writer.shares_memory
        )
        # The last deferred save, until its snapshot is taken (fence()).
        self._unfenced: SaveJob | None = None

    def new_job(self, layout: Layout, path: SavePath) -> SaveJob:
        """What save() must read now: the buffers to copy into (a deferred save records
        only the version counters: which tensors to copy, and into which buffers, is chosen
        on the save thread before the copy) and rank 0's non-sharded state."""
        marks = None
        if path.deferred:
            # The instant of the snapshot (I4): the tensors it saves are those the items hold
            # now, whatever the trainer binds to their `.data` before the fence.
            hold_tensors(layout.tensors)
            marks = SaveTimeMarks.record(layout.tensors)
        copy = None if path.deferred else self.acquire(layout)
        try:
            # Rank 0 writes the non-sharded part, always, as megatron-core does (its load
            # requires common.pt even when it holds nothing): copied now, the snapshot, and
            # serialised by the write (torch.save of a small dict costs a deferred save()'s
            # training thread more than the copy).
            common = snapshot_copy(layout.common) if self._rank == 0 else None
        except BaseException:
            if copy is not None:
                self.pool.release(copy.slot)
            raise
        stats = SaveStats(
            step=layout.step,
            blocking_s=0.0,
            plan_s=layout.seconds,
            stage_s=0.0,
            plan_reused=layout.reuse_plan,
            bytes_staged=0,
            bytes_zero_copy=live_bytes(copy) if copy is not None else 0,
            snapshot=path.value if path.deferred else "now",
        )
        deadline = deadline_in(self._timeout_s)
        return SaveJob(layout, path, copy, new_save_id(), common, stats, deadline, marks)

    def acquire(
        self, layout: Layout, marks: SaveTimeMarks | None = None, live: bool = False
    ) -> SnapshotPlan:
        """Which tensors to copy (and into which reused buffers), which to write live.
        `marks` are those a deferred or live save() recorded; without them, this is save()
        now. `live`: a live snapshot, which writes every host tensor it can without a copy."""
        candidates = None
        # A writer process reads only shared memory: it cannot write live host tensors.
        if not self._writer.shares_memory:
            candidates = live_candidates(
                layout.tensors,
                layout.sharded.get("optimizer"),
                self._config.staging.offload_aware,
                live,
            )
        versions = marks.versions if marks is not None else None
        live_tensors, staged = split_live(layout.tensors, candidates, versions)
        sources = [item.data for item in staged]
        slot, dropped = self.pool.acquire([item.key for item in staged], sources)
        for old in dropped:
            self._writer.forget_slot(old)
        if marks is None:
            return SnapshotPlan(slot, staged, [t._version for t in sources], live_tensors)
        staged_versions = [marks.versions[id(item)] for item in staged]
        return SnapshotPlan(slot, staged, staged_versions, live_tensors, marks.ready)

    def release(self, slot: StagingSlot) -> None:
        self.pool.release(slot)

    def copy(self, job: SaveJob, sources: list[torch.Tensor] | None = None) -> None:
        """Step 2: copy `sources` (the live tensors; by default those the items still hold)
        into the staging slot; from then on the save references the copies, never the live
        tensors. A deferred copy checks that nothing changed them first."""
        started = time.perf_counter()
        copy = job.copy
        if sources is None:
            sources = [item.data for item in copy.items]
        job.stats.bytes_staged = copy_into(copy.slot, sources, copy.ready or None, job.copied)
        if job.path.deferred:
            check_copied_unchanged(copy, sources)
        if job.started is None:
            bind_buffers(copy)
        # else the save thread owns the items: they were pointed at the buffers before it
        # took the job, and its plan may be rebinding them meanwhile (where it converts,
        # megatron-core views each staged tensor with its prepended axes, then reads the
        # view back): a second binding from this thread could undo a view under way and
        # fail the plan.
        job.stats.stage_s = time.perf_counter() - started

    def take_deferred(self, job: SaveJob) -> None:
        """Step 2 of a deferred or live save, on the save thread: choose and acquire the
        buffers, then copy, judged against the version counters save() recorded (job.marks);
        then fence() returns (a failure is the caller's to raise). A live snapshot that
        writes tensors from the trainer's memory is taken only once they are written: the
        save thread opens the fence then (SaveRunner)."""
        taken = True
        try:
            faults.inject(Phase.STAGE, self._role, self._rank)
            job.copy = self.acquire(job.layout, job.marks, live=job.path.live)
            # Set before the fence opens: quiet() then waits for the live writes (I4).
            job.stats.bytes_zero_copy = live_bytes(job.copy)
            self.copy(job)
            taken = not (job.path.live and job.copy.live)
        finally:
            if taken:
                job.snapshot_taken.set()

    def give_back(self, job: SaveJob, buffers_free: bool) -> None:
        """Return the job's staging slot to the pool, or drop it for good where a writer or
        a copy that did not stop in time may still use its buffers."""
        slot = job.copy.slot
        if job.copied is not None and not job.copied.wait_settled(job.deadline):
            buffers_free = False
        if buffers_free:
            self.pool.release(slot)
        else:
            self.pool.forget(slot)
            self._writer.forget_slot(slot)

    # ---- the fence of a deferred or live snapshot ------------------------------------------

    def deferred(self, job: SaveJob) -> None:
        """`job`'s snapshot is taken on the save thread: fence() waits for it."""
        self._unfenced = job

    def fence(self, timeout_s: float | None = None) -> None:
        """Return once the last deferred snapshot is taken, or the last live one written
        and no writer thread reads it any more (CheckpointManager.fence)."""
        job = self._unfenced
        if job is None:
            return
        timeout = self._timeout_s if timeout_s is None else timeout_s
        if timeout_s is None and job.path.live:
            # A live snapshot is taken when its write ends, by the write's own deadline.
            timeout = max(timeout, time_left(job.deadline) + _LIVE_FENCE_SLACK_S)
        deadline = deadline_in(timeout)
        if not job.snapshot_taken.wait(timeout):
            what = "written" if job.path.live else "taken"
            raise CommitTimeoutError(
                f"{self._role} rank {self._rank}: the {job.path.value} snapshot of step "
                f"{job.step} under {self._root} was not {what} within {timeout:g}s (its save "
                f"thread is {job.stats.doing})"
            )
        # Shut at every call, not only the first, while a writer thread that outlasted the
        # write's deadline may still read the state: the trainer must not change it yet.
        if job.reads_ended is not None and not job.reads_ended.wait(time_left(deadline)):
            raise CommitTimeoutError(job.fence_error)
        self._unfenced = None

    def forget_unfenced(self) -> None:
        """The writes are drained: every snapshot was taken or failed."""
        self._unfenced = None
