"""A toy PPO trainer shaped like verl's: a driver, Megatron worker groups in Ray actors, and
asynchronous committed checkpoints through verl_ckpt.

    python -m recipes.ppo_toy                                  # train (resumes if it can)
    python -m recipes.ppo_toy trainer.total_steps=60 checkpoint=sync actor.world_size=2 \
        actor.tensor_parallel_size=2 actor.optimizer_offload=true

Task: after a random prompt the actor samples `rollout.response_length` tokens; the reward is
the fraction of them equal to `rollout.target_token`. A tiny GPT learns it in tens of steps.

One driver step (verl's order): rollout (actor) -> values (critic) -> rewards -> GAE
advantages -> actor and critic updates (concurrently) -> metrics; on a save step the driver
writes its own state and every rank snapshots its state (`CheckpointManager.save`, returns
once the snapshot is taken); the commit happens in the background (the finalizer actor) and
the loop never waits for it. Before exit the ranks finish their writes (`close`) and the
driver waits for the last save to commit.

Preemption (`checkpoint.preemption`, verl_ckpt.driver.preemption): on SIGTERM or SIGUSR1, or when
the deadline in `checkpoint.preemption.deadline_env` comes near, the step under way finishes, is
saved out of schedule and committed within `grace_s`, and the recipe exits with status 75
(EX_TEMPFAIL: run the same command again to resume).

Connects to the Ray cluster in RAY_ADDRESS (`ray job submit` sets it); otherwise starts an
embedded Ray bound to 127.0.0.1 and shuts it down at the end.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if not os.environ.get("RAY_ADDRESS"):
    # An embedded, single-node Ray: keep every address on 127.0.0.1. Ray replaces 127.0.0.1
    # by the machine's reachable IP (resolve_ip_for_localhost) unless multi-node clusters are
    # off; the variable is read when ray is imported, and Ray's processes inherit it.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Token authentication, which a new local Ray turns on by itself, warning on every run
    # that it did; named explicitly (Ray's documented switch), it is the same mode without
    # the warning. Read when ray is imported: set later (this module imported by a process
    # that imported ray already), Ray's cached mode and the variable would disagree.
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")

import hydra  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

# The driver never imports megatron-core: only the rank processes do (recipes.workers).
import verl_ckpt
from recipes.data import DataCursor, PromptSet
from recipes.groups import RoleGroup, data_parallel_parts, describe_snapshot, mean_loss
from recipes.metrics import MetricsLog
from recipes.ppo_config import (
    ROLES,
    PPOToyConfig,
    RecipeConfigError,
    check_overrides,
    derive_seed,
    register_recipe_configs,
    to_recipe_config,
)
from recipes.ppo_math import gae, token_rewards, whiten
from recipes.replay import REPLAY_PARTICIPANT, ReplayBuffer
from recipes.resume_plan import dropped_state, nothing_to_do
from recipes.rollout import RolloutGroup
from recipes.rollout_worker import ROLLOUT_PARTICIPANT
from recipes.workers import WorkerStartupError, WorkerStartupTimeout, process_died

log = logging.getLogger("ppo_toy")

REPO_ROOT = Path(__file__).resolve().parent.parent
# 2: the data cursor at the trained frontier (1 held the generator of random prompts).
DRIVER_STATE_FORMAT = 2

__all__ = ["DRIVER_STATE_FORMAT", "PPOToyTrainer", "RoleGroup", "describe_snapshot", "run"]


def participants(cfg: PPOToyConfig) -> dict[str, int]:
    """The participants of each step besides the roles' ranks and the driver."""
    declared = {}
    if cfg.rollout.mode == "async":
        declared[ROLLOUT_PARTICIPANT] = cfg.rollout.num_workers
    if cfg.rollout.replay_size > 0:
        declared[REPLAY_PARTICIPANT] = 1
    return declared


# ---- the trainer -------------------------------------------------------------------------


