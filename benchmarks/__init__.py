"""Benchmarks of verl_ckpt against its peers and against the floors of this machine.

Run `python -m benchmarks.run` (see benchmarks/README.md).
"""

import os

# Every Ray of the benchmarks stays on 127.0.0.1 (recipes.local_ray refuses it otherwise).
# Ray replaces 127.0.0.1 by the machine's reachable IP unless multi-node clusters are off,
# which this variable does; Ray reads it when it is imported, and its processes inherit it.
# Set here, in the package, before any of its modules imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
