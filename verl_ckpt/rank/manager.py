"""CheckpointManager: the per-rank half of verl_ckpt, living inside each Megatron worker.

`save()` runs protocol steps 1 (plan) and 2 (stage) in the training thread and returns;
steps 3 (write) and 4 (report) run on the rank's save thread (protocol/__init__.py). Which
thread runs what is the save's path (save_job.SavePath), chosen once per save: a save
whose plan is cached leaves only the copy to the training thread (the group's agreement,
issued, not awaited; begin_step and the plan follow on the save thread); with
`snapshot="deferred"`, the copy moves to the save thread as well, and the trainer calls
`fence()` before it next changes the state; with `snapshot="live"`, host tensors are not
copied at all but written from the trainer's memory, and `fence()` waits for those writes.

The manager composes its collaborators, one per concern: StepPlanner (step 1: agreement,
begin_step, plan cache), Snapshotter (step 2: staging pool, copies, the fence), SaveRunner
(steps 3-4: save thread, writer, pending writes, uploads), RankLoader (load), and the
participant link to the finalizer (commit/participant.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from verl_ckpt.commit.aggregator import batches_reports, open_node_aggregator
from verl_ckpt.commit.client import FinalizerClient, check_shared_root, get_finalizer
from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.format.load_stats import LoadStats, PhaseClock
from verl_ckpt.protocol import Phase, faults
from verl_ckpt.protocol.config import CheckpointConfig, to_checkpoint_config
from verl_ckpt.protocol.deadlines import deadline_in
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitTimeoutError,
)
from verl_ckpt.rank.agreement import PREPARE
from verl_ckpt.rank.copy_progress import CopyProgress
from verl_ckpt.rank.loader import RankLoader
from verl_ckpt.rank.parts import open_parts
from verl_ckpt.rank.save_job import SaveJob, SavePath, SaveStats, chosen_snapshot
from verl_ckpt.rank.snapshot_plan import bind_buffers, freeze_objects
from verl_ckpt.rank.state_dict import compose_state, model_spec_bytes
from verl_ckpt.store.layout import role_name_problem

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "SaveStats"]


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
        _check_group(role, rank, world_size, process_group)
        self.role, self.rank, self.world_size = role, rank, world_size
        self._root = Path(self.config.root_dir).resolve()
        self._timeout_s = float(self.config.timeout_s)
        handle = get_finalizer(self._root, self._timeout_s)
        check_shared_root(self._root, handle, self._timeout_s, f"{role} rank {rank}")
        self._client = FinalizerClient(
            handle, f"{role} rank {rank} of {self._root}", self._timeout_s
        )
        aggregator = None
        if batches_reports(self.config.report_batching, world_size):
            aggregator = open_node_aggregator(
                self._root,
                handle,
                role,
                rank,
                self._timeout_s,
                self._client.who,
                world_size,
                self.config.report_group_size,
            )
        self._link = ParticipantLink(
            self._client,
            role,
            rank,
            world_size,
            self._timeout_s,
            inject_faults=True,
            aggregator=aggregator,
        )
        # The driver's lease on the root (None: a flock): a lost lease refuses the next save.
        self._lease = self._client.lease_guard()
        self._loader = RankLoader(self.config, role, rank, world_size, self._root)
        # Where the last load()'s time went on this rank (None before the first load).
        self.last_load: LoadStats | None = None
        self._parts = open_parts(
            self.config, process_group, world_size, self._root, self._link, self._make_uploader
        )
        # The collaborators, by name (close() stops them all through _parts).
        self._agreement = self._parts.agreement
        self._writer = self._parts.writer
        self._snapshotter = self._parts.snapshotter
        self._planner = self._parts.planner
        self._runner = self._parts.runner
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
        statements_before = self._planner.statements_made
        try:
            state = compose_state(self.config, self.world_size, self.rank, model, optimizer, extra)
            layout = self._planner.layout(PREPARE, state, go_ahead=False)
            copy = self._snapshotter.acquire(layout)
            try:
                self._runner.warm_up(copy.slot, deadline_in(self._timeout_s))
                self._planner.plan_ahead(layout)
            finally:
                self._snapshotter.release(copy.slot)
        except BaseException:
            self._planner.withdraw(PREPARE, statements_before)  # as save() does
            raise

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
        changes the state (a change before the fence fails this save, loudly); "live" returns
        at once too, writes host tensors from the trainer's memory without a copy (device
        tensors are copied as "deferred" does), and `fence()` waits until they are written.
        The first save, and a save after a structure change, copy now: their planning needs
        the group.
        """
        self._check_open()
        started = time.perf_counter()
        job = self._agree(step, model, optimizer, extra, snapshot, model_spec)  # step 1
        if not job.path.deferred:
            self._stage(job)  # step 2 (with begin_step and the plan unless they run behind)
        self._runner.launch(job)  # steps 3-4, and what 1-2 left, in the background
        job.stats.blocking_s = time.perf_counter() - started
        return job.stats

    def fence(self, timeout_s: float | None = None) -> None:
        """Return once the snapshot of every save so far is taken: from then on the trainer
        may change the state (after a live save: once the host tensors it writes without a
        copy are written). Needed only after a deferred or live save; save(), load() and
        quiet() call it first (close() waits for the writes instead). Raises
        CommitTimeoutError at the deadline (checkpoint.timeout_s; by default, for a live
        save, its write's own deadline); where a live save's write timed out while a writer
        thread still reads the state, at every call until that thread ended."""
        self._snapshotter.fence(timeout_s)

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

    def fence_before(self, optimizer: Any) -> Any:
        """Run every `optimizer.step()` inside quiet(): it fences first (a deferred snapshot
        is complete before the update changes the state) and background writes pause while
        the step runs. Takes a torch optimizer (or an object wrapping one as `.optimizer`,
        as megatron-core's do); returns a handle whose `.remove()` undoes it."""
        target = _torch_optimizer(optimizer)

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
        return self._runner.finished(
            deadline_in(self._timeout_s if timeout_s is None else timeout_s)
        )

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
        self._runner.drain(deadline_in(self._timeout_s))
        loaded, self.last_load = self._loader.load(step_path, model, optimizer, extra, clock)
        return loaded

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the writes in flight and stop every helper thread and process, all within
        one deadline (`timeout_s`, default checkpoint.timeout_s). Raises CommitTimeoutError
        naming what did not stop; the manager is closed either way."""
        if self._closed:
            return
        deadline = deadline_in(self._timeout_s if timeout_s is None else timeout_s)
        self._closed = True
        try:
            self._runner.finished(deadline)
        except BaseException:
            # The writes' failure (or their deadline) is what the caller must see: what did
            # not stop is logged, never raised in its place.
            self._snapshotter.forget_unfenced()
            try:
                self._parts.close(deadline)
            except CommitTimeoutError as stuck:
                logger.warning("%s rank %d: close(): %s", self.role, self.rank, stuck)
            raise
        self._snapshotter.forget_unfenced()  # drained: every snapshot was taken or failed
        self._parts.close(deadline)

    @property
    def writer_pid(self) -> int | None:
        """The pid of this rank's writer process (writer.mode=process), while it runs."""
        return self._writer.pid

    @property
    def staged_bytes(self) -> int:
        """Host memory held by the staging pool."""
        return self._snapshotter.pool.nbytes

    # ---- save(), on the training thread --------------------------------------------------

    def _agree(
        self,
        step: int,
        model: dict | None,
        optimizer: dict | None,
        extra: Any,
        snapshot: str | None,
        model_spec: dict | None,
    ) -> SaveJob:
        """Step 1's collectives (the agreement, and the sharding's validation unless the
        plan is cached), the save's path, and what must be read now (SaveJob)."""
        statements_before = self._planner.statements_made
        try:
            # A lost lease on the root (another job took it over): this save is refused,
            # and withdrawn below like any other failure, so that no peer waits for it.
            if self._lease is not None:
                self._lease.check(f"{self.role} rank {self.rank}: save of step {step}")
            mode = chosen_snapshot(self.config.snapshot, snapshot, self._runner.has_thread)
            spec_bytes = model_spec_bytes(self.config, self.role, self.rank, model_spec)
            self.fence()  # the previous save's snapshot must be complete
            # Back-pressure: an earlier failure is raised here, once, instead of saving.
            self._runner.wait_for_room()
            state = compose_state(self.config, self.world_size, self.rank, model, optimizer, extra)
            layout = self._planner.layout(step, state)
            # A save whose plan is reused needs no collective after the agreement: begin_step
            # (which may wait for an earlier step's commit and retention: back-pressure) and
            # the plan then run on the save thread, so that the trainer waits for the copy
            # alone. A save that plans over the group does it all here, as collectives must.
            path = SavePath.choose(self._runner.has_thread, layout.reuse_plan, mode)
            if path.plans_in_background:
                freeze_objects(layout.items)  # their bytes are made when the plan runs, later
            job = self._snapshotter.new_job(layout, path)
            self._planner.state_went_ahead(layout)
        except BaseException as exc:  # Ctrl-C included
            # The other participants save this step: tell the finalizer now that this rank
            # will not, or the step would wait for this report until its deadline. Told
            # first, so that the step has failed before a peer, freed by the statement
            # below, could begin it.
            self._link.withdraw(step, exc)
            # Whether it failed before its layout (raising an earlier failure, say), after
            # it before its statement went out, or after the agreement (its peers will not
            # plan without it).
            self._planner.withdraw(step, statements_before)
            raise
        job.model_spec_bytes = spec_bytes
        return job

    def _stage(self, job: SaveJob) -> None:
        """Step 2 on the training thread: the copy. A save that plans here begins the step
        before it and plans after it; a save on a cached plan hands the job to the save
        thread first, which plans beside the copy."""
        try:
            sources = [item.data for item in job.copy.items]
            if not job.path.plans_in_background:
                self._planner.begin(job)
            else:
                # The save thread takes the job over now, not after the copy: it waits
                # for the agreement, calls begin_step (a round trip to the finalizer)
                # and plans while this thread copies; it writes once the copy ended
                # (with writer.write_while_copying, each tensor once its own copy
                # ended: copy_progress.py). The plan reads which tensors there are,
                # never their values, so the state points at the buffers first.
                bind_buffers(job.copy)
                job.copied = CopyProgress(job.copy.slot.buffers)
                self._runner.hand_over(job)
            faults.inject(Phase.STAGE, self.role, self.rank)
            self._snapshotter.copy(job, sources)  # from here on the live tensors are free
            if not job.path.plans_in_background:
                self._planner.plan(job)
        except BaseException as exc:
            if job.copied is not None:
                job.copied.failed(exc)  # whoever waits for the copy stops waiting
            # Once the save thread owns the job, its write fails on this, and it frees
            # the slot and reports the failure to the finalizer.
            if job.started is None:
                # Whatever was raised, Ctrl-C included (a trainer may catch it and save
                # again): the slot goes back and the step fails now, not at its deadline.
                self._runner.abandon(job, Phase.STAGE, exc)
            else:
                self._runner.hand_over_failed(job)
            # After the failure is reported: its peers, freed by this statement, find the
            # step failed, as the finalizer does.
            self._planner.withdraw_from_plan()
            raise

    def _before_change(self) -> None:
        """The state is about to change: every snapshot must be taken (fence), and no write
        may still read a host tensor in place. Offload-aware staging writes such tensors
        without a copy; version counters catch a change made through them, but not one made
        through `.data`, a numpy view or a C++ kernel on their memory, which would change the
        file silently (I4). Then writes pause (the caller resumes them)."""
        self.fence()
        self._runner.drain_zero_copy(deadline_in(self._timeout_s))
        self._writer.pause()

    # ---- helpers -------------------------------------------------------------------------

    def _make_uploader(self) -> Any:
        if self.config.remote.url is None:
            return None
        from verl_ckpt.remote.rank_uploader import RankUploader

        return RankUploader(
            self.config.remote, self._root, self.role, self.rank, self._timeout_s, self._client
        )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.role} rank {self.rank}: CheckpointManager is closed")

    def __del__(self) -> None:  # best effort; close() is the contract
        if not getattr(self, "_closed", True):
            try:
                self._writer.close(1.0)
            except Exception:  # noqa: BLE001
                pass


