"""The save group's agreement off the training thread (verl_ckpt/rank/agreement.py), on real
Megatron ranks in Ray actors: a rank whose plan is cached states so and goes on at once, and
its save thread checks the outcome before anything is written (invariants I4, I5: no save
waits for a peer without a deadline, and no rank is left in a collective the others never
join)."""

from __future__ import annotations

import signal

import psutil
import pytest
import ray
from megatron.core.dist_checkpointing.core import CheckpointingException

from tests.conftest import ROLES
from tests.helpers import ckpt_config, close_all, open_all, save_everyone
from verl_ckpt import (
    CheckpointCoordinator,
    CheckpointError,
    CheckpointWriteError,
    CommitTimeoutError,
    StepNotCommittedError,
    read_tracker,
)
from verl_ckpt.protocol.faults import ENV_VAR

# A bound on calls that must return at once, far above what they take: before the change,
# a rank that went ahead waited in the agreement for its peer until checkpoint.timeout_s.
RETURNS_WITHIN_S = 20.0


def _step_one_committed(ranks: dict, tmp_path, **config) -> tuple[dict, CheckpointCoordinator]:
    """Open every rank and commit step 1: its save plans over the group, so that from step 2
    on each rank's plan is cached and its save goes ahead."""
    cfg = ckpt_config(tmp_path, **config)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    return cfg, coordinator


def _opened(ranks: dict, tmp_path, **config) -> tuple[dict, CheckpointCoordinator]:
    """Every rank opened on the test's own root (a one-minute deadline), nothing saved yet:
    the first save plans over the group."""
    cfg = ckpt_config(tmp_path, **config)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    return cfg, coordinator


def _then_every_rank_commits(ranks: dict, cfg: dict, coordinator, step: int) -> None:
    """`step`, saved by every rank, commits and the tracker names it (the agreement's
    statements still pair up); then everything is closed."""
    save_everyone(ranks, coordinator, step)
    coordinator.wait_for_commit(step)
    assert read_tracker(cfg["root_dir"]) == step
    close_all(ranks, coordinator)


def _fail_the_write_of_step_2_on(rank, ranks: dict, coordinator) -> None:
    """Everyone saves step 2; `rank`'s write fails (a full disk at that moment, injected), so
    the step fails naming actor rank 1, and the failure waits to be raised by its next save."""
    ray.get(rank.set_env.remote(ENV_VAR, "write:actor:1=enospc"))
    save_everyone(ranks, coordinator, 2)
    with pytest.raises(StepNotCommittedError, match="actor rank 1"):
        coordinator.wait_for_commit(2)
    ray.get(rank.set_env.remote(ENV_VAR, None))


def test_I5_a_save_on_a_cached_plan_returns_before_its_peer_arrives(ranks, tmp_path):
    cfg, coordinator = _step_one_committed(ranks, tmp_path)
    first, second = ranks["actor"]
    alone = ray.get(first.save.remote(2), timeout=RETURNS_WITHIN_S)
    assert alone["plan_reused"]
    ray.get([second.save.remote(2), ranks["critic"][0].save.remote(2)])
    coordinator.save_driver_state(2, {"step": 2})
    coordinator.wait_for_commit(2)
    assert read_tracker(cfg["root_dir"]) == 2
    done = [s for s in ray.get(first.wait.remote()) if s["step"] == 2]
    assert done and done[0]["agree_s"] is not None  # the save thread waited for the peer
    close_all(ranks, coordinator)


def test_I5_a_peer_that_never_saves_fails_the_save_that_went_ahead_naming_it(ranks, tmp_path):
    cfg, coordinator = _step_one_committed(ranks, tmp_path, timeout_s=4.0)
    first = ranks["actor"][0]
    ray.get(first.save.remote(2), timeout=RETURNS_WITHIN_S)
    # gloo's monitored barrier names rank 1 of the save group, which never called save(2).
    with pytest.raises(CheckpointWriteError, match=r"(?s)not every rank.*save\(2\).*\b1\b"):
        ray.get(first.wait.remote(30.0))  # the agreement's own deadline (4 s) fails it first
    with pytest.raises(StepNotCommittedError, match="not every rank"):
        coordinator.wait_for_commit(2)
    assert read_tracker(cfg["root_dir"]) == 1
    close_all(ranks, coordinator)


