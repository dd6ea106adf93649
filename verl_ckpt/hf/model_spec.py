"""The model description saved with each step, so that its Hugging Face weights can be exported
from the committed step alone (`verl-ckpt export`), long after the trainer is gone.

A torch_dist directory holds tensors, not hyper-parameters: the number of attention heads, for
one, cannot be read off a fused QKV weight. Rank 0 of a role writes `verl_ckpt_model.json`
into the role's directory with its files; it is committed in the commit record like them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verl_ckpt.protocol.config import HF_MODEL, CheckpointConfig
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.protocol.versioned_json import parse_versioned_json
from verl_ckpt.store.fsio import read_regular

__all__ = [
    "HEADS",
    "LM_HEAD",
    "MODEL_SPEC_FILENAME",
    "MODEL_SPEC_VERSION",
    "ModelSpecError",
    "VALUE_HEAD",
    "describe_gpt_model",
    "encode_model_spec",
    "exports_role",
    "read_model_spec",
    "write_model_spec",
]

MODEL_SPEC_FILENAME = "verl_ckpt_model.json"
MODEL_SPEC_VERSION = 1
# A model description is a few hundred bytes; a larger file is not ours and is not read.
MODEL_SPEC_MAX_BYTES = 1 << 20
# What the model's output layer gives: next-token logits (a language model, what a Hugging
# Face causal-LM export is), or values read off it (a critic: no language-model head). A
# description without the field (written before it existed) is a language model's.
LM_HEAD = "lm"
VALUE_HEAD = "value"
HEADS = (LM_HEAD, VALUE_HEAD)

# TransformerConfig fields that decide how weights map to another framework's layout.
_TRANSFORMER_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "gated_linear_unit",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "apply_residual_connection_post_layernorm",
    "apply_query_key_layer_scaling",
    "softmax_scale",
    "num_moe_experts",
    "multi_latent_attention",
)


class ModelSpecError(CheckpointError):
    """A step's model description is missing, unreadable or of an unknown version."""


def exports_role(config: CheckpointConfig, role: str) -> bool:
    """Whether `role` gets Hugging Face weights after each commit."""
    return HF_MODEL in config.save_contents and role in config.hf_export.architectures


def describe_gpt_model(model: Any, head: str = LM_HEAD) -> dict[str, Any]:
    """The description of a megatron-core GPTModel (or a wrapper holding one in `.module`)
    that the Hugging Face export needs; pass it to `CheckpointManager.save(model_spec=...)`.
    `head`: what its output layer gives, "lm" (next-token logits) or "value" (a critic's
    values: the export refuses it)."""
    if head not in HEADS:
        raise ModelSpecError(f"head={head!r}: choose one of {', '.join(HEADS)}")
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    config = model.config
    transformer = {name: _plain(getattr(config, name, None)) for name in _TRANSFORMER_FIELDS}
    activation = getattr(config, "activation_func", None)
    transformer["activation"] = _function_name(activation)
    transformer["params_dtype"] = str(getattr(config, "params_dtype", "")).removeprefix("torch.")
    return {
        "format_version": MODEL_SPEC_VERSION,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "vocab_size": int(model.vocab_size),
        "max_sequence_length": int(model.max_sequence_length),
        "position_embedding_type": str(model.position_embedding_type),
        "share_embeddings_and_output_weights": bool(model.share_embeddings_and_output_weights),
        "head": head,
        "transformer": transformer,
    }


def encode_model_spec(spec: dict[str, Any]) -> bytes:
    """The file's bytes; fails naming the problem when `spec` is not plain JSON data."""
    if not isinstance(spec, dict) or spec.get("format_version") != MODEL_SPEC_VERSION:
        raise ModelSpecError(
            f"model_spec must be a dict with format_version {MODEL_SPEC_VERSION} "
            "(build it with verl_ckpt.describe_gpt_model(model))"
        )
    try:
        data = json.dumps(spec, indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"model_spec is not JSON data: {exc}") from None
    # Refused at save(), as read_model_spec would refuse it at every export of the step.
    problem = _shape_problem(spec)
    if problem is not None:
        raise ModelSpecError(f"model_spec is malformed: {problem}")
    return data


