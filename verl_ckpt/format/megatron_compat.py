"""The one place that calls megatron-core's checkpointing internals.

megatron-core gives us the sharded state dict semantics, the DCP save plan and the
torch_dist format; we run staging, writing and the commit ourselves, because its own save
execution and finalize call CUDA unconditionally and poll with collectives (see
shared/notes/megatron-core.md). The functions used here are module-level helpers of
megatron-core 0.16 (`strategies/torch.py`, `strategies/state_dict_saver.py`); a newer release
that moves them needs changes in this file only.

Protocol step 1 (plan): sharding validation and the DCP plan (verl_ckpt/protocol/__init__.py);
and the loads of load().
"""

from __future__ import annotations

import functools
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.exchange_utils import (
    determine_main_replica_uniform_distribution,
)
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies import state_dict_saver
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import (
    COMMON_STATE_FNAME,
    TorchCommonLoadStrategy,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync,
    _split_by_size_and_type,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    distribute_main_replicas_with_precomputed_distribution,
)
from megatron.core.dist_checkpointing.validation import (
    _validate_objects_for_key,
    _validate_sharding_for_key,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

from verl_ckpt.format.load_stats import PhaseClock
from verl_ckpt.format.safe_load import load_state_file
from verl_ckpt.format.safe_reader import checkpoint_error_in
from verl_ckpt.format.structure import Structure
from verl_ckpt.format.torch_dist_dir import BACKEND, CHECKPOINTING_CONFIG
from verl_ckpt.format.write_resolution import WriteResolution, see_shards, writable
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.store.fsio import read_regular

__all__ = [
    "BACKEND",
    "PreparedSave",
    "SavePlanCache",
    "load_role_dir",
    "plan_save",
    "sharded_items",
    "split_common_state",
    "spread_main_replicas",
    "validate_sharding",
]

# The finalizer writes metadata.json without megatron-core (torch_dist_dir). It must hold
# every field this release writes, with the same value and in the same order: 0.16 writes
# and reads four fields, 0.19 writes the first two and ignores the others when it reads,
# and each reads the other's file. A release that writes another field or value must fail
# here, in every rank, before a step is saved with a stale metadata.json.
_RELEASE_CONFIG = list(asdict(CheckpointingConfig(*BACKEND)).items())
# A metadata.json is four short fields; a larger one is no file the finalizer wrote.
_CONFIG_MAX_BYTES = 64 * 1024
if _RELEASE_CONFIG != list(CHECKPOINTING_CONFIG.items())[: len(_RELEASE_CONFIG)]:
    raise ImportError(
        f"this megatron-core writes metadata.json as {dict(_RELEASE_CONFIG)}, "
        f"verl_ckpt.format.torch_dist_dir as {CHECKPOINTING_CONFIG}: update torch_dist_dir"
    )


def _memoise_torch_version_check() -> None:
    """megatron-core's torch strategy asks `is_torch_min_version("2.6a0")` for every tensor it
    converts for DCP (`mcore_to_pyt_state_dict`: every load, and every save's plan on the
    save thread), and each call parses the version string with `packaging` again: about half
    of the conversion's time (benchmarks/README.md). Its answer depends only on its
    arguments and the torch this process imported, so it is memoised, in that module's
    namespace only (`megatron.core.utils` keeps its own function). A release that drops the
    name there is left as it is."""
    check = getattr(mcore_torch, "is_torch_min_version", None)
    if callable(check) and not hasattr(check, "cache_info"):
        mcore_torch.is_torch_min_version = functools.lru_cache(maxsize=64)(check)


_memoise_torch_version_check()


@dataclass
class SavePlanCache:
    """The outcome of planning, reusable while the structure (structure.py) holds on every
    rank."""

    structure: Structure
    central_plan: Any
    local_plan: Any
    replica_distribution: Any
    # Only the coordinator (rank 0 of the save group) holds the global DCP metadata, pickled
    # (see PreparedSave).
    global_metadata: bytes | None
    # Where the plan's write items are in the sharded dict, once a save with this plan
    # converted (write_resolution.py); None until then, or where it cannot be known.
    resolution: WriteResolution | None = None
    # DCP's stream transforms of the writer that planned, which the saves that find their
    # items without planning write with too: it holds only DCP's extensions, no state of a
    # save (each stream it wraps is its own).
    transforms: Any = None


@dataclass
class PreparedSave:
    """What a rank writes: DCP write buckets (one file each) over the staged tensors."""

    write_buckets: list
    transforms: Any
    # The coordinator's DCP Metadata, pickled once per plan: the same Metadata goes with
    # every save while the plan is cached, and Ray pickling it anew for each report (a
    # dataclass per tensor and chunk) was most of the report's round trip.
    global_metadata: bytes | None
    plan_cache: SavePlanCache
    # Whether megatron-core converted the state to DCP's to plan it (write_resolution.py).
    converted: bool = True


class _PlanOnlyWriter(FileSystemWriterAsync):
    """megatron-core's DCP writer for planning; its write preparation is replaced.

    `FileSystemWriterAsync.prepare_write_data` also creates a results queue backed by a
    multiprocessing Manager: a server process per rank that outlives every save. We write
    ourselves and need no queue, so this builds the same buckets (same file names, same
    split) without it. Views are cloned as megatron-core does (`writable`).
    """

    # Each bucket's tensors as the planner resolved them, before `writable` cloned any:
    # what WriteResolution.learn compares with the shards.
    views: list[list[torch.Tensor]]

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        prefix = plan.storage_data.prefix
        self.write_buckets = []
        self.views = []
        for items in _split_by_size_and_type(self.thread_count, plan.items):
            bytes_data, tensor_data, views = [], [], []
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    bytes_data.append((item, data))
                else:
                    views.append(data)
                    tensor_data.append((item, writable(data)))
            if bytes_data or tensor_data:
                name = f"{prefix}{len(self.write_buckets)}{DEFAULT_SUFFIX}"
                path = os.path.join(self.checkpoint_dir, name)
                self.write_buckets.append((path, name, (bytes_data, tensor_data)))
                self.views.append(views)
        self.results_queue = None


def split_common_state(sharded_state_dict: dict) -> tuple[dict, dict, list[ShardedBase]]:
    """Apply factories, drop non-persistent entries, split sharded from common state; also
    the sharded part's items, in `sharded_items` order.

    The result is megatron-core's `save_preprocess`'s. It walks the state five times (and
    once more for the items), with isinstance checks against an abstract class: the
    largest part of a deferred save()'s time. Without factories and empty flattened ranges
    (what the models and optimizers here give), one walk (`_split_plain`) reproduces its
    two passes that matter, the non-persistent objects' removal and the split, container
    rules included; otherwise megatron-core runs. Validation is done separately on the save
    group (`validate_sharding`): megatron's own gathers over the default group, which may
    hold ranks that never save.
    """
    items: list[ShardedBase] = []
    try:
        sharded, common = _split_plain(sharded_state_dict, items)
    except _NotPlain:
        sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
        items = sharded_items(sharded)
    return sharded, common, items


class _NotPlain(Exception):
    """The state holds something only megatron-core's save_preprocess handles."""


_SHARDED, _COMMON, _DROPPED = range(3)
_PLAIN_LEAVES = frozenset({int, float, str, bool, type(None), bytes, torch.Tensor})


def _leaf_kind(value: Any, items: list[ShardedBase]) -> int:
    kind = type(value)
    if kind is ShardedTensor:
        flat = value.flattened_range
        if flat is not None and flat.start == flat.stop:
            raise _NotPlain  # megatron-core filters these out
        items.append(value)
        return _SHARDED
    if kind is ShardedObject:
        items.append(value)
        return _SHARDED
    if kind in _PLAIN_LEAVES:
        return _COMMON
    if isinstance(value, LocalNonpersistentObject):
        return _DROPPED  # restored locally on load, never saved
    if isinstance(value, ShardedBase):
        raise _NotPlain  # a factory (applied in place by megatron-core), a subclass
    return _COMMON


def _split_plain(x: dict | list, items: list[ShardedBase]) -> tuple[Any, Any]:
    """megatron-core's extract_nonpersistent, then extract_sharded_base on what it kept
    (both extract_matching_values), in one walk: the sharded and common parts, matches
    collected into `items` in order. Their container rules hold: a container that the
    removal of non-persistent objects empties disappears, one empty from the start stays
    on the common side (in a dict; in a list too, as a plain element)."""
    if isinstance(x, dict):
        sharded: Any = {}
        common: Any = {}
        for key, value in x.items():
            if isinstance(value, (list, dict)):
                match, rest = _split_plain(value, items)
                if match:
                    sharded[key] = match
                if rest or not value:
                    common[key] = rest
                continue
            kind = _leaf_kind(value, items)
            if kind != _DROPPED:
                (sharded if kind == _SHARDED else common)[key] = value
        return sharded, common
    sharded, common = [], []
    for value in x:
        if isinstance(value, (list, dict)) and value:
            match, rest = _split_plain(value, items)
            if match:
                sharded.append(match)
            if rest:
                common.append(rest)
            continue
        kind = _COMMON if isinstance(value, (list, dict)) else _leaf_kind(value, items)
        if kind != _DROPPED:
            (sharded if kind == _SHARDED else common).append(value)
    return sharded, common


def sharded_items(sharded_part: dict) -> list[ShardedBase]:
    return list(nested_values(sharded_part))


def spread_main_replicas(
    sharded_part: dict, group: dist.ProcessGroup | None, distribution: Any = None
) -> Any:
    """fully_parallel_save: make each rank of `group` the writer of an even share of the
    replicated shards. Computing the distribution is one all-gather on `group`; pass the
    returned distribution back while the structure is unchanged to skip it."""
    if distribution is None:
        distribution = determine_main_replica_uniform_distribution(sharded_part, group)
    distribute_main_replicas_with_precomputed_distribution(sharded_part, group, distribution)
    return distribution


def validate_sharding(items: list[ShardedBase], group: dist.ProcessGroup | None) -> None:
    """Check on the coordinator that main replicas cover every tensor exactly once."""
    local = [item.without_data() for item in items]
    coordinator = dist.get_global_rank(group, 0) if group is not None else 0
    gathered = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(local, gathered, dst=coordinator, group=group)
    if gathered is None:
        return
    by_key: dict[str, list] = {}
    for rank, rank_items in enumerate(gathered):
        for item in rank_items:
            by_key.setdefault(item.key, []).append((rank, item))
    for shardings in by_key.values():
        if isinstance(shardings[0][1], ShardedObject):
            _validate_objects_for_key(shardings)
        else:
            _validate_sharding_for_key(shardings)


def _objects_for_dcp(objects: dict[str, list]) -> dict[str, Any]:
    """megatron-core's conversion of `ShardedObject`s for DCP (serialised as its save would),
    for a plan whose tensors are found without it (write_resolution)."""
    return mcore_torch.mcore_to_pyt_state_dict(objects, False)


def plan_save(
    sharded_part: dict,
    checkpoint_dir: Path,
    group: dist.ProcessGroup | None,
    files_per_rank: int,
    structure: Structure,
    cache: SavePlanCache | None,
    replica_distribution: Any = None,
    before_gather: Callable[[], None] | None = None,
) -> PreparedSave:
    """Plan the DCP save of `sharded_part` (whose tensors are already staged on the host).

    With a valid `cache` no collective runs; otherwise the local plans are gathered on the
    save group's coordinator, which builds the global metadata. With a valid `cache` that
    learned where its write items are, megatron-core's conversion to DCP's state dict is
    skipped too (write_resolution.py). `before_gather` runs once the local conversion is
    done, just before megatron-core's planning (whose gather follows its local plan).
    """
    flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
        sharded_part, keep_only_main_replica=True
    )
    if cache is not None and cache.resolution is not None:
        write_buckets = cache.resolution.write_buckets(
            flat, checkpoint_dir, files_per_rank, _objects_for_dcp
        )
        if write_buckets is not None:
            # DCP's planning makes the directory it plans for (its prepare_local_plan).
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            kept = replace(cache, structure=structure, replica_distribution=replica_distribution)
            return PreparedSave(
                write_buckets, cache.transforms, cache.global_metadata, kept, converted=False
            )
    # Before the conversion, which reshapes shards' data in place.
    seen = see_shards(flat)
    pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(flat, False)
    writer = _PlanOnlyWriter(checkpoint_dir, thread_count=files_per_rank)
    planner = mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
    cached = (cache.central_plan, cache.local_plan, True) if cache is not None else None
    if before_gather is not None:
        before_gather()
    (_, global_metadata, _), central_plan, local_plan, _, _ = (
        state_dict_saver.save_state_dict_async_plan(
            pyt_state_dict,
            writer,
            group,
            0,
            planner=planner,
            cached_ckpt_structure=cached,
        )
    )
    if cache is not None:
        global_metadata = cache.global_metadata
    elif global_metadata is not None:
        global_metadata = pickle.dumps(global_metadata, protocol=pickle.HIGHEST_PROTOCOL)
    transforms = getattr(writer, "transforms", None)
    # Goes with this central plan: the items it resolves are the plan's.
    resolution = WriteResolution.learn(
        seen, flat, writer.write_buckets, writer.views, files_per_rank
    )
    new_cache = SavePlanCache(
        structure,
        central_plan,
        local_plan,
        replica_distribution,
        global_metadata,
        resolution,
        transforms,
    )
    return PreparedSave(writer.write_buckets, transforms, global_metadata, new_cache)


