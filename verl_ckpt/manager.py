"""CheckpointManager: the per-rank half of verl_ckpt, living inside each Megatron worker.

`save()` runs protocol steps 1 (plan) and 2 (stage) in the training thread and returns;
steps 3 (write) and 4 (report) run on the rank's save thread (protocol.py). Completion is
never polled with collectives (I6): the finalizer learns it from the report.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from verl_ckpt import faults, megatron_compat
from verl_ckpt.commit_record import FileEntry, read_commit_record, verify_files
from verl_ckpt.config import CheckpointConfig, to_checkpoint_config
from verl_ckpt.errors import (
    CheckpointError,
    CheckpointWriteError,
    CommitRecordError,
    CommitTimeoutError,
)
from verl_ckpt.file_writer import serialize_common, write_common
from verl_ckpt.finalizer_client import call_finalizer, check_shared_root, get_finalizer
from verl_ckpt.inflight import InFlightSaves
from verl_ckpt.layout import DRIVER_ROLE, step_dir
from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.reports import RankReport
from verl_ckpt.staging import StagingPool, StagingSlot, copy_into
from verl_ckpt.structure import structure_hash
from verl_ckpt.threads import DaemonPool
from verl_ckpt.writers import WriteTimeout, make_writer

__all__ = ["CheckpointManager", "SaveStats"]

logger = logging.getLogger(__name__)

EXTRA_STATE_KEY = "verl_ckpt.extra_state"
# Slack added to the deadline of a call whose callee applies the caller's own timeout.
_RPC_SLACK_S = 30.0


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
    write_s: float | None = None
    bytes_written: int | None = None
    files_written: int | None = None
    # Set when the write failed (the error is also raised once by the next save()/wait()).
    error: str | None = None


@dataclass
class _LiveTensor:
    """A host tensor written without a copy, with its version counter at save() time."""

    key: str
    tensor: torch.Tensor
    version: int


@dataclass
class _Plan:
    """Step 1's outcome: where to write, and what the save group agreed."""

    step: int
    sharded: dict
    common: dict
    items: list
    digest: str
    reuse_plan: bool
    directory: Path
    distribution: Any
    seconds: float


@dataclass
class _Snapshot:
    """Step 2's outcome: the staged copies (and live host tensors) the write reads."""

    slot: StagingSlot
    live: list[_LiveTensor]
    bytes_staged: int
    seconds: float


