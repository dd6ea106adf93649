"""Configuration of the toy PPO recipe: validated dataclasses that are also Hydra's schema.

`register_recipe_configs()` stores the schema as `ppo_toy_schema`; configs/ppo_toy.yaml lists it
first in its defaults, so Hydra rejects wrongly typed overrides naming the key, and
`to_recipe_config()` then checks the values across keys (`__post_init__`), before Ray or any
worker starts.

Unknown keys are one line each, naming the nearest known key (verl_ckpt.unknown_keys), exit
status 2: `check_overrides` refuses them on the command line before Hydra composes (Hydra's
own refusal is a five-line block without a suggestion), and `to_recipe_config` in the composed
config (a key appended with `+key=...` is otherwise dropped without a word). Hydra's other
refusals (a value of the wrong type, a preset that does not exist, an override it cannot
parse) are one line too: `check_composes` composes the config before @hydra.main does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_ckpt import CheckpointConfig, to_checkpoint_config, unknown_keys
from verl_ckpt.protocol.config_keys import build_config

__all__ = [
    "ROLES",
    "ROLLOUT_MODES",
    "AlgorithmConfig",
    "DataConfig",
    "ModelConfig",
    "PPOToyConfig",
    "RecipeConfigError",
    "RoleConfig",
    "RolloutConfig",
    "TrainerConfig",
    "check_overrides",
    "derive_seed",
    "register_recipe_configs",
    "to_recipe_config",
]

ROLES = ("actor", "critic")
# rollout.mode: `sync` (the actor ranks generate each step's batch with the weights they are
# about to update) or `async` (rollout workers generate the next batch while the trainer
# updates on this one: one step off-policy).
ROLLOUT_MODES = ("sync", "async")


class RecipeConfigError(ValueError):
    """A recipe setting is invalid; the message names the key and says why."""


# The largest trainer.seed (either sign) whose derived seeds (seed * 1000 + offset) stay in
# the signed 64-bit range (torch.Generator.manual_seed takes [-2**63, 2**64); the bound is
# kept symmetric).
MAX_SEED = (2**63 - 1) // 1000 - 1


def derive_seed(seed: int, purpose: str, index: int = 0) -> int:
    """A distinct, reproducible seed per purpose (model init, sampler, prompts) and index."""
    offsets = {
        "actor_model": 1,
        "critic_model": 2,
        "prompts": 3,
        "replay": 4,
        "sampler": 100,
        "rollout": 200,
    }
    return seed * 1000 + offsets[purpose] + index


def _fail(key: str, value: Any, why: str) -> None:
    raise RecipeConfigError(f"{key}={value!r} is invalid: {why}")


@dataclass
class TrainerConfig:
    """The driver loop."""

    # Training steps of the whole run (a resumed run continues up to this step).
    total_steps: int = 40
    # Seeds the models, the prompts and the samplers; same seed and config = same run.
    seed: int = 1
    # JSON Lines file with one object per step; null turns it off.
    metrics_path: str | None = None
    # Ray CPUs each rank asks for (0 lets ranks share CPUs; an embedded Ray gets enough).
    cpus_per_worker: float = 1.0
    # Deadline for the workers to be placed, import megatron-core and join their process group.
    startup_timeout_s: float = 300.0


@dataclass
class ModelConfig:
    """Shape of the tiny GPT of both roles (the critic reads its value off logit channel 0)."""

    vocab_size: int = 32
    hidden_size: int = 32
    num_layers: int = 2
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64


@dataclass
class DataConfig:
    """The prompt set (recipes/data.py)."""

    # Prompts in the data set, drawn once from trainer.seed; each epoch visits every one
    # once, in a seeded permutation of its own. Epochs: as many as trainer.total_steps needs.
    num_prompts: int = 256


@dataclass
class RolloutConfig:
    """What the actor generates and what it is rewarded for, and who generates it."""

    # sync: the actor ranks generate; async: `num_workers` rollout workers (Ray actors
    # holding a copy of the actor's weights) generate the next batch while the trainer
    # updates on this one (the batch of step s comes from the weights after update s-2).
    mode: str = "sync"
    # Rollout workers in async mode; the batch is split evenly over them.
    num_workers: int = 1
    # Sequences of earlier steps kept for off-policy reuse (0: no replay buffer). Once it
    # holds rollout.batch_size of them, each actor update adds a seeded sample of that many.
    replay_size: int = 0
    # Sequences per step, split evenly over the data-parallel ranks of each role.
    batch_size: int = 32
    # Prompt tokens per sequence (the prompt set's width).
    prompt_length: int = 4
    # Tokens the actor samples after the prompt.
    response_length: int = 8
    # Reward of a sequence: the fraction of its response tokens equal to this token.
    target_token: int = 3


@dataclass
class AlgorithmConfig:
    """PPO and GAE coefficients."""

    gamma: float = 1.0
    lam: float = 0.95
    clip_ratio: float = 0.2


@dataclass
class RoleConfig:
    """One role's worker group (Megatron ranks in Ray actors)."""

    # Ranks of this role: tensor_parallel_size x data-parallel size.
    world_size: int = 1
    tensor_parallel_size: int = 1
    # Keep the optimizer state in fresh host tensors between updates (verl's offload).
    optimizer_offload: bool = True
    lr: float = 1e-2
    # Passes over each step's batch.
    epochs: int = 2


