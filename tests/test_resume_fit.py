"""prepare_start(config, roles=...): a resume step that the run's ranks cannot load is refused
before Ray starts, in one line naming the step, the role and the key, with the errors the
ranks' load() raises (resume_fit.py). Reported from the README's Hydra toggles: after a
default run, `actor.world_size=4` started Ray and the workers, then every actor rank's load
raised (per-rank extra state of 2 ranks), and the recipe printed Ray's traceback.

The steps' `.metadata` files are DCP's, written through megatron-core's own conversion of a
ShardedObject (the form the ranks' extra state takes), in a process of its own: megatron-core
needs a process group for it. Their commit records list no files (start-up reads the record;
no rank loads here). tests/test_recipe_resume_check.py runs the recipe on a real run's steps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_recipe_trust import snapshot
from verl_ckpt import CheckpointError, CommitRecordError, prepare_start
from verl_ckpt.startup.resume_fit import EXTRA_STATE_KEY
from verl_ckpt.store.commit_record import CommitRecord, write_commit_record
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, step_dir
from verl_ckpt.store.tracker import write_tracker

REPO_ROOT = Path(__file__).resolve().parent.parent

_WRITE_ROLE_DIRS = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mt
step = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{step}/.pg", rank=0, world_size=1)
def save(role, state):
    sharded, _, _ = mt._replace_state_dict_keys_with_sharded_keys(state)
    dcp.save(mt.mcore_to_pyt_state_dict(sharded), checkpoint_id=str(step / role),
             planner=mt.MCoreSavePlanner(flatten_state_dict=False), no_dist=True)
weight = lambda: ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 0, 2))
moment = lambda: ShardedTensor.from_rank_offsets("optimizer.state.w", torch.zeros(4), (0, 0, 2))
# The actor's rank 0 of 2, as a rank saves it: its extra state is one object per rank.
save("actor", {"w": weight(), "m": moment(),
               "extra": ShardedObject(sys.argv[2], {"rng": 1}, (2,), (0,), replica_id=0)})
save("critic", {"w": weight(), "m": moment()})  # saved without extra state
dist.destroy_process_group()
(step / ".pg").unlink(missing_ok=True)
"""


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory) -> Path:
    """A root whose tracker names step 5: actor saved by 2 ranks with model, optimizer and
    extra state, critic by 1 rank without extra state."""
    root = tmp_path_factory.mktemp("fit") / "ckpt"
    step = step_dir(root, 5)
    step.mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WRITE_ROLE_DIRS), str(step), EXTRA_STATE_KEY],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    write_commit_record(step, CommitRecord(5, {"actor": 2, "critic": 1, "driver": 1}, []))
    write_tracker(root, 5)
    return root


@pytest.fixture
def root(saved_root, tmp_path) -> Path:
    """A copy of the saved root for one test (prepare_start locks and may recover it)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved_root, copy)
    return copy


def start(root: Path, roles: dict[str, int] | None, **config):
    plan = prepare_start({"root_dir": str(root), **config}, roles=roles)
    plan.release()
    return plan


def test_the_same_rank_counts_resume(root):
    assert start(root, {"actor": 2}).resume_dir == step_dir(root, 5)
    plan = start(root, {"actor": 2, "critic": 1}, load_contents=["model", "optimizer"])
    assert plan.resume_dir == step_dir(root, 5)


def test_another_rank_count_with_extra_state_is_refused_and_the_root_left_as_it_was(root):
    before = snapshot(root)
    with pytest.raises(CheckpointError) as refused:
        start(root, {"actor": 4, "critic": 1})
    message = str(refused.value)
    assert str(step_dir(root, 5)) in message and "role actor" in message, message
    assert "saved with 2 ranks, loading with 4" in message, message
    assert "checkpoint.load_contents" in message and "\n" not in message, message
    assert snapshot(root) == before
    # The lock was let go: the next start (with a fitting world) goes ahead.
    assert start(root, {"actor": 2}).resume_dir == step_dir(root, 5)


def test_another_rank_count_resumes_model_and_optimizer_without_extra(root):
    plan = start(root, {"actor": 4, "critic": 1}, load_contents=["model", "optimizer"])
    assert plan.resume_dir == step_dir(root, 5)


def test_a_part_a_role_was_saved_without_is_refused_naming_it_and_what_it_holds(root):
    """Found by review: `checkpoint.save_contents=[model,optimizer]` and the default
    `load_contents` (extra included) passed start-up; Ray and the workers started, then every
    rank's load raised DCP's "Missing key in checkpoint state_dict: verl_ckpt.extra_state/..."
    and the recipe printed the traceback. Now one line before Ray, naming the role, the part
    and what to load instead; the run loads what the step holds, at any rank count of a role
    saved without extra state."""
    before = snapshot(root)
    with pytest.raises(CheckpointError) as refused:
        start(root, {"actor": 2, "critic": 2})
    message = str(refused.value)
    assert f"{step_dir(root, 5)}: role critic holds no extra" in message, message
    assert "checkpoint.load_contents=[model,optimizer]" in message and "\n" not in message
    assert snapshot(root) == before
    plan = start(root, {"critic": 2}, load_contents=["model", "optimizer"])
    assert plan.resume_dir == step_dir(root, 5)


def test_a_role_the_step_does_not_hold_is_refused_naming_the_roles_it_holds(root):
    with pytest.raises(CommitRecordError, match=r"holds no state of role 'reward' \(roles: "):
        start(root, {"actor": 2, "reward": 1})


def test_an_unreadable_metadata_file_is_one_line_naming_it(root):
    metadata = step_dir(root, 5) / "actor" / ".metadata"
    metadata.write_bytes(b"not a pickle")
    with pytest.raises(CommitRecordError) as refused:
        start(root, {"actor": 4, "critic": 1})
    assert str(metadata) in str(refused.value) and "\n" not in str(refused.value)


def test_a_fallback_step_the_roles_cannot_load_is_refused_before_anything_moves(root):
    """Found by review: with resume_fallback=previous, the tracker's step 6 unusable (its
    record gone), start-up moved step 6 to quarantine and wrote the tracker back to step 5,
    and only then found that 4 actor ranks cannot load step 5's per-rank extra state of 2:
    the start was refused, the root changed all the same. Now the fallback's step is checked
    first, and the refusal leaves the root as it was."""
    shutil.copytree(step_dir(root, 5), step_dir(root, 6))
    (step_dir(root, 6) / COMMIT_RECORD_FILENAME).unlink()  # the tracker's step is unusable
    write_tracker(root, 6)

    def files() -> list:  # the root lock's own files aside (a start under the lock makes them)
        return [entry for entry in snapshot(root) if ".verl_ckpt.lock" not in entry[0]]

    before = files()
    with pytest.raises(CheckpointError, match="saved with 2 ranks, loading with 4"):
        start(root, {"actor": 4}, resume_fallback="previous")
    assert files() == before
    assert start(root, {"actor": 2}, resume_fallback="previous").resume_dir == step_dir(root, 5)


def test_without_roles_the_start_is_as_before(root):
    assert start(root, None).resume_dir == step_dir(root, 5)
