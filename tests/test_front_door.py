"""The recipe's front door (issue 47, items 2-5), tried as a new user would.

- An unknown or misspelled key, of the recipe or of `checkpoint`, plain or appended with `+`,
  is one line naming it and the nearest known key, exit status 2, before Ray starts (Hydra's
  own refusal was a five-line block with exit status 1; `+trainer.total_step=5` trained 40
  steps; `+checkpoint.save_frq=2` started Ray). `to_checkpoint_config` does the same for any
  trainer.
- "Nothing to do" is decided before Ray (it took some 40 s of Ray and worker start-up).
- Logs say what happened: the state a resume leaves out, per role and part, with why; no
  "0.00 MB of offloaded optimizer state" when nothing is offloaded; no Ray warnings caused by
  our own calls (token authentication, a deprecated property).
- The Hugging Face export refuses a value model (the recipe's critic) in one line, and names
  the context length (n_positions) in its record and its lines.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recipes.groups import describe_snapshot
from recipes.ppo_config import (
    RecipeConfigError,
    check_composes,
    check_overrides,
    to_recipe_config,
)
from recipes.resume_plan import dropped_state
from tests.test_recipe import finish, recipe_env, start_recipe
from tests.test_resume_fit import saved_root  # noqa: F401 - a fixture
from verl_ckpt import CheckpointConfigError, step_dir, to_checkpoint_config
from verl_ckpt.hf.record import EXPORT_RECORD_FILENAME, export_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
# The test's own deadline for a recipe that must end before Ray starts (imports only).
BEFORE_RAY_DEADLINE_S = 120


# ---- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "line"),
    [
        ({"save_frq": 2}, "unknown key checkpoint.save_frq (did you mean checkpoint.save_freq?)"),
        (
            OmegaConf.create({"writer": {"thread": 3}}),
            "unknown key checkpoint.writer.thread (did you mean checkpoint.writer.threads?)",
        ),
        (
            {"threads": 3},
            "unknown key checkpoint.threads (did you mean checkpoint.writer.threads?)",
        ),
    ],
)
def test_to_checkpoint_config_names_an_unknown_key_and_the_nearest_known_key(cfg, line):
    with pytest.raises(CheckpointConfigError) as refused:
        to_checkpoint_config(cfg)
    assert str(refused.value) == line


def test_keys_under_a_dict_field_are_the_users_own():
    config = to_checkpoint_config(
        {
            "hf_export": {"architectures": {"policy": "gpt2"}},
            "remote": {"storage_options": {"endpoint_url": "http://127.0.0.1:9000"}},
        }
    )
    assert config.hf_export.architectures == {"policy": "gpt2"}


def composed(*overrides: str):
    """The recipe's config as Hydra composes it for these overrides (compose API)."""
    from hydra import compose, initialize_config_dir

    import verl_ckpt
    from recipes.ppo_config import register_recipe_configs

    verl_ckpt.register_configs()
    register_recipe_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base=None):
        return compose("ppo_toy", overrides=["trainer.metrics_path=null", *overrides])


@pytest.mark.parametrize(
    ("override", "named", "nearest"),
    [
        ("+trainer.total_step=5", "trainer.total_step", "trainer.total_steps"),
        ("+checkpoint.save_frq=2", "checkpoint.save_frq", "checkpoint.save_freq"),
    ],
)
def test_a_key_appended_with_plus_is_refused_in_the_composed_config(override, named, nearest):
    """Hydra appends the key; the merge into the schema used to drop it without a word."""
    with pytest.raises(RecipeConfigError) as refused:
        to_recipe_config(composed(override))
    assert str(refused.value) == f"unknown key {named} (did you mean {nearest}?)"


def test_command_line_overrides_are_checked_against_the_schema():
    check_overrides(
        [
            "hydra.run.dir=/tmp/x",
            "hydra/job_logging=disabled",
            "checkpoint=sync",
            "trainer.total_steps=3",
            "+checkpoint.hf_export.architectures.policy=gpt2",
            "checkpoint.remote.storage_options.endpoint_url=http://127.0.0.1:9000",
            "--cfg",
            "job",
        ]
    )
    for override in ("actor.wold_size=4", "+actor.wold_size=4", "++actor.wold_size=4"):
        with pytest.raises(RecipeConfigError, match=r"actor\.wold_size .*actor\.world_size\?"):
            check_overrides([override])


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["checkpoint.save_freq=ten"],
            "Error merging override checkpoint.save_freq=ten; Value 'ten' of type 'str' could "
            "not be converted to Integer",
        ),
        (
            ["checkpoint=snc"],
            "In 'ppo_toy': Could not find 'checkpoint/snc'; Available options in 'checkpoint': "
            "async, base_checkpoint, offload, sync",
        ),
        (
            ["checkpoint.remote.storage_options.endpoint_url=http://127.0.0.1:9"],
            "Could not override 'checkpoint.remote.storage_options.endpoint_url'; To append to "
            "your config use +checkpoint.remote.storage_options.endpoint_url=http://127.0.0.1:9;"
            " Key 'endpoint_url' is not in struct",
        ),
        (
            ["checkpoint.root_dir=~/ckpt"],
            "LexerNoViableAltException: checkpoint.root_dir=~/ckpt (Hydra's override grammar: "
            "quote a value that holds special characters)",
        ),
    ],
)
def test_a_value_hydra_refuses_is_one_line(overrides, line):
    """Found by review: only unknown keys were our one line; a value of the wrong type, a
    preset that does not exist or an override Hydra cannot parse was Hydra's block of five
    to twelve lines, exit status 1 (the recipe's run of it: the test below)."""
    with pytest.raises(RecipeConfigError) as refused:
        check_composes(["hydra.run.dir=/tmp/x", *overrides], REPO_ROOT / "configs")
    assert str(refused.value) == line


