"""The recipe's finite prompt set and its data cursor.

`data.num_prompts` prompts of `rollout.prompt_length` tokens are drawn once from
`trainer.seed`. Each epoch visits every prompt once, in a permutation drawn from a
torch.Generator seeded by (seed, epoch) alone, so any epoch's order is known without
replaying the ones before it. A batch that reaches the end of an epoch continues into the
next one: the stream of prompt ids is the concatenation of the epochs' permutations, and
training runs as many epochs as `trainer.total_steps` needs.

The cursor (epoch, position) names the next prompt of that stream. The driver keeps two:
the trained frontier (what the updates consumed; saved with each committed step) and,
in async mode, the drawn one, a batch ahead (what the rollout workers were handed). A
resume starts from the trained frontier and re-derives the drawn one from the rollout
buffer the step holds, so no prompt is skipped or repeated (NeMo-RL #3599 saved the drawn
one). A cursor at an epoch's end is the next epoch's start: a resume there continues.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataCursor", "PromptSet", "permutation_seed"]


def permutation_seed(seed: int, epoch: int) -> int:
    """The seed of epoch `epoch`'s permutation: a function of (seed, epoch) only."""
    return (seed & 0xFFFFFFFF) << 24 | (epoch & 0xFFFFFF)


@dataclass(frozen=True)
class DataCursor:
    """The next prompt of the stream: position `position` of epoch `epoch`'s permutation."""

    epoch: int = 0
    position: int = 0

    def to_state(self) -> dict[str, int]:
        """Plain ints (loadable with torch.load(weights_only=True))."""
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, state: dict[str, int]) -> DataCursor:
        return cls(int(state["epoch"]), int(state["position"]))


class PromptSet:
    """`num_prompts` prompts [N, prompt_length] drawn from `prompt_seed`; epoch orders from
    `seed` (see permutation_seed)."""

    def __init__(
        self, num_prompts: int, prompt_length: int, vocab_size: int, prompt_seed: int, seed: int
    ) -> None:
        generator = torch.Generator().manual_seed(prompt_seed)
        self.prompts = torch.randint(
            0, vocab_size, (num_prompts, prompt_length), generator=generator
        )
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.prompts.shape[0]

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s permutation of the prompt ids (cached: a few epochs at a time)."""
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            generator = torch.Generator().manual_seed(permutation_seed(self.seed, epoch))
            self._orders[epoch] = torch.randperm(len(self), generator=generator)
        return self._orders[epoch]

    def next_batch(self, cursor: DataCursor, size: int) -> tuple[torch.Tensor, DataCursor]:
        """The `size` prompt ids after `cursor` (crossing into the next epoch when one ends)
        and the cursor after them; a cursor left at an epoch's end moves to the next
        epoch's start."""
        ids = []
        epoch, position = cursor.epoch, cursor.position
        while len(ids) < size:
            if position >= len(self):
                epoch, position = epoch + 1, 0
            take = min(size - len(ids), len(self) - position)
            ids.extend(self.order(epoch)[position : position + take].tolist())
            position += take
        if position >= len(self):
            epoch, position = epoch + 1, 0
        return torch.tensor(ids, dtype=torch.long), DataCursor(epoch, position)

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.prompts[ids]
