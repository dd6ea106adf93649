"""Reliability: real kills, real full disks, real corrupt files. Whatever fails, the tracker
names a complete, loadable step and resume works. Each test names the invariant it checks.

Faults are real wherever they can be produced for real (SIGKILL of processes, a small tmpfs
that fills up, files truncated and bit-flipped on disk). The documented hook
VERL_CKPT_FAULT (verl_ckpt/protocol/faults.py) only places a fault at an exact moment: a hang or a
process exit at a chosen phase, and ENOSPC exactly during the tracker write, which no real
disk can be made to produce at that instant.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch

from tests.conftest import REPO_ROOT, ROLES
from tests.helpers import (
    ckpt_config,
    close_all,
    every_rank,
    open_all,
    open_with_step_1_committed,
    save_everyone,
)
from tests.rank_worker import start_world
from verl_ckpt import (
    CheckpointCoordinator,
    CheckpointError,
    CheckpointWriteError,
    CommitRecordError,
    CommitTimeoutError,
    StepNotCommittedError,
    read_tracker,
    step_dir,
)
from verl_ckpt.commit.client import actor_options
from verl_ckpt.commit.finalizer import CheckpointFinalizer
from verl_ckpt.protocol.faults import ENV_VAR, ONCE_ENV_VAR, InjectedFault
from verl_ckpt.store.commit_record import is_committed, read_commit_record
from verl_ckpt.store.layout import RUN_MARKER_FILENAME, list_step_dirs
from verl_ckpt.store.verification import verify_files


def faulty_coordinator(cfg, roles, fault, disarmed_marker):
    """A coordinator whose finalizer runs with VERL_CKPT_FAULT=`fault`, fired once, when
    `disarmed_marker` does not exist (the test deletes it to arm the fault)."""
    root = Path(cfg["root_dir"]).resolve()
    root.mkdir(parents=True, exist_ok=True)
    disarmed_marker.touch()
    participants = {**roles, "driver": 1}
    env = {ENV_VAR: fault, ONCE_ENV_VAR: str(disarmed_marker), "PYTHONPATH": str(REPO_ROOT)}
    finalizer = ray.remote(CheckpointFinalizer).options(
        **actor_options(root), runtime_env={"env_vars": env}
    )
    # With a run id, as start_finalizer starts it: a restart then tells this job's steps from
    # an earlier job's leftovers by their run marker (admission.steps_lost_in_a_restart).
    handle = finalizer.remote(
        str(root), participants, cfg.get("max_ckpt_to_keep"), 1, run_id=uuid.uuid4().hex
    )
    # Wait until it runs: only then is its name registered for the coordinator to find.
    ray.get(handle.describe.remote())
    coordinator = CheckpointCoordinator(cfg, roles)
    assert coordinator.finalizer._actor_id == handle._actor_id
    # The creating handle owns the actor: drop it and Ray collects the actor.
    coordinator.owner_handle = handle
    return coordinator


def wait_for_file(path: Path, timeout_s: float = 30.0) -> None:
    """Until `path` exists (a fault's marker: the fault fired) or the deadline passes; the
    caller asserts on it."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def critic_fails_step_2(ranks, tmp_path, save_step_2):
    """Everyone commits step 1; then the critic's write of step 2 fails (ENOSPC, injected)
    while `save_step_2(coordinator)` saves it, and wait_for_commit(2) names the critic.
    Returns the config and the coordinator."""
    cfg = ckpt_config(tmp_path, timeout_s=30.0)
    coordinator = open_with_step_1_committed(ranks, cfg)
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, "write:critic=enospc"))
    try:
        save_step_2(coordinator)
        with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[write ENOSPC\]"):
            coordinator.wait_for_commit(2)
    finally:
        ray.get(critic.set_env.remote(ENV_VAR, None))
    return cfg, coordinator


@pytest.fixture
def lone_rank(ray_local):
    """A fresh one-rank role `victim` that a test may kill or hang."""
    (worker,) = start_world("victim", 1, tp=1)
    ray.get(worker.train.remote(1))
    yield worker
    ray.kill(worker)


