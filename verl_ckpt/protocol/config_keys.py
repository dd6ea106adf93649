"""Keys a config schema does not have, each named with the nearest key it does have.

Protocol step 0 (start, verl_ckpt/protocol/__init__.py): a key the schema lacks is refused
before anything starts. OmegaConf alone does not: a key Hydra appended (`+key=...`) is
dropped without a word when the composed config is merged into its dataclass schema, and an
unknown key in a dict is refused in a multi-line block without a suggestion. The schemas are
dataclasses (`CheckpointConfig`, a recipe's own); a field typed as a dict (`storage_options`,
`hf_export.architectures`) takes any key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["build_config", "unknown_keys"]

# How close a known key must be to be offered (difflib's ratio): a sibling of the unknown
# key, else any key of the schema whose last part is closer still (`writer.threads` for
# `threads`).
_SIBLING_CUTOFF = 0.6
_ANYWHERE_CUTOFF = 0.8


def unknown_keys(schema: type, cfg: Any, prefix: str = "") -> list[str]:
    """One sentence per key of `cfg` (a mapping or an OmegaConf node; a dotted key such as a
    command-line override is the mapping {"a": {"b": ...}}) that the dataclass `schema`
    does not have, naming it as `prefix` + its dotted path and the nearest known key."""
    tree = _plain(cfg)
    if not isinstance(tree, Mapping):
        return []
    known = _known_paths(schema)
    return [_sentence(prefix, path, known) for path in _walk(schema, tree, ()) if path is not None]


def _plain(cfg: Any) -> Any:
    """A mapping of plain values; interpolations are left unresolved (a recipe's may need
    Hydra's runtime, which a check before or outside Hydra does not have)."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # a trainer without OmegaConf passes plain dicts
        return cfg
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=False)
    return cfg


def _fields(schema: type) -> dict[str, Any]:
    """Field name -> resolved type (the modules use `from __future__ import annotations`)."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema)}


def _nested_schema(field_type: Any) -> type | None:
    """The dataclass a field holds (None: a plain value, or a dict that takes any key)."""
    return field_type if dataclasses.is_dataclass(field_type) else None


def _walk(schema: type, tree: Mapping, at: tuple[str, ...]):
    """The dotted path (a tuple) of every key of `tree` that `schema` lacks."""
    fields = _fields(schema)
    for key, value in tree.items():
        path = (*at, str(key))
        if key not in fields:
            yield path
            continue
        nested = _nested_schema(fields[key])
        if nested is not None and isinstance(value, Mapping):
            yield from _walk(nested, value, path)


def _known_paths(schema: type, at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, field_type in _fields(schema).items():
        paths.append((*at, name))
        nested = _nested_schema(field_type)
        if nested is not None:
            paths.extend(_known_paths(nested, (*at, name)))
    return paths


def _sentence(prefix: str, path: tuple[str, ...], known: list[tuple[str, ...]]) -> str:
    name = prefix + ".".join(path)
    nearest = _nearest(path, known)
    if nearest is not None:
        return f"unknown key {name} (did you mean {prefix + '.'.join(nearest)}?)"
    siblings = sorted(p[-1] for p in known if p[:-1] == path[:-1])
    return f"unknown key {name} (known here: {', '.join(siblings)})"


def _nearest(path: tuple[str, ...], known: list[tuple[str, ...]]) -> tuple[str, ...] | None:
    """A sibling of `path` whose name is close to its last part, else a key anywhere in the
    schema whose last part is closer still; None when nothing is close."""
    last = path[-1]
    siblings = {p[-1]: p for p in known if p[:-1] == path[:-1]}
    match = difflib.get_close_matches(last, list(siblings), n=1, cutoff=_SIBLING_CUTOFF)
    if match:
        return siblings[match[0]]
    by_last: dict[str, tuple[str, ...]] = {}
    for p in known:
        by_last.setdefault(p[-1], p)  # the first of that name, in the schema's field order
    match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=_ANYWHERE_CUTOFF)
    return by_last[match[0]] if match else None


def build_config(
    schema: type, cfg: Any, error: type[Exception], prefix: str = "", what: str = "config"
) -> Any:
    """The validated dataclass `schema` built from `cfg` (a mapping or an OmegaConf node):
    unknown keys first (before the merge, which would drop a key Hydra appended), each named
    with `prefix` and the nearest known key; then OmegaConf checks the types (its message
    names the full key and the value) and `__post_init__` the values. Every problem is one
    `error` naming the key."""
    unknown = unknown_keys(schema, cfg, prefix)
    if unknown:
        raise error("; ".join(unknown))
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))
    except OmegaConfBaseException as exc:
        raise error(f"invalid {what}: {exc}") from None