def test_a_structure_change_on_one_rank_only_fails_every_rank_at_once(ranks, tmp_path):
    cfg, coordinator = _step_one_committed(ranks, tmp_path)
    first, second = ranks["actor"]
    # Rank 1 saves another structure (one more tensor); rank 0 goes ahead on its cached
    # plan. Rank 1 must not enter a planning collective that rank 0 will never join.
    ahead, changed = first.save.remote(2), second.save_another_structure.remote(2)
    ray.get(ahead, timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointError, match=r"changed on ranks \[1\] but not on ranks \[0\]"):
        ray.get(changed, timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointWriteError, match=r"changed on ranks \[1\]"):
        ray.get(first.wait.remote())
    assert read_tracker(cfg["root_dir"]) == 1
    close_all(ranks, coordinator)


def test_a_sharding_refused_on_rank_0_only_ends_its_peers_save_at_once(ranks, tmp_path):
    """Found by review: megatron-core's sharding check gathers on rank 0, and only rank 0
    raises. Its peer went on to begin the step, copy, and state that it was ready to plan,
    then waited for rank 0's statement until the agreement's deadline (or, refused by
    begin_step, stated its withdrawal): either way one statement ahead of rank 0's, so rank
    0's next save paired with this one and failed a step nobody failed. Now a rank owes that
    statement from the agreement's verdict on, and rank 0 withdraws."""
    cfg, coordinator = _opened(ranks, tmp_path)  # the old code's peer waits out its minute
    first, second = ranks["actor"]
    # A first save in which both ranks claim the whole of one more tensor as its main
    # replica: rank 0, which gathers the shardings, refuses it.
    refused, peer = first.save_another_structure.remote(1), second.save_another_structure.remote(1)
    with pytest.raises(CheckpointingException, match="Invalid access pattern"):
        ray.get(refused, timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointError, match="step 1"):  # withdrawn, or refused at begin_step
        ray.get(peer, timeout=RETURNS_WITHIN_S)
    with pytest.raises(StepNotCommittedError, match="actor rank 0"):
        coordinator.wait_for_commit(1)
    _then_every_rank_commits(ranks, cfg, coordinator, 2)


def test_a_plan_that_failed_on_one_rank_after_its_gather_costs_one_more_step_only(ranks, tmp_path):
    """Found by review: a plan over the group that fails on one rank after its gather (the
    fault is injected: RankWorker.fail_the_next_plan_after_its_gather) left the peer with a
    cached plan and that rank with none. At every later save the peer went ahead and that
    rank did not, and each failed as a structure changed on one rank only, until the
    processes restarted. Now the mixed verdict drops the cache on every rank: the next save
    plans over the group again, and commits."""
    cfg, coordinator = _opened(ranks, tmp_path)
    first, second = ranks["actor"]
    ray.get(second.fail_the_next_plan_after_its_gather.remote())
    planned, failed = first.save.remote(1), second.save.remote(1)
    with pytest.raises(MemoryError, match="after the plan's gather"):
        ray.get(failed, timeout=RETURNS_WITHIN_S)
    ray.get(planned, timeout=RETURNS_WITHIN_S)
    with pytest.raises(StepNotCommittedError, match="actor rank 1"):
        coordinator.wait_for_commit(1)
    ahead, behind = first.save.remote(2), second.save.remote(2)
    ray.get(ahead, timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointError, match=r"changed on ranks \[1\] but not on ranks \[0\]"):
        ray.get(behind, timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointWriteError, match=r"changed on ranks \[1\]"):
        ray.get(first.wait.remote())
    _then_every_rank_commits(ranks, cfg, coordinator, 3)