def test_I1_I5_sigkill_of_a_rank_mid_write_commits_nothing_and_names_it(lone_rank, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0}
    coordinator = CheckpointCoordinator(cfg, {"victim": 1})
    ray.get(lone_rank.open_manager.remote(cfg))
    ray.get(lone_rank.save.remote(1))
    coordinator.save_driver_state(1, {"step": 1})
    coordinator.wait_for_commit(1)
    ray.get(lone_rank.wait.remote())
    ray.get(lone_rank.set_env.remote(ENV_VAR, "write:victim=hang"))
    ray.get(lone_rank.save.remote(2))
    coordinator.save_driver_state(2, {"step": 2})
    os.kill(ray.get(lone_rank.pid.remote()), signal.SIGKILL)
    with pytest.raises(CommitTimeoutError, match="missing reports from: victim rank 0"):
        coordinator.wait_for_commit(2, timeout_s=3)
    assert read_tracker(cfg["root_dir"]) == 1
    assert is_committed(step_dir(cfg["root_dir"], 1))
    assert not is_committed(step_dir(cfg["root_dir"], 2))
    coordinator.close()


def test_I5_hung_rank_is_named_and_training_is_not_blocked(lone_rank, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 3.0}
    coordinator = CheckpointCoordinator(cfg, {"victim": 1})
    ray.get(lone_rank.open_manager.remote(cfg))
    ray.get(lone_rank.set_env.remote(ENV_VAR, "report:victim=hang"))
    started = time.monotonic()
    ray.get(lone_rank.save.remote(1))  # returns: the hang is in the background report
    assert time.monotonic() - started < 3
    ray.get(lone_rank.train.remote(1))  # and the rank keeps training
    coordinator.save_driver_state(1, {"step": 1})
    with pytest.raises(CommitTimeoutError, match="victim rank 0"):
        coordinator.wait_for_commit(1, timeout_s=3)
    # The rank's next save does not pile up behind the hung one: a deadline error naming it
    # and what it is stuck in (here its report, not the disk).
    hung = r"write of step 1 is still running .* \(waiting for the finalizer to take its report\)"
    with pytest.raises(CommitTimeoutError, match=hung):
        ray.get(lone_rank.save.remote(2))
    assert read_tracker(cfg["root_dir"]) is None
    coordinator.close()


def saved_or_refused(outcomes: list, step: int) -> None:
    """The other ranks' saves of `step`: each saved, or was refused because the step had
    already failed (a race of their begin with the failure)."""
    for outcome in outcomes:
        try:
            ray.get(outcome)
        except CheckpointError as exc:
            assert f"step {step}" in str(exc)


def test_I5_a_rank_whose_save_raises_instead_of_saving_fails_that_step_at_once(ranks, tmp_path):
    """The critic's write of step 2 fails; its save(3) raises that failure (once) instead of
    saving step 3, which the other participants save. Step 3 then waited for the critic's
    report for ever, and with max_in_flight=1 no later step could start. Now the critic's
    save() tells the finalizer that it will not save step 3: the step fails at once, naming
    it, and step 4 commits."""
    cfg, coordinator = critic_fails_step_2(
        ranks, tmp_path, lambda coordinator: save_everyone(ranks, coordinator, 2)
    )
    critic = ranks["critic"][0]
    actors = [w.save.remote(3) for w in ranks["actor"]]
    with pytest.raises(CheckpointWriteError, match="failed to save step 2"):
        ray.get(critic.save.remote(3))
    try:
        coordinator.save_driver_state(3, {"step": 3})
    except CheckpointError as exc:  # the step may have failed already: then it is refused
        assert "step 3" in str(exc) and "saved once" in str(exc)
    with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[plan\] .*step 2"):
        coordinator.wait_for_commit(3, timeout_s=10)
    # The actors' saves of step 3 wrote it, or were refused once it had failed (raised by
    # save() or by the next wait()): either way they learn that step 3 will not commit.
    for saved, rank in zip(actors, ranks["actor"], strict=True):
        for outcome in (saved, rank.wait.remote()):
            try:
                ray.get(outcome)
            except CheckpointError as exc:
                assert "step 3" in str(exc) and "failed" in str(exc)
    save_everyone(ranks, coordinator, 4)
    coordinator.wait_for_commit(4)
    assert read_tracker(cfg["root_dir"]) == 4
    close_all(ranks, coordinator)


