"""Reports batched per node, and per group of ranks (protocol page, step 4, from the ranks'
side): a node's ranks hand their reports to the node's aggregator, which forwards each
step's reports of the node as one call: to the finalizer's `report_batch`, or, in a role of
more than `report_group_size` ranks, to the aggregator of the rank group, which forwards the
reports of its `report_group_size` ranks to the finalizer as one call. When every rank of a
job finishes a step at once, the finalizer then takes one call per group instead of one per
rank: its intake is serial (one event loop, and a Ray call costs it about as much as the
work of a hundred reports), so at 16,384 ranks on 2,048 nodes it takes 128 calls, not 2,048
(one per node) nor 16,384. Each level takes its calls in parallel with the others of its
level: a node aggregator its node's ranks', a group aggregator its nodes'.

Why a small Ray actor per node, and not the first rank of each node: a rank's actor runs
the trainer's calls one at a time, so the other ranks' reports would wait behind a
training step; and a rank that dies or is restarted would take its node's batch with it.
The aggregator is an async actor with no CPU slot, pinned to its node, named after the root
and the node so that every rank of the node finds the same one; it holds nothing but the
reports of the step being batched.

A group is a range of ranks of one role (ranks g*size to (g+1)*size - 1, `group_of`): its
members are known from the start, so a group's batch leaves as soon as its last rank's
report arrives, whichever nodes they came through. A group aggregator is started by the
first node aggregator that needs it (at a rank's join, off the report's path) and found by
name by the others (`GroupRoutes`); a node aggregator sends a group's reports straight to
the finalizer until that group's aggregator is up. A restarted node aggregator finds its
groups again from the reports that reach it.

When a batch leaves (`NodeBatcher`, at either level):
- at once when every rank of the node that joined has reported the step (the usual case:
  the node's last report does not wait);
- at once with a failure: a rank's failure fails the step now, not when its node's batch
  fills (the successes batched so far go with it);
- otherwise `linger_s` after the batch's first report (a rank of the node that never
  reports, or one that joined another node's aggregator after a restart).
Each rank's call returns once the finalizer recorded its report, with the finalizer's
answer for that report: for a rank, reporting through the aggregator is reporting.

An aggregator that dies loses the reports it holds: the ranks waiting on a node aggregator
get an error and report straight to the finalizer instead
(commit.participant.ParticipantLink.report), and a node aggregator whose group aggregator
died sends its batch straight to the finalizer (a report a lost batch had delivered is a
duplicate there, and ignored). A report that never
arrives fails its step at the step's deadline, naming the missing ranks, as without
batching: nothing waits on an aggregator for longer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from verl_ckpt.commit.client import FINALIZER_NAMESPACE
from verl_ckpt.protocol.deadlines import RPC_SLACK_S, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.messages import Participant, RankReport, ReportBatch, batch_reports

__all__ = [
    "AggregatorLost",
    "NodeAggregator",
    "NodeBatcher",
    "ReportAggregator",
    "aggregator_name",
    "batches_reports",
    "group_aggregator_name",
    "group_of",
    "open_node_aggregator",
    "uses_groups",
]

logger = logging.getLogger(__name__)

# How long a batch waits for the node's missing ranks before it leaves without them.
LINGER_S = 0.05
# Steps whose forwarded ranks a batcher remembers (to know when a node's step is complete).
_REMEMBERED_STEPS = 8

# report_batching=auto batches the reports of a role of this many ranks or more.
AUTO_MIN_RANKS = 64
# The default of report_group_size: ranks per group aggregator in a role larger than this
# (0: no group level). The finalizer takes world/size calls and a group aggregator size/8
# (nodes of 8 ranks): at 4,096 to 16,384 ranks both stay between 16 and 128.
GROUP_SIZE = 128
# How long a rank's join waits for its group's aggregator to start, and how often a node
# aggregator tries again to open one that failed: until it is up, the node's batches go
# straight to the finalizer.
GROUP_START_S = 60.0

Forward = Callable[[list[RankReport]], Awaitable[list[BaseException | None]]]


class AggregatorLost(CheckpointError):
    """The node's aggregator died or cannot be reached: report straight to the finalizer."""


