"""The commit record: the one file whose presence makes a step committed (invariant I1).

It is written by the finalizer after every participant's files and each role's metadata are
durable, and removed first when a step is deleted, so a step without it is never loadable.
The same functions read and write it on every store (store/base.py): protocol steps 5 and 9.

Where a step is: a Store and a step number, or a local step directory's path alone (the
record of `<path>/verl_ckpt_commit.json`, whatever the directory's name), or a local root's
path and a step number.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from pathlib import Path

from verl_ckpt.protocol.errors import CheckpointError, CommitRecordError
from verl_ckpt.protocol.messages import FileEntry
from verl_ckpt.protocol.versioned_json import parse_versioned_json
from verl_ckpt.store.base import Store
from verl_ckpt.store.fsio import CHECKSUM_ALGORITHM, SUPPORTED_CHECKSUMS, FileTooLarge
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    checked_relative_path,
    step_name,
    step_number_problem,
    step_of_dir,
)
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.open_store import Where, as_store
from verl_ckpt.store.record_cache import VerifiedRecords
from verl_ckpt.store.signing import SIGNATURE_FIELD, Keyring, check_signed

__all__ = [
    "COMMIT_FORMAT_VERSION",
    "COMMIT_RECORD_MAX_BYTES",
    "CommitRecord",
    "FileEntry",
    "StepStates",
    "check_record_signature",
    "committed_steps",
    "encode_commit_record",
    "find_commit_record",
    "is_committed",
    "locate_step",
    "newest_committed",
    "parse_commit_record",
    "read_commit_record",
    "read_commit_record_and_digest",
    "read_record_bytes",
    "read_step_states",
    "record_digest",
    "record_object",
    "sign_record",
    "write_commit_record",
]

logger = logging.getLogger(__name__)

COMMIT_FORMAT_VERSION = 1
# A record is read only up to this: about 100 bytes per file, so room for 600,000 files
# (4096 ranks of two roles with dozens of files each); a huge planted file is refused unread.
COMMIT_RECORD_MAX_BYTES = 64 << 20


@dataclass
class CommitRecord:
    """What a committed step holds: who took part and every file with its size and checksum.

    `participants`: the Megatron roles (a torch_dist directory each) and the driver, by
    number of ranks. `state_participants`: the participants that declared themselves to the
    coordinator (a rollout worker, a replay buffer), by count; each index's state is
    `<name>/state_<index>.pt` (layout.participant_state_file). Written only when there are
    some, so that a record without them reads as before.
    """

    step: int
    participants: dict[str, int]
    files: list[FileEntry]
    format_version: int = COMMIT_FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    committed_at: float = field(default_factory=time.time)
    # With checkpoint.signing: {"alg", "key_id", "mac"} over the rest (store/signing.py).
    signature: dict[str, str] | None = None
    state_participants: dict[str, int] = field(default_factory=dict)

    def role_world_size(self, role: str) -> int | None:
        return self.participants.get(role)


def locate_step(where: Where, step: int | None = None) -> tuple[Store, str]:
    """The store and the step directory's relative path (module docstring)."""
    if step is not None:
        return as_store(where), step_name(step)
    if isinstance(where, Store):
        raise TypeError("a step number is needed with a Store")
    path = Path(where)
    return LocalStore(path.parent), path.name


def write_commit_record(where: Where, record: CommitRecord) -> None:
    """Durably write the record (store.put_bytes: atomic): once this returns, the step is
    committed. `where`: a local step directory, or a Store (the record's own step)."""
    store, rel = locate_step(where, record.step if isinstance(where, Store) else None)
    store.put_bytes(f"{rel}/{COMMIT_RECORD_FILENAME}", encode_commit_record(record))


_ENTRY = '{"path": %s, "size": %d, "checksum": %s}'


def encode_commit_record(record: CommitRecord) -> bytes:
    """The record's bytes, as written."""
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
    if record.signature is not None:
        head[SIGNATURE_FIELD] = dict(record.signature)
    if record.state_participants:
        head["state_participants"] = dict(sorted(record.state_participants.items()))
    files = ",\n ".join(
        _ENTRY % (encode_basestring_ascii(f.path), f.size, encode_basestring_ascii(f.checksum))
        for f in record.files
    )
    body = json.dumps(head, indent=1)[:-2]  # without the closing "\n}"
    return f'{body},\n "files": [\n {files}\n ]\n}}\n'.encode()


def record_digest(data: bytes) -> str:
    """The hash that names one save of a step (its commit record's bytes): a rollback keeps
    it of each step it moves out, an export of the step it came from."""
    return hashlib.sha256(data).hexdigest()


def read_record_bytes(where: Where, step: int | None = None) -> bytes | None:
    """The bytes of the step's commit record, None when it has none. CommitRecordError
    naming it when it cannot be read (a directory in its place, EIO, a permission)."""
    store, rel = locate_step(where, step)
    return _read_bytes(store, rel)


