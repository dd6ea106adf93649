"""How the finalizer's commit grows with the number of ranks (8 to 4096 per step).

What is real: the `CheckpointFinalizer` actor (started by
`verl_ckpt.commit.client.start_finalizer` with participants {"actor": N}, no driver
participant, keep 2 committed steps), its `begin_step` and `report` calls over Ray, and
everything a commit does: it checks the size of every reported file (a stat each, made as
each report arrives), writes the role's `.metadata` (DCP) and `metadata.json`, the commit
record, the tracker, and deletes the step that retention drops.
What is simulated: the N ranks. One driver process plays them: it writes, per rank, one
real DCP data file holding that rank's row of one global [N, 16] tensor (DCP's own
`_write_item`, so the write results, the global metadata and the file sizes are real, and
the committed directory loads with `torch.distributed.checkpoint.load`), then sends the N
`RankReport`s packed as ranks send them (write results as one pickle, rank 0's plan metadata
pickled once per plan), so that the finalizer's intake and its forecast of the role's
`.metadata` (made at begin_step, used when every report matches) run as in a real job. Real
ranks would send them from N processes at about the same time; here the first N-1 are
submitted at once and awaited, then the last one is timed alone.

Figures per N (median over the timed steps):
- commit latency: last report sent -> tracker names the step (the driver polls the tracker
  file every ms); also when the last report's call returned (the finalizer commits in the
  background after answering it) and when `wait_for_commit` (called right after) returned:
  its event is set only once retention has deleted the dropped step;
- report intake: time for the first N-1 reports, and per report;
- begin_step: time for the N ranks' `begin_step` calls.
Then the finalizer class itself (called directly inside a helper actor) runs one step of the
largest N under cProfile, to show which functions grow faster than linearly.
"""

from __future__ import annotations

import asyncio
import cProfile
import functools
import inspect
import io
import os
import pickle
import pstats
import shutil
import statistics
import threading
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

import ray
import torch
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.store.commit_record import FileEntry
from verl_ckpt.store.fsio import ChecksummingWriter
from verl_ckpt.store.tracker import read_tracker

__all__ = ["run"]

ROLE = "actor"
FQN = "decoder.weight"
WIDTH = 16
TIMED_STEPS = 3  # after one warm-up step per N


def _rank_file(directory: Path, rank: int, world: int) -> tuple[list, FileEntry]:
    """Write rank `rank`'s shard (one row of a [world, WIDTH] tensor) as DCP would."""
    name = f"__{rank}_0.distcp"
    tensor = torch.full((1, WIDTH), float(rank))
    offsets = torch.Size([rank, 0])
    item = WriteItem(
        index=MetadataIndex(FQN, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([1, WIDTH])),
            properties=TensorProperties.create_from_tensor(tensor),
            size=torch.Size([world, WIDTH]),
        ),
    )
    with open(directory / name, "wb") as raw:
        stream = ChecksummingWriter(raw)
        result = _write_item(
            _StorageWriterTransforms(),
            stream,
            tensor,
            item,
            name,
            serialization_format=SerializationFormat.TORCH_SAVE,
        )
    return [result], FileEntry(f"{ROLE}/{name}", stream.size, stream.checksum)


def _global_metadata(world: int) -> Metadata:
    properties = TensorProperties.create_from_tensor(torch.zeros(1, WIDTH))
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size([r, 0]), sizes=torch.Size([1, WIDTH]))
        for r in range(world)
    ]
    return Metadata(
        state_dict_metadata={
            FQN: TensorStorageMetadata(properties, torch.Size([world, WIDTH]), chunks)
        }
    )


@functools.cache
def _packed_global_metadata(world: int) -> bytes:
    """Pickled once per plan, as a coordinator rank does (megatron_compat.PreparedSave)."""
    return pickle.dumps(_global_metadata(world), pickle.HIGHEST_PROTOCOL)


