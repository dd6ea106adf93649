"""`verl-ckpt rollback`: move the steps newer than an older committed step out of the way.

Resuming from a step older than the newest committed step of a root is refused: the run's
later saves would collide with committed steps. Rolling back to committed step N moves every
`global_step_M` with M > N (committed or not) out of the step namespace, into
`<root>/rolled_back_<time>/` (deleted at the end with `delete`), then points the tracker at N.

Start-up recovery rolls the tracker FORWARD to the newest committed step (a commit record
newer than the tracker is a commit interrupted before the tracker moved). A rollback
interrupted half-way must neither be undone by that nor leave the tracker naming a moved
step, so it is journaled. One run, by the holder of the root lock (`RootLock`):

  1. write the intent `<root>/.verl_ckpt_rollback.json` atomically. Before any rename: from
     the first rename on, whoever finds the root must learn that a rollback is under way.
  2. rename each newer step into the archive, newest first, then fsync the archive and the
     root. Newest first: the tracker's target leaves before any older step, so code that
     knows nothing of the intent soon fails loudly (the tracker names a missing step) rather
     than resuming from a step being rolled back.
  3. add each moved committed step, with the sha256 of its commit record's bytes, to the
     root's record of rolled-back steps `<root>/.verl_ckpt_rolled_back.json` (atomic; kept
     for good, each rollback adds to it). Before the tracker and the end of the intent: once
     those are gone this record is the only witness that the steps left on purpose, and a
     remote tier still holding them must not bring them back (startup/remote.py refuses).
  4. write the tracker (atomic). After every rename is durable: from the moment the tracker
     names N, no newer committed step is left in the namespace for a roll-forward to find.
  5. with `delete`, remove the archive.
  6. remove the intent. Last: the intent outlives everything it describes.

`complete_interrupted_rollback` finishes 2-6 from the intent, skipping what is done. Start-up
recovery calls it FIRST, before rolling the tracker forward; a check that must not write
uses `read_rollback_intent` and takes `intent.to` as the tracker's value.

A store that cannot rename (an object store, store/base.py) has no cheap archive (a move is
a copy): there a rollback needs `delete`, and deletes every newer step, newest first, each
record first then its objects (as retention does: a half-deleted step never looks
committed), then points the tracker at N (one PUT), with no journal. The tracker last:
moved first, it would be rolled forward again (at every finalizer start) to a newer step
still there. A crash half-way leaves the tracker naming a step without a record; start-up
then refuses, naming it, and the same command run again completes the rollback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from verl_ckpt.protocol import faults
from verl_ckpt.protocol.errors import CheckpointError, CommitRecordError, TrackerError
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.protocol.versioned_json import parse_versioned_json
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import (
    is_committed,
    read_commit_record,
    read_record_bytes,
    record_digest,
)
from verl_ckpt.store.fsio import FileTooLarge, fsync_dir, make_dir
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, checked_relative_path, step_dir
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.open_store import Where, as_store
from verl_ckpt.store.retention import delete_step
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import read_tracker, write_tracker

__all__ = [
    "ARCHIVE_PREFIX",
    "INTENT_FILENAME",
    "ROLLBACK_FORMAT_VERSION",
    "ROLLBACK_RECORD_MAX_BYTES",
    "ROLLED_BACK_FILENAME",
    "RolledBackStep",
    "RollbackError",
    "RollbackIntent",
    "complete_interrupted_rollback",
    "execute_rollback",
    "find_rolled_back",
    "intent_path",
    "plan_rollback",
    "read_rollback_intent",
    "read_rolled_back",
    "record_digest",
    "refuse_while_rollback_pending",
]

logger = logging.getLogger(__name__)

INTENT_FILENAME = ".verl_ckpt_rollback.json"
# Every committed step a rollback moved out of this root (step 3 of the module docstring).
ROLLED_BACK_FILENAME = ".verl_ckpt_rolled_back.json"
ARCHIVE_PREFIX = "rolled_back_"
ROLLBACK_FORMAT_VERSION = 1
# The intent and the record of rolled-back steps are read only up to this (the record gains
# about 200 bytes per rolled-back step): a huge planted file is refused unread.
ROLLBACK_RECORD_MAX_BYTES = 16 << 20
# The archive is removed recursively with `delete`: a damaged intent must never name
# anything but a plain directory of the root that a rollback created.
_ARCHIVE_NAME = re.compile(rf"^{ARCHIVE_PREFIX}[0-9A-Za-z_]+$")


class RollbackError(CheckpointError):
    """A rollback is refused or cannot finish; the message names the path and the way out."""


@dataclass(frozen=True)
class RollbackIntent:
    """What a rollback does, as journaled in the intent file before it starts."""

    to: int  # the committed step the tracker will name
    # Directory under the root receiving the moved steps ("" on a store that cannot rename)
    archive: str
    steps: tuple[int, ...]  # every step moved out, ascending
    delete: bool  # remove the archive once the tracker moved


@dataclass(frozen=True)
class RolledBackStep:
    """One committed step a rollback moved out of the root, as the root's record keeps it."""

    step: int
    record_sha256: str  # of the step's commit record bytes: which save of `step` it was
    to: int  # the step that rollback went back to
    archive: str  # where it was moved (deleted afterwards with `delete`)


