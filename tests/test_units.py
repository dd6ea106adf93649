"""Unit tests of the pure parts: tracker (I2), commit record (I1), retention policy (I3),
config validation. No Ray, no megatron: real files in tmp_path only."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

from verl_ckpt.protocol.config import CheckpointConfig, WriterConfig, to_checkpoint_config
from verl_ckpt.protocol.errors import CheckpointConfigError, CommitRecordError, TrackerError
from verl_ckpt.protocol.messages import GlobalMetadataCache, RankReport
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    is_committed,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import CHECKSUM_ALGORITHM, SUPPORTED_CHECKSUMS, file_checksum
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, list_step_dirs, step_dir
from verl_ckpt.store.retention import apply_retention, delete_step, steps_to_delete
from verl_ckpt.store.tracker import read_tracker, tracker_path, write_tracker
from verl_ckpt.store.verification import verify_files


def test_I2_tracker_round_trip_and_no_temp_left(tmp_path):
    assert read_tracker(tmp_path) is None
    write_tracker(tmp_path, 7)
    assert tracker_path(tmp_path).read_bytes() == b"7\n"
    write_tracker(tmp_path, 12)
    assert read_tracker(tmp_path) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize(
    "content",
    [b"", b"   \n", b"abc\n", b"-3\n", b"4\n5\n", b"\xef\xbb\xbf4\n", b"4.0\n", b"4 2\n", b"+4"],
    ids=[
        "empty",
        "whitespace",
        "non-numeric",
        "negative",
        "multi-line",
        "bom",
        "float",
        "two-numbers",
        "plus",
    ],
)
def test_I2_bad_tracker_is_an_error_naming_the_path(tmp_path, content):
    tracker_path(tmp_path).write_bytes(content)
    with pytest.raises(TrackerError, match="latest_checkpointed_iteration.txt"):
        read_tracker(tmp_path)


@pytest.mark.parametrize("content", [b"4", b"4\n", b" 4\n", b"\t4 \r\n", b"\n\n4\n\n", b"04\n"])
def test_I2_tracker_reader_accepts_surrounding_ascii_whitespace(tmp_path, content):
    """Megatron-LM and verl strip the tracker's text: a tracker they (or a person) wrote
    with extra whitespace names the same step here."""
    tracker_path(tmp_path).write_bytes(content)
    assert read_tracker(tmp_path) == 4


def test_I2_tracker_that_is_a_directory(tmp_path):
    tracker_path(tmp_path).mkdir()
    with pytest.raises(TrackerError, match="is a directory"):
        read_tracker(tmp_path)


def test_I5_tracker_that_is_a_fifo_is_an_error_not_a_wait(tmp_path):
    """A FIFO in the tracker's place: reading it waited for a writer forever (start-up hung).
    Run in a thread with a deadline, so that the old behaviour fails the test, not hangs it."""
    import os
    import threading

    os.mkfifo(tracker_path(tmp_path))
    outcome: list = []

    def read() -> None:
        try:
            outcome.append(read_tracker(tmp_path))
        except TrackerError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # release the old code's blocked open before failing
        os.close(os.open(tracker_path(tmp_path), os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO tracker waited for a writer")
    assert isinstance(outcome[0], TrackerError) and "not a regular file" in str(outcome[0])


def _record(tmp_path, step=3, algorithm=CHECKSUM_ALGORITHM):
    path = step_dir(tmp_path, step)
    (path / "actor").mkdir(parents=True)
    shard = path / "actor" / "__0_0.distcp"
    shard.write_bytes(b"x" * 1000)
    size, checksum = file_checksum(shard, algorithm)
    entries = [FileEntry("actor/__0_0.distcp", size, checksum)]
    write_commit_record(
        path, CommitRecord(step, {"actor": 1}, entries, checksum_algorithm=algorithm)
    )
    return path, shard


# crc32 is what the first records were written with: they must keep verifying.
@pytest.mark.parametrize("algorithm", SUPPORTED_CHECKSUMS)
def test_I1_commit_record_round_trip_and_checksums(tmp_path, algorithm):
    path, shard = _record(tmp_path, algorithm=algorithm)
    record = read_commit_record(path)
    assert record.step == 3 and record.participants == {"actor": 1}
    assert record.checksum_algorithm == algorithm
    assert verify_files(path, record) == []
    # A bit flip keeps the size and changes the checksum.
    data = bytearray(shard.read_bytes())
    data[500] ^= 1
    shard.write_bytes(bytes(data))
    assert "checksum" in verify_files(path, record)[0]
    shard.write_bytes(b"x" * 10)
    assert "size 10, expected 1000" in verify_files(path, record)[0]


def test_I1_commit_record_entries_are_json_whatever_the_file_names(tmp_path):
    """The record's file entries are formatted without one json.dumps each (the commit's
    critical path at thousands of ranks): names needing escapes read back unchanged, and
    each line is what json.dumps gives."""
    names = ['actor/a"quote.distcp', "actor/back\\slash", "actor/ümlaut\tand tab", "driver.pt"]
    entries = [FileEntry(name, size, f"{size:08x}") for size, name in enumerate(names)]
    write_commit_record(tmp_path, CommitRecord(7, {"actor": 1}, entries))
    assert read_commit_record(tmp_path).files == entries
    text = (tmp_path / COMMIT_RECORD_FILENAME).read_text()
    for entry in entries:
        assert (
            json.dumps({"path": entry.path, "size": entry.size, "checksum": entry.checksum}) in text
        )


def test_I1_commit_record_unknown_version_and_corruption(tmp_path):
    path, _ = _record(tmp_path)
    record_file = path / "verl_ckpt_commit.json"
    raw = json.loads(record_file.read_text())
    raw["format_version"] = 99
    record_file.write_text(json.dumps(raw))
    with pytest.raises(CommitRecordError, match="format_version 99"):
        read_commit_record(path)
    record_file.write_text("{not json")
    with pytest.raises(CommitRecordError, match="corrupt"):
        read_commit_record(path)
    # Nested past the parser's stack: a RecursionError (a traceback) before.
    record_file.write_text("[" * 100_000)
    with pytest.raises(CommitRecordError, match="corrupt"):
        read_commit_record(path)
    record_file.unlink()
    with pytest.raises(CommitRecordError, match="not a committed step"):
        read_commit_record(path)


def test_I1_commit_record_with_unknown_checksum_is_refused_naming_it(tmp_path):
    path, _ = _record(tmp_path)
    record_file = path / "verl_ckpt_commit.json"
    raw = json.loads(record_file.read_text())
    raw["checksum_algorithm"] = "md5"
    record_file.write_text(json.dumps(raw))
    with pytest.raises(CommitRecordError, match=r"verl_ckpt_commit.json.*'md5'"):
        read_commit_record(path)


@pytest.mark.parametrize(
    "committed, keep, protected, expected",
    [
        ([1, 2, 3, 4], 2, [], [1, 2]),
        ([1, 2, 3, 4], None, [], []),
        ([4, 1, 3, 2], 1, [], [1, 2, 3]),
        ([1, 2, 3], 1, [2], [1]),  # a protected step (tracker target, in flight) stays
        ([5], 1, [], []),
        ([], 3, [], []),
    ],
)
def test_I3_retention_policy(committed, keep, protected, expected):
    assert steps_to_delete(committed, keep, protected) == expected


def test_I3_delete_removes_commit_record_first_and_next_retention_finishes(tmp_path):
    path, _ = _record(tmp_path, step=1)
    delete_step(path)
    assert list_step_dirs(tmp_path) == {}
    # A deletion interrupted after the rename: only a .deleting_ directory is left, which is
    # no step directory at all, and the next retention (after a commit) removes it.
    path, _ = _record(tmp_path, step=2)
    (path / "verl_ckpt_commit.json").unlink()
    path.rename(tmp_path / ".deleting_global_step_2")
    assert list_step_dirs(tmp_path) == {}
    assert apply_retention(tmp_path, keep=1).purged == [".deleting_global_step_2"]
    assert not (tmp_path / ".deleting_global_step_2").exists()


@pytest.mark.parametrize(
    "override, key",
    [
        ({"max_ckpt_to_keep": 0}, "checkpoint.max_ckpt_to_keep"),
        ({"resume_mode": "sometimes"}, "checkpoint.resume_mode"),
        ({"resume_mode": "resume_path"}, "checkpoint.resume_from_path"),
        # Found by review: ignored without a word unless resume_mode=resume_path.
        ({"resume_from_path": "/x/global_step_1"}, "checkpoint.resume_from_path"),
        (
            {"resume_mode": "disable", "resume_from_path": "/x/global_step_1"},
            "checkpoint.resume_from_path",
        ),
        ({"save_contents": ["model", "weights"]}, "checkpoint.save_contents"),
        ({"max_in_flight": 0}, "checkpoint.max_in_flight"),
        ({"report_group_size": -1}, "checkpoint.report_group_size"),
        ({"timeout_s": -1}, "checkpoint.timeout_s"),
        ({"writer": {"mode": "fork"}}, "checkpoint.writer.mode"),
        ({"writer": {"threads": 0}}, "checkpoint.writer.threads"),
        # From review: ignored without a word by the writer process and a synchronous save.
        (
            {"writer": {"mode": "process", "write_while_copying": True}},
            "checkpoint.writer.write_while_copying",
        ),
        (
            {"async_save": False, "writer": {"write_while_copying": True}},
            "checkpoint.writer.write_while_copying",
        ),
        ({"root_dir": ""}, "checkpoint.root_dir"),
        # A NUL byte: a bare ValueError from the first filesystem call, before.
        ({"root_dir": "ckpt\0x"}, "checkpoint.root_dir"),
        (
            {"resume_mode": "resume_path", "resume_from_path": "/x/global_step_1\0"},
            "checkpoint.resume_from_path",
        ),
    ],
)
def test_config_rejects_bad_values_naming_the_key(override, key):
    with pytest.raises(CheckpointConfigError, match=key.replace(".", r"\.")):
        to_checkpoint_config(override)


def test_config_type_errors_name_the_key():
    with pytest.raises(CheckpointConfigError, match="save_freq"):
        to_checkpoint_config({"save_freq": "often"})
    with pytest.raises(CheckpointConfigError, match=r"writer\.write_while_copying"):
        to_checkpoint_config({"writer": {"write_while_copying": "sometimes"}})
    with pytest.raises(CheckpointConfigError, match=r"checkpoint\.writer\.write_while_copying"):
        WriterConfig(write_while_copying="sometimes")
    for key in ("direct_io", "idle_class"):
        with pytest.raises(CheckpointConfigError, match=rf"writer\.{key}"):
            to_checkpoint_config({"writer": {key: "sometimes"}})


def test_config_defaults_and_dict_round_trip():
    config = to_checkpoint_config({"root_dir": "/tmp/x", "writer": {"threads": 3}})
    assert isinstance(config, CheckpointConfig)
    assert config.writer.threads == 3 and config.async_save and config.max_in_flight == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("participants", ["actor"]),
        ("committed_at", "yesterday"),
        ("step", -1),
        ("step", True),  # JSON true is a Python bool, which isinstance(..., int) accepts
        ("participants", {"actor": True}),
        ("files", [{"path": "actor/x", "size": True, "checksum": "0"}]),
    ],
)
def test_I1_commit_record_with_wrong_field_types_is_malformed(tmp_path, field, value):
    path, _ = _record(tmp_path)
    record_file = path / "verl_ckpt_commit.json"
    raw = json.loads(record_file.read_text())
    raw[field] = value
    record_file.write_text(json.dumps(raw))
    with pytest.raises(CommitRecordError, match="malformed"):
        read_commit_record(path)


def test_I1_commit_record_that_cannot_be_read_is_an_error_naming_it(tmp_path):
    """A record path that is a directory (or any read error): one CommitRecordError naming
    it, and the step does not count as committed; start-up and `ls` go on with the others."""
    path, _ = _record(tmp_path)
    record_file = path / "verl_ckpt_commit.json"
    record_file.unlink()
    record_file.mkdir()
    with pytest.raises(CommitRecordError, match=r"verl_ckpt_commit.json cannot be read"):
        read_commit_record(path)
    assert not is_committed(path)


def test_I2_tracker_with_an_absurdly_long_number_is_an_error_naming_the_path(tmp_path):
    tracker_path(tmp_path).write_bytes(b"9" * 5000 + b"\n")
    with pytest.raises(TrackerError, match="latest_checkpointed_iteration.txt"):
        read_tracker(tmp_path)


_WRITE_PAST_FILE_SIZE_CAP = """
import resource, signal, sys, torch
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.format.torch_format import save_tensor_blob
# A real OS limit: writes past 64 KiB fail with EFBIG, as a full disk fails with ENOSPC.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
writers = {
    # inside torch.save, whose C++ writer turns the OSError into a RuntimeError
    "torch.save": lambda stream: torch.save(torch.zeros(1 << 20), stream),
    # the same inside a shard's tensor blob (torch.save's writer without its CRC)
    "tensor blob": lambda stream: save_tensor_blob(torch.zeros(1 << 20), stream),
    # at the final flush of the file's buffer (the last 6 KiB stay buffered until then)
    "flush": lambda stream: (stream.write(bytes(60 * 1024)), stream.write(bytes(6 * 1024))),
}
try:
    write_checksummed(sys.argv[1], writers[sys.argv[2]])
