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
    "MAX_RECORDED_PATH",
    "MAX_STEP",
    "TRACKER_FILENAME",
    "checked_relative_path",
    "list_step_dirs",
    "printable",
    "relative_path_problem",
    "participant_state_file",
    "role_dir",
    "role_name_problem",
    "step_dir",
    "step_name",
    "step_of_dir",
    "step_number_problem",
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
# The largest step: 18 digits, what a tracker may hold (tracker.parse_tracker), below int64's
# limit. A planted `global_step_<19 digits>` with a valid record was rolled forward to, and
# left a tracker that no start could read again.
MAX_STEP = 10**18 - 1
# Only the name step_dir() makes: ASCII digits, no leading zero, at most MAX_STEP.
# `global_step_05` (or other Unicode digits) would be read as step 5 while step_dir(5) names
# another directory, and the tracker could then name a step whose directory does not exist
# (I1).
_STEP_DIR = re.compile(rf"^global_step_(0|[1-9][0-9]{{0,{len(str(MAX_STEP)) - 1}}})$", re.ASCII)
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


# A name read from a record or a listing (a file of a step, a role) is at most this long:
# PATH_MAX, and NAME_MAX per part (in UTF-8 bytes, as the filesystem counts).
MAX_RECORDED_PATH = 4096
_MAX_PART_BYTES = 255
_SHOWN_CHARS = 120


def relative_path_problem(name: object) -> str | None:
    """Why `name`, read from a record or a listing (data anyone who can write the root or the
    bucket wrote), cannot name a file or directory below the directory the record speaks
    for, if it cannot: the one check of such names (commit and export records, the rollback
    journal, remote listings). Its answer is a reason, without the name."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if len(name) > MAX_RECORDED_PATH:
        return f"is longer than {MAX_RECORDED_PATH} characters"
    if not name.replace("\t", " ").isprintable():
        # NUL ends a path in the kernel; terminal escapes would rewrite a screen printing it.
        # A tab is let through: it moves no cursor anywhere harmful, and names holding one
        # have always been recorded (tests/test_units.py); printing escapes it anyway.
        return "holds a control character"
    if name.startswith(("/", "\\")):
        return "is absolute"
    parts = name.split("/")
    if "" in parts:
        return "has an empty part (a doubled or trailing '/')"
    if ".." in parts or "." in parts:
        return "has a '.' or '..' part"
    if any(len(part.encode("utf-8", "surrogateescape")) > _MAX_PART_BYTES for part in parts):
        return f"has a part longer than {_MAX_PART_BYTES} bytes"
    return None


def checked_relative_path(name: object, context: str, error: type[Exception]) -> str:
    """`name` when relative_path_problem finds nothing; else `error` in one line: `context`
    (which names the record it was read from), then the name, escaped, and why."""
    problem = relative_path_problem(name)
    if problem is not None:
        raise error(f"{context}: {printable(name)} is refused, it {problem}")
    return name  # type: ignore[return-value]


def printable(name: object) -> str:
    """`name` quoted with its control characters escaped (repr's escapes), cut to a readable
    length: for names read from a root, printed or logged (terminal escapes in a role name
    must not rewrite the terminal)."""
    text = repr(name)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}...(cut)"


def participant_state_file(name: str, index: int) -> str:
    """Where participant `name`[`index`] keeps its state, relative to the step directory."""
    return f"{name}/state_{index}.pt"


def step_number_problem(step: object) -> str | None:
    """Why `step` cannot be a step number, if it cannot: an integer from 0 to MAX_STEP."""
    if not isinstance(step, int) or isinstance(step, bool):
        return f"step {step!r} is not an integer"
    if not 0 <= step <= MAX_STEP:
        return f"step {step} is not from 0 to {MAX_STEP}"
    return None


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
