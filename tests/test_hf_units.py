"""Hugging Face export pieces without Ray or ranks: the fused QKV split, the GPT-2 mapping's
refusals, the coverage check that prevents partial exports, the config and the export plan."""

from __future__ import annotations

import logging

import pytest
import torch

from verl_ckpt import CheckpointConfig, CheckpointConfigError, UnsupportedModelError
from verl_ckpt.hf.export import _checked_rules, choose_mapping
from verl_ckpt.hf.gpt2 import GPT2Mapping, split_fused_qkv
from verl_ckpt.hf.mapping import get_mapping
from verl_ckpt.hf.model_spec import MODEL_SPEC_VERSION, ModelSpecError, encode_model_spec
from verl_ckpt.hf.scheduler import check_export_config, plan_exports


def gpt2_spec(**transformer) -> dict:
    return {
        "format_version": MODEL_SPEC_VERSION,
        "model_class": "megatron.core.models.gpt.gpt_model.GPTModel",
        "vocab_size": 64,
        "max_sequence_length": 16,
        "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": False,
        "transformer": {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_query_groups": 4,
            "kv_channels": 8,
            "ffn_hidden_size": 64,
            "normalization": "LayerNorm",
            "layernorm_epsilon": 1e-5,
            "activation": "gelu",
            "gated_linear_unit": False,
            "add_bias_linear": True,
            **transformer,
        },
    }


def test_fused_qkv_split_follows_megatron_core_group_layout():
    """Per query group: its query heads, one key head, one value head (attention.py); the
    split returns all queries, then keys, then values, heads in order (here GQA: 4 heads in
    2 groups, head dim 1, each row labelled with what it is)."""
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1  (q=1xx, k=2xx, v=3xx)
    fused = torch.tensor([100, 101, 200, 300, 102, 103, 201, 301], dtype=torch.float32)
    query, key, value = split_fused_qkv(fused, query_groups=2, heads=4)
    assert query.tolist() == [100, 101, 102, 103]
    assert key.tolist() == [200, 201] and value.tolist() == [300, 301]
    weight = fused.unsqueeze(1).expand(8, 3)  # a weight [rows, in] splits by rows the same
    assert split_fused_qkv(weight, 2, 4)[0][:, 0].tolist() == [100, 101, 102, 103]


def test_an_unknown_architecture_is_one_error_naming_every_difference():
    """A Llama-like model (rotary, RMSNorm, SwiGLU, GQA) is refused by gpt2 with every
    reason; with no architecture named, no mapping fits: one error, nothing chosen."""
    llama = gpt2_spec(normalization="RMSNorm", activation="torch.nn.functional.silu")
    llama["position_embedding_type"] = "rope"
    llama["transformer"].update(gated_linear_unit=True, num_query_groups=2)
    problems = GPT2Mapping().unsupported(llama)
    for reason in ("position_embedding_type='rope'", "normalization='RMSNorm'", "activation=",
                   "gated_linear_unit=True", "num_query_groups=2"):  # fmt: skip
        assert any(reason in p for p in problems), (reason, problems)
    with pytest.raises(UnsupportedModelError, match="is not a gpt2 model: position_embedding"):
        choose_mapping(llama, "gpt2", "ckpt/global_step_1/actor")
    with pytest.raises(UnsupportedModelError, match="no Hugging Face mapping fits"):
        choose_mapping(llama, None, "ckpt/global_step_1/actor")
    assert choose_mapping(gpt2_spec(), None, "dir").name == "gpt2"
    with pytest.raises(CheckpointConfigError, match=r"--architecture='llama' is invalid.*gpt2"):
        get_mapping("llama", "--architecture")