@dataclass
class _Batch:
    reports: list[RankReport] = field(default_factory=list)
    waiting: list[asyncio.Future] = field(default_factory=list)
    participants: set[Participant] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class NodeBatcher:
    """The batching of one node's reports, step by step (no Ray: the actor and the benchmark
    wrap it). Used from one event loop only."""

    def __init__(self, forward: Forward, linger_s: float = LINGER_S) -> None:
        self._forward = forward
        self._linger_s = linger_s
        self._members: set[Participant] = set()
        self._batches: dict[int, _Batch] = {}
        # Per recent step, the participants whose reports were forwarded already.
        self._sent: OrderedDict[int, set[Participant]] = OrderedDict()
        self._sending: set[asyncio.Task] = set()
        # Batches forwarded so far (status and tests: one per node or group when every
        # rank reports at once).
        self.batches_sent = 0

    def join(self, participant: Participant) -> None:
        """`participant` runs on this node: a step's batch waits for its report."""
        self._members.add(participant)

    async def report(self, report: RankReport) -> BaseException | None:
        """Batch `report`; the finalizer's answer for it once its batch was delivered (an
        error is returned, not raised: the caller raises it in the rank)."""
        # A rank that reports is on this node (also after this batcher lost its joins).
        self._members.add(report.participant)
        batch = self._batches.setdefault(report.step, _Batch())
        answer = asyncio.get_running_loop().create_future()
        batch.reports.append(report)
        batch.waiting.append(answer)
        batch.participants.add(report.participant)
        if report.failure is not None or self._complete(report.step, batch):
            self._flush(report.step)
        elif batch.timer is None:
            batch.timer = asyncio.get_running_loop().call_later(
                self._linger_s, self._flush, report.step
            )
        return await answer

    def pending(self) -> int:
        """Reports held, not yet forwarded (for tests)."""
        return sum(len(b.reports) for b in self._batches.values())

    def _complete(self, step: int, batch: _Batch) -> bool:
        sent = self._sent.get(step, set())
        return len(self._members - sent - batch.participants) == 0

    def _flush(self, step: int) -> None:
        batch = self._batches.pop(step, None)
        if batch is None:
            return  # the timer of a batch that left already
        if batch.timer is not None:
            batch.timer.cancel()
        self._sent.setdefault(step, set()).update(batch.participants)
        self._sent.move_to_end(step)
        while len(self._sent) > _REMEMBERED_STEPS:
            self._sent.popitem(last=False)
        self.batches_sent += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: _Batch) -> None:
        try:
            answers = list(await self._forward(batch.reports))
            if len(answers) != len(batch.reports):
                raise CheckpointError(
                    f"the finalizer answered {len(answers)} of a batch of {len(batch.reports)}"
                )
        except Exception as exc:  # noqa: BLE001 - every rank of the batch hears it
            answers = [exc] * len(batch.reports)
        # Every waiting rank is answered, whatever happened: none waits to its deadline.
        for waiting, answer in zip(batch.waiting, answers, strict=True):
            if not waiting.done():
                waiting.set_result(answer)