@dataclass
class PPOToyConfig:
    """The whole recipe config (configs/ppo_toy.yaml)."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: RoleConfig = field(
        default_factory=lambda: RoleConfig(world_size=2, tensor_parallel_size=2, lr=2e-3)
    )
    critic: RoleConfig = field(default_factory=RoleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        self._check_finite()
        self._check_trainer()
        self._check_model()
        self._check_rollout()
        self._check_algorithm()
        for role in ROLES:
            self._check_role(role, getattr(self, role))
        self.checkpoint = to_checkpoint_config(self.checkpoint)
        self._check_offload_aware_staging()
        self._check_hf_export()

    def role(self, name: str) -> RoleConfig:
        return getattr(self, name)

    @property
    def sequence_length(self) -> int:
        """Positions the models see: the prompt plus all response tokens but the last."""
        return self.rollout.prompt_length + self.rollout.response_length - 1

    def _check_finite(self) -> None:
        # First: NaN passes every range check below (each of its comparisons is false), and
        # inf most of them; both then fail after Ray started, or train on garbage.
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            if section.name == "checkpoint" or not dataclasses.is_dataclass(values):
                continue  # the checkpoint config checks its own numbers
            for key in dataclasses.fields(values):
                value = getattr(values, key.name)
                if isinstance(value, float) and not math.isfinite(value):
                    _fail(f"{section.name}.{key.name}", value, "must be a finite number")

    def _check_trainer(self) -> None:
        t = self.trainer
        if t.total_steps < 1:
            _fail("trainer.total_steps", t.total_steps, "must be >= 1")
        if t.cpus_per_worker < 0:
            _fail("trainer.cpus_per_worker", t.cpus_per_worker, "must be >= 0")
        if t.startup_timeout_s <= 0:
            _fail("trainer.startup_timeout_s", t.startup_timeout_s, "must be > 0")
        if not -MAX_SEED <= t.seed <= MAX_SEED:
            # Else the first seeded generator, made after Ray started, overflows.
            _fail("trainer.seed", t.seed, f"must lie in [-{MAX_SEED}, {MAX_SEED}]")

    def _check_model(self) -> None:
        m = self.model
        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads"):
            if getattr(m, key) < 1:
                _fail(f"model.{key}", getattr(m, key), "must be >= 1")
        if m.ffn_hidden_size < 1:
            _fail("model.ffn_hidden_size", m.ffn_hidden_size, "must be >= 1")
        if m.hidden_size % m.num_attention_heads:
            _fail(
                "model.hidden_size",
                m.hidden_size,
                f"must be a multiple of model.num_attention_heads={m.num_attention_heads}",
            )

    def _check_rollout(self) -> None:
        r = self.rollout
        for key in ("batch_size", "prompt_length", "response_length"):
            if getattr(r, key) < 1:
                _fail(f"rollout.{key}", getattr(r, key), "must be >= 1")
        if r.mode not in ROLLOUT_MODES:
            _fail("rollout.mode", r.mode, f"must be one of {', '.join(ROLLOUT_MODES)}")
        if r.num_workers < 1:
            _fail("rollout.num_workers", r.num_workers, "must be >= 1")
        if r.mode == "sync" and r.num_workers != 1:
            # Else ignored: in sync mode the actor ranks generate, and no worker starts.
            _fail(
                "rollout.num_workers",
                r.num_workers,
                "only rollout.mode=async starts rollout workers: set rollout.mode=async, "
                "or leave rollout.num_workers at 1",
            )
        if r.mode == "async" and r.batch_size % r.num_workers:
            _fail(
                "rollout.num_workers",
                r.num_workers,
                f"must divide rollout.batch_size={r.batch_size} (each worker generates "
                "an equal share)",
            )
        if r.replay_size < 0:
            _fail("rollout.replay_size", r.replay_size, "must be >= 0")
        if 0 < r.replay_size < r.batch_size:
            _fail(
                "rollout.replay_size",
                r.replay_size,
                f"must be 0 or >= rollout.batch_size={r.batch_size} (each update reuses "
                "that many sequences)",
            )
        if self.data.num_prompts < 1:
            _fail("data.num_prompts", self.data.num_prompts, "must be >= 1")
        if not 0 <= r.target_token < self.model.vocab_size:
            _fail(
                "rollout.target_token",
                r.target_token,
                f"must be a token id below model.vocab_size={self.model.vocab_size}",
            )

    def _check_algorithm(self) -> None:
        a = self.algorithm
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(a, key) <= 1.0:
                _fail(f"algorithm.{key}", getattr(a, key), "must lie in [0, 1]")
        if a.clip_ratio <= 0:
            _fail("algorithm.clip_ratio", a.clip_ratio, "must be > 0")

    def _check_offload_aware_staging(self) -> None:
        # Zero-copy saves of host-resident optimizer state are safe only if the trainer swaps
        # that state's storage between updates; Adam without offload updates it in place, and
        # a save whose write overlaps the next update would fail.
        if not self.checkpoint.staging.offload_aware:
            return
        for name in ROLES:
            if not self.role(name).optimizer_offload:
                _fail(
                    "checkpoint.staging.offload_aware",
                    True,
                    f"needs {name}.optimizer_offload=true (the optimizer state is then replaced "
                    "between updates, never written in place)",
                )

    def _check_hf_export(self) -> None:
        # Known before Ray starts: the export would fail after every commit (workers.py
        # describes the critic's model as a value model, which the export refuses).
        architectures = self.checkpoint.hf_export.architectures
        for role in architectures:
            if role not in ROLES:
                # Else refused after Ray started, when the coordinator plans the exports.
                _fail(
                    f"checkpoint.hf_export.architectures.{role}",
                    architectures[role],
                    f"this recipe has no role {role!r} (its roles: {', '.join(ROLES)})",
                )
        if "critic" in architectures:
            _fail(
                "checkpoint.hf_export.architectures.critic",
                architectures["critic"],
                "the critic is a value model (no language-model head): it has no Hugging "
                "Face export",
            )

    def _check_role(self, name: str, role: RoleConfig) -> None:
        tp = role.tensor_parallel_size
        if role.world_size < 1:
            _fail(f"{name}.world_size", role.world_size, "must be >= 1")
        if tp < 1:
            _fail(f"{name}.tensor_parallel_size", tp, "must be >= 1")
        if role.world_size % tp:
            _fail(
                f"{name}.tensor_parallel_size",
                tp,
                f"must divide {name}.world_size={role.world_size}",
            )
        # Megatron splits heads, vocabulary and MLP columns across the tensor-parallel ranks.
        for key in ("num_attention_heads", "vocab_size", "ffn_hidden_size"):
            if getattr(self.model, key) % tp:
                _fail(
                    f"{name}.tensor_parallel_size",
                    tp,
                    f"must divide model.{key}={getattr(self.model, key)}",
                )
        dp = role.world_size // tp
        if self.rollout.batch_size % dp:
            _fail(
                "rollout.batch_size",
                self.rollout.batch_size,
                f"must be a multiple of the data-parallel size of {name} "
                f"({name}.world_size / {name}.tensor_parallel_size = {dp})",
            )
        if role.lr <= 0:
            _fail(f"{name}.lr", role.lr, "must be > 0")
        if role.epochs < 1:
            _fail(f"{name}.epochs", role.epochs, "must be >= 1")


def check_overrides(overrides: list[str]) -> None:
    """Refuse a command-line override (`key=value`, `+key=value`, `++key=value`, `~key`) of
    a key the schema lacks, before Hydra composes; Hydra's own options, `hydra.*` keys and
    group paths are Hydra's. Raises RecipeConfigError naming the key and the nearest known key."""
    problems = []
    for override in overrides:
        if override.startswith("-") or ("=" not in override and not override.startswith("~")):
            continue  # a Hydra option (--cfg job, -m) or an option's value
        key = override.split("=", 1)[0].lstrip("~+").split("@", 1)[0]
        if not key or key == "hydra" or key.startswith("hydra.") or "/" in key:
            continue  # Hydra's own settings, and config groups by path (hydra/job_logging)
        tree: Any = None
        for part in reversed(key.split(".")):
            tree = {part: tree}
        problems.extend(unknown_keys(PPOToyConfig, tree))
    if problems:
        raise RecipeConfigError("; ".join(problems))


