"""Issue 45, item 1: no code from a checkpoint ever runs (docs/security.md, "Trust" in
DESIGN.md). Whoever can write a root or a bucket can plant a step: a copy of a committed
step with a newer number, one of its pickled files replaced by a pickle that runs code when
loaded (here: it creates a marker file), and a commit record whose sizes and checksums match
(anyone can compute them). The next start rolls forward to it (I2), so every file it reads
is the attacker's: the driver's state, a role's `.metadata`, `common.pt`, a byte item (a
rank's extra state). Neither the recipe's start and resume, nor `verl-ckpt ls`, `verify` and
`inspect` (local or URL) may ever run the payload; the refusal is one line naming the file;
the committed steps stay intact.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from recipes.trainer import DRIVER_STATE_FORMAT
from tests.test_recipe import RUN_TIMEOUT_S, start_recipe
from verl_ckpt.cli.main import main as cli_main
from verl_ckpt.store.commit_record import CommitRecord, read_commit_record, write_commit_record
from verl_ckpt.store.fsio import file_checksum
from verl_ckpt.store.layout import DRIVER_STATE_FILENAME, step_dir

# The committed step of the session's four-step run that planted steps copy.
SOURCE_STEP = 4
PLANTED_STEP = 99


class Payload:
    """Creates `marker` when unpickled: what an attacker's pickle would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def torch_file(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def read_dcp_metadata(role_dir: Path):
    # The test's own copy of a file it wrote: trusted here.
    with open(role_dir / ".metadata", "rb") as f:
        return pickle.load(f)  # noqa: S301


def write_dcp_metadata(role_dir: Path, metadata) -> None:
    with open(role_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def plant_driver_state(step: Path, marker: Path) -> Path:
    """The driver's state, as the recipe saves it, with one more entry: the payload."""
    path = step / DRIVER_STATE_FILENAME
    state = torch.load(path, weights_only=True)
    assert state["format"] == DRIVER_STATE_FORMAT
    path.write_bytes(torch_file({**state, "step": PLANTED_STEP, "note": Payload(marker)}))
    return path


def plant_metadata(step: Path, marker: Path) -> Path:
    """The actor's real DCP metadata, carrying the payload in a field DCP never reads."""
    metadata = read_dcp_metadata(step / "actor")
    metadata.planner_data = Payload(marker)
    write_dcp_metadata(step / "actor", metadata)
    return step / "actor" / ".metadata"


def plant_common(step: Path, marker: Path) -> Path:
    path = step / "actor" / "common.pt"
    common = torch.load(path, weights_only=True)
    path.write_bytes(torch_file({**common, "note": Payload(marker)}))
    return path


def plant_byte_item(step: Path, marker: Path) -> Path:
    """Actor rank 0's extra state (a DCP byte item) replaced: the payload's blob appended
    to the file that held it, and `.metadata` (only DCP's own classes) pointed at it."""
    role_dir = step / "actor"
    metadata = read_dcp_metadata(role_dir)
    index = next(
        i for i in metadata.storage_data if i.fqn.startswith("verl_ckpt.extra_state/shard_0_")
    )
    info = metadata.storage_data[index]
    data_file = role_dir / info.relative_path
    blob = torch_file([{"note": Payload(marker)}])
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    write_dcp_metadata(role_dir, metadata)
    return data_file


PLANTS = {
    "driver_state": plant_driver_state,
    "metadata": plant_metadata,
    "common": plant_common,
    "byte_item": plant_byte_item,
}


def plant_step(root: Path, kind: str, step: int, marker: Path) -> Path:
    """A copy of committed step SOURCE_STEP as `step`, one file replaced by `kind`'s plant,
    and a commit record that matches every file (the project's own checksum function).
    Returns the planted file."""
    path = Path(shutil.copytree(step_dir(root, SOURCE_STEP), step_dir(root, step)))
    planted = PLANTS[kind](path, marker)
    record = read_commit_record(step_dir(root, SOURCE_STEP))
    files = []
    for entry in record.files:
        size, checksum = file_checksum(path / entry.path, record.checksum_algorithm)
        files.append(dataclasses.replace(entry, size=size, checksum=checksum))
    write_commit_record(
        path,
        CommitRecord(
            step, record.participants, files, checksum_algorithm=record.checksum_algorithm
        ),
    )
    return planted


def committed_files(root: Path, steps: tuple[int, ...]) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(root)): file_checksum(p)
        for step in steps
        for p in sorted(step_dir(root, step).rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def root(four_step_run, tmp_path) -> Path:
    """A copy of the four-step run's root (steps 2 and 4 committed, tracker at 4)."""
    return Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_a_planted_step_is_refused_at_resume_without_running_its_pickle(root, tmp_path, kind):
    """The tracker stays at 4: start-up rolls forward to the planted step 99 (its record is
    valid), and the resume refuses the planted file in one line, before any code of it ran."""
    marker = tmp_path / "marker"
    planted = plant_step(root, kind, PLANTED_STEP, marker)
    before = committed_files(root, (2, SOURCE_STEP))
    proc = start_recipe(
        tmp_path / "run",
        f"trainer.total_steps={PLANTED_STEP + 1}",
        f"checkpoint.save_freq={PLANTED_STEP + 1}",
        f"checkpoint.root_dir={root}",
    )
    output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert not marker.exists(), f"the planted {kind} ran its payload:\n{output[-3000:]}"
    assert proc.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("ppo_toy:")]
    assert len(errors) == 1, output[-3000:]
    assert str(planted) in errors[0] and "refused" in errors[0], errors[0]
    assert committed_files(root, (2, SOURCE_STEP)) == before


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_verify_inspect_never_run_a_planted_pickle(root, tmp_path, capsys):
    """One root, one planted step per kind: `ls`, `verify` of each (its checksums match:
    only signing tells it apart) and `inspect` of each; a planted `.metadata` is refused by
    `inspect` in one line naming it, exit status 1 (a bad checkpoint)."""
    marker = tmp_path / "marker"
    planted = {
        kind: plant_step(root, kind, PLANTED_STEP - i, marker)
        for i, kind in enumerate(sorted(PLANTS))
    }
    steps = {kind: PLANTED_STEP - i for i, kind in enumerate(sorted(PLANTS))}
    before = committed_files(root, (2, SOURCE_STEP))
    code, out, _ = run_cli(capsys, "ls", root)
    assert code == 0 and not marker.exists(), out
    for kind, step in steps.items():
        code, out, err = run_cli(capsys, "verify", root, "--step", step)
        assert code == 0 and not marker.exists(), (kind, out, err)
        code, out, err = run_cli(capsys, "inspect", root, "--step", step)
        assert not marker.exists(), f"inspect ran the planted {kind}"
        if kind == "metadata":
            assert code == 1 and out == "", out
            assert len(err.strip().splitlines()) == 1, err
            assert str(planted[kind]) in err and "refused" in err, err
        else:
            assert code == 0 and "role actor" in out, (kind, err)
    assert committed_files(root, (2, SOURCE_STEP)) == before