class PPOToyTrainer:
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
            cfg.checkpoint, self.roles, participants=participants(cfg), start=start
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

    @property
    def all_ranks(self) -> list[tuple[str, int, Any]]:
        return [(g.name, i, w) for g in self.groups.values() for i, w in enumerate(g.ranks)]

    def _call_all(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [getattr(w, method).remote(*args) for _, _, w in self.all_ranks]

    # ---- start-up ------------------------------------------------------------------------

    # How long a rank's start-up error waits for Ray to report a peer of its role dead.
    _PEER_DEATH_NOTICE_S = 5.0

    def start_workers(self) -> None:
        """Place every rank and join each role's gloo world. Fails at the first rank that dies
        or raises, naming it; at `trainer.startup_timeout_s`, naming the ranks not ready.

        Order: every rank reports once it is constructed (`started`), so that a process that
        dies at any point of start-up is noticed at once; each role's rank 0 opens the role's
        rendezvous (binds its port and keeps it); once a role's port is known, every rank of
        that role is set up with it. Results are taken one at a time as they come: waiting for
        all of them at once would wait for the whole timeout when a rank died, its peers
        blocked in the rendezvous waiting for it.
        """
        deadline = time.monotonic() + self.cfg.trainer.startup_timeout_s
        pending: dict[ray.ObjectRef, tuple[str, int, str]] = {}  # ref -> (role, rank, call)
        for role, index, worker in self.all_ranks:
            pending[worker.started.remote()] = (role, index, "started")
        for name, group in self.groups.items():
            pending[group.ranks[0].open_rendezvous.remote()] = (name, 0, "open_rendezvous")
        ready: set[tuple[str, int]] = set()
        while pending:
            done, _ = ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                raise self._startup_timeout(ready)
            role, index, call = pending.pop(done[0])
            result = self._startup_result(done[0], role, index, pending)
            if call == "started":
                log.debug("%s: process %s", self.groups[role].describe(index), result)
            elif call == "open_rendezvous":
                for rank, ref in enumerate(self.groups[role].call("setup", result)):
                    pending[ref] = (role, rank, "setup")
            else:
                ready.add((role, index))
        log.info(
            "workers ready: %s",
            ", ".join(
                f"{n} x{size} (TP={self.cfg.role(n).tensor_parallel_size})"
                for n, size in self.roles.items()
            ),
        )

    def _startup_timeout(self, ready: set[tuple[str, int]]) -> WorkerStartupTimeout:
        missing = ", ".join(
            self.groups[role].describe(index)
            for role, index, _ in self.all_ranks
            if (role, index) not in ready
        )
        return WorkerStartupTimeout(
            f"not ready after trainer.startup_timeout_s={self.cfg.trainer.startup_timeout_s:g}s: "
            f"{missing}. Each rank asks Ray for trainer.cpus_per_worker="
            f"{self.cfg.trainer.cpus_per_worker:g} CPUs; the cluster has "
            f"{ray.cluster_resources().get('CPU', 0):g}"
        )

    def _startup_result(
        self,
        ref: ray.ObjectRef,
        role: str,
        index: int,
        pending: dict[ray.ObjectRef, tuple[str, int, str]],
    ) -> Any:
        """The result of a finished start-up call, or a WorkerStartupError naming the rank."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            failure = (index, exc)
            if not process_died(exc):
                # A rank's rendezvous error is often the echo of a peer whose process died
                # (its connection closed): name the dead rank when Ray reports one.
                failure = self._peer_death(role, pending) or failure
            who = self.groups[role].describe(failure[0])
            log.debug("%s: start-up failed: %s", who, failure[1])
            raise WorkerStartupError.from_ray_error(who, failure[1]) from None

    def _peer_death(
        self, role: str, pending: dict[ray.ObjectRef, tuple[str, int, str]]
    ) -> tuple[int, Exception] | None:
        """(rank index, error) of a rank of `role` whose process Ray reports dead within
        _PEER_DEATH_NOTICE_S (Ray notices a dead process within milliseconds); else None."""
        peers = {ref: index for ref, (name, index, _) in pending.items() if name == role}
        deadline = time.monotonic() + self._PEER_DEATH_NOTICE_S
        waiting = list(peers)
        while waiting:
            done, waiting = ray.wait(
                waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                return None
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as exc:
                if process_died(exc):
                    return peers[done[0]], exc
        return None

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
        state = self.coordinator.load_driver_state(path)
        if state.get("format") != DRIVER_STATE_FORMAT:
            raise RuntimeError(f"{path}: driver state of unknown format {state.get('format')!r}")
        step = state["step"]
        self.trained = self.drawn = DataCursor.from_state(state["data_cursor"])
        if self.rollout is not None:
            self._resume_rollout(str(path), step)
        if self.replay is not None:
            ray.get(self.replay.load.remote(str(path)))
        log.info("resumed from %s (step %d) in %.2f s", path, step, time.perf_counter() - start)
        log.info(
            "data cursor at the trained frontier: epoch %d, position %d of %d prompts",
            self.trained.epoch,
            self.trained.position,
            len(self.data),
        )
        return step

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
            # Added before the write figures are collected: a save that already finished
            # (sync saves) releases its line right away.
            self.metrics.add(record, hold_for_write=saving)
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

    def save(self, step: int) -> dict[str, Any]:
        """The driver saves its own state, then every rank snapshots its state (concurrently).

        The step commits when the last participant reported, and that report waits for the
        commit. The driver's small synchronous save goes first so that the last report is
        normally a rank's, sent from its background writer, not the training loop.
        Once the job must stop, every wait here ends at the stop's deadline.
        """
        begin = self._save_began = time.perf_counter()
        if self.preemption is not None:
            self.preemption.save_started(step)
        timeout = self.stop.remaining_s() if self.stop is not None else None
        try:
            self.coordinator.save_driver_state(
                step,
                {
                    "format": DRIVER_STATE_FORMAT,
                    "step": step,
                    # At the trained frontier: what the updates consumed, not what the
                    # rollout workers were handed ahead (their buffer holds that).
                    "data_cursor": self.trained.to_state(),
                },
                timeout_s=timeout,
            )
        except verl_ckpt.CommitTimeoutError as exc:
            if self.stop is None:
                raise
            raise verl_ckpt.preemption_failure(step, self.stop, exc) from None
        refs = self._call_all("save", step)
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

    def commit_before_exit(self, step: int) -> None:
        """The job must stop: wait (until the stop's deadline) for `step` to commit; one line."""
        summary = verl_ckpt.commit_before_deadline(self.coordinator, step, self.stop)
        extra = len(self.preemption.signals_received) - 1 if self.preemption else 0
        log.info(
            "preemption (%s): step %d committed %.2f s after the request (save and commit "
            "%.2f s), tracker names step %s%s; exiting with status %d",
            self.stop.reason,
            step,
            time.monotonic() - self.stop.since,
            time.perf_counter() - self._save_began,
            summary["tracker"],
            f"; {extra} more signal(s) during the save, ignored" if extra > 0 else "",
            verl_ckpt.PREEMPTED_EXIT_STATUS,
        )

    def collect_write_figures(self, per_rank: list[list[dict[str, Any]]]) -> None:
        """Record finished writes; once every rank's write of a step ended, report it."""
        for (role, rank, _), finished in zip(self.all_ranks, per_rank):
            for figures in finished:
                writes = self._writes.setdefault(figures["step"], {})
                writes[(role, rank)] = (figures["write_s"], figures["bytes"])
        for step in sorted(self._writes):
            writes = self._writes[step]
            if len(writes) < len(self.all_ranks):
                continue
            del self._writes[step]
            write_s = max(w for w, _ in writes.values())
            nbytes = sum(b for _, b in writes.values())
            log.info(
                "step %d: checkpoint files written in %.3f s (slowest rank), %.2f MB by %d ranks",
                step,
                write_s,
                nbytes / 1e6,
                len(writes),
            )
            self.metrics.set_write_figures(step, write_s, nbytes)

    def finish(self, last_saved: int | None) -> None:
        """Finish every rank's writes, wait for the last save to commit, then for the
        Hugging Face exports of committed steps (save_contents with hf_model)."""
        self.collect_write_figures(ray.get(self._call_all("close")))
        if self.rollout is not None:
            self.rollout.close()
        if self.replay is not None:
            ray.get(self.replay.close.remote())
        if participants(self.cfg):
            self.report_unsettled_saves(last_saved)
        if last_saved is not None:
            summary = self.coordinator.wait_for_commit(last_saved)
            log.info(
                "step %d committed under %s: %d files, %.2f MB; tracker names step %s",
                last_saved,
                self.coordinator.root,
                summary["files"],
                summary["bytes"] / 1e6,
                summary["tracker"],
            )
        self.report_exports()
        if self.cfg.checkpoint.remote.url is not None:
            self.wait_for_uploads()

    def report_unsettled_saves(self, last_saved: int | None) -> None:
        """Async mode: an earlier save step still waiting for reports (a participant that
        died in its save, say) is waited for (checkpoint.timeout_s): its outcome is one
        line, naming who never reported, instead of nothing once the job is gone."""
        pending = self.coordinator.status()["pending"]
        for step in sorted(int(s) for s in pending):
            if last_saved is None or step >= last_saved:
                continue
            try:
                self.coordinator.wait_for_commit(step, timeout_s=self._left_before_the_stop())
            except verl_ckpt.CheckpointError as exc:
                log.error("step %d did not commit: %s", step, exc)

    def _left_before_the_stop(self) -> float | None:
        """What is left of the stop's grace once the job must stop (None: not stopping, the
        checkpoint deadline applies). The scheduler kills the job at the stop's deadline:
        an export or upload that would outlast it is left to the next run (logged)."""
        return None if self.stop is None else self.stop.remaining_s()

    def report_exports(self) -> None:
        """Wait (checkpoint.timeout_s, or what is left of a stop's grace) for the exports; a
        failed one is an error line that says how to retry it, and leaves its step
        committed."""
        try:
            outcomes = self.coordinator.wait_for_exports(timeout_s=self._left_before_the_stop())
        except verl_ckpt.CommitTimeoutError as exc:
            log.error("%s", exc)
            return
        for outcome in outcomes:
            failed = outcome["state"] == "failed"
            where = f" to {outcome['path']}" if outcome["path"] else ""
            log.log(
                logging.ERROR if failed else logging.INFO,
                "step %d: Hugging Face export of %s %s%s: %s",
                outcome["step"],
                outcome["role"],
                outcome["state"],
                where,
                outcome["message"],
            )

    def wait_for_uploads(self) -> None:
        """A finished run has its last committed step in the remote tier too (within the
        checkpoint deadline); a remote tier that fails is logged, the local tier stands."""
        try:
            remote = self.coordinator.wait_for_uploads(timeout_s=self._left_before_the_stop())
        except verl_ckpt.CommitTimeoutError as exc:
            log.error("%s; the next run uploads the newest committed step", exc)
            return
        if remote["status"] == "committed" or remote["step"] is None:
            log.info(
                "remote tier %s: step %s committed; remote tracker names step %s",
                remote["url"],
                remote["step"],
                remote["tracker"],
            )
        else:
            log.error(
                "remote tier %s: step %s is not uploaded (%s); the next run uploads it",
                remote["url"],
                remote["step"],
                remote["error"] or remote["status"],
            )

    def shutdown(self) -> None:
        """Release everything; safe after a failure halfway."""
        self.metrics.close()
        for _, _, worker in self.all_ranks:
            ray.kill(worker, no_restart=True)
        if self.rollout is not None:
            self.rollout.kill()
        if self.replay is not None:
            ray.kill(self.replay, no_restart=True)
        if self.stop is None:
            self.coordinator.close()
            return
        # Stopping: the scheduler's SIGKILL is near. A commit or retention still running gets
        # what is left of the grace period (at least a few seconds); cut short, the next start
        # rolls a commit forward if it got as far as its record, and retention resumes.
        try:
            self.coordinator.close(timeout_s=max(self.stop.remaining_s(), 5.0))
        except verl_ckpt.CheckpointError as exc:
            log.warning("closing the checkpoint coordinator: %s", exc)


# ---- entry point -------------------------------------------------------------------------


def connect_ray(cfg: PPOToyConfig) -> bool:
    """Use the Ray in RAY_ADDRESS (or one already initialised); else start an embedded one on
    127.0.0.1. True when this process started Ray (and must shut it down)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        log.info("connected to the Ray cluster at %s", address)
        return False
    ranks = sum(cfg.role(name).world_size for name in ROLES)
    ranks += sum(participants(cfg).values())  # the rollout workers
    num_cpus = max(os.cpu_count() or 1, math.ceil(ranks * cfg.trainer.cpus_per_worker))
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(
        address="local",  # never attach to another Ray on this machine by accident
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}},
    )
    log.info("started an embedded Ray on 127.0.0.1 with %d CPUs", num_cpus)
    return True


def run(cfg: PPOToyConfig, start: verl_ckpt.StartPlan) -> verl_ckpt.StopRequest | None:
    """Train with the root `start` locked and recovered; release everything at the end.
    Returns the stop request the run ended on (preemption), or None: it ran to the end."""
    started_ray = False
    trainer = None
    guard = None
    begin = time.perf_counter()
    try:
        started_ray = connect_ray(cfg)
        # After ray.init, which installs Ray's own SIGTERM handler (restored by close()).
        guard = verl_ckpt.PreemptionGuard(cfg.checkpoint.preemption, start.root).install()
        trainer = PPOToyTrainer(cfg, start, guard)
        trainer.start_workers()
        if trainer.rollout is not None:
            trainer.rollout.start(cfg.trainer.startup_timeout_s)
        trainer.fit()
        log.info("done in %.1f s", time.perf_counter() - begin)
        return trainer.stop
    finally:
        if trainer is not None:
            trainer.shutdown()
        if guard is not None:
            guard.close()
        if started_ray:
            ray.shutdown()
        start.release()


verl_ckpt.register_configs()
register_recipe_configs()


def before_ray(cfg: PPOToyConfig, start: verl_ckpt.StartPlan) -> bool:
    """What the start plan decides before Ray starts: True when there is nothing to do (the
    root is released, one line said so); else a warning per part of the resume step's state
    that this run does not load."""
    done = nothing_to_do(start, cfg.trainer.total_steps)
    if done is not None:
        start.release()
        log.info(
            "step %d already reaches trainer.total_steps=%d: nothing to do (checkpoint root %s)",
            done,
            cfg.trainer.total_steps,
            start.root,
        )
        return True
    roles = {name: cfg.role(name).world_size for name in ROLES}
    for line in dropped_state(start.resume_dir, roles, cfg.checkpoint.load_contents):
        log.warning("%s", line)
    return False


@hydra.main(config_path="../configs", config_name="ppo_toy", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_recipe_config(dict_cfg)
    except (RecipeConfigError, verl_ckpt.CheckpointConfigError) as exc:
        print(f"ppo_toy: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # Before Ray starts: a bad root, tracker or resume step (one the roles' ranks cannot
    # load included), or another job on this root, is one line and exit status 2, with
    # nothing written or deleted.
    try:
        start = verl_ckpt.prepare_start(
            cfg.checkpoint,
            purpose="python -m recipes.ppo_toy",
            roles={name: cfg.role(name).world_size for name in ROLES},
        )
        if before_ray(cfg, start):
            return
    except verl_ckpt.CheckpointError as exc:
        print(f"ppo_toy: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(1)
    try:
        stopped = run(cfg, start)
    except (WorkerStartupError, verl_ckpt.CheckpointError) as exc:
        # run() has shut down the ranks and Ray by now: one line, no traceback. A rank's
        # CheckpointError arrives wrapped by Ray (a RayTaskError that is also one), whose
        # text is the rank's traceback: its cause is the rank's own one-line error.
        log.debug("run failed", exc_info=True)
        print(f"ppo_toy: error: {getattr(exc, 'cause', None) or exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if stopped is not None:
        # Preempted: the step it stopped at is committed; the same command resumes from it.
        raise SystemExit(verl_ckpt.PREEMPTED_EXIT_STATUS)


def refuse_unknown_overrides(argv: list[str]) -> None:
    """Before Hydra composes: an override of a key the schema lacks is our one line and exit
    status 2 (Hydra's own refusal is a five-line block, exit status 1, with no suggestion)."""
    try:
        check_overrides(argv)
    except RecipeConfigError as exc:
        print(f"ppo_toy: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    refuse_unknown_overrides(sys.argv[1:])
    main()
