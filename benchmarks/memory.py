"""Resident memory of the rank processes and every process they start, sampled in the driver.

Each page is counted once, as far as /proc allows cheaply:
- a rank process: its RSS (from /proc/<pid>/statm, every `interval_s`, about 5 ms);
- a descendant (writer processes, forked writers, DCP's checkpoint process, megatron-core's
  Manager): its USS, the pages only it maps (Private_Clean + Private_Dirty of
  /proc/<pid>/smaps_rollup), re-read with the list of descendants every `child_interval_s`
  (100 ms; listing the process tree takes a few ms and smaps_rollup walks the
  page tables, too dear for 5 ms). A forked child's RSS would count every page it shares
  with its parent a second time, and a writer's RSS would count the shared-memory staging
  buffers that the rank's RSS already holds.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import psutil

__all__ = ["MemorySampler"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _uss(pid: int) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


class MemorySampler:
    """A background thread that samples; `peak(t0, t1)` and `at(t)` read the samples back."""

    def __init__(
        self, pids: list[int], interval_s: float = 0.005, child_interval_s: float = 0.1
    ) -> None:
        self._pids = list(pids)
        self._interval = interval_s
        self._child_interval = child_interval_s
        self._times: list[float] = []
        self._totals: list[int] = []
        self._children: dict[int, int] = {}  # pid -> last USS
        # Every descendant ever seen: pid -> (command line, start time). The start time tells
        # a process of ours from a later one that got the same pid.
        self.seen_children: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        self._refresh_children()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def now(self) -> int:
        """The total right now (children re-read too)."""
        self._refresh_children()
        return sum(_rss(p) for p in self._pids) + sum(self._children.values())

    def peak(self, t0: float, t1: float) -> int:
        with self._lock:
            lo = bisect.bisect_left(self._times, t0)
            hi = bisect.bisect_right(self._times, t1)
            window = self._totals[lo:hi]
        return max(window) if window else self.now()

    def samples_in(self, t0: float, t1: float) -> int:
        with self._lock:
            return bisect.bisect_right(self._times, t1) - bisect.bisect_left(self._times, t0)

    def _refresh_children(self) -> None:
        found = {}
        for pid in self._pids:
            try:
                for child in psutil.Process(pid).children(recursive=True):
                    found[child.pid] = child
            except psutil.Error:
                continue
        children = {}
        for pid, proc in found.items():
            if pid not in self.seen_children:
                try:
                    name = " ".join(proc.cmdline())[:120] or proc.name()
                    self.seen_children[pid] = (name, proc.create_time())
                except psutil.Error:
                    continue
            children[pid] = _uss(pid)
        self._children = children

    def _run(self) -> None:
        next_children = time.monotonic() + self._child_interval
        while not self._stop.is_set():
            if time.monotonic() >= next_children:
                self._refresh_children()
                next_children = time.monotonic() + self._child_interval
            total = sum(_rss(p) for p in self._pids) + sum(self._children.values())
            with self._lock:
                self._times.append(time.time())
                self._totals.append(total)
            self._stop.wait(self._interval)
