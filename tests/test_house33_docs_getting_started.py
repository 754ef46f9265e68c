"""docs/getting-started.md's "Use it from Python" block, run as written on 2 gloo ranks (house33's walk).

The block names its inputs without making them (``x``, ``q``, ``k``, ``v`` and their ``bshd`` views); the test
makes them as the block's comments describe (this rank's zigzag cut of full tensors, fresh random float64),
runs every statement of the block, and compares each gathered result with one process's causal attention on
the full sequence, in float64.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "getting-started.md"


def _block() -> str:
    """The first ```python block after the "Use it from Python" heading."""
    text = DOC.read_text()
    after = text[text.index("## Use it from Python"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on one process: q ``(B, Hq, S, D)``, k, v ``(B, Hkv, S, D)`` -> ``(B, Hq, S, D)``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v


def _run_block(rank: int, world: int) -> list[str]:

    gen = torch.Generator().manual_seed(33)
    batch, q_heads, kv_heads, seq, dim, hidden = 2, 4, 2, 64, 8, 16
    x = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    q_full = torch.randn(batch, q_heads, seq, dim, generator=gen, dtype=torch.float64)
    k_full, v_full = (torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    expected = _reference(q_full, k_full, v_full)
    namespace: dict = {"x": x}
    for statement in ast.parse(_block()).body:
        exec(compile(ast.Module([statement], []), "getting-started.md", "exec"), namespace)
        if "init_process_groups" in ast.unparse(statement):  # groups built, zigzag declared: cut the inputs
            shard = namespace["seqpar"].shard_sequence
            namespace.update(q=shard(q_full, dim=2), k=shard(k_full, dim=2), v=shard(v_full, dim=2),
                             q_bshd=shard(q_full.transpose(1, 2), dim=1), k_bshd=shard(k_full.transpose(1, 2), dim=1),
                             v_bshd=shard(v_full.transpose(1, 2), dim=1))
    wrong = []
    x_local = namespace["x_local"]
    if x_local.shape != (batch, seq // world, hidden):
        wrong.append(f"x_local: shape {tuple(x_local.shape)}")
    for name, value in namespace.items():  # every full-sequence result the block gathered
        if not (isinstance(value, torch.Tensor) and name.startswith("full")):
            continue
        want = expected.transpose(1, 2) if value.shape[1] == seq and value.shape[2] == q_heads else expected
        if value.shape != want.shape:
            wrong.append(f"{name}: shape {tuple(value.shape)}, want {tuple(want.shape)}")
            continue
        err = (value - want).abs().max().item()
        if not err < 1e-9:
            wrong.append(f"{name}: max error {err:.3g}")
    if not any(name.startswith("full") for name in namespace):
        wrong.append("the block gathers nothing")
    return wrong


def test_use_it_from_python_block_runs_as_written(dist_pool):
    """Every gathered result of the block equals one process (float64, 2 ranks, zigzag, GQA).
    Seen failing: the block as it stood gathered the ``layout="bshd"`` output on dim 2 (its heads), so ``full``
    came back ``(2, 32, 8, 8)`` (the heads of both ranks, each with half the sequence) with no error."""
    results = dist_pool.run(2, _run_block, timeout=300)
    assert results == [[], []], results