def test_I5_a_save_refused_because_its_step_already_failed_does_not_fail_the_next_step(
    ranks, tmp_path
):
    """The critic's write of step 2 fails before the actors save it: their begin_step (on the
    save thread, their plans being cached) is refused, step 2 having failed. That refusal
    was kept as the actors' own write failure and raised by their save(3) instead of saving
    step 3, so step 3 failed for everyone too. In CI this happened by timing alone (the
    critic's failure reached the finalizer before an actor's begin_step). Now the refused
    save ends quietly (step 2's failure is the driver's to see, and the save's stats say
    it), and only the critic's own failure is raised to it."""
    critic = ranks["critic"][0]
    cfg, coordinator = critic_fails_step_2(
        ranks, tmp_path, lambda coordinator: ray.get(critic.save.remote(2))
    )
    refused = ray.get([w.save.remote(2) for w in ranks["actor"]])
    assert all(s["plan_reused"] for s in refused)  # begin_step ran on the save thread
    done = [ray.get(w.wait.remote()) for w in ranks["actor"]]
    assert all("step 2" in s[-1]["error"] and "failed" in s[-1]["error"] for s in done)
    with pytest.raises(CheckpointWriteError, match="failed to save step 2"):
        ray.get(critic.save.remote(3))  # the critic's own write failure, raised once
    save_everyone(ranks, coordinator, 4)
    coordinator.wait_for_commit(4)
    assert read_tracker(cfg["root_dir"]) == 4
    close_all(ranks, coordinator)


@pytest.mark.parametrize("write_while_copying", [False, True])
def test_I4_I5_a_copy_that_fails_after_the_save_thread_took_the_save_over_fails_the_step_at_once(
    ranks, tmp_path, write_while_copying
):
    """With a cached plan, the save thread takes a save over before save() copies: it plans,
    then writes once the copy ended, or (writer.write_while_copying) each tensor once its
    copy ended (copy_progress.py). The critic's copy of step 2 fails (injected, before its
    first tensor): its save() raises it, its writes, waiting for that copy, write nothing it
    did not fill, the step fails at once naming the critic's stage, and step 3, reusing the
    same staging buffers, commits and loads the state it saved."""
    cfg = ckpt_config(tmp_path, writer={"write_while_copying": write_while_copying})
    coordinator = open_with_step_1_committed(ranks, cfg)
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, "stage:critic=raise"))
    try:
        others = [w.save.remote(2) for w in every_rank(ranks) if w is not critic]
        with pytest.raises(InjectedFault):
            ray.get(critic.save.remote(2))
    finally:
        ray.get(critic.set_env.remote(ENV_VAR, None))
    started = time.monotonic()
    with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[stage\].*copy"):
        coordinator.wait_for_commit(2, timeout_s=30)
    assert time.monotonic() - started < 20  # at once, not at the step's deadline (60 s)
    saved_or_refused(others, 2)
    for rank in every_rank(ranks):
        try:
            ray.get(rank.wait.remote())
        except CheckpointError as exc:  # the refusal or failure of step 2, raised once
            assert "step 2" in str(exc)
    before = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    stats = save_everyone(ranks, coordinator, 3, after="inplace")
    assert all(s["plan_reused"] for s in stats)  # written while copied, as step 2 was
    coordinator.wait_for_commit(3)
    ray.get([w.load.remote(3) for w in every_rank(ranks)])
    after = ray.get([w.state_copy.remote() for w in every_rank(ranks)])
    for b, a in zip(before, after, strict=True):
        assert all(torch.equal(b[key], a[key]) for key in b)
    close_all(ranks, coordinator)


