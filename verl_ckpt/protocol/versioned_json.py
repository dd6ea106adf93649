"""JSON files that carry a `format_version`: the commit record, the export record, the model
description and the rollback intent. One parser, so that every reader refuses a bad file the
same way: one line naming the file and what is wrong with it."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["parse_versioned_json"]


def parse_versioned_json(
    data: bytes | str, label: str, version: int, error: type[Exception]
) -> dict[str, Any]:
    """The JSON object in `data`, which must have `format_version == version`; otherwise
    `error` whose message starts with `label` (the kind of file and its path)."""
    try:
        raw = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{label} is corrupt: {exc}") from None
    except RecursionError:  # nested deeper than the parser's stack: never a file we wrote
        raise error(f"{label} is corrupt: nested too deeply") from None
    found = raw.get("format_version") if isinstance(raw, dict) else None
    if found != version:
        raise error(
            f"{label} has format_version {found!r}; this verl_ckpt reads version {version} only"
        )
    return raw
