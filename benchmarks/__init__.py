"""Benchmarks of verl_ckpt against its peers and against the floors of this machine.

Run `python -m benchmarks.run` (see benchmarks/README.md).
"""
