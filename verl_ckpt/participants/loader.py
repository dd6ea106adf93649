"""Reading a declared participant's state back from a committed step (protocol page,
"Participants"): the step's commit record first (it must list the participant and its
file), the file's checksum where asked, then the file with weights_only=True
(format/safe_load.py): nothing in a checkpoint is unpickled as code."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from verl_ckpt.format.safe_load import load_state_file
from verl_ckpt.protocol.errors import CommitRecordError
from verl_ckpt.store.commit_record import read_commit_record
from verl_ckpt.store.layout import participant_state_file
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.verification import verify_files

__all__ = ["load_participant_state"]


def load_participant_state(
    step_dir: str | Path,
    name: str,
    index: int,
    verify_checksums: bool = True,
    keyring: Keyring | None = None,
) -> Any:
    """The state participant `name`[`index`] saved in the committed step `step_dir`.

    CommitRecordError, one line, when the step is not committed, does not hold that
    participant, or its file fails verification (size always, checksum with
    `verify_checksums`); with `keyring` (checkpoint.signing), when its commit record is not
    signed with one of its keys (SignatureError)."""
    path = Path(step_dir)
    record = read_commit_record(path, keyring=keyring)
    label = f"{name}[{index}]"
    count = record.state_participants.get(name)
    if count is None or not 0 <= index < count:
        held = ", ".join(f"{n} x{c}" for n, c in sorted(record.state_participants.items()))
        raise CommitRecordError(
            f"{path} holds no state of participant {label} (its participants: {held or 'none'})"
        )
    rel = participant_state_file(name, index)
    entry = next((f for f in record.files if f.path == rel), None)
    if entry is None:
        raise CommitRecordError(f"{path}: the commit record lists no file {rel} for {label}")
    if verify_checksums:
        # Exactly this file: a prefix "rollout/state_1.pt" would take state_10.pt too.
        problems = verify_files(path, replace(record, files=[entry]))
    else:
        size = _size(path / rel)
        problems = [] if size == entry.size else [f"{path / rel}: {size}, not {entry.size} bytes"]
    if problems:
        raise CommitRecordError(f"{path}: the state of {label} failed verification: {problems[0]}")
    return load_state_file(path / rel, map_location="cpu")


def _size(path: Path) -> int | str:
    try:
        return path.stat().st_size
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
