"""The PPO recipe's RL state committed with the model (issue 46, items 2-4): a finite prompt
set visited once per epoch, the data cursor at the trained frontier, `rollout.mode=async`
(rollout workers a step ahead of the trainer, each a participant "rollout" of the step),
and runs killed (the whole job, SIGKILL) and resumed that train exactly what an
uninterrupted run trains, step for step.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recipes.data import DataCursor, PromptSet
from recipes.ppo_config import RecipeConfigError, to_recipe_config
from recipes.weights import assemble_full_weights
from tests.test_job_kill import kill_session
from tests.test_recipe import COMPARED, Output, finish, read_metrics, recipe_env, start_recipe
from verl_ckpt import read_tracker, step_dir
from verl_ckpt.protocol.faults import ENV_VAR, ONCE_ENV_VAR
from verl_ckpt.store.commit_record import is_committed

# What a resumed step must repeat bit for bit.
EXACT = (*COMPARED, "prompt_ids", "policy_version")
# A tiny async job: 16 prompts, 8 a step (an epoch is 2 steps), one rollout worker holding
# a TP=1 copy of the TP=2 actor.
ASYNC = (
    "rollout.mode=async",
    "rollout.num_workers=1",
    "data.num_prompts=16",
    "rollout.batch_size=8",
    "checkpoint.save_freq=2",
    "checkpoint.timeout_s=60",
)
ASYNC_STEPS = 8


# ---- the prompt set and the cursor -------------------------------------------------------


def test_each_prompt_once_per_epoch_in_a_seeded_order_crossing_epochs():
    data = PromptSet(10, 4, 32, prompt_seed=3, seed=1)
    again = PromptSet(10, 4, 32, prompt_seed=3, seed=1)
    assert torch.equal(data.prompts, again.prompts)
    cursor, stream = DataCursor(), []
    for _ in range(5):  # 5 batches of 6 = 3 epochs
        ids, cursor = data.next_batch(cursor, 6)
        stream.extend(ids.tolist())
    for epoch in range(3):
        assert sorted(stream[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
        assert stream[epoch * 10 : (epoch + 1) * 10] == data.order(epoch).tolist()
    assert data.order(0).tolist() != data.order(1).tolist()
    # A cursor at an epoch's end is the next epoch's start (a resume there continues).
    assert cursor == DataCursor(3, 0)
    assert DataCursor.from_state(cursor.to_state()) == cursor
    # Any epoch's order is known without the ones before it.
    assert torch.equal(PromptSet(10, 4, 32, 3, 1).order(2), data.order(2))


def test_full_weights_are_assembled_from_tensor_parallel_shards():
    full = torch.arange(24.0).reshape(6, 4)
    shards = [
        [{"key": "w", "data": full[:3].clone(), "shape": (6, 4), "offset": (0, 0)}],
        [{"key": "w", "data": full[3:].clone(), "shape": (6, 4), "offset": (3, 0)}],
    ]
    assert torch.equal(assemble_full_weights(shards)["w"], full)
    with pytest.raises(RuntimeError, match="do not cover"):
        assemble_full_weights(shards[:1])


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"rollout": {"mode": "fast"}}, "rollout.mode"),
        ({"rollout": {"mode": "async", "num_workers": 3}}, "rollout.num_workers"),
        ({"rollout": {"num_workers": 0}}, "rollout.num_workers"),
        ({"rollout": {"replay_size": 4}}, "rollout.replay_size"),
        ({"data": {"num_prompts": 0}}, "data.num_prompts"),
    ],
)
def test_rollout_and_data_keys_are_checked_at_the_front_door(settings, key):
    with pytest.raises(RecipeConfigError, match=key.replace(".", r"\.")):
        to_recipe_config(OmegaConf.create(settings))


# ---- runs --------------------------------------------------------------------------------


def assert_same_steps(runs: list[dict[int, dict]], reference: dict[int, dict]) -> set[int]:
    """Every step any run trained equals the reference's, on every EXACT key; the steps."""
    seen = set()
    for metrics in runs:
        for step, record in metrics.items():
            assert {k: record[k] for k in EXACT} == {k: reference[step][k] for k in EXACT}, step
            seen.add(step)
    return seen


