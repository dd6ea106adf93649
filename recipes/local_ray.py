"""Start a Ray of this process's own on 127.0.0.1, once more if its node timed out starting.

Ray's raylet waits a fixed 15 s for its dashboard agent (a Python process it starts even
without a dashboard) to write its port file, and exits when it does not: on a loaded 2-core
machine the agent's imports alone can take longer (ray-project/ray#65983; seen in this
project's test suite). `ray.init` then fails after 30 s with "The current node timed out
during startup". The first start's other processes (its GCS, its agents) stay until this
process exits (Ray's reaper ends them then); the second start picks ports of its own. Every
other error of `ray.init` is raised as it is.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

__all__ = ["init_local_ray"]

_NODE_TIMED_OUT = "timed out during startup"


def init_local_ray(log: logging.Logger | None = None, **options: Any) -> None:
    """`ray.init(address="local", **options)` (always a new Ray of this process's own, never
    one found running on the machine), started a second time if the first start's node timed
    out; `log` names the first failure."""
    try:
        ray.init(address="local", **options)
    except Exception as exc:  # Ray raises a bare Exception for it
        if _NODE_TIMED_OUT not in str(exc):
            raise
        (log or logging.getLogger(__name__)).warning(
            "Ray's node did not start in time (%s); starting it once more", exc
        )
        # Whatever state of the first start this process holds is reset before the second.
        ray.shutdown()
        ray.init(address="local", **options)
