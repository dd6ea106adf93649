"""Deferred snapshots for the RL idle window, and prepare() for a cheap first save, on real
Megatron ranks in Ray actors (invariant I4: what is saved is the state at save(), whatever
the trainer does after the fence; a change before it fails the save loudly).

The documented hook VERL_CKPT_FAULT only slows a deferred copy (`stage=sleep=...`) so that
the trainer's change lands before the copy ends: the race the version counters must catch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import torch

from tests.conftest import ROLES
from tests.helpers import (
    ckpt_config,
    close_all,
    every_rank,
    open_all,
    open_with_step_1_committed,
    save_changed_before_the_fence,
    save_everyone,
)
from verl_ckpt import (
    CheckpointCoordinator,
    CheckpointWriteError,
    StepNotCommittedError,
    read_tracker,
)
from verl_ckpt.protocol.faults import ENV_VAR


def assert_restores(ranks, step, before):
    ray.get([w.load.remote(step) for w in every_rank(ranks)])
    after = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    for b, a in zip(before, after, strict=True):
        assert b.keys() == a.keys()
        assert all(torch.equal(b[key], a[key]) for key in b)


def test_I4_deferred_snapshot_is_the_state_at_save_whatever_follows_the_fence(ranks, tmp_path):
    cfg = ckpt_config(tmp_path, snapshot="deferred")
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    first = save_everyone(ranks, coordinator, 1)
    # The first save plans over the group, which only the training thread may do: it copies
    # at once. The next ones, whose plan is cached, defer the copy.
    assert {s["snapshot"] for s in first} == {"now"}
    before = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    second = save_everyone(ranks, coordinator, 2, after="fence, inplace")
    assert {s["snapshot"] for s in second} == {"deferred"}
    coordinator.wait_for_commit(2)
    done = [s for w in every_rank(ranks) for s in ray.get(w.wait.remote()) if s["step"] == 2]
    assert all(s["stage_s"] > 0 and s["bytes_staged"] > 0 for s in done)  # copied, off-thread
    assert_restores(ranks, 2, before)
    close_all(ranks, coordinator)


@pytest.mark.parametrize(
    "snapshot, phase, match",
    [
        ("deferred", "stage", "modified in place before the deferred"),
        ("live", "write", r"written without a copy were modified in place .* snapshot=live call"),
    ],
)
def test_I4_a_change_before_the_fence_fails_the_save_loudly(
    ranks, tmp_path, snapshot, phase, match
):
    cfg = ckpt_config(tmp_path, snapshot=snapshot)
    coordinator = open_with_step_1_committed(ranks, cfg)
    # No fence: the trainer writes into its state while the critic's copy (deferred) or
    # write (live) is held back.
    save_changed_before_the_fence(ranks, coordinator, ranks["critic"][0], "critic", phase, match)
    assert read_tracker(cfg["root_dir"]) == 1
    # The actor ranks were not held back: whether their copies or writes beat the change is
    # a race, and either outcome is correct (a clean snapshot, or this same loud failure).
    for w in ranks["actor"]:
        try:
            ray.get(w.wait.remote())
        except CheckpointWriteError as exc:
            assert re.search(match, str(exc))
    close_all(ranks, coordinator)


def test_I4_offload_aware_deferred_save_judges_live_tensors_by_their_version_at_save(
    ranks, tmp_path
):
    """A deferred save chooses which host tensors it writes live (offload-aware staging) on
    the save thread, later than save(). An optimizer tensor changed in place between save()
    and that choice must still fail the save: the versions that count are those at save()."""
    cfg = ckpt_config(tmp_path, snapshot="deferred", staging={"offload_aware": True})
    critic = ranks["critic"][0]
    # Every moment with a storage of its own, whatever an earlier test on these long-lived
    # ranks left: all are written live, so the change below can meet only the live check
    # (a moment that is a view would be copied, and its copy's check fail the save first).
    ray.get(critic.set_moment_layout.remote([]))
    coordinator = open_with_step_1_committed(ranks, cfg)
    # The critic's deferred snapshot starts 1 s late: its optimizer tensors change first.
    ray.get(critic.set_env.remote(ENV_VAR, "stage:critic=sleep=1"))
    try:
        # Only the critic changes its state: the failure can be no other rank's.
        second = ray.get(
            [
                w.save.remote(2, "optimizer inplace" if w is critic else "nothing")
                for w in every_rank(ranks)
            ]
        )
        assert all(s["snapshot"] == "deferred" for s in second)
        coordinator.save_driver_state(2, {"step": 2})
        with pytest.raises(
            CheckpointWriteError,
            match=r"critic rank 0 failed to save step 2 .*written without a copy were modified",
        ):
            ray.get(critic.wait.remote())
        with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[write\]"):
            coordinator.wait_for_commit(2)
    finally:
        ray.get(critic.set_env.remote(ENV_VAR, None))
    assert read_tracker(cfg["root_dir"]) == 1
    close_all(ranks, coordinator)


def test_I4_fence_before_the_optimizer_makes_its_step_wait_for_the_snapshot(ranks, tmp_path):
    cfg = ckpt_config(tmp_path, snapshot="deferred")
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    ray.get([w.fence_before_optimizer_steps.remote() for w in every_rank(ranks)])
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    # A training step right after save(): its optimizer.step() fences first.
    before, _ = _commit_step_2_with_the_critic_late(ranks, coordinator, "stage", "step")
    assert_restores(ranks, 2, before)
    close_all(ranks, coordinator)


def _commit_step_2_with_the_critic_late(ranks, coordinator, phase: str, after: str) -> tuple:
    """Every rank saves step 2 and does `after` at once, while `phase` of the critic (its
    deferred copy, or its live write) starts 1 s late; step 2 commits. Returns every rank's
    state as it was at save(), and the saves' stats."""
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, f"{phase}:critic=sleep=1"))
    try:
        before = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
        second = save_everyone(ranks, coordinator, 2, after=after)
        coordinator.wait_for_commit(2)
    finally:
        ray.get(critic.set_env.remote(ENV_VAR, None))
    return before, second