def read_rolled_back(where: Where) -> tuple[RolledBackStep, ...]:
    """Every committed step a rollback moved out of the root, oldest rollback first; empty
    when none did. A damaged record is a RollbackError naming it (never taken as "none")."""
    store = as_store(where)
    path = store.uri(ROLLED_BACK_FILENAME)
    data = _read_journal(store, ROLLED_BACK_FILENAME, "record of rolled-back steps")
    if data is None:
        return ()
    raw = parse_versioned_json(
        data, f"record of rolled-back steps {path}", ROLLBACK_FORMAT_VERSION, RollbackError
    )
    try:
        steps = tuple(RolledBackStep(**entry) for entry in raw["steps"])
    except (TypeError, KeyError) as exc:
        raise RollbackError(f"record of rolled-back steps {path} is malformed: {exc}") from None
    if not all(type(e.step) is int and isinstance(e.record_sha256, str) for e in steps):
        raise RollbackError(f"record of rolled-back steps {path} is malformed: {raw!r}")
    for entry in steps:
        checked_relative_path(
            entry.archive, f"record of rolled-back steps {path}: an archive name", RollbackError
        )
    return steps


def _read_journal(store: Store, rel: str, what: str) -> bytes | None:
    """The bytes of the rollback file `rel` (None when absent), read up to its bound; a
    RollbackError naming it when it cannot be read."""
    try:
        return store.read_bytes(rel, ROLLBACK_RECORD_MAX_BYTES)
    except CheckpointError:
        raise  # a store call past its deadline: it names the object itself
    except FileTooLarge:
        raise RollbackError(
            f"{what} {store.uri(rel)} is larger than {ROLLBACK_RECORD_MAX_BYTES} bytes; not read"
        ) from None
    except OSError as exc:
        raise RollbackError(f"{what} {store.uri(rel)} cannot be read: {exc}") from None


def find_rolled_back(root: str | os.PathLike, step: int, record: bytes) -> RolledBackStep | None:
    """The rollback that moved exactly this save of `step` (the same commit record bytes)
    out of `root`, or None."""
    digest = record_digest(record)
    found = [e for e in read_rolled_back(root) if e.step == step and e.record_sha256 == digest]
    return found[-1] if found else None


def intent_path(root: str | os.PathLike) -> Path:
    return Path(root) / INTENT_FILENAME


def read_rollback_intent(where: Where) -> RollbackIntent | None:
    """The pending rollback of the root, None when there is none. Reads only."""
    store = as_store(where)
    path = store.uri(INTENT_FILENAME)
    data = _read_journal(store, INTENT_FILENAME, "rollback intent") if store.can_rename else None
    if data is None:
        return None
    raw = parse_versioned_json(
        data, f"rollback intent {path}", ROLLBACK_FORMAT_VERSION, RollbackError
    )
    steps = raw.get("steps")
    intent = RollbackIntent(
        raw.get("to"),
        raw.get("archive"),
        tuple(steps) if isinstance(steps, list) else (),
        raw.get("delete"),
    )
    if not isinstance(steps, list) or not _is_valid(intent):
        raise RollbackError(f"rollback intent {path} is malformed: {raw!r}")
    return intent


def _is_valid(intent: RollbackIntent, can_rename: bool = True) -> bool:
    # `type(x) is int`: JSON's true and false are ints to isinstance.
    archive_ok = (
        isinstance(intent.archive, str) and _ARCHIVE_NAME.match(intent.archive) is not None
        if can_rename
        else intent.archive == "" and intent.delete is True
    )
    return (
        type(intent.to) is int
        and intent.to >= 0
        and archive_ok
        and all(type(s) is int and s > intent.to for s in intent.steps)
        and list(intent.steps) == sorted(set(intent.steps))
        and isinstance(intent.delete, bool)
    )