def test_hydra_options_and_good_overrides_are_left_to_hydra():
    configs = REPO_ROOT / "configs"
    check_composes(["hydra.run.dir=/tmp/x", "checkpoint=sync", "trainer.total_steps=3"], configs)
    check_composes(["--cfg", "job", "checkpoint.save_freq=ten"], configs)


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"trainer": {"cpus_per_worker": math.nan}}, "trainer.cpus_per_worker"),
        ({"trainer": {"startup_timeout_s": math.inf}}, "trainer.startup_timeout_s"),
        ({"actor": {"lr": math.inf}}, "actor.lr"),
        ({"algorithm": {"clip_ratio": math.nan}}, "algorithm.clip_ratio"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_naming_the_key(settings, key):
    """Found by review: NaN passed every range check (its comparisons are all false), then
    trainer.cpus_per_worker=nan was a traceback after the root was locked, and actor.lr=nan
    trained on garbage."""
    with pytest.raises(RecipeConfigError) as refused:
        to_recipe_config(OmegaConf.create(settings))
    assert str(refused.value).startswith(f"{key}=") and "must be a finite number" in str(
        refused.value
    )


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "checkpoint.save_frq=2",
            "unknown key checkpoint.save_frq (did you mean checkpoint.save_freq?)",
        ),
        (
            "+trainer.total_step=5",
            "unknown key trainer.total_step (did you mean trainer.total_steps?)",
        ),
        (
            "+checkpoint.save_frq=2",
            "unknown key checkpoint.save_frq (did you mean checkpoint.save_freq?)",
        ),
        (
            "checkpoint.save_freq=ten",
            "Error merging override checkpoint.save_freq=ten; Value 'ten' of type 'str' could "
            "not be converted to Integer",
        ),
    ],
)
def test_recipe_refuses_an_unknown_key_in_one_line_with_exit_2_before_ray(tmp_path, override, line):
    root = tmp_path / "ckpt"
    proc = start_recipe(tmp_path / "run", f"checkpoint.root_dir={root}", override)
    output, _ = proc.communicate(timeout=BEFORE_RAY_DEADLINE_S)
    assert proc.returncode == 2, output
    assert output.strip() == f"ppo_toy: invalid config: {line}", output
    assert not root.exists()


# ---- decided before Ray ----------------------------------------------------------------------


