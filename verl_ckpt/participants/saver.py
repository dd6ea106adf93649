"""A declared participant's saves (protocol page, "Participants"; steps 1-4 as a rank runs
them): save() copies the state (state_copy.py) and returns; a background thread begins the
step, writes `<step>/<name>/state_<index>.pt` (fsynced, checksummed as it is written) and
reports, or reports the failure, so that the step fails at once naming "<name>[<index>]".
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from verl_ckpt.commit.client import FinalizerClient, check_shared_root
from verl_ckpt.commit.participant import ParticipantLink, new_save_id
from verl_ckpt.commit.participant_handle import ParticipantHandle
from verl_ckpt.participants.loader import load_participant_state
from verl_ckpt.participants.state_copy import stage_state
from verl_ckpt.protocol import Phase, faults
from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.messages import FileEntry
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.fsio import WriteOptions
from verl_ckpt.store.layout import participant_state_file

__all__ = ["StateParticipant"]

logger = logging.getLogger(__name__)

# How long skip() waits for room to register itself in a step not begun yet (max_in_flight);
# past it the failure is reported unregistered, which still fails a step no save of this
# participant began.
_SKIP_BEGIN_S = 5.0


class StateParticipant:
    """Saves and loads the state of one declared participant (`handle`, from
    CheckpointCoordinator.participant_handle). One save in flight at a time: the next save()
    waits for the previous write (at most checkpoint.timeout_s), never piling up copies."""

    def __init__(self, handle: ParticipantHandle) -> None:
        self.handle = handle
        self.name, self.index = handle.name, handle.index
        self._config = handle.config
        self._timeout_s = float(handle.config.timeout_s)
        label = handle.label
        # Its files go where the finalizer commits them: the same filesystem, or never.
        check_shared_root(handle.root, handle.finalizer, self._timeout_s, label)
        client = FinalizerClient(handle.finalizer, f"{label} of {handle.root}", self._timeout_s)
        self._link = ParticipantLink(
            client,
            handle.name,
            handle.index,
            handle.count,
            self._timeout_s,
            inject_faults=True,
            label=label,
        )
        self._pool = DaemonPool(1, f"verl_ckpt_{handle.name}_{handle.index}")
        self._lock = threading.Lock()
        self._pending: Future | None = None
        # The first failure of a background save, raised once at the next save() or wait().
        self._failure: BaseException | None = None
        self._closed = False

    # ---- saving --------------------------------------------------------------------------

    def save(self, step: int, state: Any) -> None:
        """Copy `state` now and save it for `step` in the background (module docstring).
        Raises the failure of an earlier save, once, or a previous save still running after
        checkpoint.timeout_s; a state that cannot be saved (a value that is neither a tensor
        nor plain Python) is refused here. Each of these fails `step` at once."""
        self._check_open()
        save_id = new_save_id()
        try:
            self._raise_failure()
            self._wait_for_previous(self._timeout_s)
        except Exception as exc:
            # As a rank does: the others save this step, so it fails now, not at its deadline.
            self._link.report_failure(step, save_id, Phase.PLAN, exc)
            raise
        # The deadline of this save's write and report, as a rank's (steps 3-4).
        deadline = deadline_in(self._timeout_s)
        try:
            staged = stage_state(state)
        except Exception as exc:
            self._link.report_failure(step, save_id, Phase.STAGE, exc)
            raise
        self._pending = self._pool.submit(
            self._save, step, save_id, staged, deadline, label=f"the save of step {step}"
        )

    def skip(self, step: int, why: str) -> None:
        """This participant will not save `step`: the step fails now, naming it and `why`,
        instead of at its deadline."""
        self._check_open()
        save_id = new_save_id()
        try:
            # Registered first: a save of `step` that a dead process of this participant
            # began holds the step's attempt, and a failure under an id never begun would be
            # taken for a stale report of a replaced save and ignored (commit/ledger.py).
            self._link.begin(step, save_id, timeout_s=min(self._timeout_s, _SKIP_BEGIN_S))
        except Exception as exc:  # noqa: BLE001 - decided already, or no room: report anyway
            logger.info(
                "%s: skipping step %d without beginning it: %s", self.handle.label, step, exc
            )
        self._link.report_failure(
            step, save_id, Phase.PLAN, CheckpointError(f"{self.handle.label} skipped: {why}")
        )

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until the saves under way ended; raise the first failure (once)."""
        self._wait_for_previous(self._timeout_s if timeout_s is None else timeout_s)
        self._raise_failure()

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the save under way (within `timeout_s`), then stop the thread; raise a
        failure not raised yet. Idempotent."""
        if self._closed:
            return
        timeout = self._timeout_s if timeout_s is None else timeout_s
        deadline = deadline_in(timeout)
        try:
            self.wait(timeout)
        finally:
            self._closed = True
            stuck = self._pool.close(time_left(deadline))
            if stuck:
                logger.error("%s: closed with %s still running", self.handle.label, stuck)

    # ---- loading -------------------------------------------------------------------------

    def load(self, step_dir: str | Path) -> Any:
        """This participant's state in the committed step `step_dir` (load_participant_state)."""
        return load_participant_state(
            step_dir,
            self.name,
            self.index,
            verify_checksums=self._config.verify_checksums_on_load,
            # The keys of checkpoint.signing (read on the driver): a record they do not verify
            # is refused here too.
            keyring=self.handle.keyring,
        )

    # ---- the background save -------------------------------------------------------------

    def _save(self, step: int, save_id: str, state: Any, deadline: float) -> None:
        """Steps 1, 3 and 4 on the save thread. Every outcome is reported: the finalizer
        learns completion from reports only (I6)."""
        try:
            directory = self._link.begin(step, save_id, time_left(deadline, 1.0))
        except StepNotCommittedError as exc:
            # As a rank's save (rank/save_runner.py): the step had already failed, another
            # participant's failure having reached the finalizer first, and nothing was
            # written. Not this participant's failure: raised at its next save(), it would
            # fail the next step for everyone.
            self._link.report_failure(step, save_id, Phase.PLAN, exc)
            logger.warning("%s: not saving step %d: %s", self.handle.label, step, exc)
            return
        except Exception as exc:  # noqa: BLE001 - reported and kept for the caller
            self._link.report_failure(step, save_id, Phase.PLAN, exc)
            self._set_failure(step, exc)
            return
        report = self._link.new_report(step, save_id)
        rel = participant_state_file(self.name, self.index)
        try:
            faults.inject(Phase.WRITE, self.name, self.index)
            written = write_checksummed(
                directory / Path(rel).name,
                lambda stream: torch.save(state, stream),
                # Below the root by names no link redirects, as the ranks' files (fsio).
                options=WriteOptions(beneath=str(self.handle.root)),
            )
            report.files.append(FileEntry(rel, written.size, written.checksum))
        except BaseException as exc:  # noqa: BLE001 - reported, so that the step fails at once
            # A BaseException too (a KeyboardInterrupt, a SystemExit from the state's own
            # pickling): on this thread nobody else would see it, and the step would wait
            # for this report until its deadline.
            report.failure = self._link.failure(Phase.WRITE, exc)
        failure = self._link.deliver(report, deadline=max(deadline, deadline_in(1.0)))
        if failure is not None:
            self._set_failure(step, CheckpointError(failure.describe()))

    def _set_failure(self, step: int, exc: BaseException) -> None:
        logger.error("%s: the save of step %d failed: %s", self.handle.label, step, exc)
        with self._lock:
            if self._failure is None:
                self._failure = CheckpointError(
                    f"{self.handle.label}: the save of step {step} failed: {exc}"
                )

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _wait_for_previous(self, timeout_s: float) -> None:
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result(timeout=timeout_s)
        except FutureTimeout:
            raise CommitTimeoutError(
                f"{self.handle.label}: its previous save did not end within {timeout_s:.0f}s"
            ) from None
        finally:
            if pending.done():  # ended, however: what it raised is raised once, here
                self._pending = None

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.handle.label}: StateParticipant is closed")
