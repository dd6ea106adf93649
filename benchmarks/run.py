"""`python -m benchmarks.run`: verl_ckpt against its peers and the floors, in one command.

    python -m benchmarks.run                      # full run: 1 GiB state, 4 saves per system
    python -m benchmarks.run --quick              # smoke run (~1-2 min): small state, 3 saves
    python -m benchmarks.run --size-gib 0.5 --saves 6 --systems "verl_ckpt thread,torch.save"
    python -m benchmarks.run --finalizer-scale    # only the finalizer benchmark (4096, 16,384)
    python -m benchmarks.run --recipe             # also: recipe step time with/without saves

Writes benchmarks/results.md and benchmarks/results.png (or --out-dir). Starts its own Ray
on 127.0.0.1 and shuts it down; removes its temporary directory.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

# megatron-core warns about optional CUDA extensions at import.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.systems import SYSTEMS

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small state, 3 saves, small scale")
    parser.add_argument("--size-gib", type=float, help="whole state over both ranks (default 1)")
    parser.add_argument("--saves", type=int, help="saves per system (default 4; quick 3)")
    parser.add_argument(
        "--systems",
        help="comma-separated subset of: " + ", ".join(SYSTEMS) + " (default: all)",
    )
    parser.add_argument(
        "--finalizer-scale",
        action="store_true",
        help="run only the finalizer scale benchmark (writes results_finalizer.md)",
    )
    parser.add_argument(
        "--with-finalizer-scale",
        action="store_true",
        help="add the finalizer scale benchmark to the save benchmark (about 2-3 min more)",
    )
    parser.add_argument(
        "--ranks",
        default=None,
        help="simulated rank counts of the finalizer benchmark, multiples of 8 (default "
        "4096,16384; quick 512,4096); the smallest is also measured without batching",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="also compare time to durable with DCP async_save at these state sizes in GiB "
        "(default 0.25,2; quick: none; 'none' to skip)",
    )
    parser.add_argument("--recipe", action="store_true", help="also time recipes.ppo_toy steps")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile'd save")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the write-path breakdown")
    parser.add_argument("--no-load", action="store_true", help="skip the load (resume) benchmark")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: /tmp)")
    parser.add_argument("--out-dir", default=str(HERE), help="where results.md/.png go")
    parser.add_argument("--verbose", action="store_true", help="show the actors' logs")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="run this many busy-looping processes (nice 0) beside the ranks for the whole run, "
        "as other work on a shared host (default 0)",
    )
    args = parser.parse_args(argv)
    args.size_gib = args.size_gib or (0.125 if args.quick else 1.0)
    args.saves = args.saves or (3 if args.quick else 4)
    if args.saves < 2:
        parser.error("--saves must be >= 2 (the first save is reported apart)")
    names = [s.strip() for s in args.systems.split(",")] if args.systems else list(SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose among {list(SYSTEMS)}")
    args.system_names = names
    sizes = args.sizes if args.sizes is not None else ("none" if args.quick else "0.25,2")
    args.size_list = [] if sizes == "none" else [float(x) for x in sizes.split(",")]
    if args.ranks:
        args.rank_counts = [int(x) for x in args.ranks.split(",")]
    elif args.quick:
        args.rank_counts = [512, 4096]
    else:
        args.rank_counts = [4096, 16_384]
    if any(n < 8 or n % 8 for n in args.rank_counts):
        parser.error("--ranks: the finalizer benchmark simulates nodes of 8 ranks")
    return args


def log(message: str) -> None:
    print(message, flush=True)


def start_ray(verbose: bool) -> None:
    from recipes.local_ray import init_local_ray

    pythonpath = str(REPO_ROOT)
    init_local_ray(  # never attach to another Ray on this machine
        _node_ip_address="127.0.0.1",
        num_cpus=4,
        include_dashboard=False,
        namespace="verl_ckpt_bench",
        log_to_driver=verbose,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
            }
        },
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.workdir is not None:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)  # as --out-dir: made if missing
    workdir = Path(tempfile.mkdtemp(prefix="verl_ckpt_bench_", dir=args.workdir))
    import ray

    from benchmarks import report

    meta = report.machine_description()
    meta["command"] = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    sections: list[tuple[str, str]] = []
    rows = []
    begin = time.perf_counter()
    busy = _start_busy(args.busy)
    if busy:
        meta["beside"] = f"{len(busy)} busy-looping process(es), nice 0 (--busy)"
    start_ray(args.verbose)
    try:
        if not args.finalizer_scale:
            rows = run_saves(args, workdir, meta, sections)
            if args.size_list:
                sections.append(run_sizes(args, workdir))
        if args.finalizer_scale or args.with_finalizer_scale:
            sections.append(run_finalizer_scale(args, workdir))
        if args.recipe:
            sections.append(run_recipe(args, workdir))
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        for process in busy:  # ours, by pid
            process.kill()
            process.wait(30)
    meta["wall time of this run"] = f"{time.perf_counter() - begin:.0f} s"
    # The finalizer benchmark alone must not overwrite the save results of a full run.
    md = out_dir / ("results_finalizer.md" if args.finalizer_scale else "results.md")
    report.write_markdown(md, sections, meta)
    log(f"\nwrote {md}")
    if rows:
        problem = report.plot(rows, out_dir / "results.png", _plot_title(meta, args))
        log(problem or f"wrote {out_dir / 'results.png'}")
    return 0


def _start_busy(count: int) -> list[subprocess.Popen]:
    """`count` processes that loop on a core each, as other work on a shared host does."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _plot_title(meta: dict, args: argparse.Namespace) -> str:
    return (
        f"{args.size_gib:g} GiB state over 2 ranks, {args.saves} saves per system; "
        f"{meta['cpu']}, torch {meta['torch']}, megatron-core {meta['megatron-core']}"
    )


