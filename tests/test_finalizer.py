"""The finalizer alone, in-process (no Ray): its start-up and a long soak.

I3: start-up deletes nothing. I5: its memory does not grow with the number of commits (it
keeps only steps in flight). The driver is the only participant, so every commit is a
record, a tracker move and retention, with tiny files.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import inspect
import logging
import pathlib
import pickle
import shutil
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from verl_ckpt.commit import metadata_forecast
from verl_ckpt.commit.finalizer import CheckpointFinalizer
from verl_ckpt.format.torch_format import write_item
from verl_ckpt.protocol import Failure, Phase
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.faults import ENV_VAR, ONCE_ENV_VAR
from verl_ckpt.protocol.messages import RankReport, StepStatus
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    is_committed,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import ChecksummingWriter
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_STATE_FILENAME,
    list_step_dirs,
    step_dir,
)
from verl_ckpt.store.tracker import read_tracker, write_tracker
from verl_ckpt.store.verification import verify_files

DRIVER_ONLY = {"driver": 1}
# The lines of CPython's pathlib that intern path components (3.11: in parse_parts).
_PATHLIB_INTERN_LINES = [
    number
    for number, line in enumerate(inspect.getsource(pathlib).splitlines(), start=1)
    if "sys.intern(" in line
]


@pytest.fixture
def tmpfs_root():
    """A root in /dev/shm: fsync is free there, so thousands of commits take seconds."""
    root = Path(tempfile.mkdtemp(prefix="verl_ckpt_soak", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def save_driver_step(finalizer: CheckpointFinalizer, step: int) -> None:
    directory = Path(await finalizer.begin_step(step, "driver", 0, 1, 10.0))
    written = write_checksummed(directory / DRIVER_STATE_FILENAME, lambda s: s.write(b"x"))
    entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)
    await finalizer.report(RankReport(step, "driver", 0, 1, f"save{step}", files=[entry]))
    await finalizer.wait_for_commit(step, 10.0)


def test_I3_finalizer_start_deletes_nothing_and_rolls_the_tracker_forward(tmp_path):
    """Issue "Trust" #1: the finalizer's start-up applied retention, deleting a committed
    step that a run was about to resume from."""
    for step in (30, 40):
        step_dir(tmp_path, step).mkdir()
        write_commit_record(step_dir(tmp_path, step), CommitRecord(step, DRIVER_ONLY, []))
    write_tracker(tmp_path, 30)

    async def start() -> None:
        CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)

    asyncio.run(start())
    assert sorted(list_step_dirs(tmp_path)) == [30, 40]
    assert read_tracker(tmp_path) == 40


def test_I5_a_late_success_for_a_step_the_finalizer_forgot_holds_no_step_open(tmp_path):
    """Found by review: a success report for a step the ledger does not hold (a retried call
    or a batch sent again, after the step was decided and forgotten, its record deleted by
    retention) opened that step again, with no deadline: it never expired, held the only
    max_in_flight slot, and every later begin_step was refused ("steps [7] still
    uncommitted"). Such a report is now dropped; a failure still fails its step."""
    directory = step_dir(tmp_path, 7)
    directory.mkdir()
    written = write_checksummed(directory / DRIVER_STATE_FILENAME, lambda s: s.write(b"x"))
    entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)

    async def run() -> tuple[list, str]:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)
        await finalizer.report(RankReport(7, "driver", 0, 1, "old", files=[entry]))
        pending = finalizer.status()["pending"]
        began = await finalizer.begin_step(8, "driver", 0, 1, 5.0, "save-8")
        return pending, began

    pending, began = asyncio.run(run())
    assert pending == {}, pending
    assert began.endswith("global_step_8"), began


def test_I3_what_retention_keeps_is_read_on_the_event_loop_not_the_file_thread(tmp_path):
    """Found by review: retention ran in the file thread and read the steps it must keep
    (the ledger's steps in flight, the export queue, the uploads) there, while the event
    loop kept changing them: a begin_step at that moment could raise "dictionary changed
    size during iteration" and fail that retention. They are read on the loop now. The race
    itself is not produced; where the read runs is observed."""
    threads = []

    async def run() -> threading.Thread:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)
        committer = finalizer._committer
        keeps = committer.retention_keeps

        def observed() -> list[int]:
            threads.append(threading.current_thread())
            return keeps()

        committer.retention_keeps = observed
        for step in (1, 2):
            await save_driver_step(finalizer, step)
        await finalizer.drain(10.0)
        return threading.current_thread()

    loop_thread = asyncio.run(run())
    assert threads and all(t is loop_thread for t in threads), threads
    assert sorted(list_step_dirs(tmp_path)) == [2]


