"""The CUDA staging path, measured on a GPU: `python -m benchmarks.cuda_path`.

One rank in this process holds the benchmark state (benchmarks/state.py) on the GPU, its
process group "cpu:gloo,cuda:nccl" (world size 1), the finalizer in a local Ray on 127.0.0.1.
Measured in one run, side by side:
  floors     one flat device-to-host copy into pinned memory (the pinned peak) and into
             pageable memory; the write floor (the same bytes from host memory to files,
             fsynced);
  staging    verl_ckpt's `copy_into` of the state, tensor by tensor, into its reused pinned
             slot, on the training thread's stream and on a side stream after an event (the
             deferred snapshot);
  saves      verl_ckpt thread writer with snapshot "now", "deferred" and "live" (blocking,
             fence, time to commit), against DCP `async_save` with a pinned, asynchronous,
             non-blocking `DefaultStager` (blocking, staging done, durable), same tensors;
  trainer    a burst of GPU compute (bf16 matrix products, what rollout and log-prob
             passes do in the idle window) alone, and started right after save() of each
             kind: the copy on the side stream must leave it alone;
  resume     benchmarks/loads.py's variants into the GPU tensors: a step committed by
             verl_ckpt and DCP's own save of the same tensors, loaded back with the page
             cache warm, then dropped before every variant (where the system lets us).
Writes benchmarks/results_cuda.md and results_cuda.json (or --out-dir). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch

from benchmarks.loads import READ_FLOORS
from benchmarks.state import RankState, describe, spec_for_size
from benchmarks.systems import FLOOR_VARIANTS, WriteFloor, verl_config

__all__ = ["main"]

DCP_STAGERS = {
    "DCP async_save, DefaultStager async": "default async",
    "DCP async_save, DefaultStager": "default",
    "DCP async_save, BlockingAsyncStager cached": "blocking",
}


def _seconds(fn: Callable[[], Any]) -> float:
    # Without CUDA only resume() runs (tried on a CPU state before a GPU run).
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


class ComputeBurst:
    """What the trainer's GPU does in the idle window: matrix products that touch none of the
    saved state. Timed with CUDA events (the GPU's own time for the burst)."""

    def __init__(self, products: int = 40, size: int = 8192) -> None:
        self.a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.products = products

    def run(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.products):
            torch.mm(self.a, self.b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def floors(state: RankState, reps: int) -> dict[str, list[float]]:
    tensors = list(state.tensors().values())
    nbytes = state.nbytes
    flat_device = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    pinned = torch.empty_like(flat_device, device="cpu").pin_memory()
    pageable = torch.empty_like(flat_device, device="cpu")
    pageable.zero_()
    out: dict[str, list[float]] = {"pinned peak": [], "pageable": [], "write floor": []}
    workdir = Path(tempfile.mkdtemp(prefix="cuda_floor_"))
    write_floor = WriteFloor([t.cpu() for t in tensors])
    for _ in range(reps):
        out["pinned peak"].append(_seconds(lambda: pinned.copy_(flat_device, non_blocking=True)))
        out["pageable"].append(_seconds(lambda: pageable.copy_(flat_device)))
        # The fastest way this machine makes the bytes durable (systems.FLOOR_VARIANTS).
        out["write floor"].append(
            min(_timed_write(write_floor, workdir / "floor.bin", v) for v in FLOOR_VARIANTS)
        )
    shutil.rmtree(workdir)
    return out


def _timed_write(floor: WriteFloor, path: Path, variant: str) -> float:
    start = time.perf_counter()
    floor.run(path, variant)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def staging(state: RankState, reps: int) -> dict[str, list[float]]:
    from verl_ckpt.rank.staging import StagingPool, copy_into, device_ready_events

    tensors = list(state.tensors().values())
    pool = StagingPool(slots=1, pin_memory=True)
    slot, _ = pool.acquire([str(i) for i in range(len(tensors))], tensors)
    copy_into(slot, tensors)  # warm
    out: dict[str, list[float]] = {"copy_into, training stream": [], "copy_into, side stream": []}
    for _ in range(reps):
        out["copy_into, training stream"].append(_seconds(lambda: copy_into(slot, tensors)))
        out["copy_into, side stream"].append(
            _seconds(lambda: copy_into(slot, tensors, device_ready_events(tensors)))
        )
    assert all(torch.equal(b, t.cpu()) for b, t in zip(slot.buffers, tensors, strict=True))
    pool.release(slot)
    return out


def verl_saves(
    state: RankState, root: Path, snapshot: str, reps: int, burst: ComputeBurst
) -> dict[str, list[float]]:
    from verl_ckpt import CheckpointCoordinator, CheckpointManager

    # The CPU benchmark's thread-writer config, with retention on, as a trainer runs it.
    config = {**verl_config(str(root), "thread", False, snapshot), "max_ckpt_to_keep": 2}
    coordinator = CheckpointCoordinator(config, {"bench": 1}, save_driver_state=False)
    manager = CheckpointManager(config, "bench", 0, 1)
    manager.prepare(
        model=state.model_sharded_state_dict(), optimizer=state.optimizer_sharded_state_dict()
    )
    out: dict[str, list[float]] = {
        "blocking": [],
        "fence after burst": [],
        "durable": [],
        "burst after save": [],
    }
    # The rank's own figures (SaveStats), for where the time goes.
    for key in ("stage_s", "plan_s", "begin_s", "write_s", "fsync_s"):
        out[key] = []
    try:
        for step in range(1, reps + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            stats = manager.save(
                step,
                model=state.model_sharded_state_dict(),
                optimizer=state.optimizer_sharded_state_dict(),
            )
            blocking = time.perf_counter() - start
            burst_s = burst.run()  # the idle window's compute, while the snapshot is copied
            fence_start = time.perf_counter()
            manager.fence()
            fence_s = time.perf_counter() - fence_start
            coordinator.wait_for_commit(step, timeout_s=600)
            durable = time.perf_counter() - start
            if step == 1:
                continue  # the first save of a deferred or live run copies now (it plans)
            for key, value in zip(out, (blocking, fence_s, durable, burst_s), strict=False):
                out[key].append(value)
            manager.wait()
            for key in ("stage_s", "plan_s", "begin_s", "write_s", "fsync_s"):
                out[key].append(getattr(stats, key) or 0.0)
    finally:
        manager.close()
        coordinator.close()
    return out


def dcp_saves(state: RankState, root: Path, reps: int, burst: ComputeBurst, stager: str) -> dict:
    """DCP `async_save` of the state as DTensors on a CUDA mesh (as torchtitan saves), with a
    long-lived stager: "default async" (`DefaultStager`, pinned, the device-to-host copy on
    DCP's staging thread), "default" (the same, copying inside async_save) or "blocking"
    (`BlockingAsyncStager` with its pinned staged state dict cached: torchtitan's earlier
    choice)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import (
        BlockingAsyncStager,
        DefaultStager,
        StagingOptions,
    )
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (1,))

    def new_stager() -> Any:
        if stager == "blocking":
            return BlockingAsyncStager(cache_staged_state_dict=True)
        asynchronous = stager == "default async"
        return DefaultStager(StagingOptions(True, False, asynchronous, asynchronous))

    stager_obj = new_stager()
    out: dict[str, list[float]] = {
        "blocking": [],
        "staged after burst": [],
        "durable": [],
        "burst after save": [],
        "fresh stager per save": [],
    }
    try:
        for step in range(1, reps + 2):
            # Some torch releases' async_save closes the stager it is given after the save
            # (a closed DefaultStager fails the next stage with "KeyError: <class 'type'>"):
            # there a user needs a new one, with new pinned buffers, for every save.
            fresh = _closed_by_async_save(stager_obj)
            if fresh:
                stager_obj = new_stager()
            torch.cuda.synchronize()
            start = time.perf_counter()
            response = dcp.async_save(
                state.dtensor_state_dict(mesh),
                checkpoint_id=str(root / f"step_{step}"),
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                async_stager=stager_obj,
            )
            blocking = time.perf_counter() - start
            burst_s = burst.run()
            staged_start = time.perf_counter()
            staging = getattr(response, "staging_completion", None)
            if staging is not None:
                staging.result()
            staged_s = time.perf_counter() - staged_start
            upload = getattr(response, "upload_completion", response)
            upload.result()
            durable = time.perf_counter() - start
            # Done-callbacks run in the order they were added, after result() returned: once
            # ours ran, async_save's own (which may close the stager) have run too.
            callbacks_ran = threading.Event()
            upload.add_done_callback(lambda _, ran=callbacks_ran: ran.set())
            callbacks_ran.wait(60)
            if step == 1:
                continue  # DCP's stager allocates its pinned buffers on the first save
            for key, value in zip(out, (blocking, staged_s, durable, burst_s, fresh), strict=True):
                out[key].append(value)
    finally:
        stager_obj.close()
    return out


def _closed_by_async_save(stager: Any) -> bool:
    """Whether `stager` was closed: DefaultStager.close() empties its state-dict stager's
    copy table (a private attribute; a stager without one is never taken for closed)."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    return table is not None and not table


def resume(state: RankState, root: Path, reps: int) -> dict[str, dict[str, list[float]]]:
    """Loads into the GPU state (found[cache][variant] = seconds per rep), rotated as the CPU
    benchmark rotates them; every timing starts and ends with the device synchronized."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.loads import LoadRunner, rotated_loads
    from benchmarks.systems import VerlSystem
    from verl_ckpt import CheckpointCoordinator

    device_type = state.params[0].device.type
    config = verl_config(str(root / "verl"), "thread", False)
    coordinator = CheckpointCoordinator(config, {"bench": 1}, save_driver_state=False)
    system = VerlSystem(state, str(root / "verl"), mode="thread", offload_aware=False)
    try:
        system.save(1, root)
        coordinator.wait_for_commit(1, timeout_s=600)
        system.manager.wait()
        dcp.save(
            state.dtensor_state_dict(init_device_mesh(device_type, (1,))),
            checkpoint_id=str(root / "dcp"),
        )
        runner = LoadRunner(state, system, root / "verl" / "global_step_1" / "bench", root / "dcp")
        saved = {key: t.cpu().clone() for key, t in state.tensors().items()}
        found = rotated_loads(reps, lambda _cache, variant: runner.timed(variant, _seconds))
        _check_loaded_back(state, runner, saved)
    finally:
        system.close()
        coordinator.close()
    return found


def _check_loaded_back(state: RankState, runner: Any, saved: dict[str, torch.Tensor]) -> None:
    """After the timed loads: the state still holds what was saved; then zeroed, verl_ckpt's
    load brings every value back. The timings are of loads that are right."""
    for key, tensor in state.tensors().items():
        if not torch.equal(tensor.cpu(), saved[key]):
            raise AssertionError(f"{key}: differs from the saved values after the timed loads")
    for tensor in state.tensors().values():
        tensor.zero_()
    runner.run("verl_ckpt load", runner.templates())
    for key, tensor in state.tensors().items():
        if not torch.equal(tensor.cpu(), saved[key]):
            raise AssertionError(f"{key}: loaded values differ from the saved ones")


def _init_single_rank() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    # DCP's async_save needs a CPU backend beside NCCL (it refuses an NCCL-only group).
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)


def _report(results: dict[str, Any], nbytes: int) -> str:
    lines = [f"# CUDA staging path\n\n{results['meta']['state']}\n"]
    lines.append(f"Device: {results['meta']['device']}; torch {results['meta']['torch']}.\n")
    lines.append("| what | median s | GB/s |\n|---|---|---|")
    for section in ("floors", "staging"):
        for name, values in results[section].items():
            seconds = median(values)
            lines.append(f"| {name} | {seconds:.4f} | {nbytes / seconds / 1e9:.1f} |")
    peak = median(results["floors"]["pinned peak"])
    for name in ("copy_into, training stream", "copy_into, side stream"):
        ratio = median(results["staging"][name]) / peak
        lines.append(f"\n{name}: {ratio:.2f}x the pinned peak")
    alone = median(results["burst alone"])
    write_floor = median(results["floors"]["write floor"])
    lines.append("\n| save | blocking s | snapshot wait s | durable s | burst vs alone |")
    lines.append("|---|---|---|---|---|")
    for name, values in results["saves"].items():
        wait_key = "fence after burst" if "fence after burst" in values else "staged after burst"
        lines.append(
            f"| {name} | {median(values['blocking']):.4f} | {median(values[wait_key]):.4f} "
            f"| {median(values['durable']):.3f} | "
            f"{median(values['burst after save']) / alone:.3f}x |"
        )
    lines.append(
        "\n| verl_ckpt (rank's SaveStats, median s) | copy | plan | begin | write | fsync |"
    )
    lines.append("|---|---|---|---|---|---|")
    for name, values in results["saves"].items():
        if "stage_s" in values:
            keys = ("stage_s", "plan_s", "begin_s", "write_s", "fsync_s")
            lines.append(
                f"| {name} | " + " | ".join(f"{median(values[k]):.4f}" for k in keys) + " |"
            )
    lines.append(f"\nBurst alone: {alone:.4f} s. Write floor {write_floor:.3f} s.")
    durable = {name: median(values["durable"]) for name, values in results["saves"].items()}
    dcp_runs = {name: durable[name] for name in DCP_STAGERS if name in durable}
    # Against the fastest DCP stager that ran: the strongest baseline of this run.
    fastest_dcp = min(dcp_runs, key=dcp_runs.__getitem__, default=None)
    for name, seconds in durable.items():
        if name in DCP_STAGERS:
            continue
        line = f"{name}: durable {seconds / write_floor:.2f}x the write floor"
        if fastest_dcp is not None:
            line += f", {seconds / dcp_runs[fastest_dcp]:.2f}x {fastest_dcp}'s"
        lines.append(line + ".")
    for name, values in results["saves"].items():
        if any(values.get("fresh stager per save", ())):
            lines.append(
                f"{name}: a new stager for every save (this torch's async_save closes the "
                "stager it is given), its pinned buffers allocated anew each time."
            )
    for name, error in results["errors"].items():
        lines.append(f"\n{name} failed: {error}")
    if results.get("resume"):
        from benchmarks.loads import load_table

        table, verdicts = load_table(results["resume"])
        lines.append("\n## Resume onto the GPU\n\n" + table + "\n")
        lines += [f"- {line}" for line in verdicts]
    return "\n".join(lines) + "\n"


def combined_runs(paths: list[str]) -> str:
    """The headline figures of several runs' results_cuda.json side by side, with their
    median and spread (`--combine`); nothing is re-measured. A figure a run lacks (a system
    it did not run, no resume section) is "-"."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    header = " | ".join(f"run {i}" for i in range(1, len(runs) + 1))
    lines = [f"| figure | {header} | median (spread) |", "|---" * (len(runs) + 2) + "|"]

    def row(name: str, values: list[float | None], unit: str = "s") -> None:
        shown = ["-" if v is None else f"{v:.3f}{unit}" for v in values]
        known = [v for v in values if v is not None]
        spread = f"{median(known):.3f}{unit} ({min(known):.3f}-{max(known):.3f})" if known else "-"
        lines.append(f"| {name} | " + " | ".join(shown) + f" | {spread} |")

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    def saved(run: dict, name: str, key: str) -> float | None:
        values = run.get("saves", {}).get(name, {}).get(key)
        return median(values) if values else None

    def fastest_dcp(run: dict) -> float | None:
        found = [saved(run, name, "durable") for name in DCP_STAGERS]
        return min((v for v in found if v is not None), default=None)

    floors_s = [median(run["floors"]["write floor"]) for run in runs]
    peaks = [median(run["floors"]["pinned peak"]) for run in runs]
    row("write floor", floors_s)
    for name in ("copy_into, training stream", "copy_into, side stream"):
        row(
            f"{name} / pinned peak",
            [ratio(median(r["staging"][name]), p) for r, p in zip(runs, peaks, strict=True)],
            "x",
        )
    names = sorted(
        {name for run in runs for name in run.get("saves", {})},
        key=lambda n: (n in DCP_STAGERS, n),
    )
    for key in ("blocking", "durable"):
        for name in names:
            row(f"{name}: {key}", [saved(run, name, key) for run in runs])
    for name in (n for n in names if n not in DCP_STAGERS):
        ours = [saved(run, name, "durable") for run in runs]
        row(
            f"{name}: durable / write floor",
            [ratio(o, f) for o, f in zip(ours, floors_s, strict=True)],
            "x",
        )
        row(
            f"{name}: durable / fastest DCP",
            [ratio(o, fastest_dcp(r)) for o, r in zip(ours, runs, strict=True)],
            "x",
        )
    for cache in ("warm", "cold"):
        found = [(r.get("resume") or {}).get(cache, {}) for r in runs]
        read = [min((median(f[v]) for v in READ_FLOORS if f.get(v)), default=None) for f in found]
        for variant in ("verl_ckpt load", "megatron-core load", "DCP load"):
            values = [
                ratio(median(f[variant]) if f.get(variant) else None, floor)
                for f, floor in zip(found, read, strict=True)
            ]
            row(f"resume, {cache} cache: {variant} / read floor", values, "x")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--load-reps", type=int, default=3, help="0: no resume benchmark")
    parser.add_argument("--no-saves", action="store_true", help="floors, staging, resume only")
    parser.add_argument(
        "--combine", nargs="+", metavar="JSON", help="print the runs' figures side by side"
    )
    parser.add_argument(
        "--rotate", type=int, default=0, help="start the verl_ckpt systems at this one"
    )
    args = parser.parse_args(argv)
    if args.combine:
        print(combined_runs(args.combine), end="")
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda_path needs a CUDA device")
    import ray

    from recipes.local_ray import init_local_ray

    # On loopback: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, set by benchmarks/__init__.py before
    # ray was imported (init_local_ray refuses a Ray that would bind elsewhere).
    init_local_ray(
        _node_ip_address="127.0.0.1",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
    )
    _init_single_rank()
    spec = spec_for_size(int(args.size_gib * 2**30), world_size=1)
    state = RankState(spec, rank=0, device="cuda")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="verl_ckpt_cuda_"))
    burst = ComputeBurst()
    burst.run()
    results: dict[str, Any] = {
        "meta": {
            "state": describe(spec),
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "bytes": state.nbytes,
        }
    }
    try:
        results["floors"] = floors(state, args.reps)
        results["staging"] = staging(state, args.reps)
        results["burst alone"] = [burst.run() for _ in range(args.reps)]
        results["saves"], results["errors"] = {}, {}
        systems = {
            "verl_ckpt thread, now": lambda d: verl_saves(state, d, "now", args.reps, burst),
            "verl_ckpt thread, deferred": lambda d: verl_saves(
                state, d, "deferred", args.reps, burst
            ),
            # Device tensors are copied by a live snapshot too (split_live), as by a
            # deferred one: with nothing written uncopied, its fence opens after the copy.
            "verl_ckpt thread, live": lambda d: verl_saves(state, d, "live", args.reps, burst),
        }
        # Rotated (--rotate), so that runs can tell a system's figures from its position.
        names = list(systems)
        turn = args.rotate % len(names)
        systems = {name: systems[name] for name in names[turn:] + names[:turn]}
        for name, kind in DCP_STAGERS.items():
            systems[name] = lambda d, kind=kind: dcp_saves(state, d, args.reps, burst, kind)
        for index, (name, run) in enumerate(systems.items()):
            if args.no_saves:
                break
            try:
                results["saves"][name] = run(workdir / f"system_{index}")
            except Exception as exc:  # reported, and the other systems still run
                results["errors"][name] = f"{type(exc).__name__}: {exc}"
                print(f"{name} failed: {results['errors'][name]}")
        if args.load_reps:
            results["resume"] = resume(state, workdir / "resume", args.load_reps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        ray.shutdown()
    text = _report(results, state.nbytes)
    out = Path(args.out_dir)
    (out / "results_cuda.md").write_text(text)
    (out / "results_cuda.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
