"""Reports batched per node (protocol page, step 4, from the ranks' side): a node's ranks
hand their reports to the node's aggregator, which forwards each step's reports of the node
to the finalizer as one `report_batch` call. When every rank of a job finishes a step at
once, the finalizer then takes one call per node instead of one per rank: at 16,384 ranks
on 2,048 nodes its intake, which is serial (one event loop), grows with the nodes.

Why a small Ray actor per node, and not the first rank of each node: a rank's actor runs
the trainer's calls one at a time, so the other ranks' reports would wait behind a
training step; and a rank that dies or is restarted would take its node's batch with it.
The aggregator is an async actor with no CPU slot, pinned to its node, named after the root
and the node so that every rank of the node finds the same one; it holds nothing but the
reports of the step being batched.

When a batch leaves (`NodeBatcher`):
- at once when every rank of the node that joined has reported the step (the usual case:
  the node's last report does not wait);
- at once with a failure: a rank's failure fails the step now, not when its node's batch
  fills (the successes batched so far go with it);
- otherwise `linger_s` after the batch's first report (a rank of the node that never
  reports, or one that joined another node's aggregator after a restart).
Each rank's call returns once the finalizer recorded its report, with the finalizer's
answer for that report: for a rank, reporting through the aggregator is reporting.

An aggregator that dies loses the reports it holds: the ranks waiting on it get an error
and report straight to the finalizer instead (commit.participant.ParticipantLink.report; a
report the batch had delivered is a duplicate there, and ignored). A report that never
arrives fails its step at the step's deadline, naming the missing ranks, as without
batching: nothing waits on an aggregator for longer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from verl_ckpt.commit.client import FINALIZER_NAMESPACE
from verl_ckpt.protocol.deadlines import RPC_SLACK_S, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.messages import Participant, RankReport

__all__ = [
    "AggregatorLost",
    "NodeAggregator",
    "NodeBatcher",
    "ReportAggregator",
    "aggregator_name",
    "batches_reports",
    "open_node_aggregator",
]

logger = logging.getLogger(__name__)

# How long a batch waits for the node's missing ranks before it leaves without them.
LINGER_S = 0.05
# Steps whose forwarded ranks a batcher remembers (to know when a node's step is complete).
_REMEMBERED_STEPS = 8

# report_batching=auto batches the reports of a role of this many ranks or more.
AUTO_MIN_RANKS = 64

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
    """The Ray actor of one node's NodeBatcher (see the module docstring)."""

    def __init__(
        self, finalizer: ray.actor.ActorHandle, timeout_s: float, linger_s: float = LINGER_S
    ) -> None:
        self._finalizer = finalizer
        self._timeout_s = timeout_s
        self._batcher = NodeBatcher(self._forward, linger_s)

    async def join(self, role: str, rank: int) -> None:
        self._batcher.join((role, rank))

    async def report(self, report: RankReport) -> BaseException | None:
        return await self._batcher.report(report)

    async def pending(self) -> int:
        return self._batcher.pending()

    async def _forward(self, reports: list[RankReport]) -> list[BaseException | None]:
        ref = self._finalizer.report_batch.remote(reports)
        try:
            return await asyncio.wait_for(_awaited(ref), self._timeout_s + RPC_SLACK_S)
        except TimeoutError:
            return [
                CommitTimeoutError(
                    f"the node's report aggregator: the finalizer did not answer within "
                    f"{self._timeout_s:.0f}s"
                )
            ] * len(reports)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, CheckpointError) else exc
            return [cause] * len(reports)


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


class NodeAggregator:
    """A rank's side of its node's aggregator: `report` as FinalizerClient.report does it."""

    def __init__(self, handle: ray.actor.ActorHandle, who: str) -> None:
        self.handle = handle
        self.who = who

    def report(self, report: RankReport, deadline: float) -> None:
        """Deliver `report` through the node's batch; raise the finalizer's refusal of it,
        CommitTimeoutError past `deadline`, AggregatorLost when the aggregator is gone."""
        ref = self.handle.report.remote(report)
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
) -> NodeAggregator:
    """Start (or find) the aggregator of `root_dir` on this node and join it as `role`
    `rank`; call it from the rank's own process, on its node."""
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
        .remote(finalizer, timeout_s)
    )
    try:
        ray.get(handle.join.remote(role, rank), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CommitTimeoutError(
            f"{who}: the node's report aggregator did not start within {timeout_s:.0f}s"
        ) from None
    return NodeAggregator(handle, who)
