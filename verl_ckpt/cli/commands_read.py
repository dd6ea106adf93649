"""`verl-ckpt ls | verify | inspect`: read a root or a remote tier (any store), change
nothing."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from verl_ckpt.cli.common import EXIT_BAD_CHECKPOINT, CliError, pick_step
from verl_ckpt.cli.output import (
    escaped,
    human_age,
    human_bytes,
    inspection_output,
    participant_lines,
    print_table,
    print_verify_verdict,
)
from verl_ckpt.format.inspection import TensorEntry, read_role_entries
from verl_ckpt.hf.record import export_dir, verify_export
from verl_ckpt.protocol.errors import (
    CheckpointError,
    CommitRecordError,
    SignatureError,
    TrackerError,
)
from verl_ckpt.remote.transfer import copy_files
from verl_ckpt.startup.resume_check import QUARANTINE_DIRNAME
from verl_ckpt.startup.root_lock import is_locked, read_holder
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import (
    CommitRecord,
    find_commit_record,
    read_commit_record,
    read_commit_record_and_digest,
)
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DELETING_PREFIX,
    DRIVER_ROLE,
    TRACKER_FILENAME,
    list_step_dirs,
)
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.rollback import ARCHIVE_PREFIX, intent_path, read_rollback_intent
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import read_tracker
from verl_ckpt.store.verification import check_step_files

__all__ = ["StepRow", "cmd_inspect", "cmd_ls", "cmd_verify", "step_rows"]

# Deadline of `verify`'s reads and `inspect`'s downloads, and the files `inspect` moves in
# parallel.
_TIMEOUT_S = 3600.0
_THREADS = 8


@dataclass(frozen=True)
class StepRow:
    """One step as `ls` and `prune` show it."""

    step: int
    # "committed", "not committed", "corrupt: <reason>", or with signing keys "refused:
    # unsigned" / "refused: signed with another key (...)"
    status: str
    record: CommitRecord | None
    roles: str
    size: int
    age_s: float | None

    @property
    def committed(self) -> bool:
        return self.record is not None


def step_rows(store: Store, keyring: Keyring | None = None) -> list[StepRow]:
    """Every step of the store, oldest first, read now (a live job may be changing it).
    With a keyring, a step whose record it does not verify is listed as refused."""
    now = time.time()
    rows = []
    for step in store.list_steps():
        rel = store.step_rel(step)
        try:
            record = find_commit_record(store, step, keyring)
            status = "committed" if record is not None else "not committed"
        except SignatureError as exc:
            record, status = None, f"refused: {exc.reason}"
        except CommitRecordError as exc:
            # A missing record and an unreadable one mean different things to the user: the
            # first is an unfinished or interrupted save, the second a damaged commit.
            record, status = None, f"corrupt: {exc}"
        files = store.list_files(rel)
        if record is not None:
            # The roles and the driver, then the declared participants: all of the step.
            everyone = {**record.participants, **record.state_participants}
            roles = ",".join(f"{r}:{n}" for r, n in sorted(everyone.items()))
            age = now - record.committed_at
        else:
            roles = ",".join(sorted({f.split("/", 1)[0] for f in files if "/" in f})) or "-"
            changed = store.modified_at(rel)
            age = None if changed is None else now - changed
        size = sum(files.values())
        rows.append(StepRow(step, status, record, roles, size, age))
    return rows


def cmd_ls(store: Store, args: argparse.Namespace) -> int:
    rows = step_rows(store, args.keyring)
    by_step = {row.step: row for row in rows}
    target = None
    try:
        target = read_tracker(store)
        if target is None:
            note = f"none ({TRACKER_FILENAME} missing: nothing committed yet?)"
        elif target not in by_step:
            note = f"step {target}, BUT {store.uri(store.step_rel(target))} does not exist"
        elif not by_step[target].committed:
            note = f"step {target}, BUT that step is {by_step[target].status}"
        else:
            note = f"step {target}"
    except TrackerError as exc:
        note = f"unreadable: {exc}"
    print(f"root: {store.url}")
    print(f"tracker: {note}")
    if isinstance(store, LocalStore) and is_locked(store.root):
        holder = read_holder(store.root)
        # The holder's host and purpose come from a file anyone who can write the root wrote.
        shown = escaped(holder.describe()) if holder else "a process that left no name"
        print(f"in use by: {shown}")
    if rows:
        table = [("", "STEP", "SIZE", "AGE", "ROLES", "STATUS")]
        for row in rows:
            age = "-" if row.age_s is None else human_age(max(0.0, row.age_s))
            mark = "*" if row.step == target else ""
            table.append((mark, str(row.step), human_bytes(row.size), age, row.roles, row.status))
        print_table(table, right=frozenset({1, 2, 3}))
        if target in by_step:
            print("(* = the tracker's target)")
    else:
        print("no global_step_<N> directories")
    if isinstance(store, LocalStore):
        _print_leftovers(store.root)
    return 0


def _print_leftovers(root: Path) -> None:
    """What `ls`'s table does not show of a local root: a pending rollback, archives,
    half-deleted steps, quarantined steps."""
    try:
        intent = read_rollback_intent(root)
    except CheckpointError as exc:
        print(f"pending rollback: unreadable: {exc}")
    else:
        if intent is not None:
            print(
                f"pending rollback: to step {intent.to}, moving steps {list(intent.steps)} "
                f"({intent_path(root)}): interrupted; the next job start or `verl-ckpt "
                f"rollback {root} --to {intent.to}` completes it"
            )
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.startswith(ARCHIVE_PREFIX):
            moved = sorted(list_step_dirs(entry))
            print(
                f"archive {entry}: steps {moved} (moved out by verl-ckpt rollback; "
                "delete it when no longer needed)"
            )
        elif entry.name.startswith(DELETING_PREFIX):  # retention's name for a doomed step
            print(
                f"leftover {entry}: a deletion by retention was interrupted or failed; "
                "removed after the next commit"
            )
        elif entry.name == QUARANTINE_DIRNAME:
            for moved in sorted(p for p in entry.iterdir() if p.is_dir()):
                print(
                    f"quarantined {moved}: failed verification at a job start "
                    "(checkpoint.resume_fallback=previous); never deleted by verl_ckpt"
                )


def cmd_verify(store: Store, args: argparse.Namespace) -> int:
    step = pick_step(store, args.step)
    # CommitRecordError: not committed, corrupt; SignatureError (with --signing-key-*):
    # unsigned or signed with another key, before any other file of the step is read.
    record, source = read_commit_record_and_digest(store, step, args.keyring)
    result = check_step_files(
        store, step, record.files, record.checksum_algorithm, args.threads, _TIMEOUT_S
    )
    problems = [problem.describe() for problem in result.problems]
    if record.step != step:
        where = store.uri(store.step_rel(step, COMMIT_RECORD_FILENAME))
        problems.insert(0, f"{where}: names step {record.step}, not {step}")
    exports = _verify_exports(store, step, record, problems, args.keyring, source)
    speed = f" in {result.seconds:.3f} s ({result.gb_per_s:.2f} GB/s, {result.threads} threads)"
    status = print_verify_verdict(step, record, problems, speed)
    if status == 0:
        for line in participant_lines(record):
            print(line)
        for line in exports:
            print(escaped(line))  # an export record's architecture is data from the root
    return status


def _verify_exports(
    store: Store,
    step: int,
    record: CommitRecord,
    problems: list[str],
    keyring: Keyring | None,
    source: str,
) -> list[str]:
    """Check every role's Hugging Face export that exists (step E; local roots only):
    problems go to `problems`; a line per export that verified is returned. With a keyring,
    an export's record must be signed and name this save of the step (`source`)."""
    if not isinstance(store, LocalStore):
        return []
    path = store.path(store.step_rel(step))
    lines = []
    for role in sorted(record.participants):
        directory = export_dir(path, role)
        if role == DRIVER_ROLE or not directory.exists():
            continue
        export, found = verify_export(directory, keyring, source if keyring else None)
        problems.extend(found)
        if export is not None and not found:
            total = sum(entry.size for entry in export.files)
            lines.append(
                f"OK Hugging Face export of {role} ({export.architecture}): "
                f"{len(export.files)} files, {total} bytes verified"
            )
    return lines