def assert_each_prompt_once_per_epoch(reference: dict[int, dict], num_prompts: int) -> None:
    stream = [i for step in sorted(reference) for i in reference[step]["prompt_ids"]]
    for start in range(0, len(stream) - num_prompts + 1, num_prompts):
        assert sorted(stream[start : start + num_prompts]) == list(range(num_prompts)), start


def run_to_end(out_dir: Path, root: Path, *overrides: str, env: dict | None = None) -> str:
    return finish(start_recipe(out_dir, f"checkpoint.root_dir={root}", *overrides, env=env))


def run_then_kill(
    out_dir: Path, root: Path, pattern: str, *overrides: str, env: dict | None = None
) -> str:
    """Start the job in a session of its own; SIGKILL all of it once `pattern` is printed."""
    proc = start_recipe(
        out_dir, f"checkpoint.root_dir={root}", *overrides, env=env, new_session=True
    )
    output = Output(proc)
    try:
        deadline = time.monotonic() + 400
        while re.search(pattern, output.text) is None:
            assert proc.poll() is None, f"exited before {pattern!r}:\n{output.text[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r}:\n{output.text[-3000:]}"
            time.sleep(0.1)
    finally:
        kill_session(proc.pid)
    return output.wait_exit(60)


@pytest.fixture(scope="module")
def async_reference_run(tmp_path_factory) -> Path:
    """An uninterrupted async run of ASYNC_STEPS steps: its directory (its root `ckpt/`,
    whose steps hold the rollout worker's state, and its `metrics.jsonl`)."""
    out = tmp_path_factory.mktemp("async_reference")
    run_to_end(out, out / "ckpt", *ASYNC, f"trainer.total_steps={ASYNC_STEPS}")
    return out


@pytest.fixture(scope="module")
def async_reference(async_reference_run) -> dict[int, dict]:
    """The uninterrupted async run's {step: metrics}."""
    return read_metrics(async_reference_run / "metrics.jsonl")


@pytest.mark.slow
def test_async_run_killed_and_resumed_trains_exactly_like_an_uninterrupted_one(
    tmp_path, async_reference
):
    """A run that stops at an epoch boundary (step 2) is resumed into the next epoch; that
    run is SIGKILLed (the whole job) once step 4's snapshot is taken, the next one while the
    rollout worker's first save hangs (its step cannot commit; the trainer, not waiting for
    it, trains on); the last one runs to the end. Every step any of
    them trained has the uninterrupted run's prompt ids, policy version (step-2: the batch
    of step s comes from the weights after update s-2), reward and losses, bit for bit;
    the uninterrupted run trains each prompt once per epoch."""
    ref = async_reference
    assert sorted(ref) == list(range(1, ASYNC_STEPS + 1))
    assert [ref[s]["policy_version"] for s in ref] == [max(s - 2, 0) for s in ref]
    assert_each_prompt_once_per_epoch(ref, 16)
    root = tmp_path / "ckpt"
    total = f"trainer.total_steps={ASYNC_STEPS}"

    run_to_end(tmp_path / "run1", root, *ASYNC, "trainer.total_steps=2")
    assert read_tracker(root) == 2
    out = run_then_kill(
        tmp_path / "run2", root, r"step 4: checkpoint snapshot taken", *ASYNC, total
    )
    assert f"resumed from {step_dir(root, 2)} (step 2)" in out
    assert "epoch 1, position 0 of 16 prompts" in out, "the epoch boundary did not continue"
    hang = recipe_env(**{ENV_VAR: "write:rollout:0=hang"})
    resumed = read_tracker(root)
    assert resumed in (2, 4), resumed
    # Two steps after the hung save (at the next save step, the finalizer's back-pressure
    # would hold the trainer until that save's deadline).
    after = rf"step {resumed + 3}/8"
    out = run_then_kill(tmp_path / "run3", root, after, *ASYNC, total, env=hang)
    assert f"resumed from {step_dir(root, resumed)} (step {resumed})" in out
    newest = read_tracker(root)
    assert newest == resumed and not is_committed(step_dir(root, resumed + 2)), newest
    out = run_to_end(tmp_path / "run4", root, *ASYNC, total)
    assert f"resumed from {step_dir(root, newest)} (step {newest})" in out
    runs = [read_metrics(tmp_path / f"run{i}" / "metrics.jsonl") for i in range(1, 5)]
    assert assert_same_steps(runs, ref) == set(ref)
    assert read_tracker(root) == ASYNC_STEPS