def run_saves(
    args: argparse.Namespace, workdir: Path, meta: dict, sections: list[tuple[str, str]]
) -> list:
    from benchmarks import report
    from benchmarks.mcore_cpu import CPU_WORKAROUND
    from benchmarks.saves import SaveBench
    from benchmarks.state import describe, spec_for_size

    spec = spec_for_size(int(args.size_gib * 2**30))
    meta["state"] = describe(spec)
    meta["saves per system"] = str(args.saves)
    log(f"[saves] state: {describe(spec)}; workdir {workdir}")
    bench = SaveBench(spec, workdir, log)
    left: list[str] = []
    write_path: dict[str, list[float]] = {}
    loads: dict[str, dict[str, list[float]]] = {}
    try:
        ops = bench.run(args.system_names, args.saves, profile=not args.no_profile)
        if not args.no_breakdown:
            write_path = bench.write_path(reps=2 if args.quick else 3)
        if not args.no_load:
            # Five repetitions: a cold read on this disk swings by half from one to the next.
            loads = bench.load_bench(reps=2 if args.quick else 5)
    finally:
        left = bench.close()
    raw = {
        "meta": meta,
        "ops": [asdict(o) for o in ops],
        "after_save": bench.after_save,
        "floor_variants": bench.floor_variants,
        "write_path": write_path,
        "loads": loads,
        "load_detail": bench.load_detail,
        "profile": bench.profile,
    }
    (Path(args.out_dir) / "results.json").write_text(json.dumps(raw, indent=1, default=str))
    rows = report.summarize(ops, args.system_names)
    tables = report.timing_tables(rows)
    memory = report.memory_table(rows)
    goals = report.targets(rows, bench.after_save)
    log("\n" + tables + "\n\n### Memory\n\n" + memory + "\n\n### Targets (verl_ckpt thread)\n")
    for line in goals:
        log("- " + line)
    sections.append(("Save benchmark: timings", tables))
    floors = report.floor_variants_table(bench.floor_variants)
    log("\n### The write floor, each way\n\n" + floors)
    sections.append(("The write floor, each way", floors + "\n\n" + report.FLOOR_NOTE))
    sections.append(("Save benchmark: memory", memory + "\n\n" + MEMORY_NOTE))
    sections.append(("Targets (verl_ckpt thread mode, steady state)", _bullets(goals)))
    after = report.after_save_table(bench.after_save)
    log("\n### The next training step, right after save() returned\n\n" + after)
    sections.append(
        (
            "The next training step, right after save() returned",
            after + "\n\n" + report.AFTER_SAVE_NOTE,
        )
    )
    timeline = report.durable_timeline(ops)
    log("\n### Where time to durable goes, step by step\n\n" + timeline)
    sections.append(("Where verl_ckpt's time to durable goes, step by step", timeline))
    if write_path:
        text = report.write_path_table(write_path)
        log("\n### Where time to durable goes (write path)\n\n" + text)
        sections.append(("Where the write itself goes", text + "\n\n" + WRITE_PATH_NOTE))
    if loads:
        from benchmarks.loads import load_cpu_tables, load_table

        table, verdicts = load_table(loads)
        text = table + "\n\n" + _bullets(verdicts) + "\n\n" + LOAD_NOTE
        log("\n### Resume: loading a committed step\n\n" + text)
        sections.append(("Resume: loading a committed step", text))
        text = load_cpu_tables(bench.load_detail) + "\n\n" + LOAD_CPU_NOTE
        log("\n### Where a load's time goes\n\n" + text)
        sections.append(("Where a load's time goes", text))
    sections.append(
        (
            "Where verl_ckpt's blocking time goes",
            report.verl_breakdown(ops)
            + "\n\n"
            + BREAKDOWN_NOTE
            + (
                "\n\ncProfile of more saves of verl_ckpt thread mode (rank 0's training thread, "
                "by CPU time, cumulative):\n\n"
                "```\n" + report.profile_excerpt(bench.profile) + "\n```"
                if bench.profile
                else ""
            ),
        )
    )
    notes = [CPU_WORKAROUND] + SYSTEM_NOTES
    notes.append(
        "helper processes left after the ranks exited: "
        + ("; ".join(left) + " (killed by pid)" if left else "none")
    )
    sections.append(("How each system was run", _bullets(notes)))
    return rows