def refuse_while_rollback_pending(root: Where) -> None:
    """Raise RollbackError, naming the intent and the way out, while a rollback of `root` is
    pending: the tracker does not yet name the step it goes to, so a command that acts on the
    tracker's target (prune, another rollback) could delete that step."""
    pending = read_rollback_intent(root)
    if pending is not None:
        url = as_store(root).url
        raise RollbackError(
            f"a rollback of {url} to step {pending.to} was interrupted ({intent_path(url)}); "
            f"complete it first: verl-ckpt rollback {url} --to {pending.to}"
        )


def plan_rollback(
    where: Where, to_step: int, delete: bool = False, keyring: Keyring | None = None
) -> RollbackIntent:
    """What rolling the root back to `to_step` would do; changes nothing.

    Refused (naming the path) when `to_step` is not a committed step (with a keyring, of
    checkpoint.signing: one whose record it verifies), when the tracker is
    unreadable, when a rollback to another step is pending, or without `delete` on a store
    that cannot rename. A pending rollback to the same step is returned as it was journaled
    (with its own `delete`): executing it completes it.
    """
    store = as_store(where)
    pending = read_rollback_intent(store)
    if pending is not None:
        if pending.to != to_step:
            refuse_while_rollback_pending(store)
        if keyring is not None:
            # Completing it moves the tracker to its target: signed, as for a new rollback.
            _read_target(store, to_step, keyring)
        return pending
    if not store.can_rename and not delete:
        raise RollbackError(
            f"rollback of {store.url} needs --delete: this store has no cheap archive (a move "
            "is a copy), so the steps newer than --to are deleted (--dry-run lists them)"
        )
    _read_target(store, to_step, keyring)
    try:
        read_tracker(store)
    except TrackerError as exc:
        # Without the tracker we cannot tell what a resume would load now.
        raise TrackerError(f"{exc}; refusing to roll back") from None
    newer = tuple(step for step in store.list_steps() if step > to_step)
    if not isinstance(store, LocalStore):
        return RollbackIntent(to_step, "", newer, True)
    return RollbackIntent(to_step, _new_archive_name(store.root), newer, delete)


