"""The `.metadata` of a role's step, made while its ranks still write (the finalizer's forecast).

Making a role's `.metadata` (DCP's finish: every rank's write results merged into the plan's
metadata, the whole pickled) is most of a commit's own time, and a commit starts only when
the last report arrives: it counts in every save's time to durable. While a role's plan
holds, its ranks send the same plan metadata and (their blobs' sizes and padding depending
on the tensors' geometry only, and on whether a large storage starts on a page, which a
staging buffer always does, or for a live snapshot's tensors on their offset within one,
which a trainer's own tensors keep: torch_format) the same write results at every step. So once
every rank of a role began a step (admission), the finalizer makes, in the background, the
`.metadata` that the inputs of the role's last commit give for the new step's directory. The
commit uses it only if every rank of the role sent exactly those bytes again (compared
whole, not hashed); otherwise it makes the file then, as it would without a forecast. A
forecast never decides what is written: it only moves the work of an exact, checked match
ahead of the last report.
"""

from __future__ import annotations

import logging
import pickle
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.protocol.threads import DaemonPool

__all__ = ["MetadataForecast", "role_inputs"]

logger = logging.getLogger(__name__)

# Forecasts of steps that never commit (failed, lost) are dropped beyond this many.
_PENDING_MAX = 16


@dataclass(frozen=True)
class _Inputs:
    """Everything a role's `.metadata` is made of, besides its directory: the bytes as the
    ranks sent them, and the plan metadata they unpickled to (reports.RankReport.unpack)."""

    packed_metadata: bytes
    packed_results: tuple[bytes, ...]  # by rank
    metadata: Any

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
    )


def _forecast_file(directory: Path, inputs: _Inputs) -> bytes:
    # Imported here, as in commit.steps: the driver imports this module with the finalizer's
    # actor class (to start the actor) and has no use for torch's checkpoint package; the
    # finalizer imports it when it starts (CheckpointFinalizer.__init__).
    from verl_ckpt.format.torch_dist_dir import metadata_file_bytes

    # The ranks' own reports over Ray (protocol/messages.py's trust boundary), never bytes
    # read from a root.
    results = [pickle.loads(packed) for packed in inputs.packed_results]
    return metadata_file_bytes(directory, inputs.metadata, results)


class MetadataForecast:
    """Per role: the inputs of its last commit; per step begun: the `.metadata` they give.

    Used from the finalizer's event loop only; the files are made on a thread of its own.
    """

    def __init__(self) -> None:
        # How many commits took a forecast, had one whose inputs differed, or had one not
        # made yet when the commit began (then the commit made the file itself).
        self.used = 0
        self.missed = 0
        self.late = 0
        self._last: dict[str, _Inputs] = {}
        # A forecast is made while the ranks copy and write, and is wanted only at the commit:
        # on its own thread, run only on an idle core (the ranks' copy takes the cores
        # first; their disk-bound write leaves some idle), and never waited for. Started at
        # the first forecast; it lives as long as the finalizer's process.
        self._thread: DaemonPool | None = None
        self._pending: OrderedDict[tuple[int, str], tuple[_Inputs, Path, Future]] = OrderedDict()

    def begin(self, step: int, role: str, directory: Path) -> None:
        """Every rank of the role began `step` (admission): forecast its `.metadata` in
        `directory`, if the role committed before; a call for a step already forecast (a
        retried begin) does nothing."""
        key = (step, role)
        last = self._last.get(role)
        if last is None or key in self._pending:
            return
        if self._thread is None:
            self._thread = DaemonPool(1, "verl_ckpt_forecast", nice=19, idle=True)
        forecast = self._thread.submit(_forecast_file, directory, last, label="forecast")
        self._pending[key] = (last, directory, forecast)
        while len(self._pending) > _PENDING_MAX:
            _, (_, _, dropped) = self._pending.popitem(last=False)
            dropped.cancel()  # not started yet: never runs; running: its result is dropped

    def take(self, step: int, role: str, directory: Path, inputs: _Inputs | None) -> bytes | None:
        """The forecast `.metadata` of the role's step if it was made from exactly `inputs`
        for `directory`; None otherwise (the commit makes it itself)."""
        pending = self._pending.pop((step, role), None)
        if pending is None:
            return None
        forecast_from, forecast_dir, forecast = pending
        if inputs is None or forecast_dir != directory or not forecast_from.same_bytes(inputs):
            self.missed += 1
            forecast.cancel()
            return None
        if not forecast.done():
            # Never waited for: on a busy machine an idle-class thread may not run for long.
            self.late += 1
            forecast.cancel()
            return None
        try:
            metadata_file = forecast.result()
        except Exception as exc:  # noqa: BLE001 - only an optimisation: the commit makes it
            logger.warning(
                "forecast of step %d role %s failed (made at commit): %s", step, role, exc
            )
            return None
        self.used += 1
        return metadata_file

    def ready(self, step: int, role: str) -> bool:
        """Whether the forecast of the role's step is made (for tests and status)."""
        pending = self._pending.get((step, role))
        return pending is not None and pending[2].done()

    def committed(self, role: str, inputs: _Inputs | None) -> None:
        """The role's step committed from `inputs`: the next steps are forecast from them."""
        if inputs is None:
            self._last.pop(role, None)
        else:
            self._last[role] = inputs
