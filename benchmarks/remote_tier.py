"""The remote tier's upload against a plain s3fs put of the same files, and the training
slow-down while uploading, side by side in one run (paired: each verl_ckpt upload right
after a plain put of the same bytes; each training burst during an upload right after one
without).

    python -m benchmarks.remote_tier                   # 3 files x 128 MiB, 3 pairs
    python -m benchmarks.remote_tier --files 4 --mib 64 --pairs 5
    python -m benchmarks.remote_tier --recipe          # + recipes.ppo_toy with and without

The S3 endpoint is moto's server on 127.0.0.1 (tests/s3_server.py; `pip install -e
'.[test]'`), which keeps objects in its memory and parses every request in Python: on this
machine it, not the network, sets the throughput of both sides, and it competes with the
"training" for the same cores. Against AWS S3 or MinIO give `--endpoint-url` (credentials
from the AWS_* variables) and `--bucket`. Writes benchmarks/results_remote.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from verl_ckpt.remote.transfer import copy_files
from verl_ckpt.store.commit_record import FileEntry
from verl_ckpt.store.fsio import CHECKSUM_ALGORITHM, file_checksum
from verl_ckpt.store.fsspec_store import FsspecStore

OUT = Path(__file__).resolve().parent / "results_remote.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3, help="files in the step")
    # Above 2 x 50 MiB s3fs's put goes multipart too (below, one PUT per file).
    parser.add_argument("--mib", type=int, default=128, help="MiB per file")
    parser.add_argument("--pairs", type=int, default=3, help="paired measurements")
    parser.add_argument("--threads", type=int, default=4, help="verl_ckpt upload threads")
    parser.add_argument("--endpoint-url", help="an S3 endpoint instead of a local moto server")
    parser.add_argument("--bucket", help="with --endpoint-url: an existing bucket")
    parser.add_argument(
        "--recipe",
        action="store_true",
        help="also: step times of recipes.ppo_toy saving every step, without and with the "
        "remote tier (benchmarks/recipe_bench.py's runs)",
    )
    parser.add_argument("--recipe-steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args(argv)


def make_step(directory: Path, files: int, mib: int) -> list[FileEntry]:
    """A step directory of `files` incompressible files and their record entries."""
    entries = []
    for index in range(files):
        rel = f"actor/__{index}_0.distcp"
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(mib << 20))
        entries.append(FileEntry(rel, *file_checksum(path)))
    return entries


def plain_put(store: FsspecStore, step_path: Path, entries: list[FileEntry], prefix: str) -> None:
    """What a user would write without verl_ckpt: s3fs's own parallel, multipart put."""
    store.fs.put(
        [str(step_path / e.path) for e in entries],
        [store.key(prefix, e.path) for e in entries],
    )


def verl_upload(
    store: FsspecStore, step_path: Path, entries: list[FileEntry], prefix: str, threads: int
) -> None:
    # copy_files names objects after the local step directory: a fresh one per run.
    target = step_path.parent / prefix
    if not target.exists():
        target.symlink_to(step_path.name)
    outcome = copy_files(store, target, 0, entries, CHECKSUM_ALGORITHM, threads, 3600.0)
    if outcome.errors:
        raise RuntimeError("; ".join(outcome.errors))


def train_burst(steps: int = 20) -> float:
    """Seconds per step of a CPU "training step" (matmuls on one thread)."""
    a = torch.randn(384, 384)
    started = time.perf_counter()
    for _ in range(steps):
        b = a @ a
        a = b / b.norm()
    return (time.perf_counter() - started) / steps


def measure(args: argparse.Namespace, store: FsspecStore, workdir: Path) -> dict[str, Any]:
    step_path = workdir / "global_step_0"
    entries = make_step(step_path, args.files, args.mib)
    nbytes = sum(e.size for e in entries)
    plain, ours, alone, during = [], [], [], []
    torch.set_num_threads(1)
    train_burst(20)  # warm-up
    for pair in range(args.pairs):
        started = time.perf_counter()
        plain_put(store, step_path, entries, f"plain_{pair}")
        plain.append(time.perf_counter() - started)
        started = time.perf_counter()
        verl_upload(store, step_path, entries, f"global_step_{pair + 1}", args.threads)
        ours.append(time.perf_counter() - started)
        # moto keeps every object in its memory: drop them before the next pair.
        for prefix in (f"plain_{pair}", f"global_step_{pair + 1}"):
            store.remove_tree(prefix)
        # Training alone, for as long as an upload takes, then the same during one.
        bursts, until = [], time.perf_counter() + ours[-1]
        while time.perf_counter() < until:
            bursts.append(train_burst(5))
        alone.append(statistics.median(bursts))
        upload = threading.Thread(
            target=verl_upload,
            args=(store, step_path, entries, f"global_step_{100 + pair}", args.threads),
        )
        upload.start()
        bursts = []
        while upload.is_alive():
            bursts.append(train_burst(5))
        upload.join()
        store.remove_tree(f"global_step_{100 + pair}")
        during.append(statistics.median(bursts) if bursts else alone[-1])
    return {
        "bytes": nbytes,
        "plain_s": plain,
        "verl_s": ours,
        "ratio": statistics.median(v / p for v, p in zip(ours, plain)),
        "slowdown": statistics.median(d / a for d, a in zip(during, alone)),
        "alone_step_s": statistics.median(alone),
        "during_step_s": statistics.median(during),
    }