def test_a_mapping_that_does_not_cover_every_model_tensor_writes_nothing():
    """Never a partial export: a model tensor the rules do not know (or a rule whose tensor
    the step lacks) is refused before any file is written."""
    spec = gpt2_spec()
    mapping = GPT2Mapping()
    tensors = {rule.source: None for rule in mapping.rules(spec)}
    assert len(_checked_rules(mapping, spec, tensors, "dir")) == len(tensors)
    extra = {**tensors, "decoder.layers.mlp.router.weight": None}
    with pytest.raises(UnsupportedModelError, match="does not know: decoder.layers.mlp.router"):
        _checked_rules(mapping, spec, extra, "dir")
    tied = {k: v for k, v in tensors.items() if k != "output_layer.weight"}
    with pytest.raises(UnsupportedModelError, match="the step lacks: output_layer.weight"):
        _checked_rules(mapping, spec, tied, "dir")
    spec["share_embeddings_and_output_weights"] = True  # tied: lm_head comes from wte
    assert len(_checked_rules(mapping, spec, tied, "dir")) == len(tied)
    assert mapping.hf_config(spec, "float32")["tie_word_embeddings"] is True


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"save_contents": ["hf_model"]}, "checkpoint.save_contents"),
        ({"save_contents": ["optimizer", "hf_model"]}, "checkpoint.save_contents"),
        ({"load_contents": ["model", "hf_model"]}, "checkpoint.load_contents"),
        ({"hf_export": {"max_shard_mb": 0}}, "checkpoint.hf_export.max_shard_mb"),
        ({"hf_export": {"architectures": {"actor": ""}}}, "checkpoint.hf_export.architectures"),
    ],
)
def test_hf_export_config_mistakes_name_the_key(overrides, key):
    with pytest.raises(CheckpointConfigError, match=key.replace(".", r"\.")):
        CheckpointConfig(**overrides)


def test_export_plan_skips_roles_without_a_mapping_once_and_refuses_unknown_roles(caplog):
    """hf_model with {actor: gpt2}: the critic is skipped with one log line; a mapping named
    for a role the job lacks is a typo naming the key; unknown names fail before Ray."""
    config = CheckpointConfig(
        save_contents=["model", "optimizer", "extra", "hf_model"],
        hf_export={"architectures": {"actor": "gpt2"}, "max_shard_mb": 3},
    )
    with caplog.at_level(logging.INFO, logger="verl_ckpt.hf.scheduler"):
        plan = plan_exports(config, ["actor", "critic"])
    assert plan.architectures == {"actor": "gpt2"} and plan.max_shard_bytes == 3 << 20
    skipped = [r.getMessage() for r in caplog.records if "role critic" in r.getMessage()]
    assert len(skipped) == 1 and "not exported" in skipped[0]
    with pytest.raises(CheckpointConfigError, match=r"architectures\.actor='gpt2'.*no role"):
        plan_exports(config, ["policy", "critic"])
    assert plan_exports(CheckpointConfig(hf_export=config.hf_export), ["actor"]) is None
    typo = CheckpointConfig(hf_export={"architectures": {"actor": "gtp2"}})
    with pytest.raises(CheckpointConfigError, match=r"architectures\.actor='gtp2' is invalid"):
        check_export_config(typo)


def test_a_model_description_must_be_versioned_json():
    with pytest.raises(ModelSpecError, match="format_version"):
        encode_model_spec({"vocab_size": 3})
    with pytest.raises(ModelSpecError, match="not JSON data"):
        encode_model_spec({"format_version": MODEL_SPEC_VERSION, "dtype": torch.float32})
    # Found by review: save() took a description that every export would then refuse.
    with pytest.raises(ModelSpecError, match="model_spec is malformed: vocab_size"):
        encode_model_spec({**gpt2_spec(), "vocab_size": "64"})
    assert encode_model_spec(gpt2_spec())


