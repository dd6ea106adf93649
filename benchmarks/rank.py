"""One benchmark rank: a Ray actor in a gloo world holding its share of the state.

The actor keeps the state, the floors and any number of open systems; the driver
(benchmarks/run.py) decides what runs when. Every call returns wall-clock stamps
(`time.time()`, one clock on one machine) so that the driver can measure across ranks.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import time
import warnings
from pathlib import Path
from typing import Any

import ray

warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

__all__ = ["RankBench"]


@ray.remote(num_cpus=1, max_restarts=0)
class RankBench:
    def __init__(self, rank: int, world_size: int, port: int, hidden: int, layers: int) -> None:
        import torch

        from benchmarks.state import RankState, StateSpec
        from benchmarks.systems import CopyFloor, WriteFloor, WritePath
        from recipes import megatron_cpu

        # DCP's process executor rendezvous for its own process group (loopback only).
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        megatron_cpu.init_distributed(rank, world_size, port, tensor_parallel_size=world_size)
        torch.set_num_threads(1)
        self.rank = rank
        self.state = RankState(StateSpec(hidden, layers, world_size), rank)
        self.copy_floor = CopyFloor(self.state)
        self.write_floor = WriteFloor(list(self.state.tensors().values()))
        self.write_path = WritePath(self.state)
        self.systems: dict[str, Any] = {}
        self.profiler: cProfile.Profile | None = None

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "bytes": self.state.nbytes,
            "tensors": len(self.state.tensors()),
        }

    # ---- systems -------------------------------------------------------------------------

    def open_system(self, name: str, root: str) -> None:
        from benchmarks.systems import make_system

        self.systems[name] = make_system(name, self.state, root)

    def save(self, name: str, step: int, directory: str, profile: bool = False) -> dict[str, Any]:
        """One save; with `profile`, under a cProfile that counts this thread's CPU time
        (waits in collectives and preemption by other work on the machine count nothing),
        accumulated over every profiled save until `profile_text()`."""
        system = self.systems[name]
        profiler = None
        if profile:
            if self.profiler is None:
                self.profiler = cProfile.Profile(time.thread_time)
            profiler = self.profiler
        _align()
        t0 = time.time()
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        info = system.save(step, Path(directory))
        if profiler is not None:
            profiler.disable()
        blocking = time.perf_counter() - start
        return {"t0": t0, "blocking_s": blocking, "info": info}

    def profile_text(self) -> str:
        text = _profile_text(self.profiler) if self.profiler is not None else ""
        self.profiler = None
        return text

    def wait(self, name: str) -> dict[str, Any]:
        info = self.systems[name].wait()
        return {"t_end": time.time(), "info": info}

    def close_system(self, name: str) -> None:
        system = self.systems.pop(name)
        system.close()
        del system
        _release_memory()

    # ---- floors --------------------------------------------------------------------------

    def floor_copy(self) -> dict[str, Any]:
        _align()
        t0 = time.time()
        start = time.perf_counter()
        self.copy_floor.run()
        return {"t0": t0, "blocking_s": time.perf_counter() - start}

    def floor_write(self, path: str, variant: str) -> dict[str, Any]:
        _align()
        t0 = time.time()
        self.write_floor.run(Path(path), variant)
        return {"t0": t0, "t_end": time.time()}

    def write_path_variant(self, variant: str, directory: str) -> dict[str, Any]:
        _align()
        t0 = time.time()
        self.write_path.run(variant, Path(directory), self.copy_floor)
        return {"t0": t0, "t_end": time.time()}

    # ---- loads ---------------------------------------------------------------------------

    def load_open(self, system: str, role_dir: str, dcp_dir: str) -> None:
        from benchmarks.loads import LoadRunner

        self.loads = LoadRunner(self.state, self.systems[system], Path(role_dir), Path(dcp_dir))

    def load_variant(self, variant: str) -> dict[str, Any]:
        from benchmarks.loads import time_variant

        # Aligned after the variant's state dicts are built, right before its timing: the
        # building takes each rank a different time (DCP's device mesh and DTensors up to
        # 24 ms apart), which would otherwise be counted as load time of the later rank.
        return time_variant(self.loads, variant, align=_align)

    # ---- a training step after save() returned ---------------------------------------------

    def update(self, offload: bool) -> dict[str, Any]:
        """One optimizer-step-like write of the whole state, timed (no save in flight)."""
        _align()
        start = time.perf_counter()
        self.state.update(offload)
        return {"update_s": time.perf_counter() - start}

    def save_then_update(
        self, name: str, step: int, directory: str, offload: bool, quiet: bool = False
    ) -> dict[str, Any]:
        """save(), then at once the same update while the save's write runs: what the
        trainer's next step pays for the background write (CPU, memory bandwidth,
        copy-on-write faults of a forked writer). `quiet`: inside verl_ckpt's quiet(), as
        an optimizer step with fence_before() runs (a trainer's forward and backward run
        outside it, so the figure without is the one that counts)."""
        out = self.save(name, step, directory)
        start = time.perf_counter()
        # quiet(): verl_ckpt fences (a deferred snapshot's copy may still run: the update
        # then waits for it, which this timing includes) and holds its writes back.
        system = self.systems[name]
        context = getattr(system, "quiet", None) if quiet else None
        with context() if context is not None else contextlib.nullcontext():
            fence = None if quiet else getattr(system, "fence", None)
            if fence is not None:
                # Without quiet(), a trainer still fences before its update: a deferred
                # save's copy may not have run yet (the save would be refused, its tensors
                # changed). Counted in the update's time, as quiet()'s fence is.
                fence()
            self.state.update(offload)
        out["update_s"] = time.perf_counter() - start
        return out

    def restore(self) -> None:
        self.state.restore()

    # ---- teardown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close every system, stop megatron-core's Manager process, leave the process group."""
        from benchmarks.mcore_cpu import shutdown_manager
        from recipes import megatron_cpu

        for name in list(self.systems):
            try:
                self.close_system(name)
            except Exception:  # noqa: BLE001 - keep tearing down
                pass
        shutdown_manager()
        megatron_cpu.destroy_distributed()


def _release_memory() -> None:
    """Free a closed system's memory now, not at some later collection: reference cycles
    (managers, stagers, futures) can keep staging buffers alive, and glibc keeps freed heap
    pages, either of which would shift the next system's memory baseline."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _align() -> None:
    """Start every rank's timed operation at the same moment, as ranks leaving a training
    step's last collective do: without this, the skew of Ray's calls to the two actors (a
    few ms) would be counted in the first collective of a save, and in no floor."""
    import torch.distributed as dist

    dist.barrier()


def _profile_text(profiler: cProfile.Profile, limit: int = 25) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(limit)
    return out.getvalue()
