"""Hugging Face weights of a role (issue 16, protocol step 8), tested as a user would: real
Megatron ranks in Ray actors save, the finalizer exports after the commit, `transformers`
loads the export with `from_pretrained` (offline, from the local directory only) and its
logits equal the megatron-core model's at that step, at tensor parallelism 2 (the actor) and
1 (the critic of the shared ranks is a GPT too). Faults are real (an immutable directory).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import ray
import torch

from tests.conftest import ROLES
from tests.helpers import close_all, every_rank, open_all, save_everyone
from tests.rank_worker import start_world
from verl_ckpt import CheckpointCoordinator, export_role, read_tracker, step_dir
from verl_ckpt.cli.main import main as verl_ckpt_cli
from verl_ckpt.hf.model_spec import MODEL_SPEC_FILENAME
from verl_ckpt.hf.record import EXPORT_RECORD_FILENAME, export_dir, verify_export
from verl_ckpt.store.commit_record import is_committed

os.environ["HF_HUB_OFFLINE"] = "1"  # never the hub: every model comes from a local directory
import transformers  # noqa: E402 - the test extra; imported once the hub is off
from safetensors import safe_open  # noqa: E402 - with transformers

BOTH_GPT = {"actor": "gpt2", "critic": "gpt2"}


def config(tmp_path: Path, hf_model: bool = True, **overrides) -> dict:
    contents = ["model", "optimizer", "extra"] + (["hf_model"] if hf_model else [])
    return {
        "root_dir": str(tmp_path / "ckpt"),
        "timeout_s": 60.0,
        "save_contents": contents,
        "hf_export": {"architectures": BOTH_GPT},
        **overrides,
    }


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(5))


def megatron_logits(ranks: dict, role: str, tokens: torch.Tensor) -> torch.Tensor:
    """The role's logits now (every TP rank takes part in the forward; rank 0's answer)."""
    return ray.get([w.logits.remote(tokens) for w in ranks[role]])[0]


def fresh_models(ranks: dict) -> None:
    """The shared ranks' models rebuilt as at the session's start (seed 7, one step). A test
    of another module may have moved every weight by +1 (an in-place change it saves); fp32
    results of megatron-core and transformers, whose operations run in another order, then
    differ by more than the 1e-5 these tests allow (0.011 seen)."""
    from recipes.megatron_cpu import TinyGPTConfig

    ray.get([w.rebuild.remote(TinyGPTConfig().hidden_size) for w in every_rank(ranks)])


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory), local_files_only=True)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def commit_step_1(ranks: dict, cfg: dict) -> CheckpointCoordinator:
    """Fresh models saved as step 1 under `cfg` by every rank, committed; the coordinator,
    its ranks still open."""
    fresh_models(ranks)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    save_everyone(ranks, coordinator, 1)
    coordinator.wait_for_commit(1)
    return coordinator


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = verl_ckpt_cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_step8_export_after_commit_loads_in_transformers_with_megatron_logits_tp2_and_tp1(
    ranks, tmp_path, capsys
):
    """hf_model: after step 1 commits, the finalizer exports actor (TP=2) and critic (TP=1);
    each export verifies, loads with from_pretrained, and gives the logits the megatron-core
    model gave at step 1 (fp32, atol 1e-5); `verl-ckpt verify` checks the exports too."""
    cfg = config(tmp_path)
    root = Path(cfg["root_dir"])
    fresh_models(ranks)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    tokens = batch()
    save_everyone(ranks, coordinator, 1)
    expected = {role: megatron_logits(ranks, role, tokens) for role in ROLES}
    coordinator.wait_for_commit(1)
    outcomes = coordinator.wait_for_exports()
    assert {(o["step"], o["role"], o["state"]) for o in outcomes} == {
        (1, "actor", "done"),
        (1, "critic", "done"),
    }, outcomes
    for role in ROLES:
        directory = export_dir(step_dir(root, 1), role)
        record, problems = verify_export(directory)
        assert problems == [] and record.architecture == "gpt2"
        assert {f.path for f in record.files} == {"model.safetensors", "config.json"}
        torch.testing.assert_close(hf_logits(directory, tokens), expected[role], atol=1e-5, rtol=0)
    close_all(ranks, coordinator)
    code, out, _ = run_cli(capsys, "verify", root, "--step", 1)
    assert code == 0, out
    assert "OK Hugging Face export of actor (gpt2)" in out
    assert "OK Hugging Face export of critic (gpt2)" in out


def test_step8_tied_embeddings_export_as_gpt2_ties_them_tp2(ray_local, tmp_path):
    """GPT-2 ties lm_head to the word embeddings: a megatron-core GPT built that way
    (share_embeddings_and_output_weights, no output layer of its own) at TP=2 exports without
    an lm_head tensor, with tie_word_embeddings set, and transformers' logits equal the
    megatron-core model's at that step."""
    ranks = {"actor": start_world("actor", 2, tp=2)}
    cfg = config(tmp_path, hf_export={"architectures": {"actor": "gpt2"}})
    try:
        ray.get([w.rebuild.remote(32, tied_embeddings=True) for w in ranks["actor"]])
        coordinator = CheckpointCoordinator(cfg, {"actor": 2})
        open_all(ranks, cfg)
        tokens = batch()
        save_everyone(ranks, coordinator, 1)
        expected = megatron_logits(ranks, "actor", tokens)
        coordinator.wait_for_commit(1)
        outcomes = coordinator.wait_for_exports()
        assert [(o["step"], o["role"], o["state"]) for o in outcomes] == [(1, "actor", "done")]
        directory = export_dir(step_dir(cfg["root_dir"], 1), "actor")
        assert verify_export(directory)[1] == []
        assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is True
        with safe_open(directory / "model.safetensors", "pt") as exported:
            assert "lm_head.weight" not in exported.keys()
        torch.testing.assert_close(hf_logits(directory, tokens), expected, atol=1e-5, rtol=0)
        close_all(ranks, coordinator)
    finally:
        for worker in ranks["actor"]:
            ray.kill(worker)


