"""Time to durable against PyTorch DCP `async_save` at several state sizes.

The fixed costs of a save (planning, the report, the commit, the round trips) weigh most on
small states; bandwidth on large ones. For each size, a fresh pair of ranks holds that
state, and verl_ckpt (thread writer, prepare() at open) and DCP async_save (thread executor)
save it in the same paired blocks as the main benchmark (benchmarks/saves.py), with the
write floor beside every save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import DURABLE_TARGET, DURABLE_VS_DCP_TARGET, _f, _table, _x
from benchmarks.report import summarize as summarize_rows
from benchmarks.saves import SaveBench
from benchmarks.state import describe, spec_for_size
from benchmarks.systems import DCP_PEER, REFERENCE

__all__ = ["run_sizes", "sizes_table"]


def saves_at(size_gib: float, saves: int) -> int:
    """Saves per system at `size_gib`: below 1 GiB more of them (up to four times as many),
    about as many bytes as at 1 GiB. A small save takes a fraction of a second, so the
    machine's noise is a larger part of it, and three steady saves (the default four, less
    the first) left the verdict at 0.25 GiB to chance; more cost seconds."""
    return max(saves, min(4 * saves, round(saves / size_gib)))


def run_sizes(sizes_gib: list[float], saves: int, workdir: Path, log: Any) -> list[dict]:
    """One paired block of the reference and DCP per size; the summarised rows per size."""
    found = []
    for size in sizes_gib:
        spec = spec_for_size(int(size * 2**30))
        count = saves_at(size, saves)
        log(f"\n[sizes] {size:g} GiB: {describe(spec)}, {count} saves per system")
        bench = SaveBench(spec, workdir / f"size_{size:g}", log)
        try:
            ops = bench.run([REFERENCE, DCP_PEER], count, profile=False, after_save=False)
        finally:
            bench.close()
        rows = {r.system: r for r in summarize_rows(ops, [REFERENCE, DCP_PEER])}
        found.append({"size_gib": size, "state": describe(spec), "saves": count, "rows": rows})
    return found


def sizes_table(found: list[dict]) -> tuple[str, list[str]]:
    """The table, and one verdict line per size."""
    body, verdicts = [], []
    for entry in found:
        ours, dcp = entry["rows"].get(REFERENCE), entry["rows"].get(DCP_PEER)
        if ours is None or dcp is None:
            continue
        vs_dcp = 1 / dcp.ratio("durable/ref") if dcp.ratio("durable/ref") else None
        vs_floor = ours.ratio("durable/write")
        body.append(
            [
                f"{entry['size_gib']:g}",
                str(entry.get("saves", "")),
                _f(ours.blocking),
                _f(dcp.blocking),
                _f(dcp.ref_durable),
                _f(dcp.durable),
                _x(vs_dcp, 3),
                _f(ours.write_floor),
                _x(vs_floor, 3),
            ]
        )
        met_dcp = vs_dcp is not None and vs_dcp <= DURABLE_VS_DCP_TARGET
        met_floor = vs_floor is not None and vs_floor <= DURABLE_TARGET
        verdicts.append(
            f"{entry['size_gib']:g} GiB: time to durable {_x(vs_dcp, 3)} of {DCP_PEER} "
            f"(target {DURABLE_VS_DCP_TARGET}x: {'MET' if met_dcp else 'MISSED'}), "
            f"{_x(vs_floor, 3)} of the write floor (target {DURABLE_TARGET}x: "
            f"{'MET' if met_floor else 'MISSED'})"
        )
    table = _table(
        [
            "state GiB (2 ranks)",
            "saves per system",
            "verl_ckpt blocking s",
            "DCP blocking s",
            "verl_ckpt durable s",
            "DCP durable s",
            "durable / DCP (paired)",
            "write floor s",
            "verl_ckpt durable / write floor (paired)",
        ],
        body,
    )
    return table, verdicts