def test_I5_a_begin_held_up_by_retention_names_it(tmp_path, monkeypatch):
    """Found by review: a committed step holds its max_in_flight slot until its retention
    has deleted the step it replaces; a begin_step refused meanwhile said "steps [] still
    uncommitted ...; missing reports: " and drain "the commit of steps []", naming nothing.
    Both now name the retention. (A slow deletion: the documented hook sleeps in it.)"""

    async def run() -> tuple[str, str]:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)
        await save_driver_step(finalizer, 1)
        monkeypatch.setenv(ENV_VAR, "delete=sleep=3")
        await save_driver_step(finalizer, 2)  # its retention deletes step 1, slowly
        with pytest.raises(CommitTimeoutError) as refused:
            await finalizer.begin_step(3, "driver", 0, 1, 0.5, "save-3")
        with pytest.raises(CommitTimeoutError) as undrained:
            await finalizer.drain(0.5)
        await finalizer.drain(30.0)
        return str(refused.value), str(undrained.value)

    refused, undrained = asyncio.run(run())
    assert "the retention after committed steps [2] still deleting older steps" in refused
    assert "steps []" not in refused, refused
    assert undrained.startswith("the retention after steps [2] under "), undrained


def test_I5_finalizer_memory_is_flat_over_3000_commits(tmpfs_root):
    """After 3,000 commits the finalizer holds what it held after 100: the ledger keeps
    only steps in flight, retention keeps the disk at max_ckpt_to_keep steps. 64 KiB over
    2,900 commits catches a leak of 23 bytes a commit; the finalizer's bounded caches fill
    by about 17 KiB and stop (measured). The benchmark's soak runs 10,000 commits and reports
    begin_step's latency over them (benchmarks/finalizer_scale.py)."""
    logging.getLogger("verl_ckpt").setLevel(logging.WARNING)  # no thousands of log records kept

    async def soak() -> tuple[int, int, int]:
        finalizer = CheckpointFinalizer(str(tmpfs_root), DRIVER_ONLY, max_ckpt_to_keep=2)
        for step in range(1, 101):
            await save_driver_step(finalizer, step)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for step in range(101, 3_001):
            await save_driver_step(finalizer, step)
        await finalizer.drain(10.0)
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        # CPython 3.11's pathlib interns every path component (sys.intern in parse_parts):
        # the interpreter's intern table grows to its working size once, about 8 MB after
        # some thousands of new step names, and stays there (measured flat from 10,000 to
        # 30,000 commits). That table is the interpreter's, not the finalizer's: leave it out.
        interned = [tracemalloc.Filter(False, pathlib.__file__, n) for n in _PATHLIB_INTERN_LINES]
        grown = sum(
            d.size_diff
            for d in after.filter_traces(interned).compare_to(
                before.filter_traces(interned), "filename"
            )
        )
        return grown, finalizer.status()["ledger_size"], len(finalizer._background)

    try:
        grown, ledger_size, background = asyncio.run(soak())
    finally:
        logging.getLogger("verl_ckpt").setLevel(logging.NOTSET)
    assert ledger_size == 0 and background == 0
    assert grown < 64 * 1024, f"finalizer memory grew by {grown} bytes over 2,900 commits"
    assert read_tracker(tmpfs_root) == 3_000
    assert sorted(list_step_dirs(tmpfs_root)) == [2_999, 3_000]


def test_wait_for_commit_returns_the_commit_timings_after_the_step_retired(tmp_path):
    """Regression: every notification of a waiter emptied the summaries of recent commits,
    so a caller asking once retention had run got the record's summary, with no timings
    (the benchmark's time-to-durable breakdown read zeros for half of the saves)."""

    async def run() -> dict:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)
        for step in (1, 2):
            await save_driver_step(finalizer, step)
        # Retention after step 2 ran and the step left the ledger: it is retired.
        for _ in range(1000):
            if finalizer.status()["ledger_size"] == 0:
                break
            await asyncio.sleep(0.01)
        assert finalizer.status()["ledger_size"] == 0, "step 2 was not retired within 10 s"
        return await finalizer.wait_for_commit(2, 10.0)

    summary = asyncio.run(run())
    assert summary["step"] == 2 and summary["tracker"] == 2, summary
    assert 0 < summary["ready_at"] <= summary["record_at"] <= summary["tracker_at"], summary


# ---- saves of one step: refusals, replaced saves, deadlines (two driver-like ranks) ------

TWO_RANKS = {"driver": 2}


async def write_and_report(
    finalizer, step, rank, save_id, payload=b"x" * 100, failure=None, timeout_s=10.0
):
    """One participant's save of `step`: begin_step, its file, its report."""
    directory = Path(await finalizer.begin_step(step, "driver", rank, 2, timeout_s, save_id))
    report = RankReport(step, "driver", rank, 2, save_id, failure=failure)
    if failure is None:
        name = f"part{rank}.bin"
        written = write_checksummed(directory / name, lambda s: s.write(payload))
        report.files.append(FileEntry(name, written.size, written.checksum))
    await finalizer.report(report)


