"""testing/deepspeed_teardown's float64 widening (audit 34): inside the suite's DeepSpeed block ZeRO-3's ``zero.Init``
base keeps float64 as the parameters' dtype (DeepSpeed 0.19.8 asserts half / bf16 / fp32), and outside it
DeepSpeed's own assertion stands again. The AutoTP ZeRO-3 exactness tests compare at float32's precision
(``assert_tp_grads``: rtol 1e-5), so a block that let the assertion pass and left the dtype at float32 (the
parameters silently converted) passed them.

Seen failing (mut34): T1 (``self.dtype = torch.float64`` dropped) -> "zero.Init's dtype torch.float32 inside the
block"; test_deepspeed_tp.py::test_autotp2_sp2_matches_one_process[3] passed T1. The other dtypes are compared with
DeepSpeed's own answer outside the block, not with themselves: on an AMD EPYC (no oneDNN fp16) DeepSpeed 0.19.8 gives
bfloat16 for float32 too, which failed the earlier ``is torch.float32`` on CI's clean clone of session 37.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")


def _outcome(init: type, dtype: torch.dtype) -> object:
    """``zero.Init(dtype=dtype)``'s dtype, or the assertion's message where DeepSpeed refuses the dtype."""
    try:
        return init(dtype=dtype).dtype
    except AssertionError as e:
        return str(e)


def test_zero_init_keeps_float64_inside_the_block_only() -> None:
    from deepspeed.runtime.zero.partition_parameters import (
        InsertPostInitMethodToModuleSubClasses as Init,
    )

    from seqpar.testing.deepspeed_teardown import released_deepspeed_engines

    # DeepSpeed's own answers, read outside the block: 0.19.8's ``_set_dtype`` parses as ``(dtype or float16) if
    # is_fp16_supported() else (bfloat16 if ... else float32)``, so on a CPU whose oneDNN has no fp16 (an AMD EPYC here)
    # every dtype comes back bfloat16 (float64 too, never reaching the assertion), on an Intel Xeon with it the dtype
    # given (float64 refused: "Invalid data type"). The block must leave DeepSpeed's answers as they are on either
    # machine, give float64 inside it, and undo itself.
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    own = {dt: _outcome(Init, dt) for dt in dtypes}
    with released_deepspeed_engines():
        widened = Init(dtype=torch.float64)
        assert widened.dtype is torch.float64, f"zero.Init's dtype {widened.dtype} inside the block"
        for dt in dtypes[:2]:
            assert _outcome(Init, dt) == own[dt], f"zero.Init(dtype={dt}) inside the block: {_outcome(Init, dt)}"
    after = {dt: _outcome(Init, dt) for dt in dtypes}
    assert after == own, f"after the block {after}, DeepSpeed's own {own}"