def recipe_slowdown(bucket: str, workdir: Path, steps: int) -> str:
    """recipes.ppo_toy (enlarged as in recipe_bench) without saves, saving every step, and
    saving every step with every step uploaded; the endpoint comes from the AWS_* variables."""
    from benchmarks.recipe_bench import MODEL, SKIP_STEPS, _figures, _run_once

    variants = [
        ("no saves", ["checkpoint.save_freq=0"]),
        ("save every step", ["checkpoint.save_freq=1"]),
        (
            "save every step, each uploaded",
            ["checkpoint.save_freq=1", f"checkpoint.remote.url=s3://{bucket}/every1"]
            + ["checkpoint.remote.keep=2"],
        ),
        (
            "save every step, every 4th uploaded (remote.every=4)",
            ["checkpoint.save_freq=1", f"checkpoint.remote.url=s3://{bucket}/every4"]
            + ["checkpoint.remote.keep=2", "checkpoint.remote.every=4"],
        ),
    ]
    rows = []
    for index, (name, overrides) in enumerate(variants):
        figures = _figures(_run_once(workdir / f"recipe_{index}", steps, overrides, print))
        rows.append((name, figures))
    base, saving = rows[0][1]["median"], rows[1][1]["median"]
    lines = [
        f"recipes.ppo_toy, {steps} steps per run, {' '.join(MODEL)}; steps {SKIP_STEPS + 1}.."
        f"{steps}; a save of {(rows[1][1]['bytes'] or 0) / 1e6:.1f} MB after every step",
        "",
        "| run | step s (median) | vs no saves | vs saving without upload | save() blocks s "
        "(median; waits for an upload beyond remote.max_in_flight=1) |",
        "|---|---|---|---|---|",
    ]
    for name, figures in rows:
        median, blocking = figures["median"], figures["blocking"]
        lines.append(
            f"| {name} | {median:.3f} | {median / base:.2f}x | {median / saving:.2f}x | "
            f"{'-' if blocking is None else f'{blocking:.3f}'} |"
        )
    return "\n".join(lines)


def report(args: argparse.Namespace, found: dict[str, Any], endpoint: str) -> str:
    mb = found["bytes"] / 1e6
    plain, ours = statistics.median(found["plain_s"]), statistics.median(found["verl_s"])
    return "\n".join(
        [
            "# Remote tier: upload throughput and training slow-down",
            "",
            f"{args.files} files x {args.mib} MiB = {mb:.0f} MB to {endpoint}; {args.pairs} "
            f"pairs; verl_ckpt with {args.threads} threads; python -m benchmarks.remote_tier",
            "",
            "| upload | median s | MB/s |",
            "|---|---|---|",
            f"| plain s3fs `put` (parallel multipart, no checks) | {plain:.2f} | "
            f"{mb / plain:.0f} |",
            f"| verl_ckpt `copy_files` (multipart, checksum-verified) | {ours:.2f} | "
            f"{mb / ours:.0f} |",
            "",
            f"- verl_ckpt / plain s3fs time: {found['ratio']:.2f}x (median of paired ratios)",
            f"- a CPU training step (one thread) while an upload runs: {found['slowdown']:.2f}x "
            f"as long as without ({found['alone_step_s'] * 1e3:.1f} ms -> "
            f"{found['during_step_s'] * 1e3:.1f} ms; median of paired ratios; the local S3 "
            "server competes for the same cores)",
            "",
            "| machine | |",
            "|---|---|",
            *(f"| {key} | {value} |" for key, value in machine().items()),
            "",
        ]
    )


def machine() -> dict[str, str]:
    from importlib.metadata import version

    from benchmarks.report import machine_description

    described = machine_description()
    for package in ("fsspec", "s3fs", "moto"):
        described[package] = version(package)
    return described


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    with tempfile.TemporaryDirectory(prefix="verl_ckpt_remote_bench_") as tmp:
        workdir = Path(tmp)
        if args.endpoint_url:
            options = {"endpoint_url": args.endpoint_url}
            bucket = args.bucket
        else:
            from tests.s3_server import MotoServer

            server = MotoServer(workdir).wait_ready()
            options = server.storage_options()
            bucket = server.new_bucket()
        try:
            store = FsspecStore(f"s3://{bucket}/bench_{uuid.uuid4().hex[:8]}", options)
            found = measure(args, store, workdir)
            if args.recipe:
                if server is not None:
                    os.environ.update(server.env())
                recipe = recipe_slowdown(bucket, workdir, args.recipe_steps)
        finally:
            if server is not None:
                server.stop()
    text = report(args, found, args.endpoint_url or "moto_server on 127.0.0.1")
    if args.recipe:
        text += "\n## Training while uploading: the PPO recipe\n\n" + recipe + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