class _LocalLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load, with two differences: each rank plans its reads
    alone (DCP's `no_dist`: the checkpoint's global metadata says where every shard is, so
    no rank needs the others, and ranks that do not load are never waited for), and whole
    tensors are read straight into place (direct_reader.DirectFileSystemReader).
    `clock` (optional) is marked at the end of each phase, on the calling thread."""

    def __init__(self, clock: PhaseClock | None = None) -> None:
        super().__init__()
        self.clock = clock or PhaseClock()
        self.direct_reads = 0

    def load(
        self, sharded_state_dict: dict, checkpoint_dir: Path, async_strategy: str = "mcore"
    ) -> dict:
        # megatron-core 0.19 passes how the checkpoint was saved asynchronously ("mcore" or
        # NVRx's "nvrx"; 0.16 passes nothing). Both write the same torch_dist layout, which
        # is all this reader reads, so the argument changes nothing here.
        del async_strategy
        from verl_ckpt.format.direct_reader import DirectFileSystemReader

        mark = self.clock.mark
        mark("megatron-core: before the strategy")
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        flexible = [t for t in tensors if not t.allow_shape_mismatch]
        mismatching = {t.key: t for t in tensors if t.allow_shape_mismatch}
        original = sharded_state_dict
        sharded, flat_mapping, rename_mapping = (
            mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        )
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sharded, True)
        mark("megatron-core: conversion for DCP")
        reader = DirectFileSystemReader(checkpoint_dir)
        metadata = reader.read_metadata()
        mark("checkpoint metadata")
        # Tensors whose chunks are saved chunks, whole, are read first, with no DCP load
        # plan: its planning and machinery are a fixed cost per tensor.
        # The rest (resharded or mismatching tensors, objects, what the reader does not
        # know) goes through megatron-core's planner, its checks and errors included.
        whole = _whole_chunk_targets(pyt_state_dict, metadata)
        mark("matching saved chunks")
        left = reader.read_whole_chunks(metadata, whole)
        mark("reads in place")
        read = {index.fqn for index in whole} - {index.fqn for index in left}
        rest = {key: value for key, value in pyt_state_dict.items() if key not in read}
        if rest:
            _dcp_load_locally(
                rest,
                reader,
                mcore_torch.MCoreLoadPlanner(
                    shapes_validation_sharded_tensors=[t for t in flexible if t.key in rest],
                    allow_shape_mismatch_sharded_tensors=mismatching,
                ),
            )
            # DCP puts what it loads for an object (a ShardedObject's bytes) into the dict
            # it was given, in place of the request.
            pyt_state_dict.update(rest)
        mark("DCP's path (the rest)")  # marked, at 0, when nothing is left for it
        self.cached_global_metadata = metadata
        self.direct_reads = reader.direct_reads
        loaded = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            loaded, flat_mapping, rename_mapping
        )
        mcore_torch._restore_dict_types(loaded, original)
        mark("megatron-core: unwrapping")
        return loaded


class _SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron-core's common.pt load, with `weights_only=True` explicitly: megatron-core
    relies on torch's default, which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns off, and its
    refusal would be a traceback rather than one line naming the file."""

    def load_common(self, checkpoint_dir: str | Path) -> dict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        try:
            return load_state_file(path, map_location="cpu")
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None