def test_a_plan_that_fails_in_its_local_conversion_on_one_rank_ends_its_peers_save_at_once(
    ranks, tmp_path
):
    """Found by review: a rank stated it was ready to plan before its local conversion, which
    may fail on one rank only (the fault is injected: RankWorker.fail_the_next_conversion).
    Its peer, told all were ready, waited in the plan's gather for the trainer group's
    timeout. Now the statement comes after the conversion, and the failing rank withdraws."""
    cfg, coordinator = _opened(ranks, tmp_path)
    first, second = ranks["actor"]
    ray.get(second.fail_the_next_conversion.remote())
    peer, failed = first.save.remote(1), second.save.remote(1)
    with pytest.raises(ValueError, match="local conversion"):
        ray.get(failed, timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointError, match="step 1"):  # withdrawn, or refused at begin_step
        ray.get(peer, timeout=RETURNS_WITHIN_S)  # the old code: still in the gather
    with pytest.raises(StepNotCommittedError, match="actor rank 1"):
        coordinator.wait_for_commit(1)
    _then_every_rank_commits(ranks, cfg, coordinator, 2)


def test_a_prepare_that_fails_on_one_rank_before_its_statement_ends_its_peers_at_once(
    ranks, tmp_path
):
    """Found by review: prepare() lacked save()'s rule for a rank that fails before it states
    anything (here a trainer's mistake: no optimizer given). Its peer waited in the agreement
    until the deadline; and a trainer going on to save(1) paired that save's statement with
    its peer's of prepare(). Now the rank states that it withdraws: its peer stops at once,
    naming it, and the first save commits."""
    cfg, coordinator = _opened(ranks, tmp_path)  # the old code's peer waits out its minute
    first, second = ranks["actor"]
    waiting = first.prepare.remote()
    with pytest.raises(CheckpointError, match="save_contents includes 'optimizer'"):
        ray.get(second.prepare.remote(without_optimizer=True), timeout=RETURNS_WITHIN_S)
    with pytest.raises(CheckpointError, match=r"prepare\(\) stopped: rank\(s\) \[1\]"):
        ray.get(waiting, timeout=RETURNS_WITHIN_S)
    _then_every_rank_commits(ranks, cfg, coordinator, 1)


def test_a_save_that_fails_inside_save_on_one_rank_leaves_the_next_step_to_every_rank(
    ranks, tmp_path
):
    # Rank 0 goes ahead on its cached plan, and its save() fails after the layout (its extra
    # state holds a lock, which cannot be copied). Its peer went ahead too and waits for rank
    # 0's statement in a collective: the statement must still be made, or the agreement of
    # the next step would pair with this one and fail a step nobody failed.
    cfg, coordinator = _step_one_committed(ranks, tmp_path, timeout_s=20.0)
    first, second = ranks["actor"]
    broken, ahead = first.save_uncopyable_extra.remote(2), second.save.remote(2)
    with pytest.raises(TypeError, match="lock"):
        ray.get(broken, timeout=RETURNS_WITHIN_S)
    assert ray.get(ahead, timeout=RETURNS_WITHIN_S)["plan_reused"]
    ray.get(ranks["critic"][0].save.remote(2))
    with pytest.raises(StepNotCommittedError, match="actor rank 0"):
        coordinator.wait_for_commit(2)
    _then_every_rank_commits(ranks, cfg, coordinator, 3)