@pytest.mark.parametrize(
    "change, named",
    [
        ({"transformer": "x"}, "transformer"),
        ({"vocab_size": "64"}, "vocab_size"),
        ({"max_sequence_length": True}, "max_sequence_length"),
        ({"share_embeddings_and_output_weights": None}, "share_embeddings_and_output_weights"),
        ({"head": "policy"}, "head"),
        ({"transformer": {"num_layers": 2}}, "transformer.hidden_size"),
        ({"model_class": 3}, "model_class"),
        (
            {"transformer": {**gpt2_spec()["transformer"], "num_layers": [2]}},
            "transformer.num_layers",
        ),
        (
            {"transformer": {**gpt2_spec()["transformer"], "normalization": {}}},
            "transformer.normalization",
        ),
    ],
)
def test_a_malformed_model_description_is_refused_naming_the_file_and_the_field(
    tmp_path, change, named
):
    """Found by review: read_model_spec checked the version only, and a description of
    another shape ({"transformer": "x"}, a missing field) failed later in the export with an
    AttributeError's or KeyError's traceback. A description is data from the checkpoint."""
    import json

    from verl_ckpt.hf.model_spec import MODEL_SPEC_FILENAME, read_model_spec

    (tmp_path / MODEL_SPEC_FILENAME).write_text(json.dumps(gpt2_spec()))
    assert read_model_spec(tmp_path)["vocab_size"] == 64
    (tmp_path / MODEL_SPEC_FILENAME).write_text(json.dumps({**gpt2_spec(), **change}))
    with pytest.raises(ModelSpecError, match=rf"{MODEL_SPEC_FILENAME} is malformed: {named}\b"):
        read_model_spec(tmp_path)


def test_I5_the_export_queue_keeps_a_bounded_number_of_ended_outcomes(tmp_path):
    """Found by review: the finalizer kept the outcome of every export of every committed
    step, for the life of the job (status() and wait_for_exports() returned all of it). The
    exports of 1,000 steps committed back to back (each waiting one superseded by the next)
    leave OUTCOMES_KEPT ended outcomes, the newest, and the one still queued."""
    import asyncio

    from verl_ckpt.hf.scheduler import OUTCOMES_KEPT, ExportPlan, ExportQueue

    async def run() -> list[dict]:
        queue = ExportQueue(tmp_path, ExportPlan({"actor": "GPT2LMHeadModel"}, 1 << 30, 60.0))
        for step in range(1, 1001):
            queue.submit(step)  # the worker has not run yet: each supersedes the one before
        outcomes = queue.outcomes()
        queue.cancel()
        await asyncio.sleep(0)
        return outcomes

    outcomes = asyncio.run(run())
    assert len(outcomes) == OUTCOMES_KEPT + 1
    assert [o["step"] for o in outcomes] == list(range(1000 - OUTCOMES_KEPT, 1001))
    assert outcomes[-1]["state"] == "queued"


def test_an_export_checks_each_declared_tensor_size_before_allocating_it():
    """Found by review: the export allocated whatever size `.metadata` (data from the root)
    declared for a tensor, then read its chunks: a huge size ran the node out of memory, and
    chunks leaving a gap published the allocation's old bytes. Now refused, naming the
    tensor, before any allocation."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from verl_ckpt.hf.export import _check_extents
    from verl_ckpt.protocol.errors import CheckpointError

    def meta(size, *chunks):
        return TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
        )

    whole = meta((4, 6), ((0, 0), (2, 6)), ((2, 0), (2, 6)))
    _check_extents({"w": whole}, 4 * 6 * 4, "role")
    with pytest.raises(CheckpointError, match=r"tensor w of 96 bytes, more than .* \(95 bytes\)"):
        _check_extents({"w": whole}, 95, "role")
    huge = meta((1 << 40, 1 << 20), ((0, 0), (1, 1)))
    with pytest.raises(CheckpointError, match="declares tensor w of"):
        _check_extents({"w": huge}, 1 << 30, "role")
    gap = meta((4, 6), ((0, 0), (2, 6)))
    with pytest.raises(CheckpointError, match="cover 12 of its 24 elements"):
        _check_extents({"w": gap}, 1 << 20, "role")
    outside = meta((4, 6), ((0, 0), (2, 6)), ((3, 0), (2, 6)))
    with pytest.raises(CheckpointError, match="a chunk of tensor w outside its shape"):
        _check_extents({"w": outside}, 1 << 20, "role")
