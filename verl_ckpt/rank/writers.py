"""Who writes a rank's files (`checkpoint.writer.mode`): threads, a spawned process, or inline
(protocol page, step 3).

All three take the same DCP write buckets over the staged buffers and return, per file, the
DCP write results and the file's size and checksum. Never `fork`: a forked Ray/CUDA process
inherits locks and CUDA state it cannot use (and pinned memory has no copy-on-write).
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from functools import partial
from typing import Any, Protocol

import torch
import torch.multiprocessing as torch_mp

from verl_ckpt.format.file_writer import write_bucket
from verl_ckpt.protocol import faults
from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import CheckpointWriteError, CommitTimeoutError
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.protocol.threads import DaemonPool, idle_until_starved, lower_priority
from verl_ckpt.rank.copy_progress import CopyProgress
from verl_ckpt.rank.staging import StagingSlot
from verl_ckpt.store.checksummed_file import WrittenFile
from verl_ckpt.store.fsio import DEFAULT_WRITES, WriteOptions

__all__ = [
    "InlineWriter",
    "ProcessWriter",
    "ThreadWriter",
    "WriteTimeout",
    "Writer",
    "make_writer",
]

Outcome = tuple[list, WrittenFile]


class Writer(Protocol):
    """What the manager needs of a writer."""

    # Whether staged buffers must live in shared memory (another process reads them).
    shares_memory: bool

    @property
    def pid(self) -> int | None:
        """The writer process while it runs; None for writers inside the rank."""

    def write(
        self,
        buckets: list,
        transforms: Any,
        slot: StagingSlot,
        deadline: float,
        fault_scope: tuple[str, int],
        copied: CopyProgress | None = None,
        live_storages: frozenset[int] = frozenset(),
    ) -> list[Outcome]:
        """Write every bucket to its file (fsynced, checksummed) by `deadline` (monotonic).
        `copied`: the snapshot's copy into `slot` may still run; no staged tensor is written
        before its copy ended. `live_storages`: those a live snapshot writes from the
        trainer's memory (WriteOptions); a writer process, which writes staged buffers only,
        ignores them."""

    def forget_slot(self, slot: StagingSlot) -> None:
        """The slot's buffers are gone: drop any reference to them."""

    def warm_up(self, slot: StagingSlot, deadline: float) -> None:
        """Be ready to write `slot` at once (start a writer process and hand it the buffers),
        so that the first save does not pay for it."""

    def pause(self) -> None:
        """Hold writes back, within one slice of a write (at most fsio.MAX_PAUSE_S), until
        resume()."""

    def resume(self) -> None:
        """Let writes go on."""

    def close(self, timeout_s: float) -> None:
        """Stop, within `timeout_s`; raise CommitTimeoutError naming what is still running."""


class WriteTimeout(CommitTimeoutError):
    """The write did not finish by its deadline. `reads_ended` is set once no writer reads
    the staged buffers (or a live snapshot's tensors) any more: at once where nothing still
    runs, else when the last of the writer threads `running` at the deadline ends."""

    def __init__(self, message: str, running: Sequence[Future] = ()) -> None:
        super().__init__(message)
        self.reads_ended = _set_once_all_done(running)

    @property
    def buffers_in_use(self) -> bool:
        """Whether a writer may still read the buffers now (then they must never be reused)."""
        return not self.reads_ended.is_set()


def _set_once_all_done(futures: Sequence[Future]) -> threading.Event:
    """An event set by the last of `futures` to end (a done-callback: no thread polls)."""
    ended = threading.Event()
    left = len(futures)
    lock = threading.Lock()

    def one_ended(_: Future) -> None:
        nonlocal left
        with lock:
            left -= 1
            if left == 0:
                ended.set()

    if not futures:
        ended.set()
    for future in futures:
        future.add_done_callback(one_ended)  # called at once if it already ended
    return ended


def _waiting_for(
    copied: CopyProgress | None, deadline: float
) -> Callable[[torch.Tensor], None] | None:
    """What a writer calls before each tensor: wait for its copy, if one may still run."""
    if copied is None:
        return None
    return partial(copied.wait_for, deadline=deadline)


class InlineWriter:
    """The calling thread writes the files itself, one after the other."""

    shares_memory = False

    def __init__(self, options: WriteOptions = DEFAULT_WRITES) -> None:
        # Open (set) unless the trainer holds writes back while it changes its state.
        self._gate = threading.Event()
        self._gate.set()
        self._options = options

    def pause(self) -> None:
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    @property
    def pid(self) -> int | None:
        return None

    def write(
        self,
        buckets: list,
        transforms: Any,
        slot: StagingSlot,
        deadline: float,
        fault_scope: tuple[str, int],
        copied: CopyProgress | None = None,
        live_storages: frozenset[int] = frozenset(),
    ) -> list[Outcome]:
        faults.inject(Phase.WRITE, *fault_scope)
        before = _waiting_for(copied, deadline)
        options = self._options_for(live_storages)
        return [write_bucket(bucket, transforms, self._gate, options, before) for bucket in buckets]

    def _options_for(self, live_storages: frozenset[int]) -> WriteOptions:
        if live_storages:
            return dataclasses.replace(self._options, live_storages=live_storages)
        return self._options

    def forget_slot(self, slot: StagingSlot) -> None:
        pass

    def warm_up(self, slot: StagingSlot, deadline: float) -> None:
        pass

    def close(self, timeout_s: float) -> None:
        pass


class ThreadWriter(InlineWriter):
    """A pool of threads in the rank writes one file each (file I/O releases the GIL)."""

    def __init__(
        self,
        threads: int,
        name: str,
        nice: int = 0,
        options: WriteOptions = DEFAULT_WRITES,
        idle_class: bool = False,
    ) -> None:
        super().__init__(options)
        # idle_class: each write runs on cores the trainer leaves (writer.idle_class).
        self._pool = DaemonPool(threads, name, nice, idle_until_starved=idle_class)

    def write(
        self,
        buckets: list,
        transforms: Any,
        slot: StagingSlot,
        deadline: float,
        fault_scope: tuple[str, int],
        copied: CopyProgress | None = None,
        live_storages: frozenset[int] = frozenset(),
    ) -> list[Outcome]:
        faults.inject(Phase.WRITE, *fault_scope)
        if time_left(deadline) <= 0:
            # Late already (a slow agreement, begin_step or plan): start no thread, which
            # could not be stopped and would read the buffers (or a live tensor) past it.
            raise WriteTimeout("the write could not start before its deadline")
        before = _waiting_for(copied, deadline)
        options = self._options_for(live_storages)
        futures = [
            self._pool.submit(
                write_bucket,
                bucket,
                transforms,
                self._gate,
                options,
                before,
                label=f"write {bucket[0]}",
            )
            for bucket in buckets
        ]
        _, unfinished = wait_for_futures(futures, timeout=time_left(deadline))
        if unfinished:
            late = next(b for f, b in zip(futures, buckets, strict=True) if f in unfinished)
            # A bucket not started yet never starts: past the deadline it would read the
            # buffers (or a live tensor) for a save that has failed. A running thread cannot
            # be stopped and may still read them: the error says when the last one ends.
            running = [future for future in unfinished if not future.cancel()]
            raise WriteTimeout(f"writing {late[0]} did not finish in time", running)
        return [future.result() for future in futures]

    def close(self, timeout_s: float) -> None:
        stuck = self._pool.close(timeout_s)
        if stuck:
            raise CommitTimeoutError(
                f"writer threads still running after {timeout_s:g}s: {', '.join(stuck)}; "
                "left behind as daemon threads (they hold up nothing else)"
            )


