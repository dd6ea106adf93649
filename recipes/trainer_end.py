"""The end of a toy PPO run as the driver runs it (a base of PPOToyTrainer): the ranks'
write figures, the commit before a preemption exit, the last commit, saves of other
participants that did not commit, Hugging Face exports, remote uploads, shutdown.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

import verl_ckpt
from recipes.rollout import declared_participants, first_line

__all__ = ["RunEnd"]

log = logging.getLogger("ppo_toy")


class RunEnd:
    """Needs the trainer's cfg, coordinator, metrics, groups, rollout, replay, stop,
    preemption, _writes and _save_began."""

    def commit_before_exit(self, step: int) -> None:
        """The job must stop: wait (until the stop's deadline) for `step` to commit; one line."""
        summary = verl_ckpt.commit_before_deadline(self.coordinator, step, self.stop)
        extra = len(self.preemption.signals_received) - 1 if self.preemption else 0
        log.info(
            "preemption (%s): step %d committed %.2f s after the request (save and commit "
            "%.2f s), tracker names step %s%s; exiting with status %d",
            self.stop.reason,
            step,
            time.monotonic() - self.stop.since,
            time.perf_counter() - self._save_began,
            summary["tracker"],
            f"; {extra} more signal(s) during the save, ignored" if extra > 0 else "",
            verl_ckpt.PREEMPTED_EXIT_STATUS,
        )

    def collect_write_figures(self, per_rank: list[list[dict[str, Any]]]) -> None:
        """Record finished writes; once every rank's write of a step ended, report it."""
        for (role, rank, _), finished in zip(self.all_ranks, per_rank):
            for figures in finished:
                writes = self._writes.setdefault(figures["step"], {})
                writes[(role, rank)] = (figures["write_s"], figures["bytes"])
        for step in sorted(self._writes):
            writes = self._writes[step]
            if len(writes) < len(self.all_ranks):
                continue
            del self._writes[step]
            write_s = max(w for w, _ in writes.values())
            nbytes = sum(b for _, b in writes.values())
            log.info(
                "step %d: checkpoint files written in %.3f s (slowest rank), %.2f MB by %d ranks",
                step,
                write_s,
                nbytes / 1e6,
                len(writes),
            )
            self.metrics.set_write_figures(step, write_s, nbytes)

    def finish(self, last_saved: int | None) -> None:
        """Finish every rank's writes, wait for the last save to commit, then for the
        Hugging Face exports of committed steps (save_contents with hf_model)."""
        self.collect_write_figures(ray.get(self._call_all("close")))
        if self.rollout is not None:
            self.rollout.close()
        if self.replay is not None:
            # As RolloutGroup.close: a failed or late replay saver is named, and the run's
            # end (the last commit, exports, uploads) still runs.
            try:
                ray.get(self.replay.close.remote(), timeout=self.cfg.checkpoint.timeout_s)
            except ray.exceptions.RayError as exc:
                log.warning("replay buffer: closing its saver: %s", first_line(exc))
        if declared_participants(self.cfg):
            self.report_unsettled_saves(last_saved)
        if last_saved is not None:
            summary = self.coordinator.wait_for_commit(last_saved)
            log.info(
                "step %d committed under %s: %d files, %.2f MB; tracker names step %s",
                last_saved,
                self.coordinator.root,
                summary["files"],
                summary["bytes"] / 1e6,
                summary["tracker"],
            )
        self.report_exports()
        if self.cfg.checkpoint.remote.url is not None:
            self.wait_for_uploads()

    def report_unsettled_saves(self, last_saved: int | None) -> None:
        """Async mode: an earlier save step still waiting for reports (a participant that
        died in its save, say) is waited for (checkpoint.timeout_s): its outcome is one
        line, naming who never reported, instead of nothing once the job is gone."""
        pending = self.coordinator.status()["pending"]
        for step in sorted(int(s) for s in pending):
            if last_saved is None or step >= last_saved:
                continue
            try:
                self.coordinator.wait_for_commit(step, timeout_s=self._left_before_the_stop())
            except verl_ckpt.CheckpointError as exc:
                log.error("step %d did not commit: %s", step, exc)

    def _left_before_the_stop(self) -> float | None:
        """What is left of the stop's grace once the job must stop (None: not stopping, the
        checkpoint deadline applies). The scheduler kills the job at the stop's deadline:
        an export or upload that would outlast it is left to the next run (logged)."""
        return None if self.stop is None else self.stop.remaining_s()

    def report_exports(self) -> None:
        """Wait (checkpoint.timeout_s, or what is left of a stop's grace) for the exports; a
        failed one is an error line that says how to retry it, and leaves its step
        committed."""
        try:
            outcomes = self.coordinator.wait_for_exports(timeout_s=self._left_before_the_stop())
        except verl_ckpt.CommitTimeoutError as exc:
            log.error("%s", exc)
            return
        for outcome in outcomes:
            failed = outcome["state"] == "failed"
            where = f" to {outcome['path']}" if outcome["path"] else ""
            log.log(
                logging.ERROR if failed else logging.INFO,
                "step %d: Hugging Face export of %s %s%s: %s",
                outcome["step"],
                outcome["role"],
                outcome["state"],
                where,
                outcome["message"],
            )

    def wait_for_uploads(self) -> None:
        """A finished run has its last committed step in the remote tier too (within the
        checkpoint deadline); a remote tier that fails is logged, the local tier stands."""
        try:
            remote = self.coordinator.wait_for_uploads(timeout_s=self._left_before_the_stop())
        except verl_ckpt.CommitTimeoutError as exc:
            log.error("%s; the next run uploads the newest committed step", exc)
            return
        if remote["status"] == "committed" or remote["step"] is None:
            log.info(
                "remote tier %s: step %s committed; remote tracker names step %s",
                remote["url"],
                remote["step"],
                remote["tracker"],
            )
        else:
            log.error(
                "remote tier %s: step %s is not uploaded (%s); the next run uploads it",
                remote["url"],
                remote["step"],
                remote["error"] or remote["status"],
            )

    def shutdown(self) -> None:
        """Release everything; safe after a failure halfway."""
        self.metrics.close()
        for _, _, worker in self.all_ranks:
            ray.kill(worker, no_restart=True)
        if self.rollout is not None:
            self.rollout.kill()
        if self.replay is not None:
            ray.kill(self.replay, no_restart=True)
        if self.stop is None:
            self.coordinator.close()
            return
        # Stopping: the scheduler's SIGKILL is near. A commit or retention still running gets
        # what is left of the grace period (at least a few seconds); cut short, the next start
        # rolls a commit forward if it got as far as its record, and retention resumes.
        try:
            self.coordinator.close(timeout_s=max(self.stop.remaining_s(), 5.0))
        except verl_ckpt.CheckpointError as exc:
            log.warning("closing the checkpoint coordinator: %s", exc)
