"""A driver for the multi-node tests: role `actor` with one rank on node_a and one on node_b
of an existing Ray cluster, saving one step. Prints one JSON line with the outcome."""

from __future__ import annotations

import json
import sys

import ray


def main(address: str, root: str, remote: str | None = None) -> None:
    """`remote`: the JSON of checkpoint.remote (a remote tier the ranks upload to)."""
    ray.init(address=address, namespace="verl_ckpt_multinode", log_to_driver=False)
    from tests.rank_worker import start_world
    from verl_ckpt import CheckpointCoordinator, read_tracker

    cfg = {"root_dir": root, "timeout_s": 60.0}
    if remote:
        cfg["remote"] = json.loads(remote)
    coordinator = CheckpointCoordinator(cfg, {"actor": 2})
    placement = ["node_a", "node_b"]  # each rank on its own node (custom resources)
    ranks = start_world(
        "actor", 2, tp=1, options=lambda rank: {"resources": {placement[rank]: 0.01}}
    )
    nodes = ray.get([r.node.remote() for r in ranks])
    outcome = {"nodes": nodes}
    try:
        # Each rank's own outcome, so that the test sees which rank failed and why.
        opened = [r.open_manager.remote(cfg) for r in ranks]
        errors = {}
        for rank, ref in enumerate(opened):
            try:
                ray.get(ref, timeout=120)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                errors[rank] = str(exc).splitlines()[-1]
        if errors:
            outcome["open_errors"] = errors
            raise RuntimeError(" | ".join(errors.values()))
        ray.get([r.save.remote(1) for r in ranks])
        coordinator.save_driver_state(1, {"step": 1})
        coordinator.wait_for_commit(1)
        ray.get([r.close.remote() for r in ranks])
        outcome["tracker"] = read_tracker(root)
        if remote:
            outcome["remote"] = coordinator.wait_for_uploads()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome["error"] = str(exc).splitlines()[-1]
    coordinator.close()
    print("RESULT " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
