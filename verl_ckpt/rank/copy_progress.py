"""Which staging buffers a snapshot's copy has filled, so that a rank's files start to be
written while save() still copies: each tensor is written only once its own copy ended (I4).

save() copies into the slot's buffers in groups (staging.copy_into) and marks each group
copied; the writer threads wait, per tensor, for the group holding it. The disk then starts
working while the copy runs, instead of after it. A copy that fails is marked failed, and
every write waiting on it raises instead of writing a buffer the copy never filled.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable

import torch

from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError

__all__ = ["CopyFailed", "CopyProgress", "write_order"]


class CopyFailed(CheckpointError):
    """The copy into the staging buffers failed: nothing it was to fill may be written."""


class _BufferSpans:
    """Which staging buffer, if any, a tensor's memory lies in (a buffer, or a view into
    one)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        spans = sorted(
            (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), i)
            for i, b in enumerate(buffers)
            if b.numel()  # an empty buffer holds nothing to wait for
        )
        self._starts = [start for start, _, _ in spans]
        self._spans = spans

    def owner(self, tensor: torch.Tensor) -> int | None:
        if not tensor.numel():
            return None
        address = tensor.data_ptr()
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0:
            return None
        _, end, index = self._spans[at]
        return index if address < end else None


class CopyProgress:
    """The copy of one save into its staging slot, as the writers see it."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._spans = _BufferSpans(buffers)
        self._copied = [False] * len(buffers)
        self._settled = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        # When the whole copy ended (time.perf_counter), once it has.
        self.finished_at: float | None = None

    # ---- the copying side (save(), training thread) ---------------------------------------

    def copied(self, indices: Iterable[int]) -> None:
        """The buffers at `indices` hold their tensors' values now."""
        with self._changed:
            for index in indices:
                self._copied[index] = True
            self._changed.notify_all()

    def finished(self) -> None:
        """Every buffer is filled (also those never marked one by one)."""
        with self._changed:
            self.finished_at = time.perf_counter()
            self._copied = [True] * len(self._copied)
            self._settled = True
            self._changed.notify_all()

    def failed(self, error: BaseException) -> None:
        """The copy stopped: every wait for a buffer it had not filled raises."""
        with self._changed:
            self._error = error
            self._settled = True
            self._changed.notify_all()

    # ---- the writing side (save thread, writer threads) -----------------------------------

    def covers(self, buckets: list, live: list[torch.Tensor]) -> bool:
        """Whether every tensor the write `buckets` hold lies in a staging buffer or in one
        of the `live` tensors (written without a copy): then waiting for each buffer's copy
        before writing it is all the write needs. A tensor the plan made itself (a clone of
        a view) may have been made from a buffer before the copy filled it."""
        live_spans = _BufferSpans(live)
        return all(
            self._spans.owner(tensor) is not None or live_spans.owner(tensor) is not None
            for _, _, (_, tensor_data) in buckets
            for _, tensor in tensor_data
            if tensor.numel()
        )

    def wait_for(self, tensor: torch.Tensor, deadline: float) -> None:
        """Return once `tensor`'s buffer is filled; at once for a tensor outside the buffers.
        Raises CopyFailed if the copy failed first, CommitTimeoutError at `deadline`
        (monotonic)."""
        index = self._spans.owner(tensor)
        if index is not None:
            self._wait(lambda: self._copied[index], deadline)

    def wait_all(self, deadline: float) -> None:
        """Return once the whole copy ended; raise as wait_for."""
        self._wait(lambda: self._settled and self._error is None, deadline)

    def wait_settled(self, deadline: float) -> bool:
        """Wait until the copy ended or failed (nobody writes into the buffers any more);
        False if it still runs at `deadline`."""
        with self._changed:
            return self._changed.wait_for(lambda: self._settled, timeout=time_left(deadline))

    def _wait(self, filled: Callable[[], bool], deadline: float) -> None:
        with self._changed:
            while not filled():
                if self._error is not None:
                    raise CopyFailed(
                        f"the copy into the staging buffers failed: "
                        f"{type(self._error).__name__}: {self._error}"
                    )
                remaining = time_left(deadline)
                if remaining <= 0:
                    raise CommitTimeoutError(
                        "the copy into the staging buffers did not reach a tensor to write in time"
                    )
                self._changed.wait(remaining)


def write_order(buckets: list, buffers: list[torch.Tensor]) -> list[int]:
    """The buffers' indices in the order the writers need them: each file's tensors are
    written one after the other, the files at once, so a tensor is needed about when the
    bytes before it in its own file are written. The next save copies in this order (a
    hint: any order is correct, this one lets the writers start soonest)."""
    spans = _BufferSpans(buffers)
    needed: list[tuple[int, int]] = []
    for _, _, (_, tensor_data) in buckets:
        offset = 0
        for _, tensor in tensor_data:
            index = spans.owner(tensor)
            if index is not None:
                needed.append((offset, index))
            offset += tensor.numel() * tensor.element_size()
    order = list(dict.fromkeys(index for _, index in sorted(needed)))
    listed = set(order)
    return order + [i for i in range(len(buffers)) if i not in listed]