def test_I1_a_second_save_of_a_reported_step_is_refused_and_the_step_verifies(tmp_path):
    """A participant saving a step again after it reported it (a restarted rank, a retry)
    overwrote the reported files while the first save's report stayed counted: the step
    committed with a record its files failed. The second save is refused before it writes."""

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        await write_and_report(finalizer, 2, 0, "first", b"a" * 100)
        with pytest.raises(CheckpointError, match="driver rank 0 already reported step 2"):
            await finalizer.begin_step(2, "driver", 0, 2, 10.0, "second")
        await write_and_report(finalizer, 2, 1, "other")
        await finalizer.wait_for_commit(2, 10.0)

    asyncio.run(run())
    path = step_dir(tmp_path, 2)
    assert verify_files(path, read_commit_record(path)) == []


def test_I1_the_report_of_a_replaced_save_is_ignored_and_the_step_verifies(tmp_path):
    """A restarted rank saves again before its first save reported: the first save's late
    report (of bytes the second save overwrote) is ignored; the second's counts."""

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        await finalizer.begin_step(3, "driver", 0, 2, 10.0, "first")
        await write_and_report(finalizer, 3, 0, "second", b"b" * 100)
        late = RankReport(3, "driver", 0, 2, "first", files=[FileEntry("part0.bin", 100, "0")])
        await finalizer.report(late)
        await write_and_report(finalizer, 3, 1, "other")
        await finalizer.wait_for_commit(3, 10.0)

    asyncio.run(run())
    path = step_dir(tmp_path, 3)
    assert verify_files(path, read_commit_record(path)) == []


def test_I1_a_report_whose_file_has_another_size_when_it_arrives_fails_the_step(tmp_path):
    """Each report's files are checked as the report arrives (off the commit's path, which
    at thousands of ranks those stats dominated): a file of another size than reported
    fails the step, naming the file, and nothing is committed."""
    report = None

    async def run() -> None:
        nonlocal report
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        directory = Path(await finalizer.begin_step(4, "driver", 0, 2, 10.0, "torn"))
        written = write_checksummed(directory / "part0.bin", lambda s: s.write(b"t" * 100))
        report = RankReport(4, "driver", 0, 2, "torn")
        report.files.append(FileEntry("part0.bin", written.size + 20, written.checksum))
        # What a rank's own report says of its files is not taken (a node aggregator's is).
        report.files_on_arrival, report.files_checked_on = "", "node-a"
        await finalizer.report(report)
        await write_and_report(finalizer, 4, 1, "other")
        with pytest.raises(StepNotCommittedError, match=r"part0.bin: reported by driver rank 0 "):
            await finalizer.wait_for_commit(4, 10.0)

    asyncio.run(run())
    assert "with 120 bytes, found 100" in report.files_on_arrival
    # Checked here as a rank's own report, not confirmed as a node's check.
    assert "is the root shared" not in report.files_on_arrival
    assert not is_committed(step_dir(tmp_path, 4))
    assert read_tracker(tmp_path) is None


def test_I5_a_reported_file_that_cannot_be_looked_at_fails_the_step_naming_it(tmp_path):
    """A reported file whose lookup fails with something other than "no such file" (here a
    real ELOOP: a directory of the step that is a link to itself) used to raise out of the
    finalizer's intake, the report uncounted, and the step then waited for its deadline.
    Now it is the report's problem: the report is taken, and the step fails at once naming
    the file."""
    answer = None

    async def run() -> None:
        nonlocal answer
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        directory = Path(await finalizer.begin_step(4, "driver", 0, 2, 10.0, "loop"))
        (directory / "loop").symlink_to("loop")
        report = RankReport(4, "driver", 0, 2, "loop")
        report.files.append(FileEntry("loop/part0.bin", 10, "0"))
        answer = await finalizer.report(report)
        await write_and_report(finalizer, 4, 1, "other")
        with pytest.raises(StepNotCommittedError, match=r"loop/part0.bin: the files of driver "):
            await finalizer.wait_for_commit(4, 10.0)

    asyncio.run(run())
    assert answer is None
    assert not is_committed(step_dir(tmp_path, 4))


def test_I5_saving_a_failed_step_again_is_refused_naming_the_failure(tmp_path):
    """Re-saving a step number that failed used to be accepted and then silently dropped
    (every report ignored, the old failure raised to the waiter)."""

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        full = Failure("driver", 0, Phase.WRITE, "OSError: no space left", 28)
        await write_and_report(finalizer, 5, 0, "first", failure=full)
        with pytest.raises(CheckpointError, match=r"step 5 .*failed .*saved once.*no space"):
            await finalizer.begin_step(5, "driver", 1, 2, 10.0, "retry")
        await write_and_report(finalizer, 6, 0, "a")
        await write_and_report(finalizer, 6, 1, "b")
        await finalizer.wait_for_commit(6, 10.0)

    asyncio.run(run())
    assert read_tracker(tmp_path) == 6