@pytest.fixture
def step5_root(saved_root, tmp_path) -> Path:  # noqa: F811 - the fixture imported above
    """A copy of test_resume_fit's root: the tracker names step 5, whose actor was saved by
    2 ranks with model, optimizer and extra state, its critic by 1 rank without extra."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved_root, copy)
    return copy


def test_recipe_with_nothing_to_do_says_so_in_one_line_and_exits_0_before_ray(step5_root):
    """The tracker names step 5 and trainer.total_steps=5: no Ray, no workers (the step's
    shards are not even real: a worker's load would fail). Its critic was saved without
    extra state: a run loads model and optimizer only (start-up refuses a load_contents
    asking for a part the step lacks, test_resume_fit)."""
    root = step5_root
    proc = start_recipe(
        root.parent / "run",
        f"checkpoint.root_dir={root}",
        "trainer.total_steps=5",
        "checkpoint.load_contents=[model,optimizer]",
    )
    output, _ = proc.communicate(timeout=BEFORE_RAY_DEADLINE_S)
    assert proc.returncode == 0, output
    said = "step 5 already reaches trainer.total_steps=5: nothing to do"
    assert f"{said} (checkpoint root {root})" in output, output
    assert "Ray" not in output, output


# ---- logs ------------------------------------------------------------------------------------


def test_a_resume_names_each_part_of_a_roles_state_it_leaves_out_and_why(step5_root):
    step = step_dir(step5_root, 5)
    (line,) = dropped_state(step, {"actor": 4, "critic": 1}, ["model", "optimizer"])
    assert line == (
        "resume from step 5: actor: extra state (RNG) not loaded (checkpoint.load_contents="
        "['model', 'optimizer'] leaves it out; saved by 2 ranks, this run has 4: per-rank state "
        "cannot be resharded); its random streams start from trainer.seed"
    )
    lines = dropped_state(step, {"actor": 2, "critic": 1}, ["optimizer", "extra"])
    assert [x.split(" not loaded")[0] for x in lines] == [
        "resume from step 5: actor: model weights",
        "resume from step 5: critic: model weights",
    ]
    assert dropped_state(step, {"actor": 2, "critic": 1}, ["model", "optimizer", "extra"]) == []
    assert dropped_state(None, {"actor": 2}, ["model"]) == []


def test_the_snapshot_line_names_offloaded_state_only_when_there_is_some():
    rank = {"snapshot": "now", "bytes_staged": 160_000, "bytes_zero_copy": 0}
    assert describe_snapshot([rank, rank], True) == "0.32 MB copied; writing in the background"
    offloaded = {**rank, "bytes_zero_copy": 320_000}
    assert describe_snapshot([offloaded], False) == (
        "0.16 MB copied, 0.32 MB of offloaded optimizer state referenced without a copy; written"
    )
    # A live snapshot's split is made on the save thread after save() returned: no figure.
    live = {**offloaded, "snapshot": "live"}
    assert describe_snapshot([live], True) == (
        "whole host tensors written from the live state (copied with a writer process), the "
        "rest copied, in the background (the next optimizer step waits for both); writing in "
        "the background"
    )


# ---- the real recipe: its logs, and exports of its roles ---------------------------------------


def verl_ckpt_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_ckpt.cli.main", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_recipe_logs_no_ray_warning_and_its_critic_is_refused_by_the_export(tmp_path):
    """A run without optimizer offload: no line about offloaded state, no warning of Ray's
    about our own calls. Its critic (a value model) is refused by `verl-ckpt export` in one
    line, exit 2; its actor's export names the context length (11 = 4 prompt + 8 response - 1
    positions) in its line and its record."""
    root = tmp_path / "ckpt"
    output = finish(
        start_recipe(
            tmp_path / "run",
            "trainer.total_steps=2",
            "checkpoint.save_freq=2",
            "checkpoint=async",
            "actor.optimizer_offload=false",
            "critic.optimizer_offload=false",
            f"checkpoint.root_dir={root}",
        )
    )
    assert "step 2 committed" in output, output
    for unwanted in ("offloaded optimizer state", "Token authentication", "Deprecat"):
        assert unwanted not in output, output

    refused = verl_ckpt_cli("export", str(root), "--role", "critic")
    assert refused.returncode == 2, refused
    (line,) = refused.stderr.strip().splitlines()
    assert "role critic" in line and "is a value model (no language-model head)" in line, line
    assert not export_dir(step_dir(root, 2), "critic").exists()

    exported = verl_ckpt_cli("export", str(root), "--role", "actor")
    assert exported.returncode == 0, exported
    assert "context length 11 tokens (n_positions" in exported.stdout, exported.stdout
    directory = export_dir(step_dir(root, 2), "actor")
    assert json.loads((directory / EXPORT_RECORD_FILENAME).read_text())["context_length"] == 11
    assert json.loads((directory / "config.json").read_text())["n_positions"] == 11


def test_recipe_refuses_an_export_of_its_critic_before_ray():
    """Known from the config alone: the recipe's critic is a value model."""
    cfg = OmegaConf.create({"checkpoint": {"hf_export": {"architectures": {"critic": "gpt2"}}}})
    with pytest.raises(RecipeConfigError, match="the critic is a value model"):
        to_recipe_config(cfg)


@pytest.mark.parametrize(
    ("settings", "key", "why"),
    [
        # Refused after Ray started, when the coordinator planned the exports.
        (
            {"checkpoint": {"hf_export": {"architectures": {"actr": "gpt2"}}}},
            "checkpoint.hf_export.architectures.actr",
            "this recipe has no role 'actr' (its roles: actor, critic)",
        ),
        # Ignored: in sync mode no rollout worker starts.
        (
            {"rollout": {"num_workers": 4}},
            "rollout.num_workers",
            "only rollout.mode=async starts rollout workers",
        ),
        # A traceback after Ray started: the first seeded generator overflowed.
        ({"trainer": {"seed": 20000000000000000}}, "trainer.seed", "must lie in ["),
    ],
)
def test_recipe_settings_known_to_fail_after_ray_are_refused_before_it(settings, key, why):
    """From helper-58's review of the front door: each was accepted before Ray started."""
    with pytest.raises(RecipeConfigError) as refused:
        to_recipe_config(OmegaConf.create(settings))
    assert str(refused.value).startswith(f"{key}=") and why in str(refused.value), refused.value


def test_a_metrics_path_that_cannot_be_written_is_one_line_before_ray(tmp_path):
    """Found by review: the metrics file was opened by the trainer after Ray and the
    finalizer had started, and an OSError there was a traceback."""
    not_a_directory = tmp_path / "a_file"
    not_a_directory.write_text("")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.ppo_toy",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"checkpoint.root_dir={tmp_path / 'ckpt'}",
            f"trainer.metrics_path={not_a_directory / 'metrics.jsonl'}",
        ],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=BEFORE_RAY_DEADLINE_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert output.strip() == (
        f"ppo_toy: error: trainer.metrics_path='{not_a_directory / 'metrics.jsonl'}' cannot be "
        f"written: {not_a_directory} is no directory"
    ), output
