"""Where one load() went on its rank: the calling thread's wall and CPU time, phase by phase.

A warm load is mostly memory copies (the page cache into the live tensors, by the reading
threads) plus a fixed cost of Python on the calling thread before and after them (the
checkpoint's metadata, megatron-core's conversions, matching tensors to saved chunks). On a
small machine that fixed cost is what separates a load from the read floor; these figures
show it, per phase, in `CheckpointManager.last_load` and in the benchmark's resume section.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["LoadStats", "PhaseClock"]


class PhaseClock:
    """Wall and CPU time (of the thread that marks) between consecutive marks. Phases are
    kept in the order first marked; marking a phase again adds to it."""

    def __init__(self) -> None:
        self.wall_s: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()

    def mark(self, phase: str) -> None:
        """`phase` ran from the previous mark (or the clock's start) until now."""
        wall, cpu = time.perf_counter(), time.thread_time()
        self.wall_s[phase] = self.wall_s.get(phase, 0.0) + wall - self._wall
        self.cpu_s[phase] = self.cpu_s.get(phase, 0.0) + cpu - self._cpu
        self._wall, self._cpu = wall, cpu


@dataclass
class LoadStats:
    """Figures of one load() on one rank (`CheckpointManager.last_load`).

    `phases_s` and `phases_cpu_s` are measured on the calling thread, in order; they add up
    to `load_s` and `cpu_s`. The reading threads' own CPU time (the copies) is not in
    `cpu_s`: during "reads in place" the calling thread waits for them."""

    step_path: str
    load_s: float = 0.0
    cpu_s: float = 0.0
    # Tensors read straight into place by verl_ckpt's reader (the rest went through DCP's).
    tensors_read_in_place: int = 0
    phases_s: dict[str, float] = field(default_factory=dict)
    phases_cpu_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_clock(cls, step_path: str, clock: PhaseClock, read_in_place: int) -> LoadStats:
        # The phases run back to back from the clock's start: together they are the load.
        return cls(
            step_path,
            sum(clock.wall_s.values()),
            sum(clock.cpu_s.values()),
            read_in_place,
            dict(clock.wall_s),
            dict(clock.cpu_s),
        )
