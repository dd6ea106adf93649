"""Commit intake at scale: every rank finishing a step at once, 4096 and 16,384 ranks.

What is real: the `CheckpointFinalizer` actor (started by
`verl_ckpt.commit.client.start_finalizer` with participants {"actor": N}, no driver
participant, keep 2 committed steps), its `begin_batch`, `begin_step`, `report_batch` and
`report` calls over Ray, and everything a commit does: it checks the size of the reported
files (one of each node per batch as the batch arrives, trusting the node's check of the
others; every file of a rank's own `report`), writes the role's `.metadata` (DCP) and
`metadata.json`,
the commit record, the tracker, and deletes the step that retention drops. The batches are
packed as aggregators pack them (`verl_ckpt.protocol.messages.ReportBatch`).
What is simulated: the ranks and their nodes, 8 ranks a node (512 nodes at 4096 ranks, 2,048
at 16,384), in rank groups of GROUP_SIZE (report_group_size's default). A few Ray actors
(`_NodeGroup`, one process per set of whole rank groups) play them: each writes, per rank of
its nodes, one real (tiny) DCP data file holding that rank's row of one global [N, 16]
tensor (DCP's own `_write_item`, so the write results, the global metadata and the file
sizes are real, and the committed directory loads with `torch.distributed.checkpoint.load`),
and makes the rank's `RankReport` packed as a rank does (with the save id its begin
registered, as a rank's CheckpointManager does), with what its node aggregator adds on the
node (its check of the rank's file, the node's name). Then every rank finishes at once:
at one agreed instant (`time.monotonic()`, one clock for every process of the machine) the
batches that reach the finalizer in a real job leave for it over Ray: one `report_batch`
per rank group (mode "group", the default configuration), per node (mode "node",
report_group_size=0), or one `report` per rank (mode "rank", no batching).
What is measured apart: in a real job each rank's report first crosses one Ray call to its
node's aggregator, and each node's batch one more to its group's aggregator, every node and
every group in parallel on their own cores. A 2-core machine cannot run 2,048 nodes' worth
of those in parallel, so the benchmark forms the batches before the instant and measures the
two hops apart, each on a real aggregator actor taking all its callers' real calls at once
(`_hop_latencies`; the node's aggregator checks its ranks' real files); the verdict adds
them to what the finalizer hop measured. Each hop's
floor is measured the same way: the same callers' same calls straight to an actor that only
unpacks them and answers (for the finalizer hop, the last step's batches again): what Ray's
calls alone cost on this machine, below which no intake can go.

Figures per N (median over the timed steps, after a warm-up step):
- committed after the last rank's write, at the finalizer: the agreed instant (every batch
  leaves) -> the tracker names the step (the driver polls the tracker file every ms); and
  with the node and group hops added (the verdict);
- every report answered: the agreed instant -> the finalizer answered the last batch (the
  answers' way back through the aggregators is not added);
- the finalizer's CPU time over the same span (its work, whatever the machine's load);
- the begins: the N ranks' begins as they reach the finalizer, all at once (one
  `begin_batch` per rank group or per node as the aggregators forward them, or one
  `begin_step` per rank), until the last answer; and Ray's floor of the same calls to an
  actor that only answers (the last step's, once). A begin crosses the same node and
  group hops as a report, there and back: not added here;
- the finalizer's resident memory (VmRSS) after each step.
The same at 4096 ranks per node and per rank shows what each level changes. Then the
finalizer class itself (called directly inside a helper actor) takes one step of the
largest N in group batches under cProfile, to show what grows with the ranks.
"""

from __future__ import annotations

import asyncio
import cProfile
import dataclasses
import functools
import gc
import inspect
import io
import logging
import os
import pickle
import pstats
import shutil
import statistics
import threading
import time
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
from verl_ckpt.protocol.messages import RankReport, ReportBatch, batch_reports
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import ChecksummingWriter
from verl_ckpt.store.layout import DELETING_PREFIX, step_of_dir
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


def _reports(
    step: int, world: int, directory: Path, ranks: list[int] | range | None = None
) -> list[RankReport]:
    """Each rank's report as a real rank sends it: write results packed (RankReport.pack),
    and rank 0's plan metadata in the bytes it pickled once."""
    reports = []
    for rank in ranks if ranks is not None else range(world):
        results, entry = _rank_file(directory, rank, world)
        report = RankReport(step, ROLE, rank, world, _save_id(step, rank))
        report.write_results = results
        report.files = [entry]
        if rank == 0:
            report.packed_global_metadata = _packed_global_metadata(world)
        reports.append(report.pack())
    return reports


