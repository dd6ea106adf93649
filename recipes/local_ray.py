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


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def init_local_ray(log: logging.Logger | None = None, **options: Any) -> None:
    """`ray.init(address="local", **options)` (always a new Ray of this process's own, never
    one found running on the machine), started a second time if the first start's node timed
    out; `log` names the first failure. With `_node_ip_address` on loopback, a Ray that would
    bind to another address is refused (RuntimeError) instead of started."""
    loopback = options.get("_node_ip_address") in _LOOPBACK
    if loopback:
        _refuse_unless_loopback()
    _start(log, options)
    address = ray.util.get_node_ip_address() if loopback else None
    if loopback and address not in _LOOPBACK:
        # What the check above cannot see: a later Ray that resolves loopback otherwise.
        ray.shutdown()
        raise RuntimeError(f"Ray bound to {address}, not to 127.0.0.1 as asked; shut down")


def _refuse_unless_loopback() -> None:
    """Ray replaces 127.0.0.1 by the machine's reachable IP (its resolve_ip_for_localhost)
    unless multi-node clusters are off, which RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 does; Ray
    reads it once, when it is imported (ray_constants). The benchmark's Ray was so bound to
    the machine's address for every run."""
    from ray._private import ray_constants

    if getattr(ray_constants, "ENABLE_RAY_CLUSTER", False):
        raise RuntimeError(
            "a Ray on 127.0.0.1 was asked for, but this Ray would bind to the machine's "
            "reachable address: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray is imported"
        )


def _start(log: logging.Logger | None, options: dict[str, Any]) -> None:
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
