"""`python -m benchmarks.verify_bench`: how fast a committed step is re-verified.

    python -m benchmarks.verify_bench                   # 8 files x 64 MiB, 5 rounds
    python -m benchmarks.verify_bench --files 16 --file-mib 128 --rounds 7

Writes one step of random files with a real commit record (real xxh3_64 checksums), then in
each round, in rotating order, verifies it three ways: `verification.verify_step` with one
thread per available core (what `verl-ckpt verify` and `resume_verify=checksums` use), the
same with one thread, and `commit_record.verify_files` (the sequential loop `verl-ckpt
verify` used before). Beside them, the in-memory floor: xxh3_64 over the same bytes already
in memory, one thread. The files are in the page cache (written just before, read once to
warm up): this measures hashing and copying out of the cache, not the disk. Ratios are
medians of per-round ratios, so they compare figures taken seconds apart.

Writes benchmarks/results_verify.md (or --out); removes its temporary directory.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import xxhash

from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    read_commit_record,
    verify_files,
    write_commit_record,
)
from verl_ckpt.store.fsio import file_checksum
from verl_ckpt.store.verification import available_cores, verify_step

HERE = Path(__file__).resolve().parent


def make_step(path: Path, files: int, file_bytes: int) -> CommitRecord:
    entries = []
    for index in range(files):
        name = f"actor/__{index}_0.distcp"
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        with open(path / name, "wb") as f:
            for _ in range(file_bytes // (16 << 20)):
                f.write(os.urandom(16 << 20))
            f.write(os.urandom(file_bytes % (16 << 20)))
        size, checksum = file_checksum(path / name)
        entries.append(FileEntry(name, size, checksum))
    write_commit_record(path, CommitRecord(1, {"actor": files}, entries))
    return read_commit_record(path)


def timed(method, path: Path, record: CommitRecord, cores: int) -> float:
    started = time.perf_counter()
    if method == "parallel":
        assert verify_step(path, record, threads=cores).ok
    elif method == "one thread":
        assert verify_step(path, record, threads=1).ok
    else:
        assert not verify_files(path, record)
    return time.perf_counter() - started


def memory_floor(nbytes: int) -> float:
    data = memoryview(os.urandom(min(nbytes, 256 << 20)))
    repeats = max(1, nbytes // len(data))
    started = time.perf_counter()
    for _ in range(repeats):
        hasher = xxhash.xxh3_64()
        for offset in range(0, len(data), 8 << 20):
            hasher.update(data[offset : offset + (8 << 20)])
        hasher.hexdigest()
    return (time.perf_counter() - started) * nbytes / (repeats * len(data))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_bench")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--file-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results_verify.md")
    args = parser.parse_args()
    cores = available_cores()
    load_before = os.getloadavg()[0]
    methods = ("parallel", "one thread", "verify_files (before)")
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    floor: list[float] = []
    with tempfile.TemporaryDirectory(prefix="verl_ckpt_verify_") as tmp:
        path = Path(tmp) / "global_step_1"
        record = make_step(path, args.files, args.file_mib << 20)
        total = sum(entry.size for entry in record.files)
        timed("parallel", path, record, cores)  # warm the page cache
        for round_index in range(args.rounds):
            order = methods[round_index % 3 :] + methods[: round_index % 3]
            for method in order:
                seconds[method].append(timed(method, path, record, cores))
            floor.append(memory_floor(total))
    gbps = {m: [total / 1e9 / s for s in values] for m, values in seconds.items()}
    speedup = [one / par for one, par in zip(seconds["one thread"], seconds["parallel"])]
    before = [old / par for old, par in zip(seconds["verify_files (before)"], seconds["parallel"])]
    floor_ratio = [par / f for par, f in zip(seconds["parallel"], floor)]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
    except OSError:
        commit = "?"
    lines = [
        "# Verification throughput (`python -m benchmarks.verify_bench`)",
        "",
        f"{args.files} files x {args.file_mib} MiB = {total / 2**30:.2f} GiB of random bytes, "
        f"xxh3_64, page cache warm, {args.rounds} rounds; {cores} available cores "
        f"({os.cpu_count()} on the machine); {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, git {commit}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; load average before {load_before:.1f}, "
        f"after {os.getloadavg()[0]:.1f} (other work shares the cores).",
        "",
        "| method | median GB/s | min | max |",
        "|---|---|---|---|",
    ]
    for method in methods:
        values = gbps[method]
        lines.append(
            f"| {method} | {statistics.median(values):.2f} | {min(values):.2f} | "
            f"{max(values):.2f} |"
        )
    floor_gbps = statistics.median(total / 1e9 / f for f in floor)
    lines.append(f"| in-memory xxh3_64, 1 thread (floor) | {floor_gbps:.2f} | | |")
    lines += [
        "",
        f"- parallel ({cores} threads) vs one thread: {statistics.median(speedup):.2f}x "
        "(median of paired ratios)",
        f"- parallel vs the sequential `verify_files` used before: "
        f"{statistics.median(before):.2f}x",
        f"- parallel time / one-thread in-memory hash of the same bytes: "
        f"{statistics.median(floor_ratio):.2f}x",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
