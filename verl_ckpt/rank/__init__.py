"""The rank's half (floor 1): the checkpoint manager of each Megatron rank and its
collaborators (staging, snapshot plan, copy progress, pending writes, agreement with the
private gloo group, writers).
"""
