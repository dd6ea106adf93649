"""Reports and begins batched per node, and per group of ranks (protocol page, steps 1 and 4,
from the ranks' side): a node's ranks hand their begin_step calls and their reports to the
node's aggregator, which forwards each step's begins, and each step's reports, of the node
as one call: to the finalizer's `begin_batch` and `report_batch`, or, in a role of more than
`report_group_size` ranks, to the aggregator of the rank group, which forwards those of its
`report_group_size` ranks to the finalizer as one call. When every rank of a job begins or
finishes a step at once, the finalizer then takes one call per group instead of one per
rank: its intake is serial (one event loop, and a Ray call costs it about as much as the
work of a hundred reports), so at 16,384 ranks on 2,048 nodes it takes 128 calls, not 2,048
(one per node) nor 16,384. Each level takes its calls in parallel with the others of its
level: a node aggregator its node's ranks', a group aggregator its nodes'.

Why a small Ray actor per node, and not the first rank of each node: a rank's actor runs
the trainer's calls one at a time, so the other ranks' calls would wait behind a training
step; and a rank that dies or is restarted would take its node's batch with it. The
aggregator is an async actor with no CPU slot, pinned to its node, named after the root and
the node so that every rank of the node finds the same one; it holds nothing but the begins
and reports of the step being batched.

A group is a range of ranks of one role (ranks g*size to (g+1)*size - 1, `group_of`): its
members are known from the start, so a group's batch leaves as soon as its last rank's
call arrives, whichever nodes they came through. A group aggregator is started by the first
node aggregator that needs it (at a rank's join, off the call's path) and found by name by
the others (`GroupRoutes`); a node aggregator sends a group's calls straight to the
finalizer until that group's aggregator is up. A restarted node aggregator finds its groups
again from the calls that reach it.

When a batch leaves: see commit/batcher.py (at once when the node's last member's call
arrives or with a failure; otherwise after a short linger). Each rank's call returns with
the finalizer's answer for it: its directory, or its report recorded; for a rank, going
through the aggregator is calling the finalizer. The finalizer admits a batch of begins
once (one wait for room, one removal of a leftover) and answers each rank what its own
begin_step would have (commit/admission.py).

An aggregator that dies loses the calls it holds: the ranks waiting on a node aggregator get
an error and call the finalizer directly instead (commit.participant.ParticipantLink), and a
node aggregator whose group aggregator died sends its batch straight to the finalizer (a
report a lost batch had delivered is a duplicate there, and ignored; a begin asked again
with the same save id is answered the same). A report that never arrives fails its step at
the step's deadline, naming the missing ranks, as without batching: nothing waits on an
aggregator for longer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from verl_ckpt.commit.batcher import LINGER_S, NodeBatcher
from verl_ckpt.commit.client import FINALIZER_NAMESPACE
from verl_ckpt.commit.steps import reported_files_problem
from verl_ckpt.protocol.deadlines import RPC_SLACK_S, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.messages import (
    BeginRequest,
    Participant,
    RankReport,
    ReportBatch,
    batch_begins,
    batch_reports,
    begin_rows,
)
from verl_ckpt.store.layout import DRIVER_ROLE

__all__ = [
    "AggregatorLost",
    "AggregatorTimeout",
    "NodeAggregator",
    "ReportAggregator",
    "aggregator_name",
    "batches_reports",
    "group_aggregator_name",
    "group_of",
    "open_node_aggregator",
    "uses_groups",
]

logger = logging.getLogger(__name__)

# report_batching=auto batches the begins and reports of a role of this many ranks or more.
AUTO_MIN_RANKS = 64
# The default of report_group_size: ranks per group aggregator in a role larger than this
# (0: no group level). The finalizer takes world/size calls and a group aggregator size/8
# (nodes of 8 ranks): at 4,096 to 16,384 ranks both stay between 16 and 128.
GROUP_SIZE = 128
# How long a rank's join waits for its group's aggregator to start, and how often a node
# aggregator tries again to open one that failed: until it is up, the node's batches go
# straight to the finalizer.
GROUP_START_S = 60.0
# Steps whose directory a node aggregator remembers (from their begins' answers), to check
# its ranks' reported files: a node's ranks save one step at a time, and a few roles.
_KNOWN_STEP_DIRS = 8


class AggregatorLost(CheckpointError):
    """The node's aggregator died or cannot be reached: call the finalizer directly."""


