"""The two files that make a role's torch_dist directory whole: DCP's `.metadata` and
megatron-core's `metadata.json`. The finalizer writes them when it commits a step.

Only torch's DCP is imported here, never megatron-core: the finalizer is a Ray actor started
by every job (and again after each restart), and megatron-core's import costs it about 3 s
of CPU for two files it does not need it to write. `megatron_compat` imports this module and
checks at import that megatron-core still writes the same `metadata.json`, so a release that
changes the format fails there, loudly, in the ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from verl_ckpt.fsio import fsync_dir

__all__ = [
    "BACKEND",
    "CHECKPOINTING_CONFIG",
    "METADATA_FILENAMES",
    "complete_role_dir",
]

# (sharded_backend, sharded_backend_version) of megatron-core's CheckpointingConfig.
BACKEND = ("torch_dist", 1)
METADATA_FILENAMES = (".metadata", "metadata.json")
# What megatron-core's save_config(CheckpointingConfig(*BACKEND)) writes to metadata.json,
# key order included (it dumps the dataclass with json.dump).
CHECKPOINTING_CONFIG = {
    "sharded_backend": BACKEND[0],
    "sharded_backend_version": BACKEND[1],
    "common_backend": "torch",
    "common_backend_version": 1,
}


def complete_role_dir(checkpoint_dir: Path, global_metadata: Any, write_results: list) -> None:
    """Write `.metadata` and `metadata.json`, the files that make a torch_dist directory whole.

    `metadata.json` goes last: megatron-core refuses a directory without it, so until it is
    durable the directory is not loadable even by code that ignores our commit record.
    """
    # DCP's own finish (megatron-core's writer calls the same one for local files): merges
    # every rank's write results into the metadata, writes `.metadata` and fsyncs it.
    FileSystemWriter(checkpoint_dir).finish(global_metadata, write_results)
    fsync_dir(checkpoint_dir)
    with open(checkpoint_dir / "metadata.json", "w") as f:
        json.dump(CHECKPOINTING_CONFIG, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(checkpoint_dir)
