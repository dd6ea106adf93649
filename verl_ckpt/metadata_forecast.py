"""The `.metadata` of a role's step, made while its ranks still write (the finalizer's forecast).

Making a role's `.metadata` (DCP's finish: every rank's write results merged into the plan's
metadata, the whole pickled) is most of a commit's own time, and a commit starts only when
the last report arrives: it counts in every save's time to durable. While a role's plan
holds, its ranks send the same plan metadata and (their blobs' sizes depending on the
tensors' geometry only, torch_format) the same write results at every step. So when a role
begins a step, the finalizer makes, in the background, the `.metadata` that the inputs of
the role's last commit give for the new step's directory. The commit uses it only if every
rank of the role sent exactly those bytes again (compared whole, not hashed); otherwise it
makes the file then, as it would without a forecast. A forecast never decides what is
written: it only moves the work of an exact, checked match ahead of the last report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_ckpt.reports import RankReport
from verl_ckpt.torch_dist_dir import metadata_file_bytes

__all__ = ["MetadataForecast", "role_inputs"]

logger = logging.getLogger(__name__)

# Forecasts of steps that never commit (failed, lost) are dropped beyond this many.
_PENDING_MAX = 16


@dataclass(frozen=True)
class _Inputs:
    """Everything a role's `.metadata` is made of, besides its directory: the bytes as the
    ranks sent them, and the objects they unpickled to (reports.RankReport.unpack)."""

    packed_metadata: bytes
    packed_results: tuple[bytes, ...]  # by rank
    metadata: Any
    results: tuple[list, ...]

    def same_bytes(self, other: _Inputs) -> bool:
        return (
            self.packed_metadata == other.packed_metadata
            and self.packed_results == other.packed_results
        )


def role_inputs(reports: list[RankReport]) -> _Inputs | None:
    """The `.metadata` inputs in one role's reports (all of them, any order), or None where
    a report lacks the bytes a comparison needs."""
    ranked = sorted(reports, key=lambda r: r.rank)
    coordinators = [r for r in ranked if r.packed_global_metadata is not None]
    if len(coordinators) != 1 or any(r.packed_write_results is None for r in ranked):
        return None
    return _Inputs(
        coordinators[0].packed_global_metadata,
        tuple(r.packed_write_results for r in ranked),
        coordinators[0].global_metadata,
        tuple(r.write_results for r in ranked),
    )


class MetadataForecast:
    """Per role: the inputs of its last commit; per step begun: the `.metadata` they give.

    Used from the finalizer's event loop only; the files are made on worker threads.
    """

    def __init__(self) -> None:
        # How many commits took a forecast, and how many had one whose inputs differed.
        self.used = 0
        self.missed = 0
        self._last: dict[str, _Inputs] = {}
        self._pending: OrderedDict[tuple[int, str], tuple[_Inputs, Path, asyncio.Task]] = (
            OrderedDict()
        )

    def begin(self, step: int, role: str, directory: Path) -> None:
        """The role's directory of `step` exists: forecast its `.metadata`, once, if the role
        committed before."""
        key = (step, role)
        last = self._last.get(role)
        if last is None or key in self._pending:
            return
        task = asyncio.ensure_future(
            asyncio.to_thread(metadata_file_bytes, directory, last.metadata, list(last.results))
        )
        self._pending[key] = (last, directory, task)
        while len(self._pending) > _PENDING_MAX:
            _, (_, _, dropped) = self._pending.popitem(last=False)
            _discard(dropped)

    async def take(
        self, step: int, role: str, directory: Path, inputs: _Inputs | None
    ) -> bytes | None:
        """The forecast `.metadata` of the role's step if it was made from exactly `inputs`
        for `directory`; None otherwise (the commit makes it itself)."""
        pending = self._pending.pop((step, role), None)
        if pending is None:
            return None
        forecast_from, forecast_dir, task = pending
        if inputs is None or forecast_dir != directory or not forecast_from.same_bytes(inputs):
            self.missed += 1
            _discard(task)
            return None
        try:
            made = await task
            self.used += 1
            return made
        except Exception as exc:  # noqa: BLE001 - only an optimisation: the commit makes it
            logger.warning(
                "forecast of step %d role %s failed (made at commit): %s", step, role, exc
            )
            return None

    def committed(self, role: str, inputs: _Inputs | None) -> None:
        """The role's step committed from `inputs`: the next steps are forecast from them."""
        if inputs is None:
            self._last.pop(role, None)
        else:
            self._last[role] = inputs


def _discard(task: asyncio.Task) -> None:
    """Drop a forecast nobody will wait for, without leaving its error unretrieved."""
    if task.done():
        with contextlib.suppress(BaseException):
            task.exception()
    else:
        task.add_done_callback(lambda done: _discard(done))
