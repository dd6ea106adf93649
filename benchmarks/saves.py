"""The save benchmark: every system saves the same 2-rank state, paired with the floors.

Systems run one after another, each opened, measured and closed (freeing its buffers and
helper processes) before the next. Inside a system's block every iteration runs, in an
order rotated per iteration:
  the copy floor, the write floor, a save of the reference (verl_ckpt thread mode, kept
  open through all blocks) and a save of the system,
each one finished (durable) before the next starts. Ratios against the floors and the
reference come from the same block, so a burst of load from other work on the machine
weighs on both sides of a ratio alike.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from benchmarks.memory import MemorySampler
from benchmarks.state import StateSpec
from benchmarks.systems import (
    FLOOR_BUFFERED,
    FLOOR_VARIANTS,
    REFERENCE,
    SYSTEMS,
    verl_config,
)

__all__ = ["Op", "SaveBench", "free_port"]

CALL_TIMEOUT_S = 900.0
# Pairs of (update alone, update right after save()) per system in the next-step measurement.
# Five: the update alone varies by a fifth between pairs on a 2-core machine, and with three
# the verdict on a 1.3x target flipped between full runs of the same save path (1.13x, 1.15x,
# 1.32x).
AFTER_SAVE_PAIRS = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Op:
    """One timed operation (a floor or a save) and its figures."""

    block: str  # the system whose block it ran in
    name: str  # "copy floor", "write floor" or a system
    iteration: int  # 0 = the first save of `name` in this block
    blocking_s: float
    durable_s: float
    pair: int = -1  # ops of one iteration of one block share it (paired ratios)
    peak_extra: int | None = None  # bytes over the block's baseline, saves only
    resident_after: int | None = None
    rank_info: list[dict[str, Any]] = field(default_factory=list)
    # verl_ckpt only: what wait_for_commit returned (wall-clock times of the commit's steps),
    # and when the driver got it.
    commit: dict[str, Any] = field(default_factory=dict)


class SaveBench:
    def __init__(self, spec: StateSpec, workdir: Path, log: Any = print) -> None:
        from benchmarks.rank import RankBench

        self.spec = spec
        self.workdir = workdir
        self.log = log
        port = free_port()
        self.ranks = [
            RankBench.remote(r, spec.world_size, port, spec.hidden, spec.layers)
            for r in range(spec.world_size)
        ]
        infos = ray.get([r.info.remote() for r in self.ranks], timeout=CALL_TIMEOUT_S)
        self.pids = [i["pid"] for i in infos]
        self.state_bytes = sum(i["bytes"] for i in infos)
        self.sampler = MemorySampler(self.pids).start()
        self.ops: list[Op] = []
        self.coordinators: dict[str, Any] = {}
        self.steps: dict[str, int] = {}
        self.baselines: dict[str, int] = {}
        self.profile: str | None = None
        self.after_save: dict[str, dict[str, Any]] = {}
        # Every write floor variant's time, per pairing (the "write floor" op is the fastest).
        self.floor_variants: dict[str, list[float]] = {}
        # load_detail[cache][variant] = per rep, each rank's time_variant() (benchmarks/loads.py)
        self.load_detail: dict[str, dict[str, list[list[dict[str, Any]]]]] = {}
        self._pair = -1
        self._measure_after_save = True
        self.helper_pids: dict[int, tuple[str, float]] = {}

    # ---- blocks --------------------------------------------------------------------------

    def run(
        self, systems: list[str], saves: int, profile: bool = True, after_save: bool = True
    ) -> list[Op]:
        """The reference's own block first, then one block per other system (`after_save`:
        each block ends with the next-training-step measurement)."""
        self._measure_after_save = after_save
        self._open(REFERENCE)
        self._block(REFERENCE, saves, with_reference=False)
        if profile:
            self.profile = self._profiled_reference_save()
        for name in systems:
            if name == REFERENCE:
                continue
            try:
                self._open(name)
                self._block(name, saves, with_reference=True)
            finally:
                self._close(name)
        return self.ops  # the reference stays open for write_path(); close() closes it

    def _block(self, name: str, saves: int, with_reference: bool) -> None:
        self.log(
            f"[saves] {name}: {saves} saves, paired with the floors"
            + (f" and {REFERENCE}" if with_reference else "")
        )
        for i in range(saves):
            self._pair += 1
            plan = ["copy floor", "write floor"]
            if with_reference:
                plan.append(REFERENCE)
            plan.append(name)
            shift = i % len(plan)
            for op_name in plan[shift:] + plan[:shift]:
                if op_name == "copy floor":
                    self._copy_floor(name, i)
                elif op_name == "write floor":
                    self._write_floor(name, i)
                else:
                    self._save(name, op_name, i if op_name == name else i + 1)
            last = [o for o in self.ops if o.block == name and o.name == name][-1]
            self.log(
                f"    save {i + 1}: blocking {last.blocking_s:.3f} s, durable "
                f"{last.durable_s:.3f} s, peak extra {(last.peak_extra or 0) / 2**20:.0f} MiB"
            )
        if not self._measure_after_save:
            return
        self._after_save(name)
        after = self.after_save[name]
        self.log(
            f"    next step's update: {after['alone_s']:.3f} s alone, "
            f"{after['after_save_s']:.3f} s right after save() returned"
        )

    def _open(self, name: str) -> None:
        self._settle()
        self.baselines[name] = self.sampler.now()
        root = self.workdir / _slug(name)
        kind, options = SYSTEMS[name]
        if kind == "verl":
            from verl_ckpt import CheckpointCoordinator

            config = verl_config(str(root), **options)
            self.coordinators[name] = CheckpointCoordinator(
                config, {"bench": self.spec.world_size}, save_driver_state=False
            )
        self._get([r.open_system.remote(name, str(root)) for r in self.ranks])
        self.steps[name] = 0

    def _close(self, name: str) -> None:
        self.helper_pids.update(self.sampler.seen_children)
        self._get([r.close_system.remote(name) for r in self.ranks])
        coordinator = self.coordinators.pop(name, None)
        if coordinator is not None:
            coordinator.close()
        shutil.rmtree(self.workdir / _slug(name), ignore_errors=True)

    # ---- operations ----------------------------------------------------------------------

    def _copy_floor(self, block: str, i: int) -> None:
        self._settle()
        outs = self._get([r.floor_copy.remote() for r in self.ranks])
        blocking = max(o["blocking_s"] for o in outs)
        self.ops.append(Op(block, "copy floor", i, blocking, blocking, pair=self._pair))

    def _write_floor(self, block: str, i: int) -> None:
        """Every way of the write floor, in a rotated order; the fastest is this pairing's
        "write floor" (each variant's time is kept in floor_variants)."""
        shift = i % len(FLOOR_VARIANTS)
        times = {}
        for variant in FLOOR_VARIANTS[shift:] + FLOOR_VARIANTS[:shift]:
            times[variant] = self._floor_write_once(variant)
            self.floor_variants.setdefault(variant, []).append(times[variant])
        durable = min(times.values())
        self.ops.append(Op(block, "write floor", i, durable, durable, pair=self._pair))

    def _floor_write_once(self, variant: str) -> float:
        self._settle()
        directory = self.workdir / "write_floor"
        outs = self._get(
            [
                r.floor_write.remote(str(directory / f"rank{k}.bin"), variant)
                for k, r in enumerate(self.ranks)
            ]
        )
        shutil.rmtree(directory, ignore_errors=True)
        return max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)

    def _save(
        self,
        block: str,
        name: str,
        i: int,
        profile: bool = False,
        update: bool | None = None,
        record: bool = True,
        keep: bool = False,
        quiet: bool = False,
    ) -> tuple[Op, list[dict]]:
        """One save of `name`, waited for until durable. update=None: measured as a save;
        otherwise the ranks run a training-step-like update right after save() returned
        (offload-style if True), and the op is returned, not recorded."""
        self._settle()
        self.steps[name] += 1
        step = self.steps[name]
        root = self.workdir / _slug(name)
        directory = root / f"global_step_{step}"
        if update is None:
            calls = [r.save.remote(name, step, str(directory), profile) for r in self.ranks]
        else:
            calls = [
                r.save_then_update.remote(name, step, str(directory), update, quiet)
                for r in self.ranks
            ]
        saved = self._get(calls)
        t0 = min(s["t0"] for s in saved)
        coordinator = self.coordinators.get(name)
        commit: dict[str, Any] = {}
        if coordinator is not None:
            commit = coordinator.wait_for_commit(step)
            t_durable = time.time()
            commit["t0"], commit["durable_at"] = t0, t_durable
            waited = self._get([r.wait.remote(name) for r in self.ranks])
        else:
            waited = self._get([r.wait.remote(name) for r in self.ranks])
            t_durable = max(w["t_end"] for w in waited)
        peak = self.sampler.peak(t0, t_durable)
        op = Op(
            block,
            name,
            i,
            blocking_s=max(s["blocking_s"] for s in saved),
            durable_s=t_durable - t0,
            pair=self._pair,
            peak_extra=peak - self.baselines[name],
            resident_after=self.sampler.now() - self.baselines[name],
            rank_info=[{**s["info"], **w["info"]} for s, w in zip(saved, waited, strict=True)],
            commit=commit,
        )
        if record and not profile and update is None:
            self.ops.append(op)
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
        return op, saved

    def _profiled_reference_save(self, saves: int = 3) -> str:
        """More saves of the reference under cProfile (thread CPU time, not counted)."""
        walls = []
        for _ in range(saves):
            op, _ = self._save(REFERENCE, REFERENCE, -1, profile=True)
            walls.append(op.blocking_s)
        text = self._get([self.ranks[0].profile_text.remote()])[0]
        self._get([r.profile_text.remote() for r in self.ranks[1:]])
        return (
            f"{saves} saves, blocking (wall, slowest rank) "
            + ", ".join(f"{w:.3f} s" for w in walls)
            + "; profile of rank 0's training thread, CPU time:\n"
            + text
        )

    def _after_save(self, name: str) -> None:
        """The next training step: an update of the whole state alone, then the same update
        right after save() returned while the save's write runs, as a trainer's forward and
        backward pass runs (outside quiet()), then once more inside quiet() (as an optimizer
        step with fence_before() runs); AFTER_SAVE_PAIRS such triples, and the median of the
        paired ratios (one pair swung by several times with what else the machine did)."""
        offload = bool(SYSTEMS[name][1].get("offload_aware"))
        alone, after, quiet, ops = [], [], [], []
        for _ in range(AFTER_SAVE_PAIRS):
            self._settle()
            updates = self._get([r.update.remote(offload) for r in self.ranks])
            alone.append(max(o["update_s"] for o in updates))
            self._get([r.restore.remote() for r in self.ranks])
            for inside_quiet, found in ((False, after), (True, quiet)):
                op, saved = self._save(name, name, -1, update=offload, quiet=inside_quiet)
                self._get([r.restore.remote() for r in self.ranks])
                found.append(max(s["update_s"] for s in saved))
                ops.append(op)
        self.after_save[name] = {
            "alone_s": statistics.median(alone),
            "after_save_s": statistics.median(after),
            "slowdown": statistics.median(a / b for a, b in zip(after, alone, strict=True)),
            "in_quiet_s": statistics.median(quiet),
            "slowdown_in_quiet": statistics.median(
                a / b for a, b in zip(quiet, alone, strict=True)
            ),
            "pairs": len(alone),
            "alone_each_s": alone,
            "after_save_each_s": after,
            "in_quiet_each_s": quiet,
            "blocking_s": statistics.median(op.blocking_s for op in ops),
            "durable_s": statistics.median(op.durable_s for op in ops),
            "offload": offload,
        }

    def write_path(self, reps: int) -> dict[str, list[float]]:
        """Why time to durable exceeds the write floor: verl_ckpt's write path in pieces,
        each variant `reps` times, rotated, both ranks at once; with the write floor and
        saves of the reference (its time to durable) in the same rotation."""
        from benchmarks.systems import WRITE_PATH_VARIANTS

        self.log(
            f"[write path] {len(WRITE_PATH_VARIANTS)} variants x {reps}, with the write floor "
            f"and {REFERENCE}"
        )
        plan = ["write floor", *WRITE_PATH_VARIANTS, REFERENCE]
        found: dict[str, list[float]] = {v: [] for v in plan}
        directory = self.workdir / "write_path"
        for i in range(reps):
            shift = i % len(plan)
            for variant in plan[shift:] + plan[:shift]:
                if variant == REFERENCE:
                    op, _ = self._save(REFERENCE, REFERENCE, i + 1, record=False)
                    found[variant].append(op.durable_s)
                    continue
                self._settle()
                if variant == "write floor":
                    calls = [
                        r.floor_write.remote(str(directory / f"rank{k}.bin"), FLOOR_BUFFERED)
                        for k, r in enumerate(self.ranks)
                    ]
                else:
                    calls = [
                        r.write_path_variant.remote(variant, str(directory / f"rank{k}"))
                        for k, r in enumerate(self.ranks)
                    ]
                outs = self._get(calls)
                found[variant].append(max(o["t_end"] for o in outs) - min(o["t0"] for o in outs))
                shutil.rmtree(directory, ignore_errors=True)
        return found

    def load_bench(self, reps: int) -> dict[str, dict[str, list[float]]]:
        """Resume speed (benchmarks/loads.py): a committed step of the reference and DCP's
        own save of the same tensors, loaded back by every variant `reps` times, rotated,
        both ranks at once; page cache warm, then dropped before every variant."""
        from benchmarks.loads import (
            LOAD_VARIANTS,
            can_drop_caches,
            cleanup,
            rotated_loads,
            warm_page_cache,
        )
        from benchmarks.systems import DCP_PEER

        self._save(REFERENCE, REFERENCE, -1, record=False, keep=True)
        step_path = self.workdir / _slug(REFERENCE) / f"global_step_{self.steps[REFERENCE]}"
        dcp_dir = self.workdir / "load_dcp"
        self._open(DCP_PEER)
        try:
            self._settle()
            self._get([r.save.remote(DCP_PEER, 1, str(dcp_dir)) for r in self.ranks])
            self._get([r.wait.remote(DCP_PEER) for r in self.ranks])
        finally:
            self._close(DCP_PEER)
        role_dir = step_path / "bench"
        self._get([r.load_open.remote(REFERENCE, str(role_dir), str(dcp_dir)) for r in self.ranks])
        caches = "warm, cold" if can_drop_caches() else "warm"
        self.log(f"[loads] {len(LOAD_VARIANTS)} variants x {reps}, page cache {caches}")

        def both_ranks(cache: str, variant: str) -> float:
            outs = self._get([r.load_variant.remote(variant) for r in self.ranks])
            self.load_detail.setdefault(cache, {}).setdefault(variant, []).append(outs)
            return max(o["t_end"] for o in outs) - min(o["t0"] for o in outs)

        warm_page_cache(step_path, dcp_dir)
        found = rotated_loads(reps, both_ranks)
        cleanup(step_path, dcp_dir)
        return found

    # ---- plumbing ------------------------------------------------------------------------

    def _settle(self) -> None:
        """Flush dirty pages left by earlier work (deleted files), outside every timing."""
        os.sync()
        time.sleep(0.05)

    def _get(self, refs: list) -> list:
        return ray.get(refs, timeout=CALL_TIMEOUT_S)

    def close(self) -> list[str]:
        """Tear the ranks down; kill (by pid) any helper process they left. Returns what
        was left, for the report."""
        self.helper_pids.update(self.sampler.seen_children)
        for name in list(self.coordinators):
            try:
                self._close(name)
            except Exception as exc:  # noqa: BLE001 - tearing down anyway
                self.log(f"[saves] closing {name} failed: {exc}")
                self.coordinators.pop(name).close()
        try:
            self._get([r.shutdown.remote() for r in self.ranks])
        except Exception as exc:  # noqa: BLE001
            self.log(f"[saves] rank shutdown failed: {exc}")
        self.sampler.stop()
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        time.sleep(1.0)
        # Whatever outlived its rank is a leak: name it in the report, then kill it (by pid,
        # checked against its start time so that a recycled pid is never touched).
        left = []
        for pid, (name, created) in sorted(self.helper_pids.items()):
            if _same_process_alive(pid, created):
                left.append(f"pid {pid}: {name}")
                _kill(pid)
        return left


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _same_process_alive(pid: int, created: float) -> bool:
    """Whether the helper process seen earlier (pid and start time) still runs."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pid: int) -> None:
    """Kill a helper process that one of our ranks started and that outlived its rank."""
    import psutil

    try:
        psutil.Process(pid).kill()
    except psutil.Error:
        pass


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
