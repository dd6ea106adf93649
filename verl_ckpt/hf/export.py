"""Protocol step E (export), the work itself: Hugging Face weights from a committed step.

Reads the role's committed torch_dist directory with no ranks (torch.distributed.checkpoint
with no_dist: every tensor comes back whole, tensor-parallel shards merged), converts it with
a mapping (mapping.py), writes safetensors shards, config.json and, last, the export record
into a temporary directory, and renames that into place. The step itself is never touched:
an export that fails leaves nothing but a temporary directory, removed by the next attempt.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_ckpt.hf.mapping import (
    HFMapping,
    TensorRule,
    UnsupportedModelError,
    get_mapping,
    known_architectures,
)
from verl_ckpt.hf.model_spec import LM_HEAD, MODEL_SPEC_FILENAME, VALUE_HEAD, read_model_spec
from verl_ckpt.hf.record import (
    ExportRecord,
    describe_context_length,
    export_dir,
    read_export_record,
    sign_export_record,
    verify_export,
    write_export_record,
)
from verl_ckpt.protocol import faults
from verl_ckpt.protocol.errors import CheckpointConfigError, CheckpointError, CommitRecordError
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import FileEntry, read_commit_record_and_digest
from verl_ckpt.store.fsio import fsync_dir, make_dir
from verl_ckpt.store.layout import DRIVER_ROLE
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.verification import verify_files

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportSummary", "choose_mapping", "export_role"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 2048 << 20
CONFIG_FILENAME = "config.json"
SINGLE_SHARD_FILENAME = "model.safetensors"
INDEX_FILENAME = "model.safetensors.index.json"
# Keys of a role's torch_dist directory that are optimizer state, not model weights
# (megatron-core's optimizers and verl_ckpt's recipes name theirs so).
_OPTIMIZER_PREFIX = "optimizer."


@dataclass
class ExportSummary:
    step: int
    role: str
    architecture: str
    path: str
    files: int
    bytes: int
    seconds: float
    # True when a complete export that verified was there already (nothing written).
    existing: bool = False
    # Positions the model was built for (n_positions of a GPT-2 export); None: unknown.
    context_length: int | None = None


def export_role(
    step_path: str | Path,
    role: str,
    architecture: str | None = None,
    out_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    keyring: Keyring | None = None,
) -> ExportSummary:
    """Export the Hugging Face weights of `role` from the committed step at `step_path` into
    `out_dir` (default: `<step>/<role>/huggingface/`). `architecture` names the mapping;
    None picks the one mapping that fits the saved model. Raises naming the path or key;
    on any error nothing is published. `keyring` (checkpoint.signing): the step's record
    must be signed, the export record is signed, and an existing export counts only if its
    record is signed and names this very save of the step."""
    started = time.perf_counter()
    step_path = Path(step_path)
    # One read: the record checked and parsed, and the digest that names this save of it.
    record, source = read_commit_record_and_digest(step_path, keyring=keyring)
    step = record.step
    role_dir = _committed_role_dir(step_path, role, record)
    spec = read_model_spec(role_dir)
    _refuse_value_model(spec, role, role_dir)
    mapping = choose_mapping(spec, architecture, role_dir)
    context = spec.get("max_sequence_length")
    target = Path(os.path.abspath(out_dir)) if out_dir is not None else export_dir(step_path, role)
    shown = str(out_dir) if out_dir is not None else str(target)  # OUT as the caller gave it
    if out_dir is not None and Path.cwd().resolve().is_relative_to(target.resolve()):
        # OUT is replaced whole (_publish): the caller's current directory would be deleted.
        raise CheckpointConfigError(
            f"OUT {out_dir} is the current directory or holds it: an export replaces OUT "
            "whole; name a new directory"
        )
    existing = _existing_export(target, step, role, mapping.name, source, out_dir is None, keyring)
    if existing is not None:
        files = existing.files
        return ExportSummary(
            step, role, existing.architecture, shown, len(files),
            sum(f.size for f in files), time.perf_counter() - started, existing=True,
            context_length=existing.context_length or context,
        )  # fmt: skip
    if out_dir is not None and target.exists() and any(target.iterdir()):
        raise CheckpointConfigError(
            f"OUT {shown} exists and is not an export of this save of step {step} role {role} "
            f"({mapping.name}): "
            "remove it or choose another directory"
        )
    tensors = _model_tensors(role_dir)
    rules = _checked_rules(mapping, spec, tensors, role_dir)
    data_bytes = sum(f.size for f in record.files if f.path.startswith(f"{role}/"))
    _check_extents(tensors, data_bytes, role_dir)
    faults.inject(Phase.EXPORT, role)
    if out_dir is None:
        _remove_stale_temporaries(target)
    tmp = target.with_name(f".{target.name}.tmp.{uuid.uuid4().hex[:12]}")
    try:
        make_dir(tmp, parents=True)
        files = _write_weights(tmp, role_dir, tensors, rules, mapping.name, max_shard_bytes)
        dtype = _dominant_dtype(tensors, rules)
        config = json.dumps(mapping.hf_config(spec, dtype), indent=2, sort_keys=True).encode()
        files.append(_write_file(tmp, CONFIG_FILENAME, config))
        fsync_dir(tmp)
        # The record goes last: a directory holding it holds every file it names, durable.
        exported = ExportRecord(step, role, mapping.name, files, context, source)
        write_export_record(tmp, sign_export_record(exported, keyring))
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - started
    size = sum(f.size for f in files)
    logger.info(
        "exported step %d role %s (%s) to %s: %d files, %d bytes in %.2f s; %s",
        step, role, mapping.name, target, len(files), size, seconds,
        describe_context_length(context),
    )  # fmt: skip
    return ExportSummary(
        step, role, mapping.name, shown, len(files), size, seconds, context_length=context
    )


def choose_mapping(
    spec: dict[str, Any], architecture: str | None, role_dir: Path, key: str = "--architecture"
) -> HFMapping:
    """The mapping named `architecture` (it must fit the model), or the only one that fits."""
    if architecture is not None:
        mapping = get_mapping(architecture, key)
        problems = mapping.unsupported(spec)
        if problems:
            raise UnsupportedModelError(
                f"the model saved in {role_dir} is not a {architecture} model: "
                + "; ".join(problems)
            )
        return mapping
    fits, reasons = [], []
    for name in known_architectures():
        mapping = get_mapping(name, key)
        problems = mapping.unsupported(spec)
        if problems:
            reasons.append(f"{name}: {', '.join(problems)}")
        else:
            fits.append(mapping)
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise UnsupportedModelError(
            f"no Hugging Face mapping fits the model saved in {role_dir} "
            f"({spec.get('model_class')}): " + "; ".join(reasons)
        )
    raise CheckpointConfigError(
        f"several Hugging Face mappings fit the model saved in {role_dir} "
        f"({', '.join(m.name for m in fits)}): pass {key}"
    )


# ---- checks before anything is written ------------------------------------------------------


def _committed_role_dir(step_path: Path, role: str, record: Any) -> Path:
    roles = sorted(r for r in record.participants if r != DRIVER_ROLE)
    if role == DRIVER_ROLE or role not in record.participants:
        raise CheckpointConfigError(
            f"step {step_path} has no role {role!r} (roles: {', '.join(roles) or 'none'})"
        )
    committed = {entry.path: entry for entry in record.files}
    entry = committed.get(f"{role}/{MODEL_SPEC_FILENAME}")
    if entry is None:
        # A description written after the commit would not be the model that was saved.
        read_model_spec(step_path / role)  # the clearer error when the file is missing
        raise CheckpointError(
            f"{step_path / role / MODEL_SPEC_FILENAME} is not part of the committed step"
        )
    # Every file of the role (the description, which decides how every tensor is read, and
    # the shards) is checked against the commit record before a byte is converted: an export
    # is published with its own record, which would vouch for bytes changed since the commit
    # (a flipped bit, a truncated shard) if they were not the committed ones.
    problems = verify_files(step_path, record, prefix=f"{role}/")
    if problems:
        raise CommitRecordError("; ".join(problems))
    return step_path / role


def _refuse_value_model(spec: dict[str, Any], role: str, role_dir: Path) -> None:
    """A value model (a critic) has no language-model head: a causal-LM export of it would
    load in transformers and produce meaningless next-token logits."""
    if spec.get("head", LM_HEAD) == VALUE_HEAD:
        raise CheckpointConfigError(
            f"role {role} in {role_dir.parent} is a value model (no language-model head): "
            "it has no Hugging Face export; export a language-model role such as the actor"
        )


def _existing_export(
    target: Path,
    step: int,
    role: str,
    architecture: str,
    source: str,
    in_place: bool,
    keyring: Keyring | None,
) -> ExportRecord | None:
    """A complete export of this save of the step (`source`: its record_digest), of this
    role and architecture, already at `target`, that verifies. An export inside the step
    whose record predates the source's hash is this save's (it sits in that very step),
    unless signing is on: then its record must be signed and name `source`, since anyone who
    can write the root can plant an export whose record matches its files."""
    if not target.is_dir():
        return None
    try:
        record = read_export_record(target, keyring)
    except CheckpointError:
        return None
    if (record.step, record.role, record.architecture) != (step, role, architecture):
        return None
    older_in_place = in_place and keyring is None and record.source_record_sha256 is None
    if record.source_record_sha256 != source and not older_in_place:
        return None
    _, problems = verify_export(target, keyring)
    if problems:
        logger.warning("replacing the export at %s: %s", target, "; ".join(problems))
        return None
    return record


def _model_tensors(role_dir: Path) -> dict[str, Any]:
    """Key -> DCP tensor metadata of every model tensor of the role's directory."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from verl_ckpt.format.safe_load import load_dcp_metadata

    metadata = load_dcp_metadata(role_dir / ".metadata")
    tensors = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith(_OPTIMIZER_PREFIX)
    }
    if not tensors:
        raise CheckpointError(
            f"{role_dir} holds no model tensors (was 'model' in checkpoint.save_contents?)"
        )
    return tensors