except OSError as exc:
    print("ERRNO", exc.errno, exc.filename)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_early_writeback_runs_beside_the_writer_and_lets_go_of_the_file(tmp_path, monkeypatch):
    """sync_file_range blocks once the disk's queue is full; made by the writer itself, it
    held the writer back from the page cache (1.35x a plain write at 1 GiB per rank). The
    hints go to a helper thread: the writing thread never makes one, every byte and the
    checksum are as written, and the helper's duplicate descriptor is closed once the file is
    done (no descriptor left open per file written)."""
    import os
    import threading
    import time

    from verl_ckpt.store import fsio
    from verl_ckpt.store.checksummed_file import write_checksummed

    callers: list[str] = []
    real = fsio.start_writeback

    def observed(fd: int, offset: int, nbytes: int) -> bool:  # records who calls, then calls
        callers.append(threading.current_thread().name)
        return real(fd, offset, nbytes)

    monkeypatch.setattr(fsio, "start_writeback", observed)
    open_before = len(os.listdir("/proc/self/fd"))
    payload = os.urandom(1 << 20) * 40  # 40 MiB: a hint per write slice (writeback_every)
    path = tmp_path / "shard.distcp"
    written = write_checksummed(path, lambda stream: stream.write(payload))
    assert path.read_bytes() == payload
    assert (written.size, written.checksum) == file_checksum(path)
    deadline = time.monotonic() + 30
    while len(os.listdir("/proc/self/fd")) > open_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == open_before, "the helper kept its descriptor"
    assert callers and set(callers) == {"verl_ckpt_writeback"}, callers


