"""The batching of one node's (or one rank group's) calls, step by step, without Ray: the
aggregator actor (commit/aggregator.py) runs one for its members' reports and one for their
begin_step calls, and the benchmark wraps one too.

A batch holds one step's items of one role: the roles that share a node (an actor and a
critic colocated) save their steps at their own times, and one role's batch does not wait
for the other's. When a batch leaves:
- at once when every member of its role that joined has sent its item of the step (the
  usual case: the node's last call does not wait);
- at once with an urgent item (a report of a failure: the step fails now, not when its
  node's batch fills; the items batched so far go with it);
- otherwise `linger_s` after the batch's first item (a member that never sends one, or one
  that joined another node's aggregator after a restart).
Each caller waits until its batch was forwarded and gets its own item's answer.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.protocol.messages import Participant

__all__ = ["Batchable", "Forward", "NodeBatcher"]

# How long a batch waits for the node's missing members before it leaves without them.
LINGER_S = 0.05
# Steps per role whose forwarded members a batcher remembers (to know when a node's step is
# complete).
_REMEMBERED_STEPS = 8


class Batchable(Protocol):
    """What a batcher batches: a RankReport or a BeginRequest (protocol/messages.py)."""

    @property
    def step(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def participant(self) -> Participant: ...

    @property
    def urgent(self) -> bool: ...


# Forwards a batch; each item's answer, in order (an error is an answer, not raised).
Forward = Callable[[list[Any]], Awaitable[list[Any]]]


@dataclass
class _Batch:
    items: list[Batchable] = field(default_factory=list)
    waiting: list[asyncio.Future] = field(default_factory=list)
    participants: set[Participant] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class NodeBatcher:
    """One node's (or group's) items, batched per step (module docstring). Used from one
    event loop only."""

    def __init__(self, forward: Forward, linger_s: float = LINGER_S) -> None:
        self._forward = forward
        self._linger_s = linger_s
        # Per role, its members on this node.
        self._members: dict[str, set[Participant]] = {}
        # Per step and role, the batch being filled.
        self._batches: dict[tuple[int, str], _Batch] = {}
        # Per recent step and role, the participants whose items were forwarded already.
        self._sent: OrderedDict[tuple[int, str], set[Participant]] = OrderedDict()
        self._sending: set[asyncio.Task] = set()
        # Batches forwarded so far (status and tests: one per node or group when every
        # member sends at once).
        self.batches_sent = 0

    def join(self, participant: Participant) -> None:
        """`participant` runs on this node: its role's batch of a step waits for its item."""
        self._members.setdefault(participant[0], set()).add(participant)

    async def submit(self, item: Batchable) -> Any:
        """Batch `item`; the answer for it once its batch was forwarded (an error is
        returned, not raised: the caller raises it in the rank)."""
        # A participant that sends is on this node (also after this batcher lost its joins).
        self.join(item.participant)
        key = (item.step, item.role)
        batch = self._batches.setdefault(key, _Batch())
        answer = asyncio.get_running_loop().create_future()
        batch.items.append(item)
        batch.waiting.append(answer)
        batch.participants.add(item.participant)
        if item.urgent or self._complete(key, batch):
            self._flush(key)
        elif batch.timer is None:
            batch.timer = asyncio.get_running_loop().call_later(self._linger_s, self._flush, key)
        return await answer

    def pending(self) -> int:
        """Items held, not yet forwarded (for tests)."""
        return sum(len(b.items) for b in self._batches.values())

    def _complete(self, key: tuple[int, str], batch: _Batch) -> bool:
        sent = self._sent.get(key, set())
        return len(self._members[key[1]] - sent - batch.participants) == 0

    def _flush(self, key: tuple[int, str]) -> None:
        batch = self._batches.pop(key, None)
        if batch is None:
            return  # the timer of a batch that left already
        if batch.timer is not None:
            batch.timer.cancel()
        self._sent.setdefault(key, set()).update(batch.participants)
        self._sent.move_to_end(key)
        # Every role's recent steps (a few roles share a node).
        while len(self._sent) > _REMEMBERED_STEPS * max(1, len(self._members)):
            self._sent.popitem(last=False)
        self.batches_sent += 1
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: _Batch) -> None:
        try:
            answers = list(await self._forward(batch.items))
            if len(answers) != len(batch.items):
                raise CheckpointError(
                    f"the finalizer answered {len(answers)} of a batch of {len(batch.items)}"
                )
        except Exception as exc:  # noqa: BLE001 - every member of the batch hears it
            answers = [exc] * len(batch.items)
        # Every waiting member is answered, whatever happened: none waits to its deadline.
        for waiting, answer in zip(batch.waiting, answers, strict=True):
            if not waiting.done():
                waiting.set_result(answer)
