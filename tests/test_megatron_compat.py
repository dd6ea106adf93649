"""megatron_compat.split_common_state: its one-walk split must give exactly what
megatron-core's save_preprocess gives (sharded part, common part, container rules), and hand
anything it does not handle (factories, empty flattened ranges, subclasses) to
megatron-core itself. Checked on hand-built state dicts that hit every rule,
and on a real GPT model's and Adam's sharded state dicts in a process of its own (megatron's
parallel state is global).

Also: the `metadata.json` that the finalizer writes without megatron-core (torch_dist_dir) is
read by megatron-core as its own and starts with what its save_config writes (byte for byte
on 0.16; 0.19 writes fewer fields)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    maybe_load_config,
    save_config,
)
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from torch.distributed.checkpoint.metadata import Metadata

from verl_ckpt.format import megatron_compat, torch_dist_dir

REPO_ROOT = Path(__file__).resolve().parent.parent


def described(x):
    """The structure with each leaf replaced by what identifies it (leaves of two builds of
    the same state are different objects)."""
    if isinstance(x, dict):
        return {key: described(value) for key, value in x.items()}
    if isinstance(x, list):
        return [described(value) for value in x]
    if isinstance(x, ShardedBase):
        return (type(x).__name__, x.key, tuple(x.global_offset), x.replica_id)
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.flatten()[:3].tolist())
    return x


def assert_same_split(build) -> tuple[dict, dict, list]:
    """split_common_state(build()) equals save_preprocess(build()), items included."""
    sharded, common, items = megatron_compat.split_common_state(build())
    expected_sharded, expected_common = save_preprocess(build(), validate_access_integrity=False)
    assert described(sharded) == described(expected_sharded)
    assert described(common) == described(expected_common)
    assert described(items) == described(list(nested_values(expected_sharded)))
    assert all(a is b for a, b in zip(items, nested_values(sharded), strict=True))
    return sharded, common, items


def tensor(key: str, n: int = 4, rank: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.arange(float(n)) + rank, (0, rank, 2))


def plain_state() -> dict:
    return {
        "model": {
            "layer.weight": tensor("layer.weight"),
            "layer.bias": tensor("layer.bias", 2),
            "buffers": [
                tensor("b0"),
                [],
                {},
                [tensor("b1"), 3],
                {"x": tensor("b2"), "y": 1},
                [tensor("b3")],
                {"z": tensor("b4")},
            ],
            "empty": {},
            "empty_list": [],
            "nested_empty": {"a": {}, "b": [[]]},
        },
        "optimizer": {
            "state": {"exp_avg": {"w": tensor("optimizer.exp_avg.w")}},
            "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)}],
            "step_tensor": torch.tensor([3.0]),
        },
        "extra": ShardedObject("extra", {"rng": torch.arange(3)}, (2,), (0,), replica_id=0),
        "counters": [1, "two", None, b"3", 4.5, True],
    }


def test_a_plain_state_splits_as_megatron_core_splits_it():
    _, common, items = assert_same_split(plain_state)
    assert [item.key for item in items] == [
        "layer.weight",
        "layer.bias",
        "b0",
        "b1",
        "b2",
        "b3",
        "b4",
        "optimizer.exp_avg.w",
        "extra",
    ]
    assert common["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert common["model"]["empty"] == {} and "layer.weight" not in common["model"]


def with_factory() -> dict:
    state = plain_state()
    state["model"]["fused"] = ShardedTensorFactory(
        "fused",
        torch.arange(4.0),
        lambda key, data, replica_id, flat: {
            "a": ShardedTensor.from_rank_offsets(f"{key}.a", data[:2], replica_id=replica_id),
            "b": ShardedTensor.from_rank_offsets(f"{key}.b", data[2:], replica_id=replica_id),
        },
        lambda parts: torch.cat([parts["a"], parts["b"]]),
    )
    return state


def with_nonpersistent() -> dict:
    state = plain_state()
    state["optimizer"]["local"] = LocalNonpersistentObject({"not": "saved"})
    state["model"]["buffers"].append(LocalNonpersistentObject(7))
    # Containers that only the removal of non-persistent objects empties disappear; those
    # empty from the start stay.
    state["model"]["only_local"] = {"a": LocalNonpersistentObject(1)}
    state["model"]["only_local_list"] = [
        [LocalNonpersistentObject(5)],
        {"d": LocalNonpersistentObject(6)},
    ]
    state["model"]["buffers"].append([LocalNonpersistentObject(2)])
    state["model"]["buffers"].append({"b": LocalNonpersistentObject(3), "c": {}})
    state["model"]["mixed"] = {"x": [LocalNonpersistentObject(4), tensor("m0")], "y": []}
    return state


def with_empty_flattened_range() -> dict:
    state = plain_state()
    empty = tensor("flat.empty")
    empty.flattened_range = slice(2, 2)  # megatron-core drops these before saving
    state["model"]["flat"] = empty
    return state


@pytest.mark.parametrize("build", [plain_state, with_nonpersistent])
def test_states_without_factories_take_the_one_walk(build, monkeypatch):
    assert_same_split(build)

    def not_expected(*_args, **_kwargs):
        raise AssertionError("megatron-core's save_preprocess ran")

    monkeypatch.setattr(megatron_compat, "save_preprocess", not_expected)
    megatron_compat.split_common_state(build())


@pytest.mark.parametrize(
    "build, wanted",
    [(with_factory, {"fused.a", "fused.b"}), (with_empty_flattened_range, set())],
    ids=["factory", "empty-flattened-range"],
)
def test_what_only_megatron_core_handles_is_left_to_it(build, wanted, monkeypatch):
    _, _, items = assert_same_split(build)
    keys = {item.key for item in items}
    assert wanted <= keys and "flat.empty" not in keys
    calls = []
    real = megatron_compat.save_preprocess
    monkeypatch.setattr(
        megatron_compat, "save_preprocess", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    megatron_compat.split_common_state(build())
    assert calls == [1]


def run_with_megatron(body: str) -> None:
    """Run `body` in a Python process of its own (megatron's parallel state and the process
    group are global), with this checkout importable, torch imported as `torch`,
    recipes.megatron_cpu as `mc` and a one-rank process group set up; it must exit 0 and
    print a line starting with "ok"."""
    script = f"""