def test_a_save_that_raises_an_earlier_failure_on_one_rank_leaves_the_next_steps_to_every_rank(
    ranks, tmp_path
):
    """Rank 1's write of step 2 fails (a full disk at that moment, injected), so its save(3)
    raises that failure before it states anything to its group (save() raises an earlier
    failure once, instead of saving). Its peer went ahead on step 3 and waits for rank 1's
    statement in a collective. Rank 1 must still state that it does not save step 3: before
    the fix its statement of step 4 paired with its peer's of step 3, both failed, each rank's
    next save() raised that failure in turn, and no later step of the role ever committed."""
    cfg, coordinator = _step_one_committed(ranks, tmp_path, timeout_s=20.0)
    first, second = ranks["actor"]
    _fail_the_write_of_step_2_on(second, ranks, coordinator)
    ahead = first.save.remote(3)
    with pytest.raises(CheckpointWriteError, match=r"step 2.*No space left"):
        ray.get(second.save.remote(3), timeout=RETURNS_WITHIN_S)
    assert ray.get(ahead, timeout=RETURNS_WITHIN_S)["plan_reused"]
    ray.get(ranks["critic"][0].save.remote(3))
    with pytest.raises(StepNotCommittedError, match="actor rank 1"):
        coordinator.wait_for_commit(3)
    for step in (4, 5):
        save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(step)
    assert read_tracker(cfg["root_dir"]) == 5
    # Rank 0's step 3 was not its failure: no save() of rank 0 raised it.
    errors = {s["step"]: s["error"] for s in ray.get(first.wait.remote()) if s.get("error")}
    # Its step 2 too may have ended in error, never its own failure either: its begin is
    # refused when rank 1's failure of the step reached the finalizer first (a race the
    # fresh-clone suite hit).
    assert set(errors) - {2} == {3}
    assert 2 not in errors or "failed and a step number is saved once" in errors[2]
    close_all(ranks, coordinator)


def test_I5_a_close_that_leaves_an_agreement_waiting_for_a_peer_names_it(ranks, tmp_path):
    """Found by review: rank 1's save(3) raises an earlier failure and still states, on its
    agreement thread, that it does not save step 3; its peer never saves step 3, so that
    statement waits in the group's collective (up to timeout_s). close() then returned as if
    everything had stopped, though its docstring and I5 say it names what did not stop."""
    cfg, coordinator = _step_one_committed(ranks, tmp_path, timeout_s=20.0)
    first, second = ranks["actor"]
    _fail_the_write_of_step_2_on(second, ranks, coordinator)
    with pytest.raises(CheckpointWriteError, match=r"step 2.*No space left"):
        ray.get(second.save.remote(3), timeout=RETURNS_WITHIN_S)
    with pytest.raises(CommitTimeoutError, match="agreement") as stuck:
        ray.get(second.close.remote(1.0), timeout=RETURNS_WITHIN_S)
    assert "still running" in str(stuck.value), stuck.value
    ray.get([first.close.remote(), ranks["critic"][0].close.remote()])
    coordinator.close()


def test_I5_a_close_past_its_deadline_leaves_no_writer_process_behind(ranks, tmp_path):
    """writer.mode=process. Actor rank 0's save(2) goes ahead and waits for its peer; its
    close() ends at its deadline with the save in flight, and stops the writer process. When
    the peer then saves step 2, rank 0's save thread goes on to its write: before the fix it
    spawned a new writer process, which wrote, committed the step and then stayed, idle, for
    the life of the rank (nothing could close it: its manager was closed). Now that write
    fails, naming the closed writer, and no process is left."""
    cfg, coordinator = _step_one_committed(ranks, tmp_path, writer={"mode": "process"})
    first, second = ranks["actor"]
    ray.get(first.save.remote(2), timeout=RETURNS_WITHIN_S)
    with pytest.raises(CommitTimeoutError, match=r"steps \[2\] not finished"):
        ray.get(first.close.remote(2.0))
    ray.get([second.save.remote(2), ranks["critic"][0].save.remote(2)])
    with pytest.raises(StepNotCommittedError, match=r"actor rank 0.*writer .*closed"):
        # Rank 0's failed write may reach the finalizer before the driver's begin, which the
        # failed step then refuses, naming it (seen in a suite run): either call raises it.
        coordinator.save_driver_state(2, {"step": 2})
        coordinator.wait_for_commit(2)
    children = ray.get(first.process_info.remote())["children"]
    assert [cmd for _, cmd in children if "resource_tracker" not in cmd] == []
    assert read_tracker(cfg["root_dir"]) == 1
    close_all(ranks, coordinator)


