"""`verl-ckpt ls | verify | inspect | prune | rollback` on a remote tier URL, and `verl-ckpt
pull`.

Called by verl_ckpt.cli.main when ROOT is a URL (s3://bucket/prefix, file:///path, ...). Storage
options come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) and/or
`--storage-options JSON`. Exit statuses and one-line errors as for a local root.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from verl_ckpt.cli.main import (
    EXIT_BAD_CHECKPOINT,
    EXIT_USAGE,
    _CliError,
    _human_age,
    _human_bytes,
    _inspection_output,
    _locked,
    _print_table,
    _print_verify_verdict,
    _role_entries,
)
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
    CommitTimeoutError,
    TrackerError,
)
from verl_ckpt.remote.pull import pull_step
from verl_ckpt.remote.tier import (
    apply_remote_retention,
    newest_remote_step,
    plan_remote_rollback,
    read_remote_record,
    read_remote_tracker,
    roll_back_remote,
)
from verl_ckpt.remote.transfer import download_files, verify_remote_files
from verl_ckpt.store.commit_record import CommitRecord
from verl_ckpt.store.fsspec_store import RemoteListing, RemoteStore, describe_store_error
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, DRIVER_ROLE, step_dir

__all__ = ["run_remote_command"]

# Deadline of one command's transfers (each other store call has --timeout), and the files
# moved in parallel.
_TIMEOUT_S = 3600.0
_THREADS = 8


def run_remote_command(args: argparse.Namespace) -> int:
    """Run `args.command` on the URL `args.root`; CLI errors are raised as the CLI's own."""
    handler = _HANDLERS.get(args.command)
    if handler is None:
        raise _CliError(
            f"{args.command} works on a local ROOT only, not on {args.root}", EXIT_USAGE
        )
    try:
        # Each store call within --timeout: s3fs's retries alone can take minutes.
        store = RemoteStore(args.root, _storage_options(args), call_timeout_s=args.timeout)
    except CheckpointConfigError as exc:
        raise _CliError(str(exc), EXIT_USAGE) from None
    try:
        return handler(store, args)
    except CommitTimeoutError as exc:  # a store call past --timeout: names the object
        raise _CliError(describe_store_error(exc), EXIT_BAD_CHECKPOINT) from None
    except (_CliError, CheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - a store error: one line naming the URL
        raise _CliError(f"{store.url}: {describe_store_error(exc)}", EXIT_BAD_CHECKPOINT) from None


def _storage_options(args: argparse.Namespace) -> dict:
    text = getattr(args, "storage_options", None)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _CliError(f"--storage-options is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(options, dict):
        raise _CliError("--storage-options must be a JSON object", EXIT_USAGE)
    return options


def _tracker(store: RemoteStore) -> int | None:
    try:
        return read_remote_tracker(store)
    except TrackerError as exc:
        raise _CliError(str(exc), EXIT_BAD_CHECKPOINT) from None


def _pick_step(store: RemoteStore, asked: int | None) -> tuple[int, CommitRecord]:
    """`asked`, else the remote tracker's step; with its commit record."""
    step = asked if asked is not None else _tracker(store)
    if step is None:
        raise _CliError(
            f"{store.uri('latest_checkpointed_iteration.txt')} does not exist, so there is no "
            "default step; pass --step N",
            EXIT_BAD_CHECKPOINT,
        )
    record = read_remote_record(store, step)
    if record is None:
        name = step_dir("", step).name
        present = store.listing().steps
        if step not in present:
            code = EXIT_USAGE if asked is not None else EXIT_BAD_CHECKPOINT
            raise _CliError(
                f"{store.uri(name)} does not exist; steps present: {sorted(present) or 'none'}",
                code,
            )
        raise _CliError(
            f"{store.uri(name)} is not a committed step: its commit record "
            f"{COMMIT_RECORD_FILENAME} is missing (an upload that did not finish)",
            EXIT_BAD_CHECKPOINT,
        )
    return step, record


# ---- commands ------------------------------------------------------------------------------


def _ls(store: RemoteStore, args: argparse.Namespace) -> int:
    listing = store.listing()
    try:
        target = read_remote_tracker(store)
        note = "none (nothing committed yet?)" if target is None else f"step {target}"
        if target is not None and target not in listing.committed():
            note += ", BUT that step is not committed there"
    except TrackerError as exc:
        target, note = None, f"unreadable: {exc}"
    print(f"root: {store.url}")
    print(f"tracker: {note}")
    if not listing.steps:
        print("no global_step_<N> prefixes")
        return 0
    rows = [("", "STEP", "SIZE", "AGE", "ROLES", "STATUS")]
    now = time.time()
    for step in sorted(listing.steps):
        record, status = _record_and_status(store, step, step in listing.committed())
        roles = (
            ",".join(f"{r}:{n}" for r, n in sorted(record.participants.items())) if record else "-"
        )
        age = _human_age(max(0.0, now - record.committed_at)) if record else "-"
        size = _human_bytes(listing.size(step))
        rows.append(("*" if step == target else "", str(step), size, age, roles, status))
    _print_table(rows, right=frozenset({1, 2, 3}))
    if target in listing.steps:
        print("(* = the tracker's target)")
    return 0


def _record_and_status(
    store: RemoteStore, step: int, has_record: bool
) -> tuple[CommitRecord | None, str]:
    """A step's record (None unless it reads) and `ls`'s STATUS for it."""
    if not has_record:
        return None, "not committed (an upload that did not finish)"
    try:
        record = read_remote_record(store, step)
    except CommitRecordError as exc:
        return None, f"not committed: {exc}"
    if record is None:
        return None, "not committed (deleted since the listing)"
    return record, "committed"


def _verify(store: RemoteStore, args: argparse.Namespace) -> int:
    step, record = _pick_step(store, args.step)
    outcome = verify_remote_files(
        store, step, record.files, record.checksum_algorithm, _THREADS, _TIMEOUT_S
    )
    problems = list(outcome.errors)
    if record.step != step:
        where = store.uri(step_dir("", step).name, COMMIT_RECORD_FILENAME)
        problems.insert(0, f"{where}: names step {record.step}, not {step}")
    return _print_verify_verdict(step, record, problems, speed="")


def _inspect(store: RemoteStore, args: argparse.Namespace) -> int:
    step, record = _pick_step(store, args.step)
    roles = sorted(role for role in record.participants if role != DRIVER_ROLE)
    wanted = [e for e in record.files if any(e.path == f"{r}/.metadata" for r in roles)]
    with tempfile.TemporaryDirectory(prefix="verl_ckpt_inspect_") as tmp:
        outcome = download_files(
            store, step, wanted, record.checksum_algorithm, Path(tmp), _THREADS, _TIMEOUT_S
        )
        if outcome.errors:
            raise CheckpointError("; ".join(outcome.errors))
        entries = {role: _role_entries(Path(tmp) / role) for role in roles}
    _inspection_output(store.url, store.uri(step_dir("", step).name), record, entries, args.json)
    return 0


def _prune(store: RemoteStore, args: argparse.Namespace) -> int:
    listing = store.listing()
    outcome = apply_remote_retention(store, args.keep, dry_run=args.dry_run)
    _print_removed(store, listing, outcome.deleted, outcome.purged, args.dry_run)
    for error in outcome.errors:
        print(f"FAILED {error}")
    kept = sorted(set(listing.committed()) - set(outcome.deleted) - set(outcome.unreadable))
    print(f"kept committed steps: {kept or 'none'}; tracker's target: {_tracker(store)}")
    if outcome.unreadable:
        print(
            f"left alone steps {outcome.unreadable}: their commit records cannot be read "
            "(not counted toward --keep; `verl-ckpt ls` says why)"
        )
    return EXIT_BAD_CHECKPOINT if outcome.errors else 0


def _rollback(store: RemoteStore, args: argparse.Namespace) -> int:
    if not args.delete:
        raise _CliError(
            f"rollback of a remote tier URL ({store.url}) needs --delete: object storage has no "
            "cheap archive (a move is a copy), so the steps newer than --to are deleted "
            "(--dry-run lists them)",
            EXIT_USAGE,
        )
    _pick_step(store, args.to)  # committed there, else exit 2 (absent) or 1 (no record)
    listing = store.listing()
    plan = plan_remote_rollback(listing, args.to)
    try:
        tracker = read_remote_tracker(store)
        before = "none" if tracker is None else str(tracker)
    except TrackerError:
        before = "unreadable"
    if not args.dry_run:
        roll_back_remote(store, plan)
    _print_removed(store, listing, plan.steps, plan.leftovers, args.dry_run)
    if not plan.steps and not plan.leftovers:
        print(f"no step newer than {plan.to}")
    suffix = " (dry run: nothing changed)" if args.dry_run else ""
    print(f"tracker: {before} -> {plan.to}{suffix}")
    return 0


def _print_removed(
    store: RemoteStore,
    listing: RemoteListing,
    steps: list[int],
    leftovers: list[int],
    dry_run: bool,
) -> None:
    """One line per committed step and per unfinished upload deleted (or, dry, that would
    be), as prune and rollback of a URL report them."""
    verb = "would delete" if dry_run else "deleted"
    for step in steps:
        name = step_dir("", step).name
        print(f"{verb} step {step}: {store.uri(name)} ({_human_bytes(listing.size(step))})")
    for step in leftovers:
        print(f"{verb} leftover {store.uri(step_dir('', step).name)} (an unfinished upload)")


def _pull(store: RemoteStore, args: argparse.Namespace) -> int:
    step = args.step if args.step is not None else newest_remote_step(store)
    if step is None:
        raise _CliError(f"{store.url} holds no committed step", EXIT_BAD_CHECKPOINT)
    if args.step is not None:
        _pick_step(store, step)  # a step the user typed and that is not there: exit 2
    root = Path(args.dest).resolve()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root, "verl-ckpt pull"):
        summary = pull_step(store, step, root, _THREADS, _TIMEOUT_S)
    if not summary.downloaded:
        print(f"step {step} is committed in {root} already: nothing pulled")
    else:
        print(
            f"pulled step {step} from {store.url} into {summary.path}: {summary.files} files, "
            f"{summary.bytes} bytes verified in {summary.seconds:.2f} s"
        )
    return 0


_HANDLERS: dict[str, Callable[[RemoteStore, argparse.Namespace], int]] = {
    "ls": _ls,
    "verify": _verify,
    "inspect": _inspect,
    "prune": _prune,
    "rollback": _rollback,
    "pull": _pull,
}
