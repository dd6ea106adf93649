"""Any Ray actor as a participant of a step (issue 46): declared to the coordinator, saving
its own state off its caller's path, committed with the step, named when it fails."""

from __future__ import annotations

import os
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
from verl_ckpt.store.commit_record import write_commit_record


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


def replay_committed(coordinator: CheckpointCoordinator, step: int, seed: int):
    """A ReplayBuffer as participant replay[0] (seeded `seed`), and `step` committed with it
    and the driver."""
    actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), seed)
    coordinator.save_driver_state(step, {"step": step})
    ray.get(actor.save.remote(step))
    coordinator.wait_for_commit(step)
    return actor


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
        # With checkpoint.signing's keys, an unsigned record is refused here too (found by
        # review: the participant's load read the record without them).
        from verl_ckpt.protocol.errors import SignatureError
        from verl_ckpt.store.signing import Keyring

        with pytest.raises(SignatureError, match="unsigned"):
            load_participant_state(
                step_dir(cfg["root_dir"], 3), "replay", 0, keyring=Keyring([b"k" * 32])
            )
        ray.get(actor.close.remote())
    finally:
        coordinator.close()


def test_a_participant_on_a_signed_root_loads_with_the_keys_the_driver_read(
    ray_local, tmp_path, monkeypatch
):
    """Found by review: a participant read checkpoint.signing's keys itself, in its actor,
    where the driver's variable (or a key file's relative path) need not exist: the load
    failed ("unset variable") once Ray was up. The handle now carries the keys the driver
    read before Ray; a record they do not verify is still refused in the actor."""
    from verl_ckpt.protocol.errors import SignatureError

    variable = f"VERL_CKPT_TEST_KEY_{os.getpid()}"  # the driver's environment only
    monkeypatch.setenv(variable, "k3y-only-the-driver-has-" + "x" * 16)
    cfg = ckpt_config(tmp_path, signing={"key_env": variable})
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = replay_committed(coordinator, 3, seed=7)
        step = step_dir(cfg["root_dir"], 3)
        assert ray.get(actor.load.remote(str(step)))["count"] == 7
        record = read_commit_record(step)
        record.signature = None
        write_commit_record(step, record)  # the same step, its record now unsigned
        with pytest.raises(SignatureError, match="unsigned"):
            ray.get(actor.load.remote(str(step)))
        ray.get(actor.close.remote())
    finally:
        coordinator.close()


def test_a_thousand_waiting_calls_do_not_hold_a_reports_way_to_the_finalizer(ray_local, tmp_path):
    """Found by review: the finalizer is an async actor, which Ray lets run 1,000 calls at a
    time by default. Calls that wait hold their slot (a rank's upload_turn until the local
    commit, begin_step for room, wait_for_commit): at 16k ranks a thousand of them queued
    every report behind them, and no step could commit until they timed out. Here 1,100
    wait_for_commit calls wait for step 1 while its last participant saves."""
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 3)
        coordinator.save_driver_state(1, {"step": 1})
        waiting = [coordinator.finalizer.wait_for_commit.remote(1, 60.0) for _ in range(1100)]
        started = time.monotonic()
        ray.get(actor.save.remote(1))
        ray.get(actor.wait.remote(), timeout=30)  # the old code: its report queued (60 s)
        coordinator.wait_for_commit(1, timeout_s=30)
        assert time.monotonic() - started < 30
        assert all(r["step"] == 1 for r in ray.get(waiting, timeout=60))
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


def test_a_participant_refused_a_step_that_already_failed_saves_the_next_one(ray_local, tmp_path):
    """Found by review: a participant whose begin_step was refused because the step had
    already failed (another participant's failure first) kept that refusal as its own
    failure: its next save() raised it and failed the next step too, for everyone. A rank
    never did (save_runner); now a participant does as a rank does: logged, nothing raised."""
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"rollout": 2})
    try:
        actors = [
            ReplayBuffer.remote(coordinator.participant_handle("rollout", i), i) for i in range(2)
        ]
        ray.get(actors[1].skip.remote(1, "no rollouts yet"))
        with pytest.raises(StepNotCommittedError, match=r"rollout\[1\].*no rollouts yet"):
            coordinator.wait_for_commit(1, timeout_s=20)
        ray.get(actors[0].save.remote(1))  # refused at begin_step: the step failed
        ray.get(actors[0].wait.remote())  # raises nothing
        coordinator.save_driver_state(2, {"step": 2})
        ray.get([actor.save.remote(2) for actor in actors])
        coordinator.wait_for_commit(2, timeout_s=30)
        assert read_tracker(cfg["root_dir"]) == 2
        ray.get([actor.close.remote() for actor in actors])
    finally:
        coordinator.close()