def run_sizes(args: argparse.Namespace, workdir: Path) -> tuple[str, str]:
    from benchmarks.sizes import run_sizes as sweep
    from benchmarks.sizes import sizes_table

    found = sweep(args.size_list + [args.size_gib], args.saves, workdir, log)
    table, verdicts = sizes_table(sorted(found, key=lambda f: f["size_gib"]))
    text = table + "\n\n" + _bullets(verdicts)
    log("\n### Time to durable against DCP async_save, by state size\n\n" + text)
    return ("Time to durable against DCP async_save, by state size", text)


def run_finalizer_scale(args: argparse.Namespace, workdir: Path) -> tuple[str, str]:
    from benchmarks.finalizer_scale import run as run_scale

    log(f"\n[finalizer] simulated ranks per step: {args.rank_counts}")
    text = run_scale(args.rank_counts, workdir / "finalizer", log)
    log("\n" + text)
    return ("Finalizer scale", text)


def run_recipe(args: argparse.Namespace, workdir: Path) -> tuple[str, str]:
    from benchmarks.recipe_bench import run as run_recipe_bench

    text = run_recipe_bench(workdir / "recipe", log, quick=args.quick)
    log("\n" + text)
    return ("Recipe: training step time with and without background saves", text)


def _bullets(lines: list[str]) -> str:
    return "\n".join(f"- {line}" for line in lines)


MEMORY_NOTE = (
    "Peak extra: the highest resident memory of both rank processes (RSS, sampled every 5 ms) "
    "plus every process they started (USS, every 100 ms), during the save (from its start to "
    "durable), minus the same total just before the system was opened: it includes what the "
    "system keeps between saves (staging buffers, writer processes). Held after each save: "
    "the same total once the save is durable, minus the baseline. Shared memory is counted "
    "once (in the rank that touched it); a forked child's pages shared with its parent are "
    "not counted again. Figures within about 100 MiB of 0 are allocator noise (memory freed "
    "earlier and returned to the OS late); below 0 is shown as 0."
)

BREAKDOWN_NOTE = (
    "Slowest rank, median of steady saves. blocking (measured) is what the tables use: it "
    "includes building the model's and optimizer's sharded state dicts, as a trainer's save "
    "does (megatron-core systems build the same dicts; DCP builds DTensors). manager.save() "
    "and the parts after it are verl_ckpt's own SaveStats: stage = copying into the staging "
    "pool; plan = structure description, the group agreement (issued and checked on the save "
    "thread when the plan is cached; waited for, with validation, when re-planning), and "
    "megatron-core planning (on the save thread when the plan is cached: "
    "mcore_to_pyt_state_dict, save_state_dict_async_plan, prepare_write_data), copying "
    "common.pt's state; rest = back-pressure wait, composing, submitting the write (and, "
    "for a save that re-plans, the `begin_step` round trip to the finalizer actor)."
)

WRITE_PATH_NOTE = (
    "Each variant writes the rank's 504 MiB (at the default size) on both ranks at once, "
    "like the systems, fsync included: `raw + xxh3_64` (verl_ckpt's checksum) and `raw + "
    "crc32` (zlib's, used before) are the write floor with that checksum over the bytes on "
    "the writing thread; `write floor, early writeback` is the write floor handing its bytes "
    "to the disk every 4 MiB (sync_file_range) as verl_ckpt's stream does; `plain files x1` "
    "is verl_ckpt's CRC-free torch.save blobs (torch_format.py) into one file, without its "
    "checksumming stream; `verl files xN` is verl_ckpt's own `file_writer.write_bucket` (the "
    "same blobs, its checksumming stream with early writeback) into N files by N threads, as "
    "its writer runs it; `, no early writeback` the same with the writeback off; `, DCP items "
    "with torch's crc32` the blobs written by DCP's `_write_item` (torch.save with its CRC32, "
    "what verl_ckpt wrote before), also without early writeback; `copy, then write floor` is "
    "the copy floor followed by the write floor, the least a design that snapshots by "
    "copying and then writes can take."
)

