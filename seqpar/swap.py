"""Find the attention in an existing model and route it to :func:`seqpar.attention.attention`.

Three routes, chosen per module:

- ``"hf"``: Hugging Face transformers attention modules (those dispatching through
  ``ALL_ATTENTION_FUNCTIONS``). A ``"seqpar"`` attention function and mask function are registered
  with transformers, and the model's attention implementation is switched to it. The glue lives in
  :mod:`seqpar.integrations.transformers`, imported only when such a module is found, so seqpar
  imports without transformers.
- ``"sdpa"``: any other module whose code calls ``torch.nn.functional.scaled_dot_product_attention``
  (nanoGPT style). ``F.scaled_dot_product_attention`` is replaced once by a dispatcher that behaves
  exactly as the original except while a swapped module's forward runs on the calling thread; then
  the call runs as seqpar attention. Code that imported the function itself (``from
  torch.nn.functional import scaled_dot_product_attention``) bypasses the dispatcher: the swapped
  module's forward then raises, rather than silently running plain local attention.
- ``"mha"``: ``nn.MultiheadAttention`` is replaced by :class:`SeqParMultiheadAttention`, which keeps
  the same parameter objects and state_dict keys.

Every swapped module runs on a shard of the sequence: inputs ``(batch, seq_local, ...)`` in the
configured sharding, as produced by :func:`seqpar.data.shard_batch`. Positions must be the shard's
*global* positions (``position_ids`` from ``shard_batch``): Hugging Face models get them filled in
by the swap, but code that numbers positions from the local length (nanoGPT's
``pos = torch.arange(t)``) must take them as an argument instead. Features seqpar does not honour
(sliding windows shorter than the sequence, soft-capping, sinks, attention dropout, custom or
padding masks, attention weights) are refused, at swap time where the model says so, else at call
time, with the layer named: never silently computed as plain attention.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from seqpar.config import PatternConfig, SeqParConfig

__all__ = [
    "swap_attention",
    "SwapReport",
    "SwappedModule",
    "SwapError",
    "SwapOptions",
    "SeqParMultiheadAttention",
    "ROUTES",
]

logger = logging.getLogger("seqpar")

ROUTES = ("hf", "sdpa", "mha")
_ROUTE_HELP = {
    "hf": "Hugging Face transformers attention modules (dispatching through ALL_ATTENTION_FUNCTIONS)",
    "sdpa": "modules whose code calls torch.nn.functional.scaled_dot_product_attention",
    "mha": "torch.nn.MultiheadAttention modules",
}


class SwapError(ValueError):
    """The model's attention cannot be swapped as configured; the message says what and how to fix."""


@dataclass(frozen=True)
class SwapOptions:
    """How a swapped module calls seqpar attention; attached to each swapped module.

    ``deepcopy`` returns the same object: a process group cannot be copied, and a copied model
    (e.g. an EMA or reference copy) shares the groups of the original.
    """

    group: dist.ProcessGroup | None = None
    """The SP group (``None``: the default manager's SP group, else the world)."""
    mode: str = "ring"
    sharding: str = "contiguous"
    overlap: bool = True
    check_inputs: bool = True
    head_chunks: int | str = "auto"
    pattern: PatternConfig = field(default_factory=PatternConfig)
    """Dense attention, or LongNet dilated attention (``seqpar.attention.dilated``)."""

    @classmethod
    def from_config(cls, config: SeqParConfig, group: dist.ProcessGroup | None) -> SwapOptions:
        return cls(group=group, mode=config.mode, sharding=config.sharding,
                   overlap=config.overlap, check_inputs=config.check_inputs, head_chunks=config.head_chunks,
                   pattern=config.pattern)

    def __deepcopy__(self, memo: dict) -> SwapOptions:
        return self

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None
    ) -> Tensor:
        """seqpar attention on shards: q ``(batch, q_heads, seq_local, head_dim)``, k/v
        ``(batch, kv_heads, seq_local, head_dim)`` -> ``(batch, q_heads, seq_local, head_dim)``."""
        from seqpar.attention import attention

        # seqpar.attention may itself call F.scaled_dot_product_attention (one rank, no group):
        # suspend the dispatcher so that call is the plain kernel, not a recursion.
        with _suspended():
            if self.pattern.type == "dilated":
                from seqpar.attention.dilated import dilated_attention

                return dilated_attention(
                    q, k, v, segment_lengths=self.pattern.segment_lengths,
                    dilation_rates=self.pattern.dilation_rates, causal=causal, scale=scale,
                    mode=self.mode, group=self.group, sharding=self.sharding,
                    head_layout=self.pattern.head_layout, check_inputs=self.check_inputs,
                )
            return attention(
                q, k, v, causal=causal, scale=scale, mode=self.mode, group=self.group,
                sharding=self.sharding, overlap=self.overlap, check_inputs=self.check_inputs,
                head_chunks=self.head_chunks,
            )