def _reports(step: int, world: int, directory: Path) -> list[RankReport]:
    """Each rank's report as a real rank sends it: write results packed (RankReport.pack),
    and rank 0's plan metadata in the bytes it pickled once."""
    reports = []
    for rank in range(world):
        results, entry = _rank_file(directory, rank, world)
        report = RankReport(step, ROLE, rank, world, uuid.uuid4().hex)
        report.write_results = results
        report.files = [entry]
        if rank == 0:
            report.packed_global_metadata = _packed_global_metadata(world)
        reports.append(report.pack())
    return reports


class _TrackerWatch:
    """Polls the tracker every millisecond until it names `step`; `.moved_at` is when."""

    def __init__(self, root: Path, step: int) -> None:
        self.moved_at: float | None = None
        self._root, self._step = root, step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if read_tracker(self._root) == self._step:
                    self.moved_at = time.perf_counter()
                    return
            except Exception:  # noqa: BLE001 - a tracker being replaced; poll again
                pass
            time.sleep(0.001)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._stop.set()


@functools.cache
def _begin_takes_timeout() -> bool:
    from verl_ckpt.commit.finalizer import CheckpointFinalizer

    return "timeout_s" in inspect.signature(CheckpointFinalizer.begin_step).parameters


def _begin_args(step: int, rank: int, world: int) -> tuple:
    """`begin_step`'s arguments (its signature gained a deadline over time)."""
    args: tuple = (step, ROLE, rank, world)
    return args + (120.0,) if _begin_takes_timeout() else args


def _measure(world: int, root: Path) -> list[dict[str, float]]:
    from verl_ckpt.commit.client import start_finalizer

    finalizer = start_finalizer(root, {ROLE: world}, max_ckpt_to_keep=2, timeout_s=120.0)
    figures = []
    try:
        for step in range(1, TIMED_STEPS + 2):
            t = time.perf_counter()
            directory = Path(ray.get(finalizer.begin_step.remote(*_begin_args(step, 0, world))))
            ray.get(
                [finalizer.begin_step.remote(*_begin_args(step, r, world)) for r in range(1, world)]
            )
            begin_s = time.perf_counter() - t
            reports = _reports(step, world, directory)
            os.sync()  # the files' dirty pages out of the way of the timed commit
            ray.get(finalizer.describe.remote())  # the actor is idle and warm
            t = time.perf_counter()
            ray.get([finalizer.report.remote(r) for r in reports[:-1]])
            intake_s = time.perf_counter() - t
            watch = _TrackerWatch(root, step)
            sent = time.perf_counter()
            ray.get(finalizer.report.remote(reports[-1]))
            returned = time.perf_counter()
            ray.get(finalizer.wait_for_commit.remote(step, 120.0))
            waited = time.perf_counter()
            watch.join(60)
            if read_tracker(root) != step or watch.moved_at is None:
                raise RuntimeError(f"N={world}: step {step} did not move the tracker")
            if step == 1:
                continue  # warm-up: imports in the actor, first directory listing
            figures.append(
                {
                    "tracker_s": watch.moved_at - sent,
                    "returned_s": returned - sent,
                    "waited_s": waited - sent,
                    "intake_s": intake_s,
                    "begin_s": begin_s,
                }
            )
        _check_loadable(root, TIMED_STEPS + 1, world)
    finally:
        ray.kill(finalizer, no_restart=True)
    return figures


def _check_loadable(root: Path, step: int, world: int) -> None:
    """The committed role directory is a real DCP checkpoint: load it back, no ranks."""
    import torch.distributed.checkpoint as dcp

    target = {FQN: torch.zeros(world, WIDTH)}
    dcp.load(target, checkpoint_id=str(root / f"global_step_{step}" / ROLE), no_dist=True)
    expected = torch.arange(world, dtype=torch.float32).unsqueeze(1).expand(world, WIDTH)
    if not torch.equal(target[FQN], expected):
        raise RuntimeError(f"N={world}: the committed checkpoint does not load back")


