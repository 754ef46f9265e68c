"""seqpar's padded positions fed a token whose embedding is not zero by construction (:func:`fill_padding`).

:func:`seqpar.sequence.batch.shard_batch` pads a sequence to a multiple of the SP size (``2P`` for zigzag)
with ``pad_token_id`` (0) at the end (for a packed batch: one more document), and marks the padding with
:data:`~seqpar.sequence.batch.TOKEN_MASK_KEY`. Most Hugging Face decoders build their token embedding with
``padding_idx=config.pad_token_id`` (0 for Gemma), whose row transformers' init leaves all zeros. A real
token never sees the padding (causal attention, end padding, its own document when packed) and the
padding's labels are ``ignore_index``, so its values do not matter, but its *gradient path* does: Gemma 3n
rescales every position by ``mean(h**2, -1) ** 0.5`` (the AltUp projections, before and after the layers),
whose backward at a zero row is ``0 * inf = NaN``, and the NaN reaches every parameter (fuzzer case
971704548: tiny ``gemma3n_text``, P = 1, packed ``[1, 2, 1, 6, 1]`` padded to 12; one process running each
document alone never sees a pad token, and its gradients are finite).

So each swapped model's input preparer (:mod:`seqpar.swap.hf_inputs`, :mod:`seqpar.swap.hf_traced`) gives
the padded positions that hold the embedding's ``padding_idx`` another token id, and the padded rows of an
``inputs_embeds`` call (``shard_batch`` pads them with zeros) ones: no real token's output, loss or
gradient changes, since nothing real depends on the padding's values. A pad token the *data* holds
(a position the token mask keeps) is left as it is, as one process would see it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["fill_padding"]


def _padding_idx(module: nn.Module) -> tuple[int, int] | None:
    """``(padding_idx, num_embeddings)`` of ``module``'s input embedding, or None (none, or not an
    ``nn.Embedding``-like table)."""
    get = getattr(module, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    idx, rows = getattr(embedding, "padding_idx", None), getattr(embedding, "num_embeddings", None)
    if not isinstance(idx, int) or not isinstance(rows, int) or rows < 2:
        return None
    return idx % rows, rows


def fill_padding(module: nn.Module, arguments: dict[str, Any], token_mask: Tensor | None) -> None:
    """Replace, in place in ``arguments`` (a swapped model's bound call), what ``shard_batch`` put at the
    padded positions (``token_mask == 0``; ``token_mask``: ``(B, S_local)``, None: no padding) by values whose
    embedding is not zero: ``input_ids`` ``(B, S_local)`` equal to the input embedding's ``padding_idx`` by
    the next id, ``inputs_embeds`` ``(B, S_local, H)`` by ones. New tensors; the caller's are not changed."""
    if not isinstance(token_mask, Tensor) or token_mask.dim() != 2:
        return
    ids = arguments.get("input_ids")
    if isinstance(ids, Tensor) and ids.shape == token_mask.shape and not ids.is_floating_point():
        found = _padding_idx(module)
        if found is not None:
            idx, rows = found
            other = (idx + 1) % rows
            padded = token_mask.to(ids.device) == 0
            arguments["input_ids"] = torch.where(padded & (ids == idx), torch.full_like(ids, other), ids)
    embeds = arguments.get("inputs_embeds")
    if isinstance(embeds, Tensor) and embeds.dim() == 3 and embeds.shape[:2] == token_mask.shape:
        padded = (token_mask.to(embeds.device) == 0).unsqueeze(-1)  # (B, S_local, 1)
        arguments["inputs_embeds"] = torch.where(padded, torch.ones_like(embeds), embeds)