def _read_bytes(store: Store, rel: str) -> bytes | None:
    name = f"{rel}/{COMMIT_RECORD_FILENAME}"
    try:
        return store.read_bytes(name, COMMIT_RECORD_MAX_BYTES)
    except CheckpointError:
        raise  # a store call past its deadline (CommitTimeoutError): it says so itself
    except FileTooLarge:
        raise CommitRecordError(
            f"{store.uri(name)} is larger than {COMMIT_RECORD_MAX_BYTES} bytes; not read"
        ) from None
    except OSError as exc:
        raise CommitRecordError(
            f"{store.uri(name)} cannot be read: {exc.strerror or exc}"
        ) from None


def find_commit_record(
    where: Where, step: int | None = None, keyring: Keyring | None = None
) -> CommitRecord | None:
    """The step's validated commit record, or None when it has none (not committed).
    CommitRecordError naming it when it is there but does not read; SignatureError when
    `keyring` is given and the record is not signed by one of its keys."""
    store, rel = locate_step(where, step)
    data = _read_bytes(store, rel)
    return None if data is None else _parse_trusted(data, store, rel, keyring)


def read_commit_record(
    where: Where, step: int | None = None, keyring: Keyring | None = None
) -> CommitRecord:
    """Read and validate the step's commit record.

    Raises CommitRecordError naming the path when the record is missing, unparsable, or of
    a format version this code does not know; SignatureError when `keyring` is given and
    the record is unsigned or signed with a key it does not hold.
    """
    return read_commit_record_and_digest(where, step, keyring)[0]


def read_commit_record_and_digest(
    where: Where, step: int | None = None, keyring: Keyring | None = None
) -> tuple[CommitRecord, str]:
    """read_commit_record, and the record_digest of the very bytes it checked and parsed
    (what names this save of the step: one read, so the two cannot be of different saves)."""
    store, rel = locate_step(where, step)
    data = _read_bytes(store, rel)
    if data is None:
        if not store.exists(rel):
            raise CommitRecordError(f"step directory {store.uri(rel)} does not exist")
        raise CommitRecordError(
            f"{store.uri(rel)} is not a committed step: its commit record "
            f"{COMMIT_RECORD_FILENAME} is missing (the save did not finish on every rank, or "
            "the step is being deleted)"
        )
    return _parse_trusted(data, store, rel, keyring), record_digest(data)


def _record_uri(store: Store, rel: str) -> str:
    return store.uri(rel, COMMIT_RECORD_FILENAME)


def _parse_trusted(data: bytes, store: Store, rel: str, keyring: Keyring | None) -> CommitRecord:
    """The record's signature checked first (with a keyring), then the record parsed, then
    its step against its directory's: a record, signed or not, copied with its files to
    another step number is not that step (rolled forward to, counted by retention)."""
    check_record_signature(data, keyring, store.uri(rel))
    record = parse_commit_record(data, _record_uri(store, rel))
    directory_step = step_of_dir(rel)
    if directory_step is not None and record.step != directory_step:
        raise CommitRecordError(
            f"{_record_uri(store, rel)} names step {record.step}, not {directory_step} "
            "(a record copied from another step?)"
        )
    return record


def record_object(record: CommitRecord) -> dict:
    """The record as the JSON object its bytes hold (what a signature covers)."""
    return json.loads(encode_commit_record(record))


def sign_record(record: CommitRecord, keyring: Keyring | None) -> CommitRecord:
    """`record` signed by the keyring's first key (store/signing.py); itself without one."""
    if keyring is None:
        return record
    unsigned = dataclasses.replace(record, signature=None)
    return dataclasses.replace(record, signature=keyring.sign(record_object(unsigned)))


def check_record_signature(data: bytes, keyring: Keyring | None, step_uri: str) -> None:
    """With a keyring, raise SignatureError unless the record bytes `data` of the step at
    `step_uri` are signed by one of its keys: one line naming the step, "unsigned" or
    "signed with another key", never a key or a MAC. Bytes that are no JSON object pass
    here: parsing them says what is wrong. Nothing else of the step is read first."""
    if keyring is None:
        return
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json's stack
        return
    if not isinstance(raw, dict):
        return
    check_signed(
        raw,
        keyring,
        f"step {step_uri} is refused: its commit record {COMMIT_RECORD_FILENAME}",
        "none of its other files was read",
    )


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
    _check_names(record, path)
    return record