def _profile_in_process(world: int, root: Path) -> str:
    """Run the finalizer class itself (no actor) on 2 steps of N reports under cProfile.

    Step 2 is profiled: its N begin_step calls and N reports, then its commit. The commit
    normally runs in a worker thread (out of cProfile's sight), so for the profiled step the
    commit and retention functions (verl_ckpt.commit.steps) are called directly on the reports.
    """
    from verl_ckpt.commit.finalizer import CheckpointFinalizer
    from verl_ckpt.commit.steps import commit_step
    from verl_ckpt.store.retention import apply_retention

    finalizer = CheckpointFinalizer(str(root), {ROLE: world}, 2)
    profiler = cProfile.Profile()

    async def call(method: Any, *args: Any) -> Any:
        result = method(*args)
        return await result if inspect.isawaitable(result) else result

    async def one_step(step: int) -> None:
        directory = Path(await call(finalizer.begin_step, *_begin_args(step, 0, world)))
        reports = _reports(step, world, directory)
        os.sync()
        if step == 2:
            profiler.enable()
        for rank in range(1, world):
            await call(finalizer.begin_step, *_begin_args(step, rank, world))
        for report in reports[:-1]:
            await finalizer.report(report)
        if step == 2:
            commit_step(root, step, {ROLE: world}, reports)
            apply_retention(root, 2, ())
            profiler.disable()
        else:
            await finalizer.report(reports[-1])
            await call(finalizer.wait_for_commit, step, 120.0)

    async def both() -> None:
        for step in (1, 2):
            await one_step(step)

    asyncio.run(both())
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats("verl_ckpt", 8)
    stats.sort_stats("cumulative").print_stats(
        r"verl_ckpt.*\((report|commit_step|_reported_files|_complete_role|apply_retention"
        r"|committed_steps|missing|begin_step|write_commit_record|record)\)",
        12,
    )
    return "\n".join(
        line for line in out.getvalue().splitlines() if line.strip() and "List reduced" not in line
    )


def _begin_vs_kept(world: int, root: Path, kept: list[int]) -> list[tuple[int, float]]:
    """A new step's first `begin_step` (inside a rank's save()) with S committed steps of N
    ranks on disk and retention off (max_ckpt_to_keep=None, the default): the committed
    steps are copies of one real commit record of N ranks (committed_steps() reads only
    the records)."""
    from verl_ckpt.commit.client import start_finalizer

    finalizer = start_finalizer(root, {ROLE: world}, max_ckpt_to_keep=None, timeout_s=120.0)
    out = []
    try:
        directory = Path(ray.get(finalizer.begin_step.remote(*_begin_args(1, 0, world))))
        reports = _reports(1, world, directory)
        ray.get([finalizer.report.remote(r) for r in reports])
        ray.get(finalizer.wait_for_commit.remote(1, 120.0))
        record = next(p for p in (root / "global_step_1").iterdir() if p.suffix == ".json")
        present = 1
        step = 10_000
        for target in kept:
            for k in range(present + 1, target + 1):
                copy = root / f"global_step_{k + 1}"
                copy.mkdir()
                shutil.copy(record, copy / record.name)
            present = max(present, target)
            samples = []
            for _ in range(3):
                step += 1
                t = time.perf_counter()
                ray.get(finalizer.begin_step.remote(*_begin_args(step, 0, world)))
                samples.append(time.perf_counter() - t)
                # Leave the step failed (a report with an error), so that the next begin_step
                # is not held back by an uncommitted step.
                failure = Failure(ROLE, 0, Phase.WRITE, "benchmark")
                failed = RankReport(step, ROLE, 0, world, uuid.uuid4().hex, failure=failure)
                ray.get(finalizer.report.remote(failed))
                shutil.rmtree(root / f"global_step_{step}", ignore_errors=True)
            out.append((target, _median(samples)))
    finally:
        ray.kill(finalizer, no_restart=True)
    return out


