"""format/write_resolution.py: while the plan is cached, a save's write buckets are found in
its sharded dict without megatron-core's conversion to DCP's state dict, and they are the
buckets the conversion gives: the same files, items, objects and tensor views, holding the
values of this save. Where a shard's data is not placed as learned, the conversion runs.
On a real tiny GPT (two stacked layers: several shards per key) and its Adam state, in a
process of its own (megatron's parallel state is global). Invariants I7 (the files are
DCP's and megatron-core's own format: the same buckets as the conversion's) and I4 (what is
written is this save's state)."""

from __future__ import annotations

from tests.test_megatron_compat import TINY_GPT_AFTER_ONE_STEP, run_with_megatron

# For run_with_megatron, after TINY_GPT_AFTER_ONE_STEP: `plan(cache, step, change=None)` plans
# the current state into its own directory (`change` edits the sharded part first) and
# returns (prepared, how many tensor keys megatron-core converted); `first` is a plan made
# anew; `same_buckets(a, b)` asserts that two saves' buckets are the same.
PLANNING = """
import dataclasses, pathlib, tempfile
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mt
from verl_ckpt.format.structure import describe_structure
root = pathlib.Path(tempfile.mkdtemp())
convert = mt.mcore_to_pyt_state_dict
converted = []
def counting(state, *args, **kwargs):
    converted.append(sum(isinstance(shards[0], ShardedTensor) for shards in state.values()))
    return convert(state, *args, **kwargs)
mt.mcore_to_pyt_state_dict = counting
def plan(cache, step, change=None):
    state = {"model": model.sharded_state_dict(),
             "optimizer": mc.optimizer_sharded_state_dict(model, optimizer)}
    sharded, _, items = megatron_compat.split_common_state(state)
    if change is not None:
        change(items)
    converted.clear()
    prepared = megatron_compat.plan_save(
        sharded, root / f"step{step}", None, 2, describe_structure(items), cache)
    assert (root / f"step{step}").is_dir()
    return prepared, sum(converted)
def same_buckets(a, b):
    assert [name for _, name, _ in a] == [name for _, name, _ in b]
    for (_, _, (bytes_a, tensors_a)), (_, _, (bytes_b, tensors_b)) in zip(a, b, strict=True):
        assert [i for i, _ in bytes_a] == [i for i, _ in bytes_b]
        assert [d.getvalue() for _, d in bytes_a] == [d.getvalue() for _, d in bytes_b]
        assert [i for i, _ in tensors_a] == [i for i, _ in tensors_b]
        for (item, x), (_, y) in zip(tensors_a, tensors_b, strict=True):
            assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype), item
            assert torch.equal(x, y), item
first, _ = plan(None, 1)
assert first.plan_cache.resolution is not None
# A training step: every value changes, and the next saves must hold the new ones (the
# reference, `without_resolution`, converts the state as it is then).
for p in model.parameters():
    p.grad = torch.full_like(p, 0.5)
optimizer.step()
without_resolution = dataclasses.replace(first.plan_cache, resolution=None)
"""


def test_I4_I7_a_cached_plan_finds_its_write_buckets_without_converting_and_they_are_the_same():
    run_with_megatron(
        TINY_GPT_AFTER_ONE_STEP
        + PLANNING
        + """
fast, fast_converted = plan(first.plan_cache, 2)
slow, slow_converted = plan(without_resolution, 3)
assert fast_converted == 0 and slow_converted > 10, (fast_converted, slow_converted)
same_buckets(fast.write_buckets, slow.write_buckets)
assert [p for p, _, _ in fast.write_buckets] == [
    str(root / "step2" / name) for _, name, _ in slow.write_buckets]
assert fast.global_metadata == slow.global_metadata == first.global_metadata
assert fast.plan_cache.resolution is first.plan_cache.resolution
print("ok")
"""
    )


def test_I4_I7_a_shard_placed_otherwise_is_converted_and_the_buckets_are_still_the_same():
    """A shard whose data now sits elsewhere in a larger storage (a staging buffer shared by
    several tensors, say) has the same shape and strides but not the learned place: the
    conversion runs, gives the same buckets, and the plan learns again."""
    run_with_megatron(
        TINY_GPT_AFTER_ONE_STEP
        + PLANNING
        + """
def moved(items):
    shard = next(i for i in items if isinstance(i, ShardedTensor) and i.data.numel() > 8)
    storage = torch.zeros(shard.data.numel() + 8, dtype=shard.data.dtype)
    storage[8:] = shard.data.flatten()
    shard.data = storage[8:].view(shard.data.shape)
again, again_converted = plan(first.plan_cache, 2, moved)
slow, slow_converted = plan(without_resolution, 3)
assert again_converted == slow_converted > 10, (again_converted, slow_converted)
same_buckets(again.write_buckets, slow.write_buckets)
assert again.plan_cache.resolution is not None
print("ok")
"""
    )


def test_I7_a_shard_megatron_core_copies_is_never_learnt_and_every_save_converts():
    """A non-contiguous shard of a stacked layer (several shards per key): megatron-core's
    conversion writes a contiguous copy of it, which is no view of the shard. Nothing is
    learnt; the next save with the plan converts and writes the same buckets as a reference
    that never had anything to learn from."""
    run_with_megatron(
        TINY_GPT_AFTER_ONE_STEP
        + PLANNING
        + """
def transposed(items):
    for shard in items:
        if (isinstance(shard, ShardedTensor) and shard.prepend_axis_num
                and shard.data.dim() == 2 and shard.data.shape[0] != shard.data.shape[1]):
            shard.data = shard.data.t().contiguous().t()
            assert not shard.data.is_contiguous()
            return
    raise AssertionError("no 2-D shard of a stacked layer")
copied, copied_converted = plan(None, 4, transposed)
assert copied.plan_cache.resolution is None and copied_converted > 10
again, again_converted = plan(copied.plan_cache, 5, transposed)
slow, slow_converted = plan(without_resolution, 6, transposed)
assert again_converted == slow_converted > 10, (again_converted, slow_converted)
same_buckets(again.write_buckets, slow.write_buckets)
print("ok")
"""
    )
