"""MoE router statistics over a sequence split across an SP group: load-balancing loss, z-loss, counts.

A mixture-of-experts router decides token by token, so routing itself is exact on shards. What is
not is every statistic *over the tokens of a call*: the load-balancing (auxiliary) loss, a mean
z-loss, and the per-expert token counts that aux-loss-free balancing (DeepSeek-V3's
``e_score_correction_bias``) feeds on. On a shard they are the shard's own values. This module
reduces them over the SP group, and over nothing more (not DP: a DP replica is one process's batch).

Load-balancing loss (Switch Transformer eqs. 4-6, as transformers' ``load_balancing_loss_func``
computes it, summed over the layers' rows before normalising)::

    aux = E * sum_e (T_e / N) * (R_e / N)

with ``T_e`` the count of top-k assignments to expert e (no gradient), ``R_e`` the sum of the
router's softmax probabilities for e (differentiable), and ``N`` the rows counted (tokens x layers,
weighted by the attention mask when given). Every rank computes its local ``T, R, N``; ``T`` and
``N`` are summed over the group (no gradient), ``R`` through an all-reduce whose backward is the
identity (:func:`seqpar.sequence.loss.all_reduce_identity_backward`). Each rank then holds the
sequence's ``aux``, and its backward seeds ``d aux / d R_r = E T_e / N^2`` into its own graph only:
the partial derivative of the true objective with respect to its own rows. The rank gradients
*summed* over SP are one process's gradient, the convention of the SP cross-entropy, so a loss
``CE + coef * aux`` needs nothing more: both terms follow the same rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from seqpar.runtime.groups import resolve_group
from seqpar.sequence.loss import all_reduce_identity_backward

__all__ = [
    "RouterStatistics",
    "routing_statistics",
    "load_balancing_loss",
    "pkm_routing_statistics",
    "sequence_parallel_z_loss",
    "sequence_parallel_expert_counts",
]


def _sum_over(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum without gradient over the group (a copy; ``x`` itself when there is no group)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class RouterStatistics:
    """Per-expert sums over the rows of one call: ``counts`` ``(E,)`` fp32 or wider (top-k assignments, no
    gradient), ``probs`` ``(E,)`` fp32 (router probabilities, differentiable), ``rows`` 0-dim fp32 (rows
    counted; for the probabilities, and for the counts when ``count_rows`` is None)."""

    def __init__(self, counts: Tensor, probs: Tensor, rows: Tensor, count_rows: Tensor | None = None) -> None:
        self.counts = counts
        self.probs = probs
        self.rows = rows
        self.count_rows = count_rows

    def over(self, group: dist.ProcessGroup | None, *, resolve: bool = True) -> RouterStatistics:
        """The statistics of the whole sequence: summed over the SP ``group`` (see the module docstring).
        ``resolve=False``: ``group`` is taken as it is (``None``: no group, these are the sequence's)."""
        if resolve:
            group = resolve_group(group)
        if group is None or dist.get_world_size(group) == 1:
            return self
        count_rows = None if self.count_rows is None else _sum_over(self.count_rows, group)
        return RouterStatistics(_sum_over(self.counts, group),
                                all_reduce_identity_backward(self.probs, group=group),
                                _sum_over(self.rows, group), count_rows)

    def loss(self, num_experts: int) -> Tensor:
        """``E * sum_e (counts_e / count_rows) * (probs_e / rows)``: transformers' normalisation."""
        count_rows = self.rows if self.count_rows is None else self.count_rows
        # a call with no row counted (an empty dynamic-CP micro-batch, its token mask all zeros) has no loss,
        # not 0 / 0; counted rows are whole tokens, so the clamp changes nothing else
        return torch.sum((self.counts / count_rows.clamp_min(1)) * (self.probs / self.rows.clamp_min(1))) * num_experts


def routing_statistics(
    gate_logits: tuple[Tensor, ...], num_experts: int, top_k: int, attention_mask: Tensor | None = None
) -> RouterStatistics:
    """This rank's sums for the softmax-top-k load-balancing loss (transformers'
    ``load_balancing_loss_func``, the form about 30 decoders share).

    Args:
        gate_logits: one ``(batch * seq_local, E)`` tensor per MoE layer (the model's ``router_logits``).
        num_experts: E.
        top_k: experts per token.
        attention_mask: ``(batch, seq_local)``; rows weighted by it (padding excluded), else all count.
    """
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)  # (B * S_local,)
    for layer_gate in gate_logits:
        routing = F.softmax(layer_gate.to(device), dim=-1)  # (rows, E)
        _, selected = torch.topk(routing, top_k, dim=-1)  # (rows, k)
        weight = (torch.ones(selected.shape[0], dtype=torch.float32, device=device)
                  if flat_mask is None else flat_mask)
        counts = counts + torch.zeros_like(counts).scatter_add_(
            0, selected.reshape(-1), weight.repeat_interleave(top_k, output_size=weight.numel() * top_k))
        probs = probs + (routing.float() * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return RouterStatistics(counts, probs, rows)


def load_balancing_loss(
    gate_logits: tuple[Tensor, ...] | None,
    num_experts: int,
    top_k: int = 2,
    attention_mask: Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> Tensor | int:
    """transformers' ``load_balancing_loss_func`` over the whole sequence of an SP group.

    Same arguments and value as transformers' on one process (``0`` when ``gate_logits`` is not a
    tuple); on shards every rank returns the sequence's loss, and each rank's backward gives its
    share of the gradient (sum over SP). ``group``: the SP group (default: the default manager's).
    """
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    stats = routing_statistics(gate_logits, num_experts, top_k, attention_mask)
    return stats.over(group).loss(num_experts)


def pkm_routing_statistics(
    gate_logits: tuple[Tensor, ...], num_experts: int, num_keys: int, top_k: int,
    attention_mask: Tensor | None = None,
) -> RouterStatistics:
    """This rank's sums for Doge's product-key load-balancing loss (its ``load_balancing_loss_func``).

    Each layer's logits are ``(2, batch * seq_local, num_keys)``: expert ``x * num_keys + y`` scores
    ``s_x + s_y``; the top-k experts are taken among the products of the two top-``num_keys`` lists
    and the probabilities are a softmax over those ``num_keys**2`` candidates. Doge divides the
    counts by the (masked) number of top-k assignments and the probabilities by the (masked) rows.
    """
    device = gate_logits[0].device
    # Sums in at least fp32: a bf16 count is exact only up to 256 (fp16: 2048), and every token of
    # the sequence adds 1. float64 logits keep float64 (the swap's float64 check against Doge's own).
    dtype = torch.promote_types(gate_logits[0].dtype, torch.float32)
    counts = torch.zeros(num_experts, dtype=dtype, device=device)
    probs = torch.zeros(num_experts, dtype=dtype, device=device)
    rows = torch.zeros((), dtype=dtype, device=device)
    assignments = torch.zeros((), dtype=dtype, device=device)
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=dtype)  # (B * S_local,)
    for layer in gate_logits:
        (scores_x, scores_y), (indices_x, indices_y) = layer.to(device).topk(num_keys, dim=-1)
        all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)  # (rows, K*K)
        all_indices = (indices_x.unsqueeze(-1) * num_keys + indices_y.unsqueeze(-2)).flatten(-2)
        _, position = all_scores.topk(top_k, dim=-1)
        expert = all_indices.gather(-1, position)  # (rows, k)
        routing = torch.zeros(all_scores.shape[0], num_experts, dtype=dtype, device=device).scatter(
            -1, all_indices, F.softmax(all_scores.to(dtype), dim=-1))  # (rows, E)
        weight = torch.ones(expert.shape[0], dtype=dtype, device=device) if flat_mask is None else flat_mask
        counts = counts + torch.zeros_like(counts).scatter_add_(
            0, expert.reshape(-1), weight.repeat_interleave(top_k, output_size=weight.numel() * top_k))
        probs = probs + (routing * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
        assignments = assignments + weight.sum() * top_k
    return RouterStatistics(counts, probs, rows, count_rows=assignments)


def sequence_parallel_z_loss(logits_local: Tensor, *, group: dist.ProcessGroup | None = None,
                             mask: Tensor | None = None) -> Tensor:
    """Mean over the whole sequence's tokens of ``logsumexp(logits)**2`` (Bamba's LM-logit z-loss).

    Args:
        logits_local: ``(batch, seq_local, vocab)``, this rank's shard.
        mask: ``(batch, seq_local)``, the positions that count (default: all; seqpar's end padding
            is left out with the :data:`~seqpar.sequence.batch.TOKEN_MASK_KEY` mask).

    Returns:
        A scalar, the same on every SP rank; backward gives each rank its share (sum over SP).
    """
    squares = logits_local.logsumexp(dim=-1).pow(2)  # (batch, seq_local)
    acc = torch.promote_types(squares.dtype, torch.float32)  # bf16 counts are exact only to 256
    if mask is not None:
        weight = mask.to(device=squares.device, dtype=acc).reshape(squares.shape)
        squares = squares * weight
        count = weight.sum()
    else:  # filled on the device: torch.tensor(n, device=...) would be a blocking host-to-device copy
        count = squares.new_full((), squares.numel(), dtype=acc)
    total = all_reduce_identity_backward(squares.sum(dtype=acc), group=group)
    return (total / _sum_over(count, resolve_group(group))).to(logits_local.dtype)


def sequence_parallel_expert_counts(
    expert_indices: Tensor, num_experts: int, *, group: dist.ProcessGroup | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Tokens routed to each expert over the whole sequence of the SP group.

    For aux-loss-free balancing (DeepSeek-V3 updates ``e_score_correction_bias`` from how far each
    expert's load is from the mean): on a shard the counts are the shard's; summed over the SP group
    (and nothing more) they are the counts one process would see.

    Args:
        expert_indices: ``(tokens_local, top_k)`` integer expert ids of this rank's tokens.
        num_experts: E.
        mask: ``(tokens_local,)`` (any shape of that many elements): tokens that count (default: all).

    Returns:
        ``(E,)`` int64 counts, the same on every SP rank.
    """
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_indices.device)
    flat = expert_indices.reshape(expert_indices.shape[0], -1).long()  # (tokens_local, top_k)
    weight = torch.ones_like(flat) if mask is None else mask.reshape(-1, 1).to(flat).expand_as(flat)
    counts.scatter_add_(0, flat.reshape(-1), weight.reshape(-1))
    return _sum_over(counts, resolve_group(group))