def test_I5_managers_opened_in_turn_add_no_gloo_event_loop_each(ranks, tmp_path):
    """Each manager keeps its agreement group until its process exits (gloo_group.py). Made
    with torch's new_group, each group brought its own gloo device: an event-loop thread
    waking every few ms, plus two workers, 3 threads and ~0.15% of a core idle each, for the
    life of the process (a test suite's ranks open dozens). Now every group of a process
    shares the same device: a group adds at most its one sleeping worker thread."""
    actor = ranks["actor"]
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, ROLES)  # a manager opens only beside one

    def reopen() -> list[int]:
        ray.get([w.open_manager.remote(cfg) for w in actor])  # closes the one open before
        return ray.get([w.threads_once_agreement_formed.remote() for w in actor])

    before = reopen()
    reopened = 4
    for _ in range(reopened):
        after = reopen()
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert all(g <= reopened for g in grown), grown  # before the change: 3 per manager
    ray.get([w.close.remote() for w in actor])
    coordinator.close()


def test_a_manager_opened_after_the_worlds_store_died_fails_at_once_naming_it(ray_local, tmp_path):
    """The world's store lives in rank 0's process (as the recipe's and torchrun's do).
    Opening a manager counts its agreement group in that store; with rank 0's process
    killed (for real), rank 1's open used to raise torch's DistNetworkError ("Failed to recv,
    got 0 bytes"), naming neither the store nor the rank, and left the writer threads and
    save thread it had started. Now: at once, one line naming both, nothing left running."""
    from tests.rank_worker import start_world

    workers = start_world("orphan", 2, tp=2)
    cfg = ckpt_config(tmp_path)
    coordinator = CheckpointCoordinator(cfg, {"orphan": 2}, save_driver_state=False)
    try:
        port = ray.get(workers[0].store_port.remote())
        host = psutil.Process(ray.get(workers[0].pid.remote()))
        host.send_signal(signal.SIGKILL)
        host.wait(timeout=RETURNS_WITHIN_S)
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            ray.get(workers[1].open_manager.remote(cfg), timeout=RETURNS_WITHIN_S)
        # The failed open started no thread it would leave behind (writers, save thread).
        assert ray.get(workers[1].manager_threads.remote()) == []
        message = str(failed.value.cause)
        assert isinstance(failed.value.cause, CheckpointError), message
        assert "\n" not in message, message
        assert message.startswith("orphan rank 1: cannot open the checkpoint manager"), message
        assert f"store at 127.0.0.1:{port} did not answer" in message, message
    finally:
        coordinator.close()
        for w in workers:
            ray.kill(w)


def test_a_ready_statement_pays_only_its_own_steps_debt():
    """Found by review: the save thread plans steps whose plan is cached while the training
    thread may already owe the next step's ready statement; ready_to_plan took whatever was
    owed, stating the next step's readiness before this rank had copied it. Bookkeeping only:
    the agreement is a recorder here (the pairing itself runs on real ranks above)."""
    from concurrent.futures import Future
    from pathlib import Path
    from types import SimpleNamespace

    from verl_ckpt.protocol.config import CheckpointConfig
    from verl_ckpt.rank.planner import StepPlanner

    made = []

    def start(statement):
        made.append((statement.step, statement.withdrawn))
        done: Future = Future()
        done.set_result([statement])
        return done

    agreement = SimpleNamespace(start=start, outcome=lambda pending: pending.result())
    link = SimpleNamespace(role="actor")
    planner = StepPlanner(CheckpointConfig(), None, Path("/nowhere"), agreement, link, True)
    planner._ready_owed = 2  # the training thread's next save planned over the group
    planner.ready_to_plan(1)  # the save thread's cached step 1
    assert made == []
    planner.ready_to_plan(2)
    planner.withdraw_from_plan()  # paid: nothing more
    assert made == [(2, False)]