def cmd_inspect(store: Store, args: argparse.Namespace) -> int:
    step = pick_step(store, args.step)
    record = read_commit_record(store, step, args.keyring)
    roles = sorted(role for role in record.participants if role != DRIVER_ROLE)
    with _role_metadata(store, step, record, roles) as directory:
        entries = {
            role: _role_entries(directory / role, store.uri(store.step_rel(step, role)))
            for role in roles
        }
    inspection_output(store.url, store.uri(store.step_rel(step)), record, entries, args.json)
    return 0


@contextmanager
def _role_metadata(
    store: Store, step: int, record: CommitRecord, roles: list[str]
) -> Iterator[Path]:
    """A local directory holding each role's `.metadata` of the step: the step's own on a
    local root, else a temporary copy (verified against the record)."""
    if isinstance(store, LocalStore):
        yield store.path(store.step_rel(step))
        return
    wanted = [e for e in record.files if any(e.path == f"{r}/.metadata" for r in roles)]
    with tempfile.TemporaryDirectory(prefix="verl_ckpt_inspect_") as tmp:
        outcome = copy_files(
            Path(tmp) / f"global_step_{step}",
            store,
            step,
            wanted,
            record.checksum_algorithm,
            _THREADS,
            _TIMEOUT_S,
            what="download",
        )
        if outcome.errors:
            raise CheckpointError("; ".join(outcome.errors))
        yield Path(tmp) / f"global_step_{step}"


def _role_entries(role_dir: Path, shown_dir: str) -> list[TensorEntry]:
    """The role's entries; `shown_dir`: the role's directory as the user names it (a local
    path, or a URL whose `.metadata` was downloaded into `role_dir`)."""
    shown = f"{shown_dir}/.metadata"
    try:
        return read_role_entries(role_dir, shown)
    except FileNotFoundError:
        raise CliError(f"{shown} is missing", EXIT_BAD_CHECKPOINT) from None
    except CheckpointError as exc:  # damaged, or refused unread: the message names the file
        raise CliError(str(exc), EXIT_BAD_CHECKPOINT) from None
    except OSError as exc:
        raise CliError(f"{shown} is unreadable: {exc}", EXIT_BAD_CHECKPOINT) from None