def test_the_steps_waiting_for_a_participant_are_found_when_a_run_of_them_is_missing(
    ray_local, tmp_path
):
    """Found by review: the recipe found the steps a dead rollout worker never reported by
    looking for its label in status()["pending"], which names a run of missing workers as
    a range ("rollout[0-2]"): with three adjacent workers gone (a node), none was found, and
    their steps failed only at their deadline instead of at once."""
    from recipes.rollout import steps_waiting_for

    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"rollout": 3})
    try:
        coordinator.save_driver_state(1, {"step": 1})
        status = coordinator.status()
        assert status["pending"] == {1: "rollout[0-2]"}
        assert status["pending_participants"] == {1: ["rollout[0]", "rollout[1]", "rollout[2]"]}
        assert steps_waiting_for(status, "rollout[1]") == [1]
        assert steps_waiting_for(status, "rollout[3]") == []
    finally:
        coordinator.close()


def test_a_participant_name_must_be_plain_and_not_a_role(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path)
    with pytest.raises(CheckpointError, match="also a role"):
        CheckpointCoordinator(cfg, {"actor": 1}, participants={"actor": 1})
    with pytest.raises(CheckpointError, match="a file of every step"):
        CheckpointCoordinator(cfg, {}, participants={"driver_state.pt": 1})
    with pytest.raises(CheckpointError, match="reserved for the driver"):
        CheckpointCoordinator(cfg, {}, participants={"driver": 1})
    with pytest.raises(CheckpointError, match="plain directory name"):
        CheckpointCoordinator(cfg, {}, participants={"../x": 1})


def test_load_refuses_a_participant_the_step_does_not_hold(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        replay_committed(coordinator, 1, seed=1)
        with pytest.raises(CommitRecordError, match=r"no state of participant rollout\[0\]"):
            load_participant_state(step_dir(cfg["root_dir"], 1), "rollout", 0)
        with pytest.raises(CheckpointError, match=r"not a declared participant"):
            coordinator.participant_handle("replay", 1)
    finally:
        coordinator.close()


def commit_steps(coordinator, actor, steps) -> None:
    for step in steps:
        coordinator.save_driver_state(step, {"step": step})
        ray.get(actor.save.remote(step))
        coordinator.wait_for_commit(step)


def run_cli(capsys, *argv) -> tuple[int, str]:
    from verl_ckpt.cli.main import main

    code = main([str(a) for a in argv])
    out, _ = capsys.readouterr()
    return code, out


def test_I3_a_participant_shows_in_ls_verify_inspect_and_leaves_with_its_step(
    ray_local, tmp_path, capsys
):
    import json

    cfg = ckpt_config(tmp_path, max_ckpt_to_keep=1)
    root = cfg["root_dir"]
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 1)
        commit_steps(coordinator, actor, [1])
        code, out = run_cli(capsys, "ls", root)
        assert code == 0 and "driver:1,replay:1" in out, out
        code, out = run_cli(capsys, "verify", root)
        assert code == 0 and "OK participant replay x1: 1 files" in out, out
        code, out = run_cli(capsys, "inspect", root)
        assert code == 0 and "declared participants: replay x1" in out, out
        assert "participant replay x1: 1 state files" in out, out
        code, out = run_cli(capsys, "inspect", root, "--json")
        assert code == 0 and json.loads(out)["state_participants"] == {"replay": 1}
        # A damaged state file is named by verify.
        state = step_dir(root, 1) / "replay" / "state_0.pt"
        data = bytearray(state.read_bytes())
        data[-1] ^= 0xFF
        state.write_bytes(bytes(data))
        code, out = run_cli(capsys, "verify", root)
        assert code != 0 and "replay/state_0.pt" in out, out
        with pytest.raises(CommitRecordError, match=r"state of replay\[0\] failed verification"):
            load_participant_state(step_dir(root, 1), "replay", 0)
        # Retention after step 2's commit deletes step 1 with its participant's state.
        commit_steps(coordinator, actor, [2])
        coordinator.drain()
        assert not step_dir(root, 1).exists()
        assert (step_dir(root, 2) / "replay" / "state_0.pt").is_file()
    finally:
        coordinator.close()


