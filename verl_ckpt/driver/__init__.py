"""The driver's half (floor 1): the coordinator (starts the finalizer, saves the driver's
own state as one more participant, waits for commits) and preemption stops.
"""
