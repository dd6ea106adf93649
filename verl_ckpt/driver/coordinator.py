"""The driver's side: start the finalizer, save the trainer's own state, wait for commits.

The order of a whole job is the protocol page's; the driver owns step 0 (start-up, through
startup.prepare_start) and takes part in every step as one more participant.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import ray

from verl_ckpt.commit.client import FinalizerClient, check_shared_root, start_finalizer
from verl_ckpt.commit.participant import ParticipantLink, new_save_id
from verl_ckpt.commit.participant_handle import ParticipantHandle
from verl_ckpt.format.safe_load import load_state_file, safe_state_bytes
from verl_ckpt.hf.scheduler import plan_exports
from verl_ckpt.protocol import Phase
from verl_ckpt.protocol.config import CheckpointConfig, to_checkpoint_config
from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
)
from verl_ckpt.startup.prepare import StartPlan, prepare_start
from verl_ckpt.startup.resume_fit import check_participants_fit
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import FileEntry, read_commit_record
from verl_ckpt.store.fsio import WriteOptions
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_ROLE,
    DRIVER_STATE_FILENAME,
    role_name_problem,
)
from verl_ckpt.store.verification import verify_files

__all__ = ["CheckpointCoordinator"]

logger = logging.getLogger(__name__)


class CheckpointCoordinator:
    """Lives in the driver: one per checkpoint root and job.

    `roles` maps each role to its number of saving ranks, e.g. {"actor": 2, "critic": 1};
    with `save_driver_state` the driver's own state is one more participant of every step.
    `participants` maps the name of each other participant (any Ray actor holding state
    that must be restored with the step: a rollout worker, a replay buffer) to how many
    there are, e.g. {"rollout": 2}; each gets `participant_handle(name, index)` and saves
    with participants.StateParticipant. All are fixed when the finalizer starts.
    `start` is what `prepare_start(config)` returned before Ray started (recipes call it
    first, so that a bad root or resume step fails before anything starts); without it the
    coordinator runs the same checks, lock and recovery itself.
    """

    def __init__(
        self,
        config: CheckpointConfig | Any,
        roles: dict[str, int],
        save_driver_state: bool = True,
        start: StartPlan | None = None,
        participants: dict[str, int] | None = None,
    ) -> None:
        self.config = to_checkpoint_config(config)
        for role in roles:
            problem = role_name_problem(role)
            if problem:
                raise CheckpointConfigError(f"{problem} (the roles: {sorted(map(str, roles))})")
        self.state_participants = _declared_participants(participants or {}, roles)
        self.start = start if start is not None else prepare_start(self.config)
        self.root = self.start.root
        try:
            if self.start.resume_dir is not None:
                # Before the finalizer starts: a resume step holding other participants is
                # one line now, not a surprise in each actor's load.
                check_participants_fit(self.start.resume_dir, self.state_participants)
        except BaseException:
            self.start.release()
            raise
        self.participants = dict(roles)
        if save_driver_state:
            self.participants[DRIVER_ROLE] = 1
        self._closed = False
        # Exports whose outcome a caller of wait_for_exports already got (close() logs the rest).
        self._exports_seen: set[tuple[int, str]] = set()
        try:
            # Which roles get Hugging Face weights after each commit (step E).
            hf_exports = plan_exports(self.config, list(roles))
            # Starting an actor is a process start: give it a minute even when saves have a
            # short deadline.
            self.finalizer = start_finalizer(
                self.root,
                self.participants,
                self.config.max_ckpt_to_keep,
                max(60.0, self.config.timeout_s),
                self.config.max_in_flight,
                hf_exports,
                self._remote_settings(),
                self.start.keyring,
                self.state_participants,
                self.start.lock.lease_guard(),
            )
            check_shared_root(self.root, self.finalizer, self.config.timeout_s, "the driver")
            self._client = FinalizerClient(
                self.finalizer, f"the driver of {self.root}", self.config.timeout_s
            )
            # The driver's own state is one more participant of every step (role "driver").
            self._link = ParticipantLink(self._client, DRIVER_ROLE, 0, 1, self.config.timeout_s)
        except BaseException:
            self.start.release()
            raise

    def participant_handle(self, name: str, index: int) -> ParticipantHandle:
        """What index `index` of the declared participant `name` needs to save and load its
        state (participants.StateParticipant): small and picklable, pass it to the actor."""
        count = self.state_participants.get(name)
        if count is None or not (type(index) is int and 0 <= index < count):
            declared = ", ".join(f"{n} x{c}" for n, c in sorted(self.state_participants.items()))
            raise CheckpointError(
                f"{name}[{index}] is not a declared participant (declared: {declared or 'none'})"
            )
        return ParticipantHandle(
            name, index, count, str(self.root), self.finalizer, self.config, self.start.keyring
        )

    def resume_dir(self) -> Path | None:
        """The committed step to resume from (decided at start-up), or None: a fresh start."""
        return self.start.resume_dir

    def should_save(self, step: int, last_step: int | None = None) -> bool:
        """verl's rule: every `save_freq` steps, and at the last step when saving is on."""
        freq = self.config.save_freq
        return freq > 0 and (step % freq == 0 or step == last_step)

    def save_driver_state(
        self, step: int, state: dict[str, Any], timeout_s: float | None = None
    ) -> None:
        """Write the trainer's own state for `step` and report it (synchronous: it is small).
        `timeout_s` (default checkpoint.timeout_s) bounds the wait for room to start the step
        (max_in_flight); a preemption save passes what is left of its grace period."""
        if DRIVER_ROLE not in self.participants:
            raise CheckpointError("this coordinator was built with save_driver_state=False")
        self.start.lock.check_held(f"the driver's save of step {step}")
        save_id = new_save_id()
        try:
            directory = self._link.begin(step, save_id, timeout_s)
        except BaseException as exc:  # a KeyboardInterrupt in the driver's wait for room too
            # The ranks save this step: fail it now rather than at its deadline.
            self._link.report_failure(step, save_id, Phase.PLAN, exc)
            raise
        report = self._link.new_report(step, save_id)
        path = directory / DRIVER_STATE_FILENAME
        interrupted = None
        try:
            # Checked to load back with weights_only=True (load_driver_state) now: a state
            # that could not be resumed fails its own save, not the resume that needs it.
            data = safe_state_bytes(state, f"the driver state of step {step}")
            below = WriteOptions(beneath=str(self.root))  # no link redirects it (fsio)
            written = write_checksummed(path, lambda stream: stream.write(data), options=below)
            report.files.append(FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum))
        except BaseException as exc:  # noqa: BLE001 - reported, so that the step fails at once
            report.failure = self._link.failure(Phase.WRITE, exc)
            if not isinstance(exc, Exception):
                interrupted = exc  # a KeyboardInterrupt: raised as it is once reported
        self._link.report(report)
        if interrupted is not None:
            raise interrupted
        if report.failure is not None:
            raise CheckpointError(
                f"driver state of step {step} not saved ({path}): {report.failure.message}"
            )

    def load_driver_state(self, step_path: str | Path) -> dict[str, Any]:
        """The driver's state of the committed step `step_path`, loaded with nothing of it
        run (weights_only=True): a file that asks for more is refused in one line naming it
        (UnsafeCheckpointError)."""
        path = Path(step_path)
        # Signed records (checkpoint.signing): checked before the state file is read.
        record = read_commit_record(path, keyring=self.start.keyring)
        if self.config.verify_checksums_on_load:
            problems = verify_files(path, record, prefix=DRIVER_STATE_FILENAME)
            if problems:
                raise CommitRecordError(f"{path} failed verification: " + "; ".join(problems))
        return load_state_file(path / DRIVER_STATE_FILENAME)

    def wait_for_commit(self, step: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until `step` committed; raise naming missing participants or failures."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        return self._client.wait_for_commit(step, timeout)

    def drain(self, timeout_s: float | None = None) -> list[int]:
        """Wait until the commits and retention already under way finished (wait_for_commit
        returns before retention deletes old steps); return the steps still waiting for
        reports."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        return self._client.drain(timeout)

    def status(self) -> dict[str, Any]:
        return self._client.status()

    def wait_for_exports(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait (within `timeout_s`, default checkpoint.timeout_s) until the Hugging Face
        exports of committed steps ended; return each export's outcome (step, role, state:
        done, failed or skipped, message, path). A failed export leaves its step committed.
        Raises CommitTimeoutError naming the steps still exporting at the deadline."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        outcomes = self._client.wait_for_exports(timeout)
        # Those the finalizer still keeps (hf/scheduler.py OUTCOMES_KEPT): a set as flat.
        self._exports_seen = {(o["step"], o["role"]) for o in outcomes}
        return outcomes

    def wait_for_uploads(self, timeout_s: float | None = None) -> dict[str, Any]:
        """With a remote tier: make sure the newest committed step is uploaded (whole, if its
        ranks skipped it or failed), wait up to `timeout_s` for every upload under way, and
        return where the remote tier stands ("tracker", "step", "status", "error")."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        return self._client.drain_uploads(timeout)

    def remote_status(self, step: int | None = None) -> dict[str, Any]:
        """The remote tier's state as the finalizer knows it (for `step`, when given)."""
        return self._client.remote_status(step)

    def _remote_settings(self) -> dict[str, Any] | None:
        remote = self.config.remote
        if remote.url is None:
            return None
        return {**dataclasses.asdict(remote), "timeout_s": self.config.timeout_s}

    def close(self, timeout_s: float | None = None) -> None:
        """Let commits already under way finish (within `timeout_s`), stop the finalizer and
        release the root. Killing the finalizer mid-commit would leave the tracker behind
        the commit record (recovered at the next start, but a surprise for whoever reads
        the root meanwhile). Steps still waiting for reports will not commit. Then the
        Hugging Face exports under way finish within the same deadline (a failure is logged;
        exports still running then are stopped and left to `verl-ckpt export`)."""
        if self._closed:
            return
        self._closed = True
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = deadline_in(timeout)
        try:
            uncommitted = self._client.drain(timeout, closing=True)
            if uncommitted:
                logger.warning(
                    "closing %s with steps %s still waiting for reports: they will not commit "
                    "(wait_for_commit before close() keeps a step whose ranks still write)",
                    self.root,
                    uncommitted,
                )
            # Exports run in tasks the finalizer owns: killing it would kill them midway.
            self._finish_exports(time_left(deadline, 1.0))
        finally:
            ray.kill(self.finalizer, no_restart=True)
            self.start.release()

    def _finish_exports(self, timeout_s: float) -> None:
        seen = set(self._exports_seen)
        try:
            outcomes = self.wait_for_exports(timeout_s)
        except CheckpointError as exc:
            # Not beyond the deadline, and nothing left running: the rest is for
            # `verl-ckpt export`.
            logger.error("%s; stopping them", exc)
            self._client.cancel_exports()
            return
        for outcome in outcomes:
            if outcome["state"] == "failed" and (outcome["step"], outcome["role"]) not in seen:
                logger.error(
                    "Hugging Face export of step %d role %s failed: %s",
                    outcome["step"],
                    outcome["role"],
                    outcome["message"],
                )


def _declared_participants(participants: dict[str, int], roles: dict[str, int]) -> dict[str, int]:
    """The declared participants, checked: plain names (a directory of every step) that are
    neither a role nor the driver, each with a count >= 1."""
    for name, count in participants.items():
        problem = role_name_problem(name)
        if problem:
            raise CheckpointConfigError(f"participant {problem}")
        if name in roles or name in (DRIVER_STATE_FILENAME, COMMIT_RECORD_FILENAME):
            raise CheckpointConfigError(
                f"participant name {name!r} is also a role or a file of every step"
            )
        if type(count) is not int or count < 1:
            raise CheckpointConfigError(f"participant {name!r}: count {count!r} is not >= 1")
    return dict(participants)
