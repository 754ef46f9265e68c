"""Typed, validated seqpar configuration, built once at the edge.

A config comes either from a standalone seqpar JSON (the ``sequence_parallel`` block at the top level,
or under a ``"sequence_parallel"`` key) or from a DeepSpeed JSON config that carries a
``"sequence_parallel": {...}`` block beside DeepSpeed's own keys. Everything is checked at load time;
the core never reads JSON or environment variables.

Example block::

    "sequence_parallel": {
        "size": 2,                  # SP degree: ranks that share one sequence
        "mode": "ring",             # "ring" | "allgather" | "ulysses" | "hybrid" | "auto"
        "ulysses_size": 1,          # Ulysses (all-to-all) degree inside the SP group, or "auto"
        "tp_size": 1,               # tensor-parallel degree (innermost mesh dim); world = dp x size x tp_size
        "tp_sequence_parallel": false,  # Megatron-style: norms/residuals split along the sequence over TP
        "tp_loss_parallel": "auto", # LM head logits split on the vocabulary over TP: true | false | "auto"
        "sharding": "zigzag",       # "contiguous" | "zigzag" | "balanced"; absent: undeclared
        "overlap": true,            # overlap ring transfers with block compute
        "check_inputs": true,       # cross-rank shape/dtype check before each call
        "head_chunks": "auto",      # run attention in this many head passes (less memory)
        "mla_transfer": "latent",   # MLA models' ring: move the latent ("latent") or expanded K/V
        "mixer_kernels": "torch",   # hybrid mixers' local scans: "torch" | "auto" (CUDA kernels if importable)
        "swap": "auto",             # what attention to replace in a model
        "tiled_loss": false,        # LM head + cross-entropy over sequence chunks
        "tiled_mlp": false,         # decoder MLPs over sequence chunks: int | "auto" | false
        "offload_activations": false,  # checkpointed layer inputs in pinned CPU memory
        "recompute_norm": false,    # RMSNorms save only their input, recomputed in backward
        "pattern": {"type": "dense"},
        "timeout_s": 600,           # bound on the process groups seqpar creates (seconds)
        "check_finite": false,      # collective NaN/Inf check of attention inputs/outputs
        "dkv_wire_dtype": "fp32",   # ring backward's dK/dV messages: "fp32" (exact) | "bf16" (half the bytes)
        "high_priority_streams": false,  # NCCL groups' kernels on a high-priority CUDA stream (Megatron's option)
        "dynamic": {"max_tokens_per_rank": 4096, "min_size": 1}  # length-aware dynamic CP (absent: off)
    }
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConfigError",
    "TP_LOSS_PARALLEL",
    "check_tp_loss_parallel",
    "check_autotp",
    "Links",
    "SIZE_ALIASES",
    "COMM_TYPES",
    "MODES",
    "SHARDINGS",
    "PATTERN_TYPES",
    "HEAD_LAYOUTS",
    "MIXER_KERNELS",
    "DKV_WIRE_DTYPES",
    "DKV_WIRE_HINT",
    "DKV_WIRE_NO_EFFECT",
    "PatternConfig",
    "DynamicConfig",
    "SeqParConfig",
]

MODES = ("ring", "allgather", "ulysses", "hybrid", "auto")
# balanced: chunks dealt per batch from the packed documents' boundaries (seqpar.sequence.sharding), so
# causal work stays even where zigzag's balance breaks
SHARDINGS = ("contiguous", "zigzag", "balanced")
MIXER_KERNELS = ("torch", "auto")
PATTERN_TYPES = ("dense", "dilated")
HEAD_LAYOUTS = ("mixed", "grouped")
SWAP_KEYWORDS = ("auto", "hf", "sdpa", "mha", "none")
# what the ring's travelling dK/dV accumulators are sent in (seqpar.attn.ring)
DKV_WIRE_DTYPES = ("fp32", "bf16")
DKV_WIRE_HINT = (
    'choose "fp32" (the default: exact) or "bf16" (half the dK/dV bytes, added in fp32 at every hop, not '
    'exact); "fp16" is refused: with 5 exponent bits, gradients underflow (or overflow) without loss scaling'
)
# modes whose dK/dV do not travel as accumulators: all-gather reduce-scatters them (a bf16 reduce-scatter
# would sum in bf16), Ulysses returns finished gradients in the input dtype by all-to-all
DKV_WIRE_NO_EFFECT = ("allgather", "ulysses")

# The key under which a DeepSpeed (or launcher) JSON carries the seqpar block.
BLOCK_KEY = "sequence_parallel"

# Other frameworks' names, accepted inside the block (docs/names.md):
# they set `size`, and Megatron's cp_comm_type sets `mode`. Resolved once, in from_dict.
SIZE_ALIASES = ("cp_size", "context_parallel_degree", "sequence_parallel_size")
COMM_TYPES = {"p2p": "ring", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "hybrid"}


def foreign_mode_hint(mode: object) -> str:
    """``" ('p2p' is Megatron's cp_comm_type for mode 'ring')"`` when ``mode`` is one of Megatron's
    ``cp_comm_type`` names (a migrating user's mode), else ``""``."""
    if isinstance(mode, str) and mode in COMM_TYPES:
        return f" ({mode!r} is Megatron's cp_comm_type name for {COMM_TYPES[mode]!r}: write {COMM_TYPES[mode]!r})"
    return ""


class ConfigError(ValueError):
    """A seqpar config key has a wrong type or an impossible value; the message says how to fix it."""


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"sequence_parallel.{key} = {value!r} is invalid: {allowed}")


