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
import logging
import pickle
import time
from pathlib import Path

import ray

from tests.helpers import start_holding_aggregator, wait_until
from verl_ckpt.commit.aggregator import group_aggregator_name, open_node_aggregator
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
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.messages import BeginRequest, RankReport, batch_begins, begin_rows
from verl_ckpt.store.checksummed_file import write_checksummed
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


def test_begins_travel_as_rows_and_arrive_as_they_were_sent():
    """An aggregator's batch of begins crosses Ray as rows of plain values (begin_rows) and
    each receiver turns them back into the same requests; objects are taken too."""
    sent = [BeginRequest(3, "actor", 5, 8, 12.5, "a"), BeginRequest(3, "critic", 0, 2, 1.0, None)]
    rows = pickle.loads(pickle.dumps(begin_rows(sent)))
    assert all(type(row) is tuple for row in rows)
    assert batch_begins(rows) == sent and batch_begins(sent) == sent


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


def test_I1_a_batch_removes_an_uncommitted_leftover_once_before_any_rank_writes(tmp_path, caplog):
    """A leftover of step 3 (an earlier run's, never committed) is gone before the batch's
    ranks hear their directory, removed once for the batch: none of its files mixes with
    the new save's."""
    leftover = step_dir(tmp_path, 3)
    leftover.mkdir(parents=True)
    (leftover / "stale.bin").write_bytes(b"old")

    async def run() -> list:
        finalizer = _finalizer(tmp_path)
        return await finalizer.begin_batch([_request(3, r) for r in range(WORLD)])

    with caplog.at_level(logging.WARNING, logger="verl_ckpt.commit.admission"):
        answers = asyncio.run(run())
    assert answers == [str(step_dir(tmp_path.resolve(), 3))] * WORLD
    assert list(Path(answers[0]).iterdir()) == []
    removals = [r for r in caplog.records if "removing uncommitted leftover" in r.getMessage()]
    assert len(removals) == 1, [r.getMessage() for r in removals]


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


def test_I5_a_batch_that_finds_no_room_answers_every_rank_at_its_timeout(tmp_path):
    """Step 1 in flight with max_in_flight=1: a batch of step 2's begins waits for room once,
    up to the longest timeout it carries (0.5 s), and every rank hears why, naming who step
    1 misses; it never waits longer."""

    async def run() -> list:
        finalizer = _finalizer(tmp_path)
        await finalizer.begin_step(1, ROLE, 0, WORLD, 10.0, "s1r0")
        requests = [_request(2, r, timeout_s=0.2 + 0.1 * r) for r in range(WORLD)]
        return await asyncio.wait_for(finalizer.begin_batch(requests), 5.0)

    started = time.monotonic()
    answers = asyncio.run(run())
    assert time.monotonic() - started >= 0.5
    assert all(isinstance(a, CommitTimeoutError) for a in answers), answers
    assert all("step 2 cannot start" in str(a) for a in answers)
    assert "missing reports: step 1:" in str(answers[0]), answers[0]


def test_I5_a_rank_whose_own_timeout_passed_while_its_batch_waited_for_room_is_refused(tmp_path):
    """A batch of step 2's begins with timeouts of 0.3 s and 10 s waits for room behind step
    1, which commits after about 1 s: the rank with 10 s begins; the one with 0.3 s, whose
    own call stopped waiting, is refused (as its own begin_step would have been), and is
    never joined to a step it does not know it began."""

    async def run() -> tuple[list, set]:
        finalizer = _finalizer(tmp_path)
        directories = [
            await finalizer.begin_step(1, ROLE, r, WORLD, 10.0, f"s1r{r}") for r in range(WORLD)
        ]

        async def commit_step_1_later() -> None:
            await asyncio.sleep(1.0)
            for rank, directory in enumerate(directories):
                await _report(finalizer, 1, rank, directory)

        later = asyncio.ensure_future(commit_step_1_later())
        answers = await finalizer.begin_batch([_request(2, 0, timeout_s=0.3), _request(2, 1)])
        await later
        # The ledger's own record of who began step 2 (no status call lists it).
        return answers, set(finalizer._ledger.entry(2).attempts)

    answers, began = asyncio.run(run())
    assert isinstance(answers[0], CommitTimeoutError), answers
    assert "past the 0.3s of driver rank 0" in str(answers[0]), answers[0]
    assert answers[1] == str(step_dir(tmp_path.resolve(), 2))
    assert began == {(ROLE, 1)}


# ---- with Ray: the aggregator actor ------------------------------------------------------


