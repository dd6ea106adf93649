"""The main figures of several runs of `python -m benchmarks.run` side by side, with their
median and spread: `python -m benchmarks.three_runs OUT_DIR_1 OUT_DIR_2 OUT_DIR_3 [--out F]`.

Each OUT_DIR holds one run's results.json. Every figure is computed as the run's own report
computes it (paired ratios, report.summarize); nothing is re-measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.saves import Op
from benchmarks.systems import DCP_PEER, REFERENCE

__all__ = ["figures", "main"]


def figures(results: dict[str, Any]) -> dict[str, float | None]:
    """The headline figures of one run's results.json."""
    ops = [Op(**o) for o in results["ops"]]
    systems = sorted({o.name for o in ops if o.name not in report.FLOORS})
    by = {r.system: r for r in report.summarize(ops, systems)}
    ref = by[REFERENCE]
    dcp = by.get(DCP_PEER)
    after = results.get("after_save", {}).get(REFERENCE, {})
    out: dict[str, float | None] = {
        "blocking s": ref.blocking,
        "blocking / copy floor": ref.ratio("blocking/copy"),
        "durable s": ref.durable,
        "durable / write floor (fastest variant)": ref.ratio("durable/write"),
        "durable / DCP async thread (paired)": (
            1 / dcp.ratio("durable/ref") if dcp is not None and dcp.ratio("durable/ref") else None
        ),
        "first save durable / steady": (
            ref.first_durable / ref.durable if ref.first_durable and ref.durable else None
        ),
        "first save blocking / steady": (
            ref.first_blocking / ref.blocking if ref.first_blocking and ref.blocking else None
        ),
        "next update, outside quiet()": after.get("slowdown"),
        "next update, inside quiet()": after.get("slowdown_in_quiet"),
        "DCP's next update": results.get("after_save", {}).get(DCP_PEER, {}).get("slowdown"),
    }
    for name, row in by.items():
        if name not in (REFERENCE, DCP_PEER):
            out[f"{name}: durable / write floor"] = row.ratio("durable/write")
            out[f"{name}: next update"] = (
                results.get("after_save", {}).get(name, {}).get("slowdown")
            )
    for variant, times in results.get("floor_variants", {}).items():
        out[f"write floor {variant} s"] = statistics.median(times) if times else None
    for cache, variants in results.get("loads", {}).items():
        for variant, times in variants.items():
            if times:
                out[f"load {cache}: {variant} s"] = statistics.median(times)
    return out


def table(runs: list[dict[str, float | None]], labels: list[str]) -> str:
    keys = list(dict.fromkeys(k for run in runs for k in run))
    lines = [
        "| figure | " + " | ".join(labels) + " | median | spread (max - min) |",
        "|---|" + "---|" * (len(labels) + 2),
    ]
    for key in keys:
        values = [run.get(key) for run in runs]
        present = [v for v in values if v is not None]
        median = statistics.median(present) if present else None
        spread = max(present) - min(present) if len(present) > 1 else None
        lines.append(
            f"| {key} | "
            + " | ".join(_fmt(v) for v in values)
            + f" | {_fmt(median)} | {_fmt(spread)} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="out dirs of runs (each with results.json)")
    parser.add_argument("--out", default=None, help="write the table here as well")
    args = parser.parse_args(argv)
    loaded = [json.loads((Path(d) / "results.json").read_text()) for d in args.runs]
    text = table([figures(r) for r in loaded], [f"run {i + 1}" for i in range(len(loaded))])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
