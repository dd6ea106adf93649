"""Step 1's agreement (protocol.py): every rank of a save group states what it saves (step,
root, whether its cached plan still fits), and all of them learn what the others stated.

One all-gather of three integers, on whatever backend the trainer's group has: gloo (CPU
tensors, after a monitored barrier that names a rank that never came), NCCL (the tensors on
the rank's current CUDA device: NCCL has no CPU path) or a mixed "cpu:gloo,cuda:nccl" group
(CPU tensors go to its gloo half). Without a monitored barrier the all-gather is issued
asynchronously and polled against the deadline, so that it never waits longer than the save
may (invariant I5). A group of one rank has nobody to agree with: no collective at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_ckpt.errors import CheckpointError, CommitTimeoutError

__all__ = ["Statement", "agree_on_save", "collective_device"]

# Between two polls of an asynchronous all-gather: short against a save's few milliseconds.
_POLL_S = 0.0002


@dataclass(frozen=True)
class Statement:
    """What one rank says it saves."""

    step: int
    root_id: int
    plan_cached: bool


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small collective on `group` puts its tensors: host memory where the group has a
    CPU backend, else the current CUDA device (an NCCL-only group, as Megatron trainers on
    GPUs usually have)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree_on_save(
    mine: Statement,
    group: dist.ProcessGroup | None,
    world_size: int,
    timeout_s: float,
    role: str,
    rank: int,
    root: str,
) -> list[Statement]:
    """Every rank's statement, in rank order, once all ranks of `group` made theirs.

    Raises CommitTimeoutError when a rank does not come within `timeout_s`, and
    CheckpointError when the ranks disagree on the step or the root (all of them fail here
    together, before anything is written).
    """
    if world_size == 1:
        return [mine]
    backend = str(dist.get_backend(group))
    step, who = mine.step, f"{role} rank {rank}"
    if backend == "gloo":
        _monitored_barrier(group, timeout_s, who, step)
    values = torch.tensor(
        [mine.step, mine.root_id, int(mine.plan_cached)],
        dtype=torch.int64,
        device=collective_device(group),
    )
    gathered = [torch.empty_like(values) for _ in range(world_size)]
    if backend == "gloo":
        dist.all_gather(gathered, values, group=group)  # the barrier above bounded the wait
    else:
        work = dist.all_gather(gathered, values, group=group, async_op=True)
        _wait_with_deadline(
            work,
            timeout_s,
            f"{who}: not every rank of the save group called "
            f"save({step}) within {timeout_s:g}s (a {backend} group cannot name the ranks that "
            "did not come: look for the rank whose trainer stopped before save)",
        )
    statements = [Statement(int(t[0]), int(t[1]), bool(t[2])) for t in torch.stack(gathered).cpu()]
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


def _monitored_barrier(
    group: dist.ProcessGroup | None, timeout_s: float, who: str, step: int
) -> None:
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        # gloo's message names the ranks that did not reach the barrier.
        raise CommitTimeoutError(
            f"{who}: not every rank of the save group called save({step}) within "
            f"{timeout_s:g}s: {exc}"
        ) from None


def _wait_with_deadline(work: dist.Work, timeout_s: float, message: str) -> None:
    # Polled rather than work.wait(): NCCL's wait() only orders the CUDA stream and returns,
    # and a blocking wait would have no deadline of ours.
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CommitTimeoutError(message)
        time.sleep(_POLL_S)
    work.wait()  # raises the collective's own error, if it failed