def test_I5_a_save_whose_copy_failed_is_waited_for_while_its_save_thread_holds_the_buffers(
    ranks, tmp_path
):
    """The critic's copy of step 2 fails (injected) after the save thread took the save over
    and while that thread is slow to reach its write (`write:critic=sleep=3`): until it has
    reported the failure it holds the staging buffers. save(2) raised; an immediate save(3)
    must wait for it, as for any save in flight, and then save. Before the fix the failed
    save was in flight for nobody: save(3) raised "staging pool exhausted" (a step failed
    for a reason of our own making), and wait() returned while the save thread still ran."""
    cfg = ckpt_config(tmp_path, writer={"write_while_copying": True})
    coordinator = open_with_step_1_committed(ranks, cfg)
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, "stage:critic=raise,write:critic=sleep=3"))
    others = [w.save.remote(2) for w in every_rank(ranks) if w is not critic]
    with pytest.raises(InjectedFault):
        ray.get(critic.save.remote(2))
    ray.get(critic.set_env.remote(ENV_VAR, "write:critic=sleep=3"))
    third = ray.get(critic.save.remote(3))  # waits for step 2's save thread, then saves
    assert third["plan_reused"]
    ray.get(critic.set_env.remote(ENV_VAR, None))
    with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[stage\]"):
        coordinator.wait_for_commit(2, timeout_s=30)
    saved_or_refused(others, 2)
    ray.get([w.save.remote(3) for w in every_rank(ranks) if w is not critic])
    coordinator.save_driver_state(3, {"step": 3})
    coordinator.wait_for_commit(3)
    assert read_tracker(cfg["root_dir"]) == 3
    close_all(ranks, coordinator)


def test_I5_ctrl_c_during_a_first_save_frees_its_buffers_and_fails_the_step_at_once(
    ranks, tmp_path
):
    """Found by review: a KeyboardInterrupt (Ctrl-C in the trainer's terminal) inside save()
    on the training thread, during a save that plans there (the first one), left its staging
    slot taken and told the finalizer nothing: a trainer that caught it and saved again got
    "staging pool exhausted" at every later save, and the step waited out its deadline.
    The interrupt is injected (VERL_CKPT_FAULT `interrupt`, before the copy): a real SIGINT
    does not reach a call running in a Ray actor."""
    ctrl_c_in_the_critics_save(ranks, ckpt_config(tmp_path), "stage", r"critic rank 0 \[stage\]")


def ctrl_c_in_the_critics_save(ranks: dict, cfg: dict, phase: str, named: str) -> None:
    """The critic's save(1) interrupted in `phase` in a trainer that catches Ctrl-C: step 1
    fails at once, naming the critic (`named`), and step 2 commits."""
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, f"{phase}:critic=interrupt"))
    others = [w.save.remote(1) for w in ranks["actor"]]
    assert ray.get(critic.save_through_ctrl_c.remote(1)) == "KeyboardInterrupt"
    ray.get(critic.set_env.remote(ENV_VAR, None))
    with pytest.raises(StepNotCommittedError, match=named):
        coordinator.wait_for_commit(1, timeout_s=30)
    saved_or_refused(others, 1)
    save_everyone(ranks, coordinator, 2)
    coordinator.wait_for_commit(2, timeout_s=60)
    assert read_tracker(cfg["root_dir"]) == 2
    close_all(ranks, coordinator)


def test_I5_ctrl_c_during_a_synchronous_write_fails_the_step_at_once(ranks, tmp_path):
    """From the last review's leads: with synchronous saves (the `sync` preset: save()
    writes the rank's files itself, on the training thread), a KeyboardInterrupt during the
    write left save() before the rank's report, which only an `except Exception` sent: the
    step waited out its deadline and then named the critic as never reporting. Now the
    interrupted write is reported as the critic's failure (phase write) before the interrupt
    goes on, and the next step commits. Injected as the test above."""
    cfg = ckpt_config(tmp_path, async_save=False, writer={"mode": "inline"})
    ctrl_c_in_the_critics_save(ranks, cfg, "write", r"critic rank 0 \[write\] KeyboardInterrupt")


def test_I5_ctrl_c_in_the_drivers_save_fails_the_step_at_once(ray_local, tmp_path, monkeypatch):
    """From helper-54's review: a KeyboardInterrupt (Ctrl-C reaches the driver's main
    thread) while the driver wrote its state left save_driver_state without a report: a
    trainer that caught it waited for the step until its deadline, and the next step's
    begin behind it. Now the driver's failure is reported (phase write), then the
    interrupt goes on. Injected: a real SIGINT cannot be made to land inside the write."""
    from verl_ckpt.driver import coordinator as coordinator_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    try:
        monkeypatch.setattr(coordinator_module, "safe_state_bytes", interrupted)
        with pytest.raises(KeyboardInterrupt):
            coordinator.save_driver_state(1, {"step": 1})
        with pytest.raises(StepNotCommittedError, match=r"driver rank 0 \[write\] Keyboard"):
            coordinator.wait_for_commit(1, timeout_s=30)
    finally:
        coordinator.close()


