"""What a participant tells the finalizer once its write for a step ended (protocol step 4)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from verl_ckpt.commit_record import FileEntry
from verl_ckpt.protocol import Failure

__all__ = ["Participant", "RankReport"]

# (role, rank): who takes part in a step. The driver is role "driver", rank 0.
Participant = tuple[str, int]


@dataclass
class RankReport:
    """One participant's outcome for one step; reports are idempotent by (step, role, rank).

    `files` are relative to the step directory. `write_results` are DCP WriteResults and
    `global_metadata` the DCP Metadata (coordinator rank only) that the finalizer turns into
    the role's `.metadata`. `failure` set means this participant failed and the step will
    not commit.
    """

    step: int
    role: str
    rank: int
    world_size: int
    save_id: str
    files: list[FileEntry] = field(default_factory=list)
    write_results: list[Any] = field(default_factory=list)
    global_metadata: Any = None
    failure: Failure | None = None
    # In transit (pack/unpack), as plain pickles: about half of what Ray's own serialisation
    # of a hundred WriteResult dataclasses costs on the report's round trip. The global
    # metadata arrives pickled already (once per save plan: megatron_compat.PreparedSave).
    packed_write_results: bytes | None = None
    packed_global_metadata: bytes | None = None

    def pack(self) -> RankReport:
        """Before sending: write_results as one pickled blob."""
        if self.write_results:
            self.packed_write_results = pickle.dumps(self.write_results, pickle.HIGHEST_PROTOCOL)
            self.write_results = []
        return self

    def unpack(self) -> RankReport:
        """On receipt, at the finalizer's intake (not in its commit, which the last report
        waits for): the objects back."""
        if self.packed_write_results is not None:
            self.write_results = pickle.loads(self.packed_write_results)
            self.packed_write_results = None
        if self.packed_global_metadata is not None:
            self.global_metadata = pickle.loads(self.packed_global_metadata)
            self.packed_global_metadata = None
        return self

    @property
    def participant(self) -> Participant:
        return (self.role, self.rank)
