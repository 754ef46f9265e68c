"""How a swapped module calls seqpar attention (:class:`SwapOptions`), and the swap's error type."""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.config import PatternConfig, SeqParConfig
from seqpar.runtime.verified import batch_verified
from seqpar.sequence.call_group import GROUP_KEY, guard_group
from seqpar.sequence.sharding import resolve_sharding
from seqpar.swap.state import is_probing, suspended

__all__ = ["SwapError", "SwapOptions", "value_digest", "self_only_attention"]


class SwapError(ValueError):
    """The model's attention cannot be swapped as configured; the message says what and how to fix."""


def self_only_attention(q: Tensor, v: Tensor) -> Tensor:
    """Attention in which each query sees only its own key: softmax over one score is 1, so the output
    is the value at the same position. q ``(batch, q_heads, seq, head_dim)``, v
    ``(batch, kv_heads, seq, v_dim)`` -> ``(batch, q_heads, seq, v_dim)`` (GQA: each KV head repeated
    for its group of query heads, as the attention kernels do)."""
    group_size = q.shape[1] // v.shape[1]
    return v.repeat_interleave(group_size, dim=1) if group_size > 1 else v.clone()


def value_digest(value: Any) -> list[int]:
    """Integers that identify an option value the same way in every process (no salted ``hash``):
    bools and ints as themselves, strings by CRC-32, tuples/lists element-wise with their length,
    dataclasses field by field, anything else by its type name."""
    if value is None:
        return [-1]
    if isinstance(value, (bool, int)):
        return [int(value)]
    if isinstance(value, float):
        return [zlib.crc32(repr(value).encode())]
    if isinstance(value, str):
        return [zlib.crc32(value.encode())]
    if isinstance(value, (tuple, list)):
        out = [len(value)]
        for item in value:
            out += value_digest(item)
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = []
        for f in dataclasses.fields(value):
            out += value_digest(getattr(value, f.name))
        return out
    return [zlib.crc32(type(value).__qualname__.encode())]


