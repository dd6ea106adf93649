"""`verl-ckpt prune | rollback | export | pull`: change a root or a remote tier. On a local
root each holds the root's lock throughout (`RootLock`), so it never runs beside a job or
beside another command."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from verl_ckpt.cli.commands_read import step_rows
from verl_ckpt.cli.common import EXIT_BAD_CHECKPOINT, EXIT_USAGE, CliError, locked, pick_step
from verl_ckpt.cli.output import human_bytes
from verl_ckpt.hf.record import describe_context_length
from verl_ckpt.protocol.errors import CheckpointConfigError, TrackerError
from verl_ckpt.remote.pull import pull_step
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import (
    is_committed,
    newest_committed,
    read_commit_record,
    read_record_bytes,
)
from verl_ckpt.store.fsio import make_dir
from verl_ckpt.store.layout import TRACKER_FILENAME, step_of_dir
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.retention import apply_retention
from verl_ckpt.store.rollback import (
    ROLLED_BACK_FILENAME,
    RollbackError,
    execute_rollback,
    find_rolled_back,
    intent_path,
    plan_rollback,
    read_rollback_intent,
    refuse_while_rollback_pending,
)
from verl_ckpt.store.tracker import read_tracker

__all__ = ["cmd_export", "cmd_prune", "cmd_pull", "cmd_rollback"]

logger = logging.getLogger(__name__)

# Deadline of `pull`'s download, and the files moved in parallel.
_TIMEOUT_S = 3600.0
_THREADS = 8


def cmd_prune(store: Store, args: argparse.Namespace) -> int:
    with locked(store, "verl-ckpt prune"):
        return _prune(store, args)


def _prune(store: Store, args: argparse.Namespace) -> int:
    refuse_while_rollback_pending(store)
    try:
        target = read_tracker(store)
    except TrackerError as exc:
        # Without the tracker we cannot know which step a resume would load (I3).
        raise CliError(f"{exc}; refusing to prune", EXIT_BAD_CHECKPOINT) from None
    rows = step_rows(store, args.keyring)
    recorded = {row.step for row in rows if row.status != "not committed"}
    if target is not None and target not in recorded:
        # Retention spares the tracker's step only: with its record gone, a rollback's
        # target (an interrupted rollback of a tier that cannot rename moves the tracker
        # last) could be among the steps deleted. (A record this version cannot read, or
        # refuses, is a step of its own: retention neither counts nor deletes it.)
        raise CliError(
            f"the tracker {store.uri(TRACKER_FILENAME)} names step {target}, which has no "
            f"commit record in {store.url} (a rollback interrupted there leaves it so: run "
            "the same `verl-ckpt rollback` again); refusing to prune",
            EXIT_BAD_CHECKPOINT,
        )
    # Retention itself (store/retention.py), as a job's finalizer runs it after a commit.
    outcome = apply_retention(store, args.keep, dry_run=args.dry_run, keyring=args.keyring)
    verb = "would delete" if args.dry_run else "deleted"
    for row in rows:
        where = store.uri(store.step_rel(row.step))
        if row.step in outcome.deleted:
            print(f"{verb} step {row.step}: {where} ({human_bytes(row.size)})")
        elif row.step in outcome.purged:
            print(f"{verb} leftover {where} (an unfinished upload or deletion)")
        elif not row.committed:
            print(f"left alone step {row.step}: {row.status} (prune deletes committed steps)")
    for name in outcome.purged:
        if isinstance(name, str):
            print(f"{verb} leftover {store.uri(name)} (an interrupted deletion)")
    for error in outcome.errors:
        print(f"FAILED {error}")
    committed = [row.step for row in rows if row.committed]
    kept = sorted(set(committed) - set(outcome.deleted))
    print(f"kept committed steps: {kept or 'none'}; tracker's target: {target}")
    return EXIT_BAD_CHECKPOINT if outcome.errors else 0


def cmd_rollback(store: Store, args: argparse.Namespace) -> int:
    if not store.can_rename and not args.delete:
        raise CliError(
            f"rollback of a remote tier URL ({store.url}) needs --delete: object storage has no "
            "cheap archive (a move is a copy), so the steps newer than --to are deleted "
            "(--dry-run lists them)",
            EXIT_USAGE,
        )
    with locked(store, "verl-ckpt rollback"):
        pick_step(store, args.to)  # a step the user typed and that is not there: exit 2
        pending = read_rollback_intent(store)
        intent = plan_rollback(store, args.to, delete=args.delete, keyring=args.keyring)
        if pending is not None:
            logger.warning(
                "completing the interrupted rollback to step %d (%s)",
                intent.to,
                intent_path(store.url),
            )
        try:
            tracker = read_tracker(store)
            before = "none" if tracker is None else str(tracker)
        except TrackerError:  # only when completing a pending rollback, which rewrites it
            before = "unreadable"
        committed = {step for step in intent.steps if is_committed(store, step)}
        if not args.dry_run:
            execute_rollback(store, intent)
    for step in intent.steps:
        where = store.uri(store.step_rel(step))
        if not intent.delete:
            verb = "would move" if args.dry_run else "moved"
            moved = Path(store.url) / intent.archive / store.step_rel(step)
            print(f"{verb} step {step} to {moved}")
            continue
        verb = "would delete" if args.dry_run else "deleted"
        if step in committed or store.can_rename:
            print(f"{verb} step {step}: {where}")
        else:  # no rename: a step without a record is an unfinished upload
            print(f"{verb} leftover {where} (an unfinished upload)")
    if not intent.steps:
        print(f"no step newer than {intent.to}")
    suffix = " (dry run: nothing changed)" if args.dry_run else ""
    print(f"tracker: {before} -> {intent.to}{suffix}")
    return 0


def cmd_export(store: Store, args: argparse.Namespace) -> int:
    if not isinstance(store, LocalStore):
        raise CliError(f"export works on a local ROOT only, not on {store.url}", EXIT_USAGE)
    changes_root = args.out is None or _inside_root(store, Path(args.out))
    step = pick_step(store, args.step)
    if args.keyring is not None:
        # Refused before torch is imported; export_role checks the record again as it reads
        # it (the step may change meanwhile), and signs the export's record.
        read_commit_record(store, step, args.keyring)
    path = store.path(store.step_rel(step))
    from verl_ckpt.hf.export import export_role  # torch: seconds to import, only here

    def export() -> object:
        try:
            shard = args.max_shard_mb << 20
            return export_role(path, args.role, args.architecture, args.out, shard, args.keyring)
        except CheckpointConfigError as exc:  # a role, architecture or OUT the user typed
            raise CliError(str(exc), EXIT_USAGE) from None

    if changes_root:
        # Into the step itself, or elsewhere in the root: the root changes, so not beside a
        # job (its retention could delete the step midway) nor beside another command.
        with locked(store, "verl-ckpt export"):
            summary = export()
    else:
        summary = export()
    if summary.existing:
        print(
            f"step {step} role {args.role}: already exported to {summary.path} "
            f"({summary.files} files verified)"
        )
    else:
        print(
            f"exported step {step} role {args.role} ({summary.architecture}) to {summary.path}: "
            f"{summary.files} files, {summary.bytes} bytes in {summary.seconds:.1f} s; "
            f"{describe_context_length(summary.context_length)}"
        )
    return 0


def cmd_pull(store: Store, args: argparse.Namespace) -> int:
    if isinstance(store, LocalStore):
        raise CliError(f"pull needs a remote tier URL, not {store.url}", EXIT_USAGE)
    if args.step is not None:
        step = pick_step(store, args.step)  # a step the user typed and that is not there: exit 2
    else:
        newest = newest_committed(store, args.keyring)
        if newest is None:
            raise CliError(f"{store.url} holds no committed step", EXIT_BAD_CHECKPOINT)
        step = newest[0]
    root = _pull_destination(Path(args.dest))
    make_dir(root, parents=True, exist_ok=True)
    destination = LocalStore(root)
    with locked(destination, "verl-ckpt pull"):
        # As a job's start refuses it (startup/remote.py): a step put back beside a pending
        # rollback could not be moved again, and the very save a rollback moved out would
        # become the newest committed step, undoing the rollback without a word.
        refuse_while_rollback_pending(destination)
        _refuse_undoing_a_rollback(store, step, root)
        summary = pull_step(store, step, root, _THREADS, _TIMEOUT_S, keyring=args.keyring)
    if not summary.downloaded:
        print(f"step {step} is committed in {root} already: nothing pulled")
    else:
        print(
            f"pulled step {step} from {store.url} into {summary.path}: {summary.files} files, "
            f"{summary.bytes} bytes verified in {summary.seconds:.2f} s"
        )
    return 0


def _inside_root(store: LocalStore, out: Path) -> bool:
    """Whether OUT lies in the root; refused in its step namespace (a `global_step_<N>` of
    the root, or anything inside one), which belongs to the protocol's steps."""
    # Both with every link resolved: a link in either path must not hide OUT's place.
    root, target = Path(os.path.realpath(store.path(""))), Path(os.path.realpath(out))
    if not target.is_relative_to(root):
        return False
    parts = target.relative_to(root).parts
    if parts and step_of_dir(root / parts[0]) is not None:
        raise CliError(
            f"OUT {out} is in the step directory {root / parts[0]} of ROOT: omit OUT to export "
            "into the step itself, or choose a directory outside the step namespace",
            EXIT_USAGE,
        )
    return True


def _pull_destination(given: Path) -> Path:
    """The root to pull into, checked as every command's ROOT is: never a step directory or
    a directory inside one (a pull would write a lock and a step into a committed step)."""
    root = given.resolve()
    inside = next((p for p in (root, *root.parents) if step_of_dir(p) is not None), None)
    if inside is not None:
        where = "a step directory" if inside == root else f"inside the step directory {inside}"
        raise CliError(
            f"ROOT {given} is {where}; pass the root that holds it ({inside.parent})", EXIT_USAGE
        )
    if root.exists() and not root.is_dir():
        raise CliError(f"ROOT {given} is not a directory", EXIT_USAGE)
    return root


def _refuse_undoing_a_rollback(store: Store, step: int, root: Path) -> None:
    data = read_record_bytes(store, step)
    moved = find_rolled_back(root, step, data) if data is not None else None
    if moved is not None:
        raise RollbackError(
            f"step {step} of {store.url} is the save that `verl-ckpt rollback {root} --to "
            f"{moved.to}` moved out of {root} (recorded in {root / ROLLED_BACK_FILENAME}): "
            "pulling it there would undo that rollback; pull it into another directory"
        )