def execute_rollback(where: Where, intent: RollbackIntent) -> None:
    """Run `intent` (from `plan_rollback`); the caller holds the root's lock."""
    store = as_store(where)
    if not _is_valid(intent, isinstance(store, LocalStore)):
        raise ValueError(f"not a rollback plan: {intent!r}")
    if not isinstance(store, LocalStore):
        _delete_newer(store, intent)
        return
    root = store.root
    pending = read_rollback_intent(root)
    if pending is not None and pending != intent:
        raise RollbackError(
            f"another rollback of {root} is pending ({intent_path(root)}: to step "
            f"{pending.to}); complete it first"
        )
    if pending is None:
        _check_target(root, intent, journaled=False)
        payload = {
            "format_version": ROLLBACK_FORMAT_VERSION,
            "to": intent.to,
            "archive": intent.archive,
            "steps": list(intent.steps),
            "delete": intent.delete,
            "started_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        store.put_bytes(INTENT_FILENAME, json.dumps(payload, indent=1).encode())
    _finish(root, intent)


def _delete_newer(store: Store, intent: RollbackIntent) -> None:
    """A store that cannot rename (module docstring): newest first, record first; the
    tracker last, the one time it moves back, because a user asked."""
    for step in sorted(intent.steps, reverse=True):
        delete_step(store, step)
    write_tracker(store, intent.to)


def complete_interrupted_rollback(
    where: Where, keyring: Keyring | None = None
) -> RollbackIntent | None:
    """Finish a rollback that a crash interrupted; return it, or None when none was pending.
    With a keyring, a target whose record it does not verify is refused (RollbackError
    naming the intent) and nothing moves: the tracker only names a signed step.

    For start-up recovery, before it rolls the tracker forward; the caller holds the lock.
    """
    store = as_store(where)
    if not isinstance(store, LocalStore):
        return None  # no journal where nothing is renamed (module docstring)
    root = store.root
    # A crash while writing the intent leaves only its temporary: nothing had moved yet.
    store.clear_temporaries(INTENT_FILENAME)
    intent = read_rollback_intent(store)
    if intent is None:
        return None
    if keyring is not None:
        try:
            _read_target(store, intent.to, keyring)
        except CommitRecordError as exc:
            raise RollbackError(
                f"the interrupted rollback in {intent_path(root)} cannot be completed: {exc}; "
                f"restore the target's signed record, or remove {intent_path(root)} to give "
                "the rollback up"
            ) from None
    logger.warning(
        "completing the interrupted rollback of %s to step %d (%s)",
        root,
        intent.to,
        intent_path(root),
    )
    _finish(root, intent)
    return intent


def _read_target(store: Store, to_step: int, keyring: Keyring | None) -> None:
    """Refuse (naming it) a target whose commit record does not read, does not verify
    against the keyring, or names another step."""
    try:
        record = read_commit_record(store, to_step, keyring)
    except CommitRecordError as exc:
        raise CommitRecordError(f"cannot roll back to step {to_step}: {exc}") from None
    if record.step != to_step:
        raise CommitRecordError(
            f"cannot roll back to step {to_step}: the commit record of "
            f"{store.uri(store.step_rel(to_step))} names step {record.step}"
        )


def _new_archive_name(root: Path) -> str:
    name = f"{ARCHIVE_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}"
    candidate, n = name, 1
    while (root / candidate).exists():
        n += 1
        candidate = f"{name}_{n}"
    return candidate


def _check_target(root: Path, intent: RollbackIntent, journaled: bool) -> None:
    # The tracker only ever names a committed step (I1).
    if not is_committed(step_dir(root, intent.to)):
        stuck = f"; the rollback in {intent_path(root)} cannot finish" if journaled else ""
        raise RollbackError(
            f"cannot roll back {root} to step {intent.to}: {step_dir(root, intent.to)} is not "
            f"a committed step (any more){stuck}"
        )


def _finish(root: Path, intent: RollbackIntent) -> None:
    """Steps 2-5 of the module docstring; each is skipped where a previous run did it."""
    archive = root / intent.archive
    # A rerun finds the archive the interrupted run made; one planted as a link (the intent
    # is a file of the root, which others may write) would move steps out of the root and
    # delete files wherever it points. Checked before make_dir, which fails on a broken
    # link or a file without naming the way out.
    if os.path.lexists(archive) and not stat.S_ISDIR(os.lstat(archive).st_mode):
        raise RollbackError(
            f"the rollback archive {archive} is not a directory of {root} (a link?): "
            f"nothing moved; remove it, or remove {intent_path(root)} to give the rollback up"
        )
    make_dir(archive, exist_ok=True)
    for step in sorted(intent.steps, reverse=True):
        source = step_dir(root, step)
        target = archive / source.name
        if not source.exists():
            continue  # moved by the interrupted run
        if target.exists():
            raise RollbackError(f"cannot move {source} into {archive}: {target} exists")
        os.rename(source, target)
        faults.inject(Phase.ROLLBACK)
    # Both directories: the rename's new entry and its removed old one must be durable
    # before the tracker is, or a power loss could bring back a moved step.
    fsync_dir(archive)
    fsync_dir(root)
    _check_target(root, intent, journaled=True)
    # Before the tracker and the intent's end: from then on nothing else says that these
    # steps left on purpose (a remote tier holding them would bring them back).
    _record_rolled_back(root, intent)
    write_tracker(root, intent.to)
    if intent.delete:
        # Records first, as retention does: a half-deleted step is never loadable (I3).
        for step in intent.steps:
            moved = archive / step_dir(root, step).name
            if not moved.is_symlink():  # a step linked in: its record is not the root's
                (moved / COMMIT_RECORD_FILENAME).unlink(missing_ok=True)
        shutil.rmtree(archive)
        fsync_dir(root)
    intent_path(root).unlink()
    fsync_dir(root)


def _record_rolled_back(root: Path, intent: RollbackIntent) -> None:
    """Step 3: add the committed steps `intent` moved into its archive to the root's record
    of rolled-back steps. Idempotent: a rerun after a crash adds nothing twice, and a step
    whose record an interrupted `delete` already removed was recorded before that."""
    known = list(read_rolled_back(root))
    archive = root / intent.archive
    added = []
    for step in intent.steps:
        moved = archive / step_dir(root, step).name
        try:
            data = read_record_bytes(moved)  # bounded, a regular file only
            read_commit_record(moved)
        except (OSError, CommitRecordError):
            continue  # an uncommitted leftover (or recorded by the interrupted run)
        entry = RolledBackStep(step, record_digest(data), intent.to, intent.archive)
        if entry not in known:
            added.append(entry)
    if not added:
        return
    payload = {
        "format_version": ROLLBACK_FORMAT_VERSION,
        "steps": [asdict(entry) for entry in known + added],
    }
    LocalStore(root).put_bytes(ROLLED_BACK_FILENAME, json.dumps(payload, indent=1).encode())
