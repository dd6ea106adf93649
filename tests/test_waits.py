"""Waits in the rank (I5): every wait has a deadline, and none swallows Ctrl-C.

Real signals and real threads; no Ray."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures

import pytest

from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.rank.pending_writes import PendingWrites


def interrupt_soon(delay_s: float = 0.3) -> threading.Timer:
    """A real SIGINT to this process, as Ctrl-C in the trainer's terminal sends."""
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture
def ctrl_c_raises():
    """SIGINT handled as in a trainer started from a terminal (KeyboardInterrupt). A test
    run started in the background of a shell inherits SIGINT ignored, and Python keeps it
    so: without this, such a run would wait out the deadline whatever the code does."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("wait", ["wait_for_room", "drain"])
def test_I5_ctrl_c_while_waiting_for_a_save_is_never_swallowed(wait, ctrl_c_raises):
    """The rank's wait loops caught BaseException around each wait and carried on, so
    Ctrl-C during save() back-pressure, wait() or close() was lost until the deadline."""
    saves = PendingWrites(limit=1, owner="actor rank 0", timeout_s=60)
    saves.add(1, time.monotonic() + 60, Future(), stats=None)  # a write that never ends
    timer = interrupt_soon()
    try:
        with pytest.raises(KeyboardInterrupt):
            if wait == "wait_for_room":
                saves.wait_for_room()
            else:
                saves.drain(time.monotonic() + 60)
    finally:
        timer.cancel()


def test_I5_back_pressure_names_the_step_still_writing_at_its_deadline():
    saves = PendingWrites(limit=1, owner="critic rank 0", timeout_s=0.2)
    saves.add(7, time.monotonic() + 0.2, Future(), stats=None)
    with pytest.raises(CommitTimeoutError, match="critic rank 0: the write of step 7 is still"):
        saves.wait_for_room()


def test_I5_a_failed_save_is_raised_once_and_finished_saves_are_collected():
    saves = PendingWrites(limit=2, owner="actor rank 1", timeout_s=5)
    done, failed = Future(), Future()
    done.set_result(None)
    failed.set_exception(RuntimeError("disk on fire"))
    saves.add(1, time.monotonic() + 5, done, stats="stats of 1")
    saves.add(2, time.monotonic() + 5, failed, stats="stats of 2")
    with pytest.raises(RuntimeError, match="disk on fire"):
        saves.wait_for_room()
    saves.wait_for_room()  # raised once only
    assert saves.take_completed() == ["stats of 1"] and len(saves) == 0


def test_I5_daemon_pool_close_is_bounded_and_names_a_hung_task():
    pool = DaemonPool(1, "test_pool")
    running, release = threading.Event(), threading.Event()

    def hang() -> bool:
        running.set()
        return release.wait(30)

    hung = pool.submit(hang, label="write /ckpt/__0_0.distcp")
    assert running.wait(10)
    queued = [pool.submit(time.sleep, 0) for _ in range(3)]  # never started: cancelled
    started = time.monotonic()
    stuck = pool.close(0.5)
    assert stuck == ["write /ckpt/__0_0.distcp"]
    assert time.monotonic() - started < 5  # bounded by its deadline, not by the task
    release.set()
    assert hung.result(timeout=5) is True
    _, not_done = wait_for_futures(queued, timeout=5)  # the freed thread cancels them
    assert not not_done and all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(time.sleep, 0)


def test_a_pause_takes_hold_inside_a_large_write(monkeypatch):
    """A tensor's bytes reach the writer in one call (torch_format's blobs): a pause that
    starts while it is written must hold the rest of it back, not only the next tensor.
    The pause is started from inside the first slice's write (a BytesIO that clears the
    gate): the one moment a real quiet() could not be placed at on purpose."""
    from verl_ckpt.store import fsio

    monkeypatch.setattr(fsio, "_WRITE_SLICE", 4)
    gate = threading.Event()
    gate.set()

    first_slice = threading.Event()

    class PausesAfterFirstSlice(io.BytesIO):
        def write(self, data) -> int:
            if self.tell() == 0:
                gate.clear()  # the trainer enters quiet() while the first slice is written
                first_slice.set()
            return super().write(data)

    raw = PausesAfterFirstSlice()
    stream = fsio.ChecksummingWriter(raw, gate, writeback_every=0)
    writer = threading.Thread(target=stream.write, args=(b"aaaabbbbcccc",))
    writer.start()
    # Timed from the pause, not from the thread's start: on 2 loaded cores the thread may
    # reach its first write late.
    assert first_slice.wait(10), "the writer thread never wrote"
    writer.join(0.3)
    assert raw.getvalue() == b"aaaa", "the rest of the tensor was written during the pause"
    gate.set()  # quiet() ends: the write goes on where it stopped
    writer.join(10)
    assert not writer.is_alive() and raw.getvalue() == b"aaaabbbbcccc"
    assert stream.size == 12


def test_I5_paused_writes_wait_between_calls_and_a_lost_resume_ends_by_itself(
    tmp_path, monkeypatch
):
    """CheckpointManager.quiet() holds background writes back while the trainer's update
    runs; a pause whose resume never comes (an optimizer step that raised) is bounded."""
    from verl_ckpt.store import fsio
    from verl_ckpt.store.checksummed_file import write_checksummed

    gate = threading.Event()  # cleared: paused
    wrote = threading.Event()
    writer = threading.Thread(
        target=lambda: (
            write_checksummed(tmp_path / "a", lambda s: s.write(b"x"), gate),
            wrote.set(),
        )
    )
    writer.start()
    assert not wrote.wait(0.3), "a paused write went through"
    gate.set()
    assert wrote.wait(10)
    writer.join(10)
    monkeypatch.setattr(fsio, "MAX_PAUSE_S", 0.2)
    lost = threading.Event()  # paused, and nobody resumes
    write_checksummed(tmp_path / "b", lambda s: (s.write(b"y"), s.write(b"z")), lost)
    assert (tmp_path / "b").read_bytes() == b"yz" and lost.is_set()  # reopened once, for good