def test_verl_ckpt_export_writes_a_step_saved_without_hf_model(
    ranks, tmp_path, capsys, monkeypatch
):
    """A step saved without hf_model has no export, but its model description is committed:
    `verl-ckpt export ROOT --step N --role actor OUT` writes one that transformers loads
    with step N's logits; a second run finds it and keeps it; the in-place export (no OUT)
    lands in the step and verifies; an export split into safetensors shards with an index
    loads the same."""
    cfg = config(tmp_path, hf_model=False)
    root = Path(cfg["root_dir"])
    fresh_models(ranks)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    tokens = batch()
    save_everyone(ranks, coordinator, 1)
    expected = megatron_logits(ranks, "actor", tokens)
    coordinator.wait_for_commit(1)
    assert coordinator.wait_for_exports() == []
    close_all(ranks, coordinator)
    step = step_dir(root, 1)
    assert not export_dir(step, "actor").exists()
    assert (step / "actor" / MODEL_SPEC_FILENAME).is_file()

    out_dir = tmp_path / "actor_hf"
    code, out, err = run_cli(capsys, "export", root, "--step", 1, "--role", "actor", out_dir)
    assert code == 0, err
    assert f"exported step 1 role actor (gpt2) to {out_dir}" in out
    torch.testing.assert_close(hf_logits(out_dir, tokens), expected, atol=1e-5, rtol=0)
    assert verify_export(out_dir)[1] == []

    code, out, _ = run_cli(capsys, "export", root, "--step", 1, "--role", "actor", out_dir)
    assert code == 0 and "already exported" in out
    # Found by review: step 1 of another run (other weights) took the export at OUT for its
    # own ("already exported", exit 0) and left the first run's weights there. The export
    # record now names the save it came from (its commit record's hash).
    other = config(tmp_path / "other", hf_model=False)
    other_coordinator = CheckpointCoordinator(other, ROLES)
    open_all(ranks, other)
    ray.get([w.train.remote(1) for w in every_rank(ranks)])
    save_everyone(ranks, other_coordinator, 1)
    other_coordinator.wait_for_commit(1)
    close_all(ranks, other_coordinator)
    other_root = other["root_dir"]
    code, out, err = run_cli(capsys, "export", other_root, "--step", 1, "--role", "actor", out_dir)
    assert code == 2 and "is not an export of" in err and "already" not in out, out + err
    torch.testing.assert_close(hf_logits(out_dir, tokens), expected, atol=1e-5, rtol=0)
    # Found by review: OUT "." (an empty current directory) was a ValueError's traceback;
    # it is refused in one line (OUT is replaced whole: the current directory would go).
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    capsys.readouterr()  # transformers' progress bars of the loads above
    code, out, err = run_cli(capsys, "export", root, "--step", 1, "--role", "actor", ".")
    assert (code, out) == (2, "") and err.count("\n") == 1, out + err
    assert "OUT . is the current directory" in err and here.is_dir(), err

    code, out, err = run_cli(capsys, "export", root, "--role", "actor")  # the tracker's step
    assert code == 0, err
    torch.testing.assert_close(
        hf_logits(export_dir(step, "actor"), tokens), expected, atol=1e-5, rtol=0
    )
    code, out, _ = run_cli(capsys, "verify", root)
    assert code == 0 and "OK Hugging Face export of actor (gpt2)" in out

    sharded = export_role(step, "actor", "gpt2", tmp_path / "sharded", max_shard_bytes=8 << 10)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sharded.files > 4 and len(set(index["weight_map"].values())) == sharded.files - 2
    torch.testing.assert_close(hf_logits(tmp_path / "sharded", tokens), expected, atol=1e-5, rtol=0)


