"""Step 1's agreement (protocol page): every rank of a save group states what it saves
(step, root, whether its cached plan still fits), and all of them learn what the others
stated.

`SaveAgreement` runs it on a private gloo group of the save group's ranks (gloo_group.py),
from a thread of its own, in save order. A rank whose plan is cached states so and goes on
at once (its save thread checks the outcome before anything is written): its save() never
waits for its peers to arrive. A rank that must plan over the group (first save, changed
structure) waits for the outcome, on the training thread. Both ranks see the same
statements, so both reach the same verdict; a mix (one rank changed its structure, another
went ahead) fails on every rank, naming them, instead of leaving one rank in a collective
the others never join.

A rank whose save() fails before it stated anything still states, withdrawn, that it does
not save the step: its peers wait for that statement in a collective, and without it the
rank's next statement would pair with theirs for this step (failing a step nobody failed,
whose failure each rank's next save() raises in turn: no later step would commit). Its peers
then end the step at the agreement, before anything is written, as a step that will not
commit (StepNotCommittedError: not their own failure).

`agree_on_save` is the collective itself, on that gloo group: a monitored barrier (which
names a rank that never came, at the deadline: invariant I5), then one all-gather of five
integers. The trainer's own group may be gloo, NCCL or mixed: it is never used here.
A group of one rank has nobody to agree with: no group, no thread, no collective.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.rank.gloo_group import StoreUnreachable, open_private_group, reserve_group_key

__all__ = [
    "PREPARE",
    "SaveAgreement",
    "Statement",
    "agree_on_save",
    "check_went_ahead",
    "plan_reusable",
]

# The step number of prepare()'s statements: it saves no step.
PREPARE = -1

# Beyond the agreement's own deadline (the monitored barrier's), before a wait for its
# outcome gives up: the collective normally ends or fails well within it.
_RESULT_SLACK_S = 30.0


@dataclass(frozen=True)
class Statement:
    """What one rank says it saves."""

    step: int
    root_id: int
    plan_cached: bool
    # The rank does not wait for the outcome: its plan is cached, and its save thread checks
    # the outcome before anything is written.
    goes_ahead: bool = False
    # The rank does not save this step: its save() failed before it stated anything.
    withdrawn: bool = False


class SaveAgreement:
    """The save group's agreement, off the training thread where it can be (module doc)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        world_size: int,
        role: str,
        rank: int,
        root: str,
        timeout_s: float,
    ) -> None:
        self._world_size, self._role, self._rank = world_size, role, rank
        self._root, self._timeout_s = root, timeout_s
        self._thread = None
        # Statements this rank made so far: a save() that failed tells from it whether it
        # stated anything (SaveAgreement.start) before failing.
        self.statements_made = 0
        if world_size == 1:
            return  # nobody to agree with
        members = tuple(
            dist.get_process_group_ranks(group)
            if group is not None
            else range(dist.get_world_size())
        )
        # Reserved here, in the order managers open (every member's n-th manager over these
        # ranks gets the same key); the group itself is formed on the thread.
        try:
            key = reserve_group_key(members)
        except StoreUnreachable as exc:
            raise CheckpointError(
                f"{role} rank {rank}: cannot open the checkpoint manager of the save group "
                f"{list(members)}: {exc}"
            ) from None
        self._thread = DaemonPool(1, f"verl_ckpt_{role}{rank}_agree")
        # Formed on the thread, first in its queue: opening a manager never waits for the
        # peers (a rank that cannot open is named by its own error), and the first
        # agreement, queued behind it, fails naming the group if a peer never opened.
        self._forming = self._thread.submit(
            _private_group, members, key, timeout_s, f"{role} rank {rank}", label="group"
        )

    def start(self, mine: Statement) -> Future:
        """Issue this rank's statement; the future holds every rank's, in rank order."""
        self.statements_made += 1
        if self._thread is None:
            done: Future = Future()
            done.set_result([mine])
            return done
        return self._thread.submit(
            self._agree,
            mine,
            label=f"agreement on step {mine.step}",
        )

    def _agree(self, mine: Statement) -> list[Statement]:
        # Done by now (the same thread formed it first); raises if forming failed.
        group = self._forming.result()
        return agree_on_save(
            mine,
            group,
            self._world_size,
            self._timeout_s,
            self._role,
            self._rank,
            self._root,
        )

    def outcome(self, pending: Future) -> list[Statement]:
        """Every rank's statement; raises what the agreement raised (a missing rank by name,
        a disagreement on step or root)."""
        # Waited apart from result(): the agreement's own CommitTimeoutError is a TimeoutError
        # too, and must reach the caller as it is (it names the missing ranks).
        done, _ = wait_for_futures([pending], timeout=self._timeout_s + _RESULT_SLACK_S)
        if not done:
            raise CommitTimeoutError(
                f"{self._role} rank {self._rank}: the save group's agreement did not end "
                f"within {self._timeout_s + _RESULT_SLACK_S:g}s"
            )
        return pending.result()

    def close(self, timeout_s: float) -> list[str]:
        """Stop the thread; returns what did not stop."""
        if self._thread is None:
            return []
        return self._thread.close(timeout_s)


