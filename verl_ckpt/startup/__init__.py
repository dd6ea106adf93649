"""Everything before Ray starts (floor 2, protocol step 0): config and root checks, the root
lock, recovery, the resume choice, its verification and fit, the remote tier's start.
"""
