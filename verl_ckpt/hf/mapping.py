"""How a megatron-core model becomes Hugging Face weights: the mapping interface and registry.

A mapping says, for one architecture, which megatron-core tensors it reads and what each one
becomes: a `TensorRule` per megatron-core key, whose `convert` turns the global tensor (read
whole from the committed torch_dist directory, so tensor-parallel shards are already merged)
into one or more Hugging Face tensors (fused QKV split, transposes, per-layer slices). The
exporter refuses to write anything unless the rules cover every model tensor of the step:
an architecture a mapping does not know is one error, never a partial export.

Mappings are found by name: `gpt2` is built in (verl_ckpt/hf/gpt2.py); other packages add
theirs through the `verl_ckpt.hf_mappings` entry point group, e.g. in their pyproject.toml

    [project.entry-points."verl_ckpt.hf_mappings"]
    llama = "my_package.llama_mapping:LlamaMapping"

where `LlamaMapping()` builds an object with the methods of `HFMapping` (it may wrap an
installed converter library's per-tensor functions in its rules).

Protocol step E (export), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from verl_ckpt.protocol.errors import CheckpointConfigError, CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENTRY_POINT_GROUP",
    "HFMapping",
    "TensorRule",
    "UnsupportedModelError",
    "check_architecture",
    "get_mapping",
    "known_architectures",
    "register_mapping",
]

ENTRY_POINT_GROUP = "verl_ckpt.hf_mappings"
# Built-in mappings, imported only when asked for (they import torch).
_BUILTIN = {"gpt2": "verl_ckpt.hf.gpt2:GPT2Mapping"}
_REGISTERED: dict[str, Callable[[], HFMapping]] = {}


class UnsupportedModelError(CheckpointError):
    """The saved model does not fit the mapping; nothing was written."""


@dataclass(frozen=True)
class TensorRule:
    """One megatron-core tensor of the step and the Hugging Face tensors it becomes."""

    # The key in the torch_dist directory's .metadata, e.g.
    # "decoder.layers.self_attention.linear_qkv.weight" (layers stacked on dimension 0).
    source: str
    # The global tensor -> {Hugging Face key: tensor}.
    convert: Callable[[torch.Tensor], dict[str, torch.Tensor]]


class HFMapping(Protocol):
    """What a mapping provides; `spec` is the step's model description (model_spec.py)."""

    name: str

    def unsupported(self, spec: dict[str, Any]) -> list[str]:
        """Every reason this mapping cannot convert the described model; empty if it can."""
        ...

    def rules(self, spec: dict[str, Any]) -> list[TensorRule]:
        """One rule per megatron-core model tensor, covering all of them."""
        ...

    def hf_config(self, spec: dict[str, Any], dtype: str) -> dict[str, Any]:
        """The contents of config.json (`dtype`: the tensors' dtype, e.g. "float32")."""
        ...


def register_mapping(name: str, factory: Callable[[], HFMapping]) -> None:
    """Make a mapping available under `name` in this process (entry points do it for every
    process, the finalizer's export tasks included: prefer them)."""
    _REGISTERED[name] = factory


def known_architectures() -> list[str]:
    """Every mapping name: built in, registered here, and installed through entry points."""
    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(set(_BUILTIN) | set(_REGISTERED) | installed)


def get_mapping(name: str, key: str = "architecture") -> HFMapping:
    """The mapping called `name`; CheckpointConfigError naming `key` if there is none."""
    if name in _REGISTERED:
        return _REGISTERED[name]()
    if name in _BUILTIN:
        module, _, attribute = _BUILTIN[name].partition(":")
        return getattr(importlib.import_module(module), attribute)()
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return entry.load()()
    raise _unknown(name, key)


def check_architecture(name: str, key: str = "architecture") -> None:
    """Fail naming `key` unless a mapping called `name` exists (imports none of them)."""
    if name not in known_architectures():
        raise _unknown(name, key)


def _unknown(name: str, key: str) -> CheckpointConfigError:
    return CheckpointConfigError(
        f"{key}={name!r} is invalid: no Hugging Face mapping of that name (known: "
        f"{', '.join(known_architectures())}; others install through the "
        f"{ENTRY_POINT_GROUP!r} entry point group)"
    )
