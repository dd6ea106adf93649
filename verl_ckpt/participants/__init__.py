"""Any Ray actor as a participant of a step (protocol page, "Participants"): a rollout worker,
a replay buffer or a data actor declares itself to the coordinator under a name, saves its
own state off its caller's path and reports like a rank; the finalizer commits the step
only when it reported too."""

from verl_ckpt.participants.loader import load_participant_state
from verl_ckpt.participants.saver import StateParticipant

__all__ = ["StateParticipant", "load_participant_state"]
