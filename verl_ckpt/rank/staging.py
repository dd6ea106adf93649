"""Host buffers for snapshots: allocated once per structure, reused, never shared by two saves.

Freshly allocated host memory copies at well under 1 GB/s (page faults); memory already
touched copies an order of magnitude faster. So buffers live as long as the structure does.
A slot is handed out again only after the write that used it finished (the buffer-lifetime
bug of Megatron-LM #2288 was reuse while a writer still read it).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import pickle
import threading
from dataclasses import dataclass, field

import torch

from verl_ckpt.format.torch_format import PAGE_ALIGNED_MIN
from verl_ckpt.rank.copy_progress import CopyProgress
from verl_ckpt.store.direct_io import page_aligned_buffer

__all__ = ["StagingPool", "StagingSlot", "copy_into", "device_ready_events", "staging_signature"]


_slot_ids = itertools.count()

# Host bytes copied per call (the interpreter lock is released for a whole call); a write
# waiting for a tensor waits for the group holding it.
COPY_GROUP_BYTES = 32 * 2**20


def staging_signature(keys: list[str], tensors: list[torch.Tensor]) -> str:
    """What a slot's buffers hold: each staged tensor's key, shape, dtype and device type, in
    order. Two saves may reuse one slot only if this is equal: the set of tensors copied can
    change while the saved structure does not (offload-aware staging references host
    tensors instead of copying them), so neither the structure hash nor a count will do."""
    entries = [
        (key, tuple(tensor.shape), str(tensor.dtype), tensor.device.type)
        for key, tensor in zip(keys, tensors, strict=True)
    ]
    # Pickled as a whole (exact for strings and integers): half the time of hashing each
    # entry's repr, inside save().
    return hashlib.sha256(pickle.dumps(entries, protocol=5)).hexdigest()


@dataclass
class StagingSlot:
    signature: str
    buffers: list[torch.Tensor]
    in_use: bool = False
    # The buffers' indices in the order the last plan's writers read them (a copy hint).
    write_order: list[int] | None = None
    nbytes: int = field(init=False)
    slot_id: int = field(default_factory=lambda: next(_slot_ids))

    def __post_init__(self) -> None:
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers)


def _allocate_like(tensor: torch.Tensor, pin_memory: bool, shared: bool) -> torch.Tensor:
    if shared:
        # Shared memory, so that a writer process reads the snapshot without a copy.
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    elif pin_memory and tensor.is_cuda:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    else:
        buffer = _page_aligned_empty(tensor.shape, tensor.dtype)
    # Touch every page now, so that the first snapshot does not pay the page faults.
    buffer.zero_()
    return buffer


def _page_aligned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor; one large enough to be written with zero copy gets a
    mapping of its own, so that its storage starts on a page: its blob then lies
    page-aligned in the file at every save (torch_format._pad_before_blob), and a file
    written around the page cache takes its pages straight from it. torch's allocator
    aligns to 64 bytes only. The mapping lives as long as the tensor; private (not shared
    memory), so that the kernel merges neighbouring ones into one mapping."""
    nbytes = math.prod(shape) * dtype.itemsize
    # Below it written through the buffers anyway: no mapping of its own.
    if nbytes < PAGE_ALIGNED_MIN:
        return torch.empty(shape, dtype=dtype)
    memory = page_aligned_buffer(nbytes)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


class StagingPool:
    """At most `slots` sets of host buffers; one set per save in flight."""

    def __init__(self, slots: int, pin_memory: bool, shared_memory: bool = False) -> None:
        self._slots_max = slots
        self._pin_memory = pin_memory
        self._shared = shared_memory
        self._slots: list[StagingSlot] = []
        self._lock = threading.Lock()

    def acquire(
        self, keys: list[str], tensors: list[torch.Tensor]
    ) -> tuple[StagingSlot, list[StagingSlot]]:
        """A free slot whose buffers fit exactly these tensors, allocating one if needed.

        The caller guarantees (by waiting for earlier writes) that fewer than `slots` saves
        are in flight, so a slot is always available here. Also returns the slots dropped
        because what is staged changed (a writer process may hold references to forget).
        """
        signature = staging_signature(keys, tensors)
        with self._lock:
            # A change makes the other free slots useless: free them first so that host
            # memory never holds two layouts' worth of idle buffers.
            dropped = [s for s in self._slots if not s.in_use and s.signature != signature]
            self._slots = [s for s in self._slots if s not in dropped]
            for slot in self._slots:
                if not slot.in_use and slot.signature == signature:
                    slot.in_use = True
                    return slot, dropped
            if len(self._slots) >= self._slots_max:
                raise RuntimeError(
                    f"staging pool exhausted: {len(self._slots)} slots in use "
                    "(a save was started before an earlier write finished)"
                )
            slot = StagingSlot(
                signature,
                [_allocate_like(t, self._pin_memory, self._shared) for t in tensors],
            )
            slot.in_use = True
            self._slots.append(slot)
            return slot, dropped

    def release(self, slot: StagingSlot) -> None:
        with self._lock:
            slot.in_use = False

    def forget(self, slot: StagingSlot) -> None:
        """Drop a slot that a timed-out writer may still read; it is never handed out again."""
        with self._lock:
            self._slots = [s for s in self._slots if s is not slot]

    def clear(self) -> list[StagingSlot]:
        with self._lock:
            dropped = [s for s in self._slots if not s.in_use]
            self._slots = [s for s in self._slots if s.in_use]
            return dropped

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._slots)


