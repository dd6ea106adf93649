"""Protocol step E (export), the scheduling: which roles export, and the finalizer's queue.

After a step commits, the finalizer hands it to `ExportQueue`; one export runs at a time, in a
Ray task of its own (no CPU slot, the finalizer's node), never on a rank, never in the
training loop, never on the commit path: the tracker has moved before an export starts, and
nothing an export does can un-commit the step. A step waiting for or under export is kept
from retention until its export ended. If saves come faster than exports, a waiting step is
superseded by the next one (logged; `verl-ckpt export` can still write it), so the queue
never grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_ckpt.hf.mapping import check_architecture
from verl_ckpt.hf.record import describe_context_length
from verl_ckpt.protocol.config import HF_MODEL, CheckpointConfig
from verl_ckpt.protocol.errors import CheckpointConfigError, CommitTimeoutError
from verl_ckpt.store.layout import step_dir
from verl_ckpt.store.signing import Keyring

__all__ = ["ExportOutcome", "ExportPlan", "ExportQueue", "check_export_config", "plan_exports"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportPlan:
    """What the finalizer exports after each commit (built by `plan_exports`)."""

    architectures: dict[str, str]
    max_shard_bytes: int
    timeout_s: float


@dataclass
class ExportOutcome:
    """One export of one step and role, as the finalizer's status and the recipe show it."""

    step: int
    role: str
    # queued, running, done, failed, or skipped (superseded by a newer step).
    state: str
    message: str = ""
    path: str | None = None
    seconds: float | None = None

    def describe(self) -> str:
        where = f" to {self.path}" if self.path else ""
        detail = f": {self.message}" if self.message else ""
        what = f"Hugging Face export of step {self.step} role {self.role}"
        return f"{what} {self.state}{where}{detail}"


def check_export_config(config: CheckpointConfig) -> None:
    """Start-up check (before Ray): every configured architecture names a known mapping."""
    for role, name in config.hf_export.architectures.items():
        check_architecture(name, f"checkpoint.hf_export.architectures.{role}")


def plan_exports(config: CheckpointConfig, roles: list[str]) -> ExportPlan | None:
    """The export plan of a job whose ranks save `roles`; None when hf_model is not saved.
    A role without an architecture is skipped with one log line; an architecture for a role
    the job does not have is a typo, refused naming the key."""
    architectures = dict(config.hf_export.architectures)
    for role in architectures:
        if role not in roles:
            raise CheckpointConfigError(
                f"checkpoint.hf_export.architectures.{role}={architectures[role]!r} is invalid: "
                f"the job has no role {role!r} (roles: {', '.join(sorted(roles))})"
            )
    if HF_MODEL not in config.save_contents:
        return None
    for role in sorted(set(roles) - set(architectures)):
        logger.info(
            "hf_model: role %s has no checkpoint.hf_export.architectures entry: its Hugging Face "
            "weights are not exported",
            role,
        )
    if not architectures:
        return None
    return ExportPlan(architectures, config.hf_export.max_shard_mb << 20, float(config.timeout_s))


# Outcomes of exports that ended (done, failed, skipped) kept for status() and
# wait_for_exports(), newest first: the finalizer's memory stays flat over a long run.
OUTCOMES_KEPT = 256