def _private_group(members: tuple[int, ...], key: str, timeout_s: float, who: str) -> Any:
    """This manager's own gloo group over `members` (gloo_group.py): no group is shared by
    two managers' threads, or left in a state a failed agreement put it in. Kept until the
    process exits; it costs an idle thread and a socket per peer."""
    try:
        # Only the save group's ranks create it (a rollout rank of the same world never
        # calls this); a group of its own, so that the agreement thread is the only one
        # to issue collectives on it, whatever the trainer does on its groups meanwhile.
        return open_private_group(members, key, timeout_s)
    except RuntimeError as exc:
        raise CommitTimeoutError(
            f"{who}: the ranks of the save group {list(members)} did not all open their "
            f"checkpoint managers within {timeout_s:g}s: {exc}"
        ) from None


def plan_reusable(statements: list[Statement], role: str) -> bool:
    """For a rank that waited for the outcome: whether the cached plan is reused (every
    rank's fits). Ranks that went ahead will not join a planning collective: if any did
    while another's structure changed, every rank fails here or on its save thread."""
    if all(s.plan_cached for s in statements):
        return True
    if any(s.goes_ahead for s in statements):
        raise _mixed_structures(statements, role)
    return False


def check_went_ahead(statements: list[Statement], role: str) -> None:
    """For a rank that went ahead on its cached plan: every rank's must fit too."""
    if not all(s.plan_cached for s in statements):
        raise _mixed_structures(statements, role)


def _mixed_structures(statements: list[Statement], role: str) -> CheckpointError:
    changed = [i for i, s in enumerate(statements) if not s.plan_cached]
    kept = [i for i, s in enumerate(statements) if s.plan_cached]
    return CheckpointError(
        f"role {role}: the saved structure changed on ranks {changed} but not on ranks {kept}; "
        "with checkpoint.assume_constant_structure=true (the default) every rank of a role "
        "keeps its structure, or all change it for the same save; set it to false for "
        "trainers whose ranks change it on their own"
    )


def agree_on_save(
    mine: Statement,
    group: Any,
    world_size: int,
    timeout_s: float,
    role: str,
    rank: int,
    root: str,
) -> list[Statement]:
    """Every rank's statement, in rank order, once all ranks of the gloo `group` (from
    gloo_group.open_private_group) made theirs.

    Raises CommitTimeoutError when a rank does not come within `timeout_s`,
    StepNotCommittedError when a rank withdrew (it does not save the step), and
    CheckpointError when the ranks disagree on the step or the root (all of them fail here
    together, before anything is written).
    """
    step, who = mine.step, f"{role} rank {rank}"
    _monitored_barrier(group, timeout_s, who, step)
    values = torch.tensor(
        [
            mine.step,
            mine.root_id,
            int(mine.plan_cached),
            int(mine.goes_ahead),
            int(mine.withdrawn),
        ],
        dtype=torch.int64,
    )
    gathered = [torch.empty_like(values) for _ in range(world_size)]
    group.allgather([gathered], [values]).wait()  # the barrier above bounded the wait
    statements = [
        Statement(int(t[0]), int(t[1]), bool(t[2]), bool(t[3]), bool(t[4])) for t in gathered
    ]
    withdrawn = [i for i, s in enumerate(statements) if s.withdrawn]
    if withdrawn:
        if step == PREPARE:
            raise CheckpointError(
                f"{who}: prepare() stopped: rank(s) {withdrawn} of the save group failed in "
                "theirs (their own error says why)"
            )
        raise StepNotCommittedError(
            f"{who}: step {step} will not commit: rank(s) {withdrawn} of the save group do not "
            "save it (their save() failed; their own error says why)"
        )
    if len({(s.step, s.root_id) for s in statements}) != 1:
        listing = ", ".join(
            f"rank {i}: step {s.step}"
            + ("" if s.root_id == mine.root_id else " under another checkpoint.root_dir")
            for i, s in enumerate(statements)
        )
        raise CheckpointError(
            f"ranks of role {role} disagree on what to save under {root}: {listing}"
        )
    return statements


def _monitored_barrier(group: Any, timeout_s: float, who: str, step: int) -> None:
    try:
        group.monitored_barrier(timedelta(seconds=timeout_s), True)  # wait_all_ranks
    except RuntimeError as exc:
        # gloo's message names the ranks that did not reach the barrier.
        raise CommitTimeoutError(
            f"{who}: not every rank of the save group called "
            f"{'prepare()' if step == PREPARE else f'save({step})'} within "
            f"{timeout_s:g}s: {exc}"
        ) from None