def test_I5_a_save_still_queued_when_its_manager_closes_fails_its_step_at_once(ranks, tmp_path):
    """From helper-54's review: with max_in_flight=2, a close() whose drain timed out stopped
    the save thread, which cancelled the save queued behind the running one: that save
    never began, never reported, and its step waited out its deadline. Now it is reported
    as the critic's failure of the step when the manager closes. The running write is held
    by the fault hook (sleep), as a slow disk would hold it."""
    cfg = ckpt_config(tmp_path, max_in_flight=2)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, "write:critic=sleep=8"))
    for step in (1, 2):
        ray.get([w.save.remote(step) for w in every_rank(ranks)])
        coordinator.save_driver_state(step, {"step": step})
    with pytest.raises(ray.exceptions.RayTaskError, match="CommitTimeoutError"):
        ray.get(critic.close.remote(1.0))
    ray.get(critic.set_env.remote(ENV_VAR, None))
    with pytest.raises(StepNotCommittedError, match=r"step 2 .*critic rank 0 \[plan\]"):
        coordinator.wait_for_commit(2, timeout_s=30)
    close_all(ranks, coordinator)


def test_I5_a_report_that_fails_before_it_is_sent_fails_the_step_at_once(ranks, tmp_path):
    """From helper-54's review: a rank whose report failed before it left the rank (packing
    it, or the fault hook's `raise` here) returned the failure to its trainer but never told
    the finalizer, so the step waited out its deadline and then named the rank as never
    reporting. Now the rank reports its failure (phase report) in a call of its own."""
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    critic = ranks["critic"][0]
    ray.get(critic.set_env.remote(ENV_VAR, "report:critic=raise"))
    saved = [w.save.remote(1) for w in every_rank(ranks)]
    with pytest.raises(StepNotCommittedError, match=r"critic rank 0 \[report\] InjectedFault"):
        # The critic's failure may reach the finalizer before the driver's begin, which
        # the failed step then refuses, naming it: either call raises it.
        coordinator.save_driver_state(1, {"step": 1})
        coordinator.wait_for_commit(1, timeout_s=30)
    ray.get(critic.set_env.remote(ENV_VAR, None))
    saved_or_refused(saved, 1)
    with pytest.raises(CheckpointError, match=r"critic rank 0 \[report\]"):
        ray.get(critic.wait.remote())  # the critic's failure, raised to its trainer once
    save_everyone(ranks, coordinator, 2)
    coordinator.wait_for_commit(2, timeout_s=60)
    assert read_tracker(cfg["root_dir"]) == 2
    close_all(ranks, coordinator)


def test_I5_a_rank_failing_before_the_first_plan_leaves_no_peer_in_its_collective(ranks, tmp_path):
    """Found by CI (stop 62, in the test above): in a save that plans over the group (the
    first one), a rank whose begin_step was refused (the step had failed) or whose copy
    failed never joined the plan's gather on the trainer's group. Its peer, admitted, waited
    in that gather for the group's own timeout (minutes on gloo, longer on NCCL) and then
    raised a collective error instead of the step's failure. Now every rank states it is
    ready just before that collective, and the peer of a rank that failed ends at once with
    StepNotCommittedError naming it."""
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    peer, failing = ranks["actor"]
    # Fails once its peer began the step and is in the plan's gather (both were admitted).
    late_failure = "stage:actor:1=sleep=5,stage:actor:1=raise"
    ray.get(failing.set_env.remote(ENV_VAR, late_failure))
    critic_saved = ranks["critic"][0].save.remote(1)
    peer_saved = peer.save.remote(1)
    with pytest.raises(InjectedFault):
        ray.get(failing.save.remote(1))
    ray.get(failing.set_env.remote(ENV_VAR, None))
    # Withdrawn by rank 1 (or, on a loaded machine, refused at begin_step: the step failed).
    with pytest.raises(StepNotCommittedError, match=r"step 1\b"):
        ray.get(peer_saved, timeout=30)  # the old code: still in the gather
    ray.get(critic_saved)
    with pytest.raises(StepNotCommittedError, match=r"actor rank 1 \[stage\]"):
        coordinator.wait_for_commit(1, timeout_s=30)
    save_everyone(ranks, coordinator, 2)
    coordinator.wait_for_commit(2, timeout_s=60)
    assert read_tracker(cfg["root_dir"]) == 2
    close_all(ranks, coordinator)