class ReportAggregator:
    """The Ray actor of one node's NodeBatcher, or of one rank group's (`members`: the role
    and the range of ranks of the group; see the module docstring). A node's aggregator is
    made with the root (`root_dir`), which it keeps across a restart; each join and report
    carries its role's report_group_size, so that a restarted one finds its groups again
    from the reports themselves."""

    def __init__(
        self,
        finalizer: ray.actor.ActorHandle,
        timeout_s: float,
        linger_s: float = LINGER_S,
        members: tuple[str, int, int] | None = None,
        root_dir: str | None = None,
    ) -> None:
        self._finalizer = finalizer
        self._timeout_s = timeout_s
        self._batcher = NodeBatcher(self._forward, linger_s)
        if members is not None:
            role, first, end = members
            for rank in range(first, end):
                self._batcher.join((role, rank))
        self._groups = GroupRoutes(root_dir, finalizer, timeout_s, linger_s)

    async def join(self, role: str, rank: int, world_size: int = 0, group_size: int = 0) -> None:
        """`role` `rank` (of `world_size`) runs on this node. In a role of more than
        `group_size` ranks, its group's aggregator is found or started now (waited for up
        to GROUP_START_S; until it is up, the node's batches go straight to the finalizer)."""
        self._batcher.join((role, rank))
        started = self._groups.open(role, rank, world_size, group_size)
        if started is not None:
            await asyncio.wait({started}, timeout=GROUP_START_S)

    async def report(self, report: RankReport, group_size: int = 0) -> BaseException | None:
        # After a restart nobody joins again: the reports name their groups.
        self._groups.open(report.role, report.rank, report.world_size, group_size)
        return await self._batcher.report(report)

    async def report_batch(
        self, batch: ReportBatch | list[RankReport]
    ) -> list[BaseException | None]:
        """A node aggregator's batch, into this group's batch: each report's answer once the
        group's batch was delivered."""
        reports = batch_reports(batch)
        return list(await asyncio.gather(*(self._batcher.report(r) for r in reports)))

    async def pending(self) -> int:
        return self._batcher.pending()

    async def batches_sent(self) -> int:
        return self._batcher.batches_sent

    async def _forward(self, reports: list[RankReport]) -> list[BaseException | None]:
        """A batch that left: the reports of each group whose aggregator is up to it, the
        others straight to the finalizer; the answers in the batch's order. One part that
        fails answers its own reports only."""
        parts: dict[Route | None, list[int]] = {}
        for i, report in enumerate(reports):
            parts.setdefault(self._groups.route(report), []).append(i)
        answers: list[BaseException | None] = [None] * len(reports)

        async def send(route: Route | None, indices: list[int]) -> None:
            part = [reports[i] for i in indices]
            try:
                got = await (
                    _send_batch(self._finalizer, part, self._timeout_s, "the finalizer")
                    if route is None
                    else self._to_group(route, part)
                )
                if len(got) != len(part):
                    raise CheckpointError(f"{len(got)} answers to a batch of {len(part)}")
            except Exception as exc:  # noqa: BLE001 - each rank of the part hears it
                got = [exc] * len(part)
            for i, answer in zip(indices, got, strict=True):
                answers[i] = answer

        await asyncio.gather(*(send(route, indices) for route, indices in parts.items()))
        return answers

    async def _to_group(self, route: Route, reports: list[RankReport]) -> list:
        try:
            # Its own wait on the finalizer is timeout_s + RPC_SLACK_S: this one is longer,
            # so that a group that hears nothing says so. Both only bound a batch that would
            # otherwise wait forever: a rank's own deadline (the step's) governs what it hears.
            return await _send_batch(
                route.handle,
                reports,
                self._timeout_s + RPC_SLACK_S,
                "the group's report aggregator",
                raise_ray_errors=True,
            )
        except ray.exceptions.RayError as exc:
            # Dead (its owner, the node aggregator that started it, died with it), restarting
            # or broken: this batch goes straight, and the next report opens it again.
            self._groups.lost(route, exc)
            return await _send_batch(self._finalizer, reports, self._timeout_s, "the finalizer")


@dataclass(frozen=True)
class Route:
    """A group aggregator that is up, as GroupRoutes hands it to a batch that leaves."""

    key: tuple[str, int, int, int]  # role, group, group size, world size
    handle: ray.actor.ActorHandle


