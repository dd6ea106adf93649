"""CheckpointManager: the per-rank half of verl_ckpt, living inside each Megatron worker.

`save()` runs protocol steps 1 (plan) and 2 (stage) in the training thread and returns;
steps 3 (write) and 4 (report) run on the rank's save thread (protocol.py). A save whose
plan is cached leaves only the copy to the training thread: the group's agreement (issued,
not awaited), begin_step and the plan follow on the save thread. With
`snapshot="deferred"`, the copy moves to the save thread as well, and the trainer calls
`fence()` before it next changes the state.
Completion is never polled with collectives (I6): the finalizer learns it from the report.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from verl_ckpt.commit.client import call_finalizer, check_shared_root, get_finalizer
from verl_ckpt.format import megatron_compat
from verl_ckpt.format.file_writer import serialize_common, write_common
from verl_ckpt.format.load_stats import LoadStats, PhaseClock
from verl_ckpt.format.object_copy import snapshot_copy
from verl_ckpt.format.structure import Structure, describe_structure
from verl_ckpt.hf.model_spec import encode_model_spec, exports_role, write_model_spec
from verl_ckpt.protocol import RPC_SLACK_S, Failure, Phase, faults
from verl_ckpt.protocol.config import CheckpointConfig, to_checkpoint_config
from verl_ckpt.protocol.deadlines import call_deadline, deadline_in, time_left
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointWriteError,
    CommitRecordError,
    CommitTimeoutError,
    StepNotCommittedError,
)
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.rank.agreement import (
    SaveAgreement,
    Statement,
    check_went_ahead,
    plan_reusable,
)
from verl_ckpt.rank.copy_progress import CopyFailed, CopyProgress, write_order
from verl_ckpt.rank.inflight import InFlightSaves
from verl_ckpt.rank.snapshot_plan import (
    SaveTimeMarks,
    SnapshotPlan,
    bind_buffers,
    check_copied_unchanged,
    check_live_unchanged,
    freeze_objects,
    live_bytes,
    split_live,
)
from verl_ckpt.rank.staging import StagingPool, copy_into
from verl_ckpt.rank.writers import WriteTimeout, make_writer
from verl_ckpt.startup.resume_fit import EXTRA_STATE_KEY, extra_reshard_error, missing_role_error
from verl_ckpt.store.commit_record import FileEntry, read_commit_record
from verl_ckpt.store.layout import role_name_problem, step_dir
from verl_ckpt.store.verification import verify_files

__all__ = ["CheckpointManager", "SaveStats"]

logger = logging.getLogger(__name__)

# The "step" every rank agrees on in prepare(): no step directory is involved.
_PREPARE = -1
# How long a failed open waits for each part it started to stop: idle threads stop at once;
# an agreement group still forming cannot be interrupted and stops at its own deadline.
_FAILED_OPEN_CLOSE_S = 1.0


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
    # "now", or "deferred": the copy (stage_s) ran in the background, after save() returned.
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


@dataclass
class _Layout:
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
    # the job is composed (_state_went_ahead), then the save group's statements, which the
    # save thread checks before begin_step (group_agreement).
    statement: Statement | None = None
    agreement: Future | None = None

    @functools.cached_property
    def tensors(self) -> list[ShardedTensor]:
        # Read in save() (a deferred save's version counters) and again on the save thread
        # (choosing the buffers): computed once.
        return [item for item in self.items if isinstance(item, ShardedTensor)]


@dataclass
class _SaveJob:
    """One save from step 1 to step 4; the save thread takes it over from save()."""

    layout: _Layout
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
    # Set once the snapshot is taken (for a deferred one, on the save thread): fence() waits.
    snapshot_taken: threading.Event = field(default_factory=threading.Event)

    @property
    def step(self) -> int:
        return self.layout.step


class CheckpointManager:
    """Saves and loads one rank's megatron-core sharded state for one role.

    `process_group` must hold exactly the ranks of this role that save (None: the default
    group); planning collectives run on it only, and ranks outside it never take part.
    """

    def __init__(
        self,
        config: CheckpointConfig | Any,
        role: str,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = to_checkpoint_config(config)
        problem = role_name_problem(role)
        if problem:
            raise CheckpointConfigError(problem)
        if not dist.is_initialized():
            raise CheckpointError(
                "torch.distributed is not initialised: CheckpointManager plans saves on the "
                f"process group of role {role!r}"
            )
        if dist.get_world_size(process_group) != world_size or (
            dist.get_rank(process_group) != rank
        ):
            raise CheckpointError(
                f"{role} rank {rank}/{world_size} disagrees with its process group "
                f"(rank {dist.get_rank(process_group)}/{dist.get_world_size(process_group)})"
            )
        self.role, self.rank, self.world_size = role, rank, world_size
        self._group = process_group
        self._root = Path(self.config.root_dir).resolve()
        self._timeout_s = float(self.config.timeout_s)
        self._who = f"{role} rank {rank} of {self._root}"
        # The root as a number the save group can compare in one integer all-gather.
        self._root_id = int.from_bytes(hashlib.sha256(str(self._root).encode()).digest()[:7])
        self._finalizer = get_finalizer(self._root, self._timeout_s)
        check_shared_root(self._root, self._finalizer, self._timeout_s, f"{role} rank {rank}")
        # An open that fails part way stops what it started (threads, the agreement's group
        # forming), as close() would: a trainer that catches the error and opens again must
        # not pile them up. Once every part is made, close() owns them.
        with contextlib.ExitStack() as started:
            # Step 1's agreement, on a private group and thread (a collective of the save
            # group: every rank of the role opens its manager at the same time). Made first:
            # when it cannot be made (the world's store is gone), nothing else was started.
            self._agreement = SaveAgreement(
                process_group, world_size, role, rank, str(self._root), self._timeout_s
            )
            started.callback(_stop_quietly, self._agreement.close)
            writer = self.config.writer
            mode = writer.mode if self.config.async_save else "inline"
            self._writer = make_writer(
                mode, writer.threads, f"verl_ckpt_{role}{rank}", writer.nice, writer.writeback_every
            )
            started.callback(_stop_quietly, self._writer.close)
            self._pool = StagingPool(
                self.config.max_in_flight,
                self.config.staging.pin_memory,
                shared_memory=self._writer.shares_memory,
            )
            self._plan_cache: megatron_compat.SavePlanCache | None = None
            self._in_flight = InFlightSaves(
                self.config.max_in_flight, f"{role} rank {rank}", self._timeout_s
            )
            self._unfenced: _SaveJob | None = None
            # Where the last load()'s time went on this rank (None before the first load).
            self.last_load: LoadStats | None = None
            # Steps 3-4 (and a deferred step 2) run on one background thread per rank, which
            # hands files to the writer; inline mode runs them inside save().
            self._save_thread = (
                DaemonPool(1, f"verl_ckpt_{role}{rank}_save", writer.nice)
                if mode != "inline"
                else None
            )
            if self._save_thread is not None:
                started.callback(_stop_quietly, self._save_thread.close)
            # Step 8: this rank uploads its own files to the remote tier, if there is one.
            self._uploads = self._make_uploader()
            started.pop_all()
        self._closed = False  # set last: __del__ of a manager whose open failed does nothing

    # ---- public API ----------------------------------------------------------------------

    def prepare(
        self, model: dict | None = None, optimizer: dict | None = None, extra: Any = None
    ) -> None:
        """Do at set-up what would make the first save slow: agree on and validate the
        structure, build and cache the save plan, allocate and touch the staging buffers,
        start the writer process. Takes the same arguments as save(), and every rank of the
        save group calls it (it runs the planning collectives). Optional: a save without it
        does the same work itself."""
        self._check_open()
        layout = self._layout(_PREPARE, self._compose(model, optimizer, extra), go_ahead=False)
        copy = self._acquire_copy(layout)
        try:
            deadline = deadline_in(self._timeout_s)
            self._writer.warm_up(copy.slot, deadline)
            if self._save_thread is not None:
                # The save thread's first call to the finalizer costs a few hundred ms (Ray
                # sets the thread up, classes are pickled the first time): pay it now.
                warm = self._save_thread.submit(self._call_finalizer, "describe", label="warm up")
                warm.result(timeout=time_left(deadline))
            # The plan depends on the structure only: planned over the live tensors, nothing
            # is written, and the first save reuses it. DCP's planning makes the directory
            # it plans for: a scratch one, not a stray entry in the checkpoint root.
            with tempfile.TemporaryDirectory(prefix="verl_ckpt_plan_") as scratch:
                prepared = megatron_compat.plan_save(
                    layout.sharded,
                    Path(scratch) / "plan",
                    self._group,
                    self.config.writer.threads,
                    layout.structure,
                    self._plan_cache if layout.reuse_plan else None,
                    layout.distribution,
                )
            if self.config.assume_constant_structure:
                self._plan_cache = prepared.plan_cache
        finally:
            self._pool.release(copy.slot)

    def save(
        self,
        step: int,
        model: dict | None = None,
        optimizer: dict | None = None,
        extra: Any = None,
        snapshot: str | None = None,
        model_spec: dict | None = None,
    ) -> SaveStats:
        """Snapshot this rank's state for `step`; the write continues in the background.

        `model` and `optimizer` are megatron-core sharded state dicts (`sharded_state_dict()`
        of the model chunks and of the optimizer), built for this save and consumed by it;
        `extra` is any small picklable object (RNG states, counters) saved per rank.
        `model_spec` describes the model's architecture (`verl_ckpt.describe_gpt_model`):
        rank 0 writes it with the step, so that its Hugging Face weights can be exported from
        any committed step; required when the role exports hf_model.
        Every rank of the save group must call save() for the same step.

        `snapshot` (default checkpoint.snapshot): "now" returns once the state is copied;
        "deferred" returns before the copy, and the trainer must call `fence()` before it next
        changes the state (a change before the fence fails this save, loudly). The first
        save, and a save after a structure change, copy now: their planning needs the group.
        """
        self._check_open()
        started = time.perf_counter()
        layout = None
        statements_before = self._agreement.statements_made
        try:
            deferred = self._snapshot_mode(snapshot) == "deferred"
            spec_bytes = self._model_spec_bytes(model_spec)
            self.fence()  # the previous save's snapshot must be complete
            # Back-pressure: at most max_in_flight writes; an earlier failure is raised here,
            # once, instead of saving this step.
            self._in_flight.wait_for_room()
            if self._uploads is not None:
                self._uploads.wait_for_room()  # at most remote.max_in_flight uploads pending
            layout = self._layout(step, self._compose(model, optimizer, extra))  # step 1: agree
            deferred = deferred and layout.reuse_plan
            # A save whose plan is reused needs no collective after the agreement: begin_step
            # (which may wait for an earlier step's commit and retention: back-pressure) and
            # the plan then run on the save thread, so that the trainer waits for the copy
            # alone. A save that plans over the group does it all here, as collectives must.
            background = layout.reuse_plan and self._save_thread is not None
            if background:
                freeze_objects(layout.items)  # their bytes are made when the plan runs, later
            if deferred:
                # Which tensors to copy, and into which buffers, is chosen on the save thread
                # before the copy: save() reads only what must be read now.
                marks = SaveTimeMarks.record(layout.tensors)
                job = self._new_job(layout, None, marks)
            else:
                job = self._new_job(layout, self._acquire_copy(layout))
            self._state_went_ahead(layout)
        except Exception as exc:
            # The other participants save this step: tell the finalizer now that this rank
            # will not, or the step would wait for this report until its deadline. Told
            # first, so that the step has failed before a peer, freed by the statement
            # below, could begin it.
            self._report_failure(step, uuid.uuid4().hex, Phase.PLAN, exc)
            if self._agreement.statements_made == statements_before:
                # Whether it failed before its layout (raising an earlier failure, say) or
                # after it, before its statement went out.
                self._withdraw(step)
            raise
        job.stats.snapshot = "deferred" if deferred else "now"
        job.model_spec_bytes = spec_bytes
        if not deferred:
            try:
                sources = [item.data for item in job.copy.items]
                if not background:
                    self._begin(job)
                else:
                    # The save thread takes the job over now, not after the copy: it waits
                    # for the agreement, calls begin_step (a round trip to the finalizer)
                    # and plans while this thread copies; it writes once the copy ended
                    # (with writer.write_while_copying, each tensor once its own copy
                    # ended: copy_progress.py). The plan reads which tensors there are,
                    # never their values, so the state points at the buffers first.
                    bind_buffers(job.copy)
                    job.copied = CopyProgress(job.copy.slot.buffers)
                    job.started = self._save_thread.submit(
                        self._in_background, job, False, True, label=f"save of step {step}"
                    )
                faults.inject(Phase.STAGE, self.role, self.rank)
                self._copy(job, sources)  # step 2: from here on the live tensors are free
                if not background:
                    self._plan(job)
            except BaseException as exc:
                if job.copied is not None:
                    job.copied.failed(exc)  # whoever waits for the copy stops waiting
                # Once the save thread owns the job, its write fails on this, and it frees
                # the slot and reports the failure to the finalizer.
                if job.started is None:
                    if isinstance(exc, Exception):
                        self._abandon(job, Phase.STAGE, exc)
                else:
                    # Until then it holds the staging slot: in flight like any save (the next
                    # save() waits for it, as wait() and close() do), its failure raised here.
                    self._in_flight.add(job.step, job.deadline, job.started, job.stats, raised=True)
                raise
        self._launch(job, deferred, background)  # steps 3-4, and what 1-2 left, in the back
        job.stats.blocking_s = time.perf_counter() - started
        return job.stats

    def fence(self, timeout_s: float | None = None) -> None:
        """Return once the snapshot of every save so far is taken: from then on the trainer
        may change the state. Needed only after a deferred save; save(), load() and close()
        call it first. Raises CommitTimeoutError at the deadline (checkpoint.timeout_s)."""
        job = self._unfenced
        if job is None:
            return
        timeout = self._timeout_s if timeout_s is None else timeout_s
        if not job.snapshot_taken.wait(timeout):
            raise CommitTimeoutError(
                f"{self.role} rank {self.rank}: the deferred snapshot of step {job.step} under "
                f"{self._root} was not taken within {timeout:g}s"
            )
        self._unfenced = None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Around a change of the state (an optimizer step): fence(), wait for the writes
        that read host tensors in place (offload-aware staging), and hold the other
        background writes back meanwhile (within one 8 MiB slice), so that the update has the
        cores and the memory bandwidth to itself; they go on when the block ends (a pause
        never lasts longer than fsio.MAX_PAUSE_S). The write's own deadline still counts."""
        self._before_change()
        try:
            yield
        finally:
            self._writer.resume()

    def _before_change(self) -> None:
        """The state is about to change: every snapshot must be taken (fence), and no write
        may still read a host tensor in place. Offload-aware staging writes such tensors
        without a copy; version counters catch a change made through them, but not one made
        through `.data`, a numpy view or a C++ kernel on their memory, which would change the
        file silently (I4). Then writes pause (the caller resumes them)."""
        self.fence()
        deadline = deadline_in(self._timeout_s)
        self._in_flight.drain_where(lambda stats: stats.bytes_zero_copy > 0, deadline)
        self._writer.pause()

    def fence_before(self, optimizer: Any) -> Any:
        """Run every `optimizer.step()` inside quiet(): it fences first (a deferred snapshot
        is complete before the update changes the state) and background writes pause while
        the step runs. Takes a torch optimizer (or an object wrapping one as `.optimizer`,
        as megatron-core's do); returns a handle whose `.remove()` undoes it."""
        target = optimizer
        while not hasattr(target, "register_step_pre_hook") and hasattr(target, "optimizer"):
            target = target.optimizer
        if not hasattr(target, "register_step_pre_hook"):
            raise TypeError(
                f"fence_before needs a torch.optim.Optimizer (or a wrapper of one), got "
                f"{type(optimizer).__name__}"
            )

        def before(*_: Any) -> None:
            self._before_change()

        def after(*_: Any) -> None:
            self._writer.resume()

        return _Hooks(target.register_step_pre_hook(before), target.register_step_post_hook(after))

    def wait(self, timeout_s: float | None = None) -> list[SaveStats]:
        """Block until this rank's writes finished (not the commit); return their figures.

        Raises CheckpointWriteError for a failed write (once), CommitTimeoutError naming the
        steps still being written when the deadline passes.
        """
        deadline = deadline_in(self._timeout_s if timeout_s is None else timeout_s)
        self._in_flight.drain(deadline)
        self._in_flight.raise_pending()
        return self._in_flight.take_completed()

    def load(
        self,
        step_path: str | Path | int,
        model: dict | None = None,
        optimizer: dict | None = None,
        extra: bool = True,
    ) -> dict[str, Any]:
        """Load this rank's part of a committed step into the given sharded templates.

        `step_path` is a step number under the root or a `global_step_<N>` directory. Only the
        contents in `load_contents` (and given here) are loaded. The commit record, and the
        checksums with `verify_checksums_on_load`, are checked before any state is read.
        Returns a dict with keys among "model", "optimizer", "extra"; where the time went is
        then in `last_load` (LoadStats).
        """
        clock = PhaseClock()
        # Loading changes the state: a deferred snapshot must be taken, and no write may still
        # read it in place (offload-aware staging; the direct reader fills tensors without
        # bumping their version counters). Failures of those writes are raised as always.
        self.fence()
        self._in_flight.drain(time.monotonic() + self._timeout_s)
        path = step_dir(self._root, step_path) if isinstance(step_path, int) else Path(step_path)
        record = read_commit_record(path)
        saved_world = record.role_world_size(self.role)
        if saved_world is None:
            raise missing_role_error(path, self.role, record)
        wanted = self.config.load_contents
        template: dict[str, Any] = {}
        if "model" in wanted and model is not None:
            template["model"] = model
        if "optimizer" in wanted and optimizer is not None:
            template["optimizer"] = optimizer
        if "extra" in wanted and extra:
            if saved_world != self.world_size:
                raise extra_reshard_error(path, self.role, saved_world, self.world_size)
            template["extra"] = self._extra_sharded(None)
        if self.config.verify_checksums_on_load:
            problems = verify_files(path, record, prefix=f"{self.role}/")
            if problems:
                raise CommitRecordError(f"{path} failed verification: " + "; ".join(problems))
        clock.mark("checks (fence, commit record, checksums)")
        loaded, read_in_place = megatron_compat.load_role_dir(template, path / self.role, clock)
        self.last_load = LoadStats.from_clock(str(path), clock, read_in_place)
        # megatron-core merges common.pt back in, which may hold non-sharded parts of contents
        # that were not asked for (an optimizer's param_groups): return only what was.
        return {key: value for key, value in loaded.items() if key in template}

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the writes in flight and stop every helper thread and process, all within
        one deadline (`timeout_s`, default checkpoint.timeout_s). Raises CommitTimeoutError
        naming what did not stop; the manager is closed either way."""
        if self._closed:
            return
        deadline = deadline_in(self._timeout_s if timeout_s is None else timeout_s)
        self._closed = True
        try:
            self._in_flight.drain(deadline)
            self._in_flight.raise_pending()
        finally:
            self._unfenced = None  # drained: every snapshot was taken or failed
            try:
                if self._uploads is not None:
                    self._uploads.close(deadline)
                if self._save_thread is not None:
                    self._save_thread.close(time_left(deadline))
                self._agreement.close(time_left(deadline))
                self._writer.close(time_left(deadline))
            finally:
                self._pool.clear()

    @property
    def writer_pid(self) -> int | None:
        """The pid of this rank's writer process (writer.mode=process), while it runs."""
        return self._writer.pid

    @property
    def staged_bytes(self) -> int:
        """Host memory held by the staging pool."""
        return self._pool.nbytes

    # ---- step 1: plan (the collectives) --------------------------------------------------

    def _layout(self, step: int, state: dict, go_ahead: bool = True) -> _Layout:
        started = time.perf_counter()
        sharded, common, items = megatron_compat.split_common_state(state)
        structure = describe_structure(items)
        # Agreement comes before begin_step: ranks that disagree on the step or the root fail
        # together before any directory or file exists.
        reuse, statement = self._agree_with_group(step, structure, go_ahead)
        cache = self._plan_cache if reuse else None
        distribution = None
        if self.config.fully_parallel_save:
            distribution = megatron_compat.spread_main_replicas(
                sharded, self._group, cache.replica_distribution if cache else None
            )
        if not reuse:
            megatron_compat.validate_sharding(items, self._group)
        seconds = time.perf_counter() - started
        return _Layout(
            step, sharded, common, items, structure, reuse, distribution, seconds, statement
        )

    def _agree_with_group(
        self, step: int, structure: Structure, go_ahead: bool
    ) -> tuple[bool, Statement | None]:
        """State the step, the root and whether the cached plan fits (group_agreement).
        Returns whether the plan is reused, and, if this rank goes ahead on its cached plan,
        the statement it will make (_state_went_ahead; only the save thread waits for the
        others). A rank that plans over the group makes it now and waits for the outcome."""
        cached = self._plan_cache is not None and self._plan_cache.structure == structure
        ahead = go_ahead and cached and self._save_thread is not None
        statement = Statement(step, self._root_id, cached, ahead)
        if ahead:
            return True, statement
        statements = self._agreement.outcome(self._agreement.start(statement))
        return self.config.assume_constant_structure and plan_reusable(statements, self.role), None

    def _state_went_ahead(self, layout: _Layout) -> None:
        """Make the statement of a rank that went ahead, once (group_agreement). Made last in
        save(), when the job is composed: the agreement thread's collective then runs while
        the save returns (and the deferred copy, or the copy, runs), instead of taking the
        interpreter from the training thread in the middle of save()."""
        if layout.statement is not None and layout.agreement is None:
            layout.agreement = self._agreement.start(layout.statement)

    def _withdraw(self, step: int) -> None:
        """save(step) failed on this rank before it stated anything: state that it does not
        save the step (group_agreement). Its peers that went ahead wait for a statement in a
        collective; never made, this rank's next statement would pair with theirs for this
        step, and every later step of the role would fail."""
        self._agreement.start(Statement(step, self._root_id, False, False, withdrawn=True))

    # ---- step 2: stage -------------------------------------------------------------------

    def _acquire_copy(self, layout: _Layout, marks: SaveTimeMarks | None = None) -> SnapshotPlan:
        """Which tensors to copy (and into which reused buffers), which to write live.
        `marks` are those a deferred save() recorded; without them, this is save() now."""
        # A writer process reads only shared memory: it cannot write live host tensors.
        offload_aware = self.config.staging.offload_aware and not self._writer.shares_memory
        versions = marks.versions if marks is not None else None
        live, staged = split_live(
            layout.tensors, layout.sharded.get("optimizer"), offload_aware, versions
        )
        sources = [item.data for item in staged]
        slot, dropped = self._pool.acquire([item.key for item in staged], sources)
        for old in dropped:
            self._writer.forget_slot(old)
        if marks is None:
            return SnapshotPlan(slot, staged, [t._version for t in sources], live)
        staged_versions = [marks.versions[id(item)] for item in staged]
        return SnapshotPlan(slot, staged, staged_versions, live, marks.ready)

    def _begin(self, job: _SaveJob) -> None:
        """Step 1's begin_step on the finalizer: the step's directory for this rank."""
        started = time.perf_counter()
        job.directory = Path(
            self._call_finalizer(
                "begin_step",
                job.step,
                self.role,
                self.rank,
                self.world_size,
                self._timeout_s,
                job.save_id,
            )
        )
        job.stats.begin_s = time.perf_counter() - started

    def _copy(self, job: _SaveJob, sources: list[torch.Tensor] | None = None) -> None:
        """Step 2: copy `sources` (the live tensors; by default those the items still hold)
        into the staging slot; from then on the save references the copies, never the live
        tensors. A deferred copy checks that nothing changed them first."""
        started = time.perf_counter()
        copy = job.copy
        if sources is None:
            sources = [item.data for item in copy.items]
        job.stats.bytes_staged = copy_into(copy.slot, sources, copy.ready or None, job.copied)
        if job.stats.snapshot == "deferred":
            check_copied_unchanged(copy, sources)
        if job.started is None:
            bind_buffers(copy)
        # else the save thread owns the items: they were pointed at the buffers before it
        # took the job, and its plan is rebinding them meanwhile (megatron-core's conversion
        # views each staged tensor with its prepended axes, then reads the view back): a
        # second binding from this thread could undo a view under way and fail the plan.
        job.stats.stage_s = time.perf_counter() - started

    def _plan(self, job: _SaveJob) -> None:
        """Step 1's plan over the copies, into the step's directory: gathered over the group
        (training thread only) unless the cached plan is reused (no collective)."""
        started = time.perf_counter()
        job.prepared = megatron_compat.plan_save(
            job.layout.sharded,
            job.directory,
            self._group,
            self.config.writer.threads,
            job.layout.structure,
            self._plan_cache if job.layout.reuse_plan else None,
            job.layout.distribution,
        )
        if self.config.assume_constant_structure:
            self._plan_cache = job.prepared.plan_cache
        if self.config.writer.write_while_copying:
            # The next save's copy fills the buffers in the order these writes read them
            # (only an order: without writes beside the copy it makes no difference).
            slot = job.copy.slot
            slot.write_order = write_order(job.prepared.write_buckets, slot.buffers)
        job.stats.plan_s = job.layout.seconds + (time.perf_counter() - started)

    # ---- steps 3-4: write and report (background) ----------------------------------------

    def _new_job(
        self, layout: _Layout, copy: SnapshotPlan | None, marks: SaveTimeMarks | None = None
    ) -> _SaveJob:
        try:
            # Rank 0 writes the non-sharded part, always, as megatron-core does (its load
            # requires common.pt even when it holds nothing): copied now, the snapshot, and
            # serialised by the write (torch.save of a small dict costs a deferred save()'s
            # training thread more than the copy).
            common = snapshot_copy(layout.common) if self.rank == 0 else None
        except BaseException:
            if copy is not None:
                self._pool.release(copy.slot)
            raise
        stats = SaveStats(
            step=layout.step,
            blocking_s=0.0,
            plan_s=layout.seconds,
            stage_s=0.0,
            plan_reused=layout.reuse_plan,
            bytes_staged=0,
            bytes_zero_copy=live_bytes(copy) if copy is not None else 0,
        )
        deadline = deadline_in(self._timeout_s)
        return _SaveJob(layout, copy, uuid.uuid4().hex, common, stats, deadline, marks)

    def _launch(self, job: _SaveJob, deferred: bool, background: bool) -> None:
        if self._save_thread is None:
            self._write_and_report(job)
            self._in_flight.add(job.step, job.deadline, _done_future(), job.stats)
            self._in_flight.collect()
            return
        future = job.started
        if future is None:
            label = f"save of step {job.step}"
            future = self._save_thread.submit(
                self._in_background, job, deferred, background, label=label
            )
        self._in_flight.add(job.step, job.deadline, future, job.stats)
        if deferred:
            self._unfenced = job

    def _in_background(self, job: _SaveJob, deferred: bool, background: bool) -> None:
        """On the save thread: a deferred copy (then fence() returns); for a save whose plan
        is reused, the agreement, begin_step and the plan (while save() copies, if save()
        handed the job over before its copy: job.copied); then steps 3-4."""
        phase = Phase.STAGE
        try:
            if deferred:
                try:
                    self._take_deferred_snapshot(job)
                finally:
                    job.snapshot_taken.set()  # fence() returns; a failure is raised below
            if background:
                phase = Phase.PLAN
                self._agree_and_begin(job)
                self._plan(job)
                live = [entry.tensor for entry in job.copy.live]
                if job.copied is not None and not job.copied.covers(
                    job.prepared.write_buckets, live
                ):
                    # The plan made a tensor of its own (a clone of a view) from a buffer
                    # the copy may not have filled yet: plan again once it has.
                    phase = Phase.STAGE
                    job.copied.wait_all(job.deadline)
                    phase = Phase.PLAN
                    self._plan(job)
        except StepNotCommittedError as exc:
            # A peer withdrew at the agreement, or begin_step refused (the finalizer's only
            # StepNotCommittedError here): the step had already failed, another
            # participant's failure having reached the finalizer first, and nothing was
            # written. Not this rank's failure: raised at its next save(), it would fail the
            # next step for everyone.
            self._abandon(job, phase, exc)
            job.stats.error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: not saving step %d: %s", self._who, job.step, exc)
            return
        except Exception as exc:
            self._abandon(job, phase, exc)
            job.stats.error = f"{type(exc).__name__}: {exc}"
            raise CheckpointWriteError(
                f"{self.role} rank {self.rank} failed to save step {job.step} under "
                f"{self._root}: {type(exc).__name__}: {exc}"
            ) from exc
        self._write_and_report(job)

    def _agree_and_begin(self, job: _SaveJob) -> None:
        """On the save thread: every rank's statement fits (the rank went ahead on its cached
        plan), and only then begin_step: ranks that disagree fail before any directory
        exists."""
        if job.layout.agreement is not None:
            waited = time.perf_counter()
            check_went_ahead(self._agreement.outcome(job.layout.agreement), self.role)
            job.stats.agree_s = time.perf_counter() - waited
        self._begin(job)

    def _take_deferred_snapshot(self, job: _SaveJob) -> None:
        """Step 2 of a deferred save, on the save thread: choose and acquire the buffers,
        then copy, judged against the version counters save() recorded (job.marks)."""
        faults.inject(Phase.STAGE, self.role, self.rank)
        job.copy = self._acquire_copy(job.layout, job.marks)
        # Set before the fence opens: quiet() then waits for the live writes (I4).
        job.stats.bytes_zero_copy = live_bytes(job.copy)
        self._copy(job)

    def _abandon(self, job: _SaveJob, phase: Phase, exc: BaseException) -> None:
        """Steps 1-2 failed after the staging slot was taken: free it, and tell the
        finalizer, so that the step fails now rather than at the deadline."""
        if job.copy is not None:  # a deferred snapshot acquires its slot on the save thread
            self._give_back_slot(job, True)
        # Reported even before begin_step (a copy that failed first): the step then fails
        # for every rank now, instead of at the deadline.
        self._report_failure(job.step, job.save_id, phase, exc)

    def _give_back_slot(self, job: _SaveJob, buffers_free: bool) -> None:
        """Return the job's staging slot to the pool, or drop it for good where a writer or
        a copy that did not stop in time may still use its buffers."""
        slot = job.copy.slot
        if job.copied is not None and not job.copied.wait_settled(job.deadline):
            buffers_free = False
        if buffers_free:
            self._pool.release(slot)
        else:
            self._pool.forget(slot)
            self._writer.forget_slot(slot)

    def _report_failure(self, step: int, save_id: str, phase: Phase, exc: BaseException) -> None:
        report = RankReport(step, self.role, self.rank, self.world_size, save_id)
        report.failure = Failure.from_exception(self.role, self.rank, phase, exc)
        try:
            self._call_finalizer("report", report)
        except Exception as error:  # noqa: BLE001 - the original failure is what matters
            logger.warning(
                "%s: could not report the failure of step %d: %s", self._who, step, error
            )

    def _write_and_report(self, job: _SaveJob) -> None:
        started = time.perf_counter()
        report = RankReport(job.step, self.role, self.rank, self.world_size, job.save_id)
        report.failure = self._write(job, report)
        reporting = time.perf_counter()
        job.stats.write_s = reporting - started
        if job.copied is not None and job.copied.finished_at is not None:
            job.stats.write_before_copy_end_s = max(0.0, job.copied.finished_at - started)
        job.stats.bytes_written = sum(f.size for f in report.files)
        job.stats.files_written = len(report.files)
        try:
            faults.inject(Phase.REPORT, self.role, self.rank)
            self._call_finalizer("report", report.pack(), deadline=job.deadline + RPC_SLACK_S)
        except Exception as exc:  # noqa: BLE001 - the step cannot commit without this report
            if report.failure is None:
                report.failure = Failure.from_exception(self.role, self.rank, Phase.REPORT, exc)
        job.stats.report_s = time.perf_counter() - reporting
        if report.failure is None and self._uploads is not None:
            self._uploads.submit(job.step, report.files)
        if report.failure is not None:
            job.stats.error = report.failure.describe()
            raise CheckpointWriteError(
                f"{self.role} rank {self.rank} failed to save step {job.step} under "
                f"{self._root}: {report.failure.describe()}"
            )

    def _write(self, job: _SaveJob, report: RankReport) -> Failure | None:
        """Step 3: write every file (fsynced, checksummed) into the report."""
        buffers_free = True
        slot = job.copy.slot
        try:
            copied = job.copied
            if copied is not None and not self.config.writer.write_while_copying:
                copied.wait_all(job.deadline)
                copied = None
            outcomes = self._writer.write(
                job.prepared.write_buckets,
                job.prepared.transforms,
                slot,
                job.deadline,
                (self.role, self.rank),
                copied,
            )
            check_live_unchanged(job.copy.live)
            files = [written for _, written in outcomes]
            if job.common is not None:
                files.append(write_common(serialize_common(job.common), job.directory))
            if job.model_spec_bytes is not None:
                files.append(write_model_spec(job.model_spec_bytes, job.directory))
            for results, _ in outcomes:
                report.write_results.extend(results)
            report.files = [FileEntry(f"{self.role}/{f.name}", f.size, f.checksum) for f in files]
            job.stats.fsync_s = max((f.fsync_s for f in files), default=0.0)
            if self.rank == 0:
                report.packed_global_metadata = job.prepared.global_metadata
            return None
        except WriteTimeout as exc:
            buffers_free = not exc.buffers_in_use
            return Failure.from_exception(self.role, self.rank, Phase.WRITE, exc)
        except CopyFailed as exc:
            return Failure.from_exception(self.role, self.rank, Phase.STAGE, exc)
        except Exception as exc:  # noqa: BLE001 - reported to the finalizer and the caller
            return Failure.from_exception(self.role, self.rank, Phase.WRITE, exc)
        finally:
            # The buffers go back to the pool only when no writer can still read them (nor
            # a copy still write into them).
            self._give_back_slot(job, buffers_free)
            job.copy.live = []

    # ---- helpers -------------------------------------------------------------------------

    def _snapshot_mode(self, snapshot: str | None) -> str:
        mode = self.config.snapshot if snapshot is None else snapshot
        if mode not in ("now", "deferred"):
            raise CheckpointConfigError(f"save(snapshot={mode!r}): choose 'now' or 'deferred'")
        if mode == "deferred" and self._save_thread is None:
            raise CheckpointConfigError(
                "save(snapshot='deferred') needs a background writer "
                "(checkpoint.async_save=true, writer.mode thread or process)"
            )
        return mode

    def _compose(self, model: dict | None, optimizer: dict | None, extra: Any) -> dict:
        given = {"model": model, "optimizer": optimizer}
        sharded: dict[str, Any] = {}
        for content in self.config.rank_contents:
            if content == "extra":
                sharded["extra"] = self._extra_sharded(extra)
            elif given[content] is None:
                raise CheckpointError(
                    f"checkpoint.save_contents includes {content!r} but save() got no {content} "
                    "sharded state dict"
                )
            else:
                sharded[content] = given[content]
        return sharded

    def _model_spec_bytes(self, model_spec: dict | None) -> bytes | None:
        """Rank 0's model description, serialised now (a mistake fails save() at once)."""
        if model_spec is None:
            if exports_role(self.config, self.role):
                raise CheckpointError(
                    f"checkpoint.save_contents includes 'hf_model' and role {self.role!r} is "
                    "in checkpoint.hf_export.architectures, but save() got no model_spec "
                    "(pass verl_ckpt.describe_gpt_model(model))"
                )
            return None
        spec = encode_model_spec(model_spec)
        return spec if self.rank == 0 else None

    def _extra_sharded(self, extra: Any) -> ShardedObject:
        # One object per rank: its global "shape" is the role's world size.
        return ShardedObject(EXTRA_STATE_KEY, extra, (self.world_size,), (self.rank,), replica_id=0)

    def _make_uploader(self) -> Any:
        if self.config.remote.url is None:
            return None
        from verl_ckpt.remote.rank_uploader import RankUploader

        return RankUploader(
            self.config.remote,
            self._root,
            self.role,
            self.rank,
            self._timeout_s,
            self._call_finalizer,
        )

    def _call_finalizer(self, method: str, *args: Any, deadline: float | None = None) -> Any:
        deadline = deadline or call_deadline(self._timeout_s)
        return call_finalizer(self._finalizer, method, *args, deadline=deadline, who=self._who)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.role} rank {self.rank}: CheckpointManager is closed")

    def __del__(self) -> None:  # best effort; close() is the contract
        if not getattr(self, "_closed", True):
            try:
                self._writer.close(1.0)
            except Exception:  # noqa: BLE001
                pass


def _stop_quietly(stop: Callable[[float], Any]) -> None:
    """Stop a part of a manager whose open failed; the open's own error is what it raises."""
    with contextlib.suppress(Exception):
        stop(_FAILED_OPEN_CLOSE_S)


class _Hooks:
    """Removable handles of several hooks, removed together."""

    def __init__(self, *handles: Any) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _done_future() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def torch_rng_state() -> dict[str, Any]:
    """The RNG states a rank usually saves as extra state."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
