"""Small helpers shared by the Ray test modules: drive every rank of the `ranks` fixture."""

from __future__ import annotations

import ray


def every_rank(ranks: dict) -> list:
    return [w for group in ranks.values() for w in group]


def open_all(ranks: dict, cfg: dict) -> None:
    ray.get([w.open_manager.remote(cfg) for w in every_rank(ranks)])


def save_everyone(
    ranks: dict, coordinator, step: int, after: str = "nothing", snapshot: str | None = None
) -> list[dict]:
    """Every rank saves `step` (then does `after`, see RankWorker.save); then the driver."""
    stats = ray.get([w.save.remote(step, after, snapshot) for w in every_rank(ranks)])
    coordinator.save_driver_state(step, {"step": step, "data_position": step * 4})
    return stats


def close_all(ranks: dict, coordinator) -> None:
    ray.get([w.close.remote() for w in every_rank(ranks)])
    coordinator.close()
