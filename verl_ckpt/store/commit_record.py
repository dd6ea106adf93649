"""The commit record: the one file whose presence makes a step committed (invariant I1).

It is written by the finalizer after every participant's files and each role's metadata are
durable, and removed first when a step is deleted, so a step without it is never loadable.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from pathlib import Path, PurePosixPath

from verl_ckpt.protocol.errors import CommitRecordError
from verl_ckpt.protocol.messages import FileEntry
from verl_ckpt.protocol.versioned_json import parse_versioned_json
from verl_ckpt.store.fsio import (
    CHECKSUM_ALGORITHM,
    SUPPORTED_CHECKSUMS,
    atomic_write_bytes,
)
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, list_step_dirs

__all__ = [
    "COMMIT_FORMAT_VERSION",
    "CommitRecord",
    "FileEntry",
    "committed_steps",
    "is_committed",
    "parse_commit_record",
    "read_commit_record",
    "write_commit_record",
]

COMMIT_FORMAT_VERSION = 1


@dataclass
class CommitRecord:
    """What a committed step holds: who took part and every file with its size and checksum."""

    step: int
    participants: dict[str, int]
    files: list[FileEntry]
    format_version: int = COMMIT_FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    committed_at: float = field(default_factory=time.time)

    def role_world_size(self, role: str) -> int | None:
        return self.participants.get(role)


def write_commit_record(step_path: Path, record: CommitRecord) -> None:
    """Durably write the record: once this returns, the step is committed."""
    atomic_write_bytes(step_path / COMMIT_RECORD_FILENAME, _encode(record))


_ENTRY = '{"path": %s, "size": %d, "checksum": %s}'


def _encode(record: CommitRecord) -> bytes:
    # Built by hand, not with dataclasses.asdict (a recursive deep copy) nor one json.dumps
    # per entry (4x slower): with thousands of ranks the record is on the commit's critical
    # path. Each entry's text is what json.dumps gives for {"path", "size", "checksum"}
    # (json's own string escaping). One file entry per line keeps it readable and diffable.
    head = {
        "format_version": record.format_version,
        "step": record.step,
        "participants": dict(sorted(record.participants.items())),
        "checksum_algorithm": record.checksum_algorithm,
        "committed_at": record.committed_at,
    }
    files = ",\n ".join(
        _ENTRY % (encode_basestring_ascii(f.path), f.size, encode_basestring_ascii(f.checksum))
        for f in record.files
    )
    body = json.dumps(head, indent=1)[:-2]  # without the closing "\n}"
    return f'{body},\n "files": [\n {files}\n ]\n}}\n'.encode()


def read_commit_record(step_path: str | Path) -> CommitRecord:
    """Read and validate the record of the step directory `step_path`.

    Raises CommitRecordError naming the path when the record is missing, unparsable, or of
    a format version this code does not know.
    """
    path = Path(step_path) / COMMIT_RECORD_FILENAME
    if not Path(step_path).is_dir():
        raise CommitRecordError(f"step directory {step_path} does not exist")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CommitRecordError(
            f"{step_path} is not a committed step: its commit record {path.name} is missing "
            "(the save did not finish on every rank, or the step is being deleted)"
        ) from None
    except OSError as exc:  # a directory in its place, EIO, a permission
        raise CommitRecordError(f"{path} cannot be read: {exc.strerror or exc}") from None
    return parse_commit_record(data, path)


def parse_commit_record(data: bytes, path: str | Path) -> CommitRecord:
    """Parse and validate the bytes of a commit record read from `path` (named in errors);
    the remote tier reads its records through this too."""
    raw = parse_versioned_json(
        data, f"commit record {path}", COMMIT_FORMAT_VERSION, CommitRecordError
    )
    try:
        files = [FileEntry(**entry) for entry in raw.pop("files")]
        record = CommitRecord(files=files, **raw)
    except (TypeError, KeyError, AttributeError) as exc:
        raise CommitRecordError(f"commit record {path} is malformed: {exc}") from None
    problem = _type_problem(record)
    if problem:
        raise CommitRecordError(f"commit record {path} is malformed: {problem}")
    return record


def _is_int(value: object) -> bool:
    """An integer, and not a bool (JSON true/false are bools, which are ints in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(record: CommitRecord) -> str | None:
    """What is wrong with the field types of a parsed record, if anything."""
    if not _is_int(record.step) or record.step < 0:
        return f"step {record.step!r} is not a non-negative integer"
    participants = record.participants
    if not isinstance(participants, dict) or not all(
        isinstance(k, str) and _is_int(v) and v >= 1 for k, v in participants.items()
    ):
        return f"participants {participants!r} is not a mapping of role to world size"
    if record.checksum_algorithm not in SUPPORTED_CHECKSUMS:
        return f"unknown checksum algorithm {record.checksum_algorithm!r}"
    if not isinstance(record.committed_at, (int, float)):
        return f"committed_at {record.committed_at!r} is not a timestamp"
    for entry in record.files:
        if not (
            isinstance(entry.path, str)
            and _is_int(entry.size)
            and entry.size >= 0
            and isinstance(entry.checksum, str)
        ):
            return f"file entry {entry!r} is not (path, size, checksum)"
        if not _inside_the_step(entry.path):
            return f"file entry path {entry.path!r} leaves the step directory"
    return None


def _inside_the_step(path: str) -> bool:
    """A relative path of files below the step directory: a record is data from a disk or a
    bucket, and its paths become file operations (verify, pull, upload, retention)."""
    parts = PurePosixPath(path).parts
    return (
        bool(parts) and not path.startswith(("/", "\\")) and ".." not in parts and "\0" not in path
    )


def is_committed(step_path: str | Path) -> bool:
    """Whether `step_path` holds a readable commit record of a known version."""
    try:
        read_commit_record(step_path)
    except CommitRecordError:
        return False
    return True


def committed_steps(root: str | Path) -> list[int]:
    """Steps under `root` whose commit record is readable, oldest first. A corrupt record
    does not count: such a step is never resumed from, nor counted toward "keep N"."""
    return sorted(step for step, path in list_step_dirs(root).items() if is_committed(path))
