"""The remote tier: committed steps uploaded to object storage through fsspec, with the
guarantees of the local tier (protocol.py, steps 8-11), and resumable from there.

Nothing here is imported unless `checkpoint.remote.url` is set (or the CLI is given a URL):
fsspec and s3fs are an optional extra (`pip install -e '.[s3]'`).

Modules: `store` (one URL, the layout under it), `transfer` (verified parallel uploads and
downloads of a step's files), `tier` (remote commit record, tracker, retention, recovery as
plain functions), `ledger` (the finalizer's bookkeeping of uploads), `finalizer_tier` (the
finalizer's side), `rank_uploader` (a rank's side), `startup` (the check and the download of
a newer remote step before Ray starts), `cli` (the `verl-ckpt` commands on a URL).
"""

__all__: list[str] = []
