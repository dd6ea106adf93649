"""Any Ray actor as a participant of a step (issue 46): declared to the coordinator, saving
its own state off its caller's path, committed with the step, named when it fails."""

from __future__ import annotations

import random
import time

import pytest
import ray
import torch

from tests.helpers import ckpt_config
from verl_ckpt import (
    CheckpointCoordinator,
    CheckpointError,
    CommitRecordError,
    StateParticipant,
    StepNotCommittedError,
    load_participant_state,
    read_commit_record,
    read_tracker,
    step_dir,
)


@ray.remote(num_cpus=0)
class ReplayBuffer:
    """A replay buffer actor: tensors, counters and its RNG, saved as one participant."""

    def __init__(self, handle, seed: int) -> None:
        self.saver = StateParticipant(handle)
        self.samples = torch.arange(12, dtype=torch.float32).reshape(3, 4) + seed
        self.count = seed
        self.rng = torch.Generator().manual_seed(seed)
        random.seed(seed)

    def state(self) -> dict:
        return {
            "samples": self.samples,
            "count": self.count,
            "rng": self.rng.get_state(),
            "py_rng": random.getstate(),
            "meta": {"prompts": [1, 2, 3], "ratio": 0.5, "tag": "x", "none": None},
        }

    def save(self, step: int) -> float:
        """Save `step`, then change everything in place at once; the seconds save() took."""
        started = time.perf_counter()
        self.saver.save(step, self.state())
        took = time.perf_counter() - started
        self.samples.add_(100.0)
        self.count += 1
        torch.rand(3, generator=self.rng)
        return took

    def wait(self) -> None:
        self.saver.wait()

    def skip(self, step: int, why: str) -> None:
        self.saver.skip(step, why)

    def load(self, path: str) -> dict:
        return self.saver.load(path)

    def close(self) -> None:
        self.saver.close()


def coordinator_with(cfg: dict, participants: dict) -> CheckpointCoordinator:
    return CheckpointCoordinator(cfg, {}, participants=participants)


def test_I1_a_participant_actor_saves_asynchronously_and_the_step_commits_with_it(
    ray_local, tmp_path
):
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 7)
        expected = ray.get(actor.state.remote())
        coordinator.save_driver_state(3, {"step": 3})
        ray.get(actor.save.remote(3))
        coordinator.wait_for_commit(3)
        assert read_tracker(cfg["root_dir"]) == 3
        record = read_commit_record(step_dir(cfg["root_dir"], 3))
        assert record.state_participants == {"replay": 1}
        assert record.participants == {"driver": 1}
        assert "replay/state_0.pt" in {f.path for f in record.files}
        # The state at save(), although the actor changed it in place at once after.
        for loaded in (
            ray.get(actor.load.remote(str(step_dir(cfg["root_dir"], 3)))),
            load_participant_state(step_dir(cfg["root_dir"], 3), "replay", 0),
        ):
            assert torch.equal(loaded["samples"], expected["samples"])
            assert torch.equal(loaded["rng"], expected["rng"])
            assert loaded["count"] == 7 and loaded["py_rng"] == expected["py_rng"]
            assert loaded["meta"] == expected["meta"]
        ray.get(actor.close.remote())
    finally:
        coordinator.close()


def test_I1_the_step_waits_for_the_participant_report(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path, timeout_s=30.0)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 1)
        coordinator.save_driver_state(1, {"step": 1})
        assert coordinator.status()["pending"] == {1: "replay[0]"}
        assert read_tracker(cfg["root_dir"]) is None
        ray.get(actor.save.remote(1))
        coordinator.wait_for_commit(1)
        assert read_tracker(cfg["root_dir"]) == 1
    finally:
        coordinator.close()


def test_I5_a_participant_that_skips_a_step_fails_it_at_once_naming_it(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"rollout": 2})
    try:
        actors = [
            ReplayBuffer.remote(coordinator.participant_handle("rollout", i), i) for i in range(2)
        ]
        ray.get(actors[0].save.remote(1))
        ray.get(actors[1].skip.remote(1, "no rollouts yet"))
        with pytest.raises(StepNotCommittedError, match=r"rollout\[1\].*no rollouts yet"):
            coordinator.wait_for_commit(1, timeout_s=20)
    finally:
        coordinator.close()


def test_a_participant_name_must_be_plain_and_not_a_role(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path)
    with pytest.raises(CheckpointError, match="also a role"):
        CheckpointCoordinator(cfg, {"actor": 1}, participants={"actor": 1})
    with pytest.raises(CheckpointError, match="reserved for the driver"):
        CheckpointCoordinator(cfg, {}, participants={"driver": 1})
    with pytest.raises(CheckpointError, match="plain directory name"):
        CheckpointCoordinator(cfg, {}, participants={"../x": 1})


def test_load_refuses_a_participant_the_step_does_not_hold(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 1)
        coordinator.save_driver_state(1, {"step": 1})
        ray.get(actor.save.remote(1))
        coordinator.wait_for_commit(1)
        with pytest.raises(CommitRecordError, match=r"no state of participant rollout\[0\]"):
            load_participant_state(step_dir(cfg["root_dir"], 1), "rollout", 0)
        with pytest.raises(CheckpointError, match=r"not a declared participant"):
            coordinator.participant_handle("replay", 1)
    finally:
        coordinator.close()