class ProcessWriter:
    """One persistent writer process per rank, started with spawn, reading shared memory.

    Each staging slot's buffers are handed to the process once (shared memory, no copy);
    a save then sends only the write plan. A writer that dies is noticed within a fraction of
    a second (its save fails, naming the exit status) and the next save starts a new one.
    The process exits by itself when the rank's process dies.
    """

    shares_memory = True

    def __init__(
        self,
        threads: int,
        name: str,
        nice: int = 0,
        options: WriteOptions = DEFAULT_WRITES,
        idle_class: bool = False,
    ) -> None:
        self._threads = threads
        self._name = name
        self._nice = nice
        self._options = options
        self._idle_class = idle_class
        self._ctx = torch_mp.get_context("spawn")
        # Shared with the writer process, which checks it before each slice it writes.
        self._gate = self._ctx.Event()
        self._gate.set()
        self._proc = None
        self._requests = None
        self._results = None
        self._known_slots: set[int] = set()
        self._next_job = 0
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def write(
        self,
        buckets: list,
        transforms: Any,
        slot: StagingSlot,
        deadline: float,
        fault_scope: tuple[str, int],
        copied: CopyProgress | None = None,
        live_storages: frozenset[int] = frozenset(),
    ) -> list[Outcome]:
        if copied is not None:
            # The process reads the buffers without asking: they must be full before it
            # hears of the write.
            copied.wait_all(deadline)
        self._hand_over(slot)
        job = self._next_job_id()
        plan = [_describe_bucket(bucket, slot) for bucket in buckets]
        self._requests.put(("write", job, slot.slot_id, plan, transforms, fault_scope))
        return self._answer(job, deadline)

    def warm_up(self, slot: StagingSlot, deadline: float) -> None:
        # The answer to a ping comes once the process imported what it needs and holds the
        # slot's buffers: seconds of spawn and imports that the first save no longer waits.
        self._hand_over(slot)
        job = self._next_job_id()
        self._requests.put(("ping", job))
        self._answer(job, deadline)

    def _hand_over(self, slot: StagingSlot) -> None:
        self._ensure_started()
        if slot.slot_id not in self._known_slots:
            self._requests.put(("slot", slot.slot_id, slot.buffers))
            self._known_slots.add(slot.slot_id)

    def _next_job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _answer(self, job: int, deadline: float) -> Any:
        while True:
            # Read once a round: close() may reset them meanwhile (a save past its deadline).
            results, proc = self._results, self._proc
            if self._closed or results is None or proc is None:
                raise CheckpointWriteError(_CLOSED)
            try:
                kind, done_job, payload = results.get(timeout=0.2)
            except ValueError:  # the queue was closed under this wait
                raise CheckpointWriteError(_CLOSED) from None
            except queue.Empty:
                if self._closed:
                    raise CheckpointWriteError(_CLOSED) from None
                if not proc.is_alive():
                    code = proc.exitcode
                    self._reset()
                    # A dead process reads nothing: the buffers are free again.
                    raise CheckpointWriteError(
                        f"the writer process died (exit status {code}) before reporting"
                    ) from None
                if time.monotonic() >= deadline:
                    # Stop our own hung writer, so that its buffers can be reused safely.
                    self._kill()
                    raise WriteTimeout("the writer process did not finish in time") from None
                continue
            if done_job != job:
                continue  # a late answer to a job that already timed out
            if kind == "error":
                raise CheckpointWriteError(payload)
            return payload

    def pause(self) -> None:
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def forget_slot(self, slot: StagingSlot) -> None:
        if slot.slot_id in self._known_slots and self._proc is not None and self._proc.is_alive():
            self._requests.put(("drop", slot.slot_id))
        self._known_slots.discard(slot.slot_id)

    def close(self, timeout_s: float) -> None:
        # First: a save still in flight past close()'s deadline must not start a new process,
        # which nothing would ever stop.
        self._closed = True
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._requests.put(("stop",))
            self._proc.join(timeout_s)
        self._kill()

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        if self._closed:
            raise CheckpointWriteError(_CLOSED)
        self._reset()
        self._requests = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self._proc = self._ctx.Process(
            target=_writer_main,
            args=(
                self._requests,
                self._results,
                self._threads,
                self._nice,
                self._gate,
                self._options,
                self._idle_class,
            ),
            name=self._name,
            daemon=True,
        )
        self._proc.start()

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(10)
        self._reset()

    def _reset(self) -> None:
        if self._proc is not None and not self._proc.is_alive():
            self._proc.close()
        self._proc = None
        for q in (self._requests, self._results):
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._requests = self._results = None
        self._known_slots = set()


_CLOSED = "the writer process was closed: the checkpoint manager closed with this save in flight"