def test_I4_live_snapshot_writes_host_tensors_uncopied_and_its_fence_waits_for_the_writes(
    ranks, tmp_path
):
    """snapshot=live: save() returns at once, the host tensors are written from the
    trainer's own memory (no staging copy), and fence() returns only once they are written.
    The critic's write starts 1 s late: a fence that opened before the write ended would let
    the change below into the file (or fail the save on the version counters)."""
    cfg = ckpt_config(tmp_path, snapshot="live")
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    first = save_everyone(ranks, coordinator, 1)
    assert {s["snapshot"] for s in first} == {"now"}  # planned over the group: copied now
    before, second = _commit_step_2_with_the_critic_late(
        ranks, coordinator, "write", "fence, inplace"
    )
    assert {s["snapshot"] for s in second} == {"live"}
    done = [s for w in every_rank(ranks) for s in ray.get(w.wait.remote()) if s["step"] == 2]
    # Every whole host tensor is written uncopied; only views (which megatron-core clones)
    # may still be copied.
    assert all(s["bytes_zero_copy"] > s["bytes_staged"] for s in done)
    assert_restores(ranks, 2, before)
    close_all(ranks, coordinator)


def test_I4_a_live_write_that_outlasts_its_deadline_keeps_the_trainer_fenced(ranks, tmp_path):
    """The critic's writer threads stall in its live write (its write gate held shut: see
    save_live_with_its_writes_held) past the save's deadline. They cannot be stopped and
    may still read the trainer's tensors, so fence() raises, naming it, instead of handing
    the state back as free, at every call until those writes ended (a fence that raised
    once and then opened let the trainer change what a writer still read); then it opens.
    The step fails and the tracker stays."""
    cfg = ckpt_config(tmp_path, snapshot="live", timeout_s=6)
    coordinator = open_with_step_1_committed(ranks, cfg)
    critic = ranks["critic"][0]
    held = critic.save_live_with_its_writes_held.remote(2)
    ray.get([w.save.remote(2) for w in ranks["actor"]])
    first, again, released, after = ray.get(held)
    still_read = r"the live snapshot of step 2 .* is still being read by a writer thread"
    assert re.search(still_read, first), first
    assert re.search(still_read, again), again
    assert (released, after) == ("fence returned", "fence returned")
    with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[write\]"):
        coordinator.wait_for_commit(2)
    with pytest.raises(CheckpointWriteError, match="critic rank 0 failed to save step 2"):
        ray.get(critic.wait.remote())
    assert read_tracker(cfg["root_dir"]) == 1
    close_all(ranks, coordinator)


