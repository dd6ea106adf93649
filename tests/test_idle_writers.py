"""Writer threads in the idle class (writer.idle_class, protocol/threads.py): they take no
share of a core the trainer wants, and one starved of every core leaves the class so that a
save always ends. Real scheduling classes, real busy processes pinned to one core."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from verl_ckpt.protocol import threads
from verl_ckpt.protocol.threads import DaemonPool, idle_until_starved, made_progress

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not threads._may_leave_idle(),
    reason="needs Linux and the right to leave SCHED_IDLE (CAP_SYS_NICE or RLIMIT_NICE)",
)


def _in_thread(work):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the thread did not end within 60 s"
    return out[0]


def test_a_thread_stays_idle_while_its_work_progresses_and_leaves_when_starved(monkeypatch):
    monkeypatch.setattr(threads, "_CHECK_EVERY_S", 0.0)  # every call checks

    def work():
        assert idle_until_starved(10)
        seen = [os.sched_getscheduler(0)]
        made_progress()  # no wait for a core since: stays
        seen.append(os.sched_getscheduler(0))
        # Any wait at all counts as starved now (the threshold, not the kernel's count, is
        # changed): the thread leaves for the normal class at its niceness.
        monkeypatch.setattr(threads, "STARVED_AFTER_S", -1.0)
        made_progress()
        seen.append(os.sched_getscheduler(0))
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return seen

    assert _in_thread(work) == [os.SCHED_IDLE, os.SCHED_IDLE, os.SCHED_OTHER, 10]


def test_the_writer_pool_runs_each_call_idle_again_after_one_starved(monkeypatch):
    monkeypatch.setattr(threads, "_CHECK_EVERY_S", 0.0)  # every call checks
    pool = DaemonPool(1, "test_idle_pool", nice=10, idle_until_starved=True)
    try:

        def starved_call():
            before = os.sched_getscheduler(0)
            monkeypatch.setattr(threads, "STARVED_AFTER_S", -1.0)
            made_progress()
            monkeypatch.setattr(threads, "STARVED_AFTER_S", 0.5)
            return before, os.sched_getscheduler(0)

        assert pool.submit(starved_call).result(60) == (os.SCHED_IDLE, os.SCHED_OTHER)
        assert pool.submit(lambda: os.sched_getscheduler(0)).result(60) == os.SCHED_IDLE
    finally:
        assert pool.close(30) == []


def test_progress_reads_the_kernels_count_at_most_every_check_interval(monkeypatch):
    """A save makes hundreds of small writes: made_progress reads /proc (the thread's
    schedstat) once per _CHECK_EVERY_S, not once per write."""
    reads = []
    real = threads._waited_for_cores_s
    monkeypatch.setattr(threads, "_waited_for_cores_s", lambda: reads.append(1) or real())

    def work():
        assert idle_until_starved(10)
        reads.clear()
        for _ in range(1000):
            made_progress()
        within = len(reads)
        time.sleep(threads._CHECK_EVERY_S * 2)
        made_progress()
        return within, len(reads)

    within, after = _in_thread(work)
    assert within <= 5 and after == within + 1


def test_a_write_starved_of_its_only_core_leaves_the_idle_class_and_ends(tmp_path):
    """A busy process at nice 0 and the idle writer share one core (both pinned to it): the
    writer gets next to nothing of it until it has waited STARVED_AFTER_S for the core, then
    goes on at its niceness and finishes. Through the direct path, as a rank's writer."""
    from verl_ckpt.store.checksummed_file import write_checksummed
    from verl_ckpt.store.fsio import WriteOptions, file_checksum

    core = sorted(os.sched_getaffinity(0))[0]
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    path = tmp_path / "rank.distcp"
    try:
        time.sleep(0.5)  # the busy loop holds the core
        # Four slices of 8 MiB: a few milliseconds of CPU each, seconds of waiting at the idle
        # class's share of a busy core, so that the wait passes the bound on any machine.
        payload = os.urandom(32 << 20)

        def work():
            os.sched_setaffinity(0, {core})
            assert idle_until_starved(10)
            start = time.monotonic()
            written = write_checksummed(
                path, lambda stream: stream.write(payload), options=WriteOptions(direct_io=True)
            )
            return os.sched_getscheduler(0), time.monotonic() - start, written

        policy, seconds, written = _in_thread(work)
        assert policy == os.SCHED_OTHER, "the starved writer stayed in the idle class"
        assert seconds < 45
        assert (written.size, written.checksum) == file_checksum(path)
    finally:
        busy.kill()
        busy.wait(30)
