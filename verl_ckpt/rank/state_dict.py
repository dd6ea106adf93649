"""What one rank saves: the contents of checkpoint.save_contents composed into one sharded
state dict, its per-rank extra state, and rank 0's model description (hf/model_spec.py).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject

from verl_ckpt.hf.model_spec import encode_model_spec, exports_role
from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.startup.resume_fit import EXTRA_STATE_KEY

__all__ = ["compose_state", "extra_sharded", "model_spec_bytes", "torch_rng_state"]


def compose_state(
    config: CheckpointConfig,
    world_size: int,
    rank: int,
    model: dict | None,
    optimizer: dict | None,
    extra: Any,
) -> dict[str, Any]:
    """The sharded state dict of one save: each content of checkpoint.save_contents that
    ranks save, from what save() got (a missing one is an error naming it)."""
    given = {"model": model, "optimizer": optimizer}
    sharded: dict[str, Any] = {}
    for content in config.rank_contents:
        if content == "extra":
            sharded["extra"] = extra_sharded(extra, world_size, rank)
        elif given[content] is None:
            raise CheckpointError(
                f"checkpoint.save_contents includes {content!r} but save() got no {content} "
                "sharded state dict"
            )
        else:
            sharded[content] = given[content]
    return sharded


def extra_sharded(extra: Any, world_size: int, rank: int) -> ShardedObject:
    """A rank's extra state as one object per rank: its global "shape" is the role's world
    size."""
    return ShardedObject(EXTRA_STATE_KEY, extra, (world_size,), (rank,), replica_id=0)


def model_spec_bytes(
    config: CheckpointConfig, role: str, rank: int, model_spec: dict | None
) -> bytes | None:
    """Rank 0's model description, serialised now (a mistake fails save() at once)."""
    if model_spec is None:
        if exports_role(config, role):
            raise CheckpointError(
                f"checkpoint.save_contents includes 'hf_model' and role {role!r} is "
                "in checkpoint.hf_export.architectures, but save() got no model_spec "
                "(pass verl_ckpt.describe_gpt_model(model))"
            )
        return None
    spec = encode_model_spec(model_spec)
    return spec if rank == 0 else None


def torch_rng_state() -> dict[str, Any]:
    """The RNG states a rank usually saves as extra state."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state
