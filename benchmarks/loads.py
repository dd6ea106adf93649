"""Resume speed: loading a committed step into the ranks' live tensors, against the read
floor and the peers' own loads of the same state (benchmarks/README.md, "Load benchmark").

Variants, run on both ranks at once (each rank loads its share), in a rotated order:
  read floor            every file of this rank's share read with plain reads into memory
                        allocated beforehand (pinned where the state is on a GPU, as the
                        loads' landing memory is), one thread per file, 16 MiB a read;
  read floor, large reads   the same in reads of 64 MiB, the kernel told that each file is
                        read sequentially (a larger read-ahead); the fastest of the two floors
                        is the floor, the least a load can cost;
  verl_ckpt load        CheckpointManager.load() into the sharded templates (commit record
                        checked first);
  verl_ckpt load + verify   the same with verify_checksums_on_load (every file re-hashed
                        before any state is touched);
  megatron-core load    dist_checkpointing.load() of the same role directory;
  DCP load              torch.distributed.checkpoint.load() of the same tensors as DTensors,
                        saved by DCP itself;
  building the templates    the model's and optimizer's sharded_state_dict(), alone.
Each load is timed from the call of the system's load into state dicts built beforehand
(the sharded templates for verl_ckpt and megatron-core, DTensors on a device mesh for DCP),
as the issue defines it: the trainer's own code builds them, the same for every system
that loads a Megatron state, so their cost is timed apart (the last variant) and shown
beside the loads, not inside them.
Once with the page cache warm (every file read once before: warm_page_cache), once cold
(the page cache is dropped before every variant, as after a restart on a fresh node), where
the system lets us.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import _f, _median, _table, _x

__all__ = ["LOAD_VARIANTS", "LoadRunner", "load_cpu_tables", "load_table", "rotated_loads"]

# The ways of reading the bytes that a load is judged against: the fastest of them.
READ_FLOORS = ("read floor", "read floor, large reads")
LOAD_VARIANTS = (
    *READ_FLOORS,
    "verl_ckpt load",
    "verl_ckpt load + verify",
    "megatron-core load",
    "DCP load",
    "building the templates",
)
LOAD_TARGET = 1.25  # x the read floor
_CHUNK = 16 << 20
_LARGE_CHUNK = 64 << 20


class LoadRunner:
    """Inside one rank: the variants over the step saved by verl_ckpt and the DCP copy."""

    def __init__(self, state: Any, verl_system: Any, role_dir: Path, dcp_dir: Path) -> None:
        self.state = state
        self.verl = verl_system
        self.role_dir = role_dir
        self.dcp_dir = dcp_dir
        # This rank's files of the step: its own shards (as written by this rank).
        self.files = sorted(role_dir.glob(f"__{state.rank}_*.distcp"))
        # Host memory as torch allocates it, touched: the loads read into such memory, and a
        # read into a bytearray took 3 to 4 times as long here from a warm page cache (torch
        # aligns large allocations for transparent huge pages).
        self.buffers = [torch.zeros(f.stat().st_size, dtype=torch.uint8) for f in self.files]
        if state.params[0].device.type == "cuda":
            # A load onto the GPU reads into pinned host memory (direct_reader), so the
            # floor does too.
            self.buffers = [buffer.pin_memory() for buffer in self.buffers]

    def prepare(self, variant: str) -> Any:
        """What `variant` loads into, built before its timing starts."""
        if variant in ("verl_ckpt load", "verl_ckpt load + verify", "megatron-core load"):
            return self.templates()
        if variant == "DCP load":
            from torch.distributed.device_mesh import init_device_mesh

            # Where the state lives: the host here, the GPU in benchmarks/cuda_path.
            device_type = self.state.params[0].device.type
            mesh = init_device_mesh(device_type, (self.state.spec.world_size,))
            return self.state.dtensor_state_dict(mesh)
        return None

    def templates(self) -> dict[str, Any]:
        return {
            "model": self.state.model_sharded_state_dict(),
            "optimizer": self.state.optimizer_sharded_state_dict(),
        }

    def run(self, variant: str, prepared: Any = None) -> dict[str, Any] | None:
        """One load by `variant` into `prepared` (from `prepare(variant)`); for verl_ckpt's
        loads, where the time went (LoadStats, as a dict)."""
        if variant in READ_FLOORS:
            self._read_floor(large=variant == "read floor, large reads")
        elif variant in ("verl_ckpt load", "verl_ckpt load + verify"):
            verify = variant == "verl_ckpt load + verify"
            return self.verl.load(self.role_dir.parent, prepared, verify=verify)
        elif variant == "megatron-core load":
            from megatron.core import dist_checkpointing

            dist_checkpointing.load(prepared, str(self.role_dir))
        elif variant == "DCP load":
            import torch.distributed.checkpoint as dcp

            dcp.load(prepared, checkpoint_id=str(self.dcp_dir))
        elif variant == "building the templates":
            self.templates()
        else:
            raise ValueError(f"unknown load variant {variant!r}")
        return None

    def timed(self, variant: str, clock: Callable[[Callable[[], None]], float]) -> float:
        """`variant`'s load, its inputs prepared before `clock` starts timing it."""
        prepared = self.prepare(variant)
        return clock(lambda: self.run(variant, prepared))

    def _read_floor(self, large: bool) -> None:
        # One thread per file, as the direct reader reads them: from a cold page cache two
        # streams read faster than one here, and a floor must be the least a load can cost.
        with ThreadPoolExecutor(max(1, len(self.files))) as pool:
            list(pool.map(_read_whole, self.files, self.buffers, [large] * len(self.files)))