class ExportQueue:
    """The finalizer's exports: one at a time, in a Ray task (in a thread without Ray).
    Lives on the finalizer's event loop: `submit` and `protected` never await."""

    def __init__(self, root: Path, plan: ExportPlan | None, keyring: Keyring | None = None) -> None:
        self._root = root
        self._plan = plan
        # checkpoint.signing's keys: each export signs its record (hf/record.py), as the
        # finalizer signs its commit records. Handed to the export's task as its argument,
        # as the driver hands them to the finalizer; never logged.
        self._keyring = keyring
        self._waiting: deque[int] = deque()
        self._running: int | None = None
        self._outcomes: dict[tuple[int, str], ExportOutcome] = {}
        self._worker: asyncio.Task | None = None
        self._remote: Any = None
        self._running_ref: Any = None  # the Ray task of the running export

    def submit(self, step: int) -> None:
        """Queue the exports of a step that just committed."""
        if self._plan is None:
            return
        while self._waiting:
            older = self._waiting.popleft()
            for role in self._plan.architectures:
                why = f"superseded by step {step}; {self._retry(older, role)}"
                self._outcomes[(older, role)] = ExportOutcome(older, role, "skipped", why)
            logger.warning(
                "Hugging Face export of step %d skipped: step %d came first", older, step
            )
        self._waiting.append(step)
        for role in self._plan.architectures:
            self._outcomes[(step, role)] = ExportOutcome(step, role, "queued")
        self._forget_oldest_ended()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())

    def _forget_oldest_ended(self) -> None:
        ended = [key for key, o in self._outcomes.items() if o.state not in ("queued", "running")]
        for key in sorted(ended)[: max(0, len(ended) - OUTCOMES_KEPT)]:
            del self._outcomes[key]

    def protected(self) -> set[int]:
        """Steps retention must keep: queued or under export."""
        running = {self._running} if self._running is not None else set()
        return set(self._waiting) | running

    def outcomes(self) -> list[dict[str, Any]]:
        return [asdict(outcome) for _, outcome in sorted(self._outcomes.items())]

    async def wait(self, timeout_s: float) -> list[dict[str, Any]]:
        """Wait (up to `timeout_s`) until no export is queued or running; every outcome.
        Exports still running then are named in a CommitTimeoutError."""
        worker = self._worker
        if worker is not None and not worker.done():
            await asyncio.wait({worker}, timeout=timeout_s)
            if not worker.done():
                pending = sorted(self.protected())
                raise CommitTimeoutError(
                    f"Hugging Face exports of steps {pending} under {self._root} did not end "
                    f"within {timeout_s:.0f}s; `verl-ckpt export` writes them later"
                )
        return self.outcomes()

    def cancel(self) -> None:
        """Drop the waiting exports and stop the running one (the job is closing: nothing
        may keep running after it). Each is reported; `verl-ckpt export` writes it later."""
        while self._waiting:
            step = self._waiting.popleft()
            for role in self._plan.architectures:
                why = f"cancelled: the job closed first; {self._retry(step, role)}"
                self._outcomes[(step, role)] = ExportOutcome(step, role, "skipped", why)
        if self._running_ref is not None:
            import ray

            ray.cancel(self._running_ref, force=True)

    async def _work(self) -> None:
        while self._waiting:
            step = self._running = self._waiting.popleft()
            try:
                for role, architecture in self._plan.architectures.items():
                    await self._export(step, role, architecture)
            finally:
                self._running = None

    async def _export(self, step: int, role: str, architecture: str) -> None:
        outcome = self._outcomes[(step, role)]
        outcome.state = "running"
        started = time.monotonic()
        try:
            summary = await self._run(step, role, architecture)
        except Exception as exc:  # noqa: BLE001 - reported; the committed step is untouched
            outcome.state = "failed"
            outcome.message = f"{_describe(exc)}; {self._retry(step, role)}"
            logger.error("%s", outcome.describe())
        else:
            outcome.state = "done"
            outcome.path = summary["path"]
            outcome.message = (
                f"{summary['files']} files, {summary['bytes']} bytes; "
                + describe_context_length(summary.get("context_length"))
            )
            logger.info("%s", outcome.describe())
        outcome.seconds = time.monotonic() - started

    async def _run(self, step: int, role: str, architecture: str) -> dict[str, Any]:
        import ray

        plan = self._plan
        args = (
            str(step_dir(self._root, step)),
            role,
            architecture,
            plan.max_shard_bytes,
            self._keyring,
        )
        if not ray.is_initialized():  # an in-process finalizer (tests, benchmarks)
            work = asyncio.to_thread(_export_task_body, *args)
            return await asyncio.wait_for(work, plan.timeout_s)
        ref = self._running_ref = self._remote_task().remote(*args)
        try:
            return await asyncio.wait_for(_result(ref), plan.timeout_s)
        except TimeoutError:
            ray.cancel(ref, force=True)
            raise CommitTimeoutError(
                f"did not finish within checkpoint.timeout_s={plan.timeout_s:g}s"
            ) from None
        finally:
            self._running_ref = None

    def _remote_task(self) -> Any:
        if self._remote is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # This node sees the root (the driver checked every node does); max_retries=0:
            # a failed export is reported, and `verl-ckpt export` retries it.
            node = ray.get_runtime_context().get_node_id()
            self._remote = ray.remote(_export_task_body).options(
                num_cpus=0,
                max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
            )
        return self._remote

    def _retry(self, step: int, role: str) -> str:
        return f"retry with: verl-ckpt export {self._root} --step {step} --role {role}"


def _export_task_body(
    step_path: str, role: str, architecture: str, max_shard_bytes: int, keyring: Keyring | None
) -> dict[str, Any]:
    from verl_ckpt.hf.export import export_role

    summary = export_role(step_path, role, architecture, None, max_shard_bytes, keyring)
    return asdict(summary)


async def _result(ref: Any) -> Any:
    return await ref


def _describe(exc: BaseException) -> str:
    """One line: the export's own exception, not Ray's wrapper around it."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if isinstance(exc, CommitTimeoutError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