def test_inspect_of_a_url_never_runs_a_planted_metadata(root, tmp_path, s3_server, capsys):
    """The same planted `.metadata` in a bucket: `inspect URL` downloads it and refuses it
    in one line naming the object by its URL."""
    marker = tmp_path / "marker"
    plant_step(root, "metadata", PLANTED_STEP, marker)
    fs = s3_server.filesystem()
    prefix = f"{s3_server.new_bucket()}/tier"
    name = step_dir(root, PLANTED_STEP).name
    fs.put(str(step_dir(root, PLANTED_STEP)), f"{prefix}/{name}", recursive=True)
    options = json.dumps(s3_server.storage_options())
    url = f"s3://{prefix}"
    code, out, err = run_cli(
        capsys, "inspect", url, "--step", PLANTED_STEP, "--storage-options", options
    )
    assert not marker.exists(), "inspect of a URL ran the planted .metadata"
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"{url}/{name}/actor/.metadata" in err and "refused" in err, err


# ---- the loaders alone (no Ray) ----------------------------------------------------------


def test_load_state_file_loads_what_verl_ckpt_saves_and_refuses_anything_else(tmp_path):
    """What the driver and the ranks save (tensors, torch's and Python's RNG states, counters,
    a data position) comes back exactly; a pickle that asks for more is refused in one line
    naming the file, and nothing of it runs."""
    from verl_ckpt.format.safe_load import load_state_file, safe_state_bytes
    from verl_ckpt.protocol.errors import UnsafeCheckpointError

    generator = torch.Generator().manual_seed(3)
    state = {
        "format": 1,
        "step": 7,
        "data_position": [3, 1, 2],
        "torch_rng": torch.get_rng_state(),
        "sampler": generator.get_state(),
        "python_rng": random.getstate(),
        "ratio": 0.5,
        "name": "actor",
    }
    path = tmp_path / "state.pt"
    path.write_bytes(safe_state_bytes(state, "the test's state"))
    loaded = load_state_file(path)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        same = torch.equal(loaded[key], value) if torch.is_tensor(value) else loaded[key] == value
        assert same, key

    marker = tmp_path / "marker"
    path.write_bytes(torch_file({"step": 7, "note": Payload(marker)}))
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_state_file(path)
    message = str(refused.value)
    assert str(path) in message and "refused" in message and "\n" not in message
    assert not marker.exists()