@dataclass(frozen=True)
class SwapOptions:
    """How a swapped module calls seqpar attention; attached to each swapped module.

    ``deepcopy`` returns the same object: a process group cannot be copied, and a copied model
    (e.g. an EMA or reference copy) shares the groups of the original.
    """

    group: dist.ProcessGroup | None = None
    """The SP group (``None``: the default manager's SP group; without one on a world > 1: an error)."""
    mode: str = "ring"
    sharding: str = "contiguous"
    overlap: bool = True
    check_inputs: bool = True
    """Check across ranks that every rank passes the same shapes and options: once per batch in the
    swapped model's forward pre-hook (:mod:`seqpar.swap.batch`), per call outside it."""
    head_chunks: int | str = "auto"
    check_finite: bool = False
    """Collective NaN/Inf check of each call's inputs and output (:mod:`seqpar.runtime.guard`)."""
    pattern: PatternConfig = field(default_factory=PatternConfig)
    """Dense attention, or LongNet dilated attention (``seqpar.attn.dilated``)."""
    mla_transfer: str = "latent"
    """MLA layers' ring transfer: ``"latent"`` or ``"expanded"`` (:attr:`SeqParConfig.mla_transfer`)."""
    mixer_kernels: str = "torch"
    """The hybrid mixers' local-scan kernels: ``"torch"`` or ``"auto"`` (:attr:`SeqParConfig.mixer_kernels`)."""
    dkv_wire_dtype: str = "fp32"
    """The ring backward's dK/dV on the wire: ``"fp32"`` or ``"bf16"`` (:attr:`SeqParConfig.dkv_wire_dtype`)."""

    @classmethod
    def from_config(cls, config: SeqParConfig, group: dist.ProcessGroup | None) -> SwapOptions:
        return cls(group=group, mode=config.mode, sharding=resolve_sharding(config.sharding, where="swap_attention"),
                   overlap=config.overlap, check_inputs=config.check_inputs, head_chunks=config.head_chunks,
                   pattern=config.pattern, check_finite=config.check_finite, mla_transfer=config.mla_transfer,
                   mixer_kernels=config.mixer_kernels, dkv_wire_dtype=config.dkv_wire_dtype)

    def __deepcopy__(self, memo: dict) -> SwapOptions:
        return self

    def for_call(self, kwargs: dict[str, Any]) -> SwapOptions:
        """These options with the call's SP group when ``kwargs`` carries one (dynamic CP: the keyword
        :data:`seqpar.sequence.call_group.GROUP_KEY`, taken out of ``kwargs``), else these options."""
        group = kwargs.pop(GROUP_KEY, None)
        if group is None:
            return self
        group = guard_group(group)  # compiled: one graph per group, never one group's graph for another
        return self if group is self.group else dataclasses.replace(self, group=group)

    def digest(self) -> list[int]:
        """Every option except the group, as integers the ranks must agree on (fields added later,
        e.g. a window or a Ulysses degree, are included without further code)."""
        out: list[int] = []
        for f in dataclasses.fields(self):
            if f.name != "group":
                out += value_digest(getattr(self, f.name))
        return out

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None,
        layer: str | None = None, cu_seqlens: Any = None, window: int | None = None,
        sinks: Tensor | None = None, chunk_size: int | None = None, softcap: float | None = None,
        alibi_slopes: Tensor | None = None,
    ) -> Tensor:
        """seqpar attention on shards: q ``(batch, q_heads, seq_local, head_dim)``, k/v
        ``(batch, kv_heads, seq_local, head_dim)`` -> ``(batch, q_heads, seq_local, head_dim)``.

        Inside a verified batch (the swapped model's pre-hook compared its inputs across ranks) the
        per-call cross-rank check is skipped: it would cost a host sync per layer and could only
        repeat the batch's verdict (seqpar.runtime.verified).

        ``cu_seqlens`` (global packed-document boundaries), ``window``, ``sinks``, ``chunk_size``,
        ``softcap`` and ``alibi_slopes`` are passed to :func:`seqpar.attention` as they are (see there); the dilated pattern
        takes none of them.
        ``check_finite`` (off by default, then free) raises on every rank, naming ``layer``, when
        the inputs or the output hold a NaN or an Inf.

        While the position-mixing probe runs (:class:`seqpar.swap.state.probing`) the attention is
        self-only: each query attends to its own key alone, so the output is its value (GQA heads
        repeated), with no communication (see :mod:`seqpar.swap.probe`).
        """
        if is_probing():
            return self_only_attention(q, v)
        masked = {k: v for k, v in (("cu_seqlens", cu_seqlens), ("window", window), ("sinks", sinks),
                                    ("chunk_size", chunk_size), ("softcap", softcap), ("alibi_slopes", alibi_slopes))
                  if v is not None}
        if self.check_finite:  # off by default: then this branch is the whole cost
            from seqpar.runtime.guard import check_finite

            where = f"layer {layer or '?'}"
            check_finite({"query": q, "key": k, "value": v}, self.group, f"{where} attention inputs")
            out = self._attention(q, k, v, causal=causal, scale=scale, masked=masked)
            check_finite({"output": out}, self.group, f"{where} attention output")
            return out
        return self._attention(q, k, v, causal=causal, scale=scale, masked=masked)

    def _per_call_check(self) -> bool:
        """Whether this call checks its inputs across ranks: not inside a verified batch, nor while
        torch.compile traces (a collective read on the host; see :mod:`seqpar.swap.traced`)."""
        return not torch.compiler.is_compiling() and self.check_inputs and not batch_verified()

    def _attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None, masked: dict[str, Any]
    ) -> Tensor:
        # a refusal found while dynamo traces (resolve_attention's, this method's own) is raised by the op
        # seqpar::refusal when the graph runs, as seqpar.attention's are: raised while tracing, a fullgraph=True
        # caller got dynamo's "Unsupported: Observed exception" instead of the message
        from seqpar.attn.ops import defer_refusals

        return defer_refusals(self._resolved_attention)(q, k, v, causal=causal, scale=scale, masked=masked)

    def _resolved_attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None, masked: dict[str, Any]
    ) -> Tensor:
        from seqpar.attn.amp import autocast_inputs, autocast_off
        from seqpar.attn.dispatch import run_attention
        from seqpar.attn.resolve import resolve_attention

        check = self._per_call_check()
        # under torch.autocast: q, k, v as the layer's SDPA would take them (a Llama's float32 q / k beside its bf16 v)
        q, k, v = autocast_inputs(q, k, v)
        # seqpar.attention may itself call F.scaled_dot_product_attention (one rank, no group):
        # suspend the dispatcher so that call is the plain kernel, not a recursion.
        with suspended(), autocast_off(q):
            if self.pattern.type == "dilated":
                if masked:
                    raise ValueError(
                        f"seqpar: the dilated pattern does not take {sorted(masked)} (packed documents, "
                        "sliding windows, sinks, chunks, soft-capping); use the dense pattern for such models"
                    )
                from seqpar.attn.dilated import dilated_attention

                return dilated_attention(
                    q, k, v, segment_lengths=self.pattern.segment_lengths,
                    dilation_rates=self.pattern.dilation_rates, causal=causal, scale=scale,
                    mode=self.mode, group=self.group, sharding=self.sharding,
                    head_layout=self.pattern.head_layout, check_inputs=check, dkv_wire_dtype=self.dkv_wire_dtype,
                )
            # resolved once here and handed down: the run makes no check or choice again
            plan = resolve_attention(
                q, k, v, causal=causal, scale=scale, mode=self.mode, group=self.group,
                sharding=self.sharding, overlap=self.overlap, check_inputs=check,
                head_chunks=self.head_chunks, layout="bhsd", dkv_wire_dtype=self.dkv_wire_dtype, **masked,
            )
            return run_attention(plan, q, k, v, masked.get("sinks"), masked.get("alibi_slopes"))

    def latent_attention(
        self, q: Tensor, call: Any, *, causal: bool, scale: float | None, layer: str | None = None,
        cu_seqlens: Any = None, window: int | None = None, sinks: Tensor | None = None,
        chunk_size: int | None = None, softcap: float | None = None,
    ) -> Tensor:
        """seqpar attention of an MLA layer whose K/V stay latent (:mod:`seqpar.swap.mla`): q ``(batch,
        heads, seq_local, d_nope + d_rope)`` and the layer call's :class:`~seqpar.swap.mla.LatentCall`
        -> ``(batch, heads, seq_local, v_head_dim)``. The call is resolved as :meth:`attention`
        resolves it (the stand-in K/V give the shapes); the ring or the all-gather then moves the latent
        (:mod:`seqpar.attn.latent`), any other plan (and soft-capping, which the latent kernels do not
        take) gets the expanded K/V."""
        from seqpar.attn.ops import refused_output

        # a refusal found while dynamo traces is raised by seqpar::refusal when the graph runs (as
        # SwapOptions.attention's): raised while tracing, a fullgraph=True caller got dynamo's "Unsupported:
        # Observed exception" without the message. The stand-in value gives the output's head dim. A
        # CompileOnlyRefusal is never deferred (without fullgraph dynamo runs the exact eager call).
        try:
            return self._latent_attention(q, call, causal=causal, scale=scale, layer=layer, cu_seqlens=cu_seqlens,
                                          window=window, sinks=sinks, chunk_size=chunk_size, softcap=softcap)
        except (ValueError, TypeError) as e:
            out = refused_output(q, call.value, e)
            if out is None:
                raise
            return out

    def _latent_attention(
        self, q: Tensor, call: Any, *, causal: bool, scale: float | None, layer: str | None,
        cu_seqlens: Any, window: int | None, sinks: Tensor | None, chunk_size: int | None, softcap: float | None,
    ) -> Tensor:
        from seqpar.attn.amp import autocast_inputs, autocast_off
        from seqpar.attn.checks import CompileOnlyRefusal
        from seqpar.attn.dispatch import run_attention
        from seqpar.attn.latent import (
            LatentAllGatherAttention,
            LatentRingAttention,
            compiled_latent_attention,
        )
        from seqpar.attn.resolve import resolve_attention
        from seqpar.comm.ring import RingComm

        masked = {k: v for k, v in (("cu_seqlens", cu_seqlens), ("window", window), ("sinks", sinks),
                                    ("chunk_size", chunk_size), ("softcap", softcap)) if v is not None}
        check = self._per_call_check()
        # under torch.autocast: q, the stand-ins and the latent as the layer's SDPA and kv_b_proj would take them
        # (seqpar.attn.amp); the run below has autocast off, so the expansions are cast here explicitly
        q, key, value, c_cast, r_cast = autocast_inputs(q, call.key, call.value, call.c, call.r)

        def latent(c: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
            return c.to(c_cast.dtype), r.to(r_cast.dtype)

        with suspended(), autocast_off(q):
            plan = resolve_attention(
                q, key, value, causal=causal, scale=scale, mode=self.mode, group=self.group,
                sharding=self.sharding, overlap=self.overlap, check_inputs=check,
                head_chunks=self.head_chunks, layout="bhsd", dkv_wire_dtype=self.dkv_wire_dtype, **masked,
            )
            if plan.algorithm not in ("ring", "allgather") or plan.opts.softcap is not None:
                k, v = call.expand(*latent(call.c, call.r))
                return run_attention(plan, q, k.to(key.dtype), v.to(value.dtype), sinks)
            if plan.documents is not None and torch.compiler.is_compiling():
                # traced: the latent kernels have no op reading the boundary tensor. Compile only (eager reads the
                # tensor's values): never deferred, so that without fullgraph dynamo gives this frame up and
                # Python runs it (the branch below)
                raise CompileOnlyRefusal(
                    f"seqpar (layer {layer or '?'}): packed documents under torch.compile with the MLA latent "
                    "transfer are not supported (the boundaries are a tensor the latent ring cannot read while "
                    "tracing); set mla_transfer='expanded' when compiling packed batches, or run eagerly"
                )
            if plan.traced and not torch.compiler.is_compiling():
                # run by Python after dynamo gave this frame up (this refusal, or a break inside `with suspended()`:
                # check_finite's collective), yet holding a traced plan (the boundaries a tensor, the size checks
                # left to an op the latent kernels do not run; used as it is, the latent ring drops the documents
                # and runs an unchecked head_chunks). The whole call again, eagerly: resolved as an eager call
                # resolves it (the tensor's values read and checked), with dynamo off for the frames it calls (else it compiles
                # the ring's helpers one by one, which fails under dynamic=True)
                return torch.compiler.disable(self._latent_attention)(
                    q, call, causal=causal, scale=scale, layer=layer, cu_seqlens=cu_seqlens, window=window,
                    sinks=sinks, chunk_size=chunk_size, softcap=softcap)
            if self.check_finite:
                from seqpar.runtime.guard import check_finite

                check_finite({"query": q, "latent": call.c, "rope key": call.r}, self.group,
                             f"layer {layer or '?'} attention inputs")
            # run as kv_b_proj's forward (call.run), so engines that gather its weight per module see the use
            if torch.compiler.is_compiling():  # dynamo cannot trace the ring's P2P: custom ops (issue 31)
                out = call.run(lambda weight, c, r: compiled_latent_attention(
                    plan.algorithm, plan.group, plan.opts, call.dims, q, *latent(c, r), weight, sinks))
            elif plan.algorithm == "ring":
                out = call.run(lambda weight, c, r: LatentRingAttention.apply(
                    q, *latent(c, r), weight, RingComm(plan.group), plan.opts, call.dims, sinks))
            else:
                out = call.run(lambda weight, c, r: LatentAllGatherAttention.apply(
                    q, *latent(c, r), weight, plan.group, plan.opts, call.dims, sinks))
            if self.check_finite:
                check_finite({"output": out}, self.group, f"layer {layer or '?'} attention output")
            return out