@pytest.mark.slow
def test_rollout_worker_killed_in_its_save_fails_that_step_and_the_next_commits(
    tmp_path, async_reference
):
    """The rollout worker's process exits while it writes its part of step 2: step 2 does
    not commit (named "rollout[0]"), the worker is respawned where it was and step 4
    commits; every step equals the uninterrupted run's, and so does a resume from step 4."""
    root = tmp_path / "ckpt"
    crash = recipe_env(
        **{ENV_VAR: "write:rollout:0=exit", ONCE_ENV_VAR: str(tmp_path / "crashed_once")}
    )
    out = run_to_end(tmp_path / "run1", root, *ASYNC, "trainer.total_steps=4", env=crash)
    assert "rollout worker 0 (rollout[0]) died" in out, out[-3000:]
    assert "rollout[0]" in out and not is_committed(step_dir(root, 2))
    # Failed at once by the respawned worker's skip, not at the step's deadline.
    assert "rollout[0] skipped: its predecessor died saving it" in out, out[-3000:]
    assert read_tracker(root) == 4
    out = run_to_end(tmp_path / "run2", root, *ASYNC, "trainer.total_steps=6")
    assert f"resumed from {step_dir(root, 4)} (step 4)" in out
    runs = [read_metrics(tmp_path / f"run{i}" / "metrics.jsonl") for i in (1, 2)]
    assert assert_same_steps(runs, async_reference) == set(range(1, 7))


def test_a_resume_that_would_drop_the_rollout_state_is_refused_before_ray(
    tmp_path, async_reference_run
):
    """A root whose newest step holds the rollout worker's state, resumed in sync mode (or
    with another worker count): one line naming the participant, exit status 2, before Ray
    starts, nothing changed (the coordinator refused it only after Ray had started, while
    the recipe had warned that the state would start afresh)."""
    # A copy of the uninterrupted async run's root (its newest step holds rollout[0]).
    root = Path(shutil.copytree(async_reference_run / "ckpt", tmp_path / "ckpt"))
    last = ASYNC_STEPS
    assert read_tracker(root) == last and (step_dir(root, last) / "rollout").is_dir()
    for overrides in (("rollout.mode=sync",), (*ASYNC, "rollout.num_workers=2")):
        proc = start_recipe(
            tmp_path / "run2",
            f"checkpoint.root_dir={root}",
            *overrides,
            f"trainer.total_steps={last + 2}",
        )
        output, _ = proc.communicate(timeout=120)
        errors = [line for line in output.splitlines() if line.startswith("ppo_toy:")]
        assert proc.returncode == 2, output[-3000:]
        assert len(errors) == 1 and "rollout" in errors[0], output[-3000:]
        assert "Traceback" not in output and "Ray" not in output, output[-3000:]
        assert read_tracker(root) == last and is_committed(step_dir(root, last))