@dataclass(frozen=True)
class SwappedModule:
    name: str
    """Qualified name in the model (``""`` for the model itself)."""
    route: str
    """``"hf"``, ``"sdpa"`` or ``"mha"``."""
    cls: str
    """Class name of the module before the swap."""


@dataclass
class SwapReport:
    """What :func:`swap_attention` changed."""

    swapped: list[SwappedModule] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.swapped]

    @property
    def routes(self) -> dict[str, str]:
        """Module name -> route."""
        return {m.name: m.route for m in self.swapped}

    def __len__(self) -> int:
        return len(self.swapped)

    def __iter__(self) -> Iterator[SwappedModule]:
        return iter(self.swapped)

    def __str__(self) -> str:
        if not self.swapped:
            return "seqpar swap: nothing swapped"
        counts = {r: sum(m.route == r for m in self.swapped) for r in ROUTES}
        head = ", ".join(f"{n} via {r}" for r, n in counts.items() if n)
        width = max(len(m.name or "<model>") for m in self.swapped)
        lines = [f"seqpar swap: {len(self.swapped)} attention module(s) swapped ({head})"]
        lines += [f"  {(m.name or '<model>'):<{width}}  {m.cls} -> {m.route}" for m in self.swapped]
        return "\n".join(lines)


# ----------------------------------------------------------------------------- sdpa route
_ORIGINAL_SDPA = F.scaled_dot_product_attention
_PATCH_LOCK = threading.Lock()
_local = threading.local()


@dataclass
class _Frame:
    """One running swapped module on this thread's stack; ``None`` frames suspend dispatch."""

    name: str
    options: SwapOptions
    calls: int = 0


def _stack() -> list[_Frame | None]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class _suspended:
    """Context in which F.scaled_dot_product_attention is the plain kernel again."""

    def __enter__(self) -> None:
        _stack().append(None)

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