def test_I5_a_step_whose_participant_never_reports_fails_at_its_deadline(tmp_path, monkeypatch):
    """A participant that never reports (it died, or its save() raised before saving this
    step) kept the step collecting for ever: with max_in_flight=1 no later step could start.
    The step now fails once its deadline passed (the report slack is shortened here), naming
    who is missing, and the next step starts."""
    monkeypatch.setattr("verl_ckpt.commit.admission.RPC_SLACK_S", 0.1)

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        await finalizer.begin_step(7, "driver", 1, 2, 0.2, "silent")
        await write_and_report(finalizer, 7, 0, "a", timeout_s=0.2)
        # Step 8 waits for room until step 7's deadline, then starts.
        await write_and_report(finalizer, 8, 0, "c")
        await write_and_report(finalizer, 8, 1, "d")
        await finalizer.wait_for_commit(8, 10.0)
        with pytest.raises(StepNotCommittedError, match="no report by the step's deadline"):
            await finalizer.wait_for_commit(7, 1.0)

    asyncio.run(run())
    assert read_tracker(tmp_path) == 8


# ---- an uncommitted leftover, removed by begin_step ---------------------------------------


def leftover_of_an_earlier_run(root: Path, step: int) -> Path:
    """A step directory an earlier run began and never committed (no commit record)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "part0.bin").write_bytes(b"stale" * 1000)
    return path


async def file_within(path: Path, timeout_s: float = 30.0) -> None:
    """Wait on the event loop (it must stay free) until `path` exists."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s}s"
        await asyncio.sleep(0.01)


def test_I3_a_leftover_is_removed_after_the_retention_under_way_not_beside_it(
    tmp_path, monkeypatch
):
    """begin_step removes an uncommitted leftover of its step; it did so at once, while a
    retention deleted steps in its thread, both in the same root: both could remove the same
    `.deleting_*` directory, one then failing with FileNotFoundError (a begin_step doing so
    failed the save). The removal now waits for the file work under way. Here the retention
    after step 2's commit is slowed (the fault hook, once: a deletion cannot be made slow at
    will) while it deletes step 1; step 3's leftover must go only after that deletion ended,
    and before begin_step returns."""
    root = tmp_path / "ckpt"
    leftover = leftover_of_an_earlier_run(root, 3)
    marker = tmp_path / "deletion_slowed"

    async def run() -> bool:
        finalizer = CheckpointFinalizer(str(root), DRIVER_ONLY, max_ckpt_to_keep=1, max_in_flight=2)
        await save_driver_step(finalizer, 1)
        monkeypatch.setenv(ENV_VAR, "delete=sleep=1")
        monkeypatch.setenv(ONCE_ENV_VAR, str(marker))
        await save_driver_step(finalizer, 2)
        await file_within(marker)  # retention of step 1 started (in its thread), and sleeps
        # max_in_flight=2: step 3 has room while step 2's retention runs.
        directory = Path(await finalizer.begin_step(3, "driver", 0, 1, 10.0))
        retention_still_deleting = (root / ".deleting_global_step_1").exists()
        assert list(directory.iterdir()) == [], "the leftover's files are still there"
        await finalizer.drain(30.0)
        return retention_still_deleting

    retention_still_deleting = asyncio.run(run())
    assert not retention_still_deleting, "begin_step removed the leftover beside retention"
    assert leftover.is_dir() and not (leftover / "part0.bin").exists()
    assert sorted(list_step_dirs(root)) == [2, 3]
    assert not list(root.glob(".deleting_*"))


def test_I5_the_finalizer_answers_while_a_large_leftover_is_removed(tmp_path, monkeypatch):
    """The removal of a leftover ran on the finalizer's event loop: no other call (reports,
    waits, other steps) was answered until its whole directory was deleted. Here that
    deletion is slowed for 3 s (the fault hook, once: a large leftover whose deletion takes
    that long is not made at will); another call is answered meanwhile, and both
    participants of the step get their directory only once the leftover is gone."""
    leftover = leftover_of_an_earlier_run(tmp_path, 3)
    marker = tmp_path / "deletion_slowed"

    async def run() -> tuple[bool, list[str]]:
        finalizer = CheckpointFinalizer(str(tmp_path), TWO_RANKS, max_ckpt_to_keep=None)
        await write_and_report(finalizer, 1, 0, "a")
        await write_and_report(finalizer, 1, 1, "b")
        await finalizer.wait_for_commit(1, 10.0)
        monkeypatch.setenv(ENV_VAR, "delete=sleep=3")
        monkeypatch.setenv(ONCE_ENV_VAR, str(marker))
        begins = [
            asyncio.create_task(finalizer.begin_step(3, "driver", rank, 2, 10.0, f"s{rank}"))
            for rank in (0, 1)
        ]
        await file_within(marker)  # the removal started, and sleeps
        await finalizer.wait_for_commit(1, 10.0)  # another call, answered meanwhile
        answered_while_removing = not any(task.done() for task in begins)
        return answered_while_removing, await asyncio.gather(*begins)

    answered_while_removing, directories = asyncio.run(run())
    assert answered_while_removing, "no other call was answered while the leftover was removed"
    assert directories == [str(leftover)] * 2
    assert not (leftover / "part0.bin").exists()
    assert not list(tmp_path.glob(".deleting_*"))


