"""Secrets out of everything the project shows: the one redaction of settings.

`checkpoint.remote.storage_options` carries credentials (s3fs: key, secret, token; a
client's session token, a password). None of it may appear in an error, `describe()` of the
finalizer (any job can call it on the named actor), a log line, the lock file, a record or
a config dump. Whatever shows settings passes them through `redacted` first; whatever must
tell two settings apart without showing them compares `settings_digest`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "REDACTED",
    "has_password",
    "password_url_key",
    "redacted",
    "settings_digest",
    "without_password",
]

REDACTED = "<redacted>"
# Under storage_options every value is redacted but these: where the store is, never who.
_SHOWN_OPTIONS = frozenset({"endpoint_url", "region", "region_name"})
# Elsewhere, a key containing one of these words holds a secret.
_SECRET_WORDS = (
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "auth",
    "signature",
    "private",
    "session",
)


def _secret_key(key: object) -> bool:
    name = str(key).lower()
    return any(word in name for word in _SECRET_WORDS)


def has_password(url: str) -> bool:
    """Whether `url` carries a password in its user information (`ftp://user:pw@host`),
    which fsspec would use and every message naming the URL would show."""
    if "://" not in url or "@" not in url:
        return False
    try:
        return urlsplit(url).password is not None
    except ValueError:  # a malformed port or netloc: not ours to judge here
        return False


def password_url_key(value: Any, key: str = "") -> str | None:
    """The dotted key of the first URL with a password in `value` (mappings and lists, as
    settings are; e.g. storage_options' `client_kwargs.endpoint_url`), or None."""
    if isinstance(value, str):
        return key if has_password(value) else None
    items = value.items() if isinstance(value, Mapping) else None
    if items is None and isinstance(value, (list, tuple)):
        items = enumerate(value)
    for name, item in items or ():
        found = password_url_key(item, f"{key}.{name}" if key else str(name))
        if found is not None:
            return found
    return None


def without_password(url: str) -> str:
    """`url` with the user information of a URL that has a password replaced by REDACTED."""
    if not has_password(url):
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{parts.netloc.rpartition('@')[2]}"))


def redacted(value: Any, under_options: bool = False) -> Any:
    """A copy of `value` (mappings, lists and scalars, as settings are) whose keys are all
    kept and whose secrets are replaced by REDACTED: the values of secret-looking keys
    (key, secret, token, password...), and every value under a `storage_options` key but
    endpoint_url and region. `under_options`: `value` is itself storage_options."""
    if isinstance(value, Mapping):
        shown = {}
        for key, item in value.items():
            if under_options and key in _SHOWN_OPTIONS and not isinstance(item, Mapping):
                shown[key] = without_password(item) if isinstance(item, str) else item
            elif key == "storage_options":
                shown[key] = redacted(item, under_options=True)
            elif _secret_key(key) and item is not None and not isinstance(item, Mapping):
                shown[key] = REDACTED
            else:
                shown[key] = redacted(item, under_options)
        return shown
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(item, under_options) for item in value)
    if under_options and value is not None:
        return REDACTED
    if isinstance(value, str):
        return without_password(value)  # a URL's password, wherever it is
    return value


def settings_digest(value: Any) -> str:
    """A digest that tells two settings apart without showing them (secrets included)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
