"""The commit side (floor 4): the finalizer actor and its collaborators (admission of
steps, the committer, the waits for a commit), its client, the ledger of reports, the
commit of one step (protocol steps 5 to 7) and the metadata forecast.
"""
