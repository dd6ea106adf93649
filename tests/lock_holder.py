"""A real process that holds a checkpoint root's lock, for the lock and rollback tests.

    python -m tests.lock_holder ROOT MODE LEASE_S PURPOSE

It acquires the lock, prints `READY <mode>` and holds it until its stdin closes (the test
ended) or it is killed (the point of most tests). `HolderProcesses` starts such processes,
waits for READY with a deadline and, at the end, kills only the processes it started.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60


def _hold(root: str, mode: str, lease_s: str, purpose: str) -> None:
    from verl_ckpt.startup.root_lock import RootLock

    lock = RootLock.acquire(root, purpose=purpose, mode=mode, lease_s=float(lease_s))
    print(f"READY {lock.mode}", flush=True)
    sys.stdin.read()  # returns when the test closes our stdin; a kill ends us sooner
    lock.release()


class HolderProcesses:
    """Starts lock holders; `close()` kills and reaps every one still running."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen] = []

    def start(
        self,
        root: Path,
        mode: str = "auto",
        lease_s: float = 30.0,
        purpose: str = "job `python -m recipes.ppo_toy`",
    ) -> subprocess.Popen:
        """A holder of `root`'s lock, returned once it holds it (READY) or failing the test."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.lock_holder", str(root), mode, str(lease_s), purpose],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        self._started.append(proc)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([proc.stdout], [], [], left)
            if not readable:
                break
            line = proc.stdout.readline()
            if line.startswith("READY"):
                return proc
            if not line:  # it exited without holding the lock
                proc.wait(timeout=READY_TIMEOUT_S)
                raise AssertionError(f"lock holder exited {proc.returncode}: {proc.stderr.read()}")
        raise AssertionError(f"lock holder pid {proc.pid} not READY in {READY_TIMEOUT_S}s")

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL, a real crash: the holder runs no cleanup of its own."""
        proc.kill()
        proc.wait(timeout=READY_TIMEOUT_S)

    def close(self) -> None:
        for proc in self._started:
            if proc.poll() is None:
                self.kill(proc)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()


if __name__ == "__main__":
    _hold(*sys.argv[1:5])
