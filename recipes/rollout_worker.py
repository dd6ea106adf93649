"""A rollout worker of `rollout.mode=async`: a Ray actor apart from the trainer's ranks that
holds a TP=1 copy of the actor's weights and generates batches ahead of the trainer.

Calls from the driver (recipes/rollout.py), served in order (a Ray actor runs one call at a
time, in the order it received them; the cut below relies on it):
  `setup()`; resume: `load(step_dir)`; after a respawn: `restore(result)`;
  `sync_weights(version, shard_refs)` (the actor's weights after update `version`);
  `generate(step, prompt_ids, prompts)`; save steps: `save(step)`; `close()`.

The worker's part of a committed step (a participant "rollout" of index i, saved through
verl_ckpt.StateParticipant off the trainer's path): the completed samples in its buffer
that training has not consumed (each with its prompt ids and the policy version that
generated it) and its sampler's RNG state. The driver queues `save(s)` after `generate(s+1)`,
so the samples of step s+1 are complete when the save runs: the cut holds them instead of a
request in flight, and a resume regenerates nothing. Everything is tensors and plain values
(torch.load(weights_only=True) reads it).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from recipes.ppo_config import PPOToyConfig, derive_seed
from recipes.weights import assemble_full_weights, load_full_weights
from recipes.workers import build_role_model

__all__ = ["ROLLOUT_PARTICIPANT", "ROLLOUT_STATE_FORMAT", "RolloutWorker"]

ROLLOUT_PARTICIPANT = "rollout"
ROLLOUT_STATE_FORMAT = 1


class RolloutWorker:
    """One rollout worker (`index` of rollout.num_workers); `handle`: its participant handle
    (CheckpointCoordinator.participant_handle)."""

    def __init__(self, cfg: PPOToyConfig, index: int, handle: Any) -> None:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        from recipes import megatron_cpu

        self.mc = megatron_cpu
        self.cfg = cfg
        self.index = index
        self.handle = handle
        self.model = None
        self.saver = None
        self.version: int | None = None  # updates the loaded weights have seen
        # step -> completed samples of that step not known to be trained yet
        self.buffer: dict[int, dict[str, Any]] = {}
        self.sampler = torch.Generator().manual_seed(
            derive_seed(cfg.trainer.seed, "rollout", index)
        )

    def setup(self) -> int:
        """Its own world of one (TP=1) and the model; its pid."""
        import verl_ckpt

        timeout_s = self.cfg.trainer.startup_timeout_s
        self._store = self.mc.host_rendezvous(1, timeout_s)
        self.mc.init_distributed(
            0, 1, timeout_s=timeout_s, seed=self.cfg.trainer.seed, store=self._store
        )
        # Initial values do not matter: sync_weights replaces every parameter.
        self.model = build_role_model(self.mc, self.cfg, "actor")
        self.saver = verl_ckpt.StateParticipant(self.handle)
        return os.getpid()

    # ---- weights and generation ----------------------------------------------------------

    def sync_weights(self, version: int, shard_refs: list[Any]) -> int:
        """Load the actor's weights after update `version` (every actor rank's shards).
        Steps up to `version` are trained: their samples leave the buffer.

        The shards come as a list of references to the actor ranks' results, fetched here:
        the driver hands them over without waiting for them.
        """
        import ray

        load_full_weights(self.model, assemble_full_weights(ray.get(shard_refs)))
        self.version = version
        self.buffer = {s: e for s, e in self.buffer.items() if s > version}
        return version

    @torch.no_grad()
    def generate(
        self, step: int, prompt_ids: torch.Tensor, prompts: torch.Tensor
    ) -> dict[str, Any]:
        """Sample `rollout.response_length` tokens after each prompt, with their log-probs;
        the samples stay in the buffer until trained. Returns them with the sampler's state
        after them (what a respawned worker continues from)."""
        if self.version is None:
            raise RuntimeError(f"rollout worker {self.index}: generate before sync_weights")
        self.model.eval()
        sequences = prompts
        for _ in range(self.cfg.rollout.response_length):
            inputs = self.mc.causal_inputs(self.model, sequences)
            logits = self.model(*inputs)[:, -1, :]
            probs = torch.softmax(logits.float(), dim=-1)
            next_token = torch.multinomial(probs, 1, generator=self.sampler)
            sequences = torch.cat([sequences, next_token], dim=1)
        entry = {
            "step": step,
            "prompt_ids": prompt_ids.clone(),
            "tokens": sequences,
            "log_probs": self._log_probs(sequences),
            "policy_version": self.version,
        }
        self.buffer[step] = entry
        return {**entry, "sampler": self.sampler.get_state()}

    def _log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        inputs = self.mc.causal_inputs(self.model, sequences[:, :-1])
        per_token_nll = self.model(*inputs, labels=sequences[:, 1:])
        return -per_token_nll[:, self.cfg.rollout.prompt_length - 1 :].float()

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, step: int) -> float:
        """Hand this worker's part of step `step` to its participant saver (staged now,
        written in the background); the seconds this call took."""
        begin = time.perf_counter()
        self.saver.save(step, self._state(step))
        return time.perf_counter() - begin

    def skip(self, step: int, why: str) -> None:
        """This worker will not save `step` (its predecessor died saving it): the step fails
        now, naming it and `why`, instead of at its deadline."""
        self.saver.skip(step, why)

    def _state(self, step: int) -> dict[str, Any]:
        return {
            "format": ROLLOUT_STATE_FORMAT,
            "index": self.index,
            "sampler": self.sampler.get_state(),
            "buffer": [self.buffer[s] for s in sorted(self.buffer) if s > step],
        }

    def load(self, step_dir: str) -> dict[str, Any] | None:
        """Restore this worker's part of a committed step; its newest buffered samples with
        the sampler state (as generate returns them), or None if it held none."""
        state = self.saver.load(step_dir)
        if state.get("format") != ROLLOUT_STATE_FORMAT or state.get("index") != self.index:
            raise RuntimeError(
                f"{step_dir}: rollout[{self.index}] state of unknown format or index "
                f"(format {state.get('format')!r}, index {state.get('index')!r})"
            )
        self.sampler.set_state(state["sampler"])
        self.buffer = {int(e["step"]): e for e in state["buffer"]}
        if not self.buffer:
            return None
        return {**self.buffer[max(self.buffer)], "sampler": state["sampler"]}

    def buffered(self, step: int) -> dict[str, Any]:
        """The samples of `step` held in the buffer (a resumed run's first batch)."""
        if step not in self.buffer:
            raise RuntimeError(f"rollout worker {self.index}: no samples of step {step} buffered")
        return {**self.buffer[step], "sampler": self.sampler.get_state()}

    def restore(self, results: list[dict[str, Any]]) -> None:
        """A respawned worker continues where its predecessor's last completed generations
        (`results`, in order, as generate returned them) left it: those samples buffered,
        the sampler after the last."""
        self.sampler.set_state(results[-1]["sampler"])
        self.buffer = {
            int(r["step"]): {k: v for k, v in r.items() if k != "sampler"} for r in results
        }

    def close(self) -> None:
        """Finish the background saves (raise the first failure)."""
        if self.saver is not None:
            self.saver.close()
