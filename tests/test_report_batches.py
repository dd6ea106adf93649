"""Reports batched per node (commit/aggregator.py) into the finalizer's `report_batch`.

In-process (no Ray) where the batching itself is checked: the NodeBatcher of each node
forwards straight into a CheckpointFinalizer. With a real local Ray where an aggregator
actor dies. I1: a batch commits exactly what a report per rank commits, duplicates and
replays included. I5: a failure in a batch fails the step at once naming the rank, and a
lost batch fails the step at its deadline naming the ranks whose reports never came.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import ray

from tests.helpers import start_holding_aggregator, wait_until
from verl_ckpt.commit.aggregator import (
    AggregatorLost,
    batches_reports,
    group_aggregator_name,
    group_of,
    open_node_aggregator,
    uses_groups,
)
from verl_ckpt.commit.batcher import NodeBatcher
from verl_ckpt.commit.client import (
    FINALIZER_NAMESPACE,
    FinalizerClient,
    finalizer_name,
    start_finalizer,
)
from verl_ckpt.commit.finalizer import CheckpointFinalizer
from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.protocol.deadlines import call_deadline, deadline_in
from verl_ckpt.protocol.errors import CheckpointError, StepNotCommittedError
from verl_ckpt.protocol.messages import RankReport, ReportBatch
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import FileEntry, read_commit_record
from verl_ckpt.store.layout import step_dir
from verl_ckpt.store.tracker import read_tracker
from verl_ckpt.store.verification import verify_files

# The driver role: its ranks write plain files (no DCP `.metadata` to make at the commit).
ROLE = "driver"
WORLD = 4
PER_NODE = 2
# Long enough that a batch leaves only when its node is complete or holds a failure: a
# test passing with it never depended on the linger.
NEVER_S = 3600.0


class _Node:
    """One simulated node: its ranks' batcher, forwarding into `finalizer`, counting calls."""

    def __init__(self, finalizer: CheckpointFinalizer, ranks: range) -> None:
        self.calls: list[list[int]] = []
        self.batcher = NodeBatcher(self._forward, linger_s=NEVER_S)
        self._finalizer = finalizer
        for rank in ranks:
            self.batcher.join((ROLE, rank))

    async def _forward(self, reports: list[RankReport]) -> list:
        self.calls.append([r.rank for r in reports])
        # Packed, as an aggregator actor sends it.
        return await self._finalizer.report_batch(ReportBatch.of(reports))


def _nodes(finalizer: CheckpointFinalizer) -> list[_Node]:
    return [_Node(finalizer, range(n, n + PER_NODE)) for n in range(0, WORLD, PER_NODE)]


async def _written(
    finalizer: CheckpointFinalizer, step: int, rank: int, save_id: str, timeout_s: float = 10.0
) -> RankReport:
    """Rank `rank`'s save of `step`: begin_step and its file; its report, not sent."""
    directory = Path(await finalizer.begin_step(step, ROLE, rank, WORLD, timeout_s, save_id))
    written = write_checksummed(directory / f"part{rank}.bin", lambda s: s.write(b"r" * 64))
    entry = FileEntry(f"part{rank}.bin", written.size, written.checksum)
    return RankReport(step, ROLE, rank, WORLD, save_id, files=[entry])


