"""Local attention kernels: one block of queries against one block of keys, and the LSE merge."""

from seqpar.kernels.local import backward_layout, block_backward, block_forward, lse_dtype
from seqpar.kernels.matmul import addmm_fp32_out, fp32_out_matmul_supported
from seqpar.kernels.merge import (
    Partials,
    add_sink,
    in_layout_of,
    merge_into,
    new_accumulators,
    output_like,
    sink_grad,
)

__all__ = [
    "block_forward", "block_backward", "backward_layout", "lse_dtype", "merge_into", "add_sink", "Partials", "new_accumulators",
    "sink_grad", "output_like", "in_layout_of",
    "addmm_fp32_out", "fp32_out_matmul_supported",
]
