"""The Megatron / DeepSpeed ``mpu`` interface: the method names those engines call to find their
process groups (``get_sequence_parallel_group``, ``get_data_parallel_world_size``, ...), answered from
the groups and ranks of a :class:`seqpar.runtime.factory.ProcessGroupManager`, which inherits them.

So the manager can be handed to ``deepspeed.initialize(mpu=manager)``: DeepSpeed then reduces gradients
over ``get_sequence_data_parallel_group()`` and sizes its data loader by ``get_data_parallel_*``. There
is no pipeline parallelism: its group is this rank alone; the model-parallel group is the TP group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

__all__ = ["MpuInterface"]


class MpuInterface:
    """The ``mpu`` methods, read from the properties of the class that mixes it in (``sp_group``,
    ``sp_size``, ``sp_rank``, ``dp_group``, ``dp_size``, ``dp_rank``, ``dp_ranks``, ``sp_dp_group``,
    ``rank``, ``tp_group``, ``tp_size``, ``tp_rank``, ``tp_ranks``, ``self_group``)."""

    if TYPE_CHECKING:  # provided by the manager
        sp_group: dist.ProcessGroup
        sp_size: int
        sp_rank: int
        dp_group: dist.ProcessGroup
        dp_size: int
        dp_rank: int
        dp_ranks: list[int]
        sp_dp_group: dist.ProcessGroup
        rank: int
        tp_group: dist.ProcessGroup
        tp_size: int
        tp_rank: int
        tp_ranks: list[int]
        self_group: dist.ProcessGroup

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.sp_dp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp_size * self.sp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_group_rank(self.sp_dp_group, self.rank)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        """The TP group (this rank alone when ``tp_size`` is 1): there is no pipeline parallelism."""
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    # Newer Megatron/DeepSpeed spellings of the same model-parallel (tensor-parallel) axis.
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (Megatron's broadcast source)."""
        return self.tp_ranks[0]

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        """This rank alone: there is no pipeline parallelism."""
        return self.self_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
