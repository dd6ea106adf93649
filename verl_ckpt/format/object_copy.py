"""A deep copy of the non-tensor state a save takes inside save() (invariant I4), made
quickly for what trainers put there, and by `copy.deepcopy` for everything else.

A trainer's per-rank extra state is a few dicts and lists of numbers and strings and a few
whole tensors (RNG states, counters). `copy.deepcopy` spends most of its time in its generic
dispatch and in `Tensor.__deepcopy__`; on a deferred save, whose save() is otherwise short,
it was a sixth of the training thread's time. For plain containers of immutable values and
tensors that own their whole storage, a clone per tensor and a rebuilt container give the
same values, dtypes, shapes and strides. Anything that copy could not reproduce exactly (a
shared or partly used storage, a view, a subclass, autograd state, attributes set on a
tensor, any other type) makes the whole value go through `copy.deepcopy`.

Protocol step 2 (stage), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["snapshot_copy"]

_IMMUTABLE = frozenset({int, float, complex, str, bytes, bool, type(None)})


class _NotPlain(Exception):
    """The value holds something only copy.deepcopy reproduces exactly."""


def snapshot_copy(value: Any) -> Any:
    """A copy of `value` that shares no mutable object with it (as copy.deepcopy's)."""
    try:
        return _copy_plain(value, set())
    except _NotPlain:
        return copy.deepcopy(value)


def _copy_plain(value: Any, storages: set[int]) -> Any:
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict:
        copied = {}
        for key, item in value.items():
            if type(key) not in _IMMUTABLE:
                raise _NotPlain
            copied[key] = _copy_plain(item, storages)
        return copied
    if kind is list:
        return [_copy_plain(item, storages) for item in value]
    if kind is tuple:
        return tuple(_copy_plain(item, storages) for item in value)
    if kind is torch.Tensor and _owns_its_storage(value):
        # deepcopy keeps two tensors on one storage sharing it; clones would not.
        storage = value.untyped_storage().data_ptr()
        if storage in storages:
            raise _NotPlain
        storages.add(storage)
        return value.clone()
    raise _NotPlain


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """A whole, dense, contiguous tensor without autograd state or attributes of its own:
    its clone is what deepcopy would make of it."""
    return (
        tensor.layout is torch.strided
        and not tensor.requires_grad
        and tensor.grad is None
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.numel() > 0
        and tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        and not tensor.__dict__
    )