# Lines of Hydra's and OmegaConf's errors that locate rather than explain (the key is in the
# first line already; the search path is Hydra's own).
_LOCATING_LINES = ("full_key:", "reference_type=", "object_type=", "provider=", "See https://")


def check_composes(overrides: list[str], config_dir: Path) -> None:
    """Compose the recipe's config for these command-line overrides, as @hydra.main will
    next: a value of the wrong type, a preset that does not exist, an override Hydra's
    grammar cannot parse, is RecipeConfigError in one line (Hydra's own report is a block
    of five to twelve lines, exit status 1). Command lines with Hydra options (-m, --cfg,
    --config-name, ...) are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    if any(arg.startswith("-") for arg in overrides):
        return
    from verl_ckpt import register_configs

    register_configs()  # the schemas the presets and ppo_toy.yaml list first
    register_recipe_configs()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
            compose("ppo_toy", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        line = _one_line(exc)
        if isinstance(exc, OverrideParseException):
            line += " (Hydra's override grammar: quote a value that holds special characters)"
        raise RecipeConfigError(line) from None


def _one_line(exc: BaseException) -> str:
    """Hydra's error and its cause in one line: what went wrong, which override, and the
    options to choose from (a preset's), without the lines that only locate it."""
    parts: list[str] = []
    options: list[str] = []
    for error in (exc, exc.__cause__):
        for line in str(error or "").splitlines():
            if line.startswith("\t") and options:
                options.append(line.strip())
                continue
            line = line.strip()
            if line.startswith("Config search path"):
                break
            if line.startswith("Available options in"):
                options = [line.rstrip(":")]
            elif line.strip("^ ") and not line.startswith(_LOCATING_LINES):
                parts.append(line.rstrip("."))
    if options:
        parts.append(f"{options[0]}: {', '.join(options[1:])}")
    return "; ".join(dict.fromkeys(parts))


def to_recipe_config(cfg: Any) -> PPOToyConfig:
    """Build the validated config from Hydra's composed config (types already checked)."""
    # Unknown keys before the merge, which would drop a key Hydra appended (+trainer.x=5).
    return build_config(PPOToyConfig, cfg, RecipeConfigError)


def register_recipe_configs() -> None:
    """Store the schema as `ppo_toy_schema` in Hydra's ConfigStore (first in ppo_toy.yaml)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="ppo_toy_schema", node=PPOToyConfig)