_WRITE_WITH_ONE_DESCRIPTOR_LEFT = """
import os, resource, sys
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.fsio import file_checksum
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
payload = os.urandom(1 << 20) * 40  # the early writeback's helper wants a dup at the first hint
held = []
try:
    while True:  # take every descriptor but one, for real: the file's own open gets it
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    os.close(held.pop())
written = write_checksummed(sys.argv[1], lambda stream: stream.write(payload))
for fd in held:
    os.close(fd)
print("SAME", (written.size, written.checksum) == file_checksum(sys.argv[1]))
"""


def test_early_writeback_out_of_descriptors_still_writes_the_file(tmp_path):
    """The helper of the early writeback needs a duplicate descriptor; a process at its
    descriptor limit gets none, and the write goes on without hints instead of failing."""
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_WITH_ONE_DESCRIPTOR_LEFT, str(tmp_path / "f.bin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "SAME True" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("where", ["torch.save", "tensor blob", "flush"])
def test_I1_write_failure_names_the_real_cause_and_the_file(tmp_path, where):
    """A failed write must say why (EFBIG/ENOSPC) and which file, wherever it surfaces:
    torch.save's C++ writer hides the OSError behind 'unexpected pos ...', and a failed
    final flush would raise again, without the path, when the file is closed."""
    target = tmp_path / "shard.distcp"
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_PAST_FILE_SIZE_CAP, str(target), where],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"ERRNO {errno.EFBIG} {target}" in done.stdout, done.stdout + done.stderr


