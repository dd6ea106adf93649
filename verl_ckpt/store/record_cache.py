"""Commit records found valid before, known again by their bytes (a long-lived reader's
memory: the finalizer's retention reads every step's record after every commit).

A record is data from a disk that others may write, so nothing about a record is taken from
an earlier read but the verdict on exactly the same bytes: each record is read again every
time, and only its parse and checks (the largest part of a read with thousands of ranks, and
the part that grows with them) are skipped when its bytes hash to those of the record
verified before at the same place. A record changed in any way is parsed and checked again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from verl_ckpt.store.signing import Keyring

__all__ = ["VerifiedRecords"]


def _digest(data: bytes) -> bytes:
    # A cryptographic hash: the bytes come from a root others may write, and a record made to
    # collide with a verified one must not pass for it.
    return hashlib.sha256(data).digest()


class VerifiedRecords:
    """Per step directory (a store's relative path), the digest of the record bytes last
    found valid there: by the checks of `keyring` (checkpoint.signing), or of no keyring,
    and only by those (serves). Holds only the directories of the last listing."""

    def __init__(self, keyring: Keyring | None = None) -> None:
        self._key_ids = keyring.key_ids if keyring is not None else None
        self._digests: dict[str, bytes] = {}

    def serves(self, keyring: Keyring | None) -> bool:
        """Whether these verdicts are those of `keyring`: a record valid without a keyring
        may be unsigned, one valid under some keys not signed by others."""
        return (keyring.key_ids if keyring is not None else None) == self._key_ids

    def knows(self, rel: str, data: bytes) -> bool:
        """Whether `data` are the bytes of the record verified at `rel` before."""
        known = self._digests.get(rel)
        return known is not None and known == _digest(data)

    def remember(self, rel: str, data: bytes) -> None:
        """`data`, the record at `rel`, was just parsed and checked and is valid."""
        self._digests[rel] = _digest(data)

    def keep_only(self, rels: Iterable[str]) -> None:
        """Forget every directory but `rels` (the steps listed now): memory stays flat."""
        listed = set(rels)
        for rel in [r for r in self._digests if r not in listed]:
            del self._digests[rel]