class GroupRoutes:
    """A node aggregator's way to its groups' aggregators (module docstring): each started
    (or found by name) when a rank of its group joins or reports, used once it is up, and
    opened again when it died, or GROUP_START_S after it failed to start."""

    def __init__(
        self,
        root_dir: str | None,
        finalizer: ray.actor.ActorHandle,
        timeout_s: float,
        linger_s: float,
    ) -> None:
        # Resolved once: the names are made on the event loop.
        self._root = str(Path(root_dir).resolve()) if root_dir is not None else None
        self._finalizer = finalizer
        self._timeout_s = timeout_s
        self._linger_s = linger_s
        # Per role, the sizes its ranks said last (group size, world size).
        self._sizes: dict[str, tuple[int, int]] = {}
        self._opening: dict[tuple[str, int, int, int], asyncio.Task] = {}
        self._failed_at: dict[tuple[str, int, int, int], float] = {}

    def open(self, role: str, rank: int, world_size: int, group_size: int) -> asyncio.Task | None:
        """Start opening the aggregator of `role` `rank`'s group unless it is open, opening,
        or failed within GROUP_START_S; the opening, None without groups."""
        if self._root is None or not uses_groups(world_size, group_size):
            return None
        self._sizes[role] = (group_size, world_size)
        key = (role, group_of(rank, group_size), group_size, world_size)
        task = self._opening.get(key)
        if task is None or (
            _failed(task) and time.monotonic() - self._failed_at.get(key, 0.0) > GROUP_START_S
        ):
            task = asyncio.get_running_loop().create_task(self._open(key))
            task.add_done_callback(lambda done: self._started(key, done))
            self._opening[key] = task
        return task

    def route(self, report: RankReport) -> Route | None:
        """Where `report` goes: its group's aggregator if that is up, None (the finalizer)
        otherwise or without groups."""
        sizes = self._sizes.get(report.role)
        if sizes is None:
            return None
        key = (report.role, group_of(report.rank, sizes[0]), *sizes)
        task = self._opening.get(key)
        if task is None or not task.done() or _failed(task):
            return None
        return Route(key, task.result())

    def lost(self, route: Route, exc: BaseException) -> None:
        """The aggregator of `route` failed a call: forget it (unless it was opened again
        since), so that the next report opens it again."""
        task = self._opening.get(route.key)
        if task is None or not task.done() or _failed(task) or task.result() is not route.handle:
            return
        del self._opening[route.key]
        logger.warning(
            "the report aggregator of %s is gone (%s): its batches go straight to the "
            "finalizer until it is opened again",
            _describe(route.key),
            type(exc).__name__,
        )

    async def _open(self, key: tuple[str, int, int, int]) -> ray.actor.ActorHandle:
        role, group, size, world_size = key
        members = (role, group * size, min(world_size, (group + 1) * size))
        options = {
            "name": group_aggregator_name(self._root, role, group, size, world_size),
            "namespace": FINALIZER_NAMESPACE,
            "get_if_exists": True,
            # Restarted empty if it dies, with the same members; the node aggregators whose
            # calls it held send those batches to the finalizer themselves. Owned by the node
            # aggregator that started it, and gone with it: the next report of the group
            # through a node aggregator starts it again.
            "max_restarts": -1,
            "max_task_retries": 0,
            "num_cpus": 0,
        }
        args = (self._finalizer, self._timeout_s, self._linger_s, members)
        deadline = time.monotonic() + GROUP_START_S
        while True:
            # In a thread: get_if_exists looks the name up with a blocking call.
            handle = await asyncio.to_thread(
                lambda: ray.remote(ReportAggregator).options(**options).remote(*args)
            )
            try:
                await asyncio.wait_for(_awaited(handle.pending.remote()), time_left(deadline))
                return handle
            except ray.exceptions.RayActorError as exc:
                # The name still held by an aggregator that is dying (its owner just died):
                # once it is dead, the name is free for a new one. One that cannot even be
                # made will not be made by trying again.
                if getattr(exc, "actor_init_failed", False) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    def _started(self, key: tuple[str, int, int, int], task: asyncio.Task) -> None:
        if not _failed(task) or self._opening.get(key) is not task:
            return
        self._failed_at[key] = time.monotonic()
        exc = task.exception() if not task.cancelled() else None
        logger.warning(
            "the report aggregator of %s could not be started (%s): this node sends their "
            "batches straight to the finalizer",
            _describe(key),
            type(exc).__name__ if exc is not None else "cancelled",
        )


def _describe(key: tuple[str, int, int, int]) -> str:
    role, group, size, world_size = key
    return f"{role} ranks {group * size}-{min(world_size, (group + 1) * size) - 1}"


def _failed(task: asyncio.Task) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


async def _send_batch(
    to: ray.actor.ActorHandle,
    reports: list[RankReport],
    timeout_s: float,
    what: str,
    raise_ray_errors: bool = False,
) -> list[BaseException | None]:
    """`reports` packed, as one `report_batch` call to `to` (the finalizer or a group's
    aggregator), waited for up to `timeout_s` + RPC_SLACK_S: each report's answer. A timeout
    or a refused call answers every report; with `raise_ray_errors`, any other failure of
    the call (Ray's) is raised instead."""
    wait_s = timeout_s + RPC_SLACK_S
    ref = to.report_batch.remote(ReportBatch.of(reports))
    try:
        return await asyncio.wait_for(_awaited(ref), wait_s)
    except TimeoutError:
        return [
            CommitTimeoutError(f"the report aggregator: {what} did not answer within {wait_s:.0f}s")
        ] * len(reports)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, CheckpointError):
            return [exc.cause] * len(reports)
        if raise_ray_errors:
            raise
        return [exc] * len(reports)