def test_I5_a_participant_killed_in_its_save_or_never_saving_is_named_and_the_next_step_commits(
    ray_local, tmp_path
):
    """replay[0] is killed while it writes step 1 (its write hangs, by the fault hook);
    rollout[0] never saves step 1. The step fails at its deadline naming both; step 2, saved
    by a new replay actor, commits."""
    cfg = ckpt_config(tmp_path, timeout_s=3.0)
    coordinator = coordinator_with(cfg, {"replay": 1, "rollout": 1})
    try:
        handle = coordinator.participant_handle("replay", 0)
        hanging = ReplayBuffer.options(
            runtime_env={"env_vars": {"VERL_CKPT_FAULT": "write:replay=hang"}}
        ).remote(handle, 1)
        rollout = ReplayBuffer.remote(coordinator.participant_handle("rollout", 0), 2)
        coordinator.save_driver_state(1, {"step": 1})
        ray.get(hanging.save.remote(1))  # returns: the write runs (and hangs) behind it
        ray.kill(hanging)
        with pytest.raises(StepNotCommittedError) as failed:
            coordinator.wait_for_commit(1, timeout_s=300)
        assert "no report by the step's deadline from replay[0], rollout[0]" in str(failed.value)
        replay = ReplayBuffer.remote(handle, 3)
        coordinator.save_driver_state(2, {"step": 2})
        ray.get([replay.save.remote(2), rollout.save.remote(2)])
        coordinator.wait_for_commit(2)
        assert read_tracker(cfg["root_dir"]) == 2
        loaded = load_participant_state(step_dir(cfg["root_dir"], 2), "replay", 0)
        assert loaded["count"] == 3
    finally:
        coordinator.close()


def test_I5_a_respawned_participant_skips_the_step_its_killed_predecessor_began(
    ray_local, tmp_path
):
    """replay[0] is killed while it writes step 1 (its write hangs, by the fault hook); its
    successor, a new actor with the same handle, skips step 1: the step fails at once naming
    it and why, not at the step's deadline (the dead save's begin holds the step's attempt:
    the skip's report must not be taken for a stale report of a replaced save)."""
    cfg = ckpt_config(tmp_path, timeout_s=300.0)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        handle = coordinator.participant_handle("replay", 0)
        hanging = ReplayBuffer.options(
            runtime_env={"env_vars": {"VERL_CKPT_FAULT": "write:replay=hang"}}
        ).remote(handle, 1)
        coordinator.save_driver_state(1, {"step": 1})
        ray.get(hanging.save.remote(1))
        deadline = time.monotonic() + 60
        while not (step_dir(cfg["root_dir"], 1) / "replay").exists():
            assert time.monotonic() < deadline, "the hanging save never began step 1"
            time.sleep(0.05)
        ray.kill(hanging)
        successor = ReplayBuffer.remote(handle, 2)
        ray.get(successor.skip.remote(1, "its predecessor died saving it"))
        with pytest.raises(StepNotCommittedError, match=r"replay\[0\].*predecessor died"):
            coordinator.wait_for_commit(1, timeout_s=30)
        coordinator.save_driver_state(2, {"step": 2})
        ray.get(successor.save.remote(2))
        coordinator.wait_for_commit(2, timeout_s=60)
        assert read_tracker(cfg["root_dir"]) == 2
    finally:
        coordinator.close()


def test_a_resume_with_other_participants_than_the_step_is_one_line(ray_local, tmp_path):
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 1)
        commit_steps(coordinator, actor, [1])
    finally:
        coordinator.close()
    with pytest.raises(CheckpointError, match="holds the state of participants replay x1 that"):
        coordinator_with(cfg, {})
    with pytest.raises(CheckpointError, match="replay was saved by 1, this run declares 2"):
        coordinator_with(cfg, {"replay": 2})
    # A participant new to the step is allowed: it starts empty, its load says so.
    coordinator = coordinator_with(cfg, {"replay": 1, "data": 1})
    try:
        assert coordinator.resume_dir() == step_dir(cfg["root_dir"], 1)
        with pytest.raises(CommitRecordError, match=r"no state of participant data\[0\]"):
            load_participant_state(coordinator.resume_dir(), "data", 0)
    finally:
        coordinator.close()


def test_I1_a_step_with_a_participant_is_uploaded_and_restored_from_the_remote_tier(
    ray_local, s3_server, tmp_path
):
    from tests.test_remote_tier import remote_config

    cfg = remote_config(tmp_path, s3_server, s3_server.new_bucket())
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 5)
        expected = ray.get(actor.state.remote())
        commit_steps(coordinator, actor, [1])
        assert coordinator.wait_for_uploads()["status"] == "committed"
    finally:
        coordinator.close()
    # A new machine: an empty root, the same remote tier. Start-up pulls step 1 back.
    restored = {**cfg, "root_dir": str(tmp_path / "restored")}
    coordinator = coordinator_with(restored, {"replay": 1})
    try:
        assert coordinator.resume_dir() == step_dir(restored["root_dir"], 1)
        loaded = load_participant_state(coordinator.resume_dir(), "replay", 0)
        assert torch.equal(loaded["samples"], expected["samples"])
        assert torch.equal(loaded["rng"], expected["rng"]) and loaded["count"] == 5
    finally:
        coordinator.close()


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("enospc", r"replay\[0\] \[write ENOSPC\]"),
        # From helper-54's review: a BaseException on the save's thread was neither reported
        # (the step waited out its deadline) nor taken off: every later save raised it again.
        ("interrupt", r"replay\[0\] \[write\] KeyboardInterrupt"),
    ],
)
def test_I5_a_failed_write_fails_the_step_at_once_naming_it_and_is_raised_once(
    ray_local, tmp_path, fault, named
):
    cfg = ckpt_config(tmp_path)
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        failing = ReplayBuffer.options(
            runtime_env={"env_vars": {"VERL_CKPT_FAULT": f"write:replay:0={fault}"}}
        ).remote(coordinator.participant_handle("replay", 0), 1)
        coordinator.save_driver_state(1, {"step": 1})
        ray.get(failing.save.remote(1))
        started = time.monotonic()
        with pytest.raises(StepNotCommittedError, match=named):
            coordinator.wait_for_commit(1, timeout_s=30)
        assert time.monotonic() - started < 30  # at once, not at the step's deadline
        with pytest.raises(ray.exceptions.RayTaskError, match=r"replay\[0\]: the save of step 1"):
            ray.get(failing.wait.remote())
        ray.get(failing.wait.remote())  # raised once
    finally:
        coordinator.close()