def _check_extents(tensors: dict[str, Any], data_bytes: int, role_dir: Path) -> None:
    """Every tensor's declared size (`.metadata`: data from the root) before any memory is
    allocated for it: no larger than the role's committed files, and tiled by its saved
    chunks, each within the tensor. A planted `.metadata` declaring a huge tensor would
    otherwise exhaust the node's memory, and one whose chunks leave a gap would publish
    whatever that memory held."""
    for key, meta in tensors.items():
        size = tuple(meta.size)
        numel = math.prod(size)
        nbytes = numel * meta.properties.dtype.itemsize
        if nbytes > data_bytes:
            raise CheckpointError(
                f"{role_dir}: .metadata declares tensor {key} of {nbytes} bytes, more than the "
                f"role's committed files hold ({data_bytes} bytes); nothing is exported"
            )
        covered = 0
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not len(offsets) == len(sizes) == len(size) or any(
                o < 0 or n < 0 or o + n > whole for o, n, whole in zip(offsets, sizes, size)
            ):
                raise CheckpointError(
                    f"{role_dir}: .metadata declares a chunk of tensor {key} outside its "
                    f"shape {list(size)}; nothing is exported"
                )
            covered += math.prod(chunk.sizes)
        if covered != numel:
            raise CheckpointError(
                f"{role_dir}: the saved chunks of tensor {key} cover {covered} of its {numel} "
                "elements; nothing is exported"
            )