@pytest.mark.parametrize("phase", ["commit", "tracker"])
def test_I1_I2_finalizer_killed_around_the_tracker(ranks, tmp_path, phase):
    """Killed after every report arrived but before the commit record (the step is lost),
    or between the tracker's temporary file and its rename (the step is committed and the
    restarted finalizer completes it). The tracker is never garbage."""
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0}
    marker = tmp_path / "disarmed"
    coordinator = faulty_coordinator(cfg, ROLES, f"{phase}=exit", marker)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    marker.unlink()  # arm: the finalizer exits at this phase of step 2's commit
    save_everyone(ranks, coordinator, 2)
    root = Path(cfg["root_dir"])
    # A committed step holds exactly its record's files: the run marker went with its commit.
    assert not (step_dir(root, 1) / RUN_MARKER_FILENAME).exists()
    if phase == "commit":
        # Found by review: the run marker went before the record was written, so the
        # restarted finalizer (run id and all, as start_finalizer starts it) took step 2 for
        # an earlier job's leftover; the wait then ran to its deadline naming every rank.
        with pytest.raises(StepNotCommittedError, match="lost"):
            coordinator.wait_for_commit(2, timeout_s=30)
        assert read_tracker(root) == 1
        assert not is_committed(step_dir(root, 2))
    else:
        deadline = time.monotonic() + 30
        while read_tracker(root) != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_tracker(root) == 2 and is_committed(step_dir(root, 2))
        # The fault recreates the marker as it fires: the finalizer did die at that point.
        assert marker.exists(), "the finalizer never reached the tracker's rename"
    assert not list(root.glob(".latest_checkpointed_iteration.txt.tmp.*"))
    for w in every_rank(ranks):
        try:
            ray.get(w.wait.remote())
        except CheckpointWriteError as exc:
            # The last report was in flight when the finalizer died: Ray retried it on the
            # restarted finalizer, which refuses it. Reported once, clearly.
            assert phase == "commit" and "finalizer restarted" in str(exc)
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    assert read_tracker(root) == 3
    close_all(ranks, coordinator)


def test_a_save_does_not_wait_for_the_retention_of_an_earlier_step(ranks, tmp_path):
    """The trainer waits for its snapshot only: a save whose plan is reused hands begin_step
    (which waits while an earlier step's retention deletes, back-pressure) to the save
    thread. Before, save() blocked until the deletion of the step before had ended."""
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 60.0, "max_ckpt_to_keep": 1}
    marker = tmp_path / "disarmed"
    coordinator = faulty_coordinator(cfg, ROLES, "delete=sleep=8", marker)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    marker.unlink()  # arm: the deletion of step 1 after step 2's commit takes 8 s
    save_everyone(ranks, coordinator, 2)
    coordinator.wait_for_commit(2)
    root = Path(cfg["root_dir"])
    doomed = root / ".deleting_global_step_1"
    wait_for_file(marker)
    assert marker.exists() and doomed.exists(), "retention of step 1 never started"
    stats = ray.get([w.save.remote(3) for w in every_rank(ranks)])
    # Every rank's save() returned while step 1 was still being deleted, before step 3 began.
    # (The driver's own small save, below, still waits for room synchronously.)
    assert doomed.exists()
    assert all(s["plan_reused"] and s["begin_s"] is None for s in stats)
    coordinator.save_driver_state(3, {"step": 3})
    coordinator.wait_for_commit(3)
    assert read_tracker(root) == 3
    done = [s for w in every_rank(ranks) for s in ray.get(w.wait.remote()) if s["step"] == 3]
    assert all(s["begin_s"] > 0 for s in done)  # begun on the save thread, after the wait
    close_all(ranks, coordinator)