def _sdpa_dispatch(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` while seqpar is installed: the original outside swapped
    modules; seqpar attention on shards inside them."""
    stack = _stack()
    frame = stack[-1] if stack else None
    if frame is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    where = f"seqpar: F.scaled_dot_product_attention in swapped module '{frame.name}'"
    if attn_mask is not None:
        raise ValueError(
            f"{where} got an attn_mask: seqpar attention takes no mask (a local mask is wrong on a "
            "sequence shard). For causal attention pass attn_mask=None, is_causal=True; padding at "
            "the end needs no mask (see seqpar.data.shard_batch)"
        )
    if dropout_p:
        raise ValueError(
            f"{where} got dropout_p={dropout_p}: seqpar attention has no attention dropout. Set the "
            "module's attention dropout to 0.0 (or call model.eval())"
        )
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"{where}: expected (batch, heads, seq, head_dim) or (batch, seq, head_dim) inputs, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if query.dim() == 3:  # (B, S, D) -> (B, 1, S, D)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        squeeze = True
    else:
        squeeze = False
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"{where}: query has {query.shape[1]} heads and key {key.shape[1]} but enable_gqa=False "
            "(plain SDPA would refuse this too)"
        )
    frame.calls += 1
    out = frame.options.attention(query, key, value, causal=is_causal, scale=scale)
    return out.squeeze(1) if squeeze else out


def _install_sdpa_dispatcher() -> None:
    with _PATCH_LOCK:
        if F.scaled_dot_product_attention is not _sdpa_dispatch:
            if F.scaled_dot_product_attention is not _ORIGINAL_SDPA:
                logger.warning(
                    "seqpar: torch.nn.functional.scaled_dot_product_attention was already replaced by "
                    "%r; seqpar's dispatcher now replaces it and calls torch's kernel outside "
                    "swapped modules", F.scaled_dot_product_attention,
                )
            F.scaled_dot_product_attention = _sdpa_dispatch  # type: ignore[assignment]


def _enter_hook(name: str, options: SwapOptions) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        _stack().append(_Frame(name, options))

    return hook


def _exit_hook(name: str) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        stack = _stack()
        # Pop back to this module's frame (a failing forward may have left inner frames behind).
        while stack:
            frame = stack.pop()
            if frame is not None and frame.name == name:
                break
        else:
            return
        failing = sys.exc_info()[1] is not None  # always_call hooks also run when forward raised
        if frame.calls == 0 and not failing and not getattr(module, "_seqpar_allow_no_call", False):
            raise RuntimeError(
                f"seqpar: swapped module '{name}' ({type(module).__name__}) ran without calling "
                "torch.nn.functional.scaled_dot_product_attention, so its attention was not "
                "sequence-parallel. If it imports the function directly (from torch.nn.functional "
                "import scaled_dot_product_attention), call it as torch.nn.functional."
                "scaled_dot_product_attention; if it computes attention by hand, make it call SDPA"
            )

    return hook


@functools.cache
def _class_calls_sdpa(cls: type) -> bool:
    """Whether the class's own source (any method) names scaled_dot_product_attention."""
    if cls.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return "scaled_dot_product_attention" in source


# ----------------------------------------------------------------------------- mha route
class SeqParMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` on sequence shards, computed by seqpar attention.

    Same parameters and state_dict keys as ``nn.MultiheadAttention`` (``in_proj_weight``,
    ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``; ``q/k/v_proj_weight`` when
    ``kdim``/``vdim`` differ from ``embed_dim``), so checkpoints load either way.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (out, None)``, with inputs
    ``(seq_local, batch, embed)`` or ``(batch, seq_local, embed)`` (``batch_first``) and output in
    the same layout. Causal attention: ``is_causal=True``, or an ``attn_mask`` that is exactly the
    causal mask of the local length (as ``nn.Transformer.generate_square_subsequent_mask`` builds
    it); it is read as the *global* causal pattern. Other masks, ``key_padding_mask``,
    ``need_weights=True``, ``add_bias_kv``, ``add_zero_attn`` and dropout in training are refused.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        dropout: float = 0.0,
        options: SwapOptions | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.options = options if options is not None else SwapOptions()
        # The same registrations, in the same order, as nn.MultiheadAttention: same state_dict.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, **kw
        )
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()
        # nn.TransformerEncoderLayer has a fused inference fast path that reads self_attn's weights
        # and never calls self_attn.forward; any forward pre-hook on a submodule turns it off.
        self.register_forward_pre_hook(_no_fused_fast_path)

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's initialisation, for modules built directly.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    @classmethod
    def from_module(
        cls, mha: nn.MultiheadAttention, options: SwapOptions | None = None
    ) -> SeqParMultiheadAttention:
        """The equivalent of ``mha``, sharing its parameter objects (optimizers stay valid)."""
        problems = _mha_problems(mha)
        if problems:
            raise SwapError(f"cannot swap {type(mha).__name__}: " + "; ".join(problems))
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for attr in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "head_dim",
                     "dropout", "batch_first"):
            setattr(new, attr, getattr(mha, attr))
        new.options = options if options is not None else SwapOptions()
        for pname in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            new.register_parameter(pname, getattr(mha, pname))
        new.register_parameter("in_proj_bias", mha.in_proj_bias)
        new.out_proj = mha.out_proj
        new.bias_k = new.bias_v = None
        new.add_zero_attn = False
        new.train(mha.training)
        new.register_forward_pre_hook(_no_fused_fast_path)
        return new

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"batch_first={self.batch_first}, mode={self.options.mode}, "
                f"sharding={self.options.sharding}")

    def _causal_from_mask(self, attn_mask: Tensor | None, is_causal: bool, seq_q: int, seq_k: int) -> bool:
        if attn_mask is None:
            return is_causal
        if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (seq_q, seq_k):
            raise ValueError(
                f"SeqParMultiheadAttention: attn_mask of shape {tuple(attn_mask.shape)} is not "
                f"supported; only the ({seq_q}, {seq_k}) causal mask (or is_causal=True) is"
            )
        future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=attn_mask.device).triu(1)
        if attn_mask.dtype == torch.bool:
            causal = torch.equal(attn_mask, future)  # True = masked out
        else:
            # -inf, or the dtype's lowest value as some code writes it, above the diagonal.
            lowest = torch.finfo(attn_mask.dtype).min
            causal = bool((attn_mask[future] <= lowest).all() and (attn_mask[~future] == 0).all())
        if not causal:
            raise ValueError(
                "SeqParMultiheadAttention: attn_mask is not the causal mask; seqpar attention "
                "honours only causal (is_causal=True or the square subsequent mask) or no mask"
            )
        return True

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        if need_weights:
            raise ValueError(
                "SeqParMultiheadAttention: need_weights=True is not supported (attention weights of "
                "a sharded sequence are never materialised); call with need_weights=False"
            )
        if key_padding_mask is not None:
            raise ValueError(
                "SeqParMultiheadAttention: key_padding_mask is not supported (seqpar attention takes "
                "no key mask); pad at the end under causal attention, see seqpar.data.shard_batch"
            )
        if self.dropout and self.training:
            raise ValueError(
                f"SeqParMultiheadAttention: dropout={self.dropout} in training is not supported; "
                "build the nn.MultiheadAttention with dropout=0.0"
            )
        if query.dim() != 3:
            raise ValueError(
                f"SeqParMultiheadAttention: expected batched 3D inputs, got query {tuple(query.shape)}"
            )
        if not self.batch_first:  # (S, B, E) -> (B, S, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        batch, seq_q, _ = query.shape
        seq_k = key.shape[1]
        causal = self._causal_from_mask(attn_mask, is_causal, seq_q, seq_k)

        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        heads, hd = self.num_heads, self.head_dim
        q = F.linear(query, w_q, b_q).view(batch, seq_q, heads, hd).transpose(1, 2)  # (B, H, Sq, hd)
        k = F.linear(key, w_k, b_k).view(batch, seq_k, heads, hd).transpose(1, 2)  # (B, H, Sk, hd)
        v = F.linear(value, w_v, b_v).view(batch, seq_k, heads, hd).transpose(1, 2)  # (B, H, Sk, hd)
        out = self.options.attention(q, k, v, causal=causal, scale=1.0 / math.sqrt(hd))
        out = out.transpose(1, 2).reshape(batch, seq_q, self.embed_dim)  # (B, Sq, E)
        out = self.out_proj(out)
        if not self.batch_first:  # (B, S, E) -> (S, B, E)
            out = out.transpose(0, 1)
        return out, None


