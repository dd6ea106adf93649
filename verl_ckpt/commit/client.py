"""Talking to the finalizer actor: start it, find it, call it with a deadline.

One finalizer per checkpoint root, named after the root, so that every rank finds the one
the driver started. `actor_options()` is the single definition of how it runs (tests that
start it with a fault hook reuse it rather than copying it). `FinalizerClient` is how ranks
and the driver call it: one typed method per public method of the actor (commit/finalizer.py),
each bounded by a deadline and naming its caller when the finalizer does not answer.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from verl_ckpt.protocol.deadlines import call_deadline, deadline_in, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.messages import ReportBatch
from verl_ckpt.store.fsio import read_regular
from verl_ckpt.store.layout import ROOT_MARKER_FILENAME
from verl_ckpt.store.signing import Keyring

if TYPE_CHECKING:
    from verl_ckpt.hf.scheduler import ExportPlan
    from verl_ckpt.protocol.messages import RankReport
    from verl_ckpt.remote.ledger import UploadReport
    from verl_ckpt.store.lock_record import LeaseGuard

__all__ = [
    "FINALIZER_MAX_CONCURRENCY",
    "FINALIZER_NAMESPACE",
    "FinalizerClient",
    "actor_options",
    "check_shared_root",
    "finalizer_name",
    "get_finalizer",
    "start_finalizer",
]

# The root marker holds a token of 32 hex characters: a longer file is not ours.
_MARKER_MAX_BYTES = 256

FINALIZER_NAMESPACE = "verl_ckpt"


def finalizer_name(root_dir: str | os.PathLike) -> str:
    """The actor name for a root: one finalizer per checkpoint root, found by every rank."""
    digest = hashlib.sha1(str(Path(root_dir).resolve()).encode()).hexdigest()[:16]
    return f"verl_ckpt_finalizer_{digest}"


# Concurrent calls the finalizer takes (each a coroutine while it waits): far above one
# waiting call per participant of the largest job (16,384 ranks and their uploads).
FINALIZER_MAX_CONCURRENCY = 100_000


def actor_options(root_dir: str | os.PathLike) -> dict[str, Any]:
    """How the finalizer of `root_dir` runs: named, restarted on failure, no CPU slot, on the
    caller's node (the driver's, which must see the root anyway; the job ends with it)."""
    return {
        "name": finalizer_name(root_dir),
        "namespace": FINALIZER_NAMESPACE,
        "get_if_exists": True,
        # Restarted after a crash: it rebuilds its state from disk (recovery.py). A call in
        # flight is retried on the new instance, which refuses reports it cannot trust.
        "max_restarts": -1,
        "max_task_retries": 3,
        # Calls that wait (begin_step for room, upload_turn, wait_for_commit) hold a slot
        # until they return; Ray's default of 1,000 for an async actor would queue every
        # report behind a thousand of them at scale, and no step could commit.
        "max_concurrency": FINALIZER_MAX_CONCURRENCY,
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    }


def start_finalizer(
    root_dir: str | os.PathLike,
    participants: dict[str, int],
    max_ckpt_to_keep: int | None,
    timeout_s: float = 120.0,
    max_in_flight: int = 1,
    hf_exports: ExportPlan | None = None,
    remote: dict[str, Any] | None = None,
    keyring: Keyring | None = None,
    state_participants: dict[str, int] | None = None,
    lease: LeaseGuard | None = None,
) -> ray.actor.ActorHandle:
    """Start the finalizer of `root_dir`, or reconnect to the one already running.

    `participants`: the roles' ranks and the driver; `state_participants`: the participants
    declared to the coordinator (CheckpointCoordinator's `participants`). A running
    finalizer of the same root with other settings is an error, not silently reused.
    `keyring`: checkpoint.signing's keys, read before Ray started; the actor gets them as an
    argument (no environment needed on its node), and they appear nowhere but by key id
    (describe(), the mismatch error). `lease`: the driver's lease on the root
    (RootLock.lease_guard()), which the finalizer checks before each step, commit and
    deletion.
    """
    from verl_ckpt.commit.finalizer import CheckpointFinalizer, finalizer_settings

    state_participants = dict(state_participants or {})
    if not participants or any(size < 1 for size in participants.values()):
        raise CheckpointError(f"participants must map roles to world sizes >= 1: {participants}")
    if any(size < 1 for size in state_participants.values()):
        raise CheckpointError(f"participants must map names to counts >= 1: {state_participants}")
    root = str(Path(root_dir).resolve())
    actor = (
        ray.remote(CheckpointFinalizer)
        .options(**actor_options(root))
        .remote(
            root,
            dict(participants),
            max_ckpt_to_keep,
            max_in_flight,
            hf_exports,
            remote,
            uuid.uuid4().hex,  # this job's run id, the same for every restart of the actor
            keyring,
            state_participants,
            lease,
        )
    )
    try:
        found = ray.get(actor.describe.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CommitTimeoutError(
            f"the finalizer of {root} did not start within {timeout_s:.0f}s"
        ) from None
    # Both redacted (protocol/redaction.py): the message must not show a secret, and the
    # digests tell apart settings that differ only in one.
    wanted = finalizer_settings(
        root,
        participants,
        max_ckpt_to_keep,
        max_in_flight,
        hf_exports,
        remote,
        state_participants,
        list(keyring.key_ids) if keyring is not None else None,
    )
    if found != wanted:
        raise CheckpointError(
            f"a finalizer for {root} is already running with other settings "
            f"({_differences(found, wanted)}); use the same checkpoint config everywhere or "
            "stop the other job"
        )
    return actor


def _differences(found: dict[str, Any], wanted: dict[str, Any]) -> str:
    """What differs between two describe() answers (both redacted already)."""
    keys = [key for key in wanted if key != "settings_digest" and found.get(key) != wanted[key]]
    if not keys:  # only a redacted value differs: say where, not what
        return "remote.storage_options differ; their values are not shown"
    return "; ".join(f"{key}: {found.get(key)} running, {wanted[key]} asked for" for key in keys)


def get_finalizer(root_dir: str | os.PathLike, timeout_s: float) -> ray.actor.ActorHandle:
    """Find the finalizer of `root_dir` that the driver started, waiting up to `timeout_s`."""
    root = str(Path(root_dir).resolve())
    deadline = deadline_in(timeout_s)
    while True:
        try:
            return ray.get_actor(finalizer_name(root), namespace=FINALIZER_NAMESPACE)
        except ValueError:
            if time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"no finalizer for checkpoint root {root} appeared within {timeout_s:.0f}s: "
                    "the driver must call CheckpointCoordinator (or start_finalizer) first"
                ) from None
            time.sleep(0.1)


def check_shared_root(
    root_dir: str | os.PathLike, finalizer: ray.actor.ActorHandle, timeout_s: float, who: str
) -> None:
    """Fail unless this process sees the marker the finalizer wrote into the root.

    Ranks, driver and finalizer may run on different nodes; a root that is not one shared
    filesystem would scatter a step's files over several disks and never commit correctly.
    """
    token = FinalizerClient(finalizer, who, timeout_s).marker_token(deadline=deadline_in(timeout_s))
    marker = Path(root_dir) / ROOT_MARKER_FILENAME
    try:
        # Bounded, a regular file only: the root is writable by others, and a FIFO or a
        # device planted as the marker must not hang or exhaust every participant.
        data = read_regular(marker, _MARKER_MAX_BYTES)
        seen = None if data is None else data.decode(errors="replace")
    except OSError:
        seen = None
    if seen != token:
        raise CheckpointError(
            f"{who} on node {ray.util.get_node_ip_address()} does not see the checkpoint root "
            f"{root_dir} that the finalizer writes to (marker {marker.name} "
            f"{'missing' if seen is None else 'differs'}): checkpoint.root_dir must be one "
            "filesystem shared by every node"
        )


class FinalizerClient:
    """The finalizer's public methods, as ranks and the driver call them (protocol steps 1,
    4, 5 and 8 from the caller's side).

    Every call waits for the answer until a deadline (monotonic): `deadline` when given,
    else the call's own `timeout_s` (for the calls where the finalizer itself waits) or the
    client's, plus RPC_SLACK_S (`call_deadline`). Where the finalizer waits (begin_step,
    wait_for_commit, drain...) it applies the caller's timeout and names what is missing;
    the deadline only bounds the call. `who` names the caller when the finalizer does not
    answer ("actor rank 0 of /ckpt"). The finalizer's own errors (CheckpointError) are
    raised as themselves.
    """

    def __init__(self, handle: ray.actor.ActorHandle, who: str, timeout_s: float) -> None:
        self.handle = handle
        self.who = who
        self._timeout_s = timeout_s

    # ---- start-up and state -------------------------------------------------------------

    def describe(self, *, deadline: float | None = None) -> dict[str, Any]:
        return self._call("describe", deadline=deadline)

    def marker_token(self, *, deadline: float | None = None) -> str:
        return self._call("marker_token", deadline=deadline)

    def status(self, *, deadline: float | None = None) -> dict[str, Any]:
        return self._call("status", deadline=deadline)

    def lease_guard(self, *, deadline: float | None = None) -> LeaseGuard | None:
        return self._call("lease_guard", deadline=deadline)

    # ---- a participant's step (steps 1 and 4) --------------------------------------------

    def begin_step(
        self,
        step: int,
        role: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        save_id: str,
        *,
        deadline: float | None = None,
    ) -> str:
        """The participant's directory of `step`; waits (up to `timeout_s`) for room."""
        deadline = deadline or call_deadline(timeout_s)
        return self._call(
            "begin_step", step, role, rank, world_size, timeout_s, save_id, deadline=deadline
        )

    def report(self, report: RankReport, *, deadline: float | None = None) -> None:
        self._call("report", report, deadline=deadline)

    def report_batch(
        self, reports: list[RankReport], *, deadline: float | None = None
    ) -> list[CheckpointError | None]:
        """Several participants' reports in one call (a node's or a rank group's,
        commit/aggregator.py): each one's refusal, or None, in order."""
        return self._call("report_batch", ReportBatch.of(reports), deadline=deadline)

    # ---- commits and exports (the driver) -----------------------------------------------

    def wait_for_commit(
        self, step: int, timeout_s: float, *, deadline: float | None = None
    ) -> dict[str, Any]:
        deadline = deadline or call_deadline(timeout_s)
        return self._call("wait_for_commit", step, timeout_s, deadline=deadline)

    def drain(
        self, timeout_s: float, closing: bool = False, *, deadline: float | None = None
    ) -> list[int]:
        deadline = deadline or call_deadline(timeout_s)
        return self._call("drain", timeout_s, closing, deadline=deadline)

    def wait_for_exports(
        self, timeout_s: float, *, deadline: float | None = None
    ) -> list[dict[str, Any]]:
        deadline = deadline or call_deadline(timeout_s)
        return self._call("wait_for_exports", timeout_s, deadline=deadline)

    def cancel_exports(self, *, deadline: float | None = None) -> None:
        self._call("cancel_exports", deadline=deadline)

    # ---- the remote tier (step 8) --------------------------------------------------------

    def upload_turn(self, step: int, timeout_s: float, *, deadline: float | None = None) -> bool:
        deadline = deadline or call_deadline(timeout_s)
        return self._call("upload_turn", step, timeout_s, deadline=deadline)

    def report_upload(self, report: UploadReport, *, deadline: float | None = None) -> None:
        self._call("report_upload", report, deadline=deadline)

    def drain_uploads(self, timeout_s: float, *, deadline: float | None = None) -> dict[str, Any]:
        deadline = deadline or call_deadline(timeout_s)
        return self._call("drain_uploads", timeout_s, deadline=deadline)

    def remote_status(
        self, step: int | None = None, *, deadline: float | None = None
    ) -> dict[str, Any]:
        return self._call("remote_status", step, deadline=deadline)

    def _call(self, method: str, *args: Any, deadline: float | None) -> Any:
        deadline = deadline or call_deadline(self._timeout_s)
        return call_finalizer(self.handle, method, *args, deadline=deadline, who=self.who)


def call_finalizer(
    finalizer: ray.actor.ActorHandle, method: str, *args: Any, deadline: float, who: str
) -> Any:
    """Call `method` on the finalizer and wait for the answer until `deadline` (monotonic):
    the mechanism under FinalizerClient, which callers use instead."""
    ref = getattr(finalizer, method).remote(*args)
    try:
        return ray.get(ref, timeout=time_left(deadline, 0.1))
    except ray.exceptions.GetTimeoutError:
        raise CommitTimeoutError(f"{who}: the finalizer did not answer {method} in time") from None
    except ray.exceptions.RayTaskError as exc:
        # The finalizer's own error (a refusal, a deadline naming who is missing) is raised
        # as itself: one line, not wrapped in Ray's remote traceback.
        if isinstance(exc.cause, CheckpointError):
            raise exc.cause from None
        raise
