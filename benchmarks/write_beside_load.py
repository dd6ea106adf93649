"""What slows a direct write on this machine: other processes using the cores, or other
processes using the memory bus (docs/performance.md, issue 44 item 4).

One process writes 1 GiB of page-aligned memory O_DIRECT (8 MiB requests) and fsyncs, in
rounds that alternate three conditions: alone; beside two processes that spin in a Python
loop (cores busy, memory idle); beside two processes that copy 256 MiB tensors over and over
(cores and memory bus busy), as a snapshot's copy does. The write's times are printed, in
seconds, with each condition's median:

    python -m benchmarks.write_beside_load --dir /path/on/the/checkpoint/disk [--rounds 4]

Linux only, on a filesystem that takes O_DIRECT. The load processes are this script's own
children, stopped by their PIDs after each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.copy_beside_write import check_direct, private_mapping, pwrite_direct

__all__ = ["main"]

_BYTES = 1 << 30
_REQUEST = 8 << 20
_LOADS = {
    "alone": None,
    "beside two spinning processes": "while True: pass",
    "beside two copying processes": (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "a = torch.randn(64 << 20)\n"
        "b = torch.empty_like(a)\n"
        "while True: b.copy_(a)"
    ),
}
# The loads' start-up (torch's import, the tensors) must be over before the write starts.
_LOAD_START_S = 3.0


def _write(memory: memoryview, path: Path) -> float:
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        offset = 0
        while offset < _BYTES:
            pwrite_direct(fd, memory, offset, offset + _REQUEST)
            offset += _REQUEST
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - began
    path.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the disk to use")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of every condition")
    args = parser.parse_args()
    check_direct(args.dir)
    mapping = private_mapping(_BYTES)
    mapping.write(b"\1" * _BYTES)  # every page touched before the timings
    memory = memoryview(mapping)
    times: dict[str, list[float]] = {name: [] for name in _LOADS}
    for _ in range(args.rounds):
        for name, load in _LOADS.items():
            children = [subprocess.Popen([sys.executable, "-c", load]) for _ in range(2) if load]
            try:
                time.sleep(_LOAD_START_S if children else 0.5)
                times[name].append(_write(memory, args.dir / "write_beside_load.bin"))
            finally:
                for child in children:
                    child.kill()
                    child.wait()
    memory.release()
    for name, values in times.items():
        figures = " ".join(f"{t:.3f}" for t in values)
        print(f"{name:30s} median {statistics.median(values):.3f} s; each: {figures}")


if __name__ == "__main__":
    main()
