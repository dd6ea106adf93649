"""Protocol step 0 for the remote tier, before Ray starts (called by startup.prepare_start).

Before the root lock (read-only for the local root): the URL takes a write (a wrong scheme,
a missing bucket, wrong credentials or an unreachable endpoint is one line naming the URL),
and its newest committed step (with a readable record) is read. A run that would start
from an older step than the remote tier's newest (resume_mode=disable, or a resume_path
older than it) is refused: its uploads would collide with the remote tier's steps. With
resume_mode=auto, a remote tracker naming a step newer than the root's whose record is
missing or does not read is an error naming the object (resuming from an older step, or
from scratch, would go unnoticed).

Under the lock, for resume_mode=auto: when the remote tier holds a committed step newer than
the local root's newest (a fresh machine, a lost local root), it is downloaded into the root
(pull.py); recovery then rolls the tracker forward to it, and the run loads it as usual.
Unless that step is the very save a `verl-ckpt rollback` moved out of the root (its record
of rolled-back steps holds the step with the same commit record hash): then the start is
refused, before the lock and again under it, naming `verl-ckpt rollback URL --to N
--delete`, which removes the newer steps from the remote tier.

With checkpoint.signing, the remote tier's records are read with the run's keys: a step
whose record is unsigned or signed with another key is not committed for a start (never
downloaded), and one the remote tracker names is refused in one line naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
    CommitTimeoutError,
    ResumeConflictError,
)
from verl_ckpt.remote.pull import PullSummary, install_staged, pull_step, stage_step
from verl_ckpt.startup.root_lock import local_root_in_use
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import (
    find_commit_record,
    read_record_bytes,
    read_step_states,
)
from verl_ckpt.store.fsspec_store import call_with_deadline, check_store, describe_store_error
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, TRACKER_FILENAME, step_of_dir
from verl_ckpt.store.recovery import RootState
from verl_ckpt.store.rollback import ROLLED_BACK_FILENAME, find_rolled_back
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import tracker_or_none, write_tracker

__all__ = [
    "RemoteCopiesForResume",
    "RemoteHead",
    "RemoteStart",
    "check_remote_against_root",
    "check_remote_start",
    "fetch_newer_remote_step",
    "read_remote_head",
    "refuse_rolled_back_remote_step",
    "refuse_unusable_remote_tracker",
]

logger = logging.getLogger(__name__)

# Start-up's checks of the store are short: a user waits for them before anything runs.
_CHECK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RemoteHead:
    """Where the remote tier stands for a start: what a resume from it would load."""

    # The newest step with a readable commit record (None: none), and that record's bytes.
    step: int | None
    record: bytes | None
    # Every step with a commit record object, readable or not, oldest first.
    committed: tuple[int, ...]
    # The remote tracker's step (None: none, or unreadable: the finalizer replaces it), and
    # why it cannot be resumed from when it is newer than `step` (its record is missing or
    # does not read); None when it can.
    tracker: int | None = None
    tracker_problem: str | None = None


def read_remote_head(store: Store, keyring: Keyring | None = None) -> RemoteHead:
    """The newest step a resume would load from `store`, and whether its tracker names a
    newer step that cannot be loaded (start-up refuses to skip it silently): the root's
    functions (read_step_states, read_record_bytes, tracker_or_none) on the remote tier.
    With a keyring, only steps whose records it verifies count as committed."""
    states = read_step_states(store, keyring)
    step = states.committed[-1] if states.committed else None
    record = None if step is None else read_record_bytes(store, step)
    if record is None:
        step = None  # deleted since the listing
    # An unreadable remote tracker is replaced at the next remote commit (logged); the
    # records say what is committed.
    tracker = tracker_or_none(store)
    problem = None
    if tracker is not None and (step is None or tracker > step):
        problem = _record_problem(store, tracker, keyring)
    committed = tuple(sorted(states.committed + states.unreadable))
    return RemoteHead(step, record, committed, tracker, problem)


def _record_problem(store: Store, step: int, keyring: Keyring | None) -> str | None:
    """Why step `step` of `store` cannot be resumed from (its record is missing or does not
    read), in words naming the object; None when its record reads."""
    where = store.uri(store.step_rel(step, COMMIT_RECORD_FILENAME))
    try:
        if find_commit_record(store, step, keyring) is not None:
            return None  # committed since the listing: the next start sees it
    except CommitRecordError as exc:
        return str(exc)
    return (
        f"its commit record {where} is missing (an interrupted `verl-ckpt rollback "
        f"{store.url} --to N --delete`, or an upload of another save of step {step} under "
        "way or interrupted)"
    )


@dataclass(frozen=True)
class RemoteStart:
    store: Store
    # Where the remote tier stands: its newest readable committed step and that record.
    head: RemoteHead
    # checkpoint.signing's keys: a download is checked with them too (pull.py).
    keyring: Keyring | None = None

    @property
    def newest(self) -> int | None:
        """The newest step committed in the remote tier (None: nothing committed there)."""
        return self.head.step

    def way_back_to(self, step: int | None) -> str:
        """The way out of a start below the remote tier's newest step, for an error."""
        url = self.store.url
        if step is None:
            return (
                f"Use a new checkpoint.remote.url, or checkpoint.resume_mode=auto to continue "
                f"from step {self.newest}"
            )
        if step not in self.head.committed:
            return f"{url} holds no step {step} to roll back to: use a new checkpoint.remote.url"
        return (
            f"Delete the remote tier's newer steps first: verl-ckpt rollback {url} --to {step} "
            "--delete (or use a new checkpoint.remote.url)"
        )


