"""The actor's weights from its tensor-parallel ranks to a rollout worker's TP=1 copy.

Each actor rank lists the tensors of its megatron-core sharded state dict that it is the
main replica of, with where they sit in the full tensor (`local_weight_shards`); the rollout
worker places every shard at its offset (`assemble_full_weights`) and copies the full
tensors into its own model's parameters (`load_full_weights`), whose sharded state dict at
TP=1 uses the same keys. Offsets come from megatron-core itself, so this holds for any
tensor-parallel size (and data-parallel replicas, which send nothing).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["assemble_full_weights", "load_full_weights", "local_weight_shards"]


def local_weight_shards(model: Any) -> list[dict[str, Any]]:
    """This rank's share of the model's tensors: key, a copy of its local tensor, the full
    shape and its offset there (the stacked-layer axes megatron-core prepends dropped)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    shards = []
    for key, sharded in model.sharded_state_dict().items():
        if not isinstance(sharded, ShardedTensor) or not is_main_replica(sharded.replica_id):
            continue  # _extra_state objects; replicas that another rank sends
        skip = sharded.prepend_axis_num
        shards.append(
            {
                "key": key,
                "data": sharded.data.detach().clone(),
                "shape": tuple(sharded.global_shape[skip:]),
                "offset": tuple(sharded.global_offset[skip:]),
            }
        )
    return shards


def assemble_full_weights(per_rank: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards; a key whose shards do not cover it fails."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for shards in per_rank:
        for shard in shards:
            key, data = shard["key"], shard["data"]
            target = full.setdefault(key, torch.empty(shard["shape"], dtype=data.dtype))
            window = tuple(
                slice(o, o + n) for o, n in zip(shard["offset"], data.shape, strict=True)
            )
            target[window] = data
            covered[key] = covered.get(key, 0) + data.numel()
    for key, tensor in full.items():
        if covered[key] != tensor.numel():
            raise RuntimeError(f"actor weights: the ranks' shards of {key!r} do not cover it")
    return full


@torch.no_grad()
def load_full_weights(model: Any, full: dict[str, torch.Tensor]) -> None:
    """Copy `full` into a TP=1 model's parameters (its sharded tensors are views of them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    targets = {
        key: sharded.data
        for key, sharded in model.sharded_state_dict().items()
        if isinstance(sharded, ShardedTensor)
    }
    if set(targets) != set(full):
        missing = sorted(set(targets) ^ set(full))[:3]
        raise RuntimeError(f"actor weights: the rollout model's keys differ ({missing})")
    for key, target in targets.items():
        target.copy_(full[key])
