"""The memory layouts users hand :func:`seqpar.attention` and :func:`seqpar.dilated_attention` their q, k and v in,
for the fuzzer's ``strided`` draw (:mod:`seqpar.testing.fuzz`, :mod:`seqpar.testing.fuzz_compile`).

A model rarely passes dense tensors: a Hugging Face attention projects ``(batch, seq, heads * dim)`` and hands
``view(...).transpose(1, 2)`` over (a ``bhsd`` view of a ``bshd`` buffer), and a fused ``qkv`` projection
(GPT-2, Phi, Falcon, StarCoder) splits one buffer into three narrow views whose rows are ``hq d + hkv d + hkv dv``
apart. The draws until now passed only dense tensors. ``strided``:

- ``None``: q, k, v dense in the call's layout (the draws' default);
- ``"transposed"``: each a transposed view of a buffer in the other layout (``bhsd`` over a ``(b, s, h, d)``
  buffer, ``bshd`` over a ``(b, h, s, d)`` one);
- ``"fused"``: the three are narrow views of one ``(batch, seq_local, hq d + hkv d + hkv dv)`` buffer, as a
  fused projection's output split by heads.

:func:`strided_inputs` builds the leaves (one buffer per tensor, or the one fused buffer) and the views to pass;
:func:`strided_grads` reads the three gradients back from the leaves, each ``(batch, heads, seq_local, dim)``.
"""

from __future__ import annotations

import torch

__all__ = ["STRIDES", "strided_inputs", "strided_grads"]

STRIDES = (None, "transposed", "fused")


def strided_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, strided: str | None,
                   frozen_kv: bool = False) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Leaves (requiring grad) and the ``(q, k, v)`` views to pass, in ``layout`` (``"bhsd"`` / ``"bshd"``), laid
    out as ``strided`` says. ``q, k, v``: dense ``(batch, heads, seq_local, dim)`` values (no grad).
    ``frozen_kv``: k's and v's leaves do not require grad (K/V from a frozen cache or encoder, only q trains);
    not with ``"fused"``, whose three views share one leaf."""
    if strided not in STRIDES:
        raise ValueError(f"unknown strided draw {strided!r}: one of {STRIDES}")
    if frozen_kv and strided == "fused":
        raise ValueError("frozen_kv with strided='fused': the fused q, k and v are views of one leaf")
    if strided == "fused":
        b, _, s, _ = q.shape
        parts = [x.transpose(1, 2).reshape(b, s, -1) for x in (q, k, v)]  # (b, s, h * d) each
        buf = torch.cat(parts, -1).requires_grad_()  # (b, s, hq d + hkv d + hkv dv)
        views, start = [], 0
        for x in (q, k, v):
            h, d = x.shape[1], x.shape[3]
            y = buf.narrow(-1, start, h * d).unflatten(-1, (h, d))  # (b, s, h, d), rows hq d + ... apart
            views.append(y.transpose(1, 2) if layout == "bhsd" else y)
            start += h * d
        return [buf], tuple(views)
    leaves, views = [], []
    for x in (q, k, v):
        # a buffer (b, s, h, d) when the call's layout and the buffer's differ as `strided` says, else (b, h, s, d);
        # always a copy, so the caller's tensor is never made a leaf
        bshd_buffer = (layout == "bshd") != (strided == "transposed")
        leaf = (x.transpose(1, 2) if bshd_buffer else x).clone(memory_format=torch.contiguous_format)
        leaf.requires_grad_(not (frozen_kv and x is not q))
        views.append(leaf.transpose(1, 2) if strided == "transposed" else leaf)
        leaves.append(leaf)
    return leaves, tuple(views)


def strided_grads(leaves: list[torch.Tensor], shapes: list[torch.Size], layout: str,
                  strided: str | None) -> list[torch.Tensor | None]:
    """``[dq, dk, dv]``, each ``(batch, heads, seq_local, dim)``, from the leaves :func:`strided_inputs` made
    (``shapes``: q's, k's and v's ``(batch, heads, seq_local, dim)``); ``None`` for a leaf with no gradient (frozen,
    or no backward ran)."""
    if strided == "fused":
        g, out, start = leaves[0].grad, [], 0
        if g is None:
            return [None, None, None]
        for _, h, _, d in shapes:
            out.append(g.narrow(-1, start, h * d).unflatten(-1, (h, d)).transpose(1, 2))
            start += h * d
        return out
    bshd_buffer = (layout == "bshd") != (strided == "transposed")  # the leaf is (b, s, h, d)
    return [None if x.grad is None else x.grad.transpose(1, 2) if bshd_buffer else x.grad for x in leaves]