def test_I5_a_begin_step_whose_leftover_waits_for_the_file_work_ends_at_its_deadline(
    tmp_path, monkeypatch
):
    """The removal of a leftover waits for the commit or retention under way (they share the
    root's file work); begin_step's deadline covers that wait. Before, it waited past its
    timeout_s for as long as the retention took, and the rank, whose own wait ends at
    timeout_s plus the call's slack, heard only that the finalizer did not answer. Here the
    retention after step 2's commit is slowed for 3 s (the fault hook, once); begin_step(3)
    with 0.5 s fails naming the leftover; once the retention ended the step starts."""
    root = tmp_path / "ckpt"
    leftover = leftover_of_an_earlier_run(root, 3)
    marker = tmp_path / "deletion_slowed"

    async def run() -> tuple[BaseException | None, str]:
        finalizer = CheckpointFinalizer(str(root), DRIVER_ONLY, max_ckpt_to_keep=1, max_in_flight=2)
        await save_driver_step(finalizer, 1)
        monkeypatch.setenv(ENV_VAR, "delete=sleep=3")
        monkeypatch.setenv(ONCE_ENV_VAR, str(marker))
        await save_driver_step(finalizer, 2)
        await file_within(marker)  # retention of step 1 holds the file work, and sleeps
        error = None
        try:
            await finalizer.begin_step(3, "driver", 0, 1, 0.5)
        except CheckpointError as exc:
            error = exc
        directory = await finalizer.begin_step(3, "driver", 0, 1, 30.0)
        await finalizer.drain(30.0)
        return error, directory

    error, directory = asyncio.run(run())
    assert isinstance(error, CommitTimeoutError), error
    assert str(leftover) in str(error) and "not removed within" in str(error), error
    assert directory == str(leftover) and not (leftover / "part0.bin").exists()


def test_I5_a_leftover_whose_files_outlive_its_rename_lets_the_step_start(tmp_path, monkeypatch):
    """delete_step_dir first renames a step out of its name, then deletes its files. A
    failure in between (here ENOSPC from the fault hook, once: a delete failing for real on a
    healthy disk cannot be made) leaves only a `.deleting_*` directory, which no loader reads
    and retention purges: the step can start. Before, the OSError went back to the rank as a
    remote traceback and failed the save."""
    leftover = leftover_of_an_earlier_run(tmp_path, 3)
    monkeypatch.setenv(ENV_VAR, "delete=enospc")
    monkeypatch.setenv(ONCE_ENV_VAR, str(tmp_path / "fired"))

    async def run() -> str:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=None)
        return await finalizer.begin_step(3, "driver", 0, 1, 10.0)

    assert asyncio.run(run()) == str(leftover)
    assert not (leftover / "part0.bin").exists()
    assert (tmp_path / ".deleting_global_step_3" / "part0.bin").exists()


def test_a_leftover_that_cannot_leave_the_step_namespace_is_one_line_naming_it(tmp_path):
    """A leftover that stays under its step's name cannot be saved over: begin_step refuses in
    one line naming what could not be removed (here a file in the place of the removal's
    `.deleting_*` directory, a real fault; before, a NotADirectoryError as a traceback)."""
    leftover = leftover_of_an_earlier_run(tmp_path, 3)
    blocker = tmp_path / ".deleting_global_step_3"
    blocker.write_bytes(b"not a directory")

    async def run() -> BaseException:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=None)
        with pytest.raises(CheckpointError) as caught:
            await finalizer.begin_step(3, "driver", 0, 1, 10.0)
        return caught.value

    error = asyncio.run(run())
    assert str(blocker) in str(error) and "could not be removed" in str(error), error
    assert "\n" not in str(error)
    assert (leftover / "part0.bin").exists()


# ---- a role's `.metadata`, forecast while its ranks write (metadata_forecast) -------------

ACTOR = {"actor": 2}
WIDTH = 8


