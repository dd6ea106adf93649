"""The built-in mapping: megatron-core GPTModel with the GPT-2 architecture -> GPT2LMHeadModel.

GPT-2 is what the toy recipe trains (recipes/megatron_cpu.py build_tiny_gpt): learned absolute
positions, pre-LayerNorm blocks, exact-erf GELU MLP (megatron-core's default activation;
Hugging Face's "gelu"), biases on every linear layer, embeddings tied to the output layer or
not (config.json's tie_word_embeddings says which).

Layouts (megatron-core 0.16, read as global tensors, layers stacked on dimension 0):
- linear_qkv.weight [L, G * (Q + 2) * d, h]: per query group g, its Q query heads, then one key
  and one value head (attention.py get_query_key_value_tensors). GPT-2 has one query per group
  (G = heads). Hugging Face's c_attn wants all queries, then all keys, then all values.
- Hugging Face GPT-2 uses Conv1D, whose weight is [in, out]: the transpose of a Linear's.
- The layer norms live under the fused names megatron-core uses for every layer spec:
  linear_qkv.layer_norm_* is the block's first norm (ln_1), linear_fc1.layer_norm_* its second.

Protocol step E (export), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl_ckpt.hf.mapping import TensorRule

__all__ = ["GPT2Mapping", "split_fused_qkv"]

_LAYER = "decoder.layers."


def split_fused_qkv(
    fused: torch.Tensor, query_groups: int, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(queries, keys, values) of a megatron-core linear_qkv weight [G*(Q+2)*d, ...] or bias,
    each with its heads in order along dimension 0."""
    per_group = heads // query_groups
    grouped = fused.reshape(query_groups, per_group + 2, -1, *fused.shape[1:])
    rest = fused.shape[1:]
    query = grouped[:, :per_group].reshape(-1, *rest)
    key = grouped[:, per_group].reshape(-1, *rest)
    value = grouped[:, per_group + 1].reshape(-1, *rest)
    return query, key, value


class GPT2Mapping:
    """megatron-core GPTModel (GPT-2 architecture) -> transformers GPT2LMHeadModel."""

    name = "gpt2"

    def unsupported(self, spec: dict[str, Any]) -> list[str]:
        t = spec.get("transformer", {})
        heads, hidden = t.get("num_attention_heads"), t.get("hidden_size")
        wanted: list[tuple[str, Any, Any]] = [
            ("model_class", spec.get("model_class", "").rsplit(".", 1)[-1], "GPTModel"),
            ("position_embedding_type", spec.get("position_embedding_type"), "learned_absolute"),
            ("normalization", t.get("normalization"), "LayerNorm"),
            ("activation", t.get("activation"), "gelu"),
            ("gated_linear_unit", bool(t.get("gated_linear_unit")), False),
            ("add_bias_linear", t.get("add_bias_linear"), True),
            ("qk_layernorm", bool(t.get("qk_layernorm")), False),
            ("layernorm_zero_centered_gamma", bool(t.get("layernorm_zero_centered_gamma")), False),
            (
                "apply_residual_connection_post_layernorm",
                bool(t.get("apply_residual_connection_post_layernorm")),
                False,
            ),
            ("softmax_scale", t.get("softmax_scale"), None),
            ("num_moe_experts", t.get("num_moe_experts"), None),
            ("multi_latent_attention", bool(t.get("multi_latent_attention")), False),
            ("num_query_groups", t.get("num_query_groups") or heads, heads),
        ]
        problems = [
            f"{name}={found!r} (GPT-2 has {expected!r})"
            for name, found, expected in wanted
            if found != expected
        ]
        if not heads or not hidden or hidden % heads:
            problems.append(f"hidden_size={hidden!r} is not a multiple of heads={heads!r}")
        elif t.get("kv_channels") not in (None, hidden // heads):
            problems.append(f"kv_channels={t.get('kv_channels')!r} (GPT-2 has hidden/heads)")
        return problems

    def rules(self, spec: dict[str, Any]) -> list[TensorRule]:
        t = spec["transformer"]
        heads = t["num_attention_heads"]
        layers = t["num_layers"]

        def qkv(fused: torch.Tensor) -> torch.Tensor:
            # Linear layout [3h(, h)] in Hugging Face's order; transposed for Conv1D below.
            return torch.cat(split_fused_qkv(fused, heads, heads), dim=0)

        def stacked(source: str, target: str, transform: Callable) -> TensorRule:
            return TensorRule(_LAYER + source, _per_layer(layers, target, transform))

        def plain(tensor: torch.Tensor) -> torch.Tensor:
            return tensor

        rules = [
            TensorRule("embedding.word_embeddings.weight", _single("transformer.wte.weight")),
            TensorRule("embedding.position_embeddings.weight", _single("transformer.wpe.weight")),
            stacked("self_attention.linear_qkv.layer_norm_weight", "ln_1.weight", plain),
            stacked("self_attention.linear_qkv.layer_norm_bias", "ln_1.bias", plain),
            stacked("self_attention.linear_qkv.weight", "attn.c_attn.weight", lambda w: qkv(w).t()),
            stacked("self_attention.linear_qkv.bias", "attn.c_attn.bias", qkv),
            stacked("self_attention.linear_proj.weight", "attn.c_proj.weight", lambda w: w.t()),
            stacked("self_attention.linear_proj.bias", "attn.c_proj.bias", plain),
            stacked("mlp.linear_fc1.layer_norm_weight", "ln_2.weight", plain),
            stacked("mlp.linear_fc1.layer_norm_bias", "ln_2.bias", plain),
            stacked("mlp.linear_fc1.weight", "mlp.c_fc.weight", lambda w: w.t()),
            stacked("mlp.linear_fc1.bias", "mlp.c_fc.bias", plain),
            stacked("mlp.linear_fc2.weight", "mlp.c_proj.weight", lambda w: w.t()),
            stacked("mlp.linear_fc2.bias", "mlp.c_proj.bias", plain),
            TensorRule("decoder.final_layernorm.weight", _single("transformer.ln_f.weight")),
            TensorRule("decoder.final_layernorm.bias", _single("transformer.ln_f.bias")),
        ]
        if not spec["share_embeddings_and_output_weights"]:
            # Tied embeddings have no output_layer.weight: Hugging Face ties lm_head to wte.
            rules.append(TensorRule("output_layer.weight", _single("lm_head.weight")))
        return rules

    def hf_config(self, spec: dict[str, Any], dtype: str) -> dict[str, Any]:
        t = spec["transformer"]
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": spec["vocab_size"],
            "n_positions": spec["max_sequence_length"],
            "n_embd": t["hidden_size"],
            "n_layer": t["num_layers"],
            "n_head": t["num_attention_heads"],
            "n_inner": t["ffn_hidden_size"],
            "activation_function": "gelu",
            "layer_norm_epsilon": t["layernorm_epsilon"],
            "tie_word_embeddings": spec["share_embeddings_and_output_weights"],
            # What the trained model computes: no dropout at inference, 1/sqrt(d) scaling.
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            # GPT-2's defaults (50256) lie outside a smaller vocabulary.
            "bos_token_id": None,
            "eos_token_id": None,
            "dtype": dtype,
        }


def _single(target: str) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    return lambda tensor: {target: tensor}


def _per_layer(
    layers: int, target: str, transform: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    def convert(stacked: torch.Tensor) -> dict[str, torch.Tensor]:
        if stacked.shape[0] != layers:
            raise ValueError(f"{stacked.shape[0]} layers stacked, the model has {layers}")
        return {f"transformer.h.{i}.{target}": transform(stacked[i]) for i in range(layers)}

    return convert
