"""The recipe's replay buffer (`rollout.replay_size` > 0): trained sequences kept for
off-policy reuse, in a Ray actor that is a participant "replay" of every step.

Per step, in this order (the actor serves its calls in order): `sample(n)` (a seeded draw
of n earlier sequences, None until it holds n), then `add(...)` (this step's sequences,
oldest dropped past the capacity); on a save step `save(step)`: its part of the step is
what it holds after this step's add, and its sampler's RNG state, saved through
verl_ckpt.StateParticipant off the trainer's path (tensors and ints only: it loads with
torch.load(weights_only=True)).
"""

from __future__ import annotations

from typing import Any

import torch

from recipes.ppo_config import PPOToyConfig, derive_seed

__all__ = ["REPLAY_PARTICIPANT", "REPLAY_STATE_FORMAT", "ReplayBuffer"]

REPLAY_PARTICIPANT = "replay"
REPLAY_STATE_FORMAT = 1
_FIELDS = ("prompt_ids", "tokens", "log_probs", "advantages")


class ReplayBuffer:
    """Up to `rollout.replay_size` sequences; `handle`: its participant handle."""

    def __init__(self, cfg: PPOToyConfig, handle: Any) -> None:
        import verl_ckpt

        self.capacity = cfg.rollout.replay_size
        self.sampler = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, "replay"))
        self.held: dict[str, torch.Tensor] | None = None
        self.saver = verl_ckpt.StateParticipant(handle)

    def __len__(self) -> int:
        return 0 if self.held is None else self.held["tokens"].shape[0]

    def sample(self, count: int) -> dict[str, torch.Tensor] | None:
        """`count` held sequences drawn without replacement (None while fewer are held)."""
        if len(self) < count:
            return None
        picked = torch.randperm(len(self), generator=self.sampler)[:count]
        return {name: self.held[name][picked] for name in _FIELDS}

    def add(self, sequences: dict[str, torch.Tensor]) -> int:
        """Keep this step's sequences (the oldest go past the capacity); how many are held."""
        if self.held is None:
            self.held = {name: sequences[name].clone() for name in _FIELDS}
        else:
            self.held = {
                name: torch.cat([self.held[name], sequences[name]])[-self.capacity :]
                for name in _FIELDS
            }
        return len(self)

    def save(self, step: int) -> None:
        self.saver.save(
            step,
            {
                "format": REPLAY_STATE_FORMAT,
                "sampler": self.sampler.get_state(),
                "held": self.held,
            },
        )

    def load(self, step_dir: str) -> int:
        """Restore what the committed step holds; how many sequences."""
        state = self.saver.load(step_dir)
        if state.get("format") != REPLAY_STATE_FORMAT:
            raise RuntimeError(f"{step_dir}: replay state of unknown format")
        self.sampler.set_state(state["sampler"])
        self.held = state["held"]
        return len(self)

    def close(self) -> None:
        self.saver.close()
