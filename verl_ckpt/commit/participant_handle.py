"""What a participant declared to the coordinator needs to take part in steps (protocol page,
"Participants"): small and picklable, made by CheckpointCoordinator.participant_handle in
the driver and passed to the Ray actor that saves (participants.StateParticipant)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.phases import participant_label
from verl_ckpt.store.signing import Keyring

__all__ = ["ParticipantHandle"]


@dataclass(frozen=True)
class ParticipantHandle:
    """Index `index` of participant `name` (of `count`), under the checkpoint root `root`,
    reporting to `finalizer` (a Ray actor handle), with the job's checkpoint `config`."""

    name: str
    index: int
    count: int
    root: str
    finalizer: Any
    config: CheckpointConfig
    # The keys of checkpoint.signing, read on the driver before Ray started (a key file's
    # relative path or a variable need not exist where the actor runs); None: signing off.
    keyring: Keyring | None = None

    @property
    def label(self) -> str:
        """How messages name it: "rollout[1]"."""
        return participant_label(self.name, self.index, declared=True)