@ray.remote(num_cpus=0)
class _Rank:
    """A rank's process whose link begins through the node's aggregator (and, in a role of
    more than `group_size` ranks, its group's)."""

    def __init__(self, root: str, rank: int, world: int = 2, group_size: int = 0) -> None:
        handle = ray.get_actor(finalizer_name(root), namespace=FINALIZER_NAMESPACE)
        who = f"{ROLE} rank {rank}"
        aggregator = open_node_aggregator(root, handle, ROLE, rank, 30.0, who, world, group_size)
        self.link = ParticipantLink(
            FinalizerClient(handle, who, 30.0), ROLE, rank, world, 30.0, aggregator=aggregator
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

    def refusal(self, step: int, save_id: str) -> tuple[str, str]:
        """A begin through the link that is refused: the error's type and message."""
        try:
            self.link.begin(step, save_id)
        except CheckpointError as exc:
            return type(exc).__name__, str(exc)
        return "", "not refused"

    def fail(self, step: int) -> None:
        """This rank's save of `step` failed writing (reported through the link)."""
        self.link.report_failure(step, "failed", Phase.WRITE, OSError("disk on fire"))


def test_I5_a_rank_whose_aggregator_died_holding_its_begin_begins_directly(ray_local, tmp_path):
    """The node's aggregator (started first, with a linger of an hour) holds rank 0's
    begin of step 1, waiting for rank 1's, and is killed for good: rank 0 hears at once that
    it is gone and begins directly; rank 1 then does the same, and the step commits."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: 2}, max_ckpt_to_keep=None, timeout_s=60.0)
    aggregator = start_holding_aggregator(root, finalizer)
    ranks = [_Rank.remote(root, r) for r in (0, 1)]
    try:
        # Both joined it: a batch waits for every member's begin.
        handles = ray.get([rank.aggregator_handle.remote() for rank in ranks], timeout=60)
        assert handles == [aggregator] * 2
        held = ranks[0].save.remote(1)
        wait_until(
            lambda: ray.get(aggregator.pending.remote(), timeout=60) == 1, 60, "the begin held"
        )
        ray.kill(aggregator, no_restart=True)
        assert ray.get(held, timeout=60) is None
        assert ray.get(ranks[1].save.remote(1), timeout=60) is None
        ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
    finally:
        for actor in [*ranks, finalizer]:
            ray.kill(actor, no_restart=True)
    _committed_and_verified(Path(root), 1)


def test_I5_a_group_aggregator_that_died_holding_begins_leaves_them_to_the_finalizer(
    ray_local, tmp_path
):
    """A role of 4 ranks in groups of 2. Group 0's aggregator (started first, with a linger
    of an hour) holds rank 0's begin, waiting for rank 1's, and is killed for good: the
    node's aggregator sends rank 0's begin straight to the finalizer and rank 0's save goes
    on; once rank 1 saved too, the step commits."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: 4}, max_ckpt_to_keep=None, timeout_s=60.0)
    group_0 = group_aggregator_name(root, ROLE, 0, 2, 4)
    group = start_holding_aggregator(root, finalizer, group_0, (ROLE, 0, 2))
    ranks = [_Rank.remote(root, r, 4, 2) for r in range(4)]
    try:
        ray.get([rank.aggregator_handle.remote() for rank in ranks], timeout=120)
        saves = [ranks[r].save.remote(1) for r in (0, 2, 3)]
        held = "rank 0's begin held by its group"
        wait_until(lambda: ray.get(group.pending.remote(), timeout=60) == 1, 60, held)
        ray.kill(group, no_restart=True)
        assert ray.get(saves, timeout=120) == [None] * 3
        assert ray.get(ranks[1].save.remote(1), timeout=120) is None
        ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
    finally:
        for actor in [*ranks, finalizer]:
            ray.kill(actor, no_restart=True)
    _committed_and_verified(Path(root), 1)


def test_I5_a_refusal_through_the_aggregator_reaches_the_rank_as_its_own_type(ray_local, tmp_path):
    """Through the node's aggregator, a begin of a committed step is refused with the
    finalizer's one-line CheckpointError, and a begin of a step another rank failed with
    StepNotCommittedError naming that failure (the save runner tells the two apart)."""
    root = str(tmp_path)
    finalizer = start_finalizer(root, {ROLE: 2}, max_ckpt_to_keep=None, timeout_s=60.0)
    ranks = [_Rank.remote(root, r) for r in (0, 1)]
    try:
        ray.get([rank.aggregator_handle.remote() for rank in ranks], timeout=120)
        assert ray.get([rank.save.remote(1) for rank in ranks], timeout=120) == [None, None]
        ray.get(finalizer.wait_for_commit.remote(1, 60.0), timeout=90)
        kind, message = ray.get(ranks[0].refusal.remote(1, "again"), timeout=120)
        assert kind == "CheckpointError" and "step 1 is already committed" in message, message
        ray.get(ranks[0].fail.remote(2), timeout=120)
        kind, message = ray.get(ranks[1].refusal.remote(2, "late"), timeout=120)
        assert kind == "StepNotCommittedError" and "disk on fire" in message, message
    finally:
        for actor in [*ranks, finalizer]:
            ray.kill(actor, no_restart=True)


def _committed_and_verified(root: Path, step: int) -> None:
    path = step_dir(root, step)
    assert read_tracker(root) == step
    assert verify_files(path, read_commit_record(path)) == []