async def _awaited(ref: ray.ObjectRef):
    return await ref


def batches_reports(mode: str, world_size: int) -> bool:
    """Whether a rank of a role of `world_size` ranks reports through its node's aggregator
    (config key report_batching: node, off, or auto: from AUTO_MIN_RANKS ranks, below which
    the finalizer takes each report in well under a millisecond anyway)."""
    return mode == "node" or (mode == "auto" and world_size >= AUTO_MIN_RANKS)


def aggregator_name(root_dir: str | Path, node_id: str) -> str:
    """The aggregator of a root on a node: found by every rank of the node."""
    digest = hashlib.sha1(f"{Path(root_dir).resolve()}|{node_id}".encode()).hexdigest()[:16]
    return f"verl_ckpt_aggregator_{digest}"


def group_aggregator_name(
    root_dir: str | Path, role: str, group: int, group_size: int, world_size: int
) -> str:
    """The aggregator of a root's rank group `group` of `role`: found by every node's (the
    sizes in the name: a role made again with other sizes in the same job gets new ones)."""
    return aggregator_name(root_dir, f"group|{role}|{group}|{group_size}|{world_size}")


def uses_groups(world_size: int, group_size: int) -> bool:
    """Whether a role of `world_size` ranks reports through group aggregators
    (report_group_size: 0 turns the group level off)."""
    return group_size > 0 and world_size > group_size


def group_of(rank: int, group_size: int) -> int:
    """The rank group of `rank`: ranks g*group_size to (g+1)*group_size - 1 form group g."""
    return rank // group_size


class NodeAggregator:
    """A rank's side of its node's aggregator: `report` as FinalizerClient.report does it."""

    def __init__(self, handle: ray.actor.ActorHandle, who: str, group_size: int = 0) -> None:
        self.handle = handle
        self.who = who
        self._group_size = group_size

    def report(self, report: RankReport, deadline: float) -> None:
        """Deliver `report` through the node's batch; raise the finalizer's refusal of it,
        CommitTimeoutError past `deadline`, AggregatorLost when the aggregator is gone."""
        ref = self.handle.report.remote(report, self._group_size)
        try:
            answer = ray.get(ref, timeout=time_left(deadline, 0.1))
        except ray.exceptions.GetTimeoutError:
            raise CommitTimeoutError(
                f"{self.who}: the node's report aggregator did not answer in time"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise AggregatorLost(
                f"{self.who}: the node's report aggregator is gone ({type(exc).__name__})"
            ) from None
        if answer is not None:
            raise answer


def open_node_aggregator(
    root_dir: str | Path,
    finalizer: ray.actor.ActorHandle,
    role: str,
    rank: int,
    timeout_s: float,
    who: str,
    world_size: int = 0,
    group_size: int = 0,
) -> NodeAggregator:
    """Start (or find) the aggregator of `root_dir` on this node and join it as `role`
    `rank`; call it from the rank's own process, on its node. A role of more than
    `group_size` ranks (`world_size`) reports through group aggregators as well."""
    node = ray.get_runtime_context().get_node_id()
    handle = (
        ray.remote(ReportAggregator)
        .options(
            name=aggregator_name(root_dir, node),
            namespace=FINALIZER_NAMESPACE,
            get_if_exists=True,
            # Restarted if it dies, empty: the calls it held fail (their ranks report
            # straight to the finalizer), later ones reach the new instance.
            max_restarts=-1,
            max_task_retries=0,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(finalizer, timeout_s, LINGER_S, None, str(root_dir))
    )
    # join waits up to GROUP_START_S for the group's aggregator, and never fails for it.
    wait_s = timeout_s + GROUP_START_S
    try:
        ray.get(handle.join.remote(role, rank, world_size, group_size), timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        raise CommitTimeoutError(
            f"{who}: the node's report aggregator did not start within {wait_s:.0f}s"
        ) from None
    return NodeAggregator(handle, who, group_size)
