"""A documented fault-injection hook for tests and drills; inert unless the variable is set.

    VERL_CKPT_FAULT="<phase>[:<role>[:<rank>]]=<action>[,...]"

phases: `stage` (a rank, before copying its tensors into the staging buffers: on the
training thread, or on the save thread for a deferred snapshot), `write` (a rank, before
writing its files, in the writer thread or process),
`report` (a rank, before reporting to the finalizer), `commit` (the finalizer, after every
report arrived and before the commit record), `tracker` (the finalizer, after writing the
tracker's temporary file, before the rename), `delete` (the finalizer, retention, after a
step left the `global_step_<N>` namespace and before its files are removed), `export` (a
Hugging Face export, with the role, after its checks and before it writes), `rollback`
(`verl-ckpt rollback`, after each step directory moved into the archive, before the next
move and before the tracker), `upload` (a rank, remote tier: after the finalizer said the step
committed locally, before the rank uploads its files).
actions: `hang` (sleep for an hour: a hung participant), `sleep=<seconds>` (a slow one),
`raise` (raise InjectedFault), `enospc` (raise OSError ENOSPC, a full disk at that exact
moment), `exit` (the process exits at once with status 17, a crash).
With VERL_CKPT_FAULT_ONCE=<path>, a fault fires only if <path> does not exist, and creates
it first: a restarted process then runs normally.
The variables are read when the phase runs, in the process running it.
"""

from __future__ import annotations

import errno
import os
import time

__all__ = ["ENV_VAR", "ONCE_ENV_VAR", "InjectedFault", "inject"]

ENV_VAR = "VERL_CKPT_FAULT"
ONCE_ENV_VAR = "VERL_CKPT_FAULT_ONCE"


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


def _matching_action(spec: str, phase: str, role: str | None, rank: int | None) -> str | None:
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = entry.partition("=")
        parts = where.split(":")
        if parts[0] != phase:
            continue
        if len(parts) > 1 and parts[1] and parts[1] != role:
            continue
        if len(parts) > 2 and parts[2] and str(rank) != parts[2]:
            continue
        return action
    return None


def inject(phase: str, role: str | None = None, rank: int | None = None) -> None:
    """Run the action configured for this phase (and role, rank), if any."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    action = _matching_action(spec, phase, role, rank)
    if action is None:
        return
    once = os.environ.get(ONCE_ENV_VAR)
    if once:
        try:
            with open(once, "x"):
                pass
        except FileExistsError:
            return
    if action == "hang":
        time.sleep(3600)
    elif action.startswith("sleep="):
        time.sleep(float(action.removeprefix("sleep=")))
    elif action == "raise":
        raise InjectedFault(f"fault injected by {ENV_VAR} at phase {phase} ({role} rank {rank})")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at phase {phase})")
    elif action == "exit":
        os._exit(17)
    else:
        known = "hang, sleep=<s>, raise, enospc or exit"
        raise ValueError(f"{ENV_VAR}: unknown action {action!r} ({known})")