def test_early_writeback_is_a_hint_a_stream_that_refuses_it_still_gets_every_byte(tmp_path):
    """The checksumming stream hands written bytes to the disk early (sync_file_range);
    where a file refuses that (a pipe), writing goes on exactly as without it."""
    import os
    import threading

    from verl_ckpt.store.fsio import ChecksummingWriter, file_checksum, start_writeback

    with open(tmp_path / "f.bin", "wb") as regular:
        regular.write(b"x" * 4096)
        regular.flush()
        assert start_writeback(regular.fileno(), 0, 4096)
    read_end, write_end = os.pipe()
    received = bytearray()

    def drain() -> None:
        while chunk := os.read(read_end, 1 << 16):
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    payload = bytes(range(256)) * 4096  # 1 MiB
    with os.fdopen(write_end, "wb") as pipe:
        assert not start_writeback(pipe.fileno(), 0, 1)
        stream = ChecksummingWriter(pipe, writeback_every=1024)
        for start in range(0, len(payload), 100_000):
            stream.write(payload[start : start + 100_000])
    reader.join(timeout=30)
    os.close(read_end)
    (tmp_path / "expected.bin").write_bytes(payload)
    assert bytes(received) == payload
    assert (stream.size, stream.checksum) == file_checksum(tmp_path / "expected.bin")


