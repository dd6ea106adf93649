"""Megatron ranks of the toy PPO recipe, one per Ray actor, as verl's worker groups hold them.

Each role (actor, critic) is its own gloo world of `world_size` ranks = tensor-parallel x
data-parallel. A rank holds a tiny megatron-core GPTModel, a torch Adam whose state is a
megatron-core sharded state dict, and a `verl_ckpt.CheckpointManager` for its role.

Call order from the driver (every rank of a role gets every call, concurrently):
  1. every rank: `started()` (its pid, once constructed); rank 0: `open_rendezvous()` (binds
     the role's rendezvous port and keeps it); then every rank: `setup(port)` (joins the
     role's world there);
  2. resume only: `load(step_dir)`;
  3. per step: actor `generate(prompts)` (sync mode), critic `compute_values(tokens)`, then
     actor `update(...)` and critic `update(...)`; async mode: actor `weight_shards()` after
     each update (recipes/rollout.py hands them to the rollout workers);
  4. save steps: `save(step)`; any step: `finished_writes()` (figures of background writes);
  5. `close()`: finishes this rank's writes and returns their figures.

Determinism: all randomness comes from generators seeded from `trainer.seed` and saved in
each rank's extra state; the tensor-parallel ranks of a data-parallel slice seed theirs the
same, so they sample the same tokens.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import ray
import torch

from recipes.ppo_config import PPOToyConfig, derive_seed
from recipes.ppo_math import policy_loss, value_loss
from recipes.weights import local_weight_shards

if TYPE_CHECKING:
    from verl_ckpt import CheckpointManager

__all__ = [
    "ActorWorker",
    "CriticWorker",
    "WorkerStartupError",
    "WorkerStartupTimeout",
    "build_role_model",
    "process_died",
]

EXTRA_FORMAT = 1


class WorkerStartupError(RuntimeError):
    """A rank could not start (its process died, its set-up raised, or it was not ready in
    time). The message is one line that names the rank(s)."""

    @classmethod
    def from_ray_error(cls, who: str, exc: Exception) -> WorkerStartupError:
        """One line from a Ray error (Ray's messages span many lines): who died or failed, why."""
        text = str(exc)
        if process_died(exc):
            pid = re.search(r"^\s*pid: (\d+)\s*$", text, re.MULTILINE)
            detail = re.search(r"Worker exit detail: (.+?\.)(?:\s|$)", text)
            process = f"its process (pid {pid[1]})" if pid else "its process"
            reason = detail[1] if detail else _first_line(text)
            return cls(f"{who} died during start-up: {process} exited: {reason}")
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            return cls(
                f"{who} failed during start-up: {type(cause).__name__}: {_first_line(str(cause))}"
            )
        # The constructor raised (Ray's message ends with the exception's last line), or Ray
        # itself failed.
        lines = text.strip().splitlines()
        return cls(f"{who} failed during start-up: {lines[-1] if lines else type(exc).__name__}")


class WorkerStartupTimeout(WorkerStartupError, TimeoutError):
    """Ranks not ready within `trainer.startup_timeout_s` (slow, or not placed by Ray)."""


def process_died(exc: Exception) -> bool:
    """Whether a Ray error says the rank's process is gone (not: its constructor raised, which
    Ray reports with the same exception class)."""
    return isinstance(exc, ray.exceptions.RayActorError) and not exc.actor_init_failed


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def build_role_model(mc: Any, cfg: PPOToyConfig, role: str) -> Any:
    """The tiny GPT of `role` (`mc`: recipes.megatron_cpu) in this process's Megatron state,
    its initial values seeded by the role: a rollout worker's copy of the actor is built by
    the same call."""
    m = cfg.model
    shape = mc.TinyGPTConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        seq_length=cfg.sequence_length,
    )
    return mc.build_tiny_gpt(shape, seed=derive_seed(cfg.trainer.seed, f"{role}_model"))


def _import_megatron() -> Any:
    """megatron-core and what builds on it, imported in the rank processes only: the driver
    imports this module just to name the actor classes."""
    # megatron-core warns about optional CUDA extensions and deprecations at import and build.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from recipes import megatron_cpu

    return megatron_cpu