def _check_group(
    role: str, rank: int, world_size: int, process_group: dist.ProcessGroup | None
) -> None:
    """The role's name is valid, and the process group is the role's save group."""
    problem = role_name_problem(role)
    if problem:
        raise CheckpointConfigError(problem)
    if not dist.is_initialized():
        raise CheckpointError(
            "torch.distributed is not initialised: CheckpointManager plans saves on the "
            f"process group of role {role!r}"
        )
    if dist.get_world_size(process_group) != world_size or (dist.get_rank(process_group) != rank):
        raise CheckpointError(
            f"{role} rank {rank}/{world_size} disagrees with its process group "
            f"(rank {dist.get_rank(process_group)}/{dist.get_world_size(process_group)})"
        )


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside `optimizer` (megatron-core's wrap one as `.optimizer`)."""
    target = optimizer
    while not hasattr(target, "register_step_pre_hook") and hasattr(target, "optimizer"):
        target = target.optimizer
    if not hasattr(target, "register_step_pre_hook"):
        raise TypeError(
            f"fence_before needs a torch.optim.Optimizer (or a wrapper of one), got "
            f"{type(optimizer).__name__}"
        )
    return target


class _Hooks:
    """Removable handles of several hooks, removed together."""

    def __init__(self, *handles: Any) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