def _check_type(key: str, value: Any, types: tuple[type, ...], allowed: str) -> None:
    # bool is a subclass of int: `"size": true` must not pass as 1.
    if isinstance(value, bool) and bool not in types:
        _fail(key, value, allowed)
    if not isinstance(value, types):
        _fail(key, value, allowed)


TP_LOSS_PARALLEL = (True, False, "auto")


def check_tp_loss_parallel(value: Any, *, tp_size: int, tiled_loss: bool) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a valid ``tp_loss_parallel`` for ``tp_size`` and
    ``tiled_loss`` (also :func:`seqpar.integrations.fsdp.wrap`'s argument of that name)."""
    if not any(value is v or (isinstance(value, str) and value == v) for v in TP_LOSS_PARALLEL):
        _fail("tp_loss_parallel", value, 'expected true, false or "auto" (follow tp_sequence_parallel)')
    if value is True and tp_size == 1:
        _fail("tp_loss_parallel", value, "it splits the logits over the TP group: set tp_size > 1, or "
              'tp_loss_parallel "auto"')
    if value is False and tp_size > 1 and tiled_loss:
        _fail("tp_loss_parallel", value, "tiled_loss under TP computes its loss vocab-parallel from the "
              "vocabulary-split head and builds no logits to gather: set tp_loss_parallel \"auto\" or true, "
              "or tiled_loss false")


# Names a user plausibly writes for a key of the block that no close spelling finds (docs/names.md).
_KEY_HINTS = {"sp_size": "size", "sp_degree": "size", "cp_degree": "size", "degree": "size",
              "context_parallel_size": "size", "sequence_parallel_degree": "size", "sp_mode": "mode",
              "attn_mode": "mode", "cp_mode": "mode"}


def _suggestion(key: str, known: set[str]) -> str:
    """The key a user most likely meant by the misspelt or foreign ``key``, else ``""``."""
    if key in _KEY_HINTS and _KEY_HINTS[key] in known:
        return _KEY_HINTS[key]
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return close[0] if close else ""


def _check_unknown(section: str, given: Mapping[str, Any], cls: type) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        # Without the block's key the whole JSON was read as the block: a misspelt block name lands here.
        whole = section == BLOCK_KEY and BLOCK_KEY not in given
        meant = {k: BLOCK_KEY if whole and difflib.get_close_matches(k, [BLOCK_KEY], n=1, cutoff=0.75)
                 else _suggestion(k, known | ({*SIZE_ALIASES, "cp_comm_type"} if section == BLOCK_KEY else set()))
                 for k in unknown}
        # One sentence naming each key and its fix: "rename 'shardnig' to 'sharding'"; beside it, a key with no
        # near name is to be removed (not when the whole JSON was read as the block: those are DeepSpeed's keys).
        renames = [f"{k!r} to {m!r}" for k, m in meant.items() if m]
        lost = [k for k, m in meant.items() if not m]
        fix = f": rename {' and '.join(renames)}" if renames else ""
        if renames and lost and not whole:
            fix += f", and remove {' and '.join(map(repr, lost))}"
        aliases = f"; also accepted: {[*SIZE_ALIASES, 'cp_comm_type']} (docs/names.md)" if section == BLOCK_KEY else ""
        raise ConfigError(
            f"unknown key(s) {unknown} in {section}{fix}; allowed keys are {sorted(known)}{aliases}"
        )


@dataclass(frozen=True)
class Links:
    """Link and compute figures of one machine, for ``mode="auto"`` and ``ulysses_size="auto"``: the
    config's ``links`` block, or measured (:func:`seqpar.attn.choose.probe_links`). Plain data, so
    the process groups (``ProcessGroupManager.links``) can hold it without importing attention.

    Attributes:
        intra_gbps: GB/s per rank inside a node (NVLink: ~450; the Ulysses all-to-all).
        inter_gbps: GB/s per rank across nodes (InfiniBand: ~50; the ring across super-ranks).
        flops: attention kernel throughput per rank, FLOP/s (H100 flash: ~4e14 sustained).
        node_size: ranks per node (``LOCAL_WORLD_SIZE``); an SP axis longer than this crosses nodes.
        latency_s: fixed cost per message round (collective call or ring step).
        mem_gbps: device memory bandwidth, GB/s, for the copies and merges each mode adds around the
            kernels (H100 HBM3: ~3000).
    """

    intra_gbps: float = 450.0
    inter_gbps: float = 50.0
    flops: float = 4e14
    node_size: int = 8
    latency_s: float = 2e-5
    mem_gbps: float = 3000.0


@dataclass(frozen=True)
class PatternConfig:
    """Which attention pattern the swapped layers compute.

    ``dense`` is ordinary (full or causal) attention. ``dilated`` is LongNet dilated attention: a mix
    of (segment length w, dilation rate r) patterns merged by their softmax denominators.
    """

    type: str = "dense"
    """``"dense"`` or ``"dilated"``."""
    segment_lengths: tuple[int, ...] = ()
    """Dilated only: segment length w of each pattern; the sequence length must be a multiple of each."""
    dilation_rates: tuple[int, ...] = ()
    """Dilated only: dilation rate r of each pattern; r must divide the matching segment length."""
    head_layout: str = "mixed"
    """Dilated only: ``"mixed"`` (every head mixes all patterns, head j uses offset j mod r, as in the
    LongNet paper) or ``"grouped"`` (heads split evenly among the patterns, one pattern per group)."""

    def __post_init__(self) -> None:
        if self.type not in PATTERN_TYPES:
            _fail("pattern.type", self.type, f"choose one of {list(PATTERN_TYPES)}")
        if self.head_layout not in HEAD_LAYOUTS:
            _fail("pattern.head_layout", self.head_layout, f"choose one of {list(HEAD_LAYOUTS)}")
        if self.type == "dense":
            if self.segment_lengths or self.dilation_rates:
                raise ConfigError(
                    "sequence_parallel.pattern has segment_lengths/dilation_rates but type is "
                    "'dense'; set \"type\": \"dilated\" or remove them"
                )
            return
        for key in ("segment_lengths", "dilation_rates"):
            values = getattr(self, key)
            if not values:
                _fail(f"pattern.{key}", list(values), "a dilated pattern needs a non-empty list")
            for x in values:
                if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                    _fail(f"pattern.{key}", list(values), "every entry must be a positive integer")
        if len(self.segment_lengths) != len(self.dilation_rates):
            raise ConfigError(
                f"sequence_parallel.pattern: segment_lengths has {len(self.segment_lengths)} entries "
                f"but dilation_rates has {len(self.dilation_rates)}; give one rate per segment length"
            )
        for w, r in zip(self.segment_lengths, self.dilation_rates):
            if w % r:
                raise ConfigError(
                    f"sequence_parallel.pattern: dilation rate {r} does not divide segment length {w}; "
                    f"choose a segment length that is a multiple of its rate"
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PatternConfig:
        if not isinstance(d, Mapping):
            _fail("pattern", d, 'expected an object like {"type": "dense"}')
        _check_unknown("sequence_parallel.pattern", d, cls)
        kwargs = dict(d)
        for key in ("segment_lengths", "dilation_rates"):
            if key in kwargs:
                if not isinstance(kwargs[key], (list, tuple)):
                    _fail(f"pattern.{key}", kwargs[key], "expected a list of positive integers")
                kwargs[key] = tuple(kwargs[key])
        for key in ("type", "head_layout"):
            if key in kwargs:
                _check_type(f"pattern.{key}", kwargs[key], (str,), "expected a string")
        return cls(**kwargs)


@dataclass(frozen=True)
class DynamicConfig:
    """Length-aware dynamic CP (``seqpar.sequence.dynamic``): each document of a step gets a group of
    about ``ceil_pow2(len / max_tokens_per_rank)`` ranks of the DP x SP pool, scheduled in slots in which
    every rank runs one micro-batch; each micro-batch carries its group through the swapped model's call.
    ``ShardedDataLoader(dynamic=...)`` yields a rank's planned micro-batches, and ``launch/train.py
    --dynamic`` trains on them under FSDP2 and DeepSpeed ZeRO-1/2/3, as does ``SeqParTrainer``, eager or
    compiled (``--compile``, ``torch_compile=True``)."""

    max_tokens_per_rank: int
    """The most tokens one rank may hold in one micro-batch (a positive integer): a document longer than
    this is cut over a group of ranks, and one longer than the largest group can hold is refused."""
    min_size: int = 1
    """The smallest group a document gets, a power of two (1: a short document runs whole on one rank).
    It must divide the pool (DP x SP ranks of one TP rank set), checked at init_process_groups."""
    balance: str = "step"
    """What the planner evens, ``"step"`` or ``"slot"``. ``"step"``: each rank's cost over the whole step (an
    engine whose groups wait only for their own ranks until the step's one gradient reduction: DDP,
    ZeRO-1/2). ``"slot"``: each slot's ranks (FSDP2 and ZeRO-3 gather parameters in every forward, so each
    slot waits for the pool's slowest rank): heavy documents spread over more ranks and every slot carries an
    even share (``plan_dynamic(spread_heavy=True, slot_sync=True)``); it spreads by the cost model's ring
    cost, so give the planner a calibrated one (``ShardedDataLoader(cost=...)``)."""

    def __post_init__(self) -> None:
        hint = "expected a positive integer (tokens per rank per micro-batch)"
        _check_type("dynamic.max_tokens_per_rank", self.max_tokens_per_rank, (int,), hint)
        if self.max_tokens_per_rank < 1:
            _fail("dynamic.max_tokens_per_rank", self.max_tokens_per_rank, hint)
        hint = "expected a positive power of two (1, 2, 4, ...): the smallest group a document gets"
        _check_type("dynamic.min_size", self.min_size, (int,), hint)
        if self.min_size < 1 or self.min_size & (self.min_size - 1):
            _fail("dynamic.min_size", self.min_size, hint)
        hint = ('expected "step" (even each rank over the step: DDP, ZeRO-1/2) or "slot" (even each slot: FSDP2, '
                'ZeRO-3)')
        _check_type("dynamic.balance", self.balance, (str,), hint)
        if self.balance not in ("step", "slot"):
            _fail("dynamic.balance", self.balance, hint)

    @classmethod
    def from_dict(cls, d: Any) -> DynamicConfig:
        if not isinstance(d, Mapping):
            _fail("dynamic", d, 'expected an object like {"max_tokens_per_rank": 4096, "min_size": 1}, or leave it out')
        _check_unknown("sequence_parallel.dynamic", d, cls)
        if "max_tokens_per_rank" not in d:
            _fail("dynamic", dict(d), 'it needs "max_tokens_per_rank" (the most tokens one rank holds per micro-batch)')
        return cls(**d)


def _resolve_aliases(block: Mapping[str, Any]) -> dict[str, Any]:
    """The block with other frameworks' names turned into seqpar's: ``cp_size``,
    ``context_parallel_degree`` and ``sequence_parallel_size`` set ``size``; ``cp_comm_type``
    (Megatron) sets ``mode``. Two keys that say different things raise, naming both."""
    kwargs = dict(block)
    said: dict[str, tuple[str, Any]] = {}  # seqpar key -> (the key that said it first, its value)
    if "size" in kwargs:
        said["size"] = ("size", kwargs["size"])
    if "mode" in kwargs:
        said["mode"] = ("mode", kwargs["mode"])
    for alias in (*SIZE_ALIASES, "cp_comm_type"):
        if alias not in kwargs:
            continue
        value = kwargs.pop(alias)
        target = "size" if alias in SIZE_ALIASES else "mode"
        if alias == "cp_comm_type":
            if not isinstance(value, str) or value not in COMM_TYPES:
                _fail(alias, value, f"choose one of {list(COMM_TYPES)} (Megatron's names for the modes "
                      f"{list(COMM_TYPES.values())}), or set \"mode\" instead")
            value = COMM_TYPES[value]
        if target in said:
            first, before = said[target]
            if type(before) is not type(value) or before != value:
                raise ConfigError(
                    f"{BLOCK_KEY}.{first} = {block[first]!r} and {BLOCK_KEY}.{alias} = {block[alias]!r} "
                    f"disagree (both set {target!r}); keep one of them"
                )
            continue
        said[target] = (alias, value)
        kwargs[target] = value
    return kwargs


def check_autotp(ds_config: Mapping[str, Any], config: SeqParConfig) -> None:
    """Raise ``ConfigError`` when a DeepSpeed config's ``tensor_parallel.autotp_size`` differs from
    ``config.tp_size``: one TP degree, DeepSpeed's AutoTP shards the weights and seqpar lays out the
    mesh around it."""
    tp_block = ds_config.get("tensor_parallel")
    autotp = tp_block.get("autotp_size") if isinstance(tp_block, Mapping) else None
    if autotp is not None and autotp != config.tp_size:
        _fail("tp_size", config.tp_size, f"DeepSpeed's tensor_parallel.autotp_size is {autotp!r}; set "
              "sequence_parallel.tp_size to the same value (or leave autotp_size out)")


@dataclass(frozen=True)
class SeqParConfig:
    """The ``sequence_parallel`` block: how sequences are split and how attention crosses the split."""

    size: int = 1
    """SP degree, a positive integer: how many consecutive ranks share one sequence. The world size
    must be a multiple of it; the quotient is the data-parallel degree."""
    mode: str = "ring"
    """How K/V cross ranks: ``"ring"`` (point-to-point, O(S/P) memory per rank), ``"allgather"``
    (one collective, O(S) K/V per rank, fastest at moderate lengths), ``"ulysses"`` (all-to-all from
    sequence to head shards over the whole SP group; needs q_heads divisible by the SP size),
    ``"hybrid"`` (Ulysses inside groups of ``ulysses_size`` consecutive ranks, ring across them) or
    ``"auto"`` (the cheapest of these that the groups and the call allow, see seqpar.attn.choose)."""
    ulysses_size: int | str = 1
    """Ulysses degree u of ``mode="hybrid"``/``"auto"``: the SP group splits into size/u groups of u
    consecutive ranks (all-to-all inside, ideally one node) and a ring across them. Must divide
    ``size``; 1 = no Ulysses axis. ``"auto"`` chooses it once at init_process_groups."""
    tp_size: int = 1
    """Tensor-parallel degree, a positive integer: how many consecutive ranks share each layer's
    weights (Megatron-style, innermost on the mesh ``("dp", "sp", "tp")``, see seqpar.runtime.groups).
    The world size must equal dp x ``size`` x ``tp_size``; each rank then holds ``heads / tp_size``
    query and K/V heads, so both head counts must be multiples of it. 1 = no tensor parallelism."""
    tp_sequence_parallel: bool = False
    """Megatron-style sequence parallelism inside the TP group (needs ``tp_size`` > 1): between the
    tensor-parallel regions (embedding output, norms, residual adds) each TP rank holds ``seq_local / tp_size``
    tokens instead of all of them, so those activations shrink by ``tp_size``; an all-gather along the
    sequence before each attention / MLP block and a reduce-scatter after each row-parallel projection
    replace plain TP's all-reduces (see seqpar.integrations.tp). The LM head's logits then stay split on
    the vocabulary and seqpar's loss is vocab-parallel. Each SP shard's length must be a multiple of
    ``tp_size``. Default off."""
    tp_loss_parallel: bool | str = "auto"
    """The LM head's logits under TP (torchtitan's ``loss_parallel``, Megatron's vocab-parallel cross-entropy):
    ``true`` keeps them split on the vocabulary, ``(batch, seq_local, vocab / tp_size)`` per rank (a DTensor
    ``Shard(-1)``), and seqpar's loss reduces them vocab-parallel, so no rank holds ``(seq_local, vocab)``;
    ``false`` gathers the full logits on every TP rank (the plan's ``colwise_gather_output``: plain tensors,
    any loss); ``"auto"`` (default) follows ``tp_sequence_parallel``. ``true`` needs ``tp_size`` > 1;
    ``false`` is refused with ``tiled_loss`` (under TP the tiled loss is vocab-parallel: it never builds the
    logits to gather)."""
    links: dict[str, float] | None = None
    """Link figures for ``mode="auto"`` (:class:`Links`): any of ``intra_gbps``, ``inter_gbps``,
    ``flops``, ``node_size``, ``latency_s``. ``None``: measured once by a probe broadcast from one rank."""
    sharding: str | None = None
    """How a sequence is cut: ``"contiguous"`` (rank r holds chunk r of P), ``"zigzag"`` (rank r
    holds chunks r and 2P-1-r of 2P, which balances causal work) or ``"balanced"`` (per batch, from
    the packed documents' boundaries). A declared value binds the run: the manager built from this
    config keeps it, and batch/sequence cuts, attention and the loss default to it (an explicit
    argument that contradicts it is an error). ``None`` (absent): undeclared; each call's own
    argument decides, and a call without one gets ``"contiguous"``."""
    overlap: bool = True
    """Overlap the next ring transfer with the current block's compute (double buffering)."""
    check_inputs: bool = True
    """Before each attention call, exchange a few integers to check that every rank passes the same
    shapes and dtypes; turns a hang or silent corruption into a clear error. Costs one tiny
    all-gather per call: switch off once a setup is known to be right."""
    head_chunks: int | str = "auto"
    """Run the ring / all-gather once per chunk of ``kv_heads / head_chunks`` K/V heads: buffers in
    flight shrink by that factor (ring at SP = 4: ~0.32x of single-process memory with 4 chunks,
    0.53x with 1). An integer dividing the model's kv_heads, or ``"auto"`` (on CPU the largest divisor
    <= 4; on a GPU 1 unless the call would not fit, see :func:`seqpar.attn.checks.resolve_head_chunks`)."""
    mla_transfer: str = "latent"
    """What an MLA layer (DeepSeek-V2/V3, Kimi, GLM-4.5 lite, MiniCPM3: transformers modules with
    ``expand_kv`` and ``kv_b_proj``) sends round the ring: ``"latent"`` (the compressed latent,
    ``kv_lora_rank + qk_rope_head_dim`` values per token, 576 for DeepSeek-V3, expanded with
    ``kv_b_proj`` by each rank: 71x fewer bytes than its 40960 expanded K/V values, exact) or
    ``"expanded"`` (K and V as the model computes them, as for any other model). Default
    ``"latent"``: same result, far fewer bytes, and the extra work (one ``kv_b_proj`` matmul per
    block) is ``kv_lora_rank / seq_local`` of the block's attention. ``mode="ring"`` and
    ``"allgather"`` move latents; Ulysses and hybrid, and a layer whose ``expand_kv`` does not match the latent expansion
    (checked once per layer), use the expanded K/V."""
    mixer_kernels: str = "torch"
    """The kernels of the hybrid mixers' local scans (Mamba, Mamba2, GDN / KDA, lightning attention):
    ``"torch"`` (default) runs transformers' own torch functions, whose rounding seqpar's state
    correction mirrors and which are tested exact against one process; ``"auto"`` runs
    flash-linear-attention (GDN, KDA, lightning) and mamba_ssm (Mamba2's SSD Triton kernels, Mamba's
    selective scan) on CUDA where they are importable, else the torch path. ``"auto"`` is opt-in until a
    GPU run proves it exact against ``"torch"`` (``python -m seqpar.bench.gpu_check --stage
    mixer-kernels``); ``"torch"`` is slower on a GPU than those kernels."""
    swap: str | tuple[str, ...] = "auto"
    """What attention to replace in a model: ``"auto"`` (Hugging Face attention interface, modules
    calling ``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``), one of
    ``"hf" | "sdpa" | "mha" | "none"``, or a list of module class names / name patterns."""
    pattern: PatternConfig = field(default_factory=PatternConfig)
    """The attention pattern: dense (default) or LongNet dilated."""
    apex: bool = False
    """Use NVIDIA apex fused kernels (e.g. fused RMSNorm) where apex is installed; falls back with a
    log line where it is not."""
    timeout_s: int | None = None
    """Seconds a collective may wait before it fails (instead of hanging) in the process groups
    seqpar creates: the world group when seqpar initialises torch.distributed
    (``init_process_group`` or ``deepspeed.init_distributed``) and the SP/DP groups. A world group
    the user created keeps its own timeout. ``None``: torch's default."""
    check_finite: bool = False
    """Check attention inputs and outputs of every swapped layer for NaN/Inf; the decision is collective
    over the SP group, so every rank raises together naming the layer and the rank. One all-reduce and
    one host sync per layer call: a debugging aid, off by default (free when off)."""
    tiled_loss: bool = False
    """Compute LM head + cross-entropy over chunks of the local sequence (exact gradient, recomputed
    per chunk in backward): the full ``(seq_local, vocab)`` logits never exist. Applied by the swap
    to Hugging Face causal LMs of the Llama family (see :mod:`seqpar.memory.tiling`)."""
    tiled_mlp: int | str | bool = False
    """Run each decoder MLP over this many sequence chunks, recomputed in backward, so only one
    chunk's intermediate activations are alive: an integer >= 1, ``"auto"`` (chunks of about
    ``hidden_size`` tokens), or ``false``."""
    offload_activations: bool = False
    """Keep checkpointed layer inputs in pinned CPU memory, prefetched in backward (CUDA only; on a
    CPU-only build it changes nothing). Needs activation checkpointing."""
    dynamic: DynamicConfig | None = None
    """Length-aware dynamic CP (:class:`DynamicConfig`): ``{"max_tokens_per_rank": N, "min_size": 1}``.
    ``None`` (absent): off, every sequence is cut over the static SP group. When set,
    ``init_process_groups`` also makes the aligned groups of every size the planner may choose."""
    recompute_norm: bool = False
    """Make the decoder's RMSNorms save only their input and recompute the norm in backward over row
    chunks, instead of keeping the fp32 upcast and the normalised copy (bitwise the same forward and
    input gradient; the weight's gradient summed in fp32): applied by the swap to Hugging Face causal
    LMs of the Llama family (see :mod:`seqpar.memory.norm`)."""

    high_priority_streams: bool = False
    """Create seqpar's NCCL groups with ``is_high_priority_stream`` (their send/receive kernels get the next
    free SM instead of queueing behind an attention kernel that fills the GPU; Megatron-LM's
    ``--high-priority-stream-groups``). No effect on gloo. Off by default until measured over real NCCL
    (see :func:`seqpar.runtime.communicators.high_priority_options`)."""
    dkv_wire_dtype: str = "fp32"
    """The dtype the ring backward's dK/dV accumulators travel in (ring, hybrid's ring, dilated): ``"fp32"``
    (default; the accumulation dtype, exact) or ``"bf16"`` (TransformerEngine's choice: half the dK/dV
    bytes, which are two thirds of a bf16 backward's; each hop adds its share in fp32 and rounds once to
    bf16, so the gradients of K and V are *not* exact: BENCHMARKS.md gives the measured error against
    float64). Refused with ``mode`` ``"allgather"`` or ``"ulysses"`` (dense pattern), whose dK/dV move no
    accumulators; under ``"auto"`` it applies when the choice is the ring or the hybrid."""

    def __post_init__(self) -> None:
        _check_type("size", self.size, (int,), "expected a positive integer (the SP degree)")
        if self.size < 1:
            _fail("size", self.size, "expected a positive integer (the SP degree)")
        _check_type("tp_size", self.tp_size, (int,), "expected a positive integer (the TP degree)")
        if self.tp_size < 1:
            _fail("tp_size", self.tp_size, "expected a positive integer (the TP degree)")
        _check_type("tp_sequence_parallel", self.tp_sequence_parallel, (bool,), "expected true or false")
        if self.tp_sequence_parallel and self.tp_size == 1:
            _fail("tp_sequence_parallel", self.tp_sequence_parallel,
                  "it splits activations over the TP group: set tp_size > 1, or tp_sequence_parallel false")
        _check_type("mode", self.mode, (str,), f"choose one of {list(MODES)}")
        if self.mode not in MODES:
            _fail("mode", self.mode, f"choose one of {list(MODES)}{foreign_mode_hint(self.mode)}")
        if self.ulysses_size != "auto":
            u_hint = f'a positive integer dividing size {self.size}, or "auto"'
            _check_type("ulysses_size", self.ulysses_size, (int,), u_hint)
            if self.ulysses_size < 1 or self.size % self.ulysses_size:
                _fail("ulysses_size", self.ulysses_size, u_hint)
        if self.links is not None:
            link_keys = tuple(f.name for f in dataclasses.fields(Links))  # every figure the cost model reads
            links_hint = f"an object with positive numbers for any of {list(link_keys)}"
            if not isinstance(self.links, Mapping) or not set(self.links) <= set(link_keys) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in self.links.values()
            ):
                _fail("links", self.links, links_hint)
        if self.sharding is not None:  # None: undeclared (the run's calls decide)
            _check_type("sharding", self.sharding, (str,), f"choose one of {list(SHARDINGS)}, or leave it out")
            if self.sharding not in SHARDINGS:
                _fail("sharding", self.sharding, f"choose one of {list(SHARDINGS)}, or leave it out")
        if (self.sharding == "balanced" and self.mode == "hybrid" and self.ulysses_size != "auto"
                and 1 < self.ulysses_size < self.size):
            _fail("sharding", self.sharding,
                  f"the hybrid's super-ranks (ulysses_size {self.ulysses_size} of size {self.size}) hold no "
                  "balanced layout: use \"zigzag\", or mode \"ring\" / \"ulysses\" with \"balanced\"")
        for key in ("overlap", "check_inputs", "apex", "tiled_loss", "offload_activations", "check_finite",
                    "high_priority_streams"):
            _check_type(key, getattr(self, key), (bool,), "expected true or false")
        check_tp_loss_parallel(self.tp_loss_parallel, tp_size=self.tp_size, tiled_loss=self.tiled_loss)
        _check_type("recompute_norm", self.recompute_norm, (bool,), "expected true or false")
        _check_type("mla_transfer", self.mla_transfer, (str,), 'choose "latent" or "expanded"')
        if self.mla_transfer not in ("latent", "expanded"):
            _fail("mla_transfer", self.mla_transfer, 'choose "latent" or "expanded"')
        kernels_hint = f'choose one of {list(MIXER_KERNELS)} ("torch": transformers\' torch path, the default)'
        _check_type("mixer_kernels", self.mixer_kernels, (str,), kernels_hint)
        if self.mixer_kernels not in MIXER_KERNELS:
            _fail("mixer_kernels", self.mixer_kernels, kernels_hint)
        chunks_hint = 'a positive integer dividing the model\'s kv_heads, or "auto"'
        if self.head_chunks != "auto":
            _check_type("head_chunks", self.head_chunks, (int,), chunks_hint)
            if self.head_chunks < 1:
                _fail("head_chunks", self.head_chunks, chunks_hint)
        mlp_hint = 'a positive integer (the number of chunks), "auto", or false'
        if self.tiled_mlp is not False and self.tiled_mlp != "auto":
            _check_type("tiled_mlp", self.tiled_mlp, (int,), mlp_hint)
            if self.tiled_mlp < 1:
                _fail("tiled_mlp", self.tiled_mlp, mlp_hint)
        if isinstance(self.swap, str):
            if self.swap not in SWAP_KEYWORDS:
                _fail(
                    "swap",
                    self.swap,
                    f"use one of {list(SWAP_KEYWORDS)} or a list of module class names / name patterns",
                )
        elif isinstance(self.swap, tuple):
            if not self.swap or not all(isinstance(s, str) and s for s in self.swap):
                _fail("swap", list(self.swap), "a list of non-empty module class names / name patterns")
        else:
            _fail("swap", self.swap, "expected a string or a list of strings")
        if self.timeout_s is not None:
            hint = "expected a positive integer number of seconds (or null for torch's default)"
            _check_type("timeout_s", self.timeout_s, (int,), hint)
            if self.timeout_s < 1:
                _fail("timeout_s", self.timeout_s, hint)
        if not isinstance(self.pattern, PatternConfig):
            _fail("pattern", self.pattern, "expected a pattern object")
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicConfig):
            _fail("dynamic", self.dynamic, 'expected {"max_tokens_per_rank": N, "min_size": 1}, or leave it out')
        if self.dynamic is not None and self.mode == "hybrid":
            # the refusal resolve.py would give at the first call names a group= the user never passed
            _fail("mode", self.mode, 'length-aware dynamic CP gives each micro-batch its own group of ranks, and '
                  "hybrid's Ulysses x ring groups are fixed at init; with a \"dynamic\" block use mode \"ring\", "
                  '"allgather", "ulysses" or "auto", or drop "dynamic"')
        _check_type("dkv_wire_dtype", self.dkv_wire_dtype, (str,), DKV_WIRE_HINT)
        if self.dkv_wire_dtype not in DKV_WIRE_DTYPES:
            _fail("dkv_wire_dtype", self.dkv_wire_dtype, DKV_WIRE_HINT)
        if self.dkv_wire_dtype != "fp32" and self.mode in DKV_WIRE_NO_EFFECT and self.pattern.type == "dense":
            _fail("dkv_wire_dtype", self.dkv_wire_dtype,
                  f'mode "{self.mode}" moves no dK/dV accumulators (all-gather reduce-scatters dK/dV shares, '
                  'Ulysses all-to-alls finished gradients); use mode "ring", "hybrid" or "auto", or leave '
                  'dkv_wire_dtype at "fp32"')

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SeqParConfig:
        """Build from a dict: either the block itself, or a dict with a ``"sequence_parallel"`` key
        (a DeepSpeed or launcher config), whose other keys are left to their owners."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"expected a JSON object for the seqpar config, got {type(d).__name__}")
        if BLOCK_KEY in d:
            block = d[BLOCK_KEY]
            if not isinstance(block, Mapping):
                raise ConfigError(
                    f"'{BLOCK_KEY}' must be a JSON object like {{\"size\": 2, \"mode\": \"ring\"}}, "
                    f"got {block!r}"
                )
        else:
            block = d
        kwargs = _resolve_aliases(block)
        _check_unknown(BLOCK_KEY, kwargs, cls)
        if "pattern" in kwargs:
            kwargs["pattern"] = PatternConfig.from_dict(kwargs["pattern"])
        if kwargs.get("dynamic") is not None:
            kwargs["dynamic"] = DynamicConfig.from_dict(kwargs["dynamic"])
        if isinstance(kwargs.get("swap"), list):
            kwargs["swap"] = tuple(kwargs["swap"])
        config = cls(**kwargs)
        if BLOCK_KEY in d:  # a DeepSpeed or launcher config: its AutoTP degree must be ours
            check_autotp(d, config)
        return config

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> SeqParConfig:
        """Read a standalone seqpar JSON or a DeepSpeed JSON with a ``sequence_parallel`` block."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)

    @classmethod
    def from_deepspeed_config(cls, ds_config: Mapping[str, Any] | str | os.PathLike) -> SeqParConfig:
        """The ``sequence_parallel`` block of a DeepSpeed config (dict or path). A config without the
        block gives the defaults (SP size 1), so a plain DeepSpeed run keeps working."""
        if not isinstance(ds_config, Mapping):
            with open(ds_config) as f:
                ds_config = json.load(f)
        config = cls.from_dict(ds_config.get(BLOCK_KEY, {}))
        check_autotp(ds_config, config)
        return config

    @classmethod
    def load(cls, source: SeqParConfig | Mapping[str, Any] | str | os.PathLike | None) -> SeqParConfig:
        """Accept whatever a user has at hand: a config, a dict, a JSON path, or None (defaults)."""
        if source is None:
            return cls()
        if isinstance(source, SeqParConfig):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        return cls.from_json(source)

    @property
    def links_figures(self) -> Links | None:
        """The ``links`` block as :class:`Links` (``None``: not given, measure on first use)."""
        return Links(**self.links) if self.links else None

    def replace(self, **changes: Any) -> SeqParConfig:
        """A copy with some fields changed (validated again), e.g. from command-line flags."""
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:  # the links dict is not hashable; the JSON form is
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pattern"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["pattern"].items()}
        if isinstance(d["swap"], tuple):
            d["swap"] = list(d["swap"])
        return d