class _RankWorker:
    """What actor and critic ranks share: process group, model, optimizer, checkpoints."""

    role = ""
    # What the model's output layer gives (the model description saved with each step):
    # next-token logits, or a critic's values (refused by the Hugging Face export).
    head = "lm"

    def __init__(self, cfg: PPOToyConfig, rank: int) -> None:
        self.mc = _import_megatron()
        self.cfg = cfg
        self.role_cfg = cfg.role(self.role)
        self.rank = rank
        self.world_size = self.role_cfg.world_size
        self.prompt_length = cfg.rollout.prompt_length
        self.model = None
        self.optimizer = None
        self.manager: CheckpointManager | None = None
        # Rank 0 only, from open_rendezvous() on: the role's rendezvous store (it must stay
        # alive while the process group exists: the group's store is this one).
        self._rendezvous: torch.distributed.TCPStore | None = None
        self._watched: list[Any] = []  # SaveStats whose background write may still run
        self._offloaded = False

    # ---- set-up --------------------------------------------------------------------------

    def started(self) -> int:
        """This rank's process id, once the rank is constructed (megatron-core imported)."""
        return os.getpid()

    def open_rendezvous(self) -> int:
        """Rank 0: host the role's rendezvous on a loopback port of this node; the port.

        The port stays bound from here until the process exits, so the other ranks can join
        it whenever their `setup` runs; no other process can take it in between.
        """
        if self.rank != 0:
            raise RuntimeError(f"{self.role} rank {self.rank}: only rank 0 hosts the rendezvous")
        if self._rendezvous is None:
            self._rendezvous = self.mc.host_rendezvous(
                self.world_size, self.cfg.trainer.startup_timeout_s
            )
        return self._rendezvous.port

    def setup(self, port: int) -> dict[str, int]:
        """Join the role's world at rank 0's rendezvous `port`, then build model, optimizer
        and checkpoint manager."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        from verl_ckpt import CheckpointManager, describe_gpt_model

        timeout_s = self.cfg.trainer.startup_timeout_s
        if self.rank == 0:
            if self._rendezvous is None or self._rendezvous.port != port:
                raise RuntimeError(
                    f"{self.role} rank 0: setup({port}) without open_rendezvous() returning "
                    f"that port first"
                )
            store = self._rendezvous
        else:
            store = self.mc.join_rendezvous(port, self.world_size, timeout_s)
        self.mc.init_distributed(
            self.rank,
            self.world_size,
            tensor_parallel_size=self.role_cfg.tensor_parallel_size,
            timeout_s=timeout_s,
            seed=self.cfg.trainer.seed,
            store=store,
        )
        self.model = build_role_model(self.mc, self.cfg, self.role)
        self.optimizer = self.mc.make_adam(self.model, lr=self.role_cfg.lr)
        self.model_spec = describe_gpt_model(self.model, head=self.head)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.reduce_from_tp = reduce_from_tensor_model_parallel_region
        self.manager = CheckpointManager(self.cfg.checkpoint, self.role, self.rank, self.world_size)
        # What the first save would pay for (planning over the role's group, the staging
        # buffers, a writer process), paid now: every rank of the role is in setup together.
        # The extra state's content does not shape the plan (the actor's sampler comes later).
        self.manager.prepare(**self._sharded_state())
        # checkpoint.snapshot=deferred (or live): a save's copy (or write) runs while the next
        # step's rollout only reads the state; the next optimizer step (the first change)
        # waits for it.
        self.manager.fence_before(self.optimizer)
        return {"pid": os.getpid(), "tp_rank": self.tp_rank, "dp_rank": self.dp_rank}

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, step: int) -> dict[str, Any]:
        """Snapshot model, optimizer and RNG for `step`; the write continues in the background."""
        stats = self.manager.save(
            step,
            **self._sharded_state(),
            extra=self._extra_state(),
            # What a Hugging Face export of this step needs to know (checkpoint.save_contents
            # with hf_model, or `verl-ckpt export` later).
            model_spec=self.model_spec,
        )
        self._watched.append(stats)
        return {
            "blocking_s": stats.blocking_s,
            "plan_s": stats.plan_s,
            "stage_s": stats.stage_s,
            "bytes_staged": stats.bytes_staged,
            "bytes_zero_copy": stats.bytes_zero_copy,
            "snapshot": stats.snapshot,
        }

    def _sharded_state(self) -> dict[str, dict]:
        """The model's and the optimizer's sharded state dicts for a save (or prepare()): the
        model's built once and handed to the optimizer's, which reads it."""
        model = self.model.sharded_state_dict()
        optimizer = self.mc.optimizer_sharded_state_dict(self.model, self.optimizer, model)
        return {"model": model, "optimizer": optimizer}

    def finished_writes(self) -> list[dict[str, Any]]:
        """Figures of this rank's saves whose background write ended since the last call.

        Read off the SaveStats that save() returned (the writer fills them in when it is
        done), so nothing here waits for a write. A failed write is raised by the next
        save() or by close(), not here.
        """
        done = [s for s in self._watched if s.files_written is not None]
        self._watched = [s for s in self._watched if s.files_written is None]
        return [{"step": s.step, "write_s": s.write_s, "bytes": s.bytes_written} for s in done]

    def load(self, step_dir: str) -> None:
        """Restore what `checkpoint.load_contents` names (model, optimizer, RNG) from a
        committed step."""
        contents = self.cfg.checkpoint.load_contents
        loaded = self.manager.load(
            step_dir,
            model=self.model.sharded_state_dict() if "model" in contents else None,
            optimizer=(
                self.mc.optimizer_sharded_state_dict(self.model, self.optimizer)
                if "optimizer" in contents
                else None
            ),
            extra="extra" in contents,
        )
        if "model" in contents:
            self.model.load_state_dict(loaded["model"])
        if "optimizer" in contents:
            self._onload_optimizer()
            self.mc.load_optimizer_state(self.model, self.optimizer, loaded["optimizer"])
            self._offload_optimizer()
        if "extra" in contents:
            self._restore_extra_state(loaded["extra"])

    def close(self) -> list[dict[str, Any]]:
        """Finish this rank's writes (with the checkpoint deadline); their figures."""
        if self.manager is not None:
            self.manager.close()
        return self.finished_writes()

    def _extra_state(self) -> dict[str, Any]:
        return {"format": EXTRA_FORMAT, "torch_rng": torch.get_rng_state()}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        if not isinstance(extra, dict) or extra.get("format") != EXTRA_FORMAT:
            raise ValueError(
                f"{self.role} rank {self.rank}: extra state of unknown format "
                f"(expected format {EXTRA_FORMAT})"
            )
        torch.set_rng_state(extra["torch_rng"])

    # ---- optimizer offload ---------------------------------------------------------------

    def _offload_optimizer(self) -> None:
        """Move the optimizer state to fresh host tensors, as verl does between updates.

        Every state tensor is replaced by a new copy (new storage, even on CPU); nothing
        ever writes into these copies: the next update swaps in new device copies first.
        """
        if not self.role_cfg.optimizer_offload or self._offloaded:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    state[key] = value.detach().to("cpu", copy=True)
        self._offloaded = True

    def _onload_optimizer(self) -> None:
        if not self._offloaded:
            return
        device = next(self.model.parameters()).device
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    # Adam keeps `step` on the host unless capturable.
                    target = device if value.dim() > 0 else value.device
                    state[key] = value.to(target, copy=True)
        self._offloaded = False

    # ---- training ------------------------------------------------------------------------

    def _local_slice(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's data-parallel share of a full batch."""
        return batch.chunk(self.dp_size, dim=0)[self.dp_rank]

    def _forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        inputs = self.mc.causal_inputs(self.model, tokens)
        return self.model(*inputs, labels=labels)

    def _optimise(self, loss_fn) -> float:
        """`epochs` passes: forward, backward, data-parallel gradient mean, Adam step."""
        self._onload_optimizer()
        self.model.train()
        losses = []
        for _ in range(self.role_cfg.epochs):
            loss = loss_fn()
            loss.backward()
            self._average_data_parallel_grads()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        self._offload_optimizer()
        return sum(losses) / len(losses)

    def _average_data_parallel_grads(self) -> None:
        # Tensor-parallel ranks need no reduction here: megatron's TP layers already give
        # replicated parameters the same gradient on every TP rank.
        if self.dp_size == 1:
            return
        for param in self.model.parameters():
            if param.grad is not None:
                torch.distributed.all_reduce(param.grad, group=self.dp_group)
                param.grad.div_(self.dp_size)

    def _result(self, **values: Any) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "dp_rank": self.dp_rank, **values}


