"""Deadlines: every wait of the protocol has one (invariant I5).

A deadline is a `time.monotonic()` value. It is made once, where the wait's budget is
decided, and passed down, so that nested waits share one budget instead of each starting
its own clock.
"""

from __future__ import annotations

import time

__all__ = ["RPC_SLACK_S", "call_deadline", "deadline_in", "time_left"]

# Slack added to the deadline of a call whose callee applies the caller's own timeout (a
# report is sent by its save's deadline; the finalizer waits that much longer for it): the
# callee's own deadline error, which names who is missing, arrives before the caller's.
RPC_SLACK_S = 30.0


def deadline_in(seconds: float) -> float:
    """The deadline `seconds` from now."""
    return time.monotonic() + seconds


def call_deadline(timeout_s: float) -> float:
    """The caller's deadline for a remote call whose callee waits up to `timeout_s` itself."""
    return time.monotonic() + timeout_s + RPC_SLACK_S


def time_left(deadline: float, floor: float = 0.0) -> float:
    """Seconds until `deadline`, never less than `floor` (0: a passed deadline waits no more;
    a small positive floor gives a last short try, e.g. to read a result already there)."""
    return max(floor, deadline - time.monotonic())