async def _report_all(nodes: list[_Node], reports: list[RankReport]) -> list:
    """Every rank reports at once through its node's batcher."""
    node_of = {rank: nodes[rank // PER_NODE] for rank in range(WORLD)}
    return await asyncio.gather(*(node_of[r.rank].batcher.submit(r) for r in reports))


def _committed_and_verified(root: Path, step: int) -> None:
    path = step_dir(root, step)
    assert read_tracker(root) == step
    record = read_commit_record(path)
    assert sorted(f.path for f in record.files) == [f"part{r}.bin" for r in range(WORLD)]
    assert verify_files(path, record) == []


def test_I1_a_step_reported_in_one_batch_per_node_commits(tmp_path):
    """Every rank reports through its node: one finalizer call per node, and the step
    commits the files of every rank."""

    async def run() -> list[_Node]:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        nodes = _nodes(finalizer)
        reports = [await _written(finalizer, 1, r, f"s{r}") for r in range(WORLD)]
        assert await _report_all(nodes, reports) == [None] * WORLD
        await finalizer.wait_for_commit(1, 10.0)
        return nodes

    nodes = asyncio.run(run())
    assert [node.calls for node in nodes] == [[[0, 1]], [[2, 3]]]
    _committed_and_verified(tmp_path, 1)


def test_I5_a_failure_in_a_batch_fails_the_step_at_once_naming_the_rank(tmp_path):
    """A rank's failure leaves its node at once, without waiting for the node's other
    rank (which never reports here, and the batch would linger for an hour): the step
    fails, naming the rank and its failure, for the waiter and for a later begin_step."""

    async def run() -> tuple[StepNotCommittedError, _Node]:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        nodes = _nodes(finalizer)
        report = await _written(finalizer, 2, 0, "broken")
        report.files = []
        report.failure = Failure(ROLE, 0, Phase.WRITE, "OSError: disk on fire", 5)
        assert await nodes[0].batcher.submit(report) is None
        with pytest.raises(StepNotCommittedError) as caught:
            await finalizer.wait_for_commit(2, 10.0)
        return caught.value, nodes[0]

    error, node = asyncio.run(run())
    assert "driver rank 0" in str(error) and "disk on fire" in str(error), error
    assert node.calls == [[0]]
    assert read_tracker(tmp_path) is None


def test_I5_a_lost_batch_fails_the_step_at_its_deadline_naming_the_missing_ranks(
    tmp_path, monkeypatch
):
    """A node's aggregator that dies holding its batch (here: one node's batch never
    leaves, a rank of the node never reporting) does not hang the step: it fails at its
    deadline (the report slack is shortened here) naming exactly the ranks whose reports
    never reached the finalizer, and the next step starts."""
    monkeypatch.setattr("verl_ckpt.commit.admission.RPC_SLACK_S", 0.1)

    async def run() -> StepNotCommittedError:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        nodes = _nodes(finalizer)
        reports = [await _written(finalizer, 3, r, f"s{r}", timeout_s=0.2) for r in range(WORLD)]
        # Node 1 delivers; node 0's batch holds rank 0 and waits for rank 1, which is lost.
        assert await asyncio.gather(*(nodes[1].batcher.submit(r) for r in reports[2:])) == [
            None,
            None,
        ]
        held = asyncio.ensure_future(nodes[0].batcher.submit(reports[0]))
        with pytest.raises(StepNotCommittedError) as caught:
            await finalizer.wait_for_commit(3, 10.0)
        assert nodes[0].batcher.pending() == 1 and not held.done()
        held.cancel()
        # Room for the next step: the failed one no longer holds back-pressure.
        later = [await _written(finalizer, 4, r, f"t{r}") for r in range(WORLD)]
        assert await asyncio.gather(*(finalizer.report(r) for r in later)) == [None] * WORLD
        await finalizer.wait_for_commit(4, 10.0)
        return caught.value

    error = asyncio.run(run())
    assert "no report by the step's deadline from driver rank 0, driver rank 1" in str(error), error
    assert "rank 2" not in str(error) and "rank 3" not in str(error)
    _committed_and_verified(tmp_path, 4)


def test_a_batch_whose_node_never_completes_leaves_after_its_linger(tmp_path):
    """A rank of the node that never reports (dead, or moved to another node's aggregator)
    keeps its node's batch only for the linger: the others' reports are delivered, and the
    step then misses only that rank."""

    async def run() -> tuple[list, _Node, dict]:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        node = _Node(finalizer, range(WORLD))
        node.batcher = NodeBatcher(node._forward, linger_s=0.01)
        for rank in range(WORLD):
            node.batcher.join((ROLE, rank))
        reports = [await _written(finalizer, 7, r, f"s{r}") for r in range(WORLD)]
        answers = await asyncio.gather(*(node.batcher.submit(r) for r in reports[:-1]))
        return answers, node, finalizer.status()["pending"]

    answers, node, pending = asyncio.run(run())
    assert answers == [None] * (WORLD - 1)
    assert node.calls == [[0, 1, 2]]
    assert pending == {7: "driver rank 3"}


def test_I1_duplicate_and_replayed_reports_in_batches_are_ignored(tmp_path):
    """A batch holding a rank's report twice (a retried call), the replay of a whole batch
    after it was delivered (an aggregator restarted mid-answer, its ranks reporting again),
    and the report of a save the rank replaced: each is ignored as a direct report is, and
    the step commits the registered saves' files."""

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        await finalizer.begin_step(5, ROLE, 0, WORLD, 10.0, "replaced")
        reports = [await _written(finalizer, 5, r, f"s{r}") for r in range(WORLD)]
        stale = RankReport(5, ROLE, 0, WORLD, "replaced", files=[FileEntry("x", 9, "0")])
        first = [reports[0], reports[0], stale, reports[1]]
        assert await finalizer.report_batch(first) == [None] * 4
        assert await finalizer.report_batch(first) == [None] * 4  # replayed
        assert await finalizer.report_batch(reports[2:]) == [None, None]
        await finalizer.wait_for_commit(5, 10.0)
        # A replay after the commit (and after the step was retired) is late, and ignored.
        assert await finalizer.report_batch(reports) == [None] * WORLD

    asyncio.run(run())
    _committed_and_verified(tmp_path, 5)


@pytest.mark.parametrize(
    ("intruder", "named"),
    [
        ((ROLE, 9, 16), "rank 9 of world size 16"),
        ((ROLE, 1, WORLD + 1), f"rank 1 of world size {WORLD + 1}"),
        ((ROLE, WORLD, WORLD), f"rank {WORLD} of world size {WORLD}"),
        ((ROLE, -1, WORLD), f"rank -1 of world size {WORLD}"),
        ((ROLE, float("nan"), WORLD), f"rank nan of world size {WORLD}"),
        (("critic", 0, WORLD), "role 'critic' is not a participant"),
    ],
)
def test_a_batch_refuses_only_the_reports_of_non_participants(tmp_path, intruder, named):
    """A report from outside the root's participants is refused in the answer for it; the
    other reports of its batch count (whichever way the finalizer takes the batch: the one
    pass over its columns must see the intruder too)."""

    async def run() -> list:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        reports = [await _written(finalizer, 6, r, f"s{r}") for r in range(WORLD)]
        role, rank, world = intruder
        stranger = RankReport(6, role, rank, world, "x")
        answers = await finalizer.report_batch([reports[0], stranger, *reports[1:]])
        await finalizer.wait_for_commit(6, 10.0)
        return answers

    answers = asyncio.run(run())
    assert answers[0] is None and answers[2:] == [None] * (WORLD - 1)
    assert isinstance(answers[1], CheckpointError) and named in str(answers[1])
    _committed_and_verified(tmp_path, 6)


def test_I1_a_problem_a_node_found_with_a_reported_file_fails_the_step(tmp_path):
    """A node aggregator checks its ranks' files on the node that wrote them, and the
    finalizer takes its word for all but one report per node and batch: a problem the node
    found fails the step, naming the file, even where the finalizer would not see it (the
    file is whole here by the time the batch arrives)."""

    async def run() -> StepNotCommittedError:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        reports = [await _written(finalizer, 8, r, f"s{r}") for r in range(WORLD)]
        for report in reports:
            report.files_on_arrival, report.files_checked_on = "", "node-a"
        reports[1].files_on_arrival = "part1.bin: reported by driver rank 1 with 64 bytes, found 3"
        assert await finalizer.report_batch(ReportBatch.of(reports)) == [None] * WORLD
        with pytest.raises(StepNotCommittedError) as caught:
            await finalizer.wait_for_commit(8, 10.0)
        return caught.value

    error = asyncio.run(run())
    assert "part1.bin: reported by driver rank 1 with 64 bytes, found 3" in str(error), error
    assert read_tracker(tmp_path) is None


@pytest.mark.parametrize(
    ("deleted", "commits"),
    [
        # Node a's second report: the node's word is taken for it (verification on resume
        # finds such a file; many-machines.md).
        (1, True),
        # Node b's first report: checked again, and found missing although the node found it.
        (2, False),
    ],
)
def test_I1_a_batch_whose_nodes_found_every_file_is_checked_again_once_per_node(
    tmp_path, deleted, commits
):
    """The common batch, every report a success of its registered save with files its node
    found (taken in one pass over the batch): the finalizer checks each node's first report
    again, and only that one. Ranks 0-1 are node a, 2-3 node b."""

    async def run() -> StepNotCommittedError | None:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        reports = [await _written(finalizer, 4, r, f"s{r}") for r in range(WORLD)]
        for report in reports:
            report.files_on_arrival = ""
            report.files_checked_on = "node-a" if report.rank < 2 else "node-b"
        (step_dir(tmp_path, 4) / f"part{deleted}.bin").unlink()
        assert await finalizer.report_batch(ReportBatch.of(reports)) == [None] * WORLD
        try:
            await finalizer.wait_for_commit(4, 10.0)
        except StepNotCommittedError as exc:
            return exc
        return None

    error = asyncio.run(run())
    if commits:
        assert error is None and read_tracker(tmp_path) == 4
    else:
        assert error is not None and read_tracker(tmp_path) is None
        assert "part2.bin: reported by driver rank 2 with 64 bytes, found no file" in str(error)
        assert "its node node-b found it as reported" in str(error), error


def test_I1_only_a_report_the_step_counts_confirms_its_nodes_checks(tmp_path):
    """The finalizer checks one report of each node again per batch and takes the node's
    word for the others: that report must be one the step counts. Here the node's first
    report in the batch is from a save its rank replaced (ignored, and its file is not
    there), then the rank's own report, whose file the finalizer does not find although the
    node did: the step fails, naming that file."""

    async def run() -> StepNotCommittedError:
        finalizer = CheckpointFinalizer(str(tmp_path), {ROLE: WORLD}, max_ckpt_to_keep=None)
        await finalizer.begin_step(9, ROLE, 0, WORLD, 10.0, "replaced")
        reports = [await _written(finalizer, 9, r, f"s{r}") for r in range(WORLD)]
        stale = RankReport(9, ROLE, 0, WORLD, "replaced", files=[FileEntry("x", 9, "0")])
        batch = [stale, *reports]
        for report in batch:
            report.files_on_arrival, report.files_checked_on = "", "node-a"
        (step_dir(tmp_path, 9) / "part0.bin").unlink()
        assert await finalizer.report_batch(ReportBatch.of(batch)) == [None] * (WORLD + 1)
        with pytest.raises(StepNotCommittedError) as caught:
            await finalizer.wait_for_commit(9, 10.0)
        return caught.value

    error = asyncio.run(run())
    assert "part0.bin: reported by driver rank 0 with 64 bytes, found no file" in str(error)
    assert "is the root shared by every node?" in str(error), error
    assert read_tracker(tmp_path) is None


def test_a_packed_batch_carries_every_field_a_report_sends():
    """ReportBatch (what aggregators send) gives back each report as its rank sent it:
    files, packed write results and global metadata, a failure; and what its node's
    aggregator found of its files."""
    plain = RankReport(3, "actor", 5, 8, "a", files=[FileEntry("actor/x", 7, "c1")])
    plain.write_results = [{"written": 1}]
    plain.packed_global_metadata = b"metadata"
    failed = RankReport(3, "actor", 6, 8, "b", failure=Failure("actor", 6, Phase.WRITE, "boom"))
    # A node aggregator's check of a report's files travels with it (intake._check_files).
    failed.files_on_arrival = "actor/y: reported by actor rank 6 with 3 bytes, found no file"
    failed.files_checked_on = "node-a"
    back = ReportBatch.of([plain, failed]).reports()
    assert [(r.step, r.role, r.rank, r.world_size, r.save_id) for r in back] == [
        (3, "actor", 5, 8, "a"),
        (3, "actor", 6, 8, "b"),
    ]
    assert back[0].files == [FileEntry("actor/x", 7, "c1")]
    assert back[0].unpacked_write_results() == [{"written": 1}]
    assert back[0].packed_global_metadata == b"metadata" and back[0].failure is None
    assert back[1].failure == Failure("actor", 6, Phase.WRITE, "boom")
    assert back[1].files == [] and back[1].files_checked_on == "node-a"
    assert back[1].files_on_arrival == failed.files_on_arrival
    assert back[0].files_on_arrival is None and back[0].files_checked_on is None
    # A global metadata object set unpickled travels too (ranks send it pickled already).
    unpickled = RankReport(3, "actor", 0, 8, "c")
    unpickled.global_metadata = {"plan": 1}
    back = ReportBatch.of([unpickled]).reports()[0].unpack()
    assert back.global_metadata == {"plan": 1}


def test_report_batching_auto_batches_large_roles_only():
    assert not batches_reports("auto", 8) and batches_reports("auto", 64)
    assert batches_reports("node", 1) and not batches_reports("off", 4096)


# ---- with Ray: the aggregator actor ------------------------------------------------------


@ray.remote(num_cpus=0)
class _Rank:
    """A rank's process: its link reports through its node's aggregator."""

    def __init__(
        self,
        root: str,
        rank: int,
        world: int = 2,
        group_size: int = 0,
        batched: bool = True,
        role: str = ROLE,
    ) -> None:
        handle = ray.get_actor(finalizer_name(root), namespace=FINALIZER_NAMESPACE)
        who = f"{role} rank {rank}"
        self.aggregator = (
            open_node_aggregator(root, handle, role, rank, 30.0, who, world, group_size)
            if batched
            else None
        )
        client = FinalizerClient(handle, who, 30.0)
        self.link = ParticipantLink(client, role, rank, world, 30.0, aggregator=self.aggregator)
        self.rank = rank
        # Files are reported relative to the step's directory: a role's are in its own.
        self.prefix = "" if role == ROLE else f"{role}/"

    def aggregator_handle(self) -> ray.actor.ActorHandle:
        return self.aggregator.handle

    def begin(self, step: int, save_id: str) -> str:
        """begin_step alone; `report_directly` writes into its directory later."""
        self.began = self.link.begin(step, save_id)
        return str(self.began)

    def write(self, step: int, save_id: str, directory: Path | None = None) -> RankReport:
        directory = directory or self.link.begin(step, save_id)
        name = f"part{self.rank}.bin"
        written = write_checksummed(directory / name, lambda s: s.write(b"z" * 32))
        report = self.link.new_report(step, save_id)
        report.files = [FileEntry(self.prefix + name, written.size, written.checksum)]
        return report

    def save(self, step: int, save_id: str) -> str | None:
        """A save through ParticipantLink: its failure, or None."""
        failure = self.link.deliver(self.write(step, save_id), call_deadline(30.0))
        return None if failure is None else failure.describe()

    def report_directly(self, step: int, save_id: str) -> None:
        """Its files of the step it began (`begin`), reported straight to the finalizer."""
        self.link.client.report(self.write(step, save_id, self.began).pack())

    def report_began_through_aggregator(self, step: int, save_id: str) -> None:
        """Its files of the step it began (`begin`), reported through the node's aggregator."""
        self.aggregator.report(self.write(step, save_id, self.began).pack(), call_deadline(30.0))

    def deliver_began(self, step: int, save_id: str, within_s: float | None = None) -> str | None:
        """Its files of the step it began (`begin`), delivered as a save delivers them
        (ParticipantLink.deliver; within `within_s`, by default a save's 30 s and the slack):
        its failure, or None."""
        deadline = call_deadline(30.0) if within_s is None else deadline_in(within_s)
        failure = self.link.deliver(self.write(step, save_id, self.began), deadline)
        return None if failure is None else failure.describe()

    def report_through_aggregator_only(self, step: int, save_id: str) -> str:
        """A report handed to the aggregator alone (no fallback): what the rank hears."""
        try:
            self.aggregator.report(self.write(step, save_id).pack(), call_deadline(30.0))
        except AggregatorLost as exc:
            return f"lost: {exc}"
        return "delivered"


def test_I5_ranks_whose_aggregator_died_report_directly_and_the_step_commits(ray_local, tmp_path):
    """The node's aggregator actor is killed while it holds rank 0's report of step 1 (both
    ranks began the step through it; its batch of reports waits for rank 1): rank 0 hears at
    once that its aggregator is gone, nothing hangs. Then the aggregator is killed for good:
    a save through ParticipantLink falls back to direct calls, and step 2 commits."""
    root = str(tmp_path)
    finalizer = start_finalizer(
        root, {ROLE: 2}, max_ckpt_to_keep=None, timeout_s=60.0, max_in_flight=2
    )
    start_holding_aggregator(root, finalizer)
    ranks = [_Rank.remote(root, r) for r in (0, 1)]
    try:
        aggregator = ray.get(ranks[0].aggregator_handle.remote(), timeout=60)
        began = ranks[1].begin.remote(1, "a1")
        held = ranks[0].report_through_aggregator_only.remote(1, "a0")
        ray.get(began, timeout=60)
        wait_until(
            lambda: ray.get(aggregator.pending.remote(), timeout=60) == 1, 60, "the report held"
        )
        ray.kill(aggregator, no_restart=False)
        assert ray.get(held, timeout=60).startswith("lost: driver rank 0: the node's report")
        ray.kill(aggregator, no_restart=True)
        saves = [rank.save.remote(2, f"b{i}") for i, rank in enumerate(ranks)]
        assert ray.get(saves, timeout=120) == [None, None]
        ray.get(finalizer.wait_for_commit.remote(2, 60.0), timeout=90)
        status = ray.get(finalizer.status.remote(), timeout=60)
        assert status["pending"] == {1: "driver rank 0, driver rank 1"}
    finally:
        for rank in ranks:
            ray.kill(rank, no_restart=True)
        ray.kill(finalizer, no_restart=True)
    _committed_and_verified_files(Path(root), 2)


def test_I5_ranks_whose_aggregator_hangs_report_directly_and_the_step_commits(ray_local, tmp_path):
    """Found by review: a report handed to a node's aggregator that does not answer (hung, its
    node overloaded) failed at the report's deadline, and the finalizer, never told, waited
    for the step's own deadline and then blamed the rank for a missing report. The rank now
    keeps part of its time for a direct call. The aggregator is stopped for real (SIGSTOP)
    after both ranks began step 1 through it."""
    root = str(tmp_path)
    finalizer = start_finalizer(
        root, {ROLE: 2}, max_ckpt_to_keep=None, timeout_s=120.0, max_in_flight=2
    )
    ranks = [_Rank.remote(root, r) for r in (0, 1)]
    pid = None
    try:
        aggregator = ray.get(ranks[0].aggregator_handle.remote(), timeout=60)
        ray.get([rank.begin.remote(1, f"a{i}") for i, rank in enumerate(ranks)], timeout=60)
        pid = ray.get(aggregator.__ray_call__.remote(lambda actor: os.getpid()), timeout=60)
        os.kill(pid, signal.SIGSTOP)
        # Reports due within 20 s: the aggregator has the first half (a save's own
        # deadline would leave it 30 s), the direct call the rest; the old code failed at
        # the deadline.
        delivered = [rank.deliver_began.remote(1, f"a{i}", 20.0) for i, rank in enumerate(ranks)]
        assert ray.get(delivered, timeout=60) == [None, None]
        ray.get(finalizer.wait_for_commit.remote(1, 30.0), timeout=60)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        for rank in ranks:
            ray.kill(rank, no_restart=True)
        ray.kill(finalizer, no_restart=True)
    _committed_and_verified_files(Path(root), 1)


@pytest.mark.parametrize("role", [ROLE, "actor"])
def test_I1_the_finalizer_checks_one_file_per_node_again_and_names_a_root_it_sees_otherwise(
    ray_local, tmp_path, role
):
    """The node's aggregator checks its ranks' files when their reports reach it, on the
    node that wrote them (in the step's directory, which its begins' answers name: a role's
    own directory's parent, the driver role's itself); the finalizer checks one report of
    each node again when the batch arrives. Rank 0's file is deleted after the node found it
    whole and before the batch left (the aggregator holds it for rank 1): the finalizer does
    not find it, and the step fails naming the file and the likely cause, a root that is not
    the same directory on the node and on the finalizer's."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {role: 2}, max_ckpt_to_keep=None, timeout_s=60.0)
    aggregator = start_holding_aggregator(root, finalizer)
    ranks = [_Rank.remote(root, r, role=role) for r in (0, 1)]
    prefix = "" if role == ROLE else f"{role}/"
    try:
        ray.get([rank.begin.remote(1, f"s{i}") for i, rank in enumerate(ranks)], timeout=60)
        held = ranks[0].report_began_through_aggregator.remote(1, "s0")
        wait_until(
            lambda: ray.get(aggregator.pending.remote(), timeout=60) == 1, 60, "the report held"
        )
        (step_dir(tmp_path, 1) / f"{prefix}part0.bin").unlink()
        ray.get([held, ranks[1].report_began_through_aggregator.remote(1, "s1")], timeout=60)
        with pytest.raises(StepNotCommittedError) as caught:
            ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
    finally:
        for actor in [*ranks, aggregator, finalizer]:
            ray.kill(actor, no_restart=True)
    message = str(caught.value)
    assert f"{prefix}part0.bin: reported by {role} rank 0 with 32 bytes, found no file" in message
    assert "found it as reported: is the root shared by every node?" in message
    assert read_tracker(tmp_path) is None


# ---- the group level: a role larger than report_group_size --------------------------------

GROUP_WORLD = 4
GROUP_SIZE = 2


def _group_ranks(root: str, ranks: tuple[int, ...]) -> list[ray.actor.ActorHandle]:
    """Ranks of a role of GROUP_WORLD in groups of GROUP_SIZE, each joined to the node's
    aggregator (and through it, its group's) once this returns."""
    actors = [_Rank.remote(root, r, GROUP_WORLD, GROUP_SIZE) for r in ranks]
    ray.get([a.aggregator_handle.remote() for a in actors], timeout=120)
    return actors


def _group_name(root: str, group: int) -> str:
    return group_aggregator_name(root, ROLE, group, GROUP_SIZE, GROUP_WORLD)


def _group_aggregators(root: str) -> list[ray.actor.ActorHandle]:
    """The groups' aggregators, once both are up (waited for: they start in the background
    when a node's aggregator needs them)."""
    names = [_group_name(root, g) for g in range(GROUP_WORLD // GROUP_SIZE)]
    found: dict[str, ray.actor.ActorHandle] = {}

    def all_found() -> bool:
        for name in names:
            try:
                found[name] = ray.get_actor(name, namespace=FINALIZER_NAMESPACE)
                ray.get(found[name].pending.remote(), timeout=60)
            except (ValueError, ray.exceptions.RayActorError):  # not yet, or still dying
                return False
        return True

    wait_until(all_found, 120, "both group aggregators up")
    return [found[name] for name in names]


def test_I1_a_large_role_reports_through_its_group_aggregators_one_call_per_group(
    ray_local, tmp_path
):
    """4 ranks in groups of 2, all on this node: the node's one batch leaves as 2 calls, one
    to each group's aggregator, and each group's batch reaches the finalizer as one call,
    for the begins as for the reports; the step commits every rank's file, and a second
    step goes the same way."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: GROUP_WORLD}, max_ckpt_to_keep=None, timeout_s=60.0)
    node = start_holding_aggregator(root, finalizer)
    ranks = _group_ranks(root, tuple(range(GROUP_WORLD)))
    groups = _group_aggregators(root)
    try:
        for step in (1, 2):
            saves = [rank.save.remote(step, f"s{step}r{i}") for i, rank in enumerate(ranks)]
            assert ray.get(saves, timeout=120) == [None] * GROUP_WORLD
            ray.get(finalizer.wait_for_commit.remote(step, 60.0), timeout=90)
            _committed_and_verified_files(Path(root), step)
            assert ray.get(node.batches_sent.remote(), timeout=60) == step
            assert ray.get([g.batches_sent.remote() for g in groups], timeout=60) == [step] * 2
            # Their begins went the same way: one batch per node and per group.
            assert ray.get(node.begin_batches_sent.remote(), timeout=60) == step
            assert (
                ray.get([g.begin_batches_sent.remote() for g in groups], timeout=60) == [step] * 2
            )
        record = read_commit_record(step_dir(Path(root), 2))
        assert sorted(f.path for f in record.files) == [f"part{r}.bin" for r in range(GROUP_WORLD)]
    finally:
        for actor in [*ranks, *groups, node, finalizer]:
            ray.kill(actor, no_restart=True)


def test_I5_a_node_whose_group_aggregator_died_sends_its_batch_straight_and_the_step_commits(
    ray_local, tmp_path
):
    """Group 0's aggregator holds rank 0's report (its rank 1 began the step through the
    group too, but reports directly, never through it) and is killed: the node's aggregator
    sends rank 0's report to the finalizer itself, rank 0's save succeeds, and once rank 1
    reported the step commits."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: GROUP_WORLD}, max_ckpt_to_keep=None, timeout_s=60.0)
    group = start_holding_aggregator(root, finalizer, _group_name(root, 0), (ROLE, 0, GROUP_SIZE))
    # The node's aggregator with its default linger: its batch of reports leaves without
    # rank 1, which reports directly.
    ranks = _group_ranks(root, tuple(range(GROUP_WORLD)))
    node = ray.get(ranks[0].aggregator_handle.remote(), timeout=60)
    batched, direct = [ranks[0], *ranks[2:]], ranks[1]
    try:
        began = direct.begin.remote(1, "r1")
        saves = [rank.save.remote(1, f"r{i}") for i, rank in enumerate(batched)]
        ray.get(began, timeout=60)
        wait_until(lambda: ray.get(group.pending.remote(), timeout=60) == 1, 60, "the report held")
        ray.kill(group, no_restart=False)
        assert ray.get(saves, timeout=120) == [None] * 3
        ray.get(direct.report_directly.remote(1, "r1"), timeout=120)
        ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
    finally:
        for actor in [*ranks, group, node, finalizer]:
            ray.kill(actor, no_restart=True)
    _committed_and_verified_files(Path(root), 1)


@ray.remote(num_cpus=0)
class _Squatter:
    """Another actor under a group aggregator's name (a name taken by anything else)."""

    def ping(self) -> None:
        return None


def test_I5_a_group_aggregator_that_cannot_start_leaves_the_batches_going_straight(
    ray_local, tmp_path
):
    """Group 0's name is taken by an actor that is no aggregator (fault injected: a real
    actor under that name): the node's aggregator cannot open group 0, says so, and sends
    group 0's reports straight to the finalizer, group 1's through its aggregator; the
    step commits."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: GROUP_WORLD}, max_ckpt_to_keep=None, timeout_s=60.0)
    squatter = _Squatter.options(name=_group_name(root, 0), namespace=FINALIZER_NAMESPACE).remote()
    ray.get(squatter.ping.remote(), timeout=60)
    node = start_holding_aggregator(root, finalizer)
    ranks = _group_ranks(root, tuple(range(GROUP_WORLD)))
    group_1 = ray.get_actor(_group_name(root, 1), namespace=FINALIZER_NAMESPACE)
    try:
        saves = [rank.save.remote(1, f"r{i}") for i, rank in enumerate(ranks)]
        assert ray.get(saves, timeout=120) == [None] * GROUP_WORLD
        ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
        assert ray.get(group_1.batches_sent.remote(), timeout=60) == 1
    finally:
        for actor in [*ranks, group_1, squatter, node, finalizer]:
            ray.kill(actor, no_restart=True)
    _committed_and_verified_files(Path(root), 1)


# Steps after the restart within which every group aggregator must carry a batch again.
LATER_STEPS = 4


def test_I5_a_restarted_node_aggregator_finds_its_groups_again_from_the_reports(
    ray_local, tmp_path
):
    """The node's aggregator is killed and restarted between steps (it loses its joins,
    and the group aggregators it started die with it): the steps commit throughout (while
    it restarts, ranks report directly; then it sends straight to the finalizer), and the
    reports that reach the restarted aggregator open the groups again: a later step goes
    through the groups again."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: GROUP_WORLD}, max_ckpt_to_keep=None, timeout_s=60.0)
    ranks = _group_ranks(root, tuple(range(GROUP_WORLD)))
    node = ray.get(ranks[0].aggregator_handle.remote(), timeout=60)
    try:
        _save_all(ranks, finalizer, 1)
        ray.kill(node, no_restart=False)
        wait_until(lambda: _answers(node), 60, "the node aggregator restarted")
        # Each rank's first call after the restart hears that its aggregator restarted
        # (Ray tells each caller once), and reports directly.
        _save_all(ranks, finalizer, 2)
        _save_all(ranks, finalizer, 3)
        groups = _group_aggregators(root)
        before = ray.get([g.batches_sent.remote() for g in groups], timeout=60)
        # Step 3's reports start opening the groups again, off their calls' path: on a
        # loaded machine a group may be up only after step 4 (the fresh-clone suite at
        # cb65c88 saw group 0 carry no batch of step 4). Later steps each get
        # the chance; every group must carry a batch again within a few of them.
        for step in range(4, 4 + LATER_STEPS):
            _save_all(ranks, finalizer, step)
            after = ray.get([g.batches_sent.remote() for g in groups], timeout=60)
            # At least one batch each (the default linger of 50 ms may split a group's
            # batch on a loaded machine; one batch per group is test_I1's, with a linger of
            # an hour).
            if all(a > b for a, b in zip(after, before, strict=True)):
                break
        else:
            pytest.fail(f"a group carried no batch again by step {step}: {before} -> {after}")
    finally:
        for actor in [*ranks, node, finalizer]:
            ray.kill(actor, no_restart=True)
    _committed_and_verified_files(Path(root), step)


def _answers(actor: ray.actor.ActorHandle) -> bool:
    try:
        return ray.get(actor.pending.remote(), timeout=60) == 0
    except ray.exceptions.RayActorError:  # restarting
        return False


def _save_all(ranks: list[ray.actor.ActorHandle], finalizer: ray.actor.ActorHandle, step: int):
    saves = [rank.save.remote(step, f"s{step}r{i}") for i, rank in enumerate(ranks)]
    assert ray.get(saves, timeout=120) == [None] * len(ranks)
    ray.get(finalizer.wait_for_commit.remote(step, 60.0), timeout=90)


def test_report_groups_are_ranges_of_ranks_of_larger_roles_only():
    assert not uses_groups(128, 128) and uses_groups(129, 128) and not uses_groups(4096, 0)
    assert [group_of(r, 128) for r in (0, 127, 128, 16_383)] == [0, 0, 1, 127]


def _committed_and_verified_files(root: Path, step: int) -> None:
    path = step_dir(root, step)
    assert read_tracker(root) == step
    assert verify_files(path, read_commit_record(path)) == []
