"""Signed commit records: a keyed MAC (HMAC-SHA256) over each commit record (docs/signing.md).

Whoever can write a checkpoint root or a bucket can write a commit record too: its sizes and
checksums prove nothing against tampering. With `checkpoint.signing` configured, the
finalizer signs every record it writes (protocol step 5; the remote tier's record, step 9,
is the same bytes), and every reader that trusts a step (start-up's roll-forward, the
resume decision, a download from the remote tier, `verl-ckpt verify`/`ls`/`rollback`)
checks the record before it reads any other file of the step (commit_record.py).

What is signed: the record's JSON object without its `signature` field, serialised
canonically (`json.dumps(sort_keys=True, separators=(",", ":"))`). The signature is
{"alg": "hmac-sha256", "key_id": the first 8 hex digits of sha256(key), "mac": hex}. The key
id is not secret (a digest); the key and the MAC never appear in a message, a log line or
`repr` (Keyring's repr shows key ids only).

Rotation: the first key of a Keyring signs, every key of it verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from verl_ckpt.protocol.config import SigningConfig
from verl_ckpt.protocol.errors import CheckpointConfigError, SignatureError

__all__ = [
    "SIGNATURE_ALGORITHM",
    "SIGNATURE_FIELD",
    "Keyring",
    "canonical_payload",
    "check_signed",
    "key_id",
    "keyring_from",
    "load_keyring",
    "signature_problem",
]

SIGNATURE_ALGORITHM = "hmac-sha256"
SIGNATURE_FIELD = "signature"
# A key file is a few bytes; a larger one is a wrong path (a checkpoint, a device).
_MAX_KEY_FILE_BYTES = 1 << 16


def key_id(key: bytes) -> str:
    """The name of a key in records and messages: not secret (a digest's first 8 hex)."""
    return hashlib.sha256(key).hexdigest()[:8]


def canonical_payload(raw: Mapping[str, Any]) -> bytes:
    """The bytes the MAC covers: the record's object without its signature, canonically."""
    body = {k: v for k, v in raw.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


class Keyring:
    """The keys of a run: the first signs, every one verifies. Its repr names key ids only,
    so it may be passed to an actor or logged without giving a key away."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        unique = list(dict.fromkeys(bytes(k) for k in keys))
        if not unique or not all(unique):
            raise ValueError("a keyring needs at least one non-empty key")
        self._keys = tuple(unique)

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(key_id(k) for k in self._keys)

    def sign(self, raw: Mapping[str, Any]) -> dict[str, str]:
        """The signature field of the record object `raw` (by the first key)."""
        key = self._keys[0]
        mac = hmac.new(key, canonical_payload(raw), hashlib.sha256).hexdigest()
        return {"alg": SIGNATURE_ALGORITHM, "key_id": key_id(key), "mac": mac}

    def verifies(self, raw: Mapping[str, Any], mac: str) -> bool:
        """Whether `mac` is the MAC of `raw` under one of the accepted keys."""
        payload = canonical_payload(raw)
        return any(
            hmac.compare_digest(hmac.new(k, payload, hashlib.sha256).hexdigest(), mac)
            for k in self._keys
        )

    def __repr__(self) -> str:
        return f"Keyring(key_ids={list(self.key_ids)})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keyring) and self.key_ids == other.key_ids

    def __hash__(self) -> int:
        return hash(self.key_ids)


def signature_problem(raw: Mapping[str, Any], keyring: Keyring) -> str | None:
    """Why the record object `raw` is not trusted under `keyring` ("unsigned", "signed with
    another key ..."), in words without any MAC or key; None when it verifies."""
    signature = raw.get(SIGNATURE_FIELD)
    if signature is None:
        return "unsigned"
    if not isinstance(signature, Mapping) or not isinstance(signature.get("mac"), str):
        return "unsigned (its signature field is malformed)"
    if signature.get("alg") != SIGNATURE_ALGORITHM:
        return f"unsigned (signature algorithm {str(signature.get('alg'))[:20]!r} is not accepted)"
    if keyring.verifies(raw, signature["mac"]):
        return None
    claimed = str(signature.get("key_id"))[:16]
    if claimed in keyring.key_ids:
        # The key id is only a hint: an accepted id with a MAC that does not verify is a
        # record changed after it was signed (or a forged id).
        return f"signed with another key (its MAC does not verify under key id {claimed})"
    return f"signed with another key (key id {claimed!r}, not accepted)"


def check_signed(raw: Mapping[str, Any], keyring: Keyring, refused: str, unread: str) -> None:
    """Raise SignatureError unless `raw` verifies under `keyring`, in one line: "`refused`
    is <the problem>, and checkpoint.signing accepts only key ids ...; `unread`" (`refused`
    names the thing and its record, `unread` says what was not read). Never a key or a MAC."""
    problem = signature_problem(raw, keyring)
    if problem is not None:
        error = SignatureError(
            f"{refused} is {problem}, and checkpoint.signing accepts only key ids "
            f"{', '.join(keyring.key_ids)}; {unread}"
        )
        error.reason = problem
        raise error


def load_keyring(config: SigningConfig, key: str = "checkpoint.signing") -> Keyring | None:
    """The keys `config` names, read now (before Ray starts); None when signing is off.

    A missing, unreadable or empty key file, or an unset or empty variable, is one
    CheckpointConfigError naming the key and the path or variable, never a key's bytes.
    `key` is how the configuration is named in errors (the CLI passes its flags' names)."""
    if not config.enabled:
        return None
    keys = []
    if config.key_file is not None:
        keys.append(_read_key_file(config.key_file, f"{key}.key_file"))
    if config.key_env is not None:
        keys.append(_read_key_env(config.key_env, f"{key}.key_env"))
    keys += [_read_key_file(p, f"{key}.accepted_key_files") for p in config.accepted_key_files]
    keys += [_read_key_env(n, f"{key}.accepted_key_envs") for n in config.accepted_key_envs]
    return Keyring(keys)


def keyring_from(
    key_files: Sequence[str], key_envs: Sequence[str], file_name: str, env_name: str
) -> Keyring | None:
    """The keys of key files and environment variables (the CLI's flags, named in errors by
    `file_name` and `env_name`), files first; None when none is given."""
    keys = [_read_key_file(p, file_name) for p in key_files]
    keys += [_read_key_env(n, env_name) for n in key_envs]
    return Keyring(keys) if keys else None


def _read_key_file(path: str, name: str) -> bytes:
    try:
        with open(os.path.expanduser(path), "rb") as stream:
            data = stream.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise CheckpointConfigError(
            f"{name}={path!r}: the key file cannot be read: {exc.strerror or type(exc).__name__}"
        ) from None
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise CheckpointConfigError(
            f"{name}={path!r}: the key file is larger than {_MAX_KEY_FILE_BYTES} bytes"
        )
    key = data.strip()
    if not key:
        raise CheckpointConfigError(f"{name}={path!r}: the key file is empty")
    return key


def _read_key_env(variable: str, name: str) -> bytes:
    key = os.environb.get(os.fsencode(variable), b"").strip()
    if not key:
        raise CheckpointConfigError(
            f"{name}={variable!r}: the environment variable ${variable} is not set or empty"
        )
    return key
