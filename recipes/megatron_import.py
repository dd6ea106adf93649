"""Import megatron-core on a CPU-only machine without torch's compiler stack.

megatron-core wraps its fused kernels (bias-GeLU, bias-dropout-add, SwiGLU, ...) in
``torch.compile`` while its modules are imported (``megatron.core.jit.jit_fuser``). Wrapping
alone imports ``torch._dynamo`` and ``torch._inductor``: about 3 s of CPU in every process
that imports megatron-core, a third of a rank's start-up on the 2-core machines that run the
recipe and the tests, where every job starts a process per rank. The recipe's tiny models
leave every fusion off (megatron-core's defaults), so no wrapped function runs; one that
did would compute the same, only uncompiled.

So without CUDA, megatron-core's first import sees a ``torch.compile`` that returns the
function it is given, torch's own is put back right after, and megatron-core's
``disable_jit_fuser()`` gives modules imported later the same plain functions. With CUDA, or
once megatron-core is imported, nothing changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["import_megatron_core"]


def _leave_uncompiled(model: Callable | None = None, **_options: Any) -> Any:
    """``torch.compile``'s two forms, as a decorator with or without options: no compiling."""
    if model is None:
        return lambda function: function
    return model


def import_megatron_core() -> None:
    """Import megatron.core (see the module's docstring); call before any megatron import."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        return
    compile_ = torch.compile
    torch.compile = _leave_uncompiled
    try:
        from megatron.core import jit
    finally:
        torch.compile = compile_
    jit.disable_jit_fuser()
