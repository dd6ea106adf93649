"""A documented fault-injection hook for tests and drills; inert unless the variable is set.

    VERL_CKPT_FAULT="<phase>[:<role>[:<rank>]]=<action>[,...]"

phases: the values of `verl_ckpt.protocol.Phase` (where each one fires is said there).
actions: `hang` (sleep for an hour: a hung participant), `sleep=<seconds>` (a slow one),
`raise` (raise InjectedFault), `enospc` (raise OSError ENOSPC, a full disk at that exact
moment), `exit` (the process exits at once with status 17, a crash), `interrupt` (raise
KeyboardInterrupt, as Ctrl-C does on a trainer's main thread).
Every entry that matches runs, in order: `stage:actor:1=sleep=5,stage:actor:1=raise` is a
rank that fails late, once its peers are past the phase.
With VERL_CKPT_FAULT_ONCE=<path>, a fault fires only if <path> does not exist, and creates
it first: a restarted process then runs normally.
The variables are read when the phase runs, in the process running it.
"""

from __future__ import annotations

import errno
import os
import time

from verl_ckpt.protocol.phases import Phase

__all__ = ["ENV_VAR", "ONCE_ENV_VAR", "InjectedFault", "inject"]

ENV_VAR = "VERL_CKPT_FAULT"
ONCE_ENV_VAR = "VERL_CKPT_FAULT_ONCE"


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


_PHASES = {phase.value for phase in Phase}


def _matching_actions(spec: str, phase: Phase, role: str | None, rank: int | None) -> list[str]:
    actions = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = entry.partition("=")
        parts = where.split(":")
        if parts[0] not in _PHASES:
            known = ", ".join(sorted(_PHASES))
            raise ValueError(f"{ENV_VAR}: unknown phase {parts[0]!r} (known: {known})")
        if parts[0] != phase.value:
            continue
        if len(parts) > 1 and parts[1] and parts[1] != role:
            continue
        if len(parts) > 2 and parts[2] and str(rank) != parts[2]:
            continue
        actions.append(action)
    return actions


def inject(phase: Phase, role: str | None = None, rank: int | None = None) -> None:
    """Run the actions configured for this phase (and role, rank), in order, if any."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    actions = _matching_actions(spec, phase, role, rank)
    if not actions:
        return
    once = os.environ.get(ONCE_ENV_VAR)
    if once:
        try:
            with open(once, "x"):
                pass
        except FileExistsError:
            return
    for action in actions:
        _run(action, phase, role, rank)


def _run(action: str, phase: Phase, role: str | None, rank: int | None) -> None:
    if action == "hang":
        time.sleep(3600)
    elif action.startswith("sleep="):
        time.sleep(float(action.removeprefix("sleep=")))
    elif action == "raise":
        raise InjectedFault(
            f"fault injected by {ENV_VAR} at phase {phase.value} ({role} rank {rank})"
        )
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at phase {phase.value})")
    elif action == "exit":
        os._exit(17)
    elif action == "interrupt":
        raise KeyboardInterrupt  # Ctrl-C in a trainer's terminal, on the thread that saves
    else:
        known = "hang, sleep=<s>, raise, enospc, exit or interrupt"
        raise ValueError(f"{ENV_VAR}: unknown action {action!r} ({known})")