class TrainerCounters:
    """A class of the trainer's own: no checkpoint file may ask for it."""

    def __init__(self) -> None:
        self.seen = 3


def test_state_that_could_not_be_loaded_back_is_refused_when_saved():
    """An object of the caller's own class in saved state would be refused at resume: its
    save fails at once, naming what was saved and the class. (NumPy arrays are such objects
    unless megatron-core, which registers them with torch as safe, was imported.)"""
    from verl_ckpt.format.safe_load import safe_state_bytes
    from verl_ckpt.protocol.errors import CheckpointError, UnsafeCheckpointError

    with pytest.raises(CheckpointError) as refused:
        safe_state_bytes({"counters": TrainerCounters()}, "the driver state of step 3")
    assert not isinstance(refused.value, UnsafeCheckpointError)
    message = str(refused.value)
    assert "the driver state of step 3 holds" in message and "TrainerCounters" in message


def test_load_dcp_metadata_reads_what_dcp_writes_and_refuses_anything_else(tmp_path):
    """DCP's `.metadata` of tensors and byte items reads back equal to the unpickled one;
    a planted class, or a storage file outside the directory, is refused, nothing run."""
    import torch.distributed.checkpoint as dcp

    from verl_ckpt.format.safe_load import load_dcp_metadata
    from verl_ckpt.protocol.errors import UnsafeCheckpointError

    state = {"w": torch.arange(6.0).reshape(2, 3), "extra": {"step": 3}, "b": torch.ones(2)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    expected = read_dcp_metadata(tmp_path)
    loaded = load_dcp_metadata(tmp_path / ".metadata")
    assert loaded.state_dict_metadata == expected.state_dict_metadata
    assert loaded.storage_data == expected.storage_data
    assert str(loaded.storage_meta.checkpoint_id) == str(expected.storage_meta.checkpoint_id)

    marker = tmp_path / "marker"
    planted = dataclasses.replace(expected, planner_data=Payload(marker))
    write_dcp_metadata(tmp_path, planted)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is refused: it asks for"):
        load_dcp_metadata(tmp_path / ".metadata")
    assert not marker.exists()

    index, info = next(iter(expected.storage_data.items()))
    expected.storage_data[index] = dataclasses.replace(info, relative_path="../elsewhere")
    write_dcp_metadata(tmp_path, expected)
    with pytest.raises(UnsafeCheckpointError, match="'../elsewhere'"):
        load_dcp_metadata(tmp_path / ".metadata")


def test_the_safe_reader_loads_byte_items_and_refuses_a_planted_one(tmp_path):
    """DCP's own load through SafeFileSystemReader: tensors and byte items come back; a
    planted byte item is refused (DCP wraps the refusal; checkpoint_error_in unwraps it),
    nothing of it run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from verl_ckpt.format.safe_reader import SafeFileSystemReader, checkpoint_error_in
    from verl_ckpt.protocol.errors import UnsafeCheckpointError

    rng = random.getstate()  # a tuple: one byte item
    dcp.save({"w": torch.arange(4.0), "rng": rng}, checkpoint_id=tmp_path, no_dist=True)
    target = {"w": torch.zeros(4), "rng": None}
    dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4.0)) and target["rng"] == rng

    marker = tmp_path / "marker"
    metadata = read_dcp_metadata(tmp_path)
    index = next(i for i in metadata.storage_data if i.fqn == "rng")
    info = metadata.storage_data[index]
    blob = torch_file(Payload(marker))
    with open(tmp_path / info.relative_path, "ab") as f:
        offset = f.tell()
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    write_dcp_metadata(tmp_path, metadata)
    with pytest.raises(CheckpointException) as wrapped:
        dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    refused = checkpoint_error_in(wrapped.value)
    assert isinstance(refused, UnsafeCheckpointError), wrapped.value
    assert str(tmp_path / info.relative_path) in str(refused) and "(item rng)" in str(refused)
    assert not marker.exists()
