"""What both of the ``"hf"`` route's input preparers read the same way from a PreTrainedModel call's arguments:
the eager :func:`seqpar.swap.hf_inputs.prepare_inputs` and the traced :func:`seqpar.swap.hf_traced.prepare_traced`
(which ``hf_inputs`` calls, so it cannot import from there). Plain Python on the bound arguments: no host read,
nothing dynamo cannot trace."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import Tensor

__all__ = ["reference_input", "refuse_cache"]


def reference_input(arguments: dict[str, Any]) -> Tensor | None:
    """The call's token tensor the batch's shape is read from: ``input_ids`` ``(batch, seq_local)``, else
    ``inputs_embeds`` ``(batch, seq_local, hidden)``; None when neither is a tensor of two or more dims (a call
    the preparers leave as it is)."""
    ref = arguments.get("input_ids")
    if ref is None:
        ref = arguments.get("inputs_embeds")
    if not isinstance(ref, Tensor) or ref.dim() < 2:
        return None
    return ref


def refuse_cache(arguments: dict[str, Any], names: Collection[str], where: str) -> None:
    """A KV cache of a sharded sequence is meaningless: refuse one, and turn ``use_cache`` off (in
    ``arguments``, when ``use_cache`` is one of the forward's parameter ``names``).

    Raises:
        ValueError: ``past_key_values`` given, or ``use_cache=True``; ``where`` names the model.
    """
    if arguments.get("past_key_values") is not None:
        raise ValueError(
            f"seqpar ({where}): past_key_values given; a KV cache of a sequence-sharded model is "
            "not supported (generate with the unswapped model)"
        )
    if "use_cache" in names:
        if arguments.get("use_cache"):
            raise ValueError(
                f"seqpar ({where}): use_cache=True is not supported on a sequence-sharded model; "
                "pass use_cache=False"
            )
        arguments["use_cache"] = False
