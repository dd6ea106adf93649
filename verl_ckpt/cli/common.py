"""What every `verl-ckpt` command shares: exit statuses, the one-line error, the store a
ROOT names (a path or a URL: store/open_store.py), the step to work on, the root lock."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from verl_ckpt.protocol.errors import CheckpointConfigError, RootLockedError, TrackerError
from verl_ckpt.startup.root_lock import RootLock, local_root_in_use
from verl_ckpt.store.base import Store
from verl_ckpt.store.layout import TRACKER_FILENAME, step_of_dir
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.open_store import is_remote_url, open_store
from verl_ckpt.store.tracker import read_tracker

__all__ = [
    "EXIT_BAD_CHECKPOINT",
    "EXIT_USAGE",
    "CliError",
    "locked",
    "open_root",
    "pick_step",
]

EXIT_BAD_CHECKPOINT = 1
EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing failure: one line of message and the exit status to end with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def open_root(text: str, args: argparse.Namespace) -> Store:
    """The store ROOT names: a local root (checked to be one), or a URL opened with
    --storage-options, each of its calls ending within --timeout (s3fs's retries alone can
    take minutes)."""
    if not is_remote_url(text):
        return LocalStore(_check_root(Path(text)))
    try:
        options = _storage_options(args)
        store = open_store(text, options, call_timeout_s=args.timeout, setting="ROOT")
    except CheckpointConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    # A bucket's prefix without objects is an empty root; a local directory that is not
    # there is a mistyped ROOT, as for a plain path (it was listed as holding no step).
    if store.is_local and not store.fs.isdir(store.path):
        raise CliError(f"ROOT {text} does not exist or is not a directory", EXIT_USAGE)
    return store


def _check_root(root: Path) -> Path:
    if not root.exists():
        raise CliError(f"ROOT {root} does not exist", EXIT_USAGE)
    if not root.is_dir():
        raise CliError(f"ROOT {root} is not a directory", EXIT_USAGE)
    if step_of_dir(root) is not None:
        raise CliError(
            f"ROOT {root} is a step directory; pass the root that holds it ({root.parent})",
            EXIT_USAGE,
        )
    return root


def _storage_options(args: argparse.Namespace) -> dict:
    text = getattr(args, "storage_options", None)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"--storage-options is not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(options, dict):
        raise CliError("--storage-options must be a JSON object", EXIT_USAGE)
    return options


def pick_step(store: Store, asked: int | None) -> int:
    """The step to work on: `asked`, else the tracker's; its directory must exist."""
    step = asked
    if step is None:
        try:
            step = read_tracker(store)
        except TrackerError as exc:
            raise CliError(f"{exc}; pass --step N", EXIT_BAD_CHECKPOINT) from None
        if step is None:
            raise CliError(
                f"{store.uri(TRACKER_FILENAME)} does not exist, so there is no default step; "
                "pass --step N",
                EXIT_BAD_CHECKPOINT,
            )
    rel = store.step_rel(step)
    if not store.exists(rel):
        present = store.list_steps() or "none"
        origin = (
            "" if asked is not None else f" (named by the tracker {store.uri(TRACKER_FILENAME)})"
        )
        # A step the user typed is a usage error; one the tracker names is a broken root.
        code = EXIT_USAGE if asked is not None else EXIT_BAD_CHECKPOINT
        raise CliError(f"{store.uri(rel)}{origin} does not exist; steps present: {present}", code)
    return step


@contextmanager
def locked(store: Store, purpose: str) -> Iterator[None]:
    """Hold the root's lock for a command that changes a local root; refused if a job holds
    it. A URL has no lock: its writers are the finalizers of the jobs using it."""
    if not isinstance(store, LocalStore):
        _refuse_a_local_root_by_url(store)
        yield
        return
    try:
        lock = RootLock.acquire(store.root, purpose=purpose)
    except RootLockedError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    with lock:
        yield


def _refuse_a_local_root_by_url(store: Store) -> None:
    """A file:// URL is opened as a remote tier (no lock, no rollback journal). One that
    names a local root in use would let a change bypass that root's lock or a pending
    rollback's journal: refused, naming the path that takes both."""
    if not getattr(store, "is_local", False):
        return
    path = Path(store.path)
    why = local_root_in_use(path)
    if why is not None:
        raise CliError(
            f"ROOT {store.url} is a local root in use ({why}): pass its path, {path}, so "
            "that the command takes the root's lock",
            EXIT_USAGE,
        )
