"""begin_step batched per node and per rank group (commit/aggregator.py) into the finalizer's
`begin_batch` (commit/admission.py: Admission.begin_steps).

In-process (no Ray) where the admission of a batch is checked: each participant of a batch
hears what its own begin_step would have answered, directories and refusals alike. With a
real local Ray where the node's aggregator dies holding a begin. I1: a batch begins exactly
what a begin_step per rank begins (a leftover removed once, a step saved once). I5: a rank
whose aggregator is gone begins directly, and nothing waits past its deadline.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import ray

from verl_ckpt.commit.aggregator import ReportAggregator, aggregator_name, open_node_aggregator
from verl_ckpt.commit.batcher import NodeBatcher
from verl_ckpt.commit.client import (
    FINALIZER_NAMESPACE,
    FinalizerClient,
    finalizer_name,
    start_finalizer,
)
from verl_ckpt.commit.finalizer import CheckpointFinalizer
from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.format.file_writer import write_checksummed
from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.messages import BeginRequest, RankReport
from verl_ckpt.store.commit_record import FileEntry, read_commit_record
from verl_ckpt.store.layout import step_dir
from verl_ckpt.store.tracker import read_tracker
from verl_ckpt.store.verification import verify_files

# The driver role: its ranks write plain files (no DCP `.metadata` to make at the commit),
# into the step's directory itself.
ROLE = "driver"
WORLD = 4
PER_NODE = 2
NEVER_S = 3600.0  # a batch leaves only when its node is complete (see test_report_batches)


def _request(step: int, rank: int, save_id: str | None = None, timeout_s: float = 10.0):
    return BeginRequest(step, ROLE, rank, WORLD, timeout_s, save_id or f"s{step}r{rank}")


def _finalizer(root: Path, max_in_flight: int = 1) -> CheckpointFinalizer:
    return CheckpointFinalizer(
        str(root), {ROLE: WORLD}, max_ckpt_to_keep=None, max_in_flight=max_in_flight
    )


async def _report(finalizer: CheckpointFinalizer, step: int, rank: int, directory: str) -> None:
    """Rank `rank`'s file of `step` into `directory`, reported."""
    name = f"part{rank}.bin"
    written = write_checksummed(Path(directory) / name, lambda s: s.write(b"b" * 48))
    report = RankReport(step, ROLE, rank, WORLD, f"s{step}r{rank}")
    report.files = [FileEntry(name, written.size, written.checksum)]
    await finalizer.report(report)