def test_the_finalizer_unpickles_a_roles_plan_metadata_once_per_plan():
    """Coordinator ranks send their plan's metadata with every report, the same bytes while
    the plan holds: unpickled once, and again as soon as the bytes change (a new plan)."""
    cache = GlobalMetadataCache()

    def received(role: str, metadata: dict) -> object:
        report = RankReport(1, role, 0, 2, "save")
        report.packed_global_metadata = pickle.dumps(metadata)
        return report.unpack(cache).global_metadata

    first = received("actor", {"plan": 1})
    assert received("actor", {"plan": 1}) is first
    assert received("critic", {"plan": 1}) is not first  # one entry per role
    replanned = received("actor", {"plan": 2})
    assert replanned == {"plan": 2} and replanned is not first
    assert received("actor", {"plan": 2}) is replanned


@pytest.mark.parametrize("role", ["..", "../x", "/abs", ".hidden", "a/b", "a\\b", "", "driver"])
def test_a_role_that_is_no_plain_directory_name_is_refused_at_once_naming_it(tmp_path, role):
    """A role names a directory of every step: `..` or `../x` put the ranks' files (and the
    finalizer's directories) outside the root, where retention never reaches. The driver
    refused only `driver`, a manager only `driver`, names with `/` and the empty name.
    Both now refuse it in one line naming it, before anything starts (no Ray here)."""
    import torch.distributed as dist

    from verl_ckpt import CheckpointCoordinator, CheckpointManager

    assert not dist.is_initialized()  # the manager's check comes before its process group's
    config = {"root_dir": str(tmp_path / "ckpt")}
    with pytest.raises(CheckpointConfigError, match=r"role name .* (reserved|not a plain)"):
        CheckpointManager(config, role=role, rank=0, world_size=1)
    with pytest.raises(CheckpointConfigError, match=rf"role name {re.escape(repr(role))}"):
        CheckpointCoordinator(config, {"actor": 1, role: 1})
    assert list(tmp_path.iterdir()) == []  # not even the root was made


