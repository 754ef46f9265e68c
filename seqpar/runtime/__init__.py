"""What a run stands on: the process groups (SP x DP rank grid, the Ulysses/ring split, the mesh)
in ``groups``, each initialised by all its members when it is made (``communicators``); bounded waits and a rank's death noticed by its peers in ``liveness``; atomic,
verified checkpoints in ``checkpoint`` and ``verified``; process-wide guards in ``guard``.

Nothing here imports attention, sequence handling, memory or the swap: they stand on it.
"""