def test_step8_a_failed_export_leaves_the_step_committed_and_verl_ckpt_export_retries_it(
    ranks, tmp_path, capsys
):
    """A real fault: the actor's `huggingface/` is an immutable leftover the export cannot
    replace. The export fails (reported with the command that retries it), the step stays
    committed and the tracker names it; once the directory is freed, `verl-ckpt export`
    writes the export and `verify` passes."""
    cfg = config(tmp_path, hf_export={"architectures": {"actor": "gpt2"}})
    root = Path(cfg["root_dir"])
    fresh_models(ranks)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    tokens = batch()
    ray.get([w.save.remote(1) for w in every_rank(ranks)])
    ray.get([w.wait.remote() for w in every_rank(ranks)])  # the ranks' files are written
    leftover = export_dir(step_dir(root, 1), "actor")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"not weights")
    subprocess.run(["chattr", "+i", str(leftover)], check=True)
    try:
        coordinator.save_driver_state(1, {"step": 1})  # the last report: the step commits
        expected = megatron_logits(ranks, "actor", tokens)
        assert coordinator.wait_for_commit(1)["tracker"] == 1
        (outcome,) = coordinator.wait_for_exports()
        assert outcome["state"] == "failed", outcome
        assert "Operation not permitted" in outcome["message"]
        assert f"retry with: verl-ckpt export {root} --step 1 --role actor" in outcome["message"]
        assert coordinator.status()["hf_exports"] == [outcome]
    finally:
        subprocess.run(["chattr", "-i", str(leftover)], check=False)
    close_all(ranks, coordinator)
    assert read_tracker(root) == 1 and is_committed(step_dir(root, 1))
    assert not list((root / "global_step_1" / "actor").glob(".huggingface.tmp.*"))
    code, out, _ = run_cli(capsys, "verify", root)
    assert code == 1 and EXPORT_RECORD_FILENAME in out  # the leftover is no export
    code, out, err = run_cli(capsys, "export", root, "--step", 1, "--role", "actor")
    assert code == 0, err
    torch.testing.assert_close(hf_logits(leftover, tokens), expected, atol=1e-5, rtol=0)
    assert run_cli(capsys, "verify", root)[0] == 0
    config_json = json.loads((leftover / "config.json").read_text())
    assert config_json["model_type"] == "gpt2" and config_json["n_layer"] == 2