@dataclass
class _SaveJob:
    """Everything steps 3 and 4 need, handed to the save thread."""

    step: int
    save_id: str
    slot: StagingSlot
    prepared: megatron_compat.PreparedSave
    common_bytes: bytes | None
    directory: Path
    live_tensors: list[_LiveTensor]
    stats: SaveStats
    deadline: float


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
        if not role or role == DRIVER_ROLE or "/" in role:
            raise CheckpointError(f"role {role!r} is invalid (reserved or not a directory name)")
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
        self._finalizer = get_finalizer(self._root, self._timeout_s)
        check_shared_root(self._root, self._finalizer, self._timeout_s, f"{role} rank {rank}")
        mode = self.config.writer.mode if self.config.async_save else "inline"
        self._writer = make_writer(mode, self.config.writer.threads, f"verl_ckpt_{role}{rank}")
        self._pool = StagingPool(
            self.config.max_in_flight,
            self.config.staging.pin_memory,
            shared_memory=self._writer.shares_memory,
        )
        self._plan_cache: megatron_compat.SavePlanCache | None = None
        self._in_flight = InFlightSaves(
            self.config.max_in_flight, f"{role} rank {rank}", self._timeout_s
        )
        self._closed = False
        # Steps 3-4 run on one background thread per rank, which hands files to the writer;
        # inline mode runs them inside save().
        self._save_thread = (
            DaemonPool(1, f"verl_ckpt_{role}{rank}_save") if mode != "inline" else None
        )
        # Step 8: this rank uploads its own files to the remote tier, if there is one.
        self._uploads = self._make_uploader()

    # ---- public API ----------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: dict | None = None,
        optimizer: dict | None = None,
        extra: Any = None,
    ) -> SaveStats:
        """Snapshot this rank's state for `step`; return once the snapshot is taken.

        `model` and `optimizer` are megatron-core sharded state dicts (`sharded_state_dict()`
        of the model chunks and of the optimizer), built for this save and consumed by it;
        `extra` is any small picklable object (RNG states, counters) saved per rank.
        Every rank of the save group must call save() for the same step.
        """
        self._check_open()
        started = time.perf_counter()
        # Back-pressure: at most max_in_flight writes; an earlier failure is raised here, once.
        self._in_flight.wait_for_room()
        if self._uploads is not None:
            self._uploads.wait_for_room()
        state = self._compose(model=model, optimizer=optimizer, extra=extra)
        plan = self._plan(step, state)  # step 1
        try:
            snapshot = self._stage(plan)  # step 2: from here on the live tensors are free
            job = self._prepare_job(plan, snapshot)
        except Exception as exc:
            # The step directory exists: tell the finalizer, so that the step fails now
            # instead of waiting for this rank's report until the deadline.
            self._report_failure(step, Phase.STAGE, exc)
            raise
        self._launch(job)  # steps 3-4, in the background unless inline
        job.stats.blocking_s = time.perf_counter() - started
        return job.stats

    def wait(self, timeout_s: float | None = None) -> list[SaveStats]:
        """Block until this rank's writes finished (not the commit); return their figures.

        Raises CheckpointWriteError for a failed write (once), CommitTimeoutError naming the
        steps still being written when the deadline passes.
        """
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
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
        Returns a dict with keys among "model", "optimizer", "extra".
        """
        path = step_dir(self._root, step_path) if isinstance(step_path, int) else Path(step_path)
        record = read_commit_record(path)
        saved_world = record.role_world_size(self.role)
        if saved_world is None:
            raise CommitRecordError(
                f"{path} holds no state of role {self.role!r} "
                f"(roles: {sorted(record.participants)})"
            )
        wanted = self.config.load_contents
        template: dict[str, Any] = {}
        if "model" in wanted and model is not None:
            template["model"] = model
        if "optimizer" in wanted and optimizer is not None:
            template["optimizer"] = optimizer
        if "extra" in wanted and extra:
            if saved_world != self.world_size:
                raise CheckpointError(
                    f"{path}: role {self.role} was saved with {saved_world} ranks, loading with "
                    f"{self.world_size}; per-rank extra state cannot be resharded (drop 'extra' "
                    "from load_contents to load model and optimizer only)"
                )
            template["extra"] = self._extra_sharded(None)
        if self.config.verify_checksums_on_load:
            problems = verify_files(path, record, prefix=f"{self.role}/")
            if problems:
                raise CommitRecordError(f"{path} failed verification: " + "; ".join(problems))
        loaded = megatron_compat.load_role_dir(template, path / self.role)
        # megatron-core merges common.pt back in, which may hold non-sharded parts of contents
        # that were not asked for (an optimizer's param_groups): return only what was.
        return {key: value for key, value in loaded.items() if key in template}

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the writes in flight and stop every helper thread and process, all within
        one deadline (`timeout_s`, default checkpoint.timeout_s). Raises CommitTimeoutError
        naming what did not stop; the manager is closed either way."""
        if self._closed:
            return
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        self._closed = True
        try:
            self._in_flight.drain(deadline)
            self._in_flight.raise_pending()
        finally:
            try:
                if self._uploads is not None:
                    self._uploads.close(deadline)
                if self._save_thread is not None:
                    self._save_thread.close(max(0.0, deadline - time.monotonic()))
                self._writer.close(max(0.0, deadline - time.monotonic()))
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

    # ---- step 1: plan --------------------------------------------------------------------

    def _plan(self, step: int, state: dict) -> _Plan:
        started = time.perf_counter()
        sharded, common = megatron_compat.split_common_state(state)
        items = megatron_compat.sharded_items(sharded)
        digest = structure_hash(items)
        # Agreement comes before begin_step: ranks that disagree on the step or the root fail
        # together before any directory or file exists.
        reuse = self._agree_with_group(step, digest)
        waited = time.perf_counter()
        directory = Path(
            self._call_finalizer(
                "begin_step", step, self.role, self.rank, self.world_size, self._timeout_s
            )
        )
        # Time spent waiting for an earlier step to commit is back-pressure, not planning.
        started += time.perf_counter() - waited
        cache = self._plan_cache if reuse else None
        distribution = None
        if self.config.fully_parallel_save:
            distribution = megatron_compat.spread_main_replicas(
                sharded, self._group, cache.replica_distribution if cache else None
            )
        if not reuse:
            megatron_compat.validate_sharding(items, self._group)
        return _Plan(
            step,
            sharded,
            common,
            items,
            digest,
            reuse,
            directory,
            distribution,
            time.perf_counter() - started,
        )

    def _agree_with_group(self, step: int, digest: str) -> bool:
        """Check that every rank saves the same step under the same root; decide plan reuse.

        A monitored barrier first (gloo), so that a rank that never calls save() is named in
        an error after the deadline instead of hanging the others; then one all-gather of a
        few bytes. Ranks that disagree fail here together, before anything is written.
        """
        if dist.get_backend(self._group) == "gloo":
            try:
                dist.monitored_barrier(
                    self._group, timeout=timedelta(seconds=self._timeout_s), wait_all_ranks=True
                )
            except RuntimeError as exc:
                raise CommitTimeoutError(
                    f"{self.role} rank {self.rank}: not every rank of the save group called "
                    f"save({step}) within {self._timeout_s:g}s: {exc}"
                ) from None
        cached = self._plan_cache is not None and self._plan_cache.structure_hash == digest
        mine = (step, str(self._root), cached)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._group)
        if len({(s, r) for s, r, _ in everyone}) != 1:
            listing = ", ".join(
                f"rank {i}: step {s} root {r}" for i, (s, r, _) in enumerate(everyone)
            )
            raise CheckpointError(f"ranks of role {self.role} disagree on what to save: {listing}")
        return self.config.assume_constant_structure and all(c for _, _, c in everyone)

    # ---- step 2: stage -------------------------------------------------------------------

    def _stage(self, plan: _Plan) -> _Snapshot:
        started = time.perf_counter()
        tensors = [item for item in plan.items if isinstance(item, ShardedTensor)]
        live, staged_items = self._split_live(tensors, plan.sharded.get("optimizer"))
        slot, dropped = self._pool.acquire(
            [item.key for item in staged_items], [item.data for item in staged_items]
        )
        for old in dropped:
            self._writer.forget_slot(old)
        try:
            copied = copy_into(slot, [item.data for item in staged_items])
        except BaseException:
            self._pool.release(slot)
            raise
        # From here on the save references the snapshot, never the live device tensors.
        for item, buffer in zip(staged_items, slot.buffers, strict=True):
            item.data = buffer
        return _Snapshot(slot, live, copied, time.perf_counter() - started)

    def _split_live(
        self, tensors: list[ShardedTensor], optimizer_part: dict | None
    ) -> tuple[list[_LiveTensor], list[ShardedTensor]]:
        """Offload-aware staging: which optimizer tensors are written live, which are copied.

        Only optimizer state qualifies: an offloading trainer replaces its storage between
        updates, while parameters are updated in place by every step. A tensor is written
        live only if it is a whole host tensor (not a view, which megatron-core would clone
        anyway) and the writer reads this process's memory.
        """
        if (
            not self.config.staging.offload_aware
            or self._writer.shares_memory
            or not optimizer_part
        ):
            return [], tensors
        candidates = {id(item) for item in megatron_compat.sharded_items(optimizer_part)}
        live, staged = [], []
        for item in tensors:
            data = item.data
            whole = data.storage_offset() == 0 and data.untyped_storage().nbytes() == _nbytes(data)
            host = data.device.type == "cpu" and data.is_contiguous() and whole
            if id(item) in candidates and host:
                live.append(_LiveTensor(item.key, data, data._version))
            else:
                staged.append(item)
        return live, staged

    # ---- steps 3-4: write and report (background) ----------------------------------------

    def _prepare_job(self, plan: _Plan, snapshot: _Snapshot) -> _SaveJob:
        """Plan the DCP writes over the snapshot (part of step 1, cached with the plan)."""
        started = time.perf_counter()
        try:
            prepared = megatron_compat.plan_save(
                plan.sharded,
                plan.directory,
                self._group,
                self.config.writer.threads,
                plan.digest,
                self._plan_cache if plan.reuse_plan else None,
                plan.distribution,
            )
            # Rank 0 writes the non-sharded part, always, as megatron-core does (its load
            # requires common.pt even when it holds nothing): serialised now, the snapshot.
            common_bytes = serialize_common(plan.common) if self.rank == 0 else None
        except BaseException:
            self._pool.release(snapshot.slot)
            raise
        self._plan_cache = prepared.plan_cache if self.config.assume_constant_structure else None
        stats = SaveStats(
            step=plan.step,
            blocking_s=0.0,
            plan_s=plan.seconds + time.perf_counter() - started,
            stage_s=snapshot.seconds,
            plan_reused=plan.reuse_plan,
            bytes_staged=snapshot.bytes_staged,
            bytes_zero_copy=sum(_nbytes(t.tensor) for t in snapshot.live),
        )
        return _SaveJob(
            step=plan.step,
            save_id=uuid.uuid4().hex,
            slot=snapshot.slot,
            prepared=prepared,
            common_bytes=common_bytes,
            directory=plan.directory,
            live_tensors=snapshot.live,
            stats=stats,
            deadline=time.monotonic() + self._timeout_s,
        )

    def _launch(self, job: _SaveJob) -> None:
        if self._save_thread is None:
            self._write_and_report(job)
            self._in_flight.add(job.step, job.deadline, _done_future(), job.stats)
            self._in_flight.collect()
            return
        future = self._save_thread.submit(
            self._write_and_report, job, label=f"save of step {job.step}"
        )
        self._in_flight.add(job.step, job.deadline, future, job.stats)

    def _write_and_report(self, job: _SaveJob) -> None:
        started = time.perf_counter()
        report = RankReport(job.step, self.role, self.rank, self.world_size, job.save_id)
        report.failure = self._write(job, report)
        job.stats.write_s = time.perf_counter() - started
        job.stats.bytes_written = sum(f.size for f in report.files)
        job.stats.files_written = len(report.files)
        try:
            faults.inject("report", self.role, self.rank)
            self._call_finalizer("report", report, deadline=job.deadline + _RPC_SLACK_S)
        except Exception as exc:  # noqa: BLE001 - the step cannot commit without this report
            if report.failure is None:
                report.failure = Failure.from_exception(self.role, self.rank, Phase.REPORT, exc)
        if report.failure is None and self._uploads is not None:
            self._uploads.submit(job.step, report.files)
        if report.failure is not None:
            job.stats.error = report.failure.describe()
            raise CheckpointWriteError(
                f"{self.role} rank {self.rank} failed to save step {job.step} under "
                f"{self._root}: {report.failure.describe()}"
            )

    def _report_failure(self, step: int, phase: Phase, exc: BaseException) -> None:
        report = RankReport(step, self.role, self.rank, self.world_size, uuid.uuid4().hex)
        report.failure = Failure.from_exception(self.role, self.rank, phase, exc)
        try:
            self._call_finalizer("report", report)
        except Exception as error:  # noqa: BLE001 - the original failure is what matters
            logger.warning(
                "%s: could not report the failure of step %d: %s", self._who, step, error
            )

    def _write(self, job: _SaveJob, report: RankReport) -> Failure | None:
        """Step 3: write every file (fsynced, checksummed) into the report."""
        buffers_free = True
        try:
            outcomes = self._writer.write(
                job.prepared.write_buckets,
                job.prepared.transforms,
                job.slot,
                job.deadline,
                (self.role, self.rank),
            )
            _check_unchanged(job.live_tensors)
            files = [written for _, written in outcomes]
            if job.common_bytes is not None:
                files.append(write_common(job.common_bytes, job.directory))
            for results, _ in outcomes:
                report.write_results.extend(results)
            report.files = [FileEntry(f"{self.role}/{f.name}", f.size, f.checksum) for f in files]
            if self.rank == 0:
                report.global_metadata = job.prepared.global_metadata
            return None
        except WriteTimeout as exc:
            buffers_free = not exc.buffers_in_use
            return Failure.from_exception(self.role, self.rank, Phase.WRITE, exc)
        except Exception as exc:  # noqa: BLE001 - reported to the finalizer and the caller
            return Failure.from_exception(self.role, self.rank, Phase.WRITE, exc)
        finally:
            # The buffers go back to the pool only when no writer can still read them.
            if buffers_free:
                self._pool.release(job.slot)
            else:
                self._pool.forget(job.slot)
                self._writer.forget_slot(job.slot)
            job.live_tensors = []

    # ---- helpers -------------------------------------------------------------------------

    def _compose(self, model: dict | None, optimizer: dict | None, extra: Any) -> dict:
        given = {"model": model, "optimizer": optimizer}
        sharded: dict[str, Any] = {}
        for content in self.config.save_contents:
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
        deadline = deadline or time.monotonic() + self._timeout_s + _RPC_SLACK_S
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _done_future() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def _check_unchanged(live: list[_LiveTensor]) -> None:
    """Fail the save if a tensor written without a copy was changed in place meanwhile:
    its file may then hold a mix of old and new values (invariant I4)."""
    changed = [t.key for t in live if t.tensor._version != t.version]
    if changed:
        raise CheckpointError(
            f"{len(changed)} host tensors written without a copy were modified in place before "
            f"their write ended (e.g. {changed[0]}); the save is discarded. With "
            "checkpoint.staging.offload_aware=true the trainer must replace offloaded storage "
            "instead of writing into it, or set offload_aware=false"
        )


def torch_rng_state() -> dict[str, Any]:
    """The RNG states a rank usually saves as extra state."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
