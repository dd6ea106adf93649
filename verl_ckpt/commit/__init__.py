"""The commit side (floor 4): the finalizer actor, its client, the ledger of reports, the
commit of one step (protocol steps 5 to 7) and the metadata forecast.
"""