@pytest.mark.parametrize("snapshot", ["deferred", "live"])
def test_I4_a_save_holds_the_tensors_of_save_whatever_the_trainer_binds_to_data_before_the_fence(
    ranks, tmp_path, snapshot
):
    """Found by review: a trainer that rebinds a tensor's `.data` between save() and the
    fence (moves a parameter to the GPU for its rollout, swaps in EMA weights) moves no
    version counter, and the save read `.data` again after save(): it wrote the new values
    silently, or failed on the new tensor's counter. The critic's copy (deferred) or write
    (live) starts 1 s late, so that the swap lands first; what is saved must be the state
    at save()."""
    cfg = ckpt_config(tmp_path, snapshot=snapshot)
    coordinator = open_with_step_1_committed(ranks, cfg)
    phase = "stage" if snapshot == "deferred" else "write"
    before, second = _commit_step_2_with_the_critic_late(ranks, coordinator, phase, "swap data")
    assert {s["snapshot"] for s in second} == {snapshot}
    assert_restores(ranks, 2, before)
    close_all(ranks, coordinator)


@pytest.mark.parametrize("snapshot", ["now", "deferred", "live"])
def test_I4_extra_state_is_the_state_at_save_also_when_the_plan_is_cached(
    ranks, tmp_path, snapshot
):
    """The per-rank extra state (a ShardedObject) is serialised for the file when the save
    plans: on the save thread, after save() returned, once the plan is cached. A trainer that
    changes its own counters right after save() (after a fence, for a deferred one) must
    still get the values they had at save()."""
    cfg = ckpt_config(tmp_path, snapshot=snapshot)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    second = save_everyone(ranks, coordinator, 2, after="extra")
    assert all(s["plan_reused"] for s in second)
    coordinator.wait_for_commit(2)
    ray.get([w.load.remote(2) for w in every_rank(ranks)])
    assert ray.get([w.counter_value.remote() for w in every_rank(ranks)]) == [[2]] * 3
    close_all(ranks, coordinator)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_prepare_makes_the_first_save_reuse_the_plan_buffers_and_writer(ranks, tmp_path, writer):
    cfg = ckpt_config(tmp_path, writer={"mode": writer})
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    root = Path(cfg["root_dir"])
    opened = sorted(path.name for path in root.iterdir())
    ray.get([w.prepare.remote() for w in every_rank(ranks)])
    # Planning writes nothing into the checkpoint root (it once left an empty prepare/).
    assert sorted(path.name for path in root.iterdir()) == opened
    staged = ray.get([w.staged_bytes.remote() for w in every_rank(ranks)])
    assert all(n > 0 for n in staged)  # the buffers exist before the first save
    if writer == "process":
        assert all(ray.get([w.writer_pid.remote() for w in every_rank(ranks)]))
    before = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    first = save_everyone(ranks, coordinator, 1)
    assert all(s["plan_reused"] for s in first)
    assert ray.get([w.staged_bytes.remote() for w in every_rank(ranks)]) == staged
    coordinator.wait_for_commit(1)
    assert_restores(ranks, 1, before)
    close_all(ranks, coordinator)