def test_I5_a_fifo_in_place_of_a_commit_record_is_refused_not_waited_on(tmp_path):
    """Found while putting the record's reads behind the Store seam: the tracker was read
    without blocking and only as a regular file, but the commit record was read with a plain
    open(), which waits forever for a writer when a FIFO sits in its place (a root is data
    others may write). Now both go through LocalStore.read_bytes: refused, one line."""
    import os
    import threading

    path = step_dir(tmp_path, 1)
    path.mkdir()
    os.mkfifo(path / COMMIT_RECORD_FILENAME)
    answer = {}
    reader = threading.Thread(
        target=lambda: answer.setdefault("committed", is_committed(path)), daemon=True
    )
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading the commit record waited on a FIFO"
    assert answer["committed"] is False
    with pytest.raises(CommitRecordError, match="not a regular file"):
        read_commit_record(path)


@pytest.mark.parametrize("kind", ["local", "file_url"])
def test_I1_I3_one_commit_record_tracker_and_retention_on_every_store(tmp_path, kind):
    """The same functions on a local root and on an fsspec URL (store/base.py): records
    written over the seam read back, the tracker only moves forward, retention keeps the
    newest committed step and the tracker's target, and leaves a step without a record."""
    from verl_ckpt.store.open_store import open_store
    from verl_ckpt.store.recovery import read_root_state
    from verl_ckpt.store.tracker import advance_tracker

    where = tmp_path / "tier"
    where.mkdir()
    store = open_store(str(where) if kind == "local" else f"file://{where}")
    for step in (1, 2, 3, 4):
        step_dir(where, step).mkdir()  # made by begin_step (locally), by the files (a URL)
    for step in (1, 2, 3):
        write_commit_record(store, CommitRecord(step, {"driver": 1}, []))
        assert advance_tracker(store, step) == step
    assert advance_tracker(store, 1) == 3 and read_tracker(store) == 3
    store.put_bytes("global_step_4/d.pt", b"partial")  # no record: uncommitted
    write_tracker(store, 2)  # a tracker behind: its target is kept
    outcome = apply_retention(store, keep=1)
    assert outcome.deleted == [1] and outcome.errors == []
    state = read_root_state(store)
    assert state.committed == (2, 3) and state.uncommitted == (4,) and state.tracker == 2
    assert read_commit_record(store, 3).step == 3


def test_a_publish_whose_disk_fills_up_leaves_no_temporary_file(tmp_path):
    """A file copied into a local store (a pull, a file:// tier) whose disk fills up is
    discarded whole: its temporary file goes too, even though closing it fails again (the
    buffered bytes cannot be flushed either). A real EFBIG, from RLIMIT_FSIZE in a process of
    its own. Found by review: before, the failing close skipped the unlink."""
    script = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from verl_ckpt.store.local import LocalStore
publisher = LocalStore({str(tmp_path)!r}).open_publish("a/f.bin", 1 << 16, 1 << 10)
try:
    for _ in range(64):
        publisher.write(b"x" * 1000)
except OSError:
    publisher.discard()
else:
    raise SystemExit("the limit was not hit")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == []


def test_the_driver_and_participants_write_their_files_without_torchs_checkpoint_package():
    """The driver and a participant write plain checksummed files (store/checksummed_file.py):
    the recipe's driver, its coordinator, the finalizer's actor class (which the driver
    imports to start the actor) and a participant's saver import no
    torch.distributed.checkpoint (CPU in every job's driver at start-up, which had it through
    the rank's bucket writer and the finalizer's `.metadata` forecast). The finalizer itself
    imports it when it starts."""
    probe = (
        "import sys\n"
        "import recipes.ppo_toy\n"
        "from verl_ckpt.driver import coordinator\n"
        "from verl_ckpt.commit import finalizer\n"  # the actor class the driver starts
        "from verl_ckpt.participants import saver\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]"], done.stdout


def test_a_root_under_the_home_directory_is_expanded():
    """From review: root_dir "~/ckpt" (in YAML or Python; Hydra's command line wants it
    quoted) made a directory named "~" in the working directory."""
    step = "~/x/global_step_1"
    config = to_checkpoint_config(
        {"root_dir": "~/ckpt", "resume_mode": "resume_path", "resume_from_path": step}
    )
    assert config.root_dir == os.path.expanduser("~/ckpt") != "~/ckpt"
    assert config.resume_from_path == os.path.expanduser(step)
