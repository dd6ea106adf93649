"""Verified resume with fallback on the real recipe's checkpoints (real megatron-core torch_dist
shards written by Megatron ranks in Ray actors): a flipped bit, a truncated shard and a
missing shard in the newest step. With `resume_fallback=error` the recipe refuses in one line
naming the file, before Ray starts; with `previous` it quarantines the step, resumes from the
older one and continues bit-exactly (invariants I1, I3, I4).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_recipe import COMPARED, Output, finish, read_metrics, start_recipe
from tests.test_recipe_trust import assert_refused_in_one_line, run_recipe
from verl_ckpt import prepare_start, read_tracker, step_dir
from verl_ckpt.startup.resume_check import QUARANTINE_DIRNAME
from verl_ckpt.store.layout import list_step_dirs

pytestmark = pytest.mark.slow

SHARD = "actor/__1_0.distcp"  # the second actor rank's first file: real tensor bytes


@pytest.fixture
def root(four_step_run, tmp_path) -> Path:
    return Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "mode"),
    [(flip_bit, "checksums"), (truncate, "record"), (remove, "record")],
    ids=["bit_flip", "truncated", "missing"],
)
def test_I1_a_damaged_real_shard_is_quarantined_and_start_up_falls_back(root, damage, mode):
    damage(step_dir(root, 4) / SHARD)
    plan = prepare_start(
        {"root_dir": str(root), "resume_verify": mode, "resume_fallback": "previous"}
    )
    plan.release()
    assert plan.resume_dir == step_dir(root, 2) and read_tracker(root) == 2
    (moved,) = (root / QUARANTINE_DIRNAME).iterdir()
    assert moved.name.startswith("global_step_4.") and (moved / "actor").is_dir()


def test_I1_I4_the_recipe_refuses_a_bit_flip_then_falls_back_and_continues_exactly(
    root, four_step_run, tmp_path
):
    damage = step_dir(root, 4) / SHARD
    flip_bit(damage)
    damaged_bytes = damage.read_bytes()
    checksums = (f"checkpoint.root_dir={root}", "checkpoint.resume_verify=checksums")
    refused = run_recipe(tmp_path, "trainer.total_steps=4", *checksums)
    assert_refused_in_one_line(refused, f"{damage}: checksum ")
    assert read_tracker(root) == 4 and not (root / QUARANTINE_DIRNAME).exists()

    out = finish(
        start_recipe(
            tmp_path / "resumed",
            "trainer.total_steps=4",
            "checkpoint.save_freq=2",
            "checkpoint.resume_fallback=previous",
            *checksums,
        )
    )
    warning = next(x for x in out.splitlines() if "resume_fallback=previous" in x)
    assert f"{damage}: checksum " in warning and "resuming from step 2" in warning
    assert f"resumed from {step_dir(root, 2)} (step 2)" in out
    first = read_metrics(four_step_run / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert {k: resumed[step][k] for k in COMPARED} == {k: first[step][k] for k in COMPARED}
    # Step 4 was saved again, from the resumed run; the damaged one is kept in quarantine.
    assert read_tracker(root) == 4 and sorted(list_step_dirs(root)) == [2, 4]
    (moved,) = (root / QUARANTINE_DIRNAME).iterdir()
    assert (moved / SHARD).read_bytes() == damaged_bytes


def test_the_recipe_with_another_actor_world_size_is_refused_before_ray(root, tmp_path):
    """The README's toggle `actor.world_size=4 actor.tensor_parallel_size=2` in the root of
    a run whose actor had 2 ranks: it started Ray and the workers, then every actor rank's
    load raised (per-rank extra state cannot be resharded) and the recipe printed Ray's
    traceback. Now one line naming the step, the role and the key, before Ray starts."""
    four_ranks = ("actor.world_size=4", "actor.tensor_parallel_size=2")
    done = run_recipe(tmp_path, f"checkpoint.root_dir={root}", *four_ranks)
    assert_refused_in_one_line(
        done,
        f"{step_dir(root, 4)}: role actor was saved with 2 ranks, loading with 4",
        "checkpoint.load_contents",
    )
    assert read_tracker(root) == 4 and sorted(list_step_dirs(root)) == [2, 4]


def test_a_ranks_load_error_after_ray_started_is_one_line(root, tmp_path):
    """A flipped bit that start-up does not look for (resume_verify=record checks sizes)
    is found by the ranks' `verify_checksums_on_load`: the recipe stops with one line
    naming the file, exit status 1, instead of Ray's traceback of the rank."""
    damage = step_dir(root, 4) / SHARD
    flip_bit(damage)
    proc = start_recipe(
        tmp_path / "out",
        # A step past the tracker's 4: with nothing to do the run ends before Ray (issue 47).
        "trainer.total_steps=5",
        f"checkpoint.root_dir={root}",
        "checkpoint.verify_checksums_on_load=true",
    )
    output = Output(proc).wait_exit()  # a run past its deadline is killed, then failed
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    (line,) = [x for x in output.splitlines() if x.startswith("ppo_toy:")]
    assert f"{damage}: checksum" in line, line
    assert read_tracker(root) == 4
