"""A rank's side of the remote tier (protocol page, step 8): after its report, each rank
uploads its own files of the step, so that upload bandwidth grows with the nodes.

The upload runs on a thread of its own, never on the training thread nor the save thread
(the next save's write does not wait for an upload): wait for the finalizer's word that the
step committed locally, upload the rank's files in parallel, verified against the checksums
the rank reported, report what went up. A failure is reported and logged, never raised to
training: the finalizer uploads what no rank confirmed, and the next upload catches up.
Training waits only when `remote.max_in_flight` uploads are already pending.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from verl_ckpt.protocol import RPC_SLACK_S, faults
from verl_ckpt.protocol.config import RemoteConfig
from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.remote.ledger import UploadReport
from verl_ckpt.remote.transfer import copy_files
from verl_ckpt.store.commit_record import FileEntry
from verl_ckpt.store.fsio import CHECKSUM_ALGORITHM
from verl_ckpt.store.fsspec_store import describe_store_error
from verl_ckpt.store.layout import step_dir
from verl_ckpt.store.open_store import open_store

__all__ = ["RankUploader", "UploadFinalizer"]

logger = logging.getLogger(__name__)


@dataclass
class _PendingUpload:
    step: int
    future: Future | None = None
    # time.monotonic() when the upload began: its deadline counts from there, not from its
    # submission (one upload runs at a time; the next waits behind it). None until then.
    began: float | None = None


class UploadFinalizer(Protocol):
    """The finalizer calls an upload makes: commit.client.FinalizerClient's (the remote
    tier sits below the commit part, so it names only what it needs)."""

    def upload_turn(
        self, step: int, timeout_s: float, *, deadline: float | None = None
    ) -> bool: ...

    def report_upload(self, report: UploadReport, *, deadline: float | None = None) -> None: ...


# Beyond an upload's last deadline, before a save behind it stops waiting.
_RETURN_MARGIN_S = 5.0


class RankUploader:
    """The uploads of one rank; `finalizer` is its client of the finalizer."""

    def __init__(
        self,
        config: RemoteConfig,
        root: Path,
        role: str,
        rank: int,
        timeout_s: float,
        finalizer: UploadFinalizer,
    ) -> None:
        self._config = config
        self._store = open_store(config.url, config.storage_options)
        self._root = root
        self._role, self._rank = role, rank
        self._timeout_s = timeout_s
        self._finalizer = finalizer
        self._who = f"{role} rank {rank}"
        self._pool = DaemonPool(1, f"verl_ckpt_{role}{rank}_upload")
        self._pending: deque[_PendingUpload] = deque()

    def submit(self, step: int, files: list[FileEntry]) -> None:
        """Upload `files` (this rank's, as reported) of `step` once it committed locally."""
        upload = _PendingUpload(step)
        upload.future = self._pool.submit(
            self._upload, upload, list(files), label=f"upload of step {step}"
        )
        self._pending.append(upload)

    def wait_for_room(self) -> None:
        """Back-pressure before a save: wait while `remote.max_in_flight` uploads are
        pending, until the oldest one ends by itself (its own deadline, counted from when it
        began, and its report's slack); raise naming the step and the URL after that."""
        self._collect()
        while len(self._pending) >= self._config.max_in_flight:
            oldest = self._pending[0]
            # The oldest is running or about to (the one before it ended): not yet begun,
            # its deadline counts from now.
            began = oldest.began if oldest.began is not None else time.monotonic()
            done, _ = wait_for_futures(
                [oldest.future], timeout=time_left(began + self._ends_within_s)
            )
            if not done:
                step = oldest.step
                raise CommitTimeoutError(
                    f"{self._who}: the upload of step {step} to {self._config.url} is still "
                    f"running {self._ends_within_s:g}s after it began (checkpoint.timeout_s="
                    f"{self._timeout_s:g}s, and its report's); not starting another save "
                    f"(checkpoint.remote.max_in_flight={self._config.max_in_flight})"
                )
            self._collect()

    @property
    def _ends_within_s(self) -> float:
        # An upload cut off at its deadline still reports (its last call, bounded by the
        # deadline and RPC_SLACK_S): a wait that ended at the deadline itself lost that race
        # every time, failing the save at the moment the upload ended by itself (an S3
        # outage stops no training). The margin is the thread's own return.
        return self._timeout_s + RPC_SLACK_S + _RETURN_MARGIN_S

    def pending_steps(self) -> list[int]:
        self._collect()
        return [upload.step for upload in self._pending]

    def close(self, deadline: float) -> None:
        """Let pending uploads finish until `deadline`; an upload still running then is
        named in a warning and left (the finalizer uploads what it did not confirm)."""
        for upload in list(self._pending):
            done, _ = wait_for_futures([upload.future], timeout=time_left(deadline))
            if not done:
                logger.warning(
                    "%s: the upload of step %d to %s did not end before close()'s deadline",
                    self._who,
                    upload.step,
                    self._config.url,
                )
                break
        self._collect()
        self._pool.close(time_left(deadline))

    # ---- the upload (its own thread) ----------------------------------------------------

    def _upload(self, upload: _PendingUpload, files: list[FileEntry]) -> None:
        step = upload.step
        upload.began = time.monotonic()
        deadline = upload.began + self._timeout_s
        try:
            turn = self._finalizer.upload_turn(
                step, self._timeout_s, deadline=deadline + RPC_SLACK_S
            )
        except Exception as exc:  # noqa: BLE001 - no word from the finalizer: nothing to do
            logger.warning("%s: no upload of step %d: %s", self._who, step, exc)
            return
        if not turn:
            return
        report = UploadReport(step, self._role, self._rank, node=_node_address())
        try:
            faults.inject(Phase.UPLOAD, self._role, self._rank)
            outcome = copy_files(
                self._store,
                step_dir(self._root, step),
                step,
                files,
                CHECKSUM_ALGORITHM,
                self._config.threads,
                time_left(deadline),
            )
            report.paths = [entry.path for entry in outcome.done]
            report.errors = outcome.errors
            report.nbytes, report.seconds = outcome.nbytes, outcome.seconds
        except Exception as exc:  # noqa: BLE001 - reported: the finalizer uploads the files
            report.errors = [describe_store_error(exc)]
        try:
            self._finalizer.report_upload(report, deadline=deadline + RPC_SLACK_S)
        except Exception as exc:  # noqa: BLE001 - the finalizer's deadline covers a lost report
            logger.warning("%s: could not report the upload of step %d: %s", self._who, step, exc)

    def _collect(self) -> None:
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()


def _node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (tests of the uploader alone)
        return ""