def check_remote_start(config: CheckpointConfig, keyring: Keyring | None = None) -> RemoteStart:
    """The read-only part (see the module docstring); CheckpointError naming the URL.
    `keyring`: checkpoint.signing's keys (store/signing.load_keyring), if any."""
    remote = config.remote
    _refuse_overlap_with_root(remote.url, Path(config.root_dir).resolve())
    timeout = min(_CHECK_TIMEOUT_S, config.timeout_s)
    store = check_store(remote.url, remote.storage_options, timeout)
    try:
        head = call_with_deadline(lambda: read_remote_head(store, keyring), timeout, remote.url)
    except Exception as exc:  # noqa: BLE001 - one line naming the URL
        raise CheckpointConfigError(
            f"checkpoint.remote.url={remote.url!r} cannot be listed: {describe_store_error(exc)}"
        ) from None
    newest = head.step
    started = RemoteStart(store, head, keyring)
    if config.resume_mode != "auto" and newest is not None:
        if config.resume_mode == "disable":
            start, what = None, "checkpoint.resume_mode=disable starts from step 0"
        else:
            # Resolved, as the local check reads it (prepare._checked_resume_path): a link
            # to a step directory, or a path through one, resumes from that step.
            start = step_of_dir(Path(config.resume_from_path).resolve())
            if start is None:
                # No global_step_<N> directory: the local check says so in its own words
                # (resume_check), rather than this one calling it "step None".
                return started
            what = f"checkpoint.resume_from_path resumes from step {start}"
        if start is None or newest > start:
            raise ResumeConflictError(
                f"{what}, but checkpoint.remote.url {remote.url} holds committed step {newest}: "
                f"this run's uploads would collide with it. {started.way_back_to(start)}"
            )
    return started


def check_remote_against_root(
    config: CheckpointConfig, remote: RemoteStart, state: RootState
) -> None:
    """resume_mode=auto, read-only, before the lock and again under it (recovery may have
    completed a rollback): refuse a start that would silently resume from below what the
    remote tracker names, or bring back a step a rollback moved out."""
    refuse_unusable_remote_tracker(config, remote, state)
    refuse_rolled_back_remote_step(config, remote, state)


def refuse_unusable_remote_tracker(
    config: CheckpointConfig, remote: RemoteStart, state: RootState
) -> None:
    """When the remote tracker names a step newer than the root's newest whose record is
    missing or does not read, a resume would skip it for an older remote step, or start
    from scratch, without a word: refused, one line naming the object."""
    head, local = remote.head, state.effective_tracker
    if config.resume_mode != "auto" or head.tracker is None or head.tracker_problem is None:
        return
    if local is not None and local >= head.tracker:
        return  # the root is ahead: nothing would be taken from the remote tier
    raise CommitRecordError(
        f"the remote tracker {remote.store.uri(TRACKER_FILENAME)} names step {head.tracker}, "
        f"newer than the newest committed step of {state.root} ({local}), which cannot be "
        f"resumed from: {head.tracker_problem}. Nothing was downloaded; repair that step, "
        f"remove it (verl-ckpt rollback {remote.store.url} --to N --delete), or use another "
        "checkpoint.remote.url"
    )


def refuse_rolled_back_remote_step(
    config: CheckpointConfig, remote: RemoteStart, state: RootState
) -> None:
    """resume_mode=auto: refuse when the remote tier's newest committed step is newer than
    the root's and is the very save (same commit record bytes) that a `verl-ckpt rollback`
    moved out of the root: downloading it would undo the rollback without a word, and the
    run's own saves of that step would then go over the remote tier's. Read-only."""
    head, local = remote.head, state.effective_tracker
    if config.resume_mode != "auto" or head.step is None or head.record is None:
        return
    if local is not None and local >= head.step:
        return
    moved = find_rolled_back(state.root, head.step, head.record)
    if moved is None:
        return  # a fresh machine, a lost root, another run's step: downloaded as usual
    raise ResumeConflictError(
        f"checkpoint.remote.url {remote.store.url} holds committed step {head.step}, which "
        f"`verl-ckpt rollback {state.root} --to {moved.to}` moved out of checkpoint.root_dir "
        f"(recorded in {state.root / ROLLED_BACK_FILENAME}): resuming from it would undo that "
        f"rollback. {remote.way_back_to(local)}"
    )


