"""End-to-end tests of the core on a real local Ray: real megatron-core GPTModel ranks (TP=2
actor, TP=1 critic) over gloo, real files, real finalizer actor."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from tests.conftest import ROLES
from tests.helpers import (
    ckpt_config,
    close_all,
    every_rank,
    open_all,
    save_everyone,
    wait_until,
)
from tests.probes import imported, process_id
from verl_ckpt import (
    CheckpointCoordinator,
    CheckpointError,
    CheckpointWriteError,
    CommitTimeoutError,
    StepNotCommittedError,
    read_commit_record,
    read_tracker,
    step_dir,
)
from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.protocol.messages import RankReport

LOAD_PHASES = [
    "checks (fence, commit record, checksums)",
    "megatron-core: before the strategy",
    "megatron-core: conversion for DCP",
    "checkpoint metadata",
    "matching saved chunks",
    "reads in place",
    "DCP's path (the rest)",
    "megatron-core: unwrapping",
    "megatron-core: after the strategy",
]


def test_I1_I4_I7_async_save_commits_a_snapshot_megatron_reads(ranks, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    before = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    save_everyone(ranks, coordinator, 2, after="inplace")
    summary = coordinator.wait_for_commit(2)
    assert summary["step"] == 2 and read_tracker(cfg["root_dir"]) == 2
    record = read_commit_record(step_dir(cfg["root_dir"], 2))
    assert record.participants == {"actor": 2, "critic": 1, "driver": 1}
    names = {f.path for f in record.files}
    assert {
        "actor/.metadata",
        "actor/metadata.json",
        "critic/common.pt",
        "driver_state.pt",
    } <= names

    # I7: plain megatron-core reads each role directory, and it holds the state at save().
    for role, group in ranks.items():
        role_dir = str(step_dir(cfg["root_dir"], 2) / role)
        plain = ray.get([w.plain_megatron_load.remote(role_dir) for w in group])
        for i, w in enumerate(group):
            expected = before[every_rank(ranks).index(w)]
            for key, value in plain[i].items():
                assert torch.equal(value, expected[key]), key
    del i
    # The finalizer committed those directories with torch's DCP alone (torch_dist_dir): it
    # never paid for importing megatron-core, whose classes nothing it unpickles needs.
    assert not ray.get(coordinator.finalizer.__ray_call__.remote(imported, "megatron.core"))

    # I4 through our own load: model, optimizer moments and step restored exactly.
    loads = ray.get([w.load.remote(2) for w in every_rank(ranks)])
    after = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    for b, a in zip(before, after, strict=True):
        assert b.keys() == a.keys()
        for key in b:
            assert torch.equal(b[key], a[key]), key
    # Where each rank's load went (LoadStats): every tensor read in place (the extra state's
    # objects took DCP's path), each phase timed, the phases adding up to the whole call.
    for load in loads:
        stats = load["stats"]
        assert stats["step_path"] == str(step_dir(cfg["root_dir"], 2))
        assert stats["tensors_read_in_place"] == load["tensors"] > 0, load
        assert list(stats["phases_s"]) == list(stats["phases_cpu_s"]) == LOAD_PHASES, stats
        assert stats["phases_s"]["reads in place"] > 0, stats
        assert sum(stats["phases_s"].values()) == pytest.approx(stats["load_s"]), stats
        assert sum(stats["phases_cpu_s"].values()) == pytest.approx(stats["cpu_s"]), stats
    assert coordinator.load_driver_state(step_dir(cfg["root_dir"], 2))["data_position"] == 8
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def test_I3_retention_keeps_newest_and_survives_finalizer_restart(ranks, tmp_path):
    cfg = ckpt_config(tmp_path, max_ckpt_to_keep=2)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    for step in (1, 2, 3):
        save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(step)
    coordinator.drain()  # retention runs after wait_for_commit returned
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    # Kill the finalizer for real; Ray restarts it and it rebuilds its state from disk.
    # ray.kill returns before the process is gone: a begin of step 4 sent at once may reach
    # the old finalizer, and the new one then rightly refuses a step that was in flight when
    # it restarted. So save only once a new process answers.
    finalizer = coordinator.finalizer
    old_pid = ray.get(finalizer.__ray_call__.remote(process_id), timeout=60)
    ray.kill(finalizer, no_restart=False)
    wait_until(
        lambda: _pid_after_restart(finalizer) not in (None, old_pid),
        60,
        "the finalizer restarted in a new process",
    )
    save_everyone(ranks, coordinator, 4)
    coordinator.wait_for_commit(4)
    coordinator.drain()
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert read_tracker(root) == 4
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def _pid_after_restart(actor: ray.actor.ActorHandle) -> int | None:
    try:
        return ray.get(actor.__ray_call__.remote(process_id), timeout=60)
    except ray.exceptions.RayActorError:  # still restarting
        return None


def test_write_failure_surfaces_on_rank_and_in_finalizer_and_tracker_stays(ranks, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    ray.get([w.wait.remote() for w in every_rank(ranks)])
    # The critic's shard files are about 200 KB: cap its file size well below that.
    critic = ranks["critic"][0]
    ray.get(critic.limit_file_size.remote(16 * 1024))
    try:
        save_everyone(ranks, coordinator, 2)
        with pytest.raises(
            StepNotCommittedError, match=r"critic rank 0 \[write EFBIG\] OSError.*File too large"
        ):
            coordinator.wait_for_commit(2)
    finally:
        ray.get(critic.limit_file_size.remote(None))
    with pytest.raises(CheckpointWriteError, match="critic rank 0 failed to save step 2"):
        ray.get(critic.wait.remote())
    # Reported once: the next wait is clean, and the tracker still names step 1.
    ray.get(critic.wait.remote())
    assert read_tracker(cfg["root_dir"]) == 1
    # The next save succeeds and commits.
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    assert read_tracker(cfg["root_dir"]) == 3
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def test_I5_commit_deadline_names_the_missing_ranks(ranks, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    ray.get(ranks["critic"][0].save.remote(1))
    coordinator.save_driver_state(1, {"step": 1})
    # The actor ranks never save step 1: the wait ends at its deadline, naming them.
    with pytest.raises(
        CommitTimeoutError, match="missing reports from: actor rank 0, actor rank 1"
    ):
        coordinator.wait_for_commit(1, timeout_s=2)
    assert read_tracker(cfg["root_dir"]) is None
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def test_I1_finalizer_restart_loses_reports_and_never_half_commits(ranks, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    ray.get(ranks["critic"][0].save.remote(2))
    ray.get(ranks["critic"][0].wait.remote())
    # The finalizer dies (for real) after the critic reported step 2; Ray restarts it and
    # the restarted finalizer never commits step 2: the actor ranks' reports are refused.
    ray.kill(coordinator.finalizer, no_restart=False)
    ray.get([w.save.remote(2) for w in ranks["actor"]])
    for w in ranks["actor"]:
        with pytest.raises(CheckpointWriteError, match="finalizer restarted"):
            ray.get(w.wait.remote())
    with pytest.raises(StepNotCommittedError, match="lost"):
        coordinator.wait_for_commit(2, timeout_s=5)
    assert read_tracker(cfg["root_dir"]) == 1
    # A later step commits normally.
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    assert read_tracker(cfg["root_dir"]) == 3
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def test_I1_after_a_finalizer_restart_a_leftover_of_an_earlier_job_is_saved_over(ranks, tmp_path):
    """A restarted finalizer took every uncommitted directory for a step of this job in
    flight, lost: a leftover of an earlier job (which crashed saving step 3) then made this
    job's step 3 unsavable ("the finalizer restarted while the step was in flight"). Only
    the steps this job opened count as lost; the leftover is saved over as at any start."""
    cfg = ckpt_config(tmp_path)
    (step_dir(cfg["root_dir"], 3) / "actor").mkdir(parents=True)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    ray.kill(coordinator.finalizer, no_restart=False)  # for real; Ray restarts it
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    assert read_tracker(cfg["root_dir"]) == 3
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


def test_sync_save_writes_same_files_and_duplicate_reports_are_harmless(ranks, tmp_path):
    async_cfg = ckpt_config(tmp_path / "a")
    sync_cfg = ckpt_config(tmp_path / "s", async_save=False, writer={"mode": "inline"})
    names = {}
    for name, cfg in (("async", async_cfg), ("sync", sync_cfg)):
        coordinator = CheckpointCoordinator(cfg, ROLES)
        open_all(ranks, cfg)
        stats = save_everyone(ranks, coordinator, 1)
        if name == "sync":
            # A synchronous save returns with its files written.
            assert all(s["write_s"] is not None for s in stats)
        coordinator.wait_for_commit(1)
        record = read_commit_record(step_dir(cfg["root_dir"], 1))
        names[name] = sorted(f.path for f in record.files)
        # A late duplicate report changes nothing; re-saving a committed step is refused.
        late = Failure("driver", 0, Phase.WRITE, "late and wrong")
        duplicate = RankReport(1, "driver", 0, 1, "duplicate", failure=late)
        ray.get(coordinator.finalizer.report.remote(duplicate))
        assert coordinator.wait_for_commit(1)["tracker"] == 1
        with pytest.raises(CheckpointError, match="step 1 .*already committed"):
            coordinator.save_driver_state(1, {"step": 1})
        ray.get([w.close.remote() for w in every_rank(ranks)])
        coordinator.close()
    assert names["async"] == names["sync"]


def test_structure_change_replans_and_same_structure_reuses_plan(ranks, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    first = save_everyone(ranks, coordinator, 1)
    second = save_everyone(ranks, coordinator, 2)
    assert not any(s["plan_reused"] for s in first)
    assert all(s["plan_reused"] for s in second)
    # Every critic tensor changes shape: the plan must be rebuilt, never reused stale.
    critic = ranks["critic"][0]
    ray.get(critic.rebuild.remote(hidden_size=48))
    save_everyone(ranks, coordinator, 3)
    for step in (1, 2, 3):
        coordinator.wait_for_commit(step)
    by_rank = ray.get([w.wait.remote() for w in every_rank(ranks)])
    stats = by_rank[every_rank(ranks).index(critic)]
    assert [s["plan_reused"] for s in stats if s["step"] == 3] == [False]
    # Step 1 planned anew and converted the staged state for DCP; step 2, on the reused plan,
    # found its write items in the staged state without converting it (write_resolution.py);
    # the critic's step 3 converted again, with its new structure.
    converted = [[s["plan_converted"] for s in st if s["step"] in (1, 2)] for st in by_rank]
    assert converted == [[True, False]] * len(by_rank), converted
    assert [s["plan_converted"] for s in stats if s["step"] == 3] == [True]
    before = ray.get(critic.state_copy.remote())
    ray.get(critic.train.remote(1))
    ray.get(critic.load.remote(3))
    after = ray.get(critic.state_copy.remote())
    assert all(torch.equal(before[k], after[k]) for k in before)
    ray.get(critic.rebuild.remote(hidden_size=32))
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()


# ---- the suite's shared ranks (tests/conftest.py) ------------------------------------------

_KILLED: list = []


def test_a_test_that_kills_a_shared_rank_breaks_it_for_itself_only(ranks):
    """(1 of 2, in this order) A test that leaves a shared rank broken (here: dead) passes;
    the ranks that the next test gets are whole again (the next test checks)."""
    victim = ranks["critic"][0]
    _KILLED.append(victim)
    ray.kill(victim, no_restart=True)
    # ray.kill returns before the actor is gone: a call may still be answered meanwhile.
    deadline = time.monotonic() + 30
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(victim.pid.remote(), timeout=30)
            time.sleep(0.1)


def test_the_next_test_gets_every_shared_rank_answering_and_saving(ranks, tmp_path):
    """(2 of 2) After a test killed a shared rank, every rank answers and saves a step: the
    dead one was replaced (before, every later test of the worker failed with it)."""
    if not _KILLED:
        pytest.skip("runs after the test that kills a shared rank (run the module)")
    assert ranks["critic"][0] is not _KILLED[0]
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    close_all(ranks, coordinator)