def copy_into(
    slot: StagingSlot,
    tensors: list[torch.Tensor],
    ready: dict[torch.device, torch.cuda.Event] | None = None,
    progress: CopyProgress | None = None,
) -> int:
    """Copy `tensors` into the slot's buffers; return the bytes copied. `progress` learns
    of each group of host buffers as it is filled, and of the end of the copy.

    Device-to-host copies into pinned buffers are issued asynchronously and then awaited
    once, so that the copies overlap each other but the snapshot is complete on return.
    `ready` (from `device_ready_events`, recorded on the training thread) makes this safe to
    run on another thread: the copies then go on a side stream of each device that first
    waits for everything the training thread had queued when the events were recorded.
    """
    copied = 0
    streams: dict[torch.device, torch.cuda.Stream] = {}
    sources = [tensor.detach() for tensor in tensors]
    host_positions = []
    for position, (buffer, source) in enumerate(zip(slot.buffers, sources, strict=True)):
        if buffer.shape != source.shape or buffer.dtype != source.dtype:
            # copy_ would broadcast or convert silently: a wrong snapshot, not an error.
            raise ValueError(
                f"staging buffer {tuple(buffer.shape)} {buffer.dtype} does not fit tensor "
                f"{tuple(source.shape)} {source.dtype}"
            )
        if not source.is_cuda:
            host_positions.append(position)
        else:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = _copy_stream(source.device, ready)
            with torch.cuda.stream(stream):
                buffer.copy_(source, non_blocking=buffer.is_pinned())
        copied += buffer.numel() * buffer.element_size()
    for group in _copy_groups(slot, host_positions):
        # One call per group of host tensors: the interpreter lock stays released for the
        # whole group, not taken back after every tensor, so the threads planning and
        # writing meanwhile neither hold up the copy nor are held up by it.
        torch._foreach_copy_([slot.buffers[i] for i in group], [sources[i] for i in group])
        if progress is not None:
            progress.copied(group)
    for stream in streams.values():
        stream.synchronize()
    if progress is not None:
        progress.finished()
    return copied


def _copy_groups(slot: StagingSlot, positions: list[int]) -> list[list[int]]:
    """The host buffers to copy, in groups of about COPY_GROUP_BYTES, in the order the
    writers need them (slot.write_order, from the last plan) where known."""
    wanted = set(positions)
    hint = [i for i in slot.write_order or () if i in wanted]
    # Every position, each once, whatever the hint holds: the hint orders, never selects.
    order = dict.fromkeys(hint + positions)
    groups: list[list[int]] = [[]]
    size = 0
    for index in order:
        if size >= COPY_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(index)
        buffer = slot.buffers[index]
        size += buffer.numel() * buffer.element_size()
    return [g for g in groups if g]


def device_ready_events(tensors: list[torch.Tensor]) -> dict[torch.device, torch.cuda.Event]:
    """One event per CUDA device of `tensors`, recorded now on its current stream: the point
    after which a copy on another stream sees the values the training thread has produced."""
    events = {}
    for tensor in tensors:
        if tensor.is_cuda and tensor.device not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            events[tensor.device] = event
    return events


def _copy_stream(
    device: torch.device, ready: dict[torch.device, torch.cuda.Event] | None
) -> torch.cuda.Stream:
    if ready is None:
        # On the training thread: its own stream orders the copy after the compute.
        return torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_event(ready[device])
    return stream