class AggregatorTimeout(CommitTimeoutError):
    """The node's aggregator did not answer in time (hung, or its node overloaded): not an
    answer of the finalizer, which may never have seen the call."""


class ReportAggregator:
    """The Ray actor of one node's batchers, or of one rank group's (`members`: the role and
    the range of ranks of the group; see the module docstring): one NodeBatcher for the
    members' reports, one for their begin_step calls. A node's aggregator is made with the
    root (`root_dir`), which it keeps across a restart; each join, begin and report carries
    its role's report_group_size, so that a restarted one finds its groups again from the
    calls themselves."""

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
        self._reports = NodeBatcher(self._forward_reports, linger_s)
        self._begins = NodeBatcher(self._forward_begins, linger_s)
        if members is not None:
            role, first, end = members
            for rank in range(first, end):
                self._join((role, rank))
        self._groups = GroupRoutes(root_dir, finalizer, timeout_s, linger_s)
        # A node's aggregator (made with the root) checks its ranks' reported files, on the
        # node that wrote them: the finalizer then stats one file per node, not per rank
        # (commit.intake._check_files). Each step's directory is the one the finalizer
        # answered its begins with; a report of a step it did not see begin is left to the
        # finalizer.
        self._node_id = ray.get_runtime_context().get_node_id() if root_dir is not None else None
        self._step_dirs: OrderedDict[int, str] = OrderedDict()

    def _join(self, participant: Participant) -> None:
        self._reports.join(participant)
        self._begins.join(participant)

    async def join(self, role: str, rank: int, world_size: int = 0, group_size: int = 0) -> None:
        """`role` `rank` (of `world_size`) runs on this node. In a role of more than
        `group_size` ranks, its group's aggregator is found or started now (waited for up
        to GROUP_START_S; until it is up, the node's batches go straight to the finalizer)."""
        self._join((role, rank))
        started = self._groups.open(role, rank, world_size, group_size)
        if started is not None:
            await asyncio.wait({started}, timeout=GROUP_START_S)

    async def begin(self, request: BeginRequest, group_size: int = 0) -> str | BaseException:
        """A rank's begin_step through the node's batch: its directory, or the refusal."""
        # After a restart nobody joins again: the calls name their groups.
        self._groups.open(request.role, request.rank, request.world_size, group_size)
        return await self._begins.submit(request)

    async def begin_batch(
        self, batch: list[BeginRequest] | list[tuple]
    ) -> list[str | BaseException]:
        """A node aggregator's batch of begins, into this group's batch: each one's answer
        once the group's batch was answered."""
        requests = batch_begins(batch)
        return list(await asyncio.gather(*(self._begins.submit(r) for r in requests)))

    async def report(self, report: RankReport, group_size: int = 0) -> BaseException | None:
        self._groups.open(report.role, report.rank, report.world_size, group_size)
        self._check_files(report)
        return await self._reports.submit(report)

    async def report_batch(
        self, batch: ReportBatch | list[RankReport]
    ) -> list[BaseException | None]:
        """A node aggregator's batch, into this group's batch: each report's answer once the
        group's batch was delivered."""
        reports = batch_reports(batch)
        return list(await asyncio.gather(*(self._reports.submit(r) for r in reports)))

    async def pending(self) -> int:
        """Reports and begins held, not yet forwarded (for tests)."""
        return self._reports.pending() + self._begins.pending()

    async def batches_sent(self) -> int:
        """Batches of reports forwarded so far."""
        return self._reports.batches_sent

    async def begin_batches_sent(self) -> int:
        """Batches of begins forwarded so far."""
        return self._begins.batches_sent

    def _check_files(self, report: RankReport) -> None:
        """On a node's aggregator: what is wrong on disk with the files `report` names, as
        the finalizer would find it, and that this node found it."""
        step_path = self._step_dirs.get(report.step) if self._node_id is not None else None
        report.files_on_arrival = report.files_checked_on = None
        if step_path is None:
            return
        try:
            report.files_on_arrival = reported_files_problem(step_path, report)
        except OSError:  # a file that cannot be looked at here: the finalizer says what
            return
        report.files_checked_on = self._node_id

    async def _forward_reports(self, reports: list[RankReport]) -> list[BaseException | None]:
        return await self._forward(_REPORTS, reports, self._timeout_s)

    async def _forward_begins(self, requests: list[BeginRequest]) -> list[str | BaseException]:
        # The finalizer waits up to each begin's own timeout for room to start the step.
        wait_s = max(self._timeout_s, *(r.timeout_s for r in requests))
        answers = await self._forward(_BEGINS, requests, wait_s)
        if self._node_id is not None:
            self._remember_step_dirs(requests, answers)
        return answers

    def _remember_step_dirs(self, requests: list[BeginRequest], answers: list) -> None:
        # A role's directory is its step's directory's child; the driver role's is the
        # step's own.
        for request, answer in zip(requests, answers, strict=True):
            if isinstance(answer, str) and request.step not in self._step_dirs:
                own = request.role == DRIVER_ROLE
                self._step_dirs[request.step] = answer if own else os.path.dirname(answer)
                while len(self._step_dirs) > _KNOWN_STEP_DIRS:
                    self._step_dirs.popitem(last=False)

    async def _forward(self, kind: _Kind, items: list, timeout_s: float) -> list:
        """A batch that left: the items of each group whose aggregator is up to it, the
        others straight to the finalizer; the answers in the batch's order. One part that
        fails answers its own items only."""
        parts: dict[Route | None, list[int]] = {}
        for i, item in enumerate(items):
            parts.setdefault(self._groups.route(item.role, item.rank), []).append(i)
        answers: list = [None] * len(items)

        async def send(route: Route | None, indices: list[int]) -> None:
            part = [items[i] for i in indices]
            try:
                got = await (
                    _send_batch(self._finalizer, kind, part, timeout_s, "the finalizer")
                    if route is None
                    else self._to_group(route, kind, part, timeout_s)
                )
                if len(got) != len(part):
                    raise CheckpointError(f"{len(got)} answers to a batch of {len(part)}")
            except Exception as exc:  # noqa: BLE001 - each rank of the part hears it
                got = [exc] * len(part)
            for i, answer in zip(indices, got, strict=True):
                answers[i] = answer

        await asyncio.gather(*(send(route, indices) for route, indices in parts.items()))
        return answers

    async def _to_group(self, route: Route, kind: _Kind, items: list, timeout_s: float) -> list:
        started = time.monotonic()
        try:
            # Its own wait on the finalizer is timeout_s + RPC_SLACK_S: this one is longer,
            # so that a group that hears nothing says so. Both only bound a batch that would
            # otherwise wait forever: a rank's own deadline (the step's) governs what it hears.
            return await _send_batch(
                route.handle,
                kind,
                items,
                timeout_s + RPC_SLACK_S,
                "the group's report aggregator",
                raise_ray_errors=True,
            )
        except ray.exceptions.RayError as exc:
            # Dead (its owner, the node aggregator that started it, died with it), restarting
            # or broken: this batch goes straight, and the next call opens it again.
            self._groups.lost(route, exc)
            spent_s = time.monotonic() - started
            return await _send_batch(
                self._finalizer,
                kind,
                kind.again(items, spent_s),
                max(0.0, timeout_s - spent_s),
                "the finalizer",
            )


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

    def route(self, role: str, rank: int) -> Route | None:
        """Where `role` `rank`'s calls go: its group's aggregator if that is up, None (the
        finalizer) otherwise or without groups."""
        sizes = self._sizes.get(role)
        if sizes is None:
            return None
        key = (role, group_of(rank, sizes[0]), *sizes)
        task = self._opening.get(key)
        if task is None or not task.done() or _failed(task):
            return None
        return Route(key, task.result())

    def lost(self, route: Route, exc: BaseException) -> None:
        """The aggregator of `route` failed a call: forget it (unless it was opened again
        since), so that the next call through it opens it again."""
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


