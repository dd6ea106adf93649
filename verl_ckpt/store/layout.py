"""Where things live under a checkpoint root (compatible with verl's layout).

<root>/latest_checkpointed_iteration.txt   newest committed step, "N\\n"
<root>/global_step_<N>/<role>/              megatron-core torch_dist directory per role
<root>/global_step_<N>/driver_state.pt      the driver's own state
<root>/global_step_<N>/<name>/state_<i>.pt  a declared participant's state (index i)
<root>/global_step_<N>/verl_ckpt_commit.json   commit record, written last
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "COMMIT_RECORD_FILENAME",
    "DELETING_PREFIX",
    "DRIVER_ROLE",
    "DRIVER_STATE_FILENAME",
    "ROOT_MARKER_FILENAME",
    "RUN_MARKER_FILENAME",
    "TRACKER_FILENAME",
    "list_step_dirs",
    "participant_state_file",
    "role_dir",
    "role_name_problem",
    "step_dir",
    "step_name",
    "step_of_dir",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMIT_RECORD_FILENAME = "verl_ckpt_commit.json"
DRIVER_STATE_FILENAME = "driver_state.pt"
# Written by the finalizer at start-up; every rank and the driver read it back to prove that
# they see the same filesystem.
ROOT_MARKER_FILENAME = ".verl_ckpt_root_marker"
# In a step directory: the run id of the job whose finalizer opened it (finalizer.py).
RUN_MARKER_FILENAME = ".verl_ckpt_run"
# A step being deleted is renamed to this prefix first: out of the step namespace at once.
DELETING_PREFIX = ".deleting_"
# The driver reports as one more participant under this role name.
DRIVER_ROLE = "driver"
# Only the name step_dir() makes: ASCII digits, no leading zero. `global_step_05` (or other
# Unicode digits) would be read as step 5 while step_dir(5) names another directory, and
# the tracker could then name a step whose directory does not exist (I1).
_STEP_DIR = re.compile(r"^global_step_(0|[1-9][0-9]*)$", re.ASCII)
# A role names a directory of every step: one plain name (no separator, no "..", not hidden).
_ROLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def step_name(step: int) -> str:
    """The name of step `step`'s directory (or object prefix) under a root."""
    return f"global_step_{step}"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / step_name(step)


def role_dir(root: str | Path, step: int, role: str) -> Path:
    return step_dir(root, step) / role


def role_name_problem(role: object) -> str | None:
    """Why `role` cannot be a role of a checkpoint, if it cannot: it names a directory in
    every step (`../x` or an absolute name would put ranks' files outside the root, where
    retention never reaches), and `driver` is the driver's own."""
    if role == DRIVER_ROLE:
        return f"role name {DRIVER_ROLE!r} is reserved for the driver"
    if not isinstance(role, str) or not _ROLE_NAME.match(role):
        return (
            f"role name {role!r} is not a plain directory name (letters, digits, '_', '-' "
            "and '.', not first)"
        )
    return None


def participant_state_file(name: str, index: int) -> str:
    """Where participant `name`[`index`] keeps its state, relative to the step directory."""
    return f"{name}/state_{index}.pt"


def step_of_dir(path: str | Path) -> int | None:
    """The step number of a `global_step_<N>` directory name, or None for anything else."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_step_dirs(root: str | Path) -> dict[int, Path]:
    """Every `global_step_<N>` directory under `root`, committed or not, by step."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        step = step_of_dir(entry)
        if step is not None and entry.is_dir():
            found[step] = entry
    return found