def _checked_rules(
    mapping: HFMapping, spec: dict[str, Any], tensors: dict[str, Any], role_dir: Path
) -> list[TensorRule]:
    """The mapping's rules, only if they cover every model tensor exactly once."""
    rules = mapping.rules(spec)
    sources = Counter(rule.source for rule in rules)
    missing = sorted(s for s in sources if s not in tensors)
    unmapped = sorted(k for k in tensors if k not in sources)
    twice = sorted(s for s, n in sources.items() if n > 1)
    problems = []
    if unmapped:
        problems.append(f"tensors the mapping does not know: {', '.join(unmapped)}")
    if missing:
        problems.append(f"tensors the mapping needs and the step lacks: {', '.join(missing)}")
    if twice:
        problems.append(f"tensors mapped twice: {', '.join(twice)}")
    if problems:
        raise UnsupportedModelError(
            f"mapping {mapping.name} does not fit {role_dir}: " + "; ".join(problems)
        )
    return rules


# ---- writing -----------------------------------------------------------------------------------


def _write_weights(
    tmp: Path,
    role_dir: Path,
    tensors: dict[str, Any],
    rules: list[TensorRule],
    architecture: str,
    max_shard_bytes: int,
) -> list[FileEntry]:
    """Convert rule by rule (one megatron-core tensor in memory at a time, plus one shard of
    output) and write safetensors shards; with more than one, the index as well."""
    shards: list[tuple[FileEntry, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    seen: set[str] = set()
    for rule in rules:
        source = _read_global_tensor(role_dir, rule.source, tensors[rule.source])
        try:
            converted = rule.convert(source)
        except Exception as exc:
            raise UnsupportedModelError(
                f"mapping {architecture} failed to convert {rule.source} "
                f"{list(source.shape)} from {role_dir}: {type(exc).__name__}: {exc}"
            ) from exc
        for key, tensor in converted.items():
            if key in seen:
                raise UnsupportedModelError(f"mapping {architecture} writes {key} twice")
            seen.add(key)
            # A copy of its own: views of one stacked tensor would share storage, which
            # safetensors refuses, and the source is freed once converted.
            pending[key] = tensor.detach().to("cpu").contiguous().clone()
            pending_bytes += tensor.numel() * tensor.element_size()
        if pending_bytes >= max_shard_bytes:
            shards.append(_write_shard(tmp, len(shards), pending))
            pending, pending_bytes = {}, 0
    if pending or not shards:
        shards.append(_write_shard(tmp, len(shards), pending))
    return _name_shards(tmp, shards)


def _read_global_tensor(role_dir: Path, key: str, meta: Any) -> torch.Tensor:
    """One tensor of the torch_dist directory, whole: DCP assembles it from every rank's
    shards (no process group: `no_dist`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from verl_ckpt.format.safe_reader import SafeFileSystemReader, checkpoint_error_in

    # Zeros, not empty: what a read does not fill is never another allocation's bytes.
    target = {key: torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)}
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming ... a single process": intended.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(target, storage_reader=SafeFileSystemReader(str(role_dir)), no_dist=True)
        except CheckpointException as exc:
            cause = checkpoint_error_in(exc)  # a refused or damaged `.metadata`: its own line
            if cause is not None:
                raise cause from None
            # A BaseException in torch: past every `except Exception` (the export queue's
            # worker among them) it would end the caller with a traceback.
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{role_dir}: reading {key} failed: {detail}") from None
    return target[key]


def _write_shard(
    tmp: Path, index: int, tensors: dict[str, torch.Tensor]
) -> tuple[FileEntry, list[str]]:
    from safetensors.torch import save

    entry = _write_file(tmp, f".shard-{index}", save(tensors, metadata={"format": "pt"}))
    return entry, list(tensors)


def _name_shards(tmp: Path, shards: list[tuple[FileEntry, list[str]]]) -> list[FileEntry]:
    """Hugging Face's names: model.safetensors, or model-0000i-of-0000n.safetensors and the
    index that maps each tensor to its file."""
    count = len(shards)
    files, weight_map = [], {}
    for i, (entry, keys) in enumerate(shards, start=1):
        name = SINGLE_SHARD_FILENAME if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
        os.replace(tmp / entry.path, tmp / name)
        files.append(FileEntry(name, entry.size, entry.checksum))
        weight_map.update(dict.fromkeys(keys, name))
    if count > 1:
        total = sum(f.size for f in files)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        files.append(_write_file(tmp, INDEX_FILENAME, json.dumps(index, indent=2).encode()))
    return files


def _write_file(directory: Path, name: str, data: bytes) -> FileEntry:
    written = write_checksummed(directory / name, lambda stream: stream.write(data))
    return FileEntry(name, written.size, written.checksum)


def _dominant_dtype(tensors: dict[str, Any], rules: list[TensorRule]) -> str:
    counts = Counter(str(tensors[rule.source].properties.dtype) for rule in rules)
    return counts.most_common(1)[0][0].removeprefix("torch.")


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished export into place. An earlier export there that did not verify
    (or an empty OUT) is moved aside first and removed after: a directory cannot be renamed
    over a non-empty one, and readers must never see a mix of the two."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old.{uuid.uuid4().hex[:12]}")
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temporaries(target: Path) -> None:
    """Temporary directories of earlier exports that crashed (in-place exports only: nobody
    else writes into a committed step's role directory)."""
    for pattern in (f".{target.name}.tmp.*", f".{target.name}.old.*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