import socket, sys
sys.path[:0] = [{str(REPO_ROOT)!r}]
import torch
from recipes import megatron_cpu as mc
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
mc.init_distributed(0, 1, port)
"""
    done = subprocess.run(
        [sys.executable, "-c", script + body], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout


# For run_with_megatron: a tiny megatron GPT and its Adam state after one step.
TINY_GPT_AFTER_ONE_STEP = """
from verl_ckpt.format import megatron_compat
shape = mc.TinyGPTConfig(hidden_size=64, num_layers=2, ffn_hidden_size=128)
model = mc.build_tiny_gpt(shape, seed=1)
optimizer = mc.make_adam(model)
for p in model.parameters():
    p.grad = torch.ones_like(p)
optimizer.step()
"""


def test_a_real_gpt_and_adam_state_splits_as_megatron_core_splits_it():
    run_with_megatron(
        TINY_GPT_AFTER_ONE_STEP
        + """
from tests.test_megatron_compat import assert_same_split
def build():
    return {
        "model": model.sharded_state_dict(),
        "optimizer": mc.optimizer_sharded_state_dict(model, optimizer),
    }
_, common, items = assert_same_split(build)
assert len(items) > 20 and "param_groups" in str(common), (len(items), common)
# The fast walk ran: the model holds a non-persistent object, and no factory.
megatron_compat.save_preprocess = None
megatron_compat.split_common_state(build())
print("ok", len(items))
"""
    )


def test_the_optimizer_state_from_the_models_own_sharded_dict_is_the_same_state():
    """A save builds the model's sharded dict once and hands it to the optimizer's as well
    (recipes/workers.py, as megatron's optimizer.sharded_state_dict takes it): the optimizer
    state is the same as from a dict of its own, and the model's dict is left as it was."""
    run_with_megatron(
        TINY_GPT_AFTER_ONE_STEP
        + """
def described(state):
    _, common, items = megatron_compat.split_common_state(state)
    return repr(common), [
        (type(i).__name__, i.key, i.replica_id, getattr(i, "global_shape", None),
         getattr(i, "global_offset", None), torch.is_tensor(getattr(i, "data", None))
         and i.data.data_ptr())
        for i in items
    ]
model_dict = model.sharded_state_dict()
before = described({"model": model_dict})
shared = mc.optimizer_sharded_state_dict(model, optimizer, model_dict)
alone = mc.optimizer_sharded_state_dict(model, optimizer)
assert described({"optimizer": shared}) == described({"optimizer": alone})
assert len(described({"optimizer": shared})[1]) > 20
assert described({"model": model_dict}) == before
print("ok")
"""
    )


def test_the_finalizers_metadata_json_is_what_megatron_core_writes(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    made = torch_dist_dir.metadata_file_bytes(ours, Metadata(state_dict_metadata={}), [])
    torch_dist_dir.complete_role_dir(ours, made)
    save_config(CheckpointingConfig(*torch_dist_dir.BACKEND), str(theirs))
    # megatron-core reads ours as its own config; ours starts with every field it writes
    # (0.16: the same four, the same bytes; 0.19: its two, then the two it ignores).
    assert maybe_load_config(str(ours)) == maybe_load_config(str(theirs))
    assert maybe_load_config(str(ours)) == CheckpointingConfig(*torch_dist_dir.BACKEND)
    ours_fields = list(json.loads((ours / "metadata.json").read_text()).items())
    theirs_fields = list(json.loads((theirs / "metadata.json").read_text()).items())
    assert ours_fields[: len(theirs_fields)] == theirs_fields
    assert sorted(p.name for p in ours.iterdir()) == sorted(torch_dist_dir.METADATA_FILENAMES)


# megatron-core 0.19's CheckpointingConfig (it needs Python 3.12, so it cannot be installed
# beside 0.16 here): the two common_backend fields are gone. A release is stood in for by
# replacing the dataclass before megatron_compat is imported, in a process of its own.
_RELEASE_CONFIG_SCRIPT = """
import dataclasses
from megatron.core.dist_checkpointing import core

@dataclasses.dataclass
class CheckpointingConfig:
    sharded_backend: str
    sharded_backend_version: int = 1
{extra_field}

core.CheckpointingConfig = CheckpointingConfig
import verl_ckpt.format.megatron_compat
print("imported")
"""


@pytest.mark.parametrize(
    ("extra_field", "imports"), [("", True), ("    sharded_layout: str = 'flat'", False)]
)
def test_a_release_that_writes_fewer_fields_imports_and_another_field_is_refused(
    extra_field, imports
):
    """On 0.19.2 (an H200 machine, Python 3.12) megatron_compat refused to import: the guard
    wanted 0.16's four fields byte for byte, although 0.19 reads the four-field file (it
    ignores unknown fields) and 0.16 reads 0.19's two (defaults)."""
    done = subprocess.run(
        [sys.executable, "-c", _RELEASE_CONFIG_SCRIPT.format(extra_field=extra_field)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    if imports:
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().endswith("imported")
    else:
        assert done.returncode != 0
        assert "'sharded_layout': 'flat'" in done.stderr
        assert "update torch_dist_dir" in done.stderr


def test_I7_one_plan_metadata_shared_by_steps_gives_each_its_own_metadata_file(tmp_path):
    """The finalizer hands every step of a plan the same unpickled metadata
    (reports.GlobalMetadataCache): making a step's `.metadata` from it must leave it
    unchanged, and each step's `.metadata` must describe that step's directory and files."""
    shared = Metadata(state_dict_metadata={})
    for step in (1, 2):
        directory = tmp_path / f"global_step_{step}" / "actor"
        directory.mkdir(parents=True)
        made = torch_dist_dir.metadata_file_bytes(directory, shared, [])
        torch_dist_dir.complete_role_dir(directory, made)
        with open(directory / ".metadata", "rb") as f:
            written = pickle.load(f)
        assert Path(written.storage_meta.checkpoint_id) == directory
        assert written.storage_data == {}
    assert shared.storage_meta is None and shared.storage_data is None


def test_I7_the_metadata_file_is_what_dcps_own_finish_writes(tmp_path):
    """The finalizer makes `.metadata` by running DCP's own finish against a filesystem that
    keeps the bytes (torch_dist_dir.metadata_file_bytes), then writes them itself: the same
    metadata as DCP's finish writing the file, naming the new directory, and loadable."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.storage import WriteResult

    state = {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    dcp.save(state, checkpoint_id=theirs, no_dist=True)
    with open(theirs / ".metadata", "rb") as f:
        written_by_dcp = pickle.load(f)
    results = [
        WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
        for index, info in written_by_dcp.storage_data.items()
    ]
    plan = Metadata(
        state_dict_metadata=written_by_dcp.state_dict_metadata,
        planner_data=written_by_dcp.planner_data,
    )
    ours.mkdir()
    for data_file in theirs.glob("*.distcp"):
        (ours / data_file.name).write_bytes(data_file.read_bytes())
    torch_dist_dir.complete_role_dir(
        ours, torch_dist_dir.metadata_file_bytes(ours, plan, [results])
    )
    with open(ours / ".metadata", "rb") as f:
        written_by_us = pickle.load(f)
    for field in ("state_dict_metadata", "storage_data", "planner_data", "version"):
        assert getattr(written_by_us, field) == getattr(written_by_dcp, field), field
    assert Path(written_by_us.storage_meta.checkpoint_id) == ours
    assert plan.storage_data is None  # the caller's metadata is left as it was
    loaded = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.load(loaded, checkpoint_id=ours, no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def megatron_core_saved_step(directory: Path, with_object: bool = False) -> str:
    """Lines for run_with_megatron that define `built(seed, ffn=128)` (a tiny GPT and its
    Adam after one step), `template(model, optimizer)` (their sharded state dicts, and with
    `with_object` a per-rank ShardedObject `extra`, which a load leaves to DCP's path) and
    `saved_model, saved_optimizer` (seed 1), saved into `directory` in the torch_dist layout
    as megatron-core's save writes it (its own save calls CUDA on the way,
    notes/megatron-core.md): its split of the common part, its conversion for DCP, DCP's
    save with its planner, its metadata.json."""
    return f"""
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import torch as mt
def built(seed, ffn=128):
    shape = mc.TinyGPTConfig(hidden_size=64, num_layers=2, ffn_hidden_size=ffn)
    model = mc.build_tiny_gpt(shape, seed=seed)
    optimizer = mc.make_adam(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(seed))
    optimizer.step()
    return model, optimizer
def template(model, optimizer):
    state = {{"model": model.sharded_state_dict(),
              "optimizer": mc.optimizer_sharded_state_dict(model, optimizer)}}
    if {with_object!r}:
        state["extra"] = ShardedObject("extra", {{"seed": 7}}, (1,), (0,), replica_id=0)
    return state
saved_model, saved_optimizer = built(seed=1)
sharded, common = save_preprocess(template(saved_model, saved_optimizer), False)
torch.save(common, {str(directory / "common.pt")!r})
sharded, _, _ = mt._replace_state_dict_keys_with_sharded_keys(sharded)
dcp.save(mt.mcore_to_pyt_state_dict(sharded), checkpoint_id={str(directory)!r},
         planner=mt.MCoreSavePlanner(flatten_state_dict=False), no_dist=True)
save_config(CheckpointingConfig("torch_dist", 1), {str(directory)!r})
"""


def test_I4_whole_chunks_load_without_a_dcp_plan_and_mismatches_still_fail_in_megatron_core(
    tmp_path,
):
    """load_role_dir of a step saved by megatron-core itself (a real GPT and Adam): every
    tensor that receives a saved chunk whole is read with no DCP load plan (DCP's
    load sees none of them), and every value comes back. A model of another
    shape still fails in megatron-core's own shape check, naming the key. Before, every
    tensor went through DCP's load planning."""
    run_with_megatron(
        megatron_core_saved_step(tmp_path)
        + f"""
from megatron.core.dist_checkpointing.strategies import torch as mt
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from verl_ckpt.format import megatron_compat
from verl_ckpt.format.load_stats import PhaseClock
PHASES = ["megatron-core: before the strategy", "megatron-core: conversion for DCP",
          "checkpoint metadata", "matching saved chunks", "reads in place",
          "DCP's path (the rest)", "megatron-core: unwrapping",
          "megatron-core: after the strategy"]
planned = []
real_dcp_load = megatron_compat._dcp_load_locally
def spy(state_dict, *args, **kwargs):
    planned.extend(k for k, v in state_dict.items() if isinstance(v, torch.Tensor))
    return real_dcp_load(state_dict, *args, **kwargs)
megatron_compat._dcp_load_locally = spy
model, optimizer = built(seed=2)
clock = PhaseClock()
loaded, read_in_place = megatron_compat.load_role_dir(
    template(model, optimizer), {str(tmp_path)!r}, clock)
assert not planned, planned
# megatron-core's conversion asked its torch-version check, memoised, once per tensor.
assert mt.is_torch_min_version.cache_info().hits > 0, mt.is_torch_min_version.cache_info()
# Every tensor of the template was read in place, and the clock saw each phase, in order.
tensors = [t for t in nested_values(template(model, optimizer)) if isinstance(t, ShardedTensor)]
assert read_in_place == len(tensors) > 0, (read_in_place, len(tensors))
assert list(clock.wall_s) == PHASES, list(clock.wall_s)
assert clock.wall_s["reads in place"] > 0 and clock.cpu_s["checkpoint metadata"] > 0, clock.wall_s
expected = saved_model.state_dict()
got = model.state_dict()
for key, value in expected.items():
    if isinstance(value, torch.Tensor):
        assert torch.equal(got[key], value), key
mc.load_optimizer_state(model, optimizer, loaded["optimizer"])
for p, q in zip(saved_model.parameters(), model.parameters()):
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(saved_optimizer.state[p][name], optimizer.state[q][name]), name
other, other_optimizer = built(seed=3, ffn=256)
try:
    megatron_compat.load_role_dir(template(other, other_optimizer), {str(tmp_path)!r})
except BaseException as exc:  # megatron-core's error inside DCP's (a BaseException)
    assert "Global shape mismatch" in str(exc), exc
    assert "decoder.layers.mlp.linear_fc1.weight" in str(exc), exc
    print("ok", len(planned), str(exc)[:200])
else:
    raise AssertionError("a model of another shape loaded")
"""
    )


def test_a_load_through_both_paths_warns_nothing_from_verl_ckpts_own_calls(tmp_path):
    """A resume printed two FutureWarnings on every rank, both raised by verl_ckpt's own
    calls into torch: ShardedTensor's `size()` (torch deprecates its ShardedTensor) while
    matching saved chunks, and DCP's deprecated `load_state_dict` for what is left to DCP's
    path (here an object). Both paths run here: stacked layers are torch ShardedTensors in
    megatron-core's conversion, and the ShardedObject goes through DCP."""
    run_with_megatron(
        megatron_core_saved_step(tmp_path, with_object=True)
        + f"""
import warnings
from pathlib import Path
from verl_ckpt.format import megatron_compat
model, optimizer = built(seed=2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded, read_in_place = megatron_compat.load_role_dir(
        template(model, optimizer), {str(tmp_path)!r})
assert loaded["extra"] == {{"seed": 7}}, loaded["extra"]
assert read_in_place > 0
package = Path(megatron_compat.__file__).parent
ours = [f"{{w.filename}}:{{w.lineno}}: {{w.message}}" for w in caught
        if Path(w.filename).resolve().is_relative_to(package)]
assert not ours, ours
print("ok", len(caught))
"""
    )


def test_megatron_cores_torch_version_check_is_memoised_and_answers_as_its_own():
    """megatron-core's torch strategy asks `is_torch_min_version("2.6a0")` for every tensor
    it converts for DCP (every load, every save plan), parsing the version with `packaging`
    each time; megatron_compat memoises it in that module. Same answers as megatron-core's
    own function (the load test above checks that megatron-core's load asks the memoised
    one)."""
    from megatron.core import utils
    from megatron.core.dist_checkpointing.strategies import torch as mt

    check = mt.is_torch_min_version
    assert check is not utils.is_torch_min_version and hasattr(check, "cache_info")
    for version in ("2.6a0", "1.0", "99.0", torch.__version__.split("+")[0]):
        for equality in (True, False):
            assert check(version, equality) == utils.is_torch_min_version(version, equality)


# The public sharding API (ShardedTensor, ShardedObject, ...) is what a trainer itself builds
# its state dicts with; every other megatron-core module is an internal of its release.
_PUBLIC_MEGATRON = {"megatron.core.dist_checkpointing.mapping"}


def test_megatron_core_internals_are_imported_by_megatron_compat_only():
    """docs/limits.md: a release that moves megatron-core's internals needs changes in
    format/megatron_compat.py only. Every other module of the package imports at most its
    public sharding API."""
    import ast

    package = REPO_ROOT / "verl_ckpt"
    compat = package / "format" / "megatron_compat.py"
    elsewhere = []
    for path in sorted(package.rglob("*.py")):
        if path == compat:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "megatron" and name not in _PUBLIC_MEGATRON:
                    elsewhere.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
    assert not elsewhere, "megatron-core internals outside megatron_compat.py: " + ", ".join(
        elsewhere
    )
