"""Which `Store` a path or a URL names (store/base.py)."""

from __future__ import annotations

import os
from typing import Any

from verl_ckpt.protocol.errors import CheckpointConfigError
from verl_ckpt.protocol.redaction import has_password, password_url_key, without_password
from verl_ckpt.store.base import Store
from verl_ckpt.store.local import LocalStore

__all__ = ["Where", "as_store", "is_remote_url", "open_store"]

# What the functions written over the seam accept: a Store, or a local directory's path.
Where = Store | str | os.PathLike


def is_remote_url(text: str) -> bool:
    """Whether a ROOT argument is a URL (an fsspec store) rather than a local directory."""
    return "://" in text


def open_store(
    path_or_url: str | os.PathLike,
    storage_options: dict[str, Any] | None = None,
    call_timeout_s: float | None = None,
    setting: str = "checkpoint.remote.url",
) -> Store:
    """A LocalStore for a path, an FsspecStore for a URL (`storage_options` and, for each
    of its calls, the deadline `call_timeout_s`: see fsspec_store.py; `setting` names
    where the URL came from in its errors)."""
    text = os.fspath(path_or_url)
    if not is_remote_url(text):
        return LocalStore(text)
    option = password_url_key(storage_options or {})
    if has_password(text) or option is not None:
        # Refused, not used: a URL is named by messages about the store.
        where = without_password(text) if option is None else f"storage option {option}"
        raise CheckpointConfigError(
            f"{where}: a URL that holds a password (user:password@); give credentials as "
            "storage options or in the environment, never in a URL"
        )
    # Imported here: fsspec (and s3fs) only where a URL is used.
    from verl_ckpt.store.fsspec_store import FsspecStore

    return FsspecStore(text, storage_options, call_timeout_s=call_timeout_s, setting=setting)


def as_store(where: Where) -> Store:
    """`where` itself when it is a Store, else the local directory it names."""
    return where if isinstance(where, Store) else LocalStore(where)
