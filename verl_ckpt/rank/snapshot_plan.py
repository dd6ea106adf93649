"""Step 2's plan (protocol page): which tensors a save copies into its staging slot and
which it writes live from host memory (offload-aware staging, a live snapshot), and the
version-counter checks that keep both honest (invariant I4): a tensor changed in place while
a save still depends on its values fails that save loudly, never leaving a file with a mix
of old and new values."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from verl_ckpt.format import megatron_compat
from verl_ckpt.format.object_copy import snapshot_copy
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.rank.staging import StagingSlot, device_ready_events

__all__ = [
    "LiveTensor",
    "SaveTimeMarks",
    "SnapshotPlan",
    "bind_buffers",
    "check_copied_unchanged",
    "check_live_unchanged",
    "freeze_objects",
    "hold_tensors",
    "live_bytes",
    "live_candidates",
    "nbytes",
    "split_live",
]


@dataclass
class LiveTensor:
    """A host tensor written without a copy, with its version counter at save() time."""

    key: str
    tensor: torch.Tensor
    version: int


@dataclass
class SnapshotPlan:
    """The tensors to copy into the slot (with their version counters at save(), to detect a
    change before a deferred copy), and those written live."""

    slot: StagingSlot
    items: list[ShardedTensor]
    versions: list[int]
    live: list[LiveTensor]
    ready: dict = field(default_factory=dict)  # CUDA device -> event, for a deferred copy


@dataclass
class SaveTimeMarks:
    """What a deferred snapshot must read inside save(), when it leaves choosing and
    acquiring its buffers to the save thread: every tensor's version counter (a change
    between save() and the copy fails the save) and, on CUDA, one event per device marking
    the end of the work the training thread had queued (the copy waits for it)."""

    versions: dict[int, int]  # id(ShardedTensor) -> its data's version counter
    ready: dict  # CUDA device -> event

    @classmethod
    def record(cls, tensors: list[ShardedTensor]) -> SaveTimeMarks:
        sources = [item.data for item in tensors]
        versions = {id(item): data._version for item, data in zip(tensors, sources, strict=True)}
        return cls(versions, device_ready_events(sources))


def hold_tensors(tensors: list[ShardedTensor]) -> None:
    """Point each item at a tensor of its own on the same memory (detach(): no copy, the
    same version counter), inside a deferred or live save(). An item may hold the trainer's
    parameter or optimizer tensor itself, and a trainer that rebinds its `.data` after save()
    (moves it to the GPU for the rollout, swaps EMA weights in) changes what the item holds
    while no version counter moves: the save would then copy or write the new values,
    silently, or fail on a tensor that was never saved. The detached tensor keeps the
    memory that save() saw."""
    for item in tensors:
        item.data = item.data.detach()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def live_bytes(plan: SnapshotPlan) -> int:
    """Bytes the save writes from live host tensors, without a copy."""
    return sum(nbytes(t.tensor) for t in plan.live)


def freeze_objects(items: list) -> None:
    """Take the snapshot of the non-tensor shards (ShardedObject: the per-rank extra state,
    RNG states, counters) by deep-copying their data now (object_copy), on the training thread.

    Their bytes are produced when the save plans (megatron-core torch.saves them into the
    plan's write items); once the plan is cached that runs on the save thread, after save()
    returned, and a trainer changing its own objects in the meantime would have the changed
    values saved (I4). Called only when planning moves off the training thread."""
    for item in items:
        if isinstance(item, ShardedObject):
            item.data = snapshot_copy(item.data)


def split_live(
    tensors: list[ShardedTensor],
    candidates: list[ShardedTensor] | None,
    versions: dict[int, int] | None = None,
) -> tuple[list[LiveTensor], list[ShardedTensor]]:
    """Which of `tensors` are written live (from the trainer's memory, without a copy) and
    which are copied. Only `candidates` may be written live (None: none; see
    live_candidates), and of them only whole host tensors: a view is cloned by megatron-core
    anyway, and a device tensor needs its copy to the host. A live tensor's version counter
    is taken from `versions` (recorded inside save(), when this runs later) or read now.
    """
    if not candidates:
        return [], tensors
    allowed = {id(item) for item in candidates}
    live, staged = [], []
    for item in tensors:
        data = item.data
        whole = data.storage_offset() == 0 and data.untyped_storage().nbytes() == nbytes(data)
        host = data.device.type == "cpu" and data.is_contiguous() and whole
        if id(item) in allowed and host:
            version = data._version if versions is None else versions[id(item)]
            live.append(LiveTensor(item.key, data, version))
        else:
            staged.append(item)
    return live, staged


def live_candidates(
    tensors: list[ShardedTensor], optimizer_part: dict | None, offload_aware: bool, live: bool
) -> list[ShardedTensor] | None:
    """The tensors a save may write without a copy: every one for a live snapshot (the fence
    waits for their writes); for offload-aware staging only the optimizer state (an
    offloading trainer replaces its storage between updates, while parameters are updated in
    place by every step); otherwise none."""
    if live:
        return tensors
    if offload_aware and optimizer_part:
        return list(megatron_compat.sharded_items(optimizer_part))
    return None


def bind_buffers(plan: SnapshotPlan) -> None:
    """Point each copied item at its staging buffer: from then on the save (its plan, its
    write) references the copies, never the live tensors. May come before the copy fills
    the buffers, for work that reads only which tensors there are (the plan), never their
    values; the write starts only once the copy has ended."""
    for item, buffer in zip(plan.items, plan.slot.buffers, strict=True):
        item.data = buffer


def check_copied_unchanged(plan: SnapshotPlan, sources: list[torch.Tensor]) -> None:
    """A deferred snapshot is valid only if nothing changed its tensors in place between
    save() and the end of the copy: the copy may hold a mix of old and new values (I4)."""
    changed = [
        item.key
        for item, tensor, version in zip(plan.items, sources, plan.versions, strict=True)
        if tensor._version != version
    ]
    if changed:
        raise CheckpointError(
            f"{len(changed)} tensors were modified in place before the deferred snapshot was "
            f"taken (e.g. {changed[0]}); the save is discarded. Call manager.fence() (or "
            "register manager.fence_before(optimizer)) before changing the state"
        )


def check_live_unchanged(live: list[LiveTensor], live_snapshot: bool) -> None:
    """Fail the save if a tensor written without a copy was changed in place meanwhile:
    its file may then hold a mix of old and new values (invariant I4)."""
    changed = [t.key for t in live if t.tensor._version != t.version]
    if not changed:
        return
    if live_snapshot:
        fix = (
            "With snapshot=live call manager.fence() (or register "
            "manager.fence_before(optimizer)) before changing the state: it waits for these "
            "writes (a change that bumps no version counter, through .data or a C++ kernel, "
            "is not seen)"
        )
    else:
        fix = (
            "With checkpoint.staging.offload_aware=true the trainer must replace offloaded "
            "storage instead of writing into it, or set offload_aware=false"
        )
    raise CheckpointError(
        f"{len(changed)} host tensors written without a copy were modified in place before "
        f"their write ended (e.g. {changed[0]}); the save is discarded. {fix}"
    )
