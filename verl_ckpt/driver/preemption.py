"""Preemption-safe saves: the driver learns that the job is about to be stopped, takes one
out-of-schedule save at the next step boundary, and exits (protocol/__init__.py, step S).

Two warnings are understood (`checkpoint.preemption`):
- a signal in `signals` (default SIGTERM, SIGUSR1): `ray job stop`, Kubernetes and most
  schedulers send SIGTERM before their SIGKILL. The handler only records it (anything more,
  in a handler that runs between two bytecodes of whatever the main thread was doing, could
  deadlock on a lock that code holds); a second signal is recorded too and never aborts the
  save under way.
- a deadline: `deadline_env` names an environment variable holding the Unix time at which the
  job will be stopped (verl's ESI variables have this shape). At a step boundary the driver
  stops when the time left is below the longest recent step, plus the longest recent save
  (from `save()` until its commit record), plus `margin_s`: one more step would not leave
  time to save it.

The driver (a recipe's training loop) asks `PreemptionGuard.stop_requested()` at every step
boundary. On a StopRequest it saves every role and its own state (unless that step was
just saved on schedule), waits for the commit until `StopRequest.deadline` (`grace_s` after
the signal, or after the deadline decision), logs one line, finishes as usual (ranks
closed, last commit waited for) and exits with PREEMPTED_EXIT_STATUS. Past the deadline it
raises PreemptionError naming who is missing; the previous committed step stays intact.

Ray's driver (`ray.init`) installs its own SIGTERM handler, so `install()` must run after
`ray.init`; `close()` puts the previous handlers back.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from verl_ckpt.protocol.config import PreemptionConfig, check_deadline_env
from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import (
    CheckpointError,
    CommitRecordError,
    CommitTimeoutError,
    PreemptionError,
    StepNotCommittedError,
)
from verl_ckpt.store.commit_record import read_commit_record
from verl_ckpt.store.layout import step_dir

__all__ = [
    "PREEMPTED_EXIT_STATUS",
    "PreemptionGuard",
    "StopRequest",
    "commit_before_deadline",
    "preemption_failure",
    "stop_rule",
    "wait_before_deadline",
]

logger = logging.getLogger(__name__)

# EX_TEMPFAIL (sysexits.h): "temporary failure, try again". The step the job stopped at is
# committed; running the same command again resumes from it.
PREEMPTED_EXIT_STATUS = 75

# How many recent steps and saves the deadline rule looks at (their longest).
_RECENT = 5


@dataclass(frozen=True)
class StopRequest:
    """The job must stop: save now, and have the save committed by `deadline`."""

    # "SIGTERM received", or the deadline rule's reasoning.
    reason: str
    # time.monotonic() of the signal, or of the deadline decision.
    since: float
    # time.monotonic() by which the out-of-schedule save must be committed.
    deadline: float
    grace_s: float

    def remaining_s(self) -> float:
        return time_left(self.deadline)


def stop_rule(
    time_left_s: float, longest_step_s: float, longest_save_s: float, margin_s: float
) -> bool:
    """The deadline rule: stop now when one more step and its save, plus the margin, would
    not fit in the time left. (A deadline already past stops too: saving costs nothing more
    than being killed.)"""
    return time_left_s < longest_step_s + longest_save_s + margin_s


class PreemptionGuard:
    """Driver side: installs the signal handlers, and answers at each step boundary whether
    the job must stop (see the module docstring). `root` is the checkpoint root: with a
    deadline, saves announced by `save_started` are timed until their commit record
    appears there."""

    def __init__(self, config: PreemptionConfig, root: str | os.PathLike | None = None) -> None:
        self.config = config
        self._root = Path(root) if root is not None else None
        self._deadline = check_deadline_env(config)
        # (signal number, monotonic time); appended by the handler only.
        self._received: list[tuple[int, float]] = []
        self._previous: dict[int, Any] = {}
        self._request: StopRequest | None = None
        self._last_boundary: float | None = None
        self._steps: deque[float] = deque(maxlen=_RECENT)
        self._saves: deque[float] = deque(maxlen=_RECENT)
        self._saves_pending: dict[int, float] = {}
        if self._deadline is not None:
            logger.info(
                "preemption: $%s says the job stops in %.0f s",
                config.deadline_env,
                self._deadline - time.time(),
            )

    # ---- handlers --------------------------------------------------------------------------

    def install(self) -> PreemptionGuard:
        """Handle `config.signals` from now on (main thread only; after `ray.init`)."""
        if not self.config.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError(
                "checkpoint.preemption.signals can only be handled from the main thread; "
                "create the PreemptionGuard there, or set checkpoint.preemption.signals=[]"
            )
        for name in self.config.signals:
            number = signal.Signals[name]
            if number not in self._previous:
                self._previous[number] = signal.signal(number, self._on_signal)
        logger.info(
            "preemption: on %s, the next step is saved and the job exits with status %d",
            ", ".join(self.config.signals),
            PREEMPTED_EXIT_STATUS,
        )
        return self

    def close(self) -> None:
        """Put back the handlers found at `install()` (where ours is still in place)."""
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self._on_signal:
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Record only: this runs between two bytecodes of the main thread, which may be
        # inside a logging lock or a Ray call. A repeated signal never aborts the save.
        self._received.append((signum, time.monotonic()))

    @property
    def signals_received(self) -> list[str]:
        """The names of the signals received so far, in order."""
        return [signal.Signals(number).name for number, _ in self._received]

    # ---- the step boundary -----------------------------------------------------------------

    def save_started(self, step: int) -> None:
        """A save of `step` starts now: with a deadline, it is timed until it commits."""
        if self._deadline is not None and self._root is not None:
            self._saves_pending[step] = time.time()
            while len(self._saves_pending) > 2 * _RECENT:  # saves that never committed
                self._saves_pending.pop(min(self._saves_pending))

    def stop_requested(self) -> StopRequest | None:
        """Call at every step boundary: a StopRequest once the job must stop (it stays)."""
        now = time.monotonic()
        if self._last_boundary is not None:
            self._steps.append(now - self._last_boundary)
        self._last_boundary = now
        if self._request is None:
            self._request = self._signalled() or self._deadline_near(now)
        return self._request

    def _signalled(self) -> StopRequest | None:
        if not self._received:
            return None
        number, since = self._received[0]
        grace = self.config.grace_s
        return StopRequest(f"{signal.Signals(number).name} received", since, since + grace, grace)

    def _deadline_near(self, now: float) -> StopRequest | None:
        if self._deadline is None:
            return None
        self._time_committed_saves()
        left = self._deadline - time.time()
        step = max(self._steps, default=0.0)
        save = max(self._saves, default=0.0)
        margin = self.config.margin_s
        if not stop_rule(left, step, save, margin):
            return None
        reason = (
            f"${self.config.deadline_env} stops the job in {left:.0f} s, less than one more "
            f"step ({step:.1f} s) and its save ({save:.1f} s) plus "
            f"checkpoint.preemption.margin_s={margin:g}"
        )
        grace = self.config.grace_s
        # The job ends at its deadline whatever the grace says: a wait past it would meet
        # the scheduler's SIGKILL instead of ending with a clean error.
        budget = min(grace, max(0.0, left))
        if budget < grace:
            reason += f"; waiting at most {budget:.0f} s, until that deadline"
        return StopRequest(reason, now, now + budget, grace)

    def _time_committed_saves(self) -> None:
        """Move saves whose commit record appeared into the recent save durations."""
        for step, started in list(self._saves_pending.items()):
            try:
                record = read_commit_record(step_dir(self._root, step))
            except CommitRecordError:
                continue  # not committed yet
            del self._saves_pending[step]
            self._saves.append(max(0.0, record.committed_at - started))


def commit_before_deadline(coordinator: Any, step: int, request: StopRequest) -> dict[str, Any]:
    """Wait for the out-of-schedule save of `step` to commit until the request's deadline
    (`coordinator` is a CheckpointCoordinator). Raises PreemptionError naming who is
    missing, or what failed; the previous committed step is untouched either way."""
    try:
        return coordinator.wait_for_commit(step, timeout_s=request.remaining_s())
    except (CommitTimeoutError, StepNotCommittedError) as exc:
        raise preemption_failure(step, request, exc) from None


def wait_before_deadline(refs: list[Any], who: list[str], step: int, request: StopRequest) -> None:
    """Wait for the Ray calls `refs` of the out-of-schedule save of `step` (one per
    participant, named in `who`) until the request's deadline; raise PreemptionError naming
    those that had not answered."""
    import ray  # here: start-up and the verl-ckpt tool import this module without Ray

    _, late = ray.wait(list(refs), num_returns=len(refs), timeout=request.remaining_s())
    if late:
        missing = [name for name, ref in zip(who, refs) if ref in late]
        cause = CommitTimeoutError("no snapshot yet from " + ", ".join(missing))
        raise preemption_failure(step, request, cause)


def preemption_failure(step: int, request: StopRequest, cause: BaseException) -> PreemptionError:
    """The one-line error of an out-of-schedule save that did not commit in time."""
    # An error raised in the finalizer reaches us wrapped in Ray's RayTaskError, whose text
    # is a remote traceback: the original exception is its `cause`.
    cause = getattr(cause, "cause", None) or cause
    return PreemptionError(
        f"the out-of-schedule save of step {step} ({request.reason}) did not commit within "
        f"checkpoint.preemption.grace_s={request.grace_s:g}: {cause}; the newest committed "
        "step stays the one to resume from"
    )
