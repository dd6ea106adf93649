"""The toy PPO recipe's Megatron worker groups as the driver sees them: the ranks of a role
(each a Ray actor of recipes/workers.py), and what their results add up to."""

from __future__ import annotations

from typing import Any

import ray
import torch

from recipes.ppo_config import PPOToyConfig
from recipes.workers import ActorWorker, CriticWorker

__all__ = ["RoleGroup", "data_parallel_parts", "describe_snapshot", "mean_loss"]


class RoleGroup:
    """The ranks of one role, each a Ray actor; calls fan out to every rank."""

    def __init__(self, name: str, cfg: PPOToyConfig) -> None:
        worker_cls = {"actor": ActorWorker, "critic": CriticWorker}[name]
        remote_cls = ray.remote(worker_cls).options(
            num_cpus=cfg.trainer.cpus_per_worker, max_restarts=0
        )
        self.name = name
        self.ranks = [remote_cls.remote(cfg, rank) for rank in range(cfg.role(name).world_size)]

    def call(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [getattr(rank, method).remote(*args) for rank in self.ranks]

    def describe(self, index: int) -> str:
        return f"{self.name} rank {index}"


def data_parallel_parts(results: list[dict[str, Any]], key: str) -> torch.Tensor:
    """Concatenate one result per data-parallel slice (from its TP rank 0), in slice order.

    The other TP ranks must have computed the same values: a difference means the ranks
    of a slice diverged, which would corrupt training silently, so it fails here.
    """
    by_slice: dict[int, torch.Tensor] = {}
    for result in results:
        first = by_slice.setdefault(result["dp_rank"], result[key])
        if not torch.equal(first, result[key]):
            raise RuntimeError(
                f"tensor-parallel ranks of data-parallel slice {result['dp_rank']} disagree "
                f"on {key!r}"
            )
    return torch.cat([by_slice[i] for i in sorted(by_slice)], dim=0)


def mean_loss(results: list[dict[str, Any]]) -> float:
    losses = {r["dp_rank"]: r["loss"] for r in results if r["tp_rank"] == 0}
    return sum(losses.values()) / len(losses)


def describe_snapshot(stats: list[dict[str, Any]], in_background: bool) -> str:
    """What the ranks' snapshot did with the state: copied (or the copy deferred), offloaded
    optimizer state referenced without a copy (only when there was some), or, for a live
    snapshot, the state written from the trainer's memory; then written or writing."""
    referenced = sum(s["bytes_zero_copy"] for s in stats)
    if any(s["snapshot"] == "live" for s in stats):
        # Which tensors are written live is decided on the save thread, after save()
        # returned: no figure of it is final here.
        parts = [
            "whole host tensors written from the live state (copied with a writer process), "
            "the rest copied, in the background (the next optimizer step waits for both)"
        ]
        referenced = 0
    elif any(s["snapshot"] == "deferred" for s in stats):
        parts = ["copy deferred to the background (the next optimizer step waits for it)"]
    else:
        parts = [f"{sum(s['bytes_staged'] for s in stats) / 1e6:.2f} MB copied"]
    if referenced:
        parts.append(
            f"{referenced / 1e6:.2f} MB of offloaded optimizer state referenced without a copy"
        )
    parts.append("writing in the background" if in_background else "written")
    return ", ".join(parts[:-1]) + "; " + parts[-1]
