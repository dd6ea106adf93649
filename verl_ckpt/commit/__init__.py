"""The commit side: the finalizer actor and its collaborators (admission of steps, the
intake of reports, the committer, the waits for a commit), its typed client, the
participant link (one participant's begin, write, report: ranks and the driver alike), the
ledger of reports, the commit of one step (protocol steps 5 to 7) and the metadata forecast.
"""
