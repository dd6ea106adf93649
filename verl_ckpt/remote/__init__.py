"""The remote tier: committed steps uploaded to object storage through fsspec, with the
guarantees of the local tier (protocol page, steps 8-11), and resumable from there.

The remote tier is the local tier's commit on a second store (store/fsspec_store.py): the
same record, tracker and retention functions of store/, called with that store. What is
left here is what only a second tier has: `transfer` (verified parallel copies of a step's
files between two stores), `pull` (a remote step into the root, before Ray starts),
`tier` (the remote commit of a locally committed step), `ledger` (the finalizer's
bookkeeping of uploads), `finalizer_tier` (the finalizer's side), `rank_uploader` (a rank's
side). Nothing here is imported unless `checkpoint.remote.url` is set (or the CLI is given
a URL): fsspec and s3fs are an optional extra (`pip install -e '.[s3]'`).
"""

__all__: list[str] = []