def _whole_chunk_targets(pyt_state_dict: dict, metadata: Any) -> dict[MetadataIndex, torch.Tensor]:
    """The tensors of a load whose every local chunk is a saved chunk, whole, of a tensor of
    the same global shape (megatron-core's own shape check, which DCP's path runs, would
    pass). A tensor that allows a shape mismatch (a padded vocabulary) is one of them where
    the shapes match: megatron-core zeroed it for a partial read that is then whole. Keyed
    by each chunk's index in the checkpoint."""
    targets = {}
    for fqn, value in pyt_state_dict.items():
        chunks = _local_chunks(fqn, value)
        saved = metadata.state_dict_metadata.get(fqn)
        if not chunks or not isinstance(saved, TensorStorageMetadata):
            continue
        if saved.size != _global_size(value):
            continue
        saved_chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in saved.chunks}
        if all((tuple(o), tuple(s)) in saved_chunks for o, s, _ in chunks):
            targets.update((MetadataIndex(fqn, o), tensor) for o, _, tensor in chunks)
    return targets


def _global_size(value: torch.Tensor) -> torch.Size:
    """The global shape of a tensor as megatron-core hands it to DCP. A torch ShardedTensor's
    own `size()` goes through its `__torch_function__`, which torch deprecates with a
    FutureWarning (printed by every rank on every resume); its metadata holds the size."""
    if isinstance(value, mcore_torch.TorchShardedTensor):
        return value.metadata().size
    return value.size()