def _check_names(record: CommitRecord, path: str | Path) -> None:
    """Every name the record gives (its files, its roles) stays below the step directory and
    prints safely: a record is data from a disk or a bucket, and its names become file
    operations (verify, pull, upload, retention, inspect's reads of a role's metadata)."""
    for role in (*record.participants, *record.state_participants):
        checked_relative_path(
            role, f"commit record {path} is malformed: a role name is unsafe", CommitRecordError
        )
    for entry in record.files:
        checked_relative_path(
            entry.path,
            f"commit record {path} is malformed: a file path leaves the step directory or is "
            "unsafe",
            CommitRecordError,
        )


def _is_int(value: object) -> bool:
    """An integer, and not a bool (JSON true/false are bools, which are ints in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problem(record: CommitRecord) -> str | None:
    """What is wrong with the field types of a parsed record, if anything."""
    problem = step_number_problem(record.step)
    if problem is not None:
        return problem
    for name, table in (
        ("participants", record.participants),
        ("state_participants", record.state_participants),
    ):
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 1 for k, v in table.items()
        ):
            return f"{name} {table!r} is not a mapping of name to count"
    if sum(record.state_participants.values()) > len(record.files):
        # Each declared participant index has its one state file: a larger count is not a
        # record verl_ckpt wrote, and verify/inspect would walk every index of it.
        return f"state_participants {record.state_participants!r} count more files than listed"
    overlap = set(record.participants) & set(record.state_participants)
    if overlap:
        return f"{sorted(overlap)} are both roles and state participants"
    if record.checksum_algorithm not in SUPPORTED_CHECKSUMS:
        return f"unknown checksum algorithm {record.checksum_algorithm!r}"
    if not isinstance(record.committed_at, (int, float)):
        return f"committed_at {record.committed_at!r} is not a timestamp"
    if record.signature is not None and not isinstance(record.signature, dict):
        return "signature is not an object"
    for entry in record.files:
        if not (
            isinstance(entry.path, str)
            and _is_int(entry.size)
            and entry.size >= 0
            and isinstance(entry.checksum, str)
        ):
            return f"file entry {entry!r} is not (path, size, checksum)"
    return None


def is_committed(where: Where, step: int | None = None, keyring: Keyring | None = None) -> bool:
    """Whether the step holds a readable commit record of a known version (signed by one of
    the keyring's keys, with one)."""
    try:
        return find_commit_record(where, step, keyring) is not None
    except CommitRecordError:
        return False


def committed_steps(where: Where, keyring: Keyring | None = None) -> list[int]:
    """Steps of the store (or local root) whose commit record is readable, oldest first. A
    corrupt record (or, with a keyring, one not signed by its keys) does not count: such a
    step is never resumed from, nor counted toward "keep N"."""
    return list(read_step_states(where, keyring).committed)


@dataclass(frozen=True)
class StepStates:
    """Every step of a store by the state of its commit record, oldest first."""

    committed: tuple[int, ...]  # a readable record
    uncommitted: tuple[int, ...]  # no record
    # A record that does not read (or, with a keyring, is not signed by one of its keys):
    # neither counted nor deleted.
    unreadable: tuple[int, ...]


def read_step_states(
    where: Where, keyring: Keyring | None = None, verified: VerifiedRecords | None = None
) -> StepStates:
    """Read every step's commit record (a record that does not read is logged). `verified`:
    a long-lived reader's memory of the records it found valid (store/record_cache.py);
    each record is still read, and parsed again unless its bytes are the ones found valid."""
    if verified is not None and not verified.serves(keyring):
        raise ValueError("verified records remembered under other signing keys")
    store = as_store(where)
    found: dict[str, list[int]] = {"committed": [], "uncommitted": [], "unreadable": []}
    listed = store.list_steps()
    for step in listed:
        rel = store.step_rel(step)
        try:
            data = _read_bytes(store, rel)
            if data is None:
                state = "uncommitted"
            elif verified is not None and verified.knows(rel, data):
                state = "committed"
            else:
                _parse_trusted(data, store, rel, keyring)
                state = "committed"
                if verified is not None:
                    verified.remember(rel, data)
        except CommitRecordError as exc:
            logger.warning("step %d of %s is not counted as committed: %s", step, store.url, exc)
            state = "unreadable"
        found[state].append(step)
    if verified is not None:
        verified.keep_only(store.step_rel(step) for step in listed)
    return StepStates(**{state: tuple(steps) for state, steps in found.items()})


def newest_committed(where: Where, keyring: Keyring | None = None) -> tuple[int, bytes] | None:
    """The newest step whose commit record reads (and, with a keyring, is signed by one of
    its keys): what a resume would load, with the record's bytes; None when there is none.
    Reads records newest first, and stops there."""
    store = as_store(where)
    for step in reversed(store.list_steps()):
        try:
            data = read_record_bytes(store, step)
            if data is None:
                continue
            _parse_trusted(data, store, store.step_rel(step), keyring)
        except CommitRecordError as exc:
            logger.warning("skipping step %d of %s: %s", step, store.url, exc)
            continue
        return step, data
    return None
