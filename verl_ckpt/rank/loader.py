"""Loading one rank's part of a committed step (the resume side of protocol step 0): the
commit record, whether the step fits this role (resume_fit), the checksums, then
megatron-core's load into the caller's sharded templates, with where the time went.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_ckpt.format import megatron_compat
from verl_ckpt.format.load_stats import LoadStats, PhaseClock
from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.errors import CommitRecordError
from verl_ckpt.rank.state_dict import extra_sharded
from verl_ckpt.startup.resume_fit import extra_reshard_error, missing_role_error
from verl_ckpt.store.commit_record import read_commit_record
from verl_ckpt.store.layout import step_dir
from verl_ckpt.store.verification import verify_files

__all__ = ["RankLoader"]


class RankLoader:
    """Loads `role` rank `rank` of `world_size` from steps under `root`."""

    def __init__(
        self, config: CheckpointConfig, role: str, rank: int, world_size: int, root: Path
    ) -> None:
        self._config = config
        self._role, self._rank, self._world_size = role, rank, world_size
        self._root = root

    def load(
        self,
        step_path: str | Path | int,
        model: dict | None,
        optimizer: dict | None,
        extra: bool,
        clock: PhaseClock,
    ) -> tuple[dict[str, Any], LoadStats]:
        """CheckpointManager.load() once the state may change (the caller fenced and
        drained); `clock` started with the call."""
        path = step_dir(self._root, step_path) if isinstance(step_path, int) else Path(step_path)
        record = read_commit_record(path)
        saved_world = record.role_world_size(self._role)
        if saved_world is None:
            raise missing_role_error(path, self._role, record)
        template = self._template(path, saved_world, model, optimizer, extra)
        if self._config.verify_checksums_on_load:
            problems = verify_files(path, record, prefix=f"{self._role}/")
            if problems:
                raise CommitRecordError(f"{path} failed verification: " + "; ".join(problems))
        clock.mark("checks (fence, commit record, checksums)")
        loaded, read_in_place = megatron_compat.load_role_dir(template, path / self._role, clock)
        stats = LoadStats.from_clock(str(path), clock, read_in_place)
        # megatron-core merges common.pt back in, which may hold non-sharded parts of contents
        # that were not asked for (an optimizer's param_groups): return only what was.
        return {key: value for key, value in loaded.items() if key in template}, stats

    def _template(
        self,
        path: Path,
        saved_world: int,
        model: dict | None,
        optimizer: dict | None,
        extra: bool,
    ) -> dict[str, Any]:
        """The contents in load_contents that the caller gave; the extra state only at the
        world size it was saved with (it is one object per rank)."""
        wanted = self._config.load_contents
        template: dict[str, Any] = {}
        if "model" in wanted and model is not None:
            template["model"] = model
        if "optimizer" in wanted and optimizer is not None:
            template["optimizer"] = optimizer
        if "extra" in wanted and extra:
            if saved_world != self._world_size:
                raise extra_reshard_error(path, self._role, saved_world, self._world_size)
            template["extra"] = extra_sharded(None, self._world_size, self._rank)
        return template