def test_I3_finalizer_killed_mid_deletion_leaves_nothing_loadable_and_resumes(ranks, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0, "max_ckpt_to_keep": 1}
    marker = tmp_path / "disarmed"
    coordinator = faulty_coordinator(cfg, ROLES, "delete=exit", marker)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    marker.unlink()  # arm: the finalizer dies while deleting step 1 after step 2 committed
    save_everyone(ranks, coordinator, 2)
    root = Path(cfg["root_dir"])
    # The fault recreates the marker as it fires, after the rename out of the step namespace
    # and before the recursive delete: waiting for it (not for the tracker, which moves
    # before retention starts) proves the finalizer really died mid-deletion.
    wait_for_file(marker)
    assert marker.exists(), "the finalizer never reached the deletion of step 1"
    assert read_tracker(root) == 2
    # Step 1 left the step namespace at once. The restarted finalizer deletes nothing at
    # start; the retention after the next commit finishes the .deleting_ leftover.
    assert 1 not in list_step_dirs(root)
    coordinator.status()  # the restarted finalizer is up
    assert [p.name for p in root.glob(".deleting_*")] == [".deleting_global_step_1"]
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    # Retention runs after the commit is announced: the leftover's deletion first, then step
    # 2's. Waiting only until no .deleting_ entry is left could end between the two.
    coordinator.drain()
    assert not list(root.glob(".deleting_*"))
    assert sorted(list_step_dirs(root)) == [3]
    close_all(ranks, coordinator)


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem of its own (tmpfs), unmounted afterwards."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], check=True)
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_I1_I3_disk_full_during_shard_write_keeps_previous_step_and_frees_the_failed_one(
    ranks, small_disk
):
    """A real full disk fails step 2; step 1 stays committed and loadable. The bytes step 2's
    ranks did write stayed on the disk for ever (no retention deletes an uncommitted step):
    now the finalizer deletes the failed step's directory once every rank reported."""
    cfg = {"root_dir": str(small_disk / "ckpt"), "timeout_s": 30.0}
    coordinator = open_with_step_1_committed(ranks, cfg)
    ray.get([w.wait.remote() for w in every_rank(ranks)])
    # Fill the disk: what is left is less than one step.
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "ballast").write_bytes(b"\0" * (free - 64 * 1024))
    ray.get([w.save.remote(2) for w in every_rank(ranks)])
    try:
        coordinator.save_driver_state(2, {"step": 2})
    except CheckpointError as exc:
        # The driver's small write races the ranks' background writes for the last bytes:
        # if it loses, it fails naming the cause. A rank's failure may also reach the
        # finalizer before the driver begins the step, which is then refused, naming that
        # rank's failure. Either way the step does not commit.
        message = str(exc)
        assert "No space left" in message, message
        assert (
            "driver state of step 2 not saved" in message
            or "failed and a step number is saved once" in message
        ), message
    with pytest.raises(StepNotCommittedError, match="No space left on device"):
        coordinator.wait_for_commit(2)
    for w in every_rank(ranks):
        try:
            ray.get(w.wait.remote())
        except CheckpointWriteError as exc:
            assert "No space left on device" in str(exc)
    root = Path(cfg["root_dir"])
    assert read_tracker(root) == 1
    assert verify_files(step_dir(root, 1), read_commit_record(step_dir(root, 1))) == []
    # Every rank reported (wait() returned): nobody writes into step 2 any more.
    deadline = time.monotonic() + 30
    while step_dir(root, 2).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not step_dir(root, 2).exists(), "the failed step's directory is still there"
    assert not list(root.glob(".deleting_*"))
    # Space freed: the next save commits.
    (small_disk / "ballast").unlink()
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    assert read_tracker(root) == 3
    close_all(ranks, coordinator)


def test_I1_I2_disk_full_during_tracker_write_uncommits_the_step(ranks, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0}
    marker = tmp_path / "disarmed"
    coordinator = faulty_coordinator(cfg, ROLES, "tracker=enospc", marker)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    marker.unlink()
    save_everyone(ranks, coordinator, 2)
    with pytest.raises(StepNotCommittedError, match="No space left on device"):
        coordinator.wait_for_commit(2)
    root = Path(cfg["root_dir"])
    assert read_tracker(root) == 1
    assert not is_committed(step_dir(root, 2))
    save_everyone(ranks, coordinator, 3)
    coordinator.wait_for_commit(3)
    assert read_tracker(root) == 3
    close_all(ranks, coordinator)