def _dcp_load_locally(state_dict: dict, reader: Any, planner: Any) -> None:
    """DCP's load of `state_dict` by this rank alone (no collective). `load_state_dict`
    (what megatron-core 0.16 calls) is deprecated with a FutureWarning on every call, and
    `load(no_dist=True)` warns on every call that torch.distributed is "disabled", which it
    is not; both run `_load_state_dict`, called here where this torch has it (as
    `load_state_dict` does: after resetting the reader)."""
    from torch.distributed.checkpoint import state_dict_loader

    load = getattr(state_dict_loader, "_load_state_dict", None)
    try:
        if load is None:
            state_dict_loader.load_state_dict(state_dict, reader, no_dist=True, planner=planner)
            return
        reader.reset()
        load(state_dict, reader, no_dist=True, planner=planner)
    except CheckpointException as exc:
        # DCP wraps what its reader raised; ours (a refused byte item) names the file alone.
        cause = checkpoint_error_in(exc)
        if cause is None:
            raise
        raise cause from None


def _local_chunks(fqn: str, value: Any) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
    """(global offsets, sizes, tensor) of each chunk this rank loads of `value`, as
    megatron-core hands them to DCP; [] for anything else (objects, flattened ranges)."""
    if type(value) is mcore_torch.TorchShardedTensor:
        # megatron-core's older conversion, still used for tensors with prepended axes (a
        # layer's weights stacked over layers): a local shard per chunk.
        mcore_tensor = getattr(value, "mcore_sh_ten", None)
        if mcore_tensor is None or mcore_tensor.flattened_range is not None:
            return []
        return [
            (torch.Size(s.metadata.shard_offsets), torch.Size(s.metadata.shard_sizes), s.tensor)
            for s in value.local_shards()
        ]
    if isinstance(value, torch.Tensor) and hasattr(value, "__create_chunk_list__"):
        # megatron-core >= 0.14 on torch >= 2.6: DCP's checkpointable protocol
        # (CheckpointableShardedTensor, LocalShardsContainer), asked as DCP asks it.
        return [
            (c.offsets, c.sizes, value.__get_tensor_shard__(MetadataIndex(fqn, c.offsets, i)))
            for i, c in enumerate(value.__create_chunk_list__())
        ]
    return []


