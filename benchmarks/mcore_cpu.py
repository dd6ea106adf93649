"""Benchmark-only CPU workaround for megatron-core 0.16.1's own save paths.

megatron-core calls CUDA unconditionally in its save execution (see
shared/notes/megatron-core.md), so on a CPU-only torch neither its synchronous
`dist_checkpointing.save` nor its async path runs as shipped. These subclasses change exactly
those calls and nothing else; everything else (validation, planning, the forked writers, the
Manager results queue, the metadata written in finalize) is megatron-core's own code:

1. `preload_tensors(..., non_blocking=True)` ends in `torch.cuda.synchronize()`
   (filesystem_async.py:230): the strategy passes non_blocking=False instead. On CPU tensors
   `tensor.to("cpu")` returns the tensor itself, so megatron-core takes no copy here at all.
2. `save_state_dict_async_finalize` broadcasts its failure flag as a CUDA tensor
   (state_dict_saver.py:252): the same function with a CPU tensor.
3. `TemporalAsyncCaller.schedule_async_call` calls `torch.cuda.synchronize()` before its fork
   (async_utils.py:212) and `sync_all_async_calls` all-reduces a CUDA tensor (:165): the same
   methods without the synchronize and with a CPU tensor.
4. `AsyncCallsQueue.maybe_finalize_async_calls` all-reduces the call index as a CUDA tensor
   (:604): the same method with a CPU tensor.
"""

from __future__ import annotations

import logging
from functools import partial
from time import time

import torch
import torch.multiprocessing as mp
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    TemporalAsyncCaller,
    _disable_gc,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.utils import _get_failure_dict

__all__ = ["CPU_WORKAROUND", "CpuAsyncCallsQueue", "CpuTorchDistSaveStrategy", "shutdown_manager"]

logger = logging.getLogger(__name__)

CPU_WORKAROUND = (
    "megatron-core on CPU: benchmark-local subclasses replace only its CUDA calls "
    "(preload non_blocking=False, i.e. no host copy since tensors are already on the host; "
    "failure broadcast and async-call all-reduces on CPU tensors; no cuda.synchronize before fork)"
)


def _finalize_on_cpu(storage_writer, global_metadata, dist_wrapper) -> None:
    """megatron-core's `save_state_dict_async_finalize` with its flag on a CPU tensor."""
    write_results = storage_writer.retrieve_write_results()
    all_results = dist_wrapper.gather_object(write_results)
    node_failures = {}
    if dist_wrapper.is_coordinator:
        node_failures = _get_failure_dict(all_results)
        if not node_failures:
            storage_writer.finish(global_metadata, all_results)
    failed = torch.tensor([int(len(node_failures) > 0)], dtype=torch.int)
    torch.distributed.broadcast(failed, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
    if failed:
        raise CheckpointException("write", node_failures)


class CpuTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save strategy with workarounds 1 and 2 (see module doc)."""

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
        save_fn, _, save_args = writer.get_save_function_and_args()
        preload_fn = (
            partial(writer.preload_tensors, writer.write_buckets, False)
            if save_fn is not None
            else None
        )

        def finalize_fn() -> None:
            _finalize_on_cpu(*save_state_dict_ret)

        return AsyncRequest(save_fn, save_args, [finalize_fn], preload_fn=preload_fn)


class _CpuTemporalAsyncCaller(TemporalAsyncCaller):
    """Fork per save, as megatron-core and verl do, with workaround 3."""

    @_disable_gc()
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        async_fn_args = list(async_req.async_fn_args)
        if async_req.preload_fn:
            async_fn_args[1] = async_req.preload_fn()
        ctx = mp.get_context("fork")
        self.start_time = time()
        self.process = ctx.Process(
            target=async_req.async_fn, args=async_fn_args, kwargs=async_req.async_fn_kwargs
        )
        self.process.start()

    def sync_all_async_calls(self, is_alive: int) -> bool:
        flag = torch.tensor([is_alive], dtype=torch.int)
        torch.distributed.all_reduce(flag)
        return flag[0] == 0


class CpuAsyncCallsQueue(AsyncCallsQueue):
    """megatron-core's queue of async saves (non-persistent: a fork per save), workaround 4."""

    def __init__(self) -> None:
        super().__init__(persistent=False)

    def _get_async_caller(self):
        return _CpuTemporalAsyncCaller()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list:
        finalized = []
        while self.async_calls:
            if not self.async_calls[0].async_caller.is_current_async_call_done(blocking, no_dist):
                break
            call_idx, _, async_request = self.async_calls.popleft()
            for finalize_fn in async_request.finalize_fns:
                finalize_fn()
            index = torch.tensor([call_idx], dtype=torch.int)
            torch.distributed.all_reduce(index, op=torch.distributed.ReduceOp.MAX)
            assert index.item() == call_idx, "unmatched async calls"
            finalized.append(call_idx)
        return finalized


def shutdown_manager() -> None:
    """Stop the multiprocessing Manager server that megatron-core starts at a rank's first
    save (its write-results queue); it outlives everything otherwise."""
    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        try:
            manager.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            logger.warning("could not stop megatron-core's Manager process", exc_info=True)
    filesystem_async._results_queue = None
