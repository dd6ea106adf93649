"""Reading the pickles a checkpoint holds without running any code from them (issue 45;
DESIGN.md, "Trust").

A root or a bucket is data that others may write, and a commit record proves nothing about
who wrote a step (anyone can compute its sizes and checksums). So nothing read from a
checkpoint is unpickled with the full unpickler, which calls whatever a pickle names:
- torch files (`driver_state.pt`, each role's `common.pt`, a participant's state) and DCP's
  byte items (a rank's extra state) load with `torch.load(weights_only=True)`: tensors,
  numbers, strings, containers of them, and what torch itself allows;
- DCP's `.metadata` is a plain pickle of DCP's own dataclasses: a restricted unpickler
  admits exactly those classes (and torch's sizes, dtypes and layouts, and the path DCP
  records), and every file it points at must lie in its own directory.
Anything else is refused unread: UnsafeCheckpointError, one line naming the file and what it
asked for. What verl_ckpt saves is checked to load this way when it is saved
(`safe_state_bytes`), so that a refusal never comes first at resume.

torch is imported on first use: the CLI imports this module and only `inspect` needs torch.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import IO, Any

from verl_ckpt.protocol.errors import CheckpointError, UnsafeCheckpointError
from verl_ckpt.store.fsio import open_regular

__all__ = [
    "load_dcp_metadata",
    "load_state_bytes",
    "load_state_file",
    "safe_state_bytes",
]

# What a refusal says a checkpoint file may hold.
_ALLOWED = "tensors, numbers, strings and lists, tuples and dicts of them"


def load_state_file(path: str | os.PathLike, map_location: Any = None) -> Any:
    """The object a `torch.save` file holds, loaded with `weights_only=True`. Raises
    UnsafeCheckpointError (the file asks for more), CheckpointError (damaged) or OSError."""
    # A regular file only, never through a link: a FIFO planted in its place would block.
    with os.fdopen(open_regular(path), "rb") as stream:
        return _load_torch(stream, str(path), map_location)


def load_state_bytes(data: bytes, name: str, map_location: Any = None) -> Any:
    """load_state_file for bytes already read (a DCP byte item); `name` names them in errors."""
    return _load_torch(io.BytesIO(data), name, map_location)


def safe_state_bytes(obj: Any, what: str) -> bytes:
    """`torch.save`'s bytes of `obj`, checked to load back with load_state_bytes; else a
    CheckpointError naming `what` and the object load_state_file would refuse. For state
    that verl_ckpt writes: the mistake shows at save(), not at the resume that needs it."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{what} holds {_asked_for(str(exc))}, which a resume would refuse to load "
            f"(nothing from a checkpoint is unpickled but {_ALLOWED}): save those instead, "
            "e.g. a NumPy array as a tensor"
        ) from None
    return data


def _load_torch(stream: IO[bytes], name: str, map_location: Any) -> Any:
    import torch

    try:
        return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's weights-only unpickler refused something the pickle asks for.
        raise UnsafeCheckpointError(
            f"{name} is refused: loading it would need {_asked_for(str(exc))}; "
            f"a checkpoint file may hold only {_ALLOWED} (was it written by someone else?)"
        ) from None
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged zip or pickle raises anything
        raise CheckpointError(f"{name} is unreadable: {_one_line(exc)}") from None


def _asked_for(message: str) -> str:
    """What torch's refusal names: a global ("posix.system") or the refused operation."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return found.group(1)
    for line in message.splitlines():
        if "Unsupported" in line or "WeightsUnpickler error" in line:
            return line.split("error:", 1)[-1].strip().rstrip(".")
    return "more than weights_only=True allows"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---- DCP's .metadata ---------------------------------------------------------------------


def load_dcp_metadata(source: str | os.PathLike | bytes | IO[bytes], name: str | None = None):
    """DCP's `Metadata` from a `.metadata` file (a path, its bytes or an open stream), read
    with an unpickler that admits only the classes DCP's metadata is made of; `name` (default:
    the path) names the file in errors. Raises UnsafeCheckpointError (another class, or a
    storage file outside the metadata's directory), CheckpointError (damaged, or not DCP
    metadata) or OSError."""
    from torch.distributed.checkpoint.metadata import Metadata

    if isinstance(source, (str, os.PathLike)):
        with os.fdopen(open_regular(source), "rb") as stream:
            return load_dcp_metadata(stream, str(source) if name is None else name)
    shown = name or "DCP metadata"
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        metadata = _MetadataUnpickler(stream, shown).load()
    except (UnsafeCheckpointError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(f"{shown} is unreadable: {_one_line(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{shown} is not DCP metadata (it holds a {type(metadata).__name__})")
    _check_storage_files(metadata, shown)
    return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Finds only the classes of _metadata_classes(); any other global is refused before it
    is imported, let alone called."""

    def __init__(self, stream: IO[bytes], name: str) -> None:
        super().__init__(stream)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_classes().get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                f"{self._name} is refused: it asks for {module}.{name}, which is none of "
                "the classes DCP's metadata is made of (was it written by someone else?)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._name} is refused: it holds a persistent id")


_CLASSES: dict[tuple[str, str], Any] = {}


def _metadata_classes() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for what torch's DCP (and megatron-core's additions to it:
    `all_local_plans`, the save plans) pickles into `.metadata`. Each of them, called with
    any arguments or given any state, only builds data."""
    if _CLASSES:
        return _CLASSES
    import torch
    from torch.distributed.checkpoint import filesystem, metadata, planner

    found: dict[tuple[str, str], Any] = {}

    def admit(module: Any, names: tuple[str, ...]) -> None:
        for name in names:
            cls = getattr(module, name, None)  # absent from some torch versions
            if cls is not None:
                found[(module.__name__, name)] = cls

    admit(
        metadata,
        (
            "Metadata",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        ),
    )
    admit(filesystem, ("_StorageInfo", "_StoragePrefix"))
    admit(
        planner,
        ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"),
    )
    found[("torch", "Size")] = torch.Size
    # vars(), not getattr(): torch imports some of its modules on first attribute access.
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[("torch", name)] = value
    found[("torch.serialization", "_get_layout")] = _layout_by_name
    # StorageMeta.checkpoint_id: the path the saver wrote to (pathlib's module is
    # pathlib._local from Python 3.13 on).
    for module in ("pathlib", "pathlib._local"):
        found[(module, "PosixPath")] = PurePosixPath
        found[(module, "PurePosixPath")] = PurePosixPath
        found[(module, "WindowsPath")] = PureWindowsPath
        found[(module, "PureWindowsPath")] = PureWindowsPath
    found[("builtins", "set")] = set
    found[("builtins", "frozenset")] = frozenset
    _CLASSES.update(found)
    return _CLASSES


def _layout_by_name(name: str) -> Any:
    """torch.serialization._get_layout, which the pickle of a TensorProperties calls; only
    torch's own layouts."""
    import torch

    layout = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return layout


def _check_storage_files(metadata: Any, name: str) -> None:
    """Every storage file the metadata names is a plain name in its own directory: a read
    never reaches a file elsewhere (`../`, an absolute path)."""
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise CheckpointError(f"{name} is not DCP metadata (its storage_data is no dict)")
    for index, info in storage.items():
        path = getattr(info, "relative_path", None)
        plain = isinstance(path, str) and path not in ("", ".", "..")
        if not plain or any(c in path for c in "/\\\0"):
            item = getattr(index, "fqn", index)
            raise UnsafeCheckpointError(
                f"{name} is refused: it names storage file {path!r} (for {item}), "
                "which is not a file of its own directory"
            )
