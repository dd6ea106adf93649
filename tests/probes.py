"""Functions that tests run inside Ray actors with `actor.__ray_call__.remote(fn)`. Kept in a
module that imports nothing: Ray imports a function's module in the actor to call it, and a
test module would bring its own imports (torch, megatron-core) into the actor it looks at."""

from __future__ import annotations

import sys


def imported(_actor: object, module: str) -> bool:
    """Whether the actor's process has imported `module`."""
    return module in sys.modules


def process_id(_actor: object) -> int:
    """The actor's process id: a restarted actor answers with another."""
    import os

    return os.getpid()