class ActorWorker(_RankWorker):
    """A policy rank: samples responses and takes clipped PPO steps."""

    role = "actor"

    def setup(self, port: int) -> dict[str, int]:
        info = super().setup(port)
        # Same seed on the TP ranks of a data-parallel slice: they must sample the same tokens.
        seed = derive_seed(self.cfg.trainer.seed, "sampler", self.dp_rank)
        self.sampler = torch.Generator().manual_seed(seed)
        return info

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor) -> dict[str, Any]:
        """Sample `response_length` tokens after this rank's prompts; with their log-probs."""
        self.model.eval()
        sequences = self._local_slice(prompts)
        for _ in range(self.cfg.rollout.response_length):
            logits = self._forward(sequences)[:, -1, :]
            probs = torch.softmax(self.mc.gather_vocab_logits(logits).float(), dim=-1)
            next_token = torch.multinomial(probs, 1, generator=self.sampler)
            sequences = torch.cat([sequences, next_token], dim=1)
        return self._result(tokens=sequences, log_probs=self._log_probs(sequences))

    def update(
        self, tokens: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor
    ) -> dict[str, Any]:
        tokens, old = self._local_slice(tokens), self._local_slice(old_log_probs)
        adv = self._local_slice(advantages)
        clip = self.cfg.algorithm.clip_ratio
        loss = self._optimise(lambda: policy_loss(self._log_probs(tokens), old, adv, clip))
        return self._result(loss=loss)

    def weight_shards(self) -> list[dict[str, Any]]:
        """This rank's share of the model's weights, for the rollout workers (async mode)."""
        return local_weight_shards(self.model)

    def _log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        """log p of each response token [b, R], through megatron's vocab-parallel loss."""
        per_token_nll = self._forward(sequences[:, :-1], labels=sequences[:, 1:])
        return -per_token_nll[:, self.prompt_length - 1 :].float()

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "sampler": self.sampler.get_state()}

    def _restore_extra_state(self, extra: dict[str, Any]) -> None:
        super()._restore_extra_state(extra)
        self.sampler.set_state(extra["sampler"])


class CriticWorker(_RankWorker):
    """A value rank: a GPTModel whose logit channel 0 is the value of each prefix."""

    role = "critic"
    head = "value"

    @torch.no_grad()
    def compute_values(self, tokens: torch.Tensor) -> dict[str, Any]:
        self.model.eval()
        return self._result(values=self._values(self._local_slice(tokens)))

    def update(self, tokens: torch.Tensor, returns: torch.Tensor) -> dict[str, Any]:
        tokens, targets = self._local_slice(tokens), self._local_slice(returns)
        loss = self._optimise(lambda: value_loss(self._values(tokens), targets))
        return self._result(loss=loss)

    def _values(self, sequences: torch.Tensor) -> torch.Tensor:
        """Value of the state before each response token [b, R]."""
        logits = self._forward(sequences[:, :-1])  # [b, s, vocab / tp]
        # Channel 0 of the vocabulary lives on TP rank 0. The other ranks contribute zeros
        # that still depend on their logits, so every rank runs the same backward
        # collectives; the all-reduce hands everyone the value (identity in backward).
        local = logits[..., 0] if self.tp_rank == 0 else logits[..., 0] * 0.0
        values = self.reduce_from_tp(local.contiguous())
        return values[:, self.prompt_length - 1 :].float()
