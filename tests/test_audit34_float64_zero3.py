"""testing/deepspeed_teardown's float64 widening (audit 34): inside the suite's DeepSpeed block ZeRO-3's ``zero.Init``
base keeps float64 as the parameters' dtype (DeepSpeed 0.19.8 asserts half / bf16 / fp32), and outside it
DeepSpeed's own assertion stands again. The AutoTP ZeRO-3 exactness tests compare at float32's precision
(``assert_tp_grads``: rtol 1e-5), so a block that let the assertion pass and left the dtype at float32 (the
parameters silently converted) passed them.

Seen failing (mut34): T1 (``self.dtype = torch.float64`` dropped) -> "zero.Init's dtype torch.float32 inside the
block"; test_deepspeed_tp.py::test_autotp2_sp2_matches_one_process[3] passed T1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")


def test_zero_init_keeps_float64_inside_the_block_only() -> None:
    from deepspeed.runtime.zero.partition_parameters import (
        InsertPostInitMethodToModuleSubClasses as Init,
    )

    from seqpar.testing.deepspeed_teardown import released_deepspeed_engines

    with released_deepspeed_engines():
        widened = Init(dtype=torch.float64)
        assert widened.dtype is torch.float64, f"zero.Init's dtype {widened.dtype} inside the block"
        assert Init(dtype=torch.float32).dtype is torch.float32
        assert Init(dtype=torch.bfloat16).dtype is torch.bfloat16
    with pytest.raises(AssertionError, match="Invalid data type"):
        Init(dtype=torch.float64)