def _checked_on_nodes(reports: list[RankReport], step_path: Path) -> None:
    """What each rank's node aggregator adds to its report on the node (where the commit
    has it): its check of the rank's files, and the node's name. Its cost is in the node
    hop, measured apart."""
    if "files_checked_on" not in RankReport.__dataclass_fields__:
        return
    from verl_ckpt.commit.steps import reported_files_problem

    for report in reports:
        report.files_on_arrival = reported_files_problem(str(step_path), report)
        report.files_checked_on = f"node-{report.rank // NODE_SIZE}"


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
                    self.moved_at = time.monotonic()
                    return
            except Exception:  # noqa: BLE001 - a tracker being replaced; poll again
                pass
            time.sleep(0.001)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._stop.set()


@functools.cache
@functools.cache
def _begin_parameters() -> frozenset[str]:
    """The names `begin_step` takes at this commit (looked up once, not per rank's begin)."""
    from verl_ckpt.commit.finalizer import CheckpointFinalizer

    return frozenset(inspect.signature(CheckpointFinalizer.begin_step).parameters)


def _save_id(step: int, rank: int) -> str:
    """Rank `rank`'s save id of `step`: registered by its begin and sent in its report, as a
    rank's CheckpointManager does (32 hex digits, as `uuid4().hex`)."""
    return f"{step:016x}{rank:016x}"


def _begin_args(step: int, rank: int, world: int) -> tuple:
    """`begin_step`'s arguments (its signature gained a deadline, then a save id over time)."""
    args: tuple = (step, ROLE, rank, world)
    if "timeout_s" not in _begin_parameters():
        return args
    args += (120.0,)
    return args + (_save_id(step, rank),) if "save_id" in _begin_parameters() else args


def _begins_batch() -> bool:
    """Whether the finalizer takes an aggregator's batch of begins (`begin_batch`): older
    commits took one begin_step per rank, which is then what the benchmark sends."""
    from verl_ckpt.commit.finalizer import CheckpointFinalizer

    return hasattr(CheckpointFinalizer, "begin_batch")