def _check_config_file(path: Path) -> None:
    """megatron-core opens `metadata.json` with a plain open() and json.load before its
    strategies read anything: a FIFO planted there blocked the rank for good, a link to
    /dev/zero filled its memory, and deep nesting raised RecursionError. Read first as a
    regular file, bounded, and parsed (each refusal one line naming it); a missing one is
    megatron-core's own "not a distributed checkpoint". A file swapped between this read
    and megatron-core's is not caught: checks stand apart from loads (docs/security.md)."""
    data = read_regular(path, _CONFIG_MAX_BYTES)
    if data is None:
        return
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not megatron-core's checkpoint config (a JSON object)")


def load_role_dir(
    sharded_state_dict: dict, checkpoint_dir: Path, clock: PhaseClock | None = None
) -> tuple[dict, int]:
    """megatron-core's own load() of a torch_dist directory, with no collective: the saved
    sharding was validated at save time, so the load request's access-integrity check (an
    all-gather over the default group) is skipped, and reads are planned locally. Returns
    the loaded dict and how many tensors were read in place; `clock` is marked per phase."""
    _check_config_file(Path(checkpoint_dir) / "metadata.json")
    strategy = _LocalLoadStrategy(clock)
    loaded = dist_checkpointing.load(
        sharded_state_dict,
        str(checkpoint_dir),
        sharded_strategy=strategy,
        common_strategy=_SafeCommonLoadStrategy(),
        validate_access_integrity=False,
    )
    strategy.clock.mark("megatron-core: after the strategy")
    return loaded, strategy.direct_reads
