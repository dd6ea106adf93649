"""One save on one rank, from step 1 to step 4 (protocol/__init__.py): which path it takes,
what the save group agreed, what it copied, and its figures (SaveStats).
"""

from __future__ import annotations

import enum
import functools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedTensor

from verl_ckpt.format import megatron_compat
from verl_ckpt.format.structure import Structure
from verl_ckpt.protocol.config import SNAPSHOT_MODES
from verl_ckpt.protocol.errors import CheckpointConfigError
from verl_ckpt.rank.agreement import Statement
from verl_ckpt.rank.copy_progress import CopyProgress
from verl_ckpt.rank.snapshot_plan import SaveTimeMarks, SnapshotPlan

__all__ = ["Layout", "SaveJob", "SavePath", "SaveStats", "chosen_snapshot"]


@dataclass
class SaveStats:
    """Figures of one save on one rank. The write_* fields are set once the write ended."""

    step: int
    blocking_s: float
    plan_s: float
    stage_s: float
    plan_reused: bool
    # Bytes copied into staging buffers, and bytes written from live host tensors without a
    # copy (offload-aware staging).
    bytes_staged: int
    bytes_zero_copy: int = 0
    # Whether the plan converted the staged state to DCP's state dict (megatron-core's
    # conversion); a reused plan finds its write items without it once a save learned
    # where they are (format/write_resolution.py). None until the plan ran.
    plan_converted: bool | None = None
    # "now"; "deferred": the copy (stage_s) ran in the background, after save() returned;
    # "live": as "deferred", but the host tensors were written from the trainer's memory
    # without a copy (bytes_zero_copy), the fence waiting for those writes.
    snapshot: str = "now"
    # The wait, on the save thread, for the save group's agreement (ranks that went ahead
    # on a cached plan): the peers' arrival, which save() itself no longer waits for.
    agree_s: float | None = None
    # The finalizer's begin_step round trip (it waits while max_in_flight steps are
    # uncommitted, retention included); on the save thread when the plan is reused.
    begin_s: float | None = None
    write_s: float | None = None
    # Of write_s: the fsyncs of this rank's files, and the report's round trip.
    fsync_s: float | None = None
    # Of write_s: the part before save()'s copy ended. A save whose plan is reused is taken
    # over by the save thread before the copy: having planned beside it, the write waits
    # for its end (or, with writer.write_while_copying, writes beside it).
    write_before_copy_end_s: float | None = None
    report_s: float | None = None
    bytes_written: int | None = None
    files_written: int | None = None
    # Set when the write failed (the error is also raised once by the next save()/wait()).
    error: str | None = None
    # What the save's background part is doing, for an error that finds it still running
    # (PendingWrites): one of the DOING_* texts below. Not a fault Phase: those name where a
    # failure happened; this names where a save that has not ended is.
    doing: str = "waiting for the save thread"


# SaveStats.doing, as the save thread moves on; each reads after "still running (...)".
DOING_DEFERRED_COPY = "copying its deferred snapshot"
DOING_AGREEMENT = "waiting for its save group's agreement"
DOING_BEGIN = "waiting for the finalizer's answer to begin_step"
DOING_PLAN = "planning"
DOING_WRITE = "writing its files"
DOING_REPORT = "waiting for the finalizer to take its report"
DOING_DONE = "done"


