"""What a run stands on: the process groups, entered through ``groups`` (``init_process_groups``) and
built in named parts: the SP x DP x TP rank grid and the Ulysses/ring split (``grid``), the group
factory, ``ProcessGroupManager`` (``factory``), each group initialised by all its members when it is made
(``communicators``), the mesh view (``mesh``) and the Megatron/DeepSpeed ``mpu`` methods (``mpu``);
bounded waits and a rank's death noticed by its peers in ``liveness``; atomic, verified checkpoints in
``checkpoint`` and ``verified``; process-wide guards in ``guard``.

Nothing here imports attention, sequence handling, memory or the swap: they stand on it.
"""