def test_I3_rollback_moves_a_participant_state_with_its_step(ray_local, tmp_path, capsys):
    cfg = ckpt_config(tmp_path)
    root = cfg["root_dir"]
    coordinator = coordinator_with(cfg, {"replay": 1})
    try:
        actor = ReplayBuffer.remote(coordinator.participant_handle("replay", 0), 4)
        commit_steps(coordinator, actor, [1, 2])
    finally:
        coordinator.close()
    code, out = run_cli(capsys, "rollback", root, "--to", 1)
    assert code == 0 and read_tracker(root) == 1, out
    assert not step_dir(root, 2).exists()
    (archive,) = tmp_path.glob("ckpt/rolled_back_*")
    assert (step_dir(archive, 2) / "replay" / "state_0.pt").is_file()
    assert load_participant_state(step_dir(root, 1), "replay", 0)["count"] == 4


# ---- the pieces, without Ray ---------------------------------------------------------------


def test_the_commit_record_lists_state_participants_only_when_there_are_some():
    from verl_ckpt.store.commit_record import (
        CommitRecord,
        FileEntry,
        encode_commit_record,
        parse_commit_record,
    )

    plain = CommitRecord(step=1, participants={"driver": 1}, files=[])
    assert b"state_participants" not in encode_commit_record(plain)
    assert parse_commit_record(encode_commit_record(plain), "x").state_participants == {}
    files = [FileEntry(f"r/state_{i}.pt", 1, "0" * 16) for i in (0, 1)]
    record = CommitRecord(
        step=1, participants={"driver": 1}, files=files, state_participants={"r": 2}
    )
    assert parse_commit_record(encode_commit_record(record), "x").state_participants == {"r": 2}
    for bad in ({"r": 0}, {"driver": 1}, {"r": True}, {"r": 3}):
        record.state_participants = bad
        with pytest.raises(CommitRecordError, match="malformed"):
            parse_commit_record(encode_commit_record(record), "x")


def test_staging_copies_plain_state_and_refuses_what_a_safe_load_cannot_read():
    import numpy as np

    from verl_ckpt.participants.state_copy import stage_state

    tensor = torch.ones(2)
    staged = stage_state({"t": tensor, "l": [1, (2.0, "s")], "n": None})
    tensor.add_(1)
    assert torch.equal(staged["t"], torch.ones(2)) and staged["l"] == [1, (2.0, "s")]
    with pytest.raises(CheckpointError, match=r"state\['a'\]\[0\] is a numpy.ndarray"):
        stage_state({"a": [np.zeros(2)]})
    with pytest.raises(CheckpointError, match="key 3 that is not a str"):
        stage_state({3: 1})

    # Found by review: a tensor subclass survived the copy, was saved, and every resume
    # refused the committed step (a weights_only load does not read it back).
    class Tagged(torch.Tensor):
        pass

    tagged = torch.ones(2).as_subclass(Tagged)
    with pytest.raises(
        CheckpointError, match=r"state\['t'\] is a .*Tagged, a torch.Tensor subclass"
    ):
        stage_state({"t": tagged})
    assert type(stage_state({"p": torch.nn.Parameter(torch.ones(2))})["p"]) is torch.Tensor


def test_the_ledger_names_declared_participants_by_index():
    from verl_ckpt.commit.ledger import StepLedger

    ledger = StepLedger({"actor": 2, "driver": 1}, 1, state_participants={"rollout": 2})
    assert len(ledger.expected) == 5
    assert ledger.describe(ledger.missing(4)) == (
        "actor rank 0, actor rank 1, driver rank 0, rollout[0], rollout[1]"
    )