def _actor_plan() -> bytes:
    """The DCP plan metadata of one [2, WIDTH] tensor, a row per rank, pickled once as a
    coordinator rank sends it (megatron_compat.PreparedSave)."""
    properties = TensorProperties.create_from_tensor(torch.zeros(1, WIDTH))
    chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, WIDTH])) for r in (0, 1)]
    sizes = torch.Size([2, WIDTH])
    plan = Metadata(state_dict_metadata={"w": TensorStorageMetadata(properties, sizes, chunks)})
    return pickle.dumps(plan, pickle.HIGHEST_PROTOCOL)


async def save_actor_step(
    finalizer,
    step: int,
    plan: bytes,
    gap: tuple[int, int],
    wait: bool = True,
    after_reports: Any = None,
) -> None:
    """Both ranks write their row of step `step` (values 10 * step + rank) after `gap` bytes
    of their file, and report it packed as ranks do. Both begin first, as ranks do; before
    the reports, the forecast of the step's `.metadata` (if any) is given time to be made: a
    commit never waits for it, and the test must not depend on how busy the machine is."""
    directories = [
        Path(await finalizer.begin_step(step, "actor", rank, 2, 10.0, f"s{step}r{rank}"))
        for rank in (0, 1)
    ]
    if wait:
        await _forecast_made(finalizer, step)
    for rank, directory in enumerate(directories):
        save_id = f"s{step}r{rank}"
        name = f"__{rank}_0.distcp"
        offsets = torch.Size([rank, 0])
        item = WriteItem(
            index=MetadataIndex("w", offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets, torch.Size([1, WIDTH])),
                properties=TensorProperties.create_from_tensor(torch.zeros(1, WIDTH)),
                size=torch.Size([2, WIDTH]),
            ),
        )
        row = torch.full((1, WIDTH), float(10 * step + rank))
        with open(directory / name, "wb") as raw:
            stream = ChecksummingWriter(raw)
            stream.write(bytes(gap[rank]))
            result = write_item(_StorageWriterTransforms(), stream, row, item, name)
        entry = FileEntry(f"actor/{name}", stream.size, stream.checksum)
        report = RankReport(step, "actor", rank, 2, save_id, files=[entry])
        report.write_results = [result]
        if rank == 0:
            report.packed_global_metadata = plan
        await finalizer.report(report.pack())
    if after_reports is not None:
        await after_reports()  # the step's commit started, and has not been waited for
    await finalizer.wait_for_commit(step, 10.0)


async def _forecast_made(finalizer, step: int, timeout_s: float = 30.0) -> None:
    forecast = finalizer._forecast
    if forecast._last.get("actor") is None:
        return  # nothing committed before: no forecast
    deadline = time.monotonic() + timeout_s
    while not forecast.ready(step, "actor"):
        assert time.monotonic() < deadline, f"the forecast of step {step} was not made"
        await asyncio.sleep(0.01)


def test_I1_I7_a_forecast_metadata_is_used_only_when_every_rank_reports_the_same_bytes(tmp_path):
    """Step 2 reports what step 1 did (the role's plan and every rank's write results): its
    `.metadata`, made while the ranks wrote, is used. At step 3 rank 1's row moved within its
    file (same plan, other write results): the forecast made from step 2 must not be used,
    or the step would commit pointing at step 2's offsets. Step 4 repeats step 3's layout.
    Every step loads back, with DCP, exactly what its ranks wrote."""
    plan = _actor_plan()
    layouts = {1: (0, 0), 2: (0, 0), 3: (0, 64), 4: (0, 64)}

    async def run() -> list[dict]:
        finalizer = CheckpointFinalizer(str(tmp_path), ACTOR, max_ckpt_to_keep=None)
        seen = []
        for step, gap in layouts.items():
            await save_actor_step(finalizer, step, plan, gap)
            seen.append(dict(finalizer.status()["metadata_forecasts"]))
        return seen

    seen = asyncio.run(run())
    assert seen == [
        {"used": 0, "missed": 0, "late": 0},  # nothing committed before: no forecast
        {"used": 1, "missed": 0, "late": 0},
        {"used": 1, "missed": 1, "late": 0},  # rank 1's write results changed
        {"used": 2, "missed": 1, "late": 0},
    ]
    for step in layouts:
        directory = step_dir(tmp_path, step) / "actor"
        loaded = {"w": torch.zeros(2, WIDTH)}
        dcp.load(loaded, checkpoint_id=directory, no_dist=True)
        expected = torch.stack([torch.full((WIDTH,), float(10 * step + r)) for r in (0, 1)])
        assert torch.equal(loaded["w"], expected), step
        with open(directory / ".metadata", "rb") as f:
            assert Path(pickle.load(f).storage_meta.checkpoint_id) == directory
        assert (
            verify_files(step_dir(tmp_path, step), read_commit_record(step_dir(tmp_path, step)))
            == []
        )


