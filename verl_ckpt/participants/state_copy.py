"""The staging of a declared participant's state (protocol step 2 for a state participant):
a copy taken when save() is called, so that what is saved is the state at that moment
whatever the caller does next (I4), and checked to hold only what a load reads back without
unpickling code (torch.load with weights_only=True)."""

from __future__ import annotations

from typing import Any

import torch

from verl_ckpt.protocol.errors import CheckpointError

__all__ = ["stage_state"]

# Exactly these types (not subclasses: numpy's float64 is a float that weights_only refuses).
_PLAIN = (int, float, str, bool, type(None))


def stage_state(state: Any, where: str = "state") -> Any:
    """A copy of `state`: tensors copied to the host, containers rebuilt. CheckpointError
    naming the first value that is neither a tensor nor a plain Python value, nor a dict
    with str keys, list or tuple of them (`where` is its path in the state)."""
    kind = type(state)
    if isinstance(state, torch.Tensor):
        # Copied, not referenced: the caller may update the tensor in place at once.
        copy = state.detach().to("cpu", copy=True)
        if type(copy) is not torch.Tensor:  # a subclass survives the copy; a load refuses it
            raise CheckpointError(
                f"{where} is a {kind.__module__}.{kind.__qualname__}, a torch.Tensor subclass "
                "that a load cannot read back without unpickling code: save a plain tensor "
                "(torch.Tensor(x) or x.as_subclass(torch.Tensor))"
            )
        return copy
    if kind in _PLAIN:
        return state
    if kind in (list, tuple):
        return kind(stage_state(item, f"{where}[{i}]") for i, item in enumerate(state))
    if kind is dict:
        for key in state:
            if type(key) is not str:
                raise CheckpointError(f"{where} has a key {key!r} that is not a str")
        return {key: stage_state(value, f"{where}[{key!r}]") for key, value in state.items()}
    raise CheckpointError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a participant's state holds "
        "tensors and plain Python values (int, float, str, bool, None; dicts with str keys, "
        "lists and tuples of them), which a load reads back without unpickling code"
    )
