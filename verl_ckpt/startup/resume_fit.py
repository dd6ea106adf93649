"""Whether a run's ranks can load a committed step, from what is on disk alone.

A rank's `load()` refuses a step that holds no state of its role, and per-rank extra state
(RNG and the like) saved by another number of ranks: megatron-core reshards model and
optimizer, but a rank's own state has no counterpart in a world of another size.
`prepare_start(config, roles=...)` makes the same checks before Ray starts, from the commit
record's rank counts and, only when a role's rank count changed, the names in its DCP
`.metadata`: a run started with another world size then fails in one line naming the step
and the key, instead of in every rank's load once the workers are up. So does a run whose
`checkpoint.load_contents` asks for a part (model, optimizer, extra) the step was saved
without (`checkpoint.save_contents`), found from each role's `.metadata` (saved_parts).

The participants declared to the coordinator (a rollout worker, a replay buffer) are
checked the same way (check_participants_fit): a step holding a participant the run does
not declare, or with another count of one, is refused in one line (its state would be lost,
or is per index and cannot be re-split); a participant the step does not hold is allowed
(it starts empty: its load raises CommitRecordError naming it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from verl_ckpt.protocol.errors import CheckpointError, CommitRecordError, UnsafeCheckpointError
from verl_ckpt.store.commit_record import CommitRecord, read_commit_record

__all__ = [
    "EXTRA_STATE_KEY",
    "check_participants_fit",
    "check_resume_fits",
    "extra_reshard_error",
    "missing_role_error",
    "saved_parts",
]

# The megatron-core key of each rank's extra state (a ShardedObject per rank).
EXTRA_STATE_KEY = "verl_ckpt.extra_state"
# The optimizer's keys (megatron-core's optimizers name theirs so); every other key that is
# not extra state is the model's.
OPTIMIZER_KEY_PREFIX = "optimizer."


def missing_role_error(path: Path, role: str, record: CommitRecord) -> CommitRecordError:
    return CommitRecordError(
        f"{path} holds no state of role {role!r} (roles: {sorted(record.participants)})"
    )


def extra_reshard_error(path: Path, role: str, saved: int, loading: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: role {role} was saved with {saved} ranks, loading with {loading}; per-rank "
        "extra state cannot be resharded (drop 'extra' from checkpoint.load_contents to load "
        f"model and optimizer only, or load with {saved} ranks)"
    )


def check_resume_fits(
    path: Path,
    roles: Mapping[str, int],
    load_contents: Iterable[str],
    participants: Mapping[str, int] | None = None,
) -> None:
    """Raise what `load()` would raise in the ranks of `roles` (role -> ranks) loading the
    committed step `path` with `load_contents`: a role the step does not hold, or a role
    whose rank count changed while it saved extra state that `load_contents` asks for.
    With `participants` (the declared ones, name -> count), check_participants_fit too."""
    record = read_commit_record(path)
    if participants is not None:
        _check_participants(path, record, participants)
    wanted = set(load_contents)
    for role, ranks in roles.items():
        saved = record.role_world_size(role)
        if saved is None:
            raise missing_role_error(path, role, record)
        held = saved_parts(path / role)
        # A damaged `.metadata` names no part: the ranks' load fails on it, naming the file.
        missing = sorted(wanted - held) if held else []
        if missing:
            raise CheckpointError(
                f"{path}: role {role} holds no {' or '.join(missing)} (the step was saved "
                f"without it: checkpoint.save_contents); load what it holds with "
                f"checkpoint.load_contents=[{','.join(sorted(wanted & held))}]"
            )
        if saved != ranks and "extra" in wanted:
            # The parts read above answer it; only a `.metadata` that named none is read
            # again, to be refused naming the file (_holds_extra_state).
            holds_extra = ("extra" in held) if held else _holds_extra_state(path / role)
            if holds_extra:
                raise extra_reshard_error(path, role, saved, ranks)


def check_participants_fit(path: Path, participants: Mapping[str, int]) -> None:
    """Raise CheckpointError, one line, unless a run declaring `participants` (name ->
    count) can resume from the committed step `path` (module docstring)."""
    _check_participants(path, read_commit_record(path), participants)


def _check_participants(path: Path, record: CommitRecord, participants: Mapping[str, int]) -> None:
    saved = record.state_participants
    dropped = sorted(set(saved) - set(participants))
    if dropped:
        held = ", ".join(f"{name} x{saved[name]}" for name in dropped)
        raise CheckpointError(
            f"{path} holds the state of participants {held} that this run does not declare: "
            "resuming would lose it (declare them: CheckpointCoordinator(participants=...))"
        )
    for name, count in sorted(participants.items()):
        if name in saved and saved[name] != count:
            raise CheckpointError(
                f"{path}: participant {name} was saved by {saved[name]}, this run declares "
                f"{count}; a participant's state is per index and cannot be re-split"
            )


def saved_parts(role_dir: Path) -> set[str]:
    """The parts of `checkpoint.load_contents` (model, optimizer, extra) whose keys the
    role's `.metadata` holds; none for a `.metadata` that is missing or damaged (the ranks'
    load then fails on it, naming the file). One that asks for more than DCP's metadata
    classes is refused (UnsafeCheckpointError, naming it)."""
    # Imported here: the restricted unpickler, only where a start reads a `.metadata`.
    from verl_ckpt.format.safe_load import load_dcp_metadata

    try:
        keys = load_dcp_metadata(role_dir / ".metadata").state_dict_metadata
    except UnsafeCheckpointError:
        raise
    except (CheckpointError, OSError):
        return set()
    parts = set()
    for key in keys:
        # megatron-core names each rank's object "<key>/shard_<rank>_<ranks>".
        if key.startswith(EXTRA_STATE_KEY + "/"):
            parts.add("extra")
        elif key.startswith(OPTIMIZER_KEY_PREFIX):
            parts.add("optimizer")
        else:
            parts.add("model")
    return parts


def _holds_extra_state(role_dir: Path) -> bool:
    # As saved_parts, for a role whose rank count changed: a damaged `.metadata` is refused
    # here, naming the file, since the extra state it may hold cannot be loaded anyway.
    from verl_ckpt.format.safe_load import load_dcp_metadata

    path = role_dir / ".metadata"
    try:
        keys = load_dcp_metadata(path).state_dict_metadata
    except UnsafeCheckpointError:
        raise  # names the file and what it asked for
    except CheckpointError as exc:  # damaged: the message names the file
        raise CommitRecordError(str(exc)) from None
    except OSError as exc:
        raise CommitRecordError(f"{path} is unreadable: {type(exc).__name__}: {exc}") from None
    # megatron-core names each rank's object "<key>/shard_<rank>_<ranks>".
    return any(key.startswith(EXTRA_STATE_KEY + "/") for key in keys)