def test_a_forecast_starts_once_every_rank_of_its_role_began(tmp_path):
    """The forecast holds the finalizer's GIL for most of its work: started at a role's
    first begin, it would slow every other begin of the step (16,384 ranks' begins took
    2.5x as long). It starts when the role's last rank joins, once: a retried begin before
    that starts none, nor does one while the step commits (Ray retried the call: the same
    save id, which the finalizer answers as joined), and one after the commit is refused."""
    plan = _actor_plan()

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), ACTOR, max_ckpt_to_keep=None)
        pending = finalizer._forecast._pending
        await save_actor_step(finalizer, 1, plan, (0, 0))
        await finalizer.begin_step(2, "actor", 0, 2, 10.0, "s2r0")
        await finalizer.begin_step(2, "actor", 0, 2, 10.0, "s2r0")  # Ray retried the call
        assert (2, "actor") not in pending
        await finalizer.begin_step(2, "actor", 1, 2, 10.0, "s2r1")
        assert list(pending) == [(2, "actor")]

        async def retried_while_committing() -> None:
            # Until the commit's task took the forecast (once it holds the root's file work,
            # which the retention after step 1 may still hold); its file work then runs on
            # a thread, for longer than one turn of the event loop, and the begin below
            # never yields.
            deadline = time.monotonic() + 30.0
            while pending and time.monotonic() < deadline:
                await asyncio.sleep(0)
            assert list(pending) == []
            assert finalizer._ledger.status(2) is StepStatus.COMMITTING
            await finalizer.begin_step(2, "actor", 1, 2, 10.0, "s2r1")
            assert list(pending) == []

        # Step 2's saves as ranks make them (they begin again: the same save ids).
        await save_actor_step(finalizer, 2, plan, (0, 0), after_reports=retried_while_committing)
        assert finalizer.status()["metadata_forecasts"] == {"used": 1, "missed": 0, "late": 0}
        with pytest.raises(CheckpointError, match="already committed"):
            await finalizer.begin_step(2, "actor", 1, 2, 10.0, "s2r1")  # retried after it
        assert list(pending) == []

    asyncio.run(run())


def test_I5_a_commit_never_waits_for_its_forecast(tmp_path, monkeypatch):
    """The forecast thread runs only on an idle core: on a busy machine it may not run at
    all. A commit whose forecast is not made yet makes the `.metadata` itself, at once.
    (A forecast held until the test ends stands in for the busy machine: starving an
    idle-class thread for real depends on everything else the machine runs.)"""
    plan = _actor_plan()
    release = threading.Event()
    made_for_real = metadata_forecast._forecast_file

    def held(directory, inputs):
        release.wait(60.0)
        return made_for_real(directory, inputs)

    async def run() -> dict:
        finalizer = CheckpointFinalizer(str(tmp_path), ACTOR, max_ckpt_to_keep=None)
        await save_actor_step(finalizer, 1, plan, (0, 0))
        monkeypatch.setattr(metadata_forecast, "_forecast_file", held)
        try:
            await asyncio.wait_for(save_actor_step(finalizer, 2, plan, (0, 0), wait=False), 20.0)
        finally:
            release.set()
        return dict(finalizer.status()["metadata_forecasts"])

    assert asyncio.run(run()) == {"used": 0, "missed": 0, "late": 1}
    directory = step_dir(tmp_path, 2) / "actor"
    loaded = {"w": torch.zeros(2, WIDTH)}
    dcp.load(loaded, checkpoint_id=directory, no_dist=True)
    assert torch.equal(loaded["w"][1], torch.full((WIDTH,), 21.0))


def test_I3_no_step_is_deleted_after_a_tracker_move_that_was_not_made_durable(
    tmp_path, monkeypatch
):
    """Found by review: the root's fsync after the tracker's rename to step 2 failed (logged:
    a power loss may bring back the tracker naming step 1), and retention with
    max_ckpt_to_keep=1 deleted step 1 all the same, leaving nothing that such a tracker
    names. Retention now waits for a commit whose tracker is durable (step 3 here). A
    failing directory fsync cannot be produced for real here (it needs a failing device):
    injected, EIO on the root's fsync while the tracker names step 2."""
    from verl_ckpt.store import fsio

    real_fsync_dir = fsio.fsync_dir
    fired = []

    def root_fsync_failing_under_tracker_2(path):
        if Path(path) == tmp_path and read_tracker(tmp_path) == 2:
            fired.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)
        await save_driver_step(finalizer, 1)
        monkeypatch.setattr(fsio, "fsync_dir", root_fsync_failing_under_tracker_2)
        await save_driver_step(finalizer, 2)
        await finalizer.drain(10.0)
        assert fired, "the injected fault never fired"
        assert sorted(list_step_dirs(tmp_path)) == [1, 2]
        monkeypatch.setattr(fsio, "fsync_dir", real_fsync_dir)
        await save_driver_step(finalizer, 3)
        await finalizer.drain(10.0)

    asyncio.run(run())
    assert read_tracker(tmp_path) == 3 and sorted(list_step_dirs(tmp_path)) == [3]


