"""The parts of one rank's CheckpointManager, started together and stopped together: the
agreement's group and thread, the writer (threads or a process), the staging pool, the
save thread, the uploads; and the collaborators that use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from verl_ckpt.commit.participant import ParticipantLink
from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.rank.agreement import SaveAgreement
from verl_ckpt.rank.planner import StepPlanner
from verl_ckpt.rank.save_runner import SaveRunner
from verl_ckpt.rank.snapshotter import Snapshotter
from verl_ckpt.rank.writers import Writer, make_writer
from verl_ckpt.store.fsio import WriteOptions

__all__ = ["RankParts", "open_parts"]

# How long a failed open waits for each part it started to stop: idle threads stop at once;
# an agreement group still forming cannot be interrupted and stops at its own deadline.
_FAILED_OPEN_CLOSE_S = 1.0


@dataclass
class RankParts:
    agreement: SaveAgreement
    writer: Writer
    snapshotter: Snapshotter
    planner: StepPlanner
    runner: SaveRunner

    def close(self, deadline: float) -> None:
        """Stop every part within `deadline`: the uploads and the save thread first (their
        work uses the others), the agreement, the writer; the staging pool is freed last,
        whatever failed. Raises CommitTimeoutError naming the threads still running."""
        try:
            stuck = [f"the save thread ({task})" for task in self.runner.close(deadline)]
            stuck += [
                f"the save group's agreement ({task}: a statement waiting for a peer)"
                for task in self.agreement.close(time_left(deadline))
            ]
            self.writer.close(time_left(deadline))
        finally:
            self.snapshotter.pool.clear()
        if stuck:
            raise CommitTimeoutError(
                f"still running at close()'s deadline: {', '.join(stuck)}; left behind as "
                "daemon threads (they end at their own deadline and hold up nothing else)"
            )


def open_parts(
    config: CheckpointConfig,
    group: dist.ProcessGroup | None,
    world_size: int,
    root: Path,
    link: ParticipantLink,
    make_uploader: Callable[[], Any],
) -> RankParts:
    """Start the parts of `link.role` rank `link.rank`.

    An open that fails part way stops what it started (threads, the agreement's group
    forming), as close() would: a trainer that catches the error and opens again must not
    pile them up. Once every part is made, RankParts.close owns them.
    """
    role, rank, timeout_s = link.role, link.rank, float(config.timeout_s)
    with contextlib.ExitStack() as started:
        # Step 1's agreement, on a private group and thread (a collective of the save group:
        # every rank of the role opens its manager at the same time). Made first: when it
        # cannot be made (the world's store is gone), nothing else was started.
        agreement = SaveAgreement(group, world_size, role, rank, str(root), timeout_s)
        started.callback(_stop_quietly, agreement.close)
        settings = config.writer
        mode = settings.mode if config.async_save else "inline"
        writer = make_writer(
            mode,
            settings.threads,
            f"verl_ckpt_{role}{rank}",
            settings.nice,
            WriteOptions(settings.writeback_every, settings.direct_io, beneath=str(root)),
            settings.idle_class,
        )
        started.callback(_stop_quietly, writer.close)
        snapshotter = Snapshotter(config, writer, role, rank, root)
        # Steps 3-4 (and a deferred step 2) run on one background thread per rank, which
        # hands files to the writer; inline mode runs them inside save().
        save_thread = None
        if mode != "inline":
            save_thread = DaemonPool(1, f"verl_ckpt_{role}{rank}_save", settings.nice)
            started.callback(_stop_quietly, save_thread.close)
        planner = StepPlanner(config, group, root, agreement, link, save_thread is not None)
        # Step 8: this rank uploads its own files to the remote tier, if there is one.
        uploads = make_uploader()
        runner = SaveRunner(config, root, link, planner, snapshotter, writer, save_thread, uploads)
        started.pop_all()
    return RankParts(agreement, writer, snapshotter, planner, runner)


def _stop_quietly(stop: Callable[[float], Any]) -> None:
    """Stop a part of a manager whose open failed; the open's own error is what it raises."""
    with contextlib.suppress(Exception):
        stop(_FAILED_OPEN_CLOSE_S)
