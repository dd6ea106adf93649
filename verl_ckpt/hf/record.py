"""The export record: written last into a Hugging Face export, it lists every file of it with
size and checksum. An export directory is published (renamed into place) only with its record
inside, so `<role>/huggingface/` is either absent or complete; `verl-ckpt verify` re-reads it.

Torch-free: `verl-ckpt verify` imports it.

Protocol step E (export), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from verl_ckpt.protocol.errors import CommitRecordError
from verl_ckpt.protocol.versioned_json import parse_versioned_json
from verl_ckpt.store.commit_record import FileEntry
from verl_ckpt.store.fsio import (
    CHECKSUM_ALGORITHM,
    FileTooLarge,
    atomic_write_bytes,
    file_checksum,
    read_regular,
)
from verl_ckpt.store.layout import checked_relative_path
from verl_ckpt.store.signing import Keyring, check_signed

__all__ = [
    "EXPORT_DIRNAME",
    "EXPORT_FORMAT_VERSION",
    "EXPORT_RECORD_FILENAME",
    "EXPORT_RECORD_MAX_BYTES",
    "ExportRecord",
    "describe_context_length",
    "export_dir",
    "read_export_record",
    "sign_export_record",
    "verify_export",
    "write_export_record",
]

EXPORT_DIRNAME = "huggingface"
EXPORT_RECORD_FILENAME = "verl_ckpt_export.json"
EXPORT_FORMAT_VERSION = 1
# An export lists a few dozen files: a larger record is refused unread.
EXPORT_RECORD_MAX_BYTES = 4 << 20


@dataclass
class ExportRecord:
    """What an export holds and where it came from."""

    step: int
    role: str
    architecture: str
    files: list[FileEntry]
    # Positions the model was built for (the model description's max_sequence_length;
    # config.json's n_positions for GPT-2): generating past it fails. None: an older record.
    context_length: int | None = None
    # The save it came from: the sha256 of the step's commit record (record_digest). Another
    # save of the same step number (another run, a rollback then more training) is another
    # export. None: an older record, never taken for any save's export.
    source_record_sha256: str | None = None
    format_version: int = EXPORT_FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    exported_at: float = field(default_factory=time.time)
    # With checkpoint.signing: as a commit record's (store/signing.py), over the rest of the
    # record, the source's digest included; readers given a keyring refuse an export without.
    signature: dict[str, str] | None = None


def describe_context_length(positions: int | None) -> str:
    """An export's context length as log lines say it."""
    if positions is None:
        return "context length unknown"
    return f"context length {positions} tokens (n_positions; generating past it fails)"


def export_dir(step_path: Path, role: str) -> Path:
    """Where the export of `role` lives inside a committed step."""
    return Path(step_path) / role / EXPORT_DIRNAME


def _record_object(record: ExportRecord) -> dict[str, Any]:
    """The record as the JSON object its file holds (what a signature covers; the signature
    field itself is left out of what it covers, store/signing.canonical_payload)."""
    return json.loads(json.dumps(asdict(record)))


def sign_export_record(record: ExportRecord, keyring: Keyring | None) -> ExportRecord:
    """`record` signed by the keyring's first key; itself without one."""
    if keyring is None:
        return record
    unsigned = replace(record, signature=None)
    return replace(record, signature=keyring.sign(_record_object(unsigned)))


def write_export_record(directory: Path, record: ExportRecord) -> None:
    raw = asdict(record)
    if raw["signature"] is None:
        # Unsigned, as before signing: a verl_ckpt of then still reads the record.
        del raw["signature"]
    payload = json.dumps(raw, indent=1, sort_keys=True).encode()
    atomic_write_bytes(directory / EXPORT_RECORD_FILENAME, payload)


def read_export_record(directory: Path, keyring: Keyring | None = None) -> ExportRecord:
    """The record of the export in `directory`; CommitRecordError naming the file, and
    SignatureError (one line, no key or MAC) when `keyring` is given and the record is
    unsigned or signed with a key it does not hold: anyone who can write the root can write
    an export and a record whose sizes and checksums match it."""
    path = Path(directory) / EXPORT_RECORD_FILENAME
    try:
        # Bounded, and a regular file only (never a FIFO or a device planted in its place).
        data = read_regular(path, EXPORT_RECORD_MAX_BYTES)
    except FileTooLarge:
        raise CommitRecordError(
            f"export record {path} is larger than {EXPORT_RECORD_MAX_BYTES} bytes; not read"
        ) from None
    except OSError as exc:
        raise CommitRecordError(f"export record {path} is unreadable: {exc}") from None
    if data is None:
        raise CommitRecordError(
            f"{path} is missing: {directory} is not a complete Hugging Face export "
            "(run `verl-ckpt export` again)"
        )
    raw = parse_versioned_json(
        data, f"export record {path}", EXPORT_FORMAT_VERSION, CommitRecordError
    )
    if keyring is not None:
        check_signed(
            raw,
            keyring,
            f"export {directory} is refused: its record {EXPORT_RECORD_FILENAME}",
            "none of its files was read",
        )
    try:
        files = [FileEntry(**entry) for entry in raw.pop("files")]
        record = ExportRecord(files=files, **raw)
    except (TypeError, KeyError, AttributeError) as exc:
        raise CommitRecordError(f"export record {path} is malformed: {exc}") from None
    _check_names(record, path)
    return record


def _check_names(record: ExportRecord, path: Path) -> None:
    """Every file the record names stays below the export directory, and prints safely: a
    record is data from a disk, and verify hashes what it names."""
    for entry in record.files:
        if not isinstance(entry, FileEntry) or not isinstance(entry.size, int):
            raise CommitRecordError(f"export record {path} is malformed: file entry {entry!r}")
        checked_relative_path(
            entry.path,
            f"export record {path} is malformed: a file path leaves the export directory or is "
            "unsafe",
            CommitRecordError,
        )
    checked_relative_path(
        record.role, f"export record {path} is malformed: the role name", CommitRecordError
    )
    if not isinstance(record.source_record_sha256, str | None):
        raise CommitRecordError(f"export record {path} is malformed: source_record_sha256")


def verify_export(
    directory: Path, keyring: Keyring | None = None, source: str | None = None
) -> tuple[ExportRecord | None, list[str]]:
    """Re-read every file the export record lists: (the record, the problems found). With
    `keyring`, the record must be signed (read_export_record); with `source` (the
    record_digest of the step's commit record), it must name that very save of the step."""
    try:
        record = read_export_record(directory, keyring)
    except CommitRecordError as exc:
        return None, [str(exc)]
    if source is not None and record.source_record_sha256 != source:
        return record, [
            f"export {directory} was not made from this save of step {record.step}: its "
            "record names another commit record (or none)"
        ]
    problems = []
    for entry in record.files:
        path = Path(directory) / entry.path
        try:
            size, checksum = file_checksum(path, record.checksum_algorithm)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: unreadable: {exc}")
            continue
        if size != entry.size:
            problems.append(f"{path}: size {size}, expected {entry.size}")
        elif checksum != entry.checksum:
            problems.append(f"{path}: checksum {checksum}, expected {entry.checksum}")
    return record, problems