def _read_whole(path: Path, buffer: torch.Tensor, large: bool = False) -> None:
    """Read the file with plain reads into `buffer` (`large`: see READ_FLOORS)."""
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        chunk = _LARGE_CHUNK if large else _CHUNK
        if large and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset = 0
        while read := os.readv(fd, [view[offset : offset + chunk]]):
            offset += read
    finally:
        os.close(fd)


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """Write back, then drop the page cache (root only): the next reads come from disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def load_table(found: dict[str, dict[str, list[float]]]) -> tuple[str, list[str]]:
    """found[cache][variant] = seconds per rep (slowest rank). Table and verdict lines."""
    body, verdicts = [], []
    for cache, by_variant in found.items():
        med = {v: _median(t) for v, t in by_variant.items() if t}
        floor = min((med[v] for v in READ_FLOORS if v in med), default=None)
        for variant in LOAD_VARIANTS:
            if variant in med:
                ratio = med[variant] / floor if floor else None
                body.append(
                    [cache, variant, _f(med[variant]), _x(ratio, 3), str(len(by_variant[variant]))]
                )
        ours, mcore, dcp, templates = (
            med.get(v)
            for v in ("verl_ckpt load", "megatron-core load", "DCP load", "building the templates")
        )
        if ours and floor:
            ahead = all(peer is None or ours < peer for peer in (mcore, dcp))
            verdicts.append(
                f"{cache} cache: verl_ckpt load {_x(ours / floor, 3)} of the read floor "
                f"(target {LOAD_TARGET}x: {'MET' if ours / floor <= LOAD_TARGET else 'MISSED'}); "
                f"ahead of both peers: {'MET' if ahead else 'MISSED'} (megatron-core "
                f"{_f(mcore)} s, DCP {_f(dcp)} s, ours {_f(ours)} s); each into state dicts "
                f"built beforehand (building the templates: {_f(templates)} s "
                "more, for verl_ckpt and megatron-core alike)"
            )
    table = _table(["page cache", "variant", "median s", "vs read floor", "runs"], body)
    table += "\n\nThe read floor of each row's ratio is the fastest of: " + ", ".join(READ_FLOORS)
    return table, verdicts


def load_cpu_tables(detail: dict[str, dict[str, list[list[dict[str, Any]]]]]) -> str:
    """From load_detail[cache][variant] (per rep, each rank's time_variant()): the CPU each
    rank spent per load, and where verl_ckpt's load went on its calling thread (LoadStats).
    Medians over ranks and reps."""
    cpu_rows = []
    for cache, by_variant in detail.items():
        for variant in LOAD_VARIANTS[:-1]:
            ranks = [o for rep in by_variant.get(variant, []) for o in rep]
            if not ranks:
                continue
            wall = _median([o["seconds"] for o in ranks])
            user = _median([o["user_s"] for o in ranks])
            system = _median([o["system_s"] for o in ranks])
            busy = _median([(o["user_s"] + o["system_s"]) / o["seconds"] for o in ranks])
            cpu_rows.append([cache, variant, _f(wall), _f(user), _f(system), _x(busy)])
    cpu = _table(
        ["page cache", "variant", "wall s (rank)", "user CPU s", "system CPU s", "CPU / wall"],
        cpu_rows,
    )
    phases: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    totals: dict[str, tuple[list[float], list[float]]] = {}
    for cache, by_variant in detail.items():
        for rep in by_variant.get("verl_ckpt load", []):
            for out in rep:
                stats = out.get("stats")
                if not stats:
                    continue
                for phase, wall in stats["phases_s"].items():
                    walls, cpus = phases.setdefault(phase, {}).setdefault(cache, ([], []))
                    walls.append(wall)
                    cpus.append(stats["phases_cpu_s"][phase])
                walls, cpus = totals.setdefault(cache, ([], []))
                walls.append(stats["load_s"])
                cpus.append(stats["cpu_s"])
    caches = list(totals)

    def cells(by_cache: dict[str, tuple[list[float], list[float]]]) -> list[str]:
        out = []
        for cache in caches:
            walls, cpus = by_cache.get(cache, ([], []))
            out += [_ms(walls), _ms(cpus)]
        return out

    header = ["phase (calling thread)"] + [
        f"{c} {k}" for c in caches for k in ("wall ms", "CPU ms")
    ]
    rows = [[phase] + cells(by_cache) for phase, by_cache in phases.items()]
    rows.append(["the whole load()"] + cells(totals))
    return cpu + "\n\n" + _table(header, rows)


def _ms(seconds: list[float]) -> str:
    median = _median(seconds)
    return "-" if median is None else f"{median * 1e3:.1f}"


def warm_page_cache(*directories: Path) -> None:
    """Read every file under `directories` once, so that the "warm" loads find them in the
    page cache: verl_ckpt writes its files around it (writer.direct_io), so a step just
    saved is not cached by its save, as DCP's is."""
    for directory in directories:
        for path in sorted(Path(directory).rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    while f.read(8 << 20):
                        pass


def rotated_loads(
    reps: int, time_load: Callable[[str, str], float]
) -> dict[str, dict[str, list[float]]]:
    """found[cache][variant] = seconds per rep: every variant `reps` times (`time_load(cache,
    variant)`), the order rotated from one rep to the next; page cache warm, then (where the
    system lets us) dropped before every variant."""
    caches = ["warm", "cold"] if can_drop_caches() else ["warm"]
    found = {cache: {v: [] for v in LOAD_VARIANTS} for cache in caches}
    for cache in caches:
        for i in range(reps):
            shift = i % len(LOAD_VARIANTS)
            for variant in LOAD_VARIANTS[shift:] + LOAD_VARIANTS[:shift]:
                if cache == "cold":
                    drop_caches()
                found[cache][variant].append(time_load(cache, variant))
    return found


def time_variant(
    runner: LoadRunner, variant: str, align: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """One timed load in this rank, started by `align()` (the ranks' barrier) once what it
    loads into is built, with the CPU time the rank's process spent meanwhile (all its
    threads: the reading threads' copies are system time) and, for verl_ckpt's loads, where
    the calling thread's time went (LoadStats)."""
    prepared = runner.prepare(variant)
    align()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    t0 = time.time()
    stats = runner.run(variant, prepared)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "t0": t0,
        "t_end": time.time(),
        "seconds": seconds,
        "user_s": after.ru_utime - before.ru_utime,
        "system_s": after.ru_stime - before.ru_stime,
        "stats": stats,
    }


def cleanup(*paths: Path) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