def _refuse_overlap_with_root(url: str, root: Path) -> None:
    """A local remote tier (file://) must be a directory of its own: one that is the root,
    or holds it, or lies inside it, would let each tier's retention delete the other's
    steps (the remote tier's keep deleting local steps that max_ckpt_to_keep keeps)."""
    scheme, _, rest = url.partition("://")
    if scheme not in ("file", "local"):
        return
    tier = Path(rest).resolve()
    if tier == root or tier in root.parents or root in tier.parents:
        raise CheckpointConfigError(
            f"checkpoint.remote.url={url!r} overlaps checkpoint.root_dir {root}: the remote "
            "tier needs a directory of its own, neither the root nor inside or above it"
        )
    # Another job's root: this job's remote retention and uploads would change it under
    # that job's lock (helper-59's review).
    why = local_root_in_use(tier)
    if why is not None:
        raise CheckpointConfigError(
            f"checkpoint.remote.url={url!r} is a local checkpoint root in use ({why}): the "
            "remote tier needs a directory of its own"
        )


def fetch_newer_remote_step(
    config: CheckpointConfig, remote: RemoteStart, state: RootState
) -> PullSummary | None:
    """resume_mode=auto, under the root lock: download the remote tier's newest committed
    step into the root when it is newer than the root's newest; None when nothing was."""
    # Again under the lock: recovery may have just completed an interrupted rollback.
    check_remote_against_root(config, remote, state)
    local = state.effective_tracker
    if config.resume_mode != "auto" or remote.newest is None:
        return None
    if local is not None and local >= remote.newest:
        return None
    try:
        summary = pull_step(
            remote.store,
            remote.newest,
            state.root,
            config.remote.threads,
            config.timeout_s,
            keyring=remote.keyring,
        )
    except Exception as exc:  # noqa: BLE001 - a store error: one line naming the URL
        if isinstance(exc, CheckpointError) and not isinstance(exc, CommitTimeoutError):
            raise  # a record or a file that fails: the message names the object
        raise CheckpointError(
            f"checkpoint.remote.url {remote.store.url}: the download of step {remote.newest} "
            f"failed: {describe_store_error(exc)}"
        ) from None
    # The tracker names the downloaded step now, so that recovery has nothing to roll
    # forward (it would say "interrupted"): a restore is no interrupted commit.
    write_tracker(state.root, summary.step)
    newest_here = "none" if local is None else f"step {local}"
    logger.info(
        "restored step %d from the remote tier %s into %s (its newest committed step was %s): "
        "%d files, %d bytes in %.2f s, verified against the commit record",
        remote.newest,
        remote.store.url,
        state.root,
        newest_here,
        summary.files,
        summary.bytes,
        summary.seconds,
    )
    return summary


class RemoteCopiesForResume:
    """The remote tier's part in a failing resume step (resume_check.RemoteCopies), under
    the root lock: its verified copy of the step, and the floor below which a fallback
    would start under the remote tier's newest committed step."""

    def __init__(self, config: CheckpointConfig, remote: RemoteStart, root: Path) -> None:
        self._config, self._remote, self._root = config, remote, root

    def copy_in(self, step: int, make_room: Callable[[], None]) -> str | None:
        store = self._remote.store
        if step not in self._remote.head.committed:
            return None
        try:
            staged = stage_step(
                store,
                step,
                self._root,
                self._config.remote.threads,
                self._config.timeout_s,
                keyring=self._remote.keyring,
            )
        except Exception as exc:  # noqa: BLE001 - logged; the fallback goes on without it
            logger.warning(
                "the remote tier's copy of step %d cannot replace the local one: %s",
                step,
                describe_store_error(exc) if not isinstance(exc, CheckpointError) else exc,
            )
            return None
        make_room()
        summary = install_staged(staged)
        return (
            f"{store.uri(staged.target.name)} ({summary.files} files, {summary.bytes} bytes "
            "verified against its commit record)"
        )

    def refuse_below(self, step: int, what: str) -> None:
        newest = self._remote.newest
        if newest is not None and step < newest:
            raise ResumeConflictError(
                f"{what}, but checkpoint.remote.url {self._remote.store.url} holds committed "
                f"step {newest}: this run's uploads would collide with it. "
                f"{self._remote.way_back_to(step)}"
            )