# ---- the recipe ----------------------------------------------------------------------------


def test_recipe_with_hf_model_exports_the_actor_skips_the_critic_and_waits_at_its_end(tmp_path):
    """`python -m recipes.ppo_toy checkpoint.save_contents=[...,hf_model]`: the actor's step 2
    is exported (waited for before the run ends: it is there, complete, when the process
    exits), the critic (no mapping: a value model) is skipped with one log line, and the
    export loads in transformers."""
    from tests.test_recipe import finish, start_recipe

    root = tmp_path / "ckpt"
    output = finish(
        start_recipe(
            tmp_path / "run",
            "trainer.total_steps=2",
            "checkpoint.save_freq=2",
            "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            f"checkpoint.root_dir={root}",
        )
    )
    assert output.count("role critic has no checkpoint.hf_export.architectures entry") == 1
    directory = export_dir(step_dir(root, 2), "actor")
    assert f"step 2: Hugging Face export of actor done to {directory}" in output
    assert verify_export(directory)[1] == []
    assert not export_dir(step_dir(root, 2), "critic").exists()
    logits = hf_logits(directory, torch.randint(0, 32, (2, 11)))
    assert logits.shape == (2, 11, 32) and torch.isfinite(logits).all()


def test_recipe_refuses_an_unknown_mapping_name_in_one_line_before_ray(tmp_path):
    """A typo in checkpoint.hf_export.architectures is one line naming the key, exit 2,
    before Ray starts and before anything is written."""
    from tests.test_recipe import start_recipe

    root = tmp_path / "ckpt"
    proc = start_recipe(
        tmp_path / "run",
        "checkpoint.hf_export.architectures.actor=gtp2",
        f"checkpoint.root_dir={root}",
    )
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output
    (line,) = [x for x in output.splitlines() if "error" in x]
    assert line.startswith("ppo_toy: error: checkpoint.hf_export.architectures.actor='gtp2'")
    assert "started an embedded Ray" not in output and not root.exists()


# ---- retention and back-pressure -------------------------------------------------------------


def exporting_coordinator(cfg: dict, fault: str, disarmed_marker: Path) -> CheckpointCoordinator:
    """A coordinator whose finalizer (and so its export tasks, which inherit its runtime
    environment) runs with VERL_CKPT_FAULT=`fault`, fired once when `disarmed_marker` is
    missing (tests.test_faults.faulty_coordinator, with the export plan)."""
    from tests.test_faults import REPO_ROOT
    from verl_ckpt import to_checkpoint_config
    from verl_ckpt.commit.client import actor_options
    from verl_ckpt.commit.finalizer import CheckpointFinalizer
    from verl_ckpt.hf.scheduler import plan_exports
    from verl_ckpt.protocol.faults import ENV_VAR, ONCE_ENV_VAR

    config = to_checkpoint_config(cfg)
    root = Path(cfg["root_dir"]).resolve()
    root.mkdir(parents=True, exist_ok=True)
    disarmed_marker.touch()
    env = {ENV_VAR: fault, ONCE_ENV_VAR: str(disarmed_marker), "PYTHONPATH": str(REPO_ROOT)}
    handle = (
        ray.remote(CheckpointFinalizer)
        .options(**actor_options(root), runtime_env={"env_vars": env})
        .remote(
            str(root),
            {**ROLES, "driver": 1},
            config.max_ckpt_to_keep,
            1,
            plan_exports(config, list(ROLES)),
        )
    )
    ray.get(handle.describe.remote(), timeout=60)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    # The creating handle owns the actor: drop it and Ray collects the actor.
    coordinator.owner_handle = handle
    return coordinator