@dataclass(frozen=True)
class _Kind:
    """What a batch carries: the receiver's method for it (the finalizer's and a group
    aggregator's alike), how the call carries the items, and the items sent again after
    `spent_s` seconds (a group aggregator lost: straight to the finalizer)."""

    method: str
    pack: Callable[[list], object]
    again: Callable[[list, float], list]


def _begins_again(requests: list[BeginRequest], spent_s: float) -> list[BeginRequest]:
    # What is left of each begin's own wait: the finalizer's refusal (naming who holds the
    # step back) must still arrive before the rank's deadline.
    return [replace(r, timeout_s=max(0.0, r.timeout_s - spent_s)) for r in requests]


# Reports travel packed (ReportBatch: one pickle for the batch), begins as rows of values.
_REPORTS = _Kind("report_batch", ReportBatch.of, lambda reports, spent_s: reports)
_BEGINS = _Kind("begin_batch", begin_rows, _begins_again)


async def _send_batch(
    to: ray.actor.ActorHandle,
    kind: _Kind,
    items: list,
    timeout_s: float,
    what: str,
    raise_ray_errors: bool = False,
) -> list:
    """`items` as one call of `kind` to `to` (the finalizer or a group's aggregator), waited
    for up to `timeout_s` + RPC_SLACK_S: each item's answer. A timeout or a refused call
    answers every item; with `raise_ray_errors`, any other failure of the call (Ray's) is
    raised instead."""
    wait_s = timeout_s + RPC_SLACK_S
    ref = getattr(to, kind.method).remote(kind.pack(items))
    try:
        return await asyncio.wait_for(_awaited(ref), wait_s)
    except TimeoutError:
        return [
            CommitTimeoutError(f"the report aggregator: {what} did not answer within {wait_s:.0f}s")
        ] * len(items)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, CheckpointError):
            return [exc.cause] * len(items)
        if raise_ray_errors:
            raise
        return [exc] * len(items)


