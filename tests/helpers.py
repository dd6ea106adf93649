"""Small helpers shared by the Ray test modules: drive every rank of the `ranks` fixture,
wait for a condition with a deadline, start an aggregator that holds its batches."""

from __future__ import annotations

import time

import ray

from verl_ckpt.commit.aggregator import ReportAggregator, aggregator_name
from verl_ckpt.commit.client import FINALIZER_NAMESPACE


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(0.01)


def ckpt_config(tmp_path, **overrides) -> dict:
    """A checkpoint config on the test's own root, with a one-minute deadline."""
    return {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 60.0, **overrides}


def open_with_step_1_committed(ranks: dict, cfg: dict):
    """A coordinator of the test roles and every rank opened on `cfg`, step 1 saved and
    committed: from step 2 on, every rank's save plan is cached (saved off the training
    thread)."""
    from tests.conftest import ROLES
    from verl_ckpt import CheckpointCoordinator

    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    return coordinator


def every_rank(ranks: dict) -> list:
    return [w for group in ranks.values() for w in group]


def open_all(ranks: dict, cfg: dict) -> None:
    ray.get([w.open_manager.remote(cfg) for w in every_rank(ranks)])


def save_everyone(
    ranks: dict, coordinator, step: int, after: str = "nothing", snapshot: str | None = None
) -> list[dict]:
    """Every rank saves `step` (then does `after`, see RankWorker.save); then the driver."""
    from verl_ckpt import CheckpointError

    stats = ray.get([w.save.remote(step, after, snapshot) for w in every_rank(ranks)])
    try:
        coordinator.save_driver_state(step, {"step": step, "data_position": step * 4})
    except CheckpointError as exc:
        # A rank's failure of this step reached the finalizer first: the driver's save of it
        # is refused. The tests that provoke a failure assert it through wait_for_commit.
        if "a step number is saved once" not in str(exc):
            raise
    return stats


def close_all(ranks: dict, coordinator) -> None:
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def save_changed_before_the_fence(
    ranks: dict,
    coordinator,
    slowed,
    role: str,
    phase: str = "stage",
    match: str = "modified in place before the deferred",
) -> None:
    """Invariant I4: every rank saves step 2 and at once changes its state in place, with no
    fence, while `phase` of `slowed` (a rank of `role`) starts 1 s late: the deferred copy
    (stage), or a live snapshot's write. That rank's save fails loudly, naming the change
    (`match`), and the step does not commit."""
    import pytest

    from verl_ckpt import CheckpointWriteError, StepNotCommittedError
    from verl_ckpt.protocol.faults import ENV_VAR

    ray.get(slowed.set_env.remote(ENV_VAR, f"{phase}:{role}=sleep=1"))
    try:
        save_everyone(ranks, coordinator, 2, after="inplace")
        with pytest.raises(CheckpointWriteError, match=match):
            ray.get(slowed.wait.remote())
        # Whichever rank's failure reached the finalizer first is named.
        with pytest.raises(StepNotCommittedError, match=rf"rank \d \[{phase}\] .* in place"):
            coordinator.wait_for_commit(2)
    finally:
        ray.get(slowed.set_env.remote(ENV_VAR, None))


def start_holding_aggregator(
    root: str,
    finalizer: ray.actor.ActorHandle,
    name: str | None = None,
    members: tuple[str, int, int] | None = None,
) -> ray.actor.ActorHandle:
    """The node's aggregator of `root` (or, by `name` with `members`, a group's), started
    before the ranks find it, with a linger of an hour (its group aggregators too): a batch
    waiting for a rank is held until it is killed. With the default linger (50 ms) the batch
    could leave before the kill on a loaded machine, and the call would reach the finalizer
    after all."""
    node = ray.get_runtime_context().get_node_id()
    handle = (
        ray.remote(ReportAggregator)
        .options(
            name=name or aggregator_name(root, node),
            namespace=FINALIZER_NAMESPACE,
            max_restarts=-1,
            max_task_retries=0,
            num_cpus=0,
        )
        .remote(finalizer, 30.0, 3600.0, members, root)
    )
    ray.get(handle.pending.remote(), timeout=60)
    return handle


def kill_all(processes: list, timeout_s: float = 30.0) -> list:
    """Kill each of `processes` (psutil.Process) still running, and wait for them; returns
    those still alive after `timeout_s`. One that exited since it was listed (a Ray worker
    ending as its raylet goes) is skipped: psutil refuses to signal it, by its PID or by the
    PID's next owner."""
    import psutil

    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive
