"""The copy of non-tensor state taken inside save() (verl_ckpt/format/object_copy.py, invariant I4):
the quick path gives what copy.deepcopy gives, and whatever it could not reproduce exactly
goes through copy.deepcopy itself."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from verl_ckpt.format import object_copy
from verl_ckpt.format.object_copy import snapshot_copy


def _extra_state() -> dict:
    """What a trainer saves per rank: RNG states, counters, plain settings."""
    return {
        "format": 1,
        "rng": torch.get_rng_state(),
        "generator": torch.Generator().manual_seed(7).get_state(),
        "counters": [3, 4.5, None, True, b"x"],
        "shape": (2, ("a", 1.0)),
        "weights": torch.arange(6, dtype=torch.float64).reshape(2, 3),
    }


def test_plain_state_is_copied_without_deepcopy_and_shares_nothing(monkeypatch):
    original = _extra_state()
    expected = copy.deepcopy(original)

    def no_deepcopy(value, memo=None):
        raise AssertionError("the quick path fell back to copy.deepcopy")

    # A spy, not a fake: it only proves which path ran; the values are checked below.
    monkeypatch.setattr(object_copy.copy, "deepcopy", no_deepcopy)
    copied = snapshot_copy(original)
    monkeypatch.undo()
    original["rng"].add_(1)
    original["weights"].mul_(-1)
    original["counters"].append(5)
    assert copied.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(copied[key], value)
            assert copied[key].dtype == value.dtype and copied[key].stride() == value.stride()
        else:
            assert copied[key] == value and type(copied[key]) is type(value)


@pytest.mark.parametrize(
    "make",
    [
        # Two tensors on one storage: deepcopy keeps them sharing it.
        lambda: (lambda t: {"a": t, "b": t.view(-1)})(torch.zeros(2, 2)),
        # A view of a larger storage: deepcopy copies the whole storage.
        lambda: {"row": torch.arange(8.0).reshape(4, 2)[1]},
        # Autograd state and attributes set on a tensor.
        lambda: {"p": torch.ones(3, requires_grad=True)},
        lambda: {"t": (lambda t: setattr(t, "tag", "x") or t)(torch.ones(2))},
        # Containers and values of other types.
        lambda: collections.OrderedDict(a=torch.ones(2)),
        lambda: {"set": {1, 2}, "t": torch.ones(1)},
        lambda: {(1, 2): [torch.zeros(0)]},
    ],
)
def test_what_the_quick_path_cannot_reproduce_goes_through_deepcopy(make):
    original, expected = make(), copy.deepcopy(make())
    copied = snapshot_copy(original)
    assert type(copied) is type(expected)
    assert _structure(copied) == _structure(expected)


def _structure(value):
    """Values, types, tensor metadata and which tensors share a storage."""
    storages: dict[int, int] = {}

    def walk(v):
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            shared = storages.setdefault(ptr, len(storages)) if v.numel() else None
            return (
                "tensor",
                v.tolist(),
                v.dtype,
                v.stride(),
                v.requires_grad,
                v.is_leaf,
                v.untyped_storage().nbytes(),
                shared,
                dict(v.__dict__),
            )
        if isinstance(v, dict):
            return (type(v), [(k, walk(x)) for k, x in v.items()])
        if isinstance(v, (list, tuple)):
            return (type(v), [walk(x) for x in v])
        return (type(v), v)

    return walk(value)