def _begin_batches(step: int, ranks: list[int], world: int, size: int) -> list[list]:
    """The begins of `ranks` as aggregators forward them: one batch per `size` ranks, packed
    as they pack it (rows of values, where the commit has `begin_rows`)."""
    from verl_ckpt.protocol import messages

    batches: dict[int, list] = {}
    for rank in ranks:
        request = messages.BeginRequest(step, ROLE, rank, world, 120.0, _save_id(step, rank))
        batches.setdefault(rank // size, []).append(request)
    pack = getattr(messages, "begin_rows", list)
    return [pack(batch) for batch in batches.values()]


NODE_SIZE = 8
# Ranks per group aggregator (config report_group_size's default).
GROUP_SIZE = 128
# Processes playing the nodes (each some rank groups of nodes): few, the machine has few cores.
GROUPS = 4
# Target of issue 44 for "committed after the last rank's write", seconds, by ranks.
TARGETS = {4096: 0.1, 16_384: 1.0}
_START_IN_S = 0.3  # the agreed instant: this long after the driver sends it


# How the ranks' reports reach the finalizer, by benchmark mode.
MODES = {
    "group": "a batch per group of {group} ranks ({calls} groups of {per_group} nodes)",
    "node": "a batch per node ({calls} nodes)",
    "rank": "a call per rank",
}


@ray.remote(num_cpus=0)
class _NodeGroup:
    """Plays the ranks of some nodes (whole rank groups of them): begin_step and the ranks'
    files; then, at one instant, what reaches the finalizer from them: each rank group's
    batch (mode "group", as the group's aggregator forwards it), each node's (mode "node"),
    or each rank's report (mode "rank"). The batches are formed before the instant: the
    aggregators that form them in a real job run on the nodes, in parallel (their hops are
    measured apart, _hop_latencies)."""

    def __init__(self, finalizer: Any, world: int, nodes: list[int], sink: Any) -> None:
        self._finalizer = finalizer
        self._sink = sink
        self._world = world
        self._ranks = [r for n in nodes for r in range(n * NODE_SIZE, (n + 1) * NODE_SIZE)]
        self._reports: list[RankReport] = []
        self._directory: Path | None = None

    async def begin(self, step: int, mode: str, floor: bool = False) -> None:
        """These ranks' begins, all at once, as they reach the finalizer: one `begin_batch`
        per rank group (mode "group") or per node ("node"), or one `begin_step` per rank
        (mode "rank", or a finalizer without begin_batch). `floor`: the same calls to an
        actor that only answers (Ray's own cost)."""
        to = self._sink if floor else self._finalizer
        size = {"group": GROUP_SIZE, "node": NODE_SIZE}.get(mode)
        if size is None or not _begins_batch():
            refs = [to.begin_step.remote(*_begin_args(step, r, self._world)) for r in self._ranks]
            answers = await asyncio.gather(*refs)
        else:
            batches = _begin_batches(step, self._ranks, self._world, size)
            answered = await asyncio.gather(*(to.begin_batch.remote(b) for b in batches))
            answers = [a for batch in answered for a in batch]
            refused = [a for a in answers if not isinstance(a, str)]
            if refused:
                raise RuntimeError(f"{len(refused)} begins refused, the first: {refused[0]}")
        directory = Path(answers[0])
        if not floor:
            self._directory = directory

    async def write(self, step: int) -> None:
        self._reports = _reports(step, self._world, self._directory, self._ranks)
        _checked_on_nodes(self._reports, self._directory.parent)

    async def finish(self, at: float, mode: str, floor: bool = False) -> float:
        """At the instant `at`, every rank of these nodes has reported to its aggregators and
        their batches leave for the finalizer; when the last answer came. `floor`: the same
        batches to an actor that does nothing with them (Ray's own cost)."""
        size = {"group": GROUP_SIZE, "node": NODE_SIZE}.get(mode)
        batches: dict[int, list[RankReport]] = {}
        for report in self._reports:
            batches.setdefault(report.rank // size if size else report.rank, []).append(report)
        # Packed as an aggregator packs the batch it forwards (its hop includes that).
        packed = [ReportBatch.of(b) for b in batches.values()]
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if mode == "rank":
            calls = [self._finalizer.report.remote(r) for r in self._reports]
        else:
            to = self._sink if floor else self._finalizer
            calls = [to.report_batch.remote(b) for b in packed]
        answers = await asyncio.gather(*calls)
        done = time.monotonic()
        if mode != "rank":
            answers = [a for batch in answers for a in batch]
        refused = [a for a in answers if a is not None]
        if refused:
            raise RuntimeError(f"{len(refused)} reports refused, the first: {refused[0]}")
        return done


@ray.remote(num_cpus=0)
class _Sink:
    """An async actor that takes report batches, unpacks them and does nothing more: what
    Ray's calls and the batches' decoding alone cost the receiver."""

    def __init__(self, root: str = "/nonexistent") -> None:
        self._arrived = 0.0
        self._root = root

    async def report_batch(self, batch: ReportBatch | list[RankReport]) -> list:
        # Unpacked, as any receiver of a batch unpacks it.
        reports = batch_reports(batch)
        self._arrived = time.monotonic()
        return [None] * len(reports)

    async def report(self, report: RankReport) -> None:
        """A rank's report, as a node aggregator takes it (the node hop's floor)."""
        self._arrived = time.monotonic()

    async def begin_step(self, step: int, role: str, rank: int, *args: Any) -> str:
        """What begin_step answers, a directory, and nothing done (begin_step's floor)."""
        return f"{self._root}/global_step_{step}/{role}"

    async def begin_batch(self, batch: list) -> list[str]:
        """What begin_batch answers, a directory each, and nothing done but unpacking the
        batch as any receiver does (its floor)."""
        from verl_ckpt.protocol import messages

        requests = getattr(messages, "batch_begins", list)(batch)
        return [f"{self._root}/global_step_{r.step}/{r.role}" for r in requests]

    async def last_arrival(self) -> float:
        """When the last batch arrived (time.monotonic(): one clock for the machine)."""
        return self._arrived


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process `pid` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _measure(world: int, root: Path, mode: str, steps: int) -> list[dict[str, float]]:
    """`steps` timed steps (after a warm-up one) of `world` ranks all finishing at once."""
    from verl_ckpt.commit.client import start_finalizer

    nodes = world // NODE_SIZE
    finalizer = start_finalizer(root, {ROLE: world}, max_ckpt_to_keep=2, timeout_s=300.0)
    pid = ray.get(finalizer.__ray_call__.remote(lambda self: os.getpid()))
    sink = _Sink.remote()
    sink_pid = ray.get(sink.__ray_call__.remote(lambda self: os.getpid()))
    # Whole rank groups per process (a group's batcher gathers its nodes' batches in-process).
    per_group = max(1, GROUP_SIZE // NODE_SIZE)
    groups = [
        _NodeGroup.remote(
            finalizer, world, [n for n in range(nodes) if (n // per_group) % GROUPS == g], sink
        )
        for g in range(min(GROUPS, nodes))
    ]
    figures = []
    try:
        for step in range(1, steps + 2):
            t = time.monotonic()
            ray.get([g.begin.remote(step, mode) for g in groups])
            begin_s = time.monotonic() - t
            ray.get([g.write.remote(step) for g in groups])
            os.sync()  # the files' dirty pages out of the way of the timed commit
            ray.get(finalizer.describe.remote())  # the actor is idle and warm
            watch = _TrackerWatch(root, step)
            cpu = _cpu_s(pid)
            at = time.monotonic() + _START_IN_S
            answered = ray.get([g.finish.remote(at, mode) for g in groups])
            ray.get(finalizer.wait_for_commit.remote(step, 300.0))
            watch.join(60)
            cpu = _cpu_s(pid) - cpu
            if read_tracker(root) != step or watch.moved_at is None:
                raise RuntimeError(
                    f"N={world}: step {step} did not move the tracker ({read_tracker(root)}, "
                    f"{watch.moved_at})"
                )
            rss = _rss_mib(pid)
            if step == 1:
                continue  # warm-up: imports in the actor, first directory listing
            figures.append(
                {
                    "committed_s": watch.moved_at - at,
                    "answered_s": max(answered) - at,
                    "begin_s": begin_s,
                    "finalizer_cpu_s": cpu,
                    "rss_mib": rss,
                }
            )
        forecasts = ray.get(finalizer.status.remote())["metadata_forecasts"]
        figures[-1]["forecasts"] = forecasts
        t = time.monotonic()
        ray.get([g.begin.remote(steps + 1, mode, True) for g in groups])
        figures[-1]["begin_floor_s"] = time.monotonic() - t
        if mode != "rank":
            # Ray's floor: the last step's batches again, to an actor that only unpacks them.
            cpu = _cpu_s(sink_pid)
            at = time.monotonic() + _START_IN_S
            answered = ray.get([g.finish.remote(at, mode, True) for g in groups])
            figures[-1]["floor_s"] = max(answered) - at
            figures[-1]["floor_cpu_s"] = _cpu_s(sink_pid) - cpu
        _check_loadable(root, steps + 1, world)
    finally:
        for actor in [*groups, sink, finalizer]:
            ray.kill(actor, no_restart=True)
    return figures


HOP_SAMPLES = 5


@ray.remote(num_cpus=0)
class _HopSender:
    """Some of the callers of one aggregator (ranks of its node, or node aggregators of its
    group), in one process. Their files of each sample's step are real, under `root`."""

    def __init__(self, world: int, ranks: list[int], root: str) -> None:
        self._world = world
        self._ranks = ranks
        self._reports = {}
        for step in range(HOP_SAMPLES + 1):
            directory = Path(root) / f"global_step_{step}" / ROLE
            directory.mkdir(parents=True, exist_ok=True)
            self._reports[step] = _reports(step, world, directory, ranks)
            _checked_on_nodes(self._reports[step], directory.parent)

    async def send(
        self, aggregator: Any, step: int, at: float, per_node: bool, begin: bool = False
    ) -> float:
        """At `at`: each rank's report of `step` (`per_node` False), or each node's batch of
        its reports, to `aggregator`; when the last answer came. `begin`: the ranks' begins
        of the step through it first, before the instant (a node aggregator checks the
        files of the steps it saw begin)."""
        reports = self._reports[step]
        if begin:
            from verl_ckpt.protocol.messages import BeginRequest

            requests = [
                BeginRequest(step, ROLE, r, self._world, 60.0, _save_id(step, r))
                for r in self._ranks
            ]
            await asyncio.gather(*(aggregator.begin.remote(r) for r in requests))
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if per_node:
            batches = [reports[i : i + NODE_SIZE] for i in range(0, len(reports), NODE_SIZE)]
            # Packed, as a node aggregator sends its batch.
            calls = [aggregator.report_batch.remote(ReportBatch.of(b)) for b in batches]
        else:
            calls = [aggregator.report.remote(r) for r in reports]
        await asyncio.gather(*calls)
        return time.monotonic()


def _hop_latencies(world: int) -> dict[str, float]:
    """The hops below the finalizer, which the benchmark's processes play in-process and
    which a real job runs in parallel on every node (each aggregator on its own node, taking
    only its own callers): one real aggregator actor (commit.aggregator.ReportAggregator),
    taking its callers' real Ray calls all at once from 4 other processes and forwarding
    its batch to an actor that only unpacks and answers. The node hop: a node's 8 ranks'
    `report` calls to the node's aggregator; the group hop: a rank group's GROUP_SIZE / 8
    node batches (`report_batch`, packed as node aggregators pack them) to the group's
    aggregator. Median of HOP_SAMPLES, each from the agreed
    instant to the batch's arrival at the next actor (what the commit waits for; the
    answers' way back is not on its path).

    Each hop's floor (`<hop>_floor_s`): the same callers' same calls, at the same instant,
    straight to the actor that only unpacks and answers (no aggregator, no forward): what
    Ray's calls alone cost on this machine's cores.

    The node aggregator is made with a root, as in a job, and sees each step begin (before
    the instant, through the sink's answers naming the ranks' real directories): it checks
    its ranks' files as their reports arrive, which the node hop then includes."""
    import tempfile

    from verl_ckpt.commit.aggregator import ReportAggregator

    out = {}
    root = tempfile.mkdtemp(prefix="verl_ckpt_hop")
    sink = _Sink.remote(root)
    for hop, ranks, per_node in (
        ("node_hop_s", list(range(NODE_SIZE)), False),
        ("group_hop_s", list(range(GROUP_SIZE)), True),
    ):
        members = (ROLE, 0, len(ranks))
        # A node's aggregator has the root; a group's has none (aggregator.GroupRoutes).
        aggregator = (
            ray.remote(ReportAggregator)
            .options(num_cpus=0)
            .remote(sink, 60.0, members=members, root_dir=None if per_node else root)
        )
        share = len(ranks) // 4  # 4 senders: 2 ranks, or 4 nodes of 8, each
        senders = [
            _HopSender.remote(world, ranks[i : i + share], root)
            for i in range(0, len(ranks), share)
        ]
        try:
            ray.get(aggregator.pending.remote())
            for target, key in ((aggregator, hop), (sink, hop.removesuffix("_s") + "_floor_s")):
                begin = target is aggregator and not per_node
                samples = []
                for step in range(HOP_SAMPLES + 1):  # the first warms the actors up
                    at = time.monotonic() + _START_IN_S
                    ray.get([s.send.remote(target, step, at, per_node, begin) for s in senders])
                    samples.append(ray.get(sink.last_arrival.remote()) - at)
                out[key] = _median(samples[1:])
        finally:
            for actor in [*senders, aggregator]:
                ray.kill(actor, no_restart=True)
    ray.kill(sink, no_restart=True)
    shutil.rmtree(root, ignore_errors=True)
    return out


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

    Step 2 is profiled: its begins and its reports, one `begin_batch` and one packed
    `report_batch` per rank group of GROUP_SIZE ranks (but the last group's reports), then
    its commit. The commit
    normally runs in a worker thread (out of cProfile's sight), so for the profiled step the
    commit and retention functions (verl_ckpt.commit.steps) are called directly on the
    reports.
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
        # As the group mode sends them: with their nodes' checks.
        _checked_on_nodes(reports, directory.parent)
        batches = [ReportBatch.of(reports[i : i + GROUP_SIZE]) for i in range(0, world, GROUP_SIZE)]
        os.sync()
        if step == 2:
            profiler.enable()
        if _begins_batch():
            for begins in _begin_batches(step, list(range(1, world)), world, GROUP_SIZE):
                await finalizer.begin_batch(begins)
        else:
            for rank in range(1, world):
                await call(finalizer.begin_step, *_begin_args(step, rank, world))
        for batch in batches[:-1]:
            await finalizer.report_batch(batch)
        if step == 2:
            # The finalizer unpacked its own copies of these (ReportBatch): these, not yet.
            commit_step(root, step, {ROLE: world}, [r.unpack() for r in reports])
            apply_retention(root, 2, ())
            profiler.disable()
        else:
            await finalizer.report_batch(batches[-1])
            await call(finalizer.wait_for_commit, step, 300.0)

    async def both() -> None:
        for step in (1, 2):
            await one_step(step)

    asyncio.run(both())
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats("verl_ckpt", 8)
    stats.sort_stats("cumulative").print_stats(
        r"verl_ckpt.*\((report_batch|take_batch|_record|commit_step|_reported_files"
        r"|_complete_role|apply_retention|committed_steps|missing|begin_step|begin_batch"
        r"|write_commit_record|record)\)",
        12,
    )
    return "\n".join(
        line for line in out.getvalue().splitlines() if line.strip() and "List reduced" not in line
    )


_KeptRow = tuple[int, float, float, float]


def _begin_vs_kept(world: int, root: Path, kept: list[int]) -> list[_KeptRow]:
    """With S committed steps of N ranks on disk and retention keeping them all
    (max_ckpt_to_keep=None, the default): a new step's first `begin_step` (inside a rank's
    save()), and the retention that runs after every commit (_retention_after_commit). The
    committed steps are copies of one real commit record of N ranks, each naming its own
    step. Rows: (S, begin_step s, retention s, retention s without the finalizer's memory of
    the records it verified)."""
    from verl_ckpt.commit.client import start_finalizer

    finalizer = start_finalizer(root, {ROLE: world}, max_ckpt_to_keep=None, timeout_s=120.0)
    out = []
    try:
        directory = Path(ray.get(finalizer.begin_step.remote(*_begin_args(1, 0, world))))
        reports = _reports(1, world, directory)
        ray.get(
            [
                finalizer.report_batch.remote(reports[i : i + NODE_SIZE])
                for i in range(0, world, NODE_SIZE)
            ]
        )
        ray.get(finalizer.wait_for_commit.remote(1, 300.0))
        record = read_commit_record(root / "global_step_1")
        present = 1
        step = 10_000
        for target in kept:
            for k in range(present + 1, target + 1):
                copy = root / f"global_step_{k + 1}"
                copy.mkdir()
                write_commit_record(copy, dataclasses.replace(record, step=k + 1))
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
                failed = RankReport(step, ROLE, 0, world, _save_id(step, 0), failure=failure)
                ray.get(finalizer.report.remote(failed))
                shutil.rmtree(root / f"global_step_{step}", ignore_errors=True)
            remembered, parsed = _retention_after_commit(root, record)
            out.append((target, _median(samples), remembered, parsed))
    finally:
        ray.kill(finalizer, no_restart=True)
    return out


def _begun_or_deleting(name: str) -> bool:
    """A failed step of _begin_vs_kept's begins (numbered from 10_001), or one being deleted."""
    step = step_of_dir(name)
    return name.startswith(DELETING_PREFIX) or (step is not None and step > 10_000)


def _retention_after_commit(root: Path, record: CommitRecord) -> tuple[float, float]:
    """Retention right after a commit (max_ckpt_to_keep=None: it deletes nothing, and still
    reads every step's record), medians of 3: as the finalizer runs it, remembering the
    records it verified at the retentions before (store/record_cache.py), so that only the
    newly committed step's record is parsed; and parsing every record, as it did before."""
    from verl_ckpt.store.record_cache import VerifiedRecords
    from verl_ckpt.store.retention import apply_retention

    newest = root / "global_step_9999"
    # The finalizer deletes the failed steps begun before in the background: gone first, so
    # that no deletion of its runs beside the timed ones.
    deadline = time.monotonic() + 60
    while any(_begun_or_deleting(p.name) for p in root.iterdir()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the failed steps under {root} were not deleted within 60 s")
        time.sleep(0.05)
    remembered, parsed = [], []
    for _ in range(3):
        verified = VerifiedRecords()
        apply_retention(root, None, verified=verified)
        newest.mkdir()
        write_commit_record(newest, dataclasses.replace(record, step=9999))
        t = time.perf_counter()
        apply_retention(root, None, verified=verified)
        remembered.append(time.perf_counter() - t)
        t = time.perf_counter()
        apply_retention(root, None)
        parsed.append(time.perf_counter() - t)
        shutil.rmtree(newest)
    return _median(remembered), _median(parsed)


@ray.remote(num_cpus=0)
class _Profiler:
    def run(self, world: int, root: Path) -> str:
        return _profile_in_process(world, root)

    def memory(self, world: int, root: Path, steps: int) -> list[tuple[int, float, int]]:
        return _memory_over_steps(world, root, steps)


MEMORY_STEPS = 20
_MEMORY_MARKS = (1, 5, 10, 15, 20)


def _memory_over_steps(world: int, root: Path, steps: int) -> list[tuple[int, float, int]]:
    """The finalizer class in-process (its own helper process), `world` driver-role ranks
    (plain files: no DCP `.metadata`, so that a step takes a second, not a minute), one
    tiny file each, keep 2: `steps` steps, each the begins and the reports in group batches,
    wait_for_commit. At each mark: (step, the process's RSS in MiB, the ledger's size)."""
    from verl_ckpt.commit.finalizer import CheckpointFinalizer

    logging.getLogger("verl_ckpt").setLevel(logging.WARNING)
    finalizer = CheckpointFinalizer(str(root), {"driver": world}, 2)
    marks = []

    async def one_step(step: int) -> None:
        directory = Path(await finalizer.begin_step(step, "driver", 0, world, 60.0))
        if _begins_batch():
            from verl_ckpt.protocol.messages import BeginRequest

            for i in range(1, world, GROUP_SIZE):
                ranks = range(i, min(world, i + GROUP_SIZE))
                await finalizer.begin_batch(
                    [BeginRequest(step, "driver", r, world, 60.0, None) for r in ranks]
                )
        else:
            for rank in range(1, world):
                await finalizer.begin_step(step, "driver", rank, world, 60.0)
        reports = []
        for rank in range(world):
            name = f"part{rank}.bin"
            (directory / name).write_bytes(b"x")
            entry = FileEntry(name, 1, "0")
            reports.append(RankReport(step, "driver", rank, world, "s", files=[entry]))
        for i in range(0, world, GROUP_SIZE):
            await finalizer.report_batch(reports[i : i + GROUP_SIZE])
        await finalizer.wait_for_commit(step, 60.0)

    async def all_steps() -> None:
        for step in range(1, steps + 1):
            await one_step(step)
            if step in _MEMORY_MARKS:
                gc.collect()
                marks.append((step, _rss_mib(os.getpid()), finalizer.status()["ledger_size"]))

    asyncio.run(all_steps())
    return marks


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run(rank_counts: list[int], workdir: Path, log: Any = print) -> str:
    """Each N of `rank_counts` (multiples of NODE_SIZE) batched per rank group through per-
    node batches, the smallest also per node only and unbatched; the hops below the
    finalizer, measured apart; the profile at the largest; begin_step against kept steps;
    the soak."""
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for world in rank_counts:
            hops = _hop_latencies(world)
            modes = ("group", "node", "rank") if world == min(rank_counts) else ("group",)
            for mode in modes:
                steps = 3 if world <= 4096 else 2
                figures = _measure(world, workdir / f"n{world}", mode, steps)
                shutil.rmtree(workdir / f"n{world}", ignore_errors=True)
                row = {k: _median([f[k] for f in figures]) for k in figures[0] if k != "forecasts"}
                row["rss"] = [f["rss_mib"] for f in figures]
                for key in ("forecasts", "floor_s", "floor_cpu_s", "begin_floor_s"):
                    row[key] = figures[-1].get(key)
                row.update(hops)
                rows.append((world, mode, row))
                log(f"    {_verdict(world, mode, row)}")
        # Inside a Ray actor: the finalizer class asks Ray's runtime context whether its
        # actor was restarted.
        profiler = _Profiler.remote()
        try:
            profile = ray.get(
                profiler.run.remote(max(rank_counts), workdir / "profile"), timeout=900
            )
            memory = ray.get(
                profiler.memory.remote(max(rank_counts), workdir / "memory", MEMORY_STEPS),
                timeout=900,
            )
            log(
                f"    finalizer memory over {MEMORY_STEPS} steps of N={max(rank_counts)}: "
                + ", ".join(f"step {s}: {m:.0f} MiB" for s, m, _ in memory)
            )
        finally:
            ray.kill(profiler, no_restart=True)
        kept_n = min(max(rank_counts), 4096)
        kept = _begin_vs_kept(kept_n, workdir / "kept", [1, 8, 32, 128])
        log(
            "    begin_step of a new step, and retention after a commit (every record "
            "parsed), vs committed steps kept: "
            + ", ".join(
                f"S={k}: {b * 1e3:.0f} ms, {r * 1e3:.0f} ({p * 1e3:.0f}) ms" for k, b, r, p in kept
            )
        )
        soak = soak_table(
            soak_run(SOAK_COMMITS, trace_memory=False), soak_run(SOAK_COMMITS, trace_memory=True)
        )
        log("\n" + soak)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return (
        _markdown(rows, profile, max(rank_counts), kept, kept_n)
        + "\n\n"
        + _memory_table(memory, max(rank_counts))
        + "\n\n"
        + soak
    )


def _memory_table(memory: list[tuple[int, float, int]], world: int) -> str:
    rows = "\n".join(f"| {s} | {m:.0f} | {n} |" for s, m, n in memory)
    return (
        f"Finalizer memory across steps: the finalizer class in a helper process, N={world} "
        f"driver-role ranks (a tiny plain file each), reports in batches of {GROUP_SIZE}, keep 2, "
        f"{MEMORY_STEPS} steps; the process's RSS after each marked step (after gc):\n\n"
        "| step | RSS MiB | steps in the ledger |\n|---|---|---|\n" + rows
    )


def _how(world: int, mode: str) -> str:
    per_group = GROUP_SIZE // NODE_SIZE
    return MODES[mode].format(
        group=GROUP_SIZE,
        calls=world // (GROUP_SIZE if mode == "group" else NODE_SIZE),
        per_group=per_group,
    )


def _critical_path_s(mode: str, row: dict[str, Any]) -> float:
    """Committed after the last rank's write in a real job: the hops below the finalizer
    that the benchmark plays in-process (measured apart), then what it measured."""
    hops = {"group": ("node_hop_s", "group_hop_s"), "node": ("node_hop_s",), "rank": ()}[mode]
    return row["committed_s"] + sum(row[h] for h in hops)


def _verdict(world: int, mode: str, row: dict[str, Any]) -> str:
    """One line: committed after the last rank's write, against the issue's target."""
    committed = row["committed_s"]
    total = _critical_path_s(mode, row)
    line = (
        f"N={world} ({_how(world, mode)}): committed {committed * 1e3:.0f} ms after the last "
        "rank's write"
    )
    if mode != "rank":
        line += (
            " at the finalizer; with the hops below it ("
            + ("node " if mode == "node" else "node and group ")
            + f"aggregators) {total * 1e3:.0f} ms"
        )
    rss = row.get("rss") or [row["rss_mib"]]
    line += (
        f"; the N ranks' begins answered at the finalizer after {row['begin_s'] * 1e3:.0f} ms"
        + (
            f" (Ray's floor {row['begin_floor_s'] * 1e3:.0f} ms)"
            if row.get("begin_floor_s") is not None
            else ""
        )
    )
    work = (
        f" (finalizer CPU {row['finalizer_cpu_s'] * 1e3:.0f} ms; RSS {min(rss):.0f}-"
        f"{max(rss):.0f} MiB over the timed steps)"
    )
    if row.get("floor_s") is not None:
        work += (
            f"; Ray's floor, the same calls to an actor that only unpacks and answers: every "
            f"report answered after {row['floor_s'] * 1e3:.0f} ms, its CPU "
            f"{row['floor_cpu_s'] * 1e3:.0f} ms"
        )
    if row.get("floor_s") is not None and mode == "group":
        # The three hops' floors together: what no intake, however fast, gets below here.
        floors = row["node_hop_floor_s"] + row["group_hop_floor_s"] + row["floor_s"]
        work += (
            f"; the hops' floors (each hop's calls straight to that actor: node "
            f"{row['node_hop_floor_s'] * 1e3:.0f}, group {row['group_hop_floor_s'] * 1e3:.0f}, "
            f"finalizer {row['floor_s'] * 1e3:.0f} ms) add up to {floors * 1e3:.0f} ms"
        )
    target = TARGETS.get(world)
    if mode != "group" or target is None:
        return line + work + ", no target"
    verdict = "MET" if total <= target else "NOT MET"
    return line + work + f", target <= {target * 1e3:.0f} ms: {verdict}"


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
    from verl_ckpt.store.checksummed_file import write_checksummed
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
    rows: list[tuple[int, str, dict[str, Any]]],
    profile: str,
    largest: int,
    kept: list[_KeptRow],
    kept_n: int,
) -> str:
    lines = [
        "| ranks N | reports | committed after the last rank's write, at the finalizer ms | "
        "node hop ms | group hop ms | committed, hops included ms | every report answered "
        "ms | finalizer CPU from the reports to the commit ms | the N ranks' begins at the "
        "finalizer ms (Ray's floor) | finalizer RSS per step MiB | .metadata forecasts used "
        "/ missed / late |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, mode, r in rows:
        rss = ", ".join(f"{m:.0f}" for m in r["rss"])
        f = r["forecasts"]
        node_hop = f"{r['node_hop_s'] * 1e3:.0f}" if mode != "rank" else "-"
        group_hop = f"{r['group_hop_s'] * 1e3:.0f}" if mode == "group" else "-"
        lines.append(
            f"| {world} | {_how(world, mode)} | {r['committed_s'] * 1e3:.0f} | {node_hop} | "
            f"{group_hop} | {_critical_path_s(mode, r) * 1e3:.0f} | "
            f"{r['answered_s'] * 1e3:.0f} | {r['finalizer_cpu_s'] * 1e3:.0f} | "
            f"{r['begin_s'] * 1e3:.0f} ({r['begin_floor_s'] * 1e3:.0f}) | {rss} | "
            f"{f['used']} / {f['missed']} / {f['late']} |"
        )
    verdicts = [_verdict(world, mode, r) for world, mode, r in rows]
    return (
        __doc__.split("\n\n", 1)[1].strip()
        + "\n\nMedians over the timed steps after a warm-up step (3 timed steps up to 4096 ranks, "
        "2 above). The finalizer's CPU time (its process, every thread: Ray's included), from "
        "just before the agreed instant to wait_for_commit's answer, does not depend on how "
        "busy the machine is: it is the work the step's intake and commit cost the finalizer. "
        "RSS after each timed step:\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(f"- {v}" for v in verdicts)
        + f"\n\nIn-process cProfile of one step with N={largest} (the begins and the reports in "
        f"batches of {GROUP_SIZE}, the commit; by own time, then cumulative):\n\n```\n"
        + profile
        + "\n```"
        + f"\n\nWith S committed steps of N={kept_n} ranks kept on disk (max_ckpt_to_keep=None, "
        "the default; copies of one real commit record, each naming its own step), medians of "
        "3: a new step's first begin_step (called inside a rank's save(), so blocking), and "
        "the retention that runs after every commit (in the finalizer's file thread, after "
        "wait_for_commit answered; it deletes nothing here but reads every step's record), "
        "as the finalizer runs it (only the newly committed record parsed, the others known "
        "by their bytes' SHA-256) and parsing every record (before 1d615de):"
        "\n\n| committed steps kept S | begin_step ms | retention after a commit ms | "
        "the same, every record parsed ms |\n|---|---|---|---|\n"
        + "\n".join(
            f"| {k} | {b * 1e3:.1f} | {r * 1e3:.1f} | {p * 1e3:.1f} |" for k, b, r, p in kept
        )
    )