def test_I3_retention_keeps_a_step_under_export_and_a_waiting_export_is_superseded(ranks, tmp_path):
    """keep=1 while step 1's export hangs (the fault hook parks it): steps 2 and 3 commit,
    retention keeps step 1 (being read) and deletes step 2 once its waiting export was
    superseded by step 3's; the run's end waits within its deadline, then stops the hung
    export (nothing left running) and reports it with the command that writes it later."""
    from tests.test_trust import wait_for
    from verl_ckpt import CommitTimeoutError

    cfg = config(tmp_path, max_ckpt_to_keep=1, hf_export={"architectures": {"actor": "gpt2"}})
    root = Path(cfg["root_dir"])
    marker = tmp_path / "disarmed"
    coordinator = exporting_coordinator(cfg, "export:actor=hang", marker)
    open_all(ranks, cfg)
    marker.unlink()  # arm: the first export parks before writing
    save_everyone(ranks, coordinator, 1)
    wait_for(marker.exists, 60, "the export of step 1 did not start")
    for step in (2, 3):
        save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(step)
    wait_for(lambda: not step_dir(root, 2).exists(), 30, "retention did not delete step 2")
    assert is_committed(step_dir(root, 1)) and read_tracker(root) == 3
    with pytest.raises(CommitTimeoutError, match=r"exports of steps \[1, 3\] .* did not end"):
        coordinator.wait_for_exports(timeout_s=1)
    states = {(o["step"], o["state"]) for o in coordinator.status()["hf_exports"]}
    assert states == {(1, "running"), (2, "skipped"), (3, "queued")}
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close(timeout_s=2)
    assert not list((step_dir(root, 1) / "actor").glob(".huggingface.tmp.*"))
    # Every export the job did not finish is one command away.
    assert verl_ckpt_cli(["export", str(root), "--step", "3", "--role", "actor"]) == 0
    assert verify_export(export_dir(step_dir(root, 3), "actor"))[1] == []