@pytest.mark.parametrize("step", [-1, 10**18, True])
def test_a_step_number_no_root_can_hold_is_refused_before_anything_is_written(tmp_path, step):
    """From review: a save of step 10**18 (19 digits) wrote every byte into a directory that
    no listing counts as a step, then failed at the tracker; -1 made `global_step_-1`."""

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, max_ckpt_to_keep=1)
        with pytest.raises(CheckpointError, match=r"a step cannot be saved under .*: step"):
            await finalizer.begin_step(step, "driver", 0, 1, 10.0)

    asyncio.run(run())
    assert not any(p.name.startswith("global_step_") for p in tmp_path.iterdir())


def test_I5_drain_waits_for_a_commit_that_began_while_it_waited(tmp_path, monkeypatch):
    """From the last review's leads: drain() (the coordinator's close, before it kills the
    finalizer) waited only for the tasks under way when it was called. A report that
    completed another step while it waited started that step's commit, which drain() did
    not wait for: the finalizer would be killed in the middle of it. Each commit is slowed
    by the fault hook (a commit of a few files is otherwise over before a test can act)."""
    monkeypatch.setenv(ENV_VAR, "commit=sleep=1")

    async def report(finalizer: CheckpointFinalizer, step: int, directory: Path) -> None:
        written = write_checksummed(directory / DRIVER_STATE_FILENAME, lambda s: s.write(b"x"))
        entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)
        await finalizer.report(RankReport(step, "driver", 0, 1, f"save{step}", files=[entry]))

    async def run() -> list[int]:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, None, max_in_flight=2)
        first = Path(await finalizer.begin_step(1, "driver", 0, 1, 30.0))
        second = Path(await finalizer.begin_step(2, "driver", 0, 1, 30.0))
        await report(finalizer, 1, first)  # step 1's commit starts (and takes 1 s)
        drained = asyncio.create_task(finalizer.drain(30.0))
        await asyncio.sleep(0.2)
        assert not drained.done(), "drain() did not wait for step 1's commit"
        await report(finalizer, 2, second)  # step 2's commit starts while drain() waits
        return await drained

    assert asyncio.run(run()) == []
    assert read_tracker(tmp_path) == 2, "drain() returned before step 2's commit ended"


@pytest.mark.parametrize("arrives", ["after the drain", "while the drain answers"])
def test_I5_after_a_closing_drain_a_last_report_fails_its_step_instead_of_committing(
    tmp_path, arrives
):
    """From the last review's leads: the coordinator's close() drains, then waits for the
    Hugging Face exports, then kills the finalizer. A step's last report that arrived after
    the drain (while close() waited for the exports) started a commit, which the kill could
    cut between the commit record and the tracker, though close() had logged that the step
    would not commit. After a closing drain the step fails instead, naming the close. "while
    the drain answers" (helper-56's review of the fix): a report run by the actor's loop in
    the turn drain() yields before its answer is sealed out too."""

    async def run() -> tuple[list[int], str]:
        finalizer = CheckpointFinalizer(str(tmp_path), DRIVER_ONLY, None)
        directory = Path(await finalizer.begin_step(1, "driver", 0, 1, 30.0))
        written = write_checksummed(directory / DRIVER_STATE_FILENAME, lambda s: s.write(b"x"))
        entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)
        last_report = RankReport(1, "driver", 0, 1, "save1", files=[entry])
        if arrives == "after the drain":
            uncommitted = await finalizer.drain(10.0, closing=True)
            await finalizer.report(last_report)
        else:
            # Both queued on the loop, the drain first (as the actor runs concurrent calls):
            # the report runs when the drain first yields.
            draining = asyncio.create_task(finalizer.drain(10.0, closing=True))
            reporting = asyncio.create_task(finalizer.report(last_report))
            uncommitted, _ = await asyncio.gather(draining, reporting)
        with pytest.raises(StepNotCommittedError) as failed:
            await finalizer.wait_for_commit(1, 10.0)
        return uncommitted, str(failed.value)

    uncommitted, failure = asyncio.run(run())
    # While the drain answered, the step had failed already: it is no longer in flight.
    assert uncommitted == ([1] if arrives == "after the drain" else [])
    assert f"the coordinator of {tmp_path} closed before its last report arrived" in failure
    assert read_tracker(tmp_path) is None
    assert not (step_dir(tmp_path, 1) / COMMIT_RECORD_FILENAME).exists()
