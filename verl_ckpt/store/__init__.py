"""Where steps live, and what is written once over every place they live (floor 7).

One seam, `Store` (base.py), with two implementations: a local directory (local.py) and an
fsspec URL (fsspec_store.py); `open_store` (open_store.py) picks one. Over it, once for every
tier: the commit record (commit_record.py), the tracker (tracker.py), retention
(retention.py), recovery (recovery.py), rollback (rollback.py) and verification
(verification.py), and a long-lived reader's memory of the records it verified
(record_cache.py). Also the layout of a root, durable file primitives (fsio.py), and
the root lock's holder records and lease guard (lock_record.py).
Imports only `verl_ckpt.protocol`.
"""