def test_I3_back_to_back_saves_with_keep_1_never_leave_zero_or_too_many_steps(ranks, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0, "max_ckpt_to_keep": 1}
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    root = Path(cfg["root_dir"])
    violations, seen_commit, stop = [], threading.Event(), threading.Event()

    def watch():
        while not stop.is_set():
            steps = list_step_dirs(root)
            committed = [s for s, p in steps.items() if is_committed(p)]
            if len(steps) > 1 + 1:  # keep + max_in_flight
                violations.append(f"{len(steps)} step directories: {sorted(steps)}")
            if committed:
                seen_commit.set()
            elif seen_commit.is_set() and read_tracker(root) is not None:
                # The listing may interleave with a deletion: confirm from the tracker.
                if not is_committed(step_dir(root, read_tracker(root))):
                    violations.append(f"no committed step, listing {sorted(steps)}")
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 9):
            save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(8)
        coordinator.drain()  # retention after step 8's commit
    finally:
        stop.set()
        watcher.join()
    assert violations == []
    assert sorted(list_step_dirs(root)) == [8]
    close_all(ranks, coordinator)


def test_ranks_that_disagree_on_the_step_fail_before_writing(ranks, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0}
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    first, second = ranks["actor"]
    refs = [first.save.remote(5), second.save.remote(6)]
    for ref in refs:
        with pytest.raises(CheckpointError, match="disagree on what to save.*step 5.*step 6"):
            ray.get(ref)
    assert list_step_dirs(cfg["root_dir"]) == {}
    close_all(ranks, coordinator)


def test_I1_corrupt_shard_is_caught_before_any_state_is_touched(ranks, tmp_path):
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0, "verify_checksums_on_load": True}
    coordinator = open_with_step_1_committed(ranks, cfg)
    shard = step_dir(cfg["root_dir"], 1) / "critic" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    critic = ranks["critic"][0]
    ray.get(critic.train.remote(1))
    before = ray.get(critic.state_copy.remote())
    with pytest.raises(CommitRecordError, match=r"__0_0\.distcp: checksum"):
        ray.get(critic.load.remote(1))
    after = ray.get(critic.state_copy.remote())
    assert all(torch.equal(before[k], after[k]) for k in before)
    close_all(ranks, coordinator)


def test_resume_with_another_world_size_reshards_model_and_refuses_extra(ranks, tmp_path):
    """The actor saved at TP=2 over 2 ranks; a 1-rank TP=1 world loads it: megatron-core
    reshards model and optimizer, while per-rank extra state is refused before loading."""
    cfg = {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 30.0}
    coordinator = open_with_step_1_committed(ranks, cfg)
    ray.get([w.close.remote() for w in every_rank(ranks)])
    (loader,) = start_world("actor", 1, tp=1)
    try:
        ray.get(loader.open_manager.remote(cfg))
        with pytest.raises(CheckpointError, match="saved with 2 ranks, loading with 1"):
            ray.get(loader.load.remote(1))
        model_only = {**cfg, "load_contents": ["model", "optimizer"]}
        ray.get(loader.open_manager.remote(model_only))
        ray.get(loader.load_model_and_optimizer.remote(1))
        losses = ray.get(loader.train.remote(1))
        assert losses[0] == losses[0]  # a finite loss: the resharded model trains
        ray.get(loader.close.remote())
    finally:
        ray.kill(loader)
    coordinator.close()


def test_rank_with_another_root_fails_at_start_before_writing(ranks, tmp_path):
    """A rank configured with another root than the driver finds no finalizer for it and
    fails at start-up, naming that root, before any save."""
    coordinator = CheckpointCoordinator({"root_dir": str(tmp_path / "ckpt")}, ROLES)
    critic = ranks["critic"][0]
    elsewhere = {"root_dir": str(tmp_path / "elsewhere"), "timeout_s": 2.0}
    with pytest.raises(CommitTimeoutError, match=r"no finalizer for checkpoint root .*elsewhere"):
        ray.get(critic.open_manager.remote(elsewhere))
    assert not (tmp_path / "elsewhere").exists()
    coordinator.close()