class SavePath(enum.Enum):
    """Which thread runs which part of one save; chosen once, in save(), after step 1's
    agreement (it depends on whether the cached plan is reused).

    INLINE       no save thread (writer.mode inline, or async_save off): steps 1-4 in save().
    PLAN_NOW     begin_step, copy and plan in save() (the plan's collectives need the
                 training thread); write and report on the save thread.
    CACHED_PLAN  the copy in save(); the agreement's check, begin_step and the plan on the
                 save thread beside it (no collective left), then write and report.
    DEFERRED     save() only records version counters; the copy, then all of the above, on
                 the save thread; the trainer calls fence() before it changes the state.
    LIVE         as DEFERRED, but the host tensors are written from the trainer's own memory
                 instead of copied (device tensors are copied): fence() waits for their writes.
    """

    INLINE = "inline"
    PLAN_NOW = "plan now"
    CACHED_PLAN = "cached plan"
    DEFERRED = "deferred"
    LIVE = "live"

    @classmethod
    def choose(cls, save_thread: bool, plan_reused: bool, snapshot: str) -> SavePath:
        # A deferred or live snapshot needs a cached plan: the first save, and a save after
        # a structure change, copy now, their planning needing the group.
        if not save_thread:
            return cls.INLINE
        if not plan_reused:
            return cls.PLAN_NOW
        return {"deferred": cls.DEFERRED, "live": cls.LIVE}.get(snapshot, cls.CACHED_PLAN)

    @property
    def plans_in_background(self) -> bool:
        """begin_step and the plan run on the save thread (no collective is left)."""
        return self in (SavePath.CACHED_PLAN, SavePath.DEFERRED, SavePath.LIVE)

    @property
    def deferred(self) -> bool:
        """save() returns before the snapshot is taken: fence() waits for it."""
        return self in (SavePath.DEFERRED, SavePath.LIVE)

    @property
    def live(self) -> bool:
        return self is SavePath.LIVE


def chosen_snapshot(configured: str, snapshot: str | None, save_thread: bool) -> str:
    """The snapshot mode save(snapshot=...) asks for (default: checkpoint.snapshot); a
    deferred or live one needs a save thread to take it on."""
    mode = configured if snapshot is None else snapshot
    if mode not in SNAPSHOT_MODES:
        raise CheckpointConfigError(
            f"save(snapshot={mode!r}): choose one of {', '.join(map(repr, SNAPSHOT_MODES))}"
        )
    if mode != "now" and not save_thread:
        raise CheckpointConfigError(
            f"save(snapshot={mode!r}) needs a background writer "
            "(checkpoint.async_save=true, writer.mode thread or process)"
        )
    return mode


@dataclass
class Layout:
    """Step 1 on the training thread: what the save group agreed (every collective of a
    save happens here, so that nothing after it may not run on another thread)."""

    step: int
    sharded: dict
    common: dict
    items: list
    structure: Structure
    reuse_plan: bool
    distribution: Any
    seconds: float
    # Set when this rank goes ahead on its cached plan: its statement, issued by save() once
    # the job is composed (StepPlanner.state_went_ahead), then the save group's statements,
    # which the save thread checks before begin_step (rank/agreement.py).
    statement: Statement | None = None
    agreement: Future | None = None

    @functools.cached_property
    def tensors(self) -> list[ShardedTensor]:
        # Read in save() (a deferred save's version counters) and again on the save thread
        # (choosing the buffers): computed once.
        return [item for item in self.items if isinstance(item, ShardedTensor)]


@dataclass
class SaveJob:
    """One save from step 1 to step 4; the save thread takes it over from save()."""

    layout: Layout
    path: SavePath
    copy: SnapshotPlan | None  # None until a deferred snapshot acquires it (save thread)
    save_id: str
    # Rank 0 only: the non-sharded state (common.pt), as copied inside save() (I4).
    common: dict | None
    stats: SaveStats
    deadline: float
    marks: SaveTimeMarks | None = None  # a deferred snapshot's, recorded in save()
    # A save whose plan is reused: the save thread's run of the job, submitted before
    # save() copies, and the copy's progress that its plan and writes wait on.
    started: Future | None = None
    copied: CopyProgress | None = None
    directory: Path | None = None
    prepared: megatron_compat.PreparedSave | None = None
    # Rank 0 only: the model description the Hugging Face export reads (hf/model_spec.py).
    model_spec_bytes: bytes | None = None
    # Set once the snapshot is taken (for a deferred one, on the save thread; for a live one,
    # once its writes ended): fence() waits.
    snapshot_taken: threading.Event = field(default_factory=threading.Event)
    # A live write that outlasted its deadline while writer threads still ran: they cannot
    # be stopped and may still read the trainer's tensors, so fence() raises `fence_error`
    # until `reads_ended` is set (by the last of those threads to end), then opens.
    fence_error: str | None = None
    reads_ended: threading.Event | None = None

    @property
    def step(self) -> int:
        return self.layout.step