async def _awaited(ref: ray.ObjectRef):
    return await ref


def batches_reports(mode: str, world_size: int) -> bool:
    """Whether a rank of a role of `world_size` ranks begins and reports through its node's
    aggregator (config key report_batching: node, off, or auto: from AUTO_MIN_RANKS ranks,
    below which the finalizer takes each call in well under a millisecond anyway)."""
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
    """A rank's side of its node's aggregator: `begin` and `report` as FinalizerClient's
    begin_step and report do them."""

    def __init__(self, handle: ray.actor.ActorHandle, who: str, group_size: int = 0) -> None:
        self.handle = handle
        self.who = who
        self._group_size = group_size

    def begin(self, request: BeginRequest, deadline: float) -> str:
        """begin_step through the node's batch: the participant's directory; raise the
        finalizer's refusal, CommitTimeoutError past `deadline`, AggregatorLost when the
        aggregator is gone."""
        return self._call(self.handle.begin.remote(request, self._group_size), deadline)

    def report(self, report: RankReport, deadline: float) -> None:
        """Deliver `report` through the node's batch; raise as `begin` does."""
        self._call(self.handle.report.remote(report, self._group_size), deadline)

    def _call(self, ref: ray.ObjectRef, deadline: float):
        try:
            answer = ray.get(ref, timeout=time_left(deadline, 0.1))
        except ray.exceptions.GetTimeoutError:
            raise AggregatorTimeout(
                f"{self.who}: the node's report aggregator did not answer in time"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise AggregatorLost(
                f"{self.who}: the node's report aggregator is gone ({type(exc).__name__})"
            ) from None
        if isinstance(answer, BaseException):
            raise answer
        return answer


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
