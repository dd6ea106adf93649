"""The finalizer: one Ray actor per checkpoint root, which commits steps (the protocol
page, verl_ckpt/protocol).

It only connects the pieces: admission (admission.py, step 1: back-pressure, leftovers,
refusals), the intake (intake.py, step 4: the step ledger of ledger.py counts reports), the
committer (committer.py, steps 5-7: the plain functions of steps.py write the commit record,
the tracker and delete old steps), the waits for a commit (waiters.py), the remote tier
(remote/finalizer_tier.py, steps 8-11), the exports (hf/, step E), and recovery
(store/recovery.py), which rolls the root forward whenever the actor starts. Every
coroutine runs on the actor's one event loop, so the ledgers need no lock and one notifier
(protocol.event_loop.Changes) wakes every waiter of both tiers; file work runs in a thread,
one commit or retention at a time.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verl_ckpt.commit.admission import Admission, steps_lost_in_a_restart
from verl_ckpt.commit.committer import Committer
from verl_ckpt.commit.intake import ReportIntake
from verl_ckpt.commit.ledger import StepLedger, StepStatus
from verl_ckpt.commit.metadata_forecast import MetadataForecast
from verl_ckpt.commit.waiters import Waiters
from verl_ckpt.hf.scheduler import ExportPlan, ExportQueue
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.event_loop import Changes, TaskSet
from verl_ckpt.protocol.messages import (
    BeginRequest,
    GlobalMetadataCache,
    RankReport,
    ReportBatch,
    batch_begins,
    batch_reports,
)
from verl_ckpt.protocol.redaction import redacted, settings_digest
from verl_ckpt.store.commit_record import committed_steps
from verl_ckpt.store.fsio import atomic_write_bytes, make_dir
from verl_ckpt.store.layout import ROOT_MARKER_FILENAME
from verl_ckpt.store.lock_record import LeaseGuard
from verl_ckpt.store.recovery import recover_root
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import read_tracker

__all__ = ["CheckpointFinalizer", "finalizer_settings"]

logger = logging.getLogger(__name__)

# How long a lease found held stays believed for begin_step (see begin_step).
_LEASE_RECHECK_S = 0.5


class CheckpointFinalizer:
    """Commits the steps of one checkpoint root; runs as a restartable Ray actor
    (commit.client.start_finalizer), or in-process for tests and benchmarks."""

    def __init__(
        self,
        root_dir: str,
        participants: dict[str, int],
        max_ckpt_to_keep: int | None,
        max_in_flight: int = 1,
        hf_exports: ExportPlan | None = None,
        remote: dict[str, Any] | None = None,
        run_id: str | None = None,
        keyring: Keyring | None = None,
        state_participants: dict[str, int] | None = None,
        lease: LeaseGuard | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self._root = Path(root_dir)
        # checkpoint.signing's keys, read by the driver before Ray started: every record this
        # finalizer writes is signed, and recovery and retention trust only verified ones.
        # Never logged nor in describe() (Keyring's repr names key ids only).
        self._keyring = keyring
        # The driver's lease on the root (None: a flock, which the kernel keeps): once it is
        # lost, no step begins, commits or is deleted here (store/lock_record.py).
        self._lease = lease
        # The roles' ranks and the driver; the declared participants apart (ledger.py): the
        # commit expects no `.metadata` of theirs, and the remote tier uploads their files
        # itself, as the driver's.
        self._participants = dict(participants)
        self._state_participants = dict(state_participants or {})
        self._keep = max_ckpt_to_keep
        # Reports carry DCP metadata and write results, whose classes live in torch's DCP:
        # import it now, not while unpickling the first report (seconds of no answers). Not
        # megatron-core: nothing the finalizer unpickles or writes needs it (torch_dist_dir).
        import verl_ckpt.format.torch_dist_dir  # noqa: F401

        make_dir(self._root, parents=True, exist_ok=True)
        # Recovery rolls an interrupted commit forward and deletes nothing (retention runs
        # only after a new commit). The run id is this job's finalizer, whatever its restarts
        # (Ray passes a restarted actor the same arguments): begin_step marks the steps it
        # opens with it (admission.steps_lost_in_a_restart).
        state = recover_root(self._root, keyring)
        lost = steps_lost_in_a_restart(self._root, list(state.uncommitted), run_id)
        self._ledger = StepLedger(
            participants, max_in_flight, lost=lost, state_participants=self._state_participants
        )
        if state.uncommitted:
            logger.warning(
                "checkpoint root %s holds uncommitted step directories %s (ignored%s)",
                self._root,
                list(state.uncommitted),
                f"; the reports of {lost} were lost in a finalizer restart" if lost else "",
            )
        # Step E: Hugging Face exports of committed steps, off the commit path.
        self._hf_plan = hf_exports
        self._exports = ExportQueue(self._root, hf_exports, keyring)
        # Every node must see this directory: ranks and the driver check this token.
        self._marker_token = uuid.uuid4().hex
        atomic_write_bytes(self._root / ROOT_MARKER_FILENAME, self._marker_token.encode())
        # A deep copy, kept as given: botocore rewrites storage_options' nested dicts in place
        # (config_kwargs.retries), and describe() must answer what start_finalizer asked for.
        self._remote_settings = copy.deepcopy(remote) if remote else None
        self._connect(participants, remote, run_id)
        _freeze_long_lived()

    def _connect(
        self, participants: dict[str, int], remote: dict[str, Any] | None, run_id: str | None
    ) -> None:
        """Make the collaborators, each given the pieces it shares with the others."""
        # Each role's plan metadata, unpickled once per plan rather than at every step, and
        # each role's `.metadata` made while its ranks write (both off the commit's path).
        self._metadata_cache = GlobalMetadataCache()
        self._forecast = MetadataForecast()
        # One notifier for every waiter of both tiers: ranks waiting for an upload turn see
        # a failed local step, and local waiters re-check after any change.
        self._changes = Changes()
        self._background = TaskSet()
        self._remote = _open_remote_tier(
            remote,
            self._root,
            participants,
            self._ledger.status,
            self._upload_ended,
            self._changes,
            self._keyring,
        )
        self._committer = Committer(
            self._root,
            self._participants,
            self._keep,
            self._ledger,
            self._changes,
            self._background,
            self._forecast,
            self._exports,
            self._uploading,
            self._remote.after_local_commit if self._remote is not None else lambda step: None,
            self._keyring,
            self._check_lease,
        )
        self._intake = ReportIntake(self._root, self._ledger, self._changes, self._committer)
        self._waiters = Waiters(self._root, self._ledger, self._changes, self._committer)
        self._admission = Admission(
            self._root,
            {**self._participants, **self._state_participants},
            run_id,
            self._ledger,
            self._waiters,
            self._committer,
            self._background,
            self._forecast,
        )

    # ---- queries -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The settings this finalizer runs with, secrets redacted (any job can call this on
        the named actor), and a digest of them all (finalizer_settings)."""
        return finalizer_settings(
            str(self._root),
            self._participants,
            self._keep,
            self._ledger.max_in_flight,
            self._hf_plan,
            self._remote_settings,
            self._state_participants,
            list(self._keyring.key_ids) if self._keyring is not None else None,
        )

    def lease_guard(self) -> LeaseGuard | None:
        """The driver's lease on the root, which ranks check before each save (None: the
        root is flocked, and the kernel keeps the lock for as long as the driver lives)."""
        return self._lease

    def _check_lease(self, what: str, fresh_within_s: float = 0.0) -> None:
        if self._lease is not None:
            self._lease.check(what, fresh_within_s)

    def marker_token(self) -> str:
        """The token this finalizer wrote into the root's marker file at start-up."""
        return self._marker_token

    def status(self) -> dict[str, Any]:
        ledger = self._ledger
        missing = {step: ledger.missing(step) for step in ledger.in_flight()}
        pending = {step: ledger.describe(who) for step, who in missing.items()}
        # Declared participants (few) by label, one by one: "pending" names runs as ranges.
        waiting = {
            step: [ledger.label(p) for p in who if p[0] in ledger.state_participants]
            for step, who in missing.items()
        }
        return {
            "committed": committed_steps(self._root, self._keyring),
            "tracker": read_tracker(self._root),
            "pending": pending,
            "pending_participants": waiting,
            "ledger_size": len(ledger),
            "hf_exports": self._exports.outcomes(),
            "metadata_forecasts": {
                "used": self._forecast.used,
                "missed": self._forecast.missed,
                "late": self._forecast.late,
            },
        }

    # ---- protocol step 1: begin_step (admission.py) --------------------------------------

    async def begin_step(
        self,
        step: int,
        role: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        save_id: str | None = None,
    ) -> str:
        """Make sure the step's directory exists; return the participant's directory.

        Back-pressure first: a new step starts only while fewer than max_in_flight steps are
        uncommitted. An uncommitted leftover of the step is removed (off the event loop, one
        removal for all participants) before anyone is told the directory. Then, without
        awaiting (so that participants' calls are serialised), the directory. Every
        participant of a step gets the same answer whatever the order of their calls (ranks
        told different things would wait for each other in their planning collectives).
        Refused: a committed step, a step that failed or was lost (a step number is saved
        once), and a second save (`save_id`) of a step the participant already reported,
        which would overwrite the files it reported. The step must have every report by
        `timeout_s` + slack after the last participant's begin_step.
        """
        # Every rank calls this at every step: the lease file is read again once per
        # _LEASE_RECHECK_S at most (a commit and a deletion always read it).
        self._check_lease(f"step {step} ({role} rank {rank})", _LEASE_RECHECK_S)
        return await self._admission.begin_step(step, role, rank, world_size, timeout_s, save_id)

    async def begin_batch(
        self, batch: list[BeginRequest] | list[tuple]
    ) -> list[str | CheckpointError]:
        """The begin_step calls of a node's or a rank group's participants, of one step, in
        one call (commit/aggregator.py; rows as protocol.messages.begin_rows makes them):
        the step admitted once for all of them; each one's directory or refusal (what its
        begin_step would return or raise), in order."""
        requests = batch_begins(batch)
        if requests:
            self._check_lease(f"step {requests[0].step} ({len(requests)} ranks)", _LEASE_RECHECK_S)
        return await self._admission.begin_steps(requests)

    # ---- protocol steps 4-7: report (intake.py), commit, retention (committer.py) -------

    async def report(self, report: RankReport) -> None:
        """Record one participant's outcome; start the commit when the last one arrives."""
        report.unpack(self._metadata_cache)
        # A rank's own call, not a node aggregator's batch: its files are checked here,
        # whatever the report says of them.
        report.files_on_arrival = report.files_checked_on = None
        self._admission.check_participant(report.role, report.rank, report.world_size)
        self._intake.take(report)

    async def report_batch(
        self, batch: ReportBatch | list[RankReport]
    ) -> list[CheckpointError | None]:
        """Record the reports of a node's or a rank group's ranks in one call
        (commit/aggregator.py), in one pass; start a commit when a step's last report
        arrives. Each report's refusal (what `report` would raise for it), or None, in
        order: one bad report refuses itself only."""
        reports = batch_reports(batch)
        if self._admission.all_participants(reports):
            for report in reports:
                report.unpack(self._metadata_cache)
            return self._intake.take_batch(reports)
        accepted: list[RankReport] = []
        errors: list[CheckpointError | None] = []
        for report in reports:
            try:
                report.unpack(self._metadata_cache)
                self._admission.check_participant(report.role, report.rank, report.world_size)
            except CheckpointError as exc:
                errors.append(exc)
                continue
            errors.append(None)
            accepted.append(report)
        taken = iter(self._intake.take_batch(accepted))
        return [error if error is not None else next(taken) for error in errors]

    # ---- waiting (waiters.py) ------------------------------------------------------------

    async def wait_for_commit(self, step: int, timeout_s: float) -> dict[str, Any]:
        """Wait until `step` committed; raise naming who is missing or what failed."""
        return await self._waiters.wait_for_commit(step, timeout_s)

    async def drain(self, timeout_s: float, closing: bool = False) -> list[int]:
        """Wait (up to `timeout_s`) for commits and retention already under way, so that a
        coordinator closing the job never kills the finalizer mid-commit; return the steps
        still collecting reports. `closing`: those will not commit (a last report arriving
        later fails its step, naming the close), since the coordinator goes on to wait for
        the exports and then kills the finalizer, which could cut a commit begun meanwhile."""
        if not await self._background.ended(timeout_s):
            committing = [
                s
                for s in self._ledger.in_flight()
                if self._ledger.status(s) is StepStatus.COMMITTING
            ]
            retiring = self._ledger.retiring()
            running = f"the commit of steps {committing}" if committing or not retiring else ""
            if retiring:
                after = f"the retention after steps {retiring}"
                running = f"{running} and {after}" if running else after
            raise CommitTimeoutError(
                f"{running} under {self._root} did not end within "
                f"{timeout_s:.0f}s; the next start rolls forward any commit that got as "
                "far as its commit record"
            )
        if closing:
            # In the turn of the loop in which ended() found no task left (it returns without
            # awaiting after that check): a report taken in any later turn, the one below
            # included, fails its step instead of starting a commit.
            self._committer.refuse_new_commits(f"the coordinator of {self._root} closed")
        # A finished task leaves the task set in its done callback, which runs on the next
        # turn of the loop: let it, so that nothing finished looks pending (also when every
        # task had finished before this call: their callbacks may not have run yet).
        await asyncio.sleep(0)
        return self._ledger.in_flight()

    async def wait_for_exports(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait (up to `timeout_s`) for the Hugging Face exports queued or running; return
        the outcome of every export of this finalizer (step E)."""
        return await self._exports.wait(timeout_s)

    def cancel_exports(self) -> None:
        """Stop the running export and drop the waiting ones (the coordinator is closing)."""
        self._exports.cancel()

    # ---- protocol steps 8-11: the remote tier (verl_ckpt/remote/finalizer_tier.py) ---------

    async def upload_turn(self, step: int, timeout_s: float) -> bool:
        """A rank asks whether to upload its files of `step` (once committed locally)."""
        return await self._remote_tier().upload_turn(step, timeout_s)

    async def report_upload(self, report: Any) -> None:
        await self._remote_tier().report(report)

    async def drain_uploads(self, timeout_s: float) -> dict[str, Any]:
        """Upload the newest committed step if it is not in the remote tier yet, and wait for
        every upload under way; where the remote tier stands."""
        return await self._remote_tier().drain(timeout_s)

    def remote_status(self, step: int | None = None) -> dict[str, Any]:
        return self._remote_tier().status(step)

    def _remote_tier(self):
        if self._remote is None:
            raise CheckpointError(f"no remote tier is configured for {self._root}")
        return self._remote

    def _upload_ended(self) -> None:
        """An upload ended: finish the retention of a commit that left its step, if any."""
        self._committer.retain_after_upload()

    def _uploading(self) -> set[int]:
        return set(self._remote.protected()) if self._remote is not None else set()


def finalizer_settings(
    root_dir: str,
    participants: dict[str, int],
    max_ckpt_to_keep: int | None,
    max_in_flight: int,
    hf_exports: ExportPlan | None,
    remote: dict[str, Any] | None,
    state_participants: dict[str, int] | None = None,
    signing: list[str] | None = None,
) -> dict[str, Any]:
    """What `describe()` answers for these settings: each one, with the remote tier's
    storage_options and anything secret-looking redacted (protocol/redaction.py), and
    `settings_digest`, which tells settings apart where only a secret differs."""
    settings = {
        "root_dir": root_dir,
        "participants": dict(participants),
        "state_participants": dict(state_participants or {}),
        "max_ckpt_to_keep": max_ckpt_to_keep,
        "max_in_flight": max_in_flight,
        "hf_exports": asdict(hf_exports) if hf_exports else None,
        "remote": dict(remote) if remote else None,
        # Key ids only (store/signing.py): never a key.
        "signing": signing,
    }
    return {**redacted(settings), "settings_digest": settings_digest(settings)}


def _freeze_long_lived() -> None:
    """In an actor process (the finalizer's, or a benchmark's helper that hosts one):
    everything alive once the finalizer started (Ray's, torch's and DCP's modules: a few
    hundred thousand objects) lives as long as the process, so it goes out of the cyclic
    collector's sight. Each step's intake makes objects by the thousand per rank group, and
    every full collection they set off walked all of those first, serially, on the commit's
    path. Garbage is collected first (frozen, it would stay). Not in a driver or a test
    process, which host other things and make finalizers by the dozen."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    gc.collect()
    gc.freeze()


def _open_remote_tier(remote, root, participants, local_status, on_upload_end, changes, keyring):
    """The remote tier of this root (protocol steps 8-11), or None without one; fsspec is
    imported only when there is one."""
    if not remote or not remote.get("url"):
        return None
    from verl_ckpt.remote.finalizer_tier import RemoteTier

    return RemoteTier(remote, root, participants, local_status, on_upload_end, changes, keyring)