@ray.remote(num_cpus=0)
class _Profiler:
    def run(self, world: int, root: Path) -> str:
        return _profile_in_process(world, root)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run(rank_counts: list[int], workdir: Path, log: Any = print) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for world in rank_counts:
            root = workdir / f"n{world}"
            figures = _measure(world, root)
            shutil.rmtree(root, ignore_errors=True)
            row = {k: _median([f[k] for f in figures]) for k in figures[0]}
            rows.append((world, row))
            log(
                f"    N={world}: commit (last report -> tracker) {row['tracker_s'] * 1e3:.1f} ms, "
                f"report intake {row['intake_s'] / max(1, world - 1) * 1e3:.2f} ms/report"
            )
        # Inside a Ray actor: the finalizer class asks Ray's runtime context whether its
        # actor was restarted.
        profiler = _Profiler.remote()
        try:
            profile = ray.get(
                profiler.run.remote(max(rank_counts), workdir / "profile"), timeout=900
            )
        finally:
            ray.kill(profiler, no_restart=True)
        kept = _begin_vs_kept(max(rank_counts), workdir / "kept", [1, 8, 32, 128])
        log(
            "    begin_step of a new step vs committed steps kept: "
            + ", ".join(f"S={k}: {v * 1e3:.0f} ms" for k, v in kept)
        )
        soak = soak_table(
            soak_run(SOAK_COMMITS, trace_memory=False), soak_run(SOAK_COMMITS, trace_memory=True)
        )
        log("\n" + soak)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _markdown(rows, profile, max(rank_counts), kept) + "\n\n" + soak


SOAK_COMMITS = 10_000
_SOAK_MARKS = (100, 1_000, 10_000)


def soak_run(commits: int = SOAK_COMMITS, trace_memory: bool = False) -> list[dict[str, float]]:
    """The finalizer class in-process (no actor), the driver its only participant, one tiny
    file per step, max_ckpt_to_keep=2, on tmpfs (fsync is free there, so that the figures
    are the finalizer's own): `commits` steps, each begin_step, write, report,
    wait_for_commit. At each mark: the median begin_step and report-to-commit latency of the
    last 100 steps, the finalizer's ledger size, and with `trace_memory` the memory traced
    since step 100 (tracemalloc, which slows Python down: latencies come from a run without
    it; CPython 3.11's pathlib intern table, which grows once to its working size, is left
    out: see tests/test_finalizer.py)."""
    import asyncio
    import gc
    import inspect
    import logging
    import pathlib
    import tempfile
    import tracemalloc

    from verl_ckpt.commit.finalizer import CheckpointFinalizer
    from verl_ckpt.format.file_writer import write_checksummed
    from verl_ckpt.store.layout import DRIVER_STATE_FILENAME

    interned = [
        tracemalloc.Filter(False, pathlib.__file__, number)
        for number, line in enumerate(inspect.getsource(pathlib).splitlines(), start=1)
        if "sys.intern(" in line
    ]
    root = Path(tempfile.mkdtemp(prefix="verl_ckpt_soak", dir="/dev/shm"))
    logging.getLogger("verl_ckpt").setLevel(logging.WARNING)
    marks: list[dict[str, float]] = []

    async def soak() -> None:
        finalizer = CheckpointFinalizer(str(root), {"driver": 1}, max_ckpt_to_keep=2)
        # Preallocated: a list of the samples would grow inside the traced region by two
        # floats per commit, about 64 bytes that are the benchmark's, not the finalizer's.
        begins, commits_s = array("d", bytes(8 * commits)), array("d", bytes(8 * commits))
        baseline = None
        for step in range(1, commits + 1):
            t = time.perf_counter()
            directory = Path(await finalizer.begin_step(step, "driver", 0, 1, 10.0))
            begins[step - 1] = time.perf_counter() - t
            written = write_checksummed(directory / DRIVER_STATE_FILENAME, lambda s: s.write(b"x"))
            entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)
            t = time.perf_counter()
            await finalizer.report(RankReport(step, "driver", 0, 1, str(step), files=[entry]))
            await finalizer.wait_for_commit(step, 10.0)
            commits_s[step - 1] = time.perf_counter() - t
            if step == 100 and trace_memory:
                gc.collect()
                tracemalloc.start()
                baseline = tracemalloc.take_snapshot().filter_traces(interned)
            if step in _SOAK_MARKS:
                gc.collect()
                grown = 0.0
                if baseline is not None:
                    now = tracemalloc.take_snapshot().filter_traces(interned)
                    grown = sum(d.size_diff for d in now.compare_to(baseline, "filename"))
                marks.append(
                    {
                        "commits": step,
                        "begin_ms": _median(begins[step - 100 : step]) * 1e3,
                        "commit_ms": _median(commits_s[step - 100 : step]) * 1e3,
                        "ledger": finalizer.status()["ledger_size"],
                        "grown_kib": grown / 1024,
                    }
                )
        tracemalloc.stop()

    try:
        asyncio.run(soak())
    finally:
        logging.getLogger("verl_ckpt").setLevel(logging.NOTSET)
        shutil.rmtree(root, ignore_errors=True)
    return marks


