"""How `verl-ckpt` prints: sizes, ages, tables, and the verdicts and inspections that more
than one command shows."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from verl_ckpt.cli.common import EXIT_BAD_CHECKPOINT
from verl_ckpt.format.inspection import TensorEntry
from verl_ckpt.store.commit_record import CommitRecord
from verl_ckpt.store.layout import DRIVER_STATE_FILENAME, participant_state_file

__all__ = [
    "escaped",
    "human_age",
    "human_bytes",
    "inspection_output",
    "participant_lines",
    "print_table",
    "print_verify_verdict",
]


def escaped(text: object, keep_newlines: bool = False) -> str:
    """`text` with its control characters escaped as repr escapes them (`\\x1b`, `\\n`),
    unquoted: names read from a root are printed through this, so that a role or a key
    holding terminal escapes cannot rewrite the terminal. `keep_newlines` for a message of
    ours that has several lines."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or (keep_newlines and ch == "\n") else repr(ch)[1:-1] for ch in text
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for limit, unit_s, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if seconds < limit:
            return f"{int(seconds // unit_s)}{unit}"
    return f"{int(seconds // 86400)}d"


def print_table(rows: list[tuple[str, ...]], right: frozenset[int] = frozenset()) -> None:
    rows = [tuple(escaped(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        print("  ".join(cells).rstrip())


def print_verify_verdict(step: int, record: CommitRecord, problems: list[str], speed: str) -> int:
    """Print `verify`'s verdict on a step; its exit status."""
    if problems:
        print(f"FAILED step {step}: {len(problems)} problem(s) in {len(record.files)} files")
        for problem in problems:
            print(escaped(problem))
        return EXIT_BAD_CHECKPOINT
    total = sum(entry.size for entry in record.files)
    print(f"OK step {step}: {len(record.files)} files, {total} bytes verified{speed}")
    return 0


def inspection_output(
    root: str,
    step_location: str,
    record: CommitRecord,
    roles: dict[str, list[TensorEntry]],
    as_json: bool,
) -> None:
    """`inspect`'s output."""
    if not as_json:
        _print_inspection(root, step_location, record, roles)
        return
    report = {
        "root": root,
        "step": record.step,
        "format_version": record.format_version,
        "participants": record.participants,
        "state_participants": record.state_participants,
        "roles": {
            role: {
                "path": f"{step_location}/{role}",
                "entries": [asdict(e) for e in entries],
                "total_bytes": sum(e.nbytes for e in entries),
            }
            for role, entries in roles.items()
        },
        "files": [asdict(entry) for entry in record.files],
    }
    json.dump(report, sys.stdout, indent=1)
    print()


def _print_inspection(
    root: str, step_location: str, record: CommitRecord, roles: dict[str, list[TensorEntry]]
) -> None:
    print(
        f"step {record.step} under {escaped(root)}: committed, format version "
        f"{record.format_version}"
    )
    print(
        "participants: "
        + ", ".join(f"{escaped(r)} x{n}" for r, n in sorted(record.participants.items()))
    )
    if record.state_participants:
        held = sorted(record.state_participants.items())
        print("declared participants: " + ", ".join(f"{escaped(r)} x{n}" for r, n in held))
    for role, entries in roles.items():
        print(f"\nrole {escaped(role)} ({escaped(step_location)}/{escaped(role)}):")
        rows = [("  KEY", "DTYPE", "SHAPE", "BYTES")]
        for e in entries:
            shape = str(e.shape) if e.kind == "tensor" else "-"
            rows.append((f"  {e.key}", e.dtype or "object", shape, str(e.nbytes)))
        print_table(rows, right=frozenset({3}))
        total = sum(e.nbytes for e in entries)
        tensors = sum(e.kind == "tensor" for e in entries)
        print(
            f"  total: {len(entries)} entries ({tensors} tensors), "
            f"{total} bytes ({human_bytes(total)})"
        )
    for entry in record.files:
        if entry.path == DRIVER_STATE_FILENAME:
            print(f"\ndriver state: {escaped(entry.path)}, {entry.size} bytes")
    for line in participant_lines(record, verified=False):
        print(line)


def participant_lines(record: CommitRecord, verified: bool = True) -> list[str]:
    """One line per declared participant of the step (its state files), as `verify` (with
    `verified`) and `inspect` print them."""
    lines = []
    for name, count in sorted(record.state_participants.items()):
        paths = {participant_state_file(name, index) for index in range(count)}
        entries = [entry for entry in record.files if entry.path in paths]
        size = sum(entry.size for entry in entries)
        if verified:
            lines.append(
                f"OK participant {name} x{count}: {len(entries)} files, {size} bytes verified"
            )
        else:
            lines.append(f"participant {name} x{count}: {len(entries)} state files, {size} bytes")
    return lines
