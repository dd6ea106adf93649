"""Where steps live, and what is written once over every place they live (floor 7).

The layout of a root, durable file primitives, the commit record, the tracker, retention,
recovery, rollback and verification. Imports only `verl_ckpt.protocol`.
"""
