"""A cached plan's write buckets, found in the next save's sharded dict directly.

While the plan is cached (the structure holds, structure.py), megatron-core still converts
the whole sharded dict to DCP's at every save (`mcore_to_pyt_state_dict`: a torch
ShardedTensor or a container per key, most of the save thread's planning CPU) only for
DCP's planner to find each write item's tensor in it again. That tensor is normally a view
of one shard's own data (megatron-core reshapes it, for example to add the prepended layer
axis, and copies only a non-contiguous shard). So the save that converts also learns, for
each tensor write item, which shard it views and how; the next saves take the same view of
that shard's data and skip the conversion. Nothing of the conversion is re-implemented:
what is learnt is what this release's conversion and DCP's planner did, checked against the
shards themselves, and where they copied, nothing is learnt (`WriteResolution.learn`). The
objects (`ShardedObject`) are still serialised by megatron-core, as they may change at every
save.

Protocol step 1 (plan): megatron_compat.plan_save, verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.planner import WriteItem

from verl_ckpt.format.torch_format import StorageGeometry, storage_geometry

__all__ = ["WriteResolution", "see_shards", "writable"]


def writable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a write bucket holds it: a view is cloned, as megatron-core does, since
    `torch.save` of a view writes its whole storage."""
    tensor = tensor.detach()
    is_view = tensor.untyped_storage().nbytes() != tensor.numel() * tensor.itemsize
    return tensor.clone() if is_view else tensor


@dataclass(frozen=True)
class _Shard:
    """One shard's data as the conversion found it."""

    geometry: StorageGeometry
    storage: int  # its storage's address
    global_offset: tuple[int, ...]


# Before megatron-core converts them (it reshapes shards' data in place): by key, each
# shard's place in that key's list, or None for an object.
_SeenShards = dict[str, list[_Shard | None]]


def see_shards(flat: dict[str, list]) -> _SeenShards:
    """Every tensor shard of `flat` (megatron-core's flattened dict: key -> its shards, main
    replicas only), as it is before the conversion."""
    return {
        key: [
            _Shard(
                storage_geometry(s.data),
                s.data.untyped_storage().data_ptr(),
                tuple(s.global_offset),
            )
            if isinstance(s, ShardedTensor) and s.data is not None
            else None
            for s in shards
        ]
        for key, shards in flat.items()
    }


@dataclass(frozen=True)
class _TensorItem:
    item: WriteItem
    key: str
    position: int  # in the key's list of shards
    global_offset: tuple[int, ...]
    # The shard's data as learned (before and after megatron-core reshaped it in place: a
    # staged dict reused by the next save holds the reshaped data).
    accepted: frozenset[StorageGeometry]
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # shape, stride, storage offset


@dataclass(frozen=True)
class _Bucket:
    name: str
    objects: tuple[WriteItem, ...]
    tensors: tuple[_TensorItem, ...]


class WriteResolution:
    """Where each write item of a cached plan is in the sharded dict."""

    def __init__(self, buckets: tuple[_Bucket, ...], files_per_rank: int) -> None:
        self._buckets = buckets
        self._files_per_rank = files_per_rank
        self._object_keys = sorted({item.index.fqn for b in buckets for item in b.objects})

    @classmethod
    def learn(
        cls,
        seen: _SeenShards,
        flat: dict[str, list],
        write_buckets: list,
        views: list[list],
        files_per_rank: int,
    ) -> WriteResolution | None:
        """From a save that converted: `seen` before the conversion, `flat` after it, the
        buckets its planner resolved (split for `files_per_rank`) and, for each bucket, its
        tensors as the planner resolved them (before `writable`). None when a tensor item
        is not a view of exactly one shard's data, in its dtype (megatron-core copied a
        non-contiguous shard, say), and the conversion then runs at every save."""
        buckets = []
        for (_, name, (bytes_data, tensor_data)), resolved in zip(
            write_buckets, views, strict=True
        ):
            tensors = []
            for (item, _), tensor in zip(tensor_data, resolved, strict=True):
                learned = _learn_item(seen, flat, item, tensor)
                if learned is None:
                    return None
                tensors.append(learned)
            objects = tuple(item for item, _ in bytes_data)
            buckets.append(_Bucket(name, objects, tuple(tensors)))
        return cls(tuple(buckets), files_per_rank)

    def write_buckets(
        self,
        flat: dict[str, list],
        checkpoint_dir: Path | str,
        files_per_rank: int,
        convert_objects: Callable[[dict[str, list]], dict[str, Any]],
    ) -> list | None:
        """The buckets over `flat`'s data, as the planner would resolve them; None where a
        shard's data is no longer placed as learned, or the files are split otherwise (the
        caller converts instead). `convert_objects` is megatron-core's conversion for DCP
        (from megatron_compat, the one place that calls its internals)."""
        if files_per_rank != self._files_per_rank or any(k not in flat for k in self._object_keys):
            return None
        found = [[_data_as_learned(flat, spec) for spec in b.tensors] for b in self._buckets]
        if any(data is None for datas in found for data in datas):
            return None
        # megatron-core serialises the objects, as its conversion would (a list of each
        # key's objects' data, one file entry per key).
        objects = convert_objects({key: flat[key] for key in self._object_keys})
        buckets = []
        for bucket, datas in zip(self._buckets, found, strict=True):
            bytes_data = [(item, objects[item.index.fqn]) for item in bucket.objects]
            tensor_data = [
                (spec.item, writable(data.as_strided(*spec.view)))
                for spec, data in zip(bucket.tensors, datas, strict=True)
            ]
            path = os.path.join(checkpoint_dir, bucket.name)
            buckets.append((path, bucket.name, (bytes_data, tensor_data)))
        return buckets


def _data_as_learned(flat: dict[str, list], spec: _TensorItem) -> torch.Tensor | None:
    shards = flat.get(spec.key)
    if shards is None or spec.position >= len(shards):
        return None
    shard = shards[spec.position]
    data = shard.data if isinstance(shard, ShardedTensor) else None
    if (
        data is None
        or tuple(shard.global_offset) != spec.global_offset
        or storage_geometry(data) not in spec.accepted
    ):
        return None
    return data


def _learn_item(
    seen: _SeenShards, flat: dict[str, list], item: WriteItem, tensor: torch.Tensor
) -> _TensorItem | None:
    key = item.index.fqn
    storage = tensor.untyped_storage().data_ptr()
    geometry = storage_geometry(tensor)
    matches = [
        position
        for position, shard in enumerate(seen.get(key, ()))
        if shard is not None
        and shard.storage == storage
        and shard.geometry[0] == geometry[0]  # the same dtype: not a reinterpreting view
        and shard.geometry[3:] == geometry[3:]  # the same offset in a storage of that size
    ]
    if len(matches) != 1:
        return None
    position = matches[0]
    before = seen[key][position]
    after = flat[key][position].data
    # The shard still holds that storage after the conversion: a storage megatron-core
    # copied a shard into could have been given the address of one it freed, and matched it.
    if after.untyped_storage().data_ptr() != storage:
        return None
    return _TensorItem(
        item,
        key,
        position,
        before.global_offset,
        frozenset({before.geometry, storage_geometry(after)}),
        geometry[1:4],  # shape, stride, storage offset
    )
