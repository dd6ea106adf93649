"""The whole sharded structure of a rank's state, as a value compared with `==`.

The staging buffers and the save plan are reused only while this description is unchanged
(and each rank of the save group states whether its own is): a changed shape, offset, dtype
or replica id must never reuse a stale plan (megatron-core's own cache does, and then
writes stale metadata). It is only ever compared with the description this process cached
at its last planning, so it is kept as it is, neither serialised nor hashed: equality of
tuples of strings, integers, torch dtypes and None is exact, and costs a deferred save() a
fraction of what pickling it for a hash did.

Protocol step 1 (plan): the key of the plan cache, verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor

__all__ = ["Structure", "describe_structure"]

# One tuple per shard, in the order of the state's items.
Structure = tuple[tuple, ...]


def _describe(item: ShardedBase) -> tuple:
    # tuple() of a tuple is the tuple itself; it copies a list, which a caller could still
    # change after the description was cached.
    if isinstance(item, ShardedTensor):
        flat = item.flattened_range
        data = item.data
        return (
            "tensor",
            item.key,
            tuple(item.local_shape),
            tuple(item.global_shape),
            tuple(item.global_offset),
            tuple(item.axis_fragmentations),
            item.dtype,
            data.dtype if data is not None else None,
            tuple(data.shape) if data is not None else None,
            item.replica_id,
            (flat.start, flat.stop) if flat is not None else None,
        )
    return (
        "object",
        item.key,
        tuple(item.global_shape),
        tuple(item.global_offset),
        item.replica_id,
    )


def describe_structure(items: Iterable[ShardedBase]) -> Structure:
    """Every shard's key, shapes, offsets, dtypes, flattening and replica id."""
    return tuple(_describe(item) for item in items)