@pytest.mark.slow
def test_sync_run_killed_and_resumed_trains_exactly_like_an_uninterrupted_one(
    tmp_path, uninterrupted
):
    """Sync mode (the default config): the job is SIGKILLed during step 5, after step 4
    committed, and resumed; every step equals the uninterrupted run's (policy version
    step-1), which trains each of the 256 prompts once per epoch."""
    ref = uninterrupted()
    assert [ref[s]["policy_version"] for s in sorted(ref)] == [s - 1 for s in sorted(ref)]
    assert_each_prompt_once_per_epoch(ref, 256)
    root = tmp_path / "ckpt"
    common = ("trainer.total_steps=10", "checkpoint.save_freq=2")
    run_then_kill(tmp_path / "run1", root, r"step 5/10", *common)
    newest = read_tracker(root)
    assert newest in (2, 4), newest
    out = run_to_end(tmp_path / "run2", root, *common)
    assert f"resumed from {step_dir(root, newest)} (step {newest})" in out
    runs = [read_metrics(tmp_path / f"run{i}" / "metrics.jsonl") for i in (1, 2)]
    assert assert_same_steps(runs, ref) == set(range(1, 11))


@pytest.mark.slow
def test_replay_buffer_is_saved_with_the_step_and_a_resume_reuses_the_same_sequences(tmp_path):
    """rollout.replay_size (sync mode, one actor rank): the replay buffer is a participant
    "replay" of each step; a run of 2 steps resumed to 4 reuses the same earlier sequences
    and trains the same as an uninterrupted 4-step run, bit for bit."""
    replay = (
        "data.num_prompts=12",
        "rollout.batch_size=8",
        "rollout.replay_size=8",
        "actor.world_size=1",
        "actor.tensor_parallel_size=1",
        "checkpoint.save_freq=2",
    )
    run_to_end(tmp_path / "ref", tmp_path / "ref_ckpt", *replay, "trainer.total_steps=4")
    root = tmp_path / "ckpt"
    run_to_end(tmp_path / "run1", root, *replay, "trainer.total_steps=2")
    assert (step_dir(root, 2) / "replay" / "state_0.pt").is_file()
    # From helper-58's review: resumed with another response length, the replayed sequences
    # (of the saved width) failed the first update after Ray started, with a traceback.
    proc = start_recipe(
        tmp_path / "wider",
        f"checkpoint.root_dir={root}",
        *replay,
        "rollout.response_length=12",
        "trainer.total_steps=4",
    )
    output, _ = proc.communicate(timeout=120)
    errors = [line for line in output.splitlines() if line.startswith("ppo_toy:")]
    assert proc.returncode == 2, output[-3000:]
    assert len(errors) == 1 and "rollout.response_length=8" in errors[0], output[-3000:]
    assert "Traceback" not in output and "Ray" not in output, output[-3000:]
    out = run_to_end(tmp_path / "run2", root, *replay, "trainer.total_steps=4")
    assert f"resumed from {step_dir(root, 2)} (step 2)" in out
    ref = read_metrics(tmp_path / "ref" / "metrics.jsonl")
    assert ref[1]["replay_prompt_ids"] == [] and len(ref[3]["replay_prompt_ids"]) == 8
    runs = [read_metrics(tmp_path / f"run{i}" / "metrics.jsonl") for i in (1, 2)]
    assert assert_same_steps(runs, ref) == {1, 2, 3, 4}
    for step in (3, 4):
        assert runs[1][step]["replay_prompt_ids"] == ref[step]["replay_prompt_ids"], step


@pytest.mark.slow
def test_a_replay_buffer_turned_on_at_a_resume_starts_empty(tmp_path, four_step_run):
    """Found by review: the start-up check allows a declared participant the resumed step
    lacks (it starts empty, docs/participants.md), but the recipe loaded the replay buffer
    from the step regardless, and the run exited after Ray started ("holds no state of
    participant replay[0]"). Resumed: a copy of the session's run of 4 steps, saved without
    a replay buffer."""
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    assert read_tracker(root) == 4 and not (step_dir(root, 4) / "replay").exists()
    out = run_to_end(
        tmp_path / "run2",
        root,
        "rollout.replay_size=32",  # the recipe's batch_size: each update reuses as many
        "checkpoint.save_freq=2",
        "trainer.total_steps=6",
    )
    assert "it holds no replay buffer; it starts empty" in out, out[-3000:]
    assert read_tracker(root) == 6 and (step_dir(root, 6) / "replay" / "state_0.pt").is_file()
