"""`latest_checkpointed_iteration.txt`: read strictly, write atomically (invariant I2).

The tracker stays a bare integer so that Megatron-LM and verl read it unchanged; the commit
record beside each step carries the format version.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from verl_ckpt.protocol import faults
from verl_ckpt.protocol.errors import TrackerError
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.store.fsio import atomic_write_bytes
from verl_ckpt.store.layout import TRACKER_FILENAME

__all__ = ["parse_tracker", "read_tracker", "tracker_path", "write_tracker"]


_ASCII_WHITESPACE = " \t\n\r\v\f"


def tracker_path(root: str | Path) -> Path:
    return Path(root) / TRACKER_FILENAME


def read_tracker(root: str | Path) -> int | None:
    """The step the tracker names, or None when there is no tracker file.

    One non-negative integer, with surrounding ASCII whitespace allowed (Megatron-LM and
    verl strip it: a tracker written by hand or by them reads the same). Anything else is an
    error naming the file: a tracker we cannot read is never taken as "start from scratch".
    """
    path = tracker_path(root)
    try:
        # Opened without blocking, and read only if it is a regular file: a FIFO in its
        # place would wait for a writer forever, a link to a device never end.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                raise TrackerError(f"tracker {path} is not a regular file holding a step")
            raw = b""
            while chunk := os.read(fd, 1 << 16):
                raw += chunk
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise TrackerError(f"tracker {path} is a directory, not a file holding a step") from None
    except OSError as exc:
        raise TrackerError(f"tracker {path} cannot be read: {exc.strerror or exc}") from None
    return parse_tracker(raw, str(path))


def parse_tracker(raw: bytes, where: str) -> int:
    """The step in a tracker's bytes (read from `where`, named in errors): the rules of
    read_tracker, shared by the remote tier's tracker object."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise TrackerError(
            f"tracker {where} is not plain ASCII (a byte-order mark or binary data?): {raw[:20]!r}"
        ) from None
    body = text.strip(_ASCII_WHITESPACE)
    # No step has more than 18 digits; int() refuses thousands of them with its own error.
    if not body.isdigit() or len(body) > 18:
        raise TrackerError(
            f"tracker {where} must hold one non-negative integer step, found {text[:40]!r}"
        )
    return int(body)


def write_tracker(root: str | Path, step: int) -> None:
    """Atomically point the tracker at `step` (tmp file, fsync, rename, directory fsync)."""
    if step < 0:
        raise ValueError(f"tracker step must be >= 0, got {step}")
    atomic_write_bytes(
        tracker_path(root),
        f"{step}\n".encode("ascii"),
        before_replace=lambda: faults.inject(Phase.TRACKER),
    )