def _describe_bucket(bucket: tuple, slot: StagingSlot) -> tuple:
    """Replace each staged tensor by (buffer index, view geometry); the process has them."""
    by_storage = {b.untyped_storage().data_ptr(): i for i, b in enumerate(slot.buffers)}
    path, storage_key, (bytes_data, tensor_data) = bucket
    tensors = []
    for item, tensor in tensor_data:
        index = by_storage.get(tensor.untyped_storage().data_ptr())
        if index is None:
            # Not a staged buffer (megatron-core cloned a view): sent whole, moved to shared
            # memory by torch's pickler.
            tensors.append((item, ("tensor", tensor)))
        else:
            view = (index, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
            tensors.append((item, ("buffer", view)))
    return path, storage_key, bytes_data, tensors


def _rebuild_bucket(described: tuple, buffers: list[torch.Tensor]) -> tuple:
    path, storage_key, bytes_data, tensors = described
    tensor_data = []
    for item, (kind, value) in tensors:
        if kind == "tensor":
            tensor_data.append((item, value))
        else:
            index, offset, shape, stride = value
            tensor_data.append((item, buffers[index].as_strided(shape, stride, offset)))
    return path, storage_key, (bytes_data, tensor_data)


def _exit_with_parent() -> None:
    parent = torch_mp.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)


def _writer_main(
    requests: Any,
    results: Any,
    threads: int,
    nice: int,
    gate: Any,
    options: WriteOptions,
    idle_class: bool,
) -> None:
    """The writer process: serve slot registrations and writes until told to stop."""
    # Before any thread starts: every thread of this process inherits the lowered priority.
    lower_priority(nice)
    torch.set_num_threads(1)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    pool = ThreadPoolExecutor(threads)
    slots: dict[int, list[torch.Tensor]] = {}
    while True:
        # An idle server's wait, deliberately without a deadline: the rank bounds every
        # write it waits for (WriteTimeout), and this process ends with a "stop" message or,
        # through _exit_with_parent, when the rank dies.
        message = requests.get()
        kind = message[0]
        if kind == "stop":
            break
        if kind == "slot":
            slots[message[1]] = message[2]
        elif kind == "drop":
            slots.pop(message[1], None)
        elif kind == "ping":
            results.put(("done", message[1], None))
        elif kind == "write":
            _, job, slot_id, plan, transforms, fault_scope = message
            try:
                faults.inject(Phase.WRITE, *fault_scope)
                buckets = [_rebuild_bucket(b, slots[slot_id]) for b in plan]
                write = partial(
                    _write_bucket_at,
                    nice if idle_class else None,
                    transforms=transforms,
                    gate=gate,
                    options=options,
                )
                outcomes = _write_every_bucket(pool, write, buckets)
                results.put(("done", job, outcomes))
            except Exception as exc:  # noqa: BLE001 - sent back, raised in the rank
                results.put(("error", job, f"{type(exc).__name__}: {exc}"))
    pool.shutdown()


def _write_bucket_at(idle_nice: int | None, bucket: tuple, **kwargs: Any) -> Outcome:
    """write_bucket on a writer process's thread, in the idle class until starved
    (writer.idle_class) when `idle_nice` is not None."""
    if idle_nice is not None:
        idle_until_starved(idle_nice)
    return write_bucket(bucket, **kwargs)


def _write_every_bucket(
    pool: ThreadPoolExecutor, write: Callable[[tuple], Outcome], buckets: list
) -> list[Outcome]:
    """Write the buckets on the process's threads; raise the failure of the first bucket
    that failed (in the plan's order) only once no bucket runs any more.

    The answer frees the rank's staging slot, which its next snapshot overwrites: an answer
    sent while another thread still wrote a bucket of this step from the shared buffers
    would let that thread read the next step's bytes. After a failure the buckets not yet
    started are cancelled (the step fails anyway); those running cannot be stopped and are
    waited for. The rank bounds this wait: past its deadline it kills this process."""
    futures = [pool.submit(write, bucket) for bucket in buckets]
    wait_for_futures(futures, return_when=FIRST_EXCEPTION)
    for future in futures:
        future.cancel()  # only those not started: a no-op once every bucket ended
    wait_for_futures(futures)
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()
    return [future.result() for future in futures]


def make_writer(
    mode: str,
    threads: int,
    name: str,
    nice: int = 0,
    options: WriteOptions = DEFAULT_WRITES,
    idle_class: bool = False,
) -> Writer:
    if mode == "process":
        return ProcessWriter(threads, name, nice, options, idle_class)
    if mode == "thread":
        return ThreadWriter(threads, name, nice, options, idle_class)
    # Inline: the training thread writes itself, never in the idle class.
    return InlineWriter(options)