def write_model_spec(data: bytes, role_dir: Path, beneath: str | None = None) -> Any:
    """Write the description into the role's directory (fsynced, checksummed, step 3);
    `beneath`: the root it is written below (fsio.open_dir_beneath)."""
    from verl_ckpt.store.checksummed_file import write_checksummed
    from verl_ckpt.store.fsio import WriteOptions

    return write_checksummed(
        role_dir / MODEL_SPEC_FILENAME,
        lambda stream: stream.write(data),
        options=WriteOptions(beneath=beneath),
    )


def read_model_spec(role_dir: Path) -> dict[str, Any]:
    """The description of the model saved in `role_dir`; ModelSpecError naming the file."""
    path = Path(role_dir) / MODEL_SPEC_FILENAME
    try:
        # Bounded, a regular file only: the step's directory is data others may write.
        data = read_regular(path, MODEL_SPEC_MAX_BYTES)
        if data is None:
            raise FileNotFoundError(path)
    except FileNotFoundError:
        raise ModelSpecError(
            f"{path} is missing: the step was saved without a model description (its ranks "
            "must pass model_spec=verl_ckpt.describe_gpt_model(model) to save())"
        ) from None
    except OSError as exc:
        raise ModelSpecError(f"{path} is unreadable: {exc}") from None
    spec = parse_versioned_json(data, str(path), MODEL_SPEC_VERSION, ModelSpecError)
    problem = _shape_problem(spec)
    if problem is not None:
        raise ModelSpecError(f"{path} is malformed: {problem}")
    return spec


# The fields a mapping reads (describe_gpt_model writes them all), and their JSON types: a
# description is data from the checkpoint, checked before a mapping indexes into it.
_POSITIVE_INT = "a positive integer"
_SPEC_FIELDS = {
    "vocab_size": _POSITIVE_INT,
    "max_sequence_length": _POSITIVE_INT,
    "share_embeddings_and_output_weights": bool,
}
# Read when present (a mapping compares them with what it supports).
_OPTIONAL_STRINGS = ("model_class", "position_embedding_type")
_REQUIRED_TRANSFORMER_FIELDS = {
    "num_layers": _POSITIVE_INT,
    "hidden_size": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
}


def _shape_problem(spec: dict[str, Any]) -> str | None:
    """What is wrong with the shape of a parsed description (None: nothing)."""
    for name, kind in _SPEC_FIELDS.items():
        problem = _field_problem(name, spec.get(name), kind)
        if problem:
            return problem
    for name in _OPTIONAL_STRINGS:
        if name in spec and not isinstance(spec[name], str):
            return f"{name} must be a string, not {spec[name]!r:.80}"
    if spec.get("head", LM_HEAD) not in HEADS:
        return f"head must be one of {', '.join(HEADS)}, not {spec.get('head')!r:.80}"
    transformer = spec.get("transformer")
    if not isinstance(transformer, dict):
        return f"transformer must be an object, not {transformer!r:.80}"
    for name, kind in _REQUIRED_TRANSFORMER_FIELDS.items():
        problem = _field_problem(f"transformer.{name}", transformer.get(name), kind)
        if problem:
            return problem
    # The fields a mapping compares (GPT-2's unsupported()) must be JSON scalars; others a
    # plug-in mapping may shape as it needs.
    for name in (*_TRANSFORMER_FIELDS, "activation", "params_dtype"):
        value = transformer.get(name)
        if value is not None and not isinstance(value, bool | int | float | str):
            return f"transformer.{name} must be a number, a string or null, not {value!r:.80}"
    return None


def _field_problem(name: str, value: Any, kind: type | str) -> str | None:
    if kind == _POSITIVE_INT:
        if type(value) is int and value > 0:
            return None
        return f"{name} must be {_POSITIVE_INT}, not {value!r:.80}"
    if isinstance(value, kind):  # type: ignore[arg-type]
        return None
    return f"{name} must be a {kind.__name__}, not {value!r:.80}"  # type: ignore[union-attr]


def _plain(value: Any) -> Any:
    """A JSON value for a config field (enums and dtypes by name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _function_name(function: Any) -> str | None:
    """`gelu` for torch's exact GELU (what megatron-core uses by default), else the
    function's module and name, which a mapping can recognise or refuse."""
    if function is None:
        return None
    import torch.nn.functional as F

    if function is F.gelu:
        return "gelu"
    module = getattr(function, "__module__", None) or ""
    return f"{module}.{getattr(function, '__qualname__', repr(function))}".lstrip(".")