LOAD_NOTE = (
    "Each variant loads this rank's share of the state into the ranks' live tensors, both "
    "ranks at once, slowest rank counted; rotated order. The read floors read the files this "
    "rank wrote with plain reads into a buffer allocated beforehand, one thread per file, in "
    "reads of 16 MiB, or of 64 MiB with the kernel told that each file is read sequentially; "
    "each ratio is against the faster of the two. Both ranks start each "
    "timed load together (a barrier once its state dicts are built). Each load is timed from "
    "its call into state dicts built beforehand, as the issue defines it (`load()` into the "
    "templates): the sharded templates (verl_ckpt, megatron-core) or DTensors (DCP) come from "
    "the trainer's own code, the same whichever system loads; `building the templates` times "
    "the model's and optimizer's sharded_state_dict() alone. Warm: the page cache "
    "holds the files (they were just written); cold: the page cache is dropped "
    "(/proc/sys/vm/drop_caches) before every variant, as on a node that did not write them."
)

LOAD_CPU_NOTE = (
    "The same loads as above, per rank (medians over both ranks and every rep). First: the "
    "CPU time each rank's process spent during one load, all its threads (the copies from the "
    "page cache into memory are system time, in the reading threads), and that time over the "
    "load's wall time: both ranks share the machine's cores, so where the two ranks' CPU "
    "fills them, a load can only be as short as its CPU time allows. Second: where "
    "verl_ckpt's load went on the thread that called load() (`CheckpointManager.last_load`, "
    "verl_ckpt/format/load_stats.py): during `reads in place` it waits for the reading threads; "
    "every other phase is Python on that thread (the checkpoint's `.metadata`, megatron-core's "
    "conversions, matching tensors to saved chunks), the fixed cost a load pays above the "
    "read floor, whatever the state's size."
)

SYSTEM_NOTES = [
    "verl_ckpt: CheckpointManager per rank (save_contents model+optimizer, writer.threads=2), "
    "CheckpointCoordinator in the driver; time to durable ends when `wait_for_commit` returns "
    "(files fsynced, .metadata/metadata.json and commit record written, tracker moved).",
    "verl_ckpt thread write while copying: writer.write_while_copying=true, a save whose "
    "plan is reused starts writing while save() still copies, each tensor once its copy "
    "ended, instead of once the whole copy ended (the trade-off: blocking against time to "
    "durable).",
    "verl_ckpt thread write while copying in the normal class: the same with writer.idle_class="
    "false: the writer threads run at nice 10 in the normal class, so they take a share of the "
    "cores during the copy; in the idle class they run only where a core is left.",
    "verl_ckpt thread offload_aware: staging.offload_aware=true; the optimizer state lives on "
    "the host (as an offloaded optimizer does), so exp_avg/exp_avg_sq are written from the "
    "live tensors and only the parameters are copied: it copies a third of the bytes the copy "
    "floor copies.",
    "torch.save: one file per rank of the rank's tensors (params, exp_avg, exp_avg_sq), then "
    "fsync; blocking = durable.",
    "mcore sync: megatron-core `dist_checkpointing.save(..., async_sharded_save=False)` with the "
    "torch_dist strategy (thread_count=2, no cached metadata, as verl configures it), "
    "validation on; its writer forks one process per file.",
    "mcore async (fork): `dist_checkpointing.save(..., async_sharded_save=True)` + "
    "`AsyncCallsQueue` (TemporalAsyncCaller: a fork per save) as verl's Megatron checkpoint "
    "manager drives it; finalized with `maybe_finalize_async_calls(blocking=True)` right after "
    "the save returns (the earliest a trainer polling every step could). On CPU its preload is "
    "no copy (`tensor.to('cpu')` returns the tensor), so its snapshot is the fork's "
    "copy-on-write: cheap to take, paid later as page faults when the trainer writes to its "
    "tensors while the child still runs (see the next-step table). On GPU it would copy "
    "device to host before forking. verl wraps the strategy in "
    "FullyParallelSaveStrategyWrapper; with DP=1 (2 ranks at TP=2) it has nothing to spread, "
    "so it is left out.",
    "DCP async thread / process: `torch.distributed.checkpoint.async_save` of DTensors "
    "(Shard/Replicate on a 1-D CPU mesh) with AsyncCheckpointerType.THREAD or .PROCESS and one "
    "long-lived DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=<True "
    "for the process executor>, use_async_staging=False, use_non_blocking_copy=False)); pinned "
    "memory, async staging and non-blocking copies all need an accelerator on torch 2.13. The "
    "stager caches its storages, so from the second save on it copies into reused memory; the "
    "process executor's checkpoint process (spawned, with its own gloo group) starts at the "
    "first save.",
    "Floors: copy = `copy_` of every tensor into buffers allocated and touched beforehand; "
    "write = `os.write` of the same bytes into one file per rank, then fsync. Both ranks run "
    "in parallel, like the systems; the slowest rank counts.",
    "Each save's directory is deleted once durable, and `os.sync()` runs before every timed "
    "operation, both outside the timings.",
]


if __name__ == "__main__":
    sys.exit(main())
