"""The rank's half (floor 1): the checkpoint manager of each Megatron rank and its
collaborators, one per protocol step: planner (step 1: agreement, begin_step, plan cache),
snapshotter (step 2: staging pool, copies, fence), save_runner (steps 3-4: save thread,
writer, pending writes, uploads), loader (load); save_job (one save and its path), parts
(opening and closing them together), state_dict (what a rank saves), and their mechanisms
(staging, snapshot plan, copy progress, pending writes, agreement with the private gloo
group, writers).
"""
