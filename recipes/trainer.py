"""The toy PPO recipe's driver loop (`PPOToyTrainer`): resume, the steps (rollout, values,
rewards, GAE, updates), the saves of a step with every participant. Start-up of the ranks is
in trainer_startup.py, the end of a run (last commit, exports, uploads, shutdown) in
trainer_end.py; the Hydra app that runs it in ppo_toy.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch

import verl_ckpt
from recipes.data import DataCursor, PromptSet
from recipes.groups import RoleGroup, data_parallel_parts, describe_snapshot, mean_loss
from recipes.metrics import MetricsLog
from recipes.ppo_config import ROLES, PPOToyConfig, derive_seed
from recipes.ppo_math import gae, token_rewards, whiten
from recipes.replay import REPLAY_PARTICIPANT, ReplayBuffer
from recipes.rollout import RolloutGroup, declared_participants
from recipes.rollout_worker import ROLLOUT_PARTICIPANT
from recipes.trainer_end import RunEnd
from recipes.trainer_startup import WorkerStartup
from verl_ckpt.store.layout import DRIVER_STATE_FILENAME

__all__ = ["DRIVER_STATE_FORMAT", "PPOToyTrainer", "check_driver_state", "data_stream"]

log = logging.getLogger("ppo_toy")

# 2: the data cursor at the trained frontier (1 held the generator of random prompts).
DRIVER_STATE_FORMAT = 2


def data_stream(cfg: PPOToyConfig) -> dict[str, Any]:
    """The keys that make the prompt stream the data cursor points into (and, in async
    mode, the shape of the batch the rollout workers hold ahead; with a replay buffer, the
    width of the sequences it holds): saved with each step, and a resume with other values
    is refused before Ray (the cursor would point into another stream: prompts skipped or
    repeated without a word; replayed sequences of another width fail the first update)."""
    keys = {
        "data.num_prompts": cfg.data.num_prompts,
        "rollout.prompt_length": cfg.rollout.prompt_length,
        "model.vocab_size": cfg.model.vocab_size,
        "trainer.seed": cfg.trainer.seed,
    }
    if cfg.rollout.mode == "async":
        keys["rollout.batch_size"] = cfg.rollout.batch_size
    if cfg.rollout.mode == "async" or cfg.rollout.replay_size > 0:
        keys["rollout.response_length"] = cfg.rollout.response_length
    return keys


def check_driver_state(
    state: dict[str, Any], step_path: Any, cfg: PPOToyConfig | None = None
) -> dict[str, Any]:
    """`state` (the driver's state of the committed step `step_path`), if this recipe can
    resume from it with `cfg`; else CheckpointError, one line naming the file and the format
    or the key."""
    where = f"{step_path}/{DRIVER_STATE_FILENAME}"
    if state.get("format") != DRIVER_STATE_FORMAT:
        raise verl_ckpt.CheckpointError(
            f"{where}: driver state of format "
            f"{state.get('format')!r}, this recipe resumes format {DRIVER_STATE_FORMAT} only"
        )
    saved = state.get("data_stream")  # absent in a state written before it was saved
    if cfg is not None and isinstance(saved, dict):
        for key, value in data_stream(cfg).items():
            if key in saved and saved[key] != value:
                raise verl_ckpt.CheckpointError(
                    f"{where}: the step was saved with {key}={saved[key]!r}, this run has "
                    f"{value!r}: its data cursor points into the prompt stream of the saved "
                    f"value; run with {key}={saved[key]!r}, or use a new checkpoint.root_dir"
                )
    return state


class PPOToyTrainer(WorkerStartup, RunEnd):
    def __init__(
        self,
        cfg: PPOToyConfig,
        start: verl_ckpt.StartPlan,
        preemption: verl_ckpt.PreemptionGuard | None = None,
    ) -> None:
        self.cfg = cfg
        self.preemption = preemption
        # Set once the job must stop (a signal, or the deadline): it exits after that save.
        self.stop: verl_ckpt.StopRequest | None = None
        self._save_began = 0.0
        self.roles = {name: cfg.role(name).world_size for name in ROLES}
        # The coordinator starts the finalizer; the ranks' managers look it up in setup().
        # `start` was decided before Ray started (root checked and locked, resume step).
        self.coordinator = verl_ckpt.CheckpointCoordinator(
            cfg.checkpoint, self.roles, participants=declared_participants(cfg), start=start
        )
        self.groups = {name: RoleGroup(name, cfg) for name in ROLES}
        self.data = PromptSet(
            cfg.data.num_prompts,
            cfg.rollout.prompt_length,
            cfg.model.vocab_size,
            prompt_seed=derive_seed(cfg.trainer.seed, "prompts"),
            seed=cfg.trainer.seed,
        )
        # What the updates consumed (saved with each step), and, in async mode, what the
        # rollout workers were handed: a batch ahead.
        self.trained = DataCursor()
        self.drawn = DataCursor()
        self.rollout = (
            RolloutGroup(cfg, self.coordinator, self.groups["actor"])
            if cfg.rollout.mode == "async"
            else None
        )
        self.replay = None
        if cfg.rollout.replay_size > 0:
            # Light (no megatron-core): it asks Ray for no CPU of its own.
            self.replay = (
                ray.remote(ReplayBuffer)
                .options(num_cpus=0, max_restarts=0)
                .remote(cfg, self.coordinator.participant_handle(REPLAY_PARTICIPANT, 0))
            )
        self.metrics = MetricsLog(cfg.trainer.metrics_path)
        # step -> {(role, rank): (write_s, bytes)} for saves whose writes are not all known.
        self._writes: dict[int, dict[tuple[str, int], tuple[float, int]]] = {}

    def resume(self) -> int:
        """Load the committed step `checkpoint.resume_mode` picks; the step to continue after.
        Async mode: the rollout workers get the weights of that step and the batch ahead
        of it (restored from their part of the step, or generated on a fresh start)."""
        path = self.coordinator.resume_dir()
        if path is None:
            log.info("starting fresh (checkpoint root %s)", self.coordinator.root)
            if self.rollout is not None:
                self.rollout.sync(0)
                self._draw(1)
            return 0
        start = time.perf_counter()
        ray.get(self._call_all("load", str(path)))
        state = check_driver_state(self.coordinator.load_driver_state(path), path, self.cfg)
        step = state["step"]
        self.trained = self.drawn = DataCursor.from_state(state["data_cursor"])
        if self.rollout is not None:
            self._resume_rollout(str(path), step)
        if self.replay is not None:
            self._resume_replay(str(path), step)
        log.info("resumed from %s (step %d) in %.2f s", path, step, time.perf_counter() - start)
        log.info(
            "data cursor at the trained frontier: epoch %d, position %d of %d prompts",
            self.trained.epoch,
            self.trained.position,
            len(self.data),
        )
        return step

    def _resume_replay(self, path: str, step: int) -> None:
        """The replay buffer of the committed step; a step saved without one (replay turned
        on for this run: the start-up check allows it) starts it empty, as documented."""
        if not verl_ckpt.read_commit_record(path).state_participants.get(REPLAY_PARTICIPANT):
            log.warning("resume from step %d: it holds no replay buffer; it starts empty", step)
            return
        ray.get(self.replay.load.remote(path), timeout=self.cfg.checkpoint.timeout_s)

    def _resume_rollout(self, path: str, step: int) -> None:
        """The rollout workers' buffers of the committed step: each buffered batch must be
        the next one of the prompt stream (none skipped, none repeated); the drawn cursor
        moves past them."""
        saved = verl_ckpt.read_commit_record(path).state_participants.get(ROLLOUT_PARTICIPANT)
        if saved != self.cfg.rollout.num_workers:
            log.warning(
                "resume from step %d: it holds %s rollout worker state(s), this run has "
                "rollout.num_workers=%d: the workers start from their seeds and step %d's "
                "batch is generated now, from the weights after update %d (an uninterrupted "
                "run used update %d's)",
                step,
                saved or "no",
                self.cfg.rollout.num_workers,
                step + 1,
                step,
                step - 1,
            )
            self.rollout.sync(step)
            self._draw(step + 1)
            return
        held = self.rollout.load(path)
        self.rollout.sync(step)
        for ahead, ids in held.items():
            expected, self.drawn = self.data.next_batch(self.drawn, self.cfg.rollout.batch_size)
            if not torch.equal(ids, expected):
                raise RuntimeError(
                    f"{path}: the rollout buffer's batch of step {ahead} is not the next one "
                    "of the prompt stream after the saved data cursor"
                )
        if not held:
            self._draw(step + 1)

    def _draw(self, step: int) -> None:
        """Async mode: hand the rollout workers the next batch of prompts, for `step`."""
        ids, self.drawn = self.data.next_batch(self.drawn, self.cfg.rollout.batch_size)
        self.rollout.generate(step, ids, self.data.tokens(ids))

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> None:
        total = self.cfg.trainer.total_steps
        start = self.resume()
        if start >= total:
            log.info("step %d already reaches trainer.total_steps=%d: nothing to do", start, total)
            self.finish(None)
            return
        if self.stop_requested() is not None:  # before any step: nothing new to save
            log.info("%s before the first step: step %d stays the newest", self.stop.reason, start)
            self.finish(None)
            return
        last_saved = None
        for step in range(start + 1, total + 1):
            begin = time.perf_counter()
            record = self.train_step(step)
            # The step boundary: a stop request adds a save out of schedule.
            stopping = self.stop_requested() is not None
            saving = self.coordinator.should_save(step, total) or stopping
            if saving:
                record.update(self.save(step))
                last_saved = step
            if self.rollout is not None:
                # After the save: each worker saves step+1's samples before it loads the
                # weights of this update (it serves its calls in order).
                self.rollout.sync(step)
            record["step_s"] = time.perf_counter() - begin
            log.info(
                "step %d/%d reward %.3f actor_loss %.4f critic_loss %.4f (%.2f s)",
                step,
                total,
                record["reward"],
                record["actor_loss"],
                record["critic_loss"],
                record["step_s"],
            )
            # Before the write figures are collected, which may include this step's own
            # (a sync save's): a step's figures line comes after its line.
            self.metrics.add(record)
            self.collect_write_figures(ray.get(self._call_all("finished_writes")))
            if self.rollout is not None:
                self.rollout.save_figures()  # logs a failed save (that step does not commit)
            if stopping:
                self.commit_before_exit(step)
                break
        self.finish(last_saved)

    def train_step(self, step: int) -> dict[str, Any]:
        r, a = self.cfg.rollout, self.cfg.algorithm
        batch = self.rollout_batch(step)
        tokens, old_log_probs = batch["tokens"], batch["log_probs"]
        actor, critic = self.groups["actor"], self.groups["critic"]
        tokens_ref = ray.put(tokens)
        values = data_parallel_parts(ray.get(critic.call("compute_values", tokens_ref)), "values")

        rewards = token_rewards(tokens[:, r.prompt_length :], r.target_token)
        advantages, returns = gae(rewards, values, a.gamma, a.lam)
        advantages = whiten(advantages)

        # With a replay buffer, the actor's update adds earlier sequences (off-policy: their
        # own old log-probs and advantages); the critic fits this step's returns only.
        reused = self.reuse(batch["prompt_ids"], tokens, old_log_probs, advantages)
        if reused is None:
            actor_refs = actor.call("update", tokens_ref, old_log_probs, advantages)
        else:
            actor_refs = actor.call(
                "update",
                ray.put(torch.cat([tokens, reused["tokens"]])),
                torch.cat([old_log_probs, reused["log_probs"]]),
                torch.cat([advantages, reused["advantages"]]),
            )
        critic_refs = critic.call("update", tokens_ref, returns)
        record = {
            "step": step,
            "reward": rewards.mean().item(),
            "actor_loss": mean_loss(ray.get(actor_refs)),
            "critic_loss": mean_loss(ray.get(critic_refs)),
            "value_mean": values.mean().item(),
            "epoch": batch["epoch"],
            "policy_version": batch["policy_version"],
            "prompt_ids": batch["prompt_ids"].tolist(),
        }
        if self.replay is not None:
            record["replay_prompt_ids"] = [] if reused is None else reused["prompt_ids"].tolist()
        # The update consumed the batch: the trained frontier moves past it.
        self.trained = batch["cursor_after"]
        return record

    def reuse(
        self,
        prompt_ids: torch.Tensor,
        tokens: torch.Tensor,
        log_probs: torch.Tensor,
        advantages: torch.Tensor,
    ) -> dict[str, torch.Tensor] | None:
        """Replay buffer: a draw of earlier sequences (None while it holds too few, or
        without one); then this step's sequences join it (after the draw: never reused at
        the step that generated them)."""
        if self.replay is None:
            return None
        reused = ray.get(self.replay.sample.remote(self.cfg.rollout.batch_size))
        fresh = {
            "prompt_ids": prompt_ids,
            "tokens": tokens,
            "log_probs": log_probs,
            "advantages": advantages,
        }
        self.replay.add.remote(fresh)
        return reused

    def rollout_batch(self, step: int) -> dict[str, Any]:
        """Step `step`'s batch: the next prompts after the trained frontier, generated now by
        the actor ranks (sync mode, the weights after update step-1), or taken from the
        rollout workers (async mode, the weights after update step-2), whose next batch is
        queued first so that it is generated while this one trains."""
        expected, after = self.data.next_batch(self.trained, self.cfg.rollout.batch_size)
        if self.rollout is None:
            prompts = self.data.tokens(expected)
            generated = ray.get(self.groups["actor"].call("generate", prompts))
            batch = {
                "prompt_ids": expected,
                "tokens": data_parallel_parts(generated, "tokens"),
                "log_probs": data_parallel_parts(generated, "log_probs"),
                "policy_version": step - 1,
            }
        else:
            self._draw(step + 1)
            batch = self.rollout.take(step)
            if not torch.equal(batch["prompt_ids"], expected):
                raise RuntimeError(
                    f"step {step}: the rollout workers' batch is not the next one of the "
                    "prompt stream (a prompt would be skipped or repeated)"
                )
        return {**batch, "cursor_after": after, "epoch": self.trained.epoch}

    # ---- checkpoints ---------------------------------------------------------------------

    def stop_requested(self) -> verl_ckpt.StopRequest | None:
        """Ask the preemption guard at a step boundary; remember a stop request."""
        if self.stop is None and self.preemption is not None:
            self.stop = self.preemption.stop_requested()
        return self.stop

    def wait_for_lost_steps(self) -> None:
        """Steps a dead rollout worker never reported (its successor skipped them, so they
        fail at once): take their outcome here, one line naming who failed each, before
        this save asks the finalizer for room."""
        for lost in self.rollout.take_lost_steps():
            try:
                self.coordinator.wait_for_commit(lost)
            except verl_ckpt.CheckpointError as exc:
                log.error("step %d did not commit: %s", lost, exc)

    def save(self, step: int) -> dict[str, Any]:
        """Every rank snapshots its state and the driver saves its own, concurrently.

        The step commits when the last participant reported, and that report waits for the
        commit. The ranks' saves are asked for first, and the driver's small synchronous save
        runs while they copy: it is then off the step's path (the driver waited for the
        ranks anyway), and its report still comes before theirs, which their background
        writes send, so the last report is normally a rank's, not the training loop's. If
        the driver's save fails, its error is raised here while the ranks may still be
        saving the step: that step never commits (it lacks the driver's report; where the
        driver had begun it, its failure is reported and fails the step at once), and what
        the ranks wrote of it is an uncommitted leftover: never resumed from, and removed
        before that step number is saved again.
        Once the job must stop, every wait here ends at the stop's deadline.
        """
        if self.rollout is not None:
            self.wait_for_lost_steps()
        begin = self._save_began = time.perf_counter()
        if self.preemption is not None:
            self.preemption.save_started(step)
        timeout = self.stop.remaining_s() if self.stop is not None else None
        refs = self._call_all("save", step)
        try:
            self.coordinator.save_driver_state(
                step,
                {
                    "format": DRIVER_STATE_FORMAT,
                    "step": step,
                    # At the trained frontier: what the updates consumed, not what the
                    # rollout workers were handed ahead (their buffer holds that).
                    "data_cursor": self.trained.to_state(),
                    "data_stream": data_stream(self.cfg),
                },
                timeout_s=timeout,
            )
        except verl_ckpt.CommitTimeoutError as exc:
            if self.stop is None:
                raise
            raise verl_ckpt.preemption_failure(step, self.stop, exc) from None
        if self.rollout is not None:
            self.rollout.save(step)  # not waited for: off the trainer's path
        if self.replay is not None:
            self.replay.save.remote(step)  # queued after this step's add; not waited for
        if self.stop is not None:
            who = [self.groups[role].describe(index) for role, index, _ in self.all_ranks]
            verl_ckpt.wait_before_deadline(refs, who, step, self.stop)
        stats = ray.get(refs)
        wall = time.perf_counter() - begin
        blocking = max(s["blocking_s"] for s in stats)
        log.debug("step %d: per-rank save figures %s", step, stats)
        self._writes[step] = {}
        log.info(
            "step %d: checkpoint snapshot taken, ranks blocked %.3f s (slowest of %d), "
            "driver %.3f s in all; %s",
            step,
            blocking,
            len(stats),
            wall,
            describe_snapshot(stats, self.cfg.checkpoint.writes_in_background),
        )
        return {"ckpt_blocking_s": blocking, "ckpt_save_wall_s": wall}