def test_I1_a_node_s_begins_leave_as_one_call_and_each_rank_gets_its_directory(tmp_path):
    """Every rank begins through its node's batcher: one `begin_batch` per node, each rank
    gets the role's directory of the step, exactly what its own begin_step returns, and the
    step then commits every rank's file."""
    calls: list[list[int]] = []

    async def run() -> list[str]:
        finalizer = _finalizer(tmp_path)

        async def forward(requests: list[BeginRequest]) -> list:
            calls.append([r.rank for r in requests])
            return await finalizer.begin_batch(requests)

        nodes = [NodeBatcher(forward, linger_s=NEVER_S) for _ in range(WORLD // PER_NODE)]
        for rank in range(WORLD):
            nodes[rank // PER_NODE].join((ROLE, rank))
        answers = await asyncio.gather(
            *(nodes[r // PER_NODE].submit(_request(1, r)) for r in range(WORLD))
        )
        # The same save asking again, directly (its aggregator died after answering).
        again = await finalizer.begin_step(1, ROLE, 0, WORLD, 10.0, "s1r0")
        assert again == answers[0]
        for rank, directory in enumerate(answers):
            await _report(finalizer, 1, rank, directory)
        await finalizer.wait_for_commit(1, 10.0)
        return answers

    answers = asyncio.run(run())
    assert sorted(calls) == [[0, 1], [2, 3]]
    assert answers == [str(step_dir(tmp_path.resolve(), 1))] * WORLD
    assert read_tracker(tmp_path) == 1
    record = read_commit_record(step_dir(tmp_path, 1))
    assert len(record.files) == WORLD and verify_files(step_dir(tmp_path, 1), record) == []


def test_a_role_s_batch_leaves_without_waiting_for_another_role_on_its_node():
    """An actor's and a critic's ranks share a node (colocated roles save at their own
    times): the actor's begins leave as soon as both actor ranks began, with a linger of an
    hour and the critic's ranks silent; then the critic's leave as their own batch."""
    sent: list[list[tuple[str, int]]] = []

    async def forward(requests: list[BeginRequest]) -> list:
        sent.append([r.participant for r in requests])
        return ["ok"] * len(requests)

    async def run() -> None:
        node = NodeBatcher(forward, linger_s=NEVER_S)
        for role in ("actor", "critic"):
            for rank in (0, 1):
                node.join((role, rank))

        def begin(role: str, rank: int):
            return node.submit(BeginRequest(1, role, rank, 2, 10.0, "s"))

        actor = asyncio.gather(begin("actor", 0), begin("actor", 1))
        assert await asyncio.wait_for(actor, 5.0) == ["ok", "ok"]
        critic = asyncio.gather(begin("critic", 1), begin("critic", 0))
        assert await asyncio.wait_for(critic, 5.0) == ["ok", "ok"]

    asyncio.run(run())
    assert sent == [[("actor", 0), ("actor", 1)], [("critic", 1), ("critic", 0)]]


def test_I1_a_batch_removes_an_uncommitted_leftover_once_before_any_rank_writes(tmp_path):
    """A leftover of step 3 (an earlier run's, never committed) is gone before the batch's
    ranks hear their directory: none of its files mixes with the new save's."""
    leftover = step_dir(tmp_path, 3)
    leftover.mkdir(parents=True)
    (leftover / "stale.bin").write_bytes(b"old")

    async def run() -> list:
        finalizer = _finalizer(tmp_path)
        return await finalizer.begin_batch([_request(3, r) for r in range(WORLD)])

    answers = asyncio.run(run())
    assert answers == [str(step_dir(tmp_path.resolve(), 3))] * WORLD
    assert list(Path(answers[0]).iterdir()) == []


def test_I1_each_participant_of_a_batch_hears_its_own_refusal(tmp_path):
    """In one batch: a stranger (a rank outside the role) is refused alone; a rank that
    reported the step from another save is refused alone (its files would be overwritten);
    the others begin. A committed step refuses the whole batch, and a failed step refuses
    it with StepNotCommittedError, as begin_step does."""

    async def run() -> tuple[list, list, list]:
        finalizer = _finalizer(tmp_path, max_in_flight=2)
        directory = await finalizer.begin_step(1, ROLE, 0, WORLD, 10.0, "s1r0")
        await _report(finalizer, 1, 0, directory)
        stranger = BeginRequest(1, ROLE, 9, 16, 10.0, "x")
        mixed = await finalizer.begin_batch(
            [_request(1, 0, save_id="another save"), stranger, _request(1, 1), _request(1, 2)]
        )
        for rank in range(1, WORLD):
            await finalizer.begin_step(1, ROLE, rank, WORLD, 10.0, f"s1r{rank}")
            await _report(finalizer, 1, rank, directory)
        await finalizer.wait_for_commit(1, 10.0)
        committed = await finalizer.begin_batch([_request(1, r, "new") for r in range(WORLD)])
        failed_report = RankReport(2, ROLE, 0, WORLD, "s2r0")
        await finalizer.begin_step(2, ROLE, 0, WORLD, 10.0, "s2r0")
        failed_report.failure = Failure(ROLE, 0, Phase.WRITE, "OSError: disk on fire")
        await finalizer.report(failed_report)
        failed = await finalizer.begin_batch([_request(2, r) for r in range(1, WORLD)])
        return mixed, committed, failed

    mixed, committed, failed = asyncio.run(run())
    assert isinstance(mixed[0], CheckpointError) and "already reported" in str(mixed[0])
    assert isinstance(mixed[1], CheckpointError) and "rank 9 of world size 16" in str(mixed[1])
    assert mixed[2:] == [str(step_dir(tmp_path.resolve(), 1))] * 2
    assert all(isinstance(a, CheckpointError) for a in committed), committed
    assert all("already committed" in str(a) for a in committed), committed
    assert all(isinstance(a, StepNotCommittedError) for a in failed), failed
    assert all("disk on fire" in str(a) for a in failed), failed


def test_a_batch_that_finds_no_room_answers_every_rank_at_its_timeout(tmp_path):
    """Step 1 in flight with max_in_flight=1: a batch of step 2's begins waits for room once,
    up to the longest timeout it carries, and every rank hears why, naming who step 1
    misses; it never waits longer."""

    async def run() -> list:
        finalizer = _finalizer(tmp_path)
        await finalizer.begin_step(1, ROLE, 0, WORLD, 10.0, "s1r0")
        requests = [_request(2, r, timeout_s=0.2 + 0.1 * r) for r in range(WORLD)]
        return await asyncio.wait_for(finalizer.begin_batch(requests), 5.0)

    answers = asyncio.run(run())
    assert all(isinstance(a, CommitTimeoutError) for a in answers), answers
    assert all("step 2 cannot start" in str(a) for a in answers)
    assert "missing reports: step 1:" in str(answers[0]), answers[0]


# ---- with Ray: the aggregator actor ------------------------------------------------------


@ray.remote(num_cpus=0)
class _Rank:
    """A rank's process whose link begins through the node's aggregator."""

    def __init__(self, root: str, rank: int) -> None:
        handle = ray.get_actor(finalizer_name(root), namespace=FINALIZER_NAMESPACE)
        who = f"{ROLE} rank {rank}"
        aggregator = open_node_aggregator(root, handle, ROLE, rank, 30.0, who, 2)
        self.link = ParticipantLink(
            FinalizerClient(handle, who, 30.0), ROLE, rank, 2, 30.0, aggregator=aggregator
        )
        self.aggregator = aggregator.handle

    def aggregator_handle(self) -> ray.actor.ActorHandle:
        return self.aggregator

    def save(self, step: int) -> str | None:
        """begin, a file, and the report, through the link: its failure, or None."""
        save_id = f"s{step}r{self.link.rank}"
        directory = self.link.begin(step, save_id)
        name = f"part{self.link.rank}.bin"
        written = write_checksummed(directory / name, lambda s: s.write(b"q" * 16))
        report = self.link.new_report(step, save_id)
        report.files = [FileEntry(name, written.size, written.checksum)]
        failure = self.link.deliver(report)
        return None if failure is None else failure.describe()


def test_I5_a_rank_whose_aggregator_died_holding_its_begin_begins_directly(ray_local, tmp_path):
    """The node's aggregator (started first, with a linger of an hour) holds rank 0's
    begin of step 1, waiting for rank 1's, and is killed for good: rank 0 hears at once that
    it is gone and begins directly; rank 1 then does the same, and the step commits."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: 2}, max_ckpt_to_keep=None, timeout_s=60.0)
    node = ray.get_runtime_context().get_node_id()
    aggregator = (
        ray.remote(ReportAggregator)
        .options(
            name=aggregator_name(root, node),
            namespace=FINALIZER_NAMESPACE,
            max_restarts=-1,
            max_task_retries=0,
            num_cpus=0,
        )
        .remote(finalizer, 30.0, NEVER_S, None, root)
    )
    ranks = [_Rank.remote(root, r) for r in (0, 1)]
    try:
        # Both joined it: a batch waits for every member's begin.
        handles = ray.get([rank.aggregator_handle.remote() for rank in ranks], timeout=60)
        assert handles == [aggregator] * 2
        held = ranks[0].save.remote(1)
        _until(lambda: ray.get(aggregator.pending.remote(), timeout=60) == 1)
        ray.kill(aggregator, no_restart=True)
        assert ray.get(held, timeout=60) is None
        assert ray.get(ranks[1].save.remote(1), timeout=60) is None
        ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
    finally:
        for actor in [*ranks, finalizer]:
            ray.kill(actor, no_restart=True)
    path = step_dir(Path(root), 1)
    assert read_tracker(Path(root)) == 1
    assert verify_files(path, read_commit_record(path)) == []


def _until(ready, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
