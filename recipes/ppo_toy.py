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
from recipes.hydra_records import redact_hydra_records
from recipes.local_ray import init_local_ray
from recipes.metrics import metrics_path_problem
from recipes.ppo_config import (
    ROLES,
    PPOToyConfig,
    RecipeConfigError,
    check_composes,
    check_overrides,
    register_recipe_configs,
    to_recipe_config,
)
from recipes.resume_plan import dropped_state, nothing_to_do
from recipes.rollout import declared_participants
from recipes.trainer import PPOToyTrainer, check_driver_state
from recipes.workers import WorkerStartupError
from verl_ckpt.format.safe_load import load_state_file
from verl_ckpt.store.layout import DRIVER_STATE_FILENAME

log = logging.getLogger("ppo_toy")

REPO_ROOT = Path(__file__).resolve().parent.parent
__all__ = ["connect_ray", "main", "run"]


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
    ranks += sum(declared_participants(cfg).values())  # the rollout workers
    num_cpus = max(os.cpu_count() or 1, math.ceil(ranks * cfg.trainer.cpus_per_worker))
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    init_local_ray(  # never attach to another Ray on this machine by accident
        log,
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
    if start.resume_dir is not None:
        # The driver's state of the resume step, read as the resume reads it (nothing of it
        # run), and its format checked: a state this recipe cannot resume from is one line
        # here, not a traceback once Ray and the workers are up.
        path = Path(start.resume_dir)
        try:
            state = load_state_file(path / DRIVER_STATE_FILENAME)
        except OSError as exc:
            raise verl_ckpt.CheckpointError(
                f"{path / DRIVER_STATE_FILENAME}: the driver's state cannot be read: "
                f"{exc.strerror or exc}"
            ) from None
        check_driver_state(state, path, cfg)
    return False


@hydra.main(config_path="../configs", config_name="ppo_toy", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    # First: Hydra has just written the command line, credentials included, into the run's
    # .hydra/ record.
    redact_hydra_records(dict_cfg)
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
            # A resume step holding rollout or replay state this run does not declare (another
            # rollout.mode or worker count) is refused here, before Ray, not by the coordinator.
            participants=declared_participants(cfg),
        )
        if before_ray(cfg, start):
            return
        problem = metrics_path_problem(cfg.trainer.metrics_path)
    except verl_ckpt.CheckpointError as exc:
        print(f"ppo_toy: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if problem is not None:
        print(f"ppo_toy: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
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
    """Before Hydra composes: an override of a key the schema lacks, a value of the wrong
    type, a preset that does not exist, is our one line and exit status 2 (Hydra's own
    refusal is a block of five lines or more, exit status 1, with no suggestion)."""
    try:
        check_overrides(argv)
        check_composes(argv, REPO_ROOT / "configs")
    except RecipeConfigError as exc:
        print(f"ppo_toy: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    refuse_unknown_overrides(sys.argv[1:])
    main()
