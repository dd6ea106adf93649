"""Start-up of the toy PPO recipe's Megatron ranks as the driver runs it (a base of
PPOToyTrainer): every rank placed and joined to its role's gloo world, or one line naming
the rank that failed or was not ready (tests/test_recipe_startup.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from recipes.workers import WorkerStartupError, WorkerStartupTimeout, process_died

__all__ = ["WorkerStartup"]

log = logging.getLogger("ppo_toy")


class WorkerStartup:
    """Needs `cfg`, `roles` and `groups` (role name -> RoleGroup) of the trainer."""

    @property
    def all_ranks(self) -> list[tuple[str, int, Any]]:
        return [(g.name, i, w) for g in self.groups.values() for i, w in enumerate(g.ranks)]

    def _call_all(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [getattr(w, method).remote(*args) for _, _, w in self.all_ranks]

    # ---- start-up ------------------------------------------------------------------------

    # How long a rank's start-up error waits for Ray to report a peer of its role dead.
    _PEER_DEATH_NOTICE_S = 5.0

    def start_workers(self) -> None:
        """Place every rank and join each role's gloo world. Fails at the first rank that dies
        or raises, naming it; at `trainer.startup_timeout_s`, naming the ranks not ready.

        Order: every rank reports once it is constructed (`started`), so that a process that
        dies at any point of start-up is noticed at once; each role's rank 0 opens the role's
        rendezvous (binds its port and keeps it); once a role's port is known, every rank of
        that role is set up with it. Results are taken one at a time as they come: waiting for
        all of them at once would wait for the whole timeout when a rank died, its peers
        blocked in the rendezvous waiting for it.
        """
        deadline = time.monotonic() + self.cfg.trainer.startup_timeout_s
        pending: dict[ray.ObjectRef, tuple[str, int, str]] = {}  # ref -> (role, rank, call)
        for role, index, worker in self.all_ranks:
            pending[worker.started.remote()] = (role, index, "started")
        for name, group in self.groups.items():
            pending[group.ranks[0].open_rendezvous.remote()] = (name, 0, "open_rendezvous")
        ready: set[tuple[str, int]] = set()
        while pending:
            done, _ = ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                raise self._startup_timeout(ready)
            role, index, call = pending.pop(done[0])
            result = self._startup_result(done[0], role, index, pending)
            if call == "started":
                log.debug("%s: process %s", self.groups[role].describe(index), result)
            elif call == "open_rendezvous":
                for rank, ref in enumerate(self.groups[role].call("setup", result)):
                    pending[ref] = (role, rank, "setup")
            else:
                ready.add((role, index))
        log.info(
            "workers ready: %s",
            ", ".join(
                f"{n} x{size} (TP={self.cfg.role(n).tensor_parallel_size})"
                for n, size in self.roles.items()
            ),
        )

    def _startup_timeout(self, ready: set[tuple[str, int]]) -> WorkerStartupTimeout:
        missing = ", ".join(
            self.groups[role].describe(index)
            for role, index, _ in self.all_ranks
            if (role, index) not in ready
        )
        return WorkerStartupTimeout(
            f"not ready after trainer.startup_timeout_s={self.cfg.trainer.startup_timeout_s:g}s: "
            f"{missing}. Each rank asks Ray for trainer.cpus_per_worker="
            f"{self.cfg.trainer.cpus_per_worker:g} CPUs; the cluster has "
            f"{ray.cluster_resources().get('CPU', 0):g}"
        )

    def _startup_result(
        self,
        ref: ray.ObjectRef,
        role: str,
        index: int,
        pending: dict[ray.ObjectRef, tuple[str, int, str]],
    ) -> Any:
        """The result of a finished start-up call, or a WorkerStartupError naming the rank."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            failure = (index, exc)
            if not process_died(exc):
                # A rank's rendezvous error is often the echo of a peer whose process died
                # (its connection closed): name the dead rank when Ray reports one.
                failure = self._peer_death(role, pending) or failure
            who = self.groups[role].describe(failure[0])
            log.debug("%s: start-up failed: %s", who, failure[1])
            raise WorkerStartupError.from_ray_error(who, failure[1]) from None

    def _peer_death(
        self, role: str, pending: dict[ray.ObjectRef, tuple[str, int, str]]
    ) -> tuple[int, Exception] | None:
        """(rank index, error) of a rank of `role` whose process Ray reports dead within
        _PEER_DEATH_NOTICE_S (Ray notices a dead process within milliseconds); else None."""
        peers = {ref: index for ref, (name, index, _) in pending.items() if name == role}
        deadline = time.monotonic() + self._PEER_DEATH_NOTICE_S
        waiting = list(peers)
        while waiting:
            done, waiting = ray.wait(
                waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not done:
                return None
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as exc:
                if process_died(exc):
                    return peers[done[0]], exc
        return None