def _no_fused_fast_path(module: nn.Module, args: Any) -> None:
    """Deliberately empty (see SeqParMultiheadAttention.__init__)."""


def _mha_problems(mha: nn.MultiheadAttention) -> list[str]:
    problems = []
    if mha.bias_k is not None or mha.bias_v is not None:
        problems.append("add_bias_kv=True (a learned key every query sees) is not supported")
    if mha.add_zero_attn:
        problems.append("add_zero_attn=True is not supported")
    if mha.dropout and mha.training:
        problems.append(
            f"attention dropout {mha.dropout} in training is not supported; build it with dropout=0.0"
        )
    return problems


# ----------------------------------------------------------------------------- the swap
def _hf_glue() -> Any | None:
    """The transformers glue module, or None when transformers is not installed."""
    try:
        from seqpar.integrations import transformers as glue
    except ImportError:
        return None
    return glue


def _matches(name: str, module: nn.Module, patterns: tuple[str, ...]) -> bool:
    cls = type(module)
    keys = (name, cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    return any(fnmatch.fnmatchcase(k, p) for p in patterns for k in keys)


def _parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def swap_attention(
    model: nn.Module,
    config: SeqParConfig | dict | str | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> SwapReport:
    """Route the attention of ``model`` to seqpar attention, in place.

    Call it on every rank, before wrapping the model in an engine and before building the
    optimizer (``nn.MultiheadAttention`` parameters are kept as the same objects either way).

    Args:
        model: any ``nn.Module``; after the swap it must be fed sequence shards
            (:func:`seqpar.data.shard_batch`), on every rank of the SP group.
        config: a ``SeqParConfig`` (or dict / JSON path); uses ``swap``, ``mode``, ``sharding``,
            ``overlap``, ``check_inputs``. ``swap="auto"`` tries every route, ``"hf"``, ``"sdpa"``,
            ``"mha"`` one route, a tuple of class names / fnmatch patterns (matched against the
            qualified module name, the class name and the dotted class path) limits the swap to
            those modules, ``"none"`` swaps nothing.
        group: the SP group (default: the default manager's SP group, else the world).

    Returns:
        A :class:`SwapReport` of the swapped modules and their routes.

    Raises:
        SwapError: nothing matched; or a matched module uses a feature seqpar does not honour
            (all such modules are named, and nothing is changed).
    """
    cfg = SeqParConfig.load(config)
    if cfg.pattern.type == "dilated" and cfg.sharding != "contiguous":
        raise SwapError(
            "sequence_parallel.pattern is dilated but sharding is "
            f"{cfg.sharding!r}: dilated segments are contiguous runs of the sequence, so shard with "
            "\"sharding\": \"contiguous\" (dilated attention needs no zigzag balancing: its causal "
            "work is the same in every segment)"
        )
    if cfg.swap == "none":
        logger.info("seqpar swap: swap='none', attention left as it is")
        return SwapReport()
    patterns = cfg.swap if isinstance(cfg.swap, tuple) else None
    routes = set(ROUTES) if cfg.swap == "auto" or patterns else {cfg.swap}
    options = SwapOptions.from_config(cfg, group)
    glue = _hf_glue() if "hf" in routes else None

    plan: list[tuple[str, nn.Module, str]] = []
    problems: list[str] = []
    sdpa_prefixes: list[str] = []
    for name, module in model.named_modules():
        if patterns is not None and not _matches(name, module, patterns):
            continue
        route = None
        if "mha" in routes and isinstance(module, (nn.MultiheadAttention, SeqParMultiheadAttention)):
            route = "mha"
            if isinstance(module, nn.MultiheadAttention):
                problems += [f"layer '{name}': {p}" for p in _mha_problems(module)]
                if not name:
                    problems.append(
                        "the model is itself an nn.MultiheadAttention, which cannot be replaced in "
                        "place; wrap it in a module, or use SeqParMultiheadAttention.from_module"
                    )
        elif glue is not None and glue.is_hf_attention(module):
            route = "hf"
            problems += [f"layer '{name}': {p}" for p in glue.swap_problems(module)]
        elif (
            "sdpa" in routes
            and _class_calls_sdpa(type(module))
            and not any(name.startswith(p) for p in sdpa_prefixes)
        ):
            route = "sdpa"
            sdpa_prefixes.append(f"{name}." if name else "")
        if route is not None:
            plan.append((name, module, route))

    if problems:
        raise SwapError(
            "seqpar cannot swap this model's attention exactly:\n  - " + "\n  - ".join(problems)
            + "\nNothing was changed."
        )
    if not plan:
        looked = "; ".join(_ROUTE_HELP[r] for r in ROUTES if r in routes)
        if patterns is not None:
            looked = f"modules matching {list(patterns)} among {looked}"
        hint = ""
        if "hf" in routes and glue is None:
            hint = " (transformers is not installed, so the 'hf' route was unavailable)"
        raise SwapError(
            f"swap_attention found nothing to swap in {type(model).__name__} with "
            f"swap={cfg.swap!r}: looked for {looked}{hint}. Set sequence_parallel.swap to a route "
            "or to class names / name patterns of the attention modules"
        )

    report = SwapReport()
    hf_modules: list[tuple[str, nn.Module]] = []
    for name, module, route in plan:
        report.swapped.append(SwappedModule(name, route, type(module).__name__))
        if route == "mha":
            if isinstance(module, SeqParMultiheadAttention):
                module.options = options
                continue
            parent, attr = _parent_and_attr(model, name)
            setattr(parent, attr, SeqParMultiheadAttention.from_module(module, options))
        elif route == "hf":
            hf_modules.append((name, module))
        else:
            _install_sdpa_dispatcher()
            old = getattr(module, "_seqpar_sdpa_hooks", None)
            if old is not None:
                for handle in old:
                    handle.remove()
            module._seqpar_sdpa_hooks = (
                module.register_forward_pre_hook(_enter_hook(name, options)),
                module.register_forward_hook(_exit_hook(name), always_call=True),
            )
    if hf_modules:
        glue.apply(model, hf_modules, options)
    logger.info("%s", report)
    from seqpar.tiling import apply_tiling  # tiled loss / MLP, offload: from the same config

    report.tiling = apply_tiling(model, cfg, group=group)
    return report
