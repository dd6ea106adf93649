"""The state every system saves: one rank's share of a tensor-parallel model plus Adam.

Built with megatron-core's mapping API (`ShardedTensor.from_rank_offsets`) and its optimizer
helpers, with the key layout of a GPT decoder: per layer the QKV and FC1 weights split on
dim 0, the projection and FC2 weights split on dim 1 (tensor parallelism over the ranks),
a QKV bias split on dim 0, and layer-norm weight and bias replicated on every rank (replica
id = rank, so only rank 0 writes them). Adam's exp_avg and exp_avg_sq have the parameters'
shapes, so the state is about three times the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

__all__ = ["RankState", "StateSpec", "spec_for_size"]

_FLOAT_BYTES = 4
# Global parameters per layer, in units of hidden^2: qkv 3, proj 1, fc1 4, fc2 4.
_MATRIX_UNITS = 12


@dataclass(frozen=True)
class StateSpec:
    """Shape of the benchmark model; sizes are those of the whole state over all ranks."""

    hidden: int
    layers: int
    world_size: int = 2

    @property
    def total_bytes(self) -> int:
        per_layer = _MATRIX_UNITS * self.hidden**2 + 3 * self.hidden  # + qkv bias
        per_layer += 2 * self.hidden * self.world_size  # replicated layer norm on each rank
        return 3 * per_layer * self.layers * _FLOAT_BYTES  # params + exp_avg + exp_avg_sq

    @property
    def rank_bytes(self) -> int:
        return self.total_bytes // self.world_size


def spec_for_size(total_bytes: int, world_size: int = 2) -> StateSpec:
    """The spec closest to `total_bytes` (whole layers; tensors of a few MiB to tens of MiB)."""
    hidden = 1024 if total_bytes >= (512 << 20) else 512
    per_layer = StateSpec(hidden, 1, world_size).total_bytes
    return StateSpec(hidden, max(1, round(total_bytes / per_layer)), world_size)


class RankState:
    """One rank's parameters and Adam state, and the views of it each system saves.

    `sharded_state_dict()` builds fresh megatron-core sharded dicts on every call (a save
    consumes them: verl_ckpt points them at its staging buffers).
    """

    def __init__(self, spec: StateSpec, rank: int, seed: int = 0, device: str = "cpu") -> None:
        """`device`: where the state lives ("cuda" for the CUDA benchmark); the values are
        drawn on the host either way, so that every device holds the same state."""
        self.spec, self.rank = spec, rank
        h, tp = spec.hidden, spec.world_size
        if h % tp:
            raise ValueError(f"hidden size {h} is not divisible by {tp} ranks")
        generator = torch.Generator().manual_seed(seed + rank)
        # (key, local shape, split axis or None for replicated)
        layout = []
        for i in range(spec.layers):
            prefix = f"decoder.layers.{i}"
            layout += [
                (f"{prefix}.self_attention.linear_qkv.weight", (3 * h // tp, h), 0),
                (f"{prefix}.self_attention.linear_qkv.bias", (3 * h // tp,), 0),
                (f"{prefix}.self_attention.linear_proj.weight", (h, h // tp), 1),
                (f"{prefix}.mlp.linear_fc1.weight", (4 * h // tp, h), 0),
                (f"{prefix}.mlp.linear_fc2.weight", (h, 4 * h // tp), 1),
                (f"{prefix}.input_layernorm.weight", (h,), None),
                (f"{prefix}.input_layernorm.bias", (h,), None),
            ]
        self.layout = layout
        self._originals: dict[tuple[int, str], torch.Tensor] = {}

        def drawn(shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
            return torch.empty(shape).uniform_(low, high, generator=generator).to(device)

        self.params = [torch.nn.Parameter(drawn(shape, -0.1, 0.1)) for _, shape, _ in layout]
        self.optimizer = torch.optim.Adam(self.params, lr=1e-4)
        for p in self.params:
            # What Adam holds after some steps; filled so that every page is resident.
            self.optimizer.state[p] = {
                "step": torch.tensor(10.0),
                "exp_avg": drawn(p.shape, -1e-3, 1e-3),
                "exp_avg_sq": drawn(p.shape, 0, 1e-6),
            }

    # ---- what a training step does to this memory -----------------------------------------

    @torch.no_grad()
    def update(self, offload: bool = False) -> None:
        """Write every parameter and both moments, as an optimizer step does (a cheap
        stand-in for Adam's arithmetic with the same memory traffic).

        offload=True: the moments are replaced by new tensors instead (an offloaded
        optimizer's state is swapped in and out, never written in place); `restore()` puts
        the original tensor objects back (unchanged) so that nothing else sees the swap.
        """
        for param in self.params:
            param.add_(1e-7)
            state = self.optimizer.state[param]
            for name in ("exp_avg", "exp_avg_sq"):
                if offload:
                    self._originals.setdefault((id(param), name), state[name])
                    state[name] = state[name].add(1e-7)
                else:
                    state[name].add_(1e-7)

    def restore(self) -> None:
        for param in self.params:
            state = self.optimizer.state[param]
            for name in ("exp_avg", "exp_avg_sq"):
                original = self._originals.pop((id(param), name), None)
                if original is not None:
                    state[name] = original

    # ---- megatron-core sharded view (verl_ckpt, megatron dist_checkpointing) ---------------

    def model_sharded_state_dict(self) -> dict:
        tp = self.spec.world_size
        sharded = {}
        for (key, _, axis), param in zip(self.layout, self.params, strict=True):
            if axis is None:
                sharded[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=self.rank)
            else:
                sharded[key] = ShardedTensor.from_rank_offsets(key, param, (axis, self.rank, tp))
        return sharded

    def optimizer_sharded_state_dict(self) -> dict:
        """megatron-core's layout of an Adam state (`optimizer.state.exp_avg.<param key>`)."""
        from recipes.megatron_cpu import optimizer_sharded_state_dict

        return optimizer_sharded_state_dict(_ShardedModel(self), self.optimizer)

    def sharded_state_dict(self) -> dict:
        return {
            "model": self.model_sharded_state_dict(),
            "optimizer": self.optimizer_sharded_state_dict(),
        }

    # ---- plain views (floors, torch.save, DCP) ---------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of this rank by a unique name, detached (no copies)."""
        out = {}
        for (key, _, _), param in zip(self.layout, self.params, strict=True):
            out[f"model.{key}"] = param.detach()
            state = self.optimizer.state[param]
            out[f"optimizer.exp_avg.{key}"] = state["exp_avg"]
            out[f"optimizer.exp_avg_sq.{key}"] = state["exp_avg_sq"]
        return out

    def dtensor_state_dict(self, mesh) -> dict:
        """The same state as DTensors on a 1-D CPU mesh (what DCP users such as torchtitan
        save): split tensors are Shard(axis), replicated ones Replicate()."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        out = {}
        for (key, _, axis), param in zip(self.layout, self.params, strict=True):
            placements = [Replicate()] if axis is None else [Shard(axis)]
            state = self.optimizer.state[param]
            for name, tensor in (
                (f"model.{key}", param.detach()),
                (f"optimizer.exp_avg.{key}", state["exp_avg"]),
                (f"optimizer.exp_avg_sq.{key}", state["exp_avg_sq"]),
            ):
                out[name] = DTensor.from_local(tensor, mesh, placements, run_check=False)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class _ShardedModel:
    """What megatron's optimizer helpers need of a model: its sharded state dict."""

    def __init__(self, state: RankState) -> None:
        self._state = state

    def sharded_state_dict(self) -> dict:
        return self._state.model_sharded_state_dict()


def describe(spec: StateSpec) -> str:
    return (
        f"{spec.layers} layers x hidden {spec.hidden}, TP={spec.world_size}: "
        f"{spec.total_bytes / 2**30:.2f} GiB in all ({spec.rank_bytes / 2**20:.0f} MiB per rank; "
        "params + Adam exp_avg + exp_avg_sq, fp32)"
    )


def _check() -> None:  # pragma: no cover - a quick self-check: python -m benchmarks.state
    spec = spec_for_size(1 << 30)
    print(describe(spec), math.isclose(spec.total_bytes, 1 << 30, rel_tol=0.1))


if __name__ == "__main__":  # pragma: no cover
    _check()