def soak_table(timed: list[dict[str, float]], traced: list[dict[str, float]]) -> str:
    rows = "\n".join(
        f"| {m['commits']:,} | {m['begin_ms']:.3f} | {m['commit_ms']:.3f} | {m['ledger']:.0f} | "
        f"{t['grown_kib']:.1f} |"
        for m, t in zip(timed, traced, strict=True)
    )
    return (
        f"Soak: {SOAK_COMMITS:,} commits of the finalizer alone (in-process, the driver its "
        "only participant, a tiny file per step, keep 2, on tmpfs). Medians of the last 100 "
        "steps at each mark (a run without tracing); memory traced since step 100 in a second "
        "run (pathlib's intern table left out).\n\n"
        "| commits | begin_step ms | report -> committed ms | steps in the ledger | "
        "memory grown since step 100 KiB |\n|---|---|---|---|---|\n" + rows
    )


def _markdown(
    rows: list[tuple[int, dict[str, float]]],
    profile: str,
    largest: int,
    kept: list[tuple[int, float]],
) -> str:
    lines = [
        "| ranks N | commit: last report -> tracker ms | last report call returned ms | "
        "wait_for_commit returned ms | per rank us (commit / N) | intake of N-1 reports s | "
        "per report ms | begin_step x N s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, r in rows:
        lines.append(
            f"| {world} | {r['tracker_s'] * 1e3:.1f} | {r['returned_s'] * 1e3:.1f} | "
            f"{r['waited_s'] * 1e3:.1f} | "
            f"{r['tracker_s'] / world * 1e6:.0f} | {r['intake_s']:.2f} | "
            f"{r['intake_s'] / max(1, world - 1) * 1e3:.2f} | {r['begin_s']:.2f} |"
        )
    growth = []
    for (w0, r0), (w1, r1) in zip(rows, rows[1:]):
        scale = w1 / w0
        per_report = (r1["intake_s"] / (w1 - 1)) / (r0["intake_s"] / max(1, w0 - 1))
        growth.append(
            f"N {w0} -> {w1} (x{scale:g}): commit x{r1['tracker_s'] / r0['tracker_s']:.1f}, "
            f"intake per report x{per_report:.2f}"
        )
    return (
        __doc__.split("\n\n", 1)[1].strip()
        + "\n\nMedian of "
        + f"{TIMED_STEPS} steps per N after a warm-up step:\n\n"
        + "\n".join(lines)
        + "\n\nGrowth: "
        + "; ".join(growth)
        + f"\n\nIn-process cProfile of one step with N={largest} (begin_step x N, N reports, the "
        "commit; by own time, then cumulative):\n\n```\n"
        + profile
        + "\n```"
        + f"\n\nA new step's first begin_step (called inside a rank's save(), so blocking) with S "
        f"committed steps of N={largest} ranks kept on disk (max_ckpt_to_keep=None, the "
        "default), median of 3:\n\n| committed steps kept S | begin_step ms |\n|---|---|\n"
        + "\n".join(f"| {k} | {v * 1e3:.1f} |" for k, v in kept)
    )