def flip_a_byte_amid(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def cut_the_end_of(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


@pytest.mark.parametrize("damage", [flip_a_byte_amid, cut_the_end_of])
def test_an_export_of_a_step_whose_shard_changed_since_its_commit_is_refused(
    ranks, tmp_path, capsys, damage
):
    """An export converts the committed bytes or nothing: a shard changed after the commit
    (one flipped byte amid the tensors, as a failing disk leaves it; its end cut off) is
    refused in one line naming the file, and nothing is written. Before, only the model
    description was checked: the export converted the flipped byte and published it under a
    valid export record, and a cut shard ended `verl-ckpt export` with torch's traceback."""
    cfg = config(tmp_path, hf_model=False)
    root = Path(cfg["root_dir"])
    close_all(ranks, commit_step_1(ranks, cfg))
    shard = max((step_dir(root, 1) / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    damage(shard)
    out_dir = tmp_path / "actor_hf"
    code, out, err = run_cli(capsys, "export", root, "--step", 1, "--role", "actor", out_dir)
    assert code == 1 and out == "", out
    assert str(shard) in err and err.count("\n") == 1, err
    assert not out_dir.exists()


def test_with_signing_a_planted_export_is_neither_verified_nor_taken_for_done(
    ranks, tmp_path, capsys
):
    """Found by review: export records were never signed, and one without the save it came
    from passed for the step's own. With checkpoint.signing, weights planted at
    `<step>/actor/huggingface/` with a record that matches them (unsigned, or signed with
    another key) printed "OK Hugging Face export" under `verl-ckpt verify --signing-key-file`
    and "already exported" under `verl-ckpt export`. The finalizer's exports are signed now;
    a planted one fails verify in one line and is exported over."""
    from verl_ckpt.hf.record import read_export_record
    from verl_ckpt.store.fsio import file_checksum
    from verl_ckpt.store.signing import Keyring

    key_file = tmp_path / "team.key"
    key_file.write_bytes(b"k3y-0f-the-team-s3cr3t-bytes-42\n")
    cfg = config(tmp_path, signing={"key_file": str(key_file)})
    root = Path(cfg["root_dir"])
    coordinator = commit_step_1(ranks, cfg)
    assert {o["state"] for o in coordinator.wait_for_exports()} == {"done"}
    close_all(ranks, coordinator)
    directory = export_dir(step_dir(root, 1), "actor")
    assert read_export_record(directory).signature is not None
    key = ("--signing-key-file", key_file)
    code, out, err = run_cli(capsys, "verify", root, "--step", 1, *key)
    assert code == 0 and "OK Hugging Face export of actor (gpt2)" in out, out + err

    genuine = (directory / "model.safetensors").read_bytes()
    for attacker in (None, Keyring([b"an-attacker-of-their-own-key"])):
        planted = directory / "model.safetensors"
        planted.write_bytes(b"planted weights")
        raw = json.loads((directory / EXPORT_RECORD_FILENAME).read_text())
        entry = next(e for e in raw["files"] if e["path"] == "model.safetensors")
        entry["size"], entry["checksum"] = file_checksum(planted)
        raw["source_record_sha256"] = None
        raw.pop("signature", None)
        if attacker is not None:
            raw["signature"] = attacker.sign(raw)
        (directory / EXPORT_RECORD_FILENAME).write_text(json.dumps(raw))
        assert verify_export(directory)[1] == []  # sizes and checksums match: only a key tells

        code, out, err = run_cli(capsys, "verify", root, "--step", 1, *key)
        assert code == 1 and "OK Hugging Face export" not in out, out + err
        why = "unsigned" if attacker is None else "signed with another key"
        assert f"export {directory} is refused" in out + err and why in out + err, out + err

        code, out, err = run_cli(capsys, "export", root, "--step", 1, "--role", "actor", *key)
        assert code == 0 and "already exported" not in out, out + err
        assert (directory / "model.safetensors").read_bytes() == genuine
        code, out, err = run_cli(capsys, "verify", root, "--step", 1, *key)
        assert code == 0 and "OK Hugging Face export of actor (gpt2)" in out, out + err


@pytest.mark.parametrize("declared", ["huge", "a gap"])
def test_an_export_refuses_a_tensor_size_its_step_cannot_hold(ranks, tmp_path, declared):
    """From review: the export allocated whatever size the role's `.metadata` declared and
    then read the saved chunks into it. In a root others can write (here unsigned, the
    record rewritten to match), a huge size ran the node out of memory (torch refused it
    with a traceback here), and a size whose chunks leave a gap published memory that no
    chunk filled. Both are refused in one line naming the tensor, before any allocation."""
    import dataclasses
    import pickle

    from verl_ckpt.format.safe_load import load_dcp_metadata
    from verl_ckpt.protocol.errors import CheckpointError
    from verl_ckpt.store.commit_record import read_commit_record, write_commit_record
    from verl_ckpt.store.fsio import file_checksum

    cfg = config(tmp_path, hf_model=False)
    close_all(ranks, commit_step_1(ranks, cfg))
    step = step_dir(Path(cfg["root_dir"]), 1)
    path = step / "actor" / ".metadata"
    metadata = load_dcp_metadata(path)
    key = "embedding.word_embeddings.weight"
    meta = metadata.state_dict_metadata[key]
    rows = 1 << 40 if declared == "huge" else meta.size[0] * 2
    metadata.state_dict_metadata[key] = dataclasses.replace(
        meta, size=torch.Size((rows, *meta.size[1:]))
    )
    path.write_bytes(pickle.dumps(metadata))  # as a writer of the root would
    size, checksum = file_checksum(path)
    record = read_commit_record(step)
    record.files = [
        dataclasses.replace(e, size=size, checksum=checksum) if e.path == "actor/.metadata" else e
        for e in record.files
    ]
    write_commit_record(step, record)
    why = "more than the role's committed files hold" if declared == "huge" else "cover"
    with pytest.raises(CheckpointError, match=f"tensor {key} .*{why}"):
        export_role(step, "actor", "gpt2", tmp_path / "out")
    assert not (tmp_path / "out").exists()
