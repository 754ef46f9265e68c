"""Per-rank memory of a whole training step: ``estimate_training_memory(model_config, ...)``.

Attention is one term among several once it is O(S/P). This model adds up, per rank, the bytes
alive at the step's worst moment, by category:

- ``parameters``: the engine's copy of the weights (sharded or whole) plus the whole-layer copies it
  gathers for compute (FSDP2: the root module and up to two decoder layers; ZeRO-3: the root, every
  tensor under DeepSpeed's persistence threshold, and the layers' other tensors its prefetch and reuse
  distance keep gathered: :func:`_zero3_gathered`) and, with low-precision training, the fp32 master partition;
- ``gradients``: the reduced gradient partition plus the unreduced whole-layer gradients in flight;
- ``optimizer_state``: AdamW's two moments, fp32, on the engine's partition;
- ``activations``: what each decoder layer saves for backward (per token: the tensors listed in
  :func:`_layer_saved_bytes`, as ``python -m seqpar.bench.layer_memory`` measures them; fewer with
  ``recompute_norm``), or only its input with activation checkpointing plus one layer recomputed;
  the tiled MLP keeps one chunk's intermediate activations instead of the whole;
- ``attention_transients``: :func:`seqpar.memory.attention.estimate_attention_memory` for one layer's attention call,
  less the q, k, v, output already counted as activations;
- ``logits_loss``: the ``(seq_local, vocab)`` logits, their fp32 log-softmax and two gradients of that
  size (untiled), or the tiled loss's backward (``tiled_loss``: :func:`seqpar.memory.tiling.loss_backward_bytes`, in
  the order the loss runs: the head's gradient in its dtype plus a block's buffers and dhidden in fp32 when the
  vocabulary blocks are outer, else two chunks of fp32 logits plus the fp32 dW accumulator and, in low precision,
  the head's gradient cast from it while it is alive at the end of the loss's backward);
- ``communication``: the engines' gradient-reduction buckets (ZeRO-3's end of backward: beside its bucket, the bucket's
  flat reduce-scatter input and, on CPU, gloo's copy of it; a head gradient larger than the bucket is reduce-scattered
  on its own during the backward, beside every layer's activations).

``peak`` is the largest of the step's candidate moments (the loss backward, the last layer's backward,
the gradients' reduction at the end of backward, ZeRO-3's reduction of a head gradient that overflows the bucket,
ZeRO-3's forward beside its prefetch's coalesced all-gather buffer), each a sum of the categories alive then. The figures are those of
``launch/train.py``'s Llama on CPU (fp32, exact tensor accounting); ``tests/test_training_memory.py``
holds them within 10% of the measured peak over SP 1/2/4, tiling on/off, activation checkpointing
on/off, FSDP2 and ZeRO-2/3. On a GPU the allocator's fragmentation and the kernels' workspaces
come on top: the GPU figures in BENCHMARKS.md are labelled as modelled.

Hybrid models (linear-attention / state-space / convolution layers among the attention layers) are
read from their transformers config by :mod:`seqpar.memory.mixers`: each mixer layer's weights, what it
saves for backward at S/P and its sequence-parallel exchange (conv halo, all-gathered chunk summaries)
replace attention's terms in that layer; validated on a Jamba within 10% in the same test file.

``offload_activations`` moves the checkpointed layer inputs to host memory: on a GPU they then cost
one or two layers' inputs (the one in use and the prefetched one) instead of all layers'.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from seqpar.memory.attention import as_dtype, estimate_attention_memory
from seqpar.memory.mixers import MixerShape, mixer_shape
from seqpar.memory.search import largest_fitting

__all__ = ["ModelShape", "MODEL_SHAPES", "estimate_training_memory", "longest_sequence", "layer_saved_bytes",
           "CATEGORIES"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "attention_transients",
              "logits_loss", "communication")
ENGINES = ("fsdp2", "deepspeed")


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a Llama-family decoder (Hugging Face config field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    mixer: MixerShape | None = None
    """Hybrid models: the mixer of the non-attention layers (:func:`seqpar.memory.mixers.mixer_shape`)."""
    layer_kinds: tuple[str, ...] = ()
    """Hybrid models: each layer's kind (``"attention"``, ``"mixer"``, ``"both"``, ``"mlp"``); empty: all attention."""

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a dict, a ``transformers`` config object or a ModelShape."""
        if isinstance(config, ModelShape):
            return config
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if get(k) is None]
        if missing:
            raise ValueError(f"model_config lacks {missing}: give the Hugging Face config fields")
        mixer, kinds = mixer_shape(config)
        return cls(
            vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")), num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            num_key_value_heads=int(get("num_key_value_heads") or get("num_attention_heads")),
            head_dim=get("head_dim"), tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            mixer=mixer, layer_kinds=kinds,
        )

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_params(self) -> int:
        h, d = self.hidden_size, self.d
        return h * self.num_attention_heads * d * 2 + h * self.num_key_value_heads * d * 2  # q, o; k, v

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every layer's kind (all ``"attention"`` for a Llama-family shape)."""
        return self.layer_kinds or ("attention",) * self.num_hidden_layers

    def params_of(self, kind: str) -> int:
        """Parameters of one layer of ``kind``: its attention and / or mixer, gate / up / down, two RMSNorms."""
        h, i = self.hidden_size, self.intermediate_size
        mix = self.mixer.params(h) if self.mixer is not None and kind in ("mixer", "both") else 0
        attn = self.attention_params if kind in ("attention", "both") else 0
        return attn + mix + 3 * h * i + 2 * h

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (the whole copy an engine gathers for compute)."""
        if not self.layer_kinds:
            return self.params_of("attention")
        return max(self.params_of(k) for k in self.layer_kinds)

    @property
    def root_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.hidden_size  # embed, lm_head, norm

    @property
    def params(self) -> int:
        if not self.layer_kinds:
            return self.root_params + self.num_hidden_layers * self.layer_params
        return self.root_params + sum(self.params_of(k) for k in self.layer_kinds)

    def tp_local(self, tp: int) -> ModelShape:
        """The shape one rank of a tensor-parallel group of ``tp`` holds (Megatron / transformers' plan): query
        and K/V heads, the MLP's intermediate width and the vocabulary (embedding, LM head) split ``tp`` ways;
        hidden size, head dim and the norms whole. ``tp_local(1)`` is the shape itself.

        Raises:
            ValueError: head counts that ``tp`` does not divide.
        """
        if tp == 1:
            return self
        if self.mixer is not None:
            raise ValueError(f"tp_size={tp}: the memory model of hybrid models ({self.mixer.family} mixers) covers "
                             "tp_size 1 only; estimate with tp_size=1")
        if tp < 1 or self.num_attention_heads % tp or self.num_key_value_heads % tp:
            raise ValueError(f"tp_size={tp} must divide the query heads ({self.num_attention_heads}) and the K/V "
                             f"heads ({self.num_key_value_heads}); choose a divisor of both")
        return ModelShape(
            vocab_size=math.ceil(self.vocab_size / tp), hidden_size=self.hidden_size,
            intermediate_size=math.ceil(self.intermediate_size / tp), num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads // tp, num_key_value_heads=self.num_key_value_heads // tp,
            head_dim=self.d, tie_word_embeddings=self.tie_word_embeddings,
        )


# Shapes from the models' published config.json files, written out here: no download.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama3-70b": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                   "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "qwen2-7b": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4},
    "mistral-7b": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8},
    "train-py": {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
}


def _norm_saved_bytes(h: int, e: int, recompute_norm: bool, input_saved_elsewhere: bool, tp_seq: int = 1) -> int:
    """Bytes per token one RMSNorm call keeps for backward, its output included (the next projection
    saves it), measured by ``python -m seqpar.bench.layer_memory``: Hugging Face's saves the fp32
    upcast of its input (the input itself in fp32) and the normalised copy; the lean one
    (``recompute_norm``) only its input. ``input_saved_elsewhere``: the input is counted apart (the
    checkpointed layer input). ``tp_seq``: TP sequence parallelism's degree (1: off): the norm runs on
    ``1 / tp_seq`` of the tokens, but the column-parallel projection after it saves the all-gathered
    input, whole (torch's DTensor matmul keeps the input it was given; Megatron re-gathers instead)."""
    if recompute_norm:
        return h * e + (0 if input_saved_elsewhere else h * e // tp_seq)
    upcast = 0 if (e == 4 and input_saved_elsewhere) else h * 4 // tp_seq  # fp32: .float() is the input itself
    return upcast + h * e // tp_seq + h * e + 4 // tp_seq  # + the fp32 reciprocal RMS per row


def _layer_saved_bytes(m: ModelShape, e: int, *, mlp_saved: bool, recompute_norm: bool, input_counted: bool,
                       out_copy: bool, tp_seq: int = 1) -> int:
    """Bytes per token one decoder layer saves for backward (Hugging Face Llama, seqpar attention),
    measured by ``python -m seqpar.bench.layer_memory``: the two RMSNorms (:func:`_norm_saved_bytes`;
    the first one's input is the layer input, ``input_counted`` when the caller counts it as a
    checkpointed input; the second one's is the residual sum); the rotated q, k, v, the output and
    the fp32 log-sum-exp attention saves, the rotary cos / sin, and the contiguous
    ``(batch, seq, heads, dim)`` copy o_proj saves when attention's output is laid out otherwise
    (``out_copy``); and, unless the MLP is tiled, gate, up, act(gate) and their product (4 I). Under
    tensor parallelism ``m`` is a rank's shape (:meth:`ModelShape.tp_local`) and ``tp_seq`` the TP sequence
    parallelism degree of the norms."""
    h, kvd, qd = m.hidden_size, m.num_key_value_heads * m.d, m.num_attention_heads * m.d
    saved = _norm_saved_bytes(h, e, recompute_norm, input_counted, tp_seq)
    saved += _norm_saved_bytes(h, e, recompute_norm, False, tp_seq)
    saved += (2 * qd + 2 * kvd + (qd if out_copy else 0) + 2 * m.d) * e + m.num_attention_heads * 4
    if mlp_saved:
        saved += 4 * m.intermediate_size * e
    return saved


def layer_saved_bytes(model_config: Any, *, dtype: torch.dtype | str = torch.float32, sp_size: int = 1,
                      mode: str = "ring", tp_size: int = 1, tp_sequence_parallel: bool = False,
                      recompute_norm: bool = False, tiled_mlp: bool = False) -> int:
    """Bytes per local token (of the SP shard) that one decoder layer saves for backward on a rank, its input
    left out (the term :func:`estimate_training_memory` counts per layer; measured by
    ``python -m seqpar.bench.layer_memory`` and, with tensor parallelism, ``launch/tp_memory.py``)."""
    m = _model_shape(model_config).tp_local(tp_size)
    e = torch.empty((), dtype=as_dtype(dtype)).element_size()
    return _layer_saved_bytes(m, e, mlp_saved=not tiled_mlp, recompute_norm=recompute_norm, input_counted=True,
                              out_copy=sp_size > 1 and mode != "ring",
                              tp_seq=tp_size if tp_sequence_parallel else 1)


def _mixer_layer_delta(m: ModelShape, e: int, kind: str, *, sp_size: int, out_copy: bool) -> int:
    """Bytes per local token a hybrid model's layer of ``kind`` saves beyond (or short of) a Llama layer's
    :func:`_layer_saved_bytes`: a mixer layer saves its mixer's tensors
    (:meth:`seqpar.memory.mixers.MixerShape.saved_bytes`) instead of attention's q, k, v, output, log-sum-exp
    and rotary tables; a ``"both"`` layer (Falcon-H1, Zamba's hybrid layers) saves both; an ``"mlp"`` layer
    (Nemotron-H) neither."""
    qd, kvd = m.num_attention_heads * m.d, m.num_key_value_heads * m.d
    attention = (2 * qd + 2 * kvd + (qd if out_copy else 0) + 2 * m.d) * e + m.num_attention_heads * 4
    mixer = m.mixer.saved_bytes(e, sp_size) if m.mixer is not None else 0
    return {"attention": 0, "both": mixer, "mixer": mixer - attention, "mlp": -attention}[kind]


def _mlp_chunk_rows(tiled_mlp: int | str | bool, rows: int, hidden: int) -> int:
    if tiled_mlp is False:
        return rows
    from seqpar.memory.tiling import mlp_chunks

    return math.ceil(rows / mlp_chunks(tiled_mlp, rows, hidden))


class _StateBytes(NamedTuple):
    """The step's static bytes per rank: weights (with the gathered whole copies), AdamW's moments, and the
    reduced gradient partition."""

    params: int
    optimizer: int
    grads_reduced: int
    layers_gathered: int = 0
    """ZeRO-3: the decoder layers' non-persistent whole copies within ``params`` (gathered for compute, alive
    through the backward's moments), which the end of backward has released (:func:`_zero3_gathered`)."""
    forward_fetch: int = 0
    """ZeRO-3: the traced step's first coalesced all-gather of non-persistent parameters, whole (its flat buffer is
    alive beside the copies made from it: the forward's peak; :func:`_zero3_gathered`)."""
    layer_copies: tuple[int, ...] = ()
    """ZeRO-3: each decoder layer's share of ``layers_gathered``, first layer first, when every layer's copies are
    kept from the forward to its backward (empty when only a layer and its prefetch are): DeepSpeed releases a layer's
    copies once its backward has run (est31c, a bucket overflowing inside the 5th-last layer's MLP backward of 8: only
    the 4 layers still to run held their MLP weights, 12 x 524,288 B)."""


class _ActivationBytes(NamedTuple):
    """Saved activations per rank at the last layer's backward (``backward``) and at the loss's backward
    (``at_loss``), the MLP backward's transient (tiled: one chunk recomputed; untiled: the gradients
    of its intermediates), and what the last layer's MLP block saved (``after_attention``: freed by
    its backward, which runs before attention's)."""

    backward: int
    at_loss: int
    mlp_transient: int
    after_attention: int = 0
    mlp_grads: int = 0
    """The layer's whole gradients alive beside ``mlp_transient`` at the MLP backward's peak. Tiled: 0, the
    transient already holds the MLP weights' gradient (its accumulator and one chunk's). Untiled: the MLP weights'
    gradients made so far (down_proj's beside the three intermediate gradients; gate's and up's beside fewer).
    Either way the layer's other gradients are not made yet: attention's backward runs after the MLP's."""
    layer_freed: int = 0
    """What one layer's finished backward frees of ``backward``: its saved tensors (its checkpointed input under
    activation checkpointing); 0 where the model does not follow layers one by one (hybrids, offloaded inputs)."""
    mlp_product: int = 0
    """Untiled: the product ``act(gate) * up`` the last layer's down_proj saved (within ``backward``), freed by
    down_proj's backward, before the MLP backward's peak (recorded at ZeRO-3's, est31)."""
    post_norm: int = 0
    """What the post-attention RMSNorm saved (within ``backward``), freed by its backward, which runs between the
    MLP's and o_proj's (recorded at ZeRO-3's overflow at o_proj's gradient, est32)."""
    out_grad: int = 0
    """o_proj's input gradient (rows x q heads' width), made before its weight's (recorded at that overflow,
    est32)."""
    mlp_input: int = 0
    """The MLP's input (the post-attention norm's output, within ``backward``: the norm's figure counts it, as the
    projections after it save it), freed by the MLP's weight backwards: the norm itself keeps its normalised copy,
    not its output (recorded at ZeRO-3's overflow at gate_proj's gradient: 4 layers still to run, 15 of their 16
    norm outputs and copies alive, est33). Untiled only: the tiled MLP's hold on its input was not recorded (0)."""
    hidden_grad: int = 0
    """One hidden-size gradient over the rows (one is counted in ``backward``, the gradient coming down): a second
    one is alive while a layer's MLP weight gradients are reduced (recorded at ZeRO-3's overflows at down_proj's,
    up_proj's and gate_proj's gradients: two of 8,192 B, est32)."""
    attn_saved: int = 0
    """What one layer's attention saved (q, k, v, the output, its copy for o_proj where made, the log-sum-exp; not the
    shared rotary pair), freed by attention's backward (recorded at ZeRO-3's overflow at v_proj's gradient, est34)."""
    qkv_grads: int = 0
    """Alive once attention's backward has run and v_proj's weight backward has: the gradients of q (rows x q heads'
    width) and k (rows x kv heads' width), and v_proj's input gradient (rows x hidden) (recorded at that overflow)."""
    final_norm_in_flight: int = 0
    """ZeRO-3's reduction of a head gradient larger than the bucket runs inside the final norm's backward: the norm's
    weight gradient's arrival overflows the bucket once the weight's product backward has run (freeing the normalised
    copy it saved, the loss's gradient consumed): the norm's input (its fp32 upcast: the last layer's output itself in
    fp32) and reciprocal RMS, which its other backward nodes still hold, and its weight gradient are alive beside the
    gradient coming down (counted in ``backward``). Recorded at the 1e6-element bucket's measured peak (est34:
    262,144 + 4,096 + 256 B at 1024 rows, hidden 64, fp32): the -0.29% (266,617 B) the model had left under there."""


def _model_shape(model_config: Any) -> ModelShape:
    """The ModelShape of a name in :data:`MODEL_SHAPES`, a config dict or object, or a ModelShape."""
    if isinstance(model_config, str):
        if model_config not in MODEL_SHAPES:
            raise ValueError(f"unknown model {model_config!r}; known: {sorted(MODEL_SHAPES)}, or pass a config dict")
        model_config = MODEL_SHAPES[model_config]
    return ModelShape.from_config(model_config)


def _check_run(engine: str, zero_stage: int, seq_len: int, sp_size: int) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {list(ENGINES)}")
    if engine == "deepspeed" and zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: choose 1, 2 or 3")
    if seq_len % sp_size:
        raise ValueError(f"seq_len={seq_len} is not a multiple of sp_size={sp_size}")


# DeepSpeed ZeRO-3's defaults (deepspeed.runtime.zero.config), the defaults of estimate_training_memory's keywords of
# the same names: a parameter of at most this many elements stays whole
# on every rank (``stage3_param_persistence_threshold``); the traced step's prefetch gathers up to this many elements
# ahead at one fetch (``stage3_prefetch_bucket_size``); a gathered parameter is not released when its next use is
# within this many elements of parameters (``stage3_max_reuse_distance``)
ZERO3_PERSISTENCE = 100_000
ZERO3_PREFETCH = 50_000_000
ZERO3_REUSE = 1_000_000_000
# the modules fetched (each fetch prefetching) before a Llama model's first MLP is released: the causal LM, the
# decoder model, the embedding, the rotary embedding, the first layer, its input norm, attention and its four
# projections, the post-attention norm, the MLP (:func:`_zero3_gathered`)
ZERO3_FETCHES_BEFORE_RELEASE = 13


def _layer_tensors(m: ModelShape, kind: str) -> list[int]:
    """The elements of each parameter tensor of one layer of ``kind`` (sum: :meth:`ModelShape.params_of`): q, k, v,
    o; a hybrid mixer's parameters as one lump; gate, up, down; the two RMSNorms."""
    h, i, qd, kvd = m.hidden_size, m.intermediate_size, m.num_attention_heads * m.d, m.num_key_value_heads * m.d
    attn = [h * qd, h * kvd, h * kvd, qd * h] if kind in ("attention", "both") else []
    mix = [m.mixer.params(h)] if m.mixer is not None and kind in ("mixer", "both") else []
    return attn + mix + [h * i] * 3 + [h, h]


def _zero3_gathered(m: ModelShape, *, persistence: int = ZERO3_PERSISTENCE, prefetch: int = ZERO3_PREFETCH,
                    reuse: int = ZERO3_REUSE) -> tuple[int, int, int, tuple[int, ...]]:
    """ZeRO-3's whole parameter copies, in elements: ``(always, layers, forward_fetch, per_layer)``, under DeepSpeed's
    ``stage3_param_persistence_threshold`` (``persistence``), ``stage3_prefetch_bucket_size`` (``prefetch``) and
    ``stage3_max_reuse_distance`` (``reuse``), all in elements.

    ``always``: the root (embedding, LM head, final norm: whole through the step; recorded at the peaks of
    tests/test_training_memory.py's 2-layer ZeRO-3 settings, est29 / est29b) and every layer's persistent tensors
    (``persistence`` elements or fewer: whole on every rank from the start). ``layers``: the layers'
    non-persistent tensors gathered at the backward's moments: all of them when the model's non-persistent
    parameters are within ``reuse`` (what the forward gathered is kept for its reuse in the backward) or within what
    the fetches before the first layer's MLP is released can prefetch (:data:`ZERO3_FETCHES_BEFORE_RELEASE`
    ``x prefetch``: the prefetcher then passes every backward use and DeepSpeed releases nothing before it; measured
    past a 1e6-element reuse distance at 4 and 8 layers, est32), else a
    layer and its prefetch; released by the end of backward (est31: a one-layer model's MLP weights, 3 x 1,048,576 B,
    alive at its layer's backward and not at the end of backward's reduction). ``forward_fetch``: the traced step's
    first coalesced all-gather (the first fetch's prefetch: up to ``prefetch`` elements ahead, the root's
    non-persistent tensors included), whose flat buffer is alive beside the copies made from it (est31: 4 layers'
    MLP weights, 12 x 524,288 B, beside their 6,291,456-byte flat buffer at the forward's peak). Under a smaller
    ``prefetch`` the forward fetches several such buffers, one at a time: the one alive at the last layer is the last
    prefetch's, at most the first's (est31c, 1e6 elements: 3 prefetches of 8 x 524,288 B, one 4,194,304-byte buffer
    alive at the forward's peak). ``per_layer``: each layer's share of ``layers`` when it holds every layer's (else
    empty)."""
    root = [m.vocab_size * m.hidden_size] * (1 if m.tie_word_embeddings else 2)
    layers = [_layer_tensors(m, kind) for kind in m.kinds]
    persistent = sum(n for t in layers for n in t if n <= persistence)
    per_layer = [sum(n for n in t if n > persistence) for t in layers]
    non_persistent = sum(per_layer)
    root_np = sum(n for n in root if n > persistence)
    # a gathered copy is kept for its backward use when that use is within ``reuse``, or when a prefetch passed it:
    # at each module's fetch the prefetcher pops the parameter trace until it holds ``prefetch`` elements of
    # parameters not yet gathered (gathered ones pass free), marking each use it pops, and DeepSpeed releases no
    # parameter whose marked use is still ahead. When the fetches before the first layer's MLP is released can
    # gather every non-persistent parameter, the trace drains, backward uses included, and nothing is released
    # before its backward (est32, both measured past a 1e6-element reuse distance: 4 layers at the default
    # prefetch, 41,181,861 B, and 8 layers at a 1e6-element prefetch, 67,448,633 B, each the default reuse
    # distance's peak to the byte; "a layer and its prefetch" was -6.5% / -4.7% under)
    if root_np + non_persistent <= reuse or root_np + non_persistent <= ZERO3_FETCHES_BEFORE_RELEASE * prefetch:
        in_backward, kept = non_persistent, tuple(per_layer)
    else:
        in_backward, kept = sum(sorted(per_layer)[-2:]), ()  # a layer and its prefetch (not measured at this size)
    # the non-persistent tensors in the order the forward uses them: the embedding, each layer's, the LM head. A
    # non-persistent embedding is fetched on its own (a single tensor gathers into its copy, no flat buffer); the
    # prefetch after it (or after a persistent embedding's fetch) takes the next ones until it holds ``prefetch``
    order = [n for t in layers for n in t if n > persistence] + (root[1:] if root[-1] > persistence else [])
    fetched: list[int] = []
    for n in order:
        if sum(fetched) >= prefetch:
            break
        fetched.append(n)
    fetch = sum(fetched) if len(fetched) > 1 else 0  # one coalesced all-gather's flat buffer
    return m.root_params + persistent, in_backward, fetch, kept


def _state_bytes(m: ModelShape, e: int, *, world: int, engine: str, sharded: bool,
                 offload_optimizer: bool, zero3: dict[str, int] | None = None) -> _StateBytes:
    """Parameters, AdamW state and the reduced gradients, on the engine's partition of ``world`` ranks. ``zero3``:
    :func:`_zero3_gathered`'s keywords (DeepSpeed ZeRO-3's persistence, prefetch and reuse settings)."""
    p_all, p_layer, p_root = m.params, m.layer_params, m.root_params
    part = math.ceil(p_all / world)
    gathered = (p_root + 2 * p_layer) * e  # whole copies for compute: root + a layer + its prefetch
    if engine == "fsdp2":
        # the fp32 shard (cast to the training dtype when gathered) plus the whole copies gathered
        # for compute: FSDP2 keeps the root (embedding, head, norm) gathered through the step. A one-layer model has
        # no next layer to prefetch: counting one was +24.6 .. +26.2% over three measured FSDP2 settings (est30b)
        if m.num_hidden_layers == 1:
            gathered = (p_root + p_layer) * e
        params = part * 4 + gathered
    elif sharded:
        # ZeRO-3: its partition + the fp32 optimizer partition + the whole copies (_zero3_gathered: the root and the
        # persistent tensors always, the layers' non-persistent ones through the backward). Counting a layer and its
        # prefetch whatever the persistence was +27.8% over a one-layer model's measured peak (est31)
        always, layers, fetch, kept = _zero3_gathered(m, **(zero3 or {}))
        params = part * e + part * 4 + (always + layers) * e
        optimizer, grads_reduced = 2 * part * 4, part * 4
        if offload_optimizer:
            params -= part * 4
            optimizer = grads_reduced = 0
        return _StateBytes(params, optimizer, grads_reduced, layers_gathered=layers * e, forward_fetch=fetch * e,
                           layer_copies=tuple(n * e for n in kept))
    else:
        params = p_all * e + part * 4  # whole weights + the optimizer's fp32 partition
    optimizer = 2 * part * 4
    grads_reduced = part * 4
    if offload_optimizer:  # DeepSpeed offload_optimizer: fp32 master, moments and reduced grads on the host
        params -= part * 4
        optimizer = grads_reduced = 0
    return _StateBytes(params, optimizer, grads_reduced)


def _activation_bytes(m: ModelShape, e: int, *, rows: int, sp_size: int, mode: str, tiled_mlp: int | str | bool,
                      recompute_norm: bool, activation_checkpointing: bool, offload_activations: bool,
                      device: str, tp_seq: int = 1, head_gathers: bool = True, batch: int = 1) -> _ActivationBytes:
    """What the decoder layers save for backward over ``rows`` local tokens (all layers, or their
    checkpointed inputs plus one layer recomputed), and the tiled MLP's one-chunk transient. ``tp_seq``:
    TP sequence parallelism's degree: the residual stream (layer inputs, norms) holds ``rows / tp_seq``;
    ``head_gathers``: the LM head saves the final norm's output all-gathered (untiled), else only the local one."""
    h, n_layers = m.hidden_size, m.num_hidden_layers
    qd, kvd = m.num_attention_heads * m.d, m.num_key_value_heads * m.d
    low = e < 4
    mlp_rows = _mlp_chunk_rows(tiled_mlp, rows, h)
    if mlp_rows >= rows:  # one chunk: the tiled MLP calls the MLP as it is (seqpar.memory.tiling's forward), so no
        # fp32 weight-gradient accumulator and the intermediates saved (counted tiled, "auto" at 1K rows of Llama-3-8B
        # needed 1 GiB more than untiled: --gpu-mem 24 fitted 8K untiled, nothing tiled)
        tiled_mlp = False
    # seqpar attention returns its output in q's layout at SP size 1 (plain SDPA) and in ring mode:
    # o_proj's contiguous input is then the same storage; the other modes make a copy (measured at SP 2)
    out_copy = sp_size > 1 and mode != "ring"
    per_layer = _layer_saved_bytes(m, e, mlp_saved=tiled_mlp is False, recompute_norm=recompute_norm,
                                   input_counted=activation_checkpointing, out_copy=out_copy, tp_seq=tp_seq) * rows
    # hybrids: each layer's own figure (attention and / or mixer); the largest one is the one recomputed
    layers = ([per_layer] * n_layers if not m.layer_kinds else
              [per_layer + _mixer_layer_delta(m, e, kind, sp_size=sp_size, out_copy=out_copy) * rows
               for kind in m.layer_kinds])
    # the rotary cos / sin: one pair of (rows, head_dim) tables, made once by the model's rotary embedding and passed
    # to every layer, whose q and k products save views of the same two storages. _layer_saved_bytes counts the pair
    # in each attention layer (one layer, as seqpar.bench.layer_memory measures it); the step holds it once, from the
    # forward (kept by activation checkpointing's recompute inputs) to the first layer's backward. Recorded (est33,
    # TensorMemoryTracker record_peak): one pair alive at the peak of Hugging Face Llama's forward + backward at 1, 2,
    # 4 and 8 layers, fp32 and bf16, with and without checkpointing, and at the peak of ZeRO-3's 8-layer step
    # (tests/test_est33_rotary_once.py); counted per layer, multi-layer estimates were over by (layers - 1) pairs
    rotary = 2 * m.d * e * rows
    own = [n - rotary if kind in ("attention", "both") else n for n, kind in zip(layers, m.kinds)]
    rotary = rotary if any(kind in ("attention", "both") for kind in m.kinds) else 0  # mixers only: no table
    if activation_checkpointing:
        inputs_kept = n_layers * rows * h * e // tp_seq
        if offload_activations and device == "cuda":
            inputs_kept = 2 * rows * h * e // tp_seq  # the layer in use and its prefetched predecessor
        activations = inputs_kept + max(own) + rotary  # plus one layer recomputed in backward
        activations_at_loss = inputs_kept + rotary  # no layer is recomputed yet when the loss runs backward
    else:
        activations = activations_at_loss = sum(own) + rotary
    if m.mixer is not None:  # one mixer layer's sequence-parallel exchange at a time (2 chunks: zigzag)
        activations += m.mixer.state_bytes(batch, e, sp_size, chunks=2)
    # the final norm's saved tensors (its output is the head's input) live until the loss's backward
    # has gone through the norm; the last layer's backward then holds the gradient coming down
    final_norm = _norm_saved_bytes(h, e, recompute_norm, False, tp_seq)
    if tp_seq > 1 and not head_gathers:  # the tiled loss gathers chunk by chunk: the output stays local
        final_norm += h * e // tp_seq - h * e
    activations_at_loss += final_norm * rows
    # inside the final norm's backward (ZeRO-3's head overflow): its saved tensors less the normalised copy and the
    # output (both freed by then), and its weight's gradient (lean norms: their input only, counted as the output)
    final_norm_in_flight = max(0, _norm_saved_bytes(h, e, recompute_norm, False, tp_seq) - h * e // tp_seq - h * e
                               ) * rows + h * e
    activations += rows * h * e // tp_seq
    mlp_transient = mlp_grads = 0
    if tiled_mlp is not False:
        # one chunk's intermediates recomputed, and the MLP weights' gradient accumulator + the
        # chunk's gradient (fp32 accumulator when low precision)
        mlp_transient = 5 * m.intermediate_size * mlp_rows * e + 3 * h * m.intermediate_size * (e + (4 if low else e))
    else:
        # the untiled MLP's backward, just before attention's: the gradients of its intermediates
        # (the product, then up and act(gate), then gate: at most three of size I per token at once)
        mlp_transient = 3 * m.intermediate_size * rows * e
        # beside them only the MLP weights' gradients made so far: down_proj's (h I) beside the three, then up's
        # and gate's as the intermediates' gradients are freed (2 h I beside two, 3 h I beside one). The layer's
        # whole gradients counted here instead were +10.1% at SP 2 / 128 rows (recorded at the peak: 1 gradient
        # of h I and 3 of I rows; tests/test_training_memory.py)
        hi, ir = h * m.intermediate_size, m.intermediate_size * rows
        mlp_grads = (max(hi + 3 * ir, 2 * hi + 2 * ir, 3 * hi + ir) - 3 * ir) * e
    # the MLP's saved intermediates are gone once its backward ran, before attention's backward
    after_attention = 4 * m.intermediate_size * e * rows if tiled_mlp is False else 0
    if m.layer_kinds or (activation_checkpointing and offload_activations and device == "cuda"):
        layer_freed = 0
    else:
        # a finished layer frees its own saved tensors, not the shared rotary pair (the first layer's backward does)
        layer_freed = rows * h * e // tp_seq if activation_checkpointing else per_layer - rotary
    return _ActivationBytes(activations, activations_at_loss, mlp_transient, after_attention, mlp_grads=mlp_grads,
                            layer_freed=layer_freed, mlp_product=after_attention // 4,
                            mlp_input=rows * h * e if tiled_mlp is False else 0,
                            post_norm=_norm_saved_bytes(h, e, recompute_norm, False, tp_seq) * rows,
                            out_grad=m.num_attention_heads * m.d * e * rows, hidden_grad=rows * h * e // tp_seq,
                            final_norm_in_flight=final_norm_in_flight,
                            attn_saved=(2 * qd + 2 * kvd + (qd if out_copy else 0)) * e * rows + m.num_attention_heads * 4 * rows,
                            qkv_grads=(qd + kvd + h) * e * rows)


def _attention_transient_bytes(m: ModelShape, dt: torch.dtype, *, rows: int, seq_len: int, sp_size: int, mode: str,
                               batch: int, head_chunks: int | str, dkv_wire_dtype: str = "fp32",
                               masks: dict[str, Any] | None = None) -> int:
    """One layer's attention call (:func:`estimate_attention_memory`, with the data's ``masks``: cu_seqlens,
    window, chunk_size, sinks, sharding; ``bshd``: Hugging Face's projections seen transposed) less its q, k, v,
    output and log-sum-exp, which the layer's activations already count (the lse was counted twice until est37)."""
    e = torch.empty((), dtype=dt).element_size()
    attn = estimate_attention_memory(seq_len, world_size=sp_size, mode=mode if sp_size > 1 else "single",
                                     batch=batch, q_heads=m.num_attention_heads, kv_heads=m.num_key_value_heads,
                                     head_dim=m.d, dtype=dt, causal=True, head_chunks=head_chunks,
                                     dkv_wire_dtype=dkv_wire_dtype, layout="bshd", **(masks or {}))
    qkvo = rows * m.d * (2 * m.num_attention_heads + 2 * m.num_key_value_heads) * e
    lse = rows * m.num_attention_heads * (8 if dt == torch.float64 else 4)
    return max(0, attn - qkvo - lse)


def _logits_loss_bytes(m: ModelShape, e: int, *, rows: int, tiled_loss: bool, tp_seq: int = 1) -> int:
    """The LM head's logits and the loss's buffers over ``rows`` local tokens (one chunk's when tiled).
    ``m``'s vocabulary is a rank's slice under the vocab-parallel loss; ``tp_seq``: TP sequence parallelism's
    degree, under which the tiled loss holds this rank's ``rows / tp_seq`` hidden rows and all-gathers one
    chunk of every rank's at a time."""
    h, v = m.hidden_size, m.vocab_size
    if tiled_loss:
        from seqpar.memory.tiling import loss_backward_bytes, loss_backward_order, loss_chunk_rows

        chunk_rows = loss_chunk_rows(rows, h, v)
        if tp_seq == 1:
            # the backward's own model, in the order it runs (tiling.loss_backward_order: vocabulary blocks outer
            # for a bf16 / fp16 head with fewer rows than vocabulary, else row chunks outer); measured in every
            # dtype and both orders by tests/test_memory_tiled_loss_bf16.py
            order = loss_backward_order(rows, h, v, e, e, chunk_rows)
            return loss_backward_bytes(order, rows, h, v, e, e, chunk_rows)
        # TP sequence parallelism (_GatheredTiledLMLoss): the same rule and model over this rank's rows / tp_seq and
        # a gathered chunk of about chunk_rows (tiling._gathered_tiled_lm_loss); its vocabulary order regathers
        # every rank's rows once in the backward. Measured in both orders by tests/test_tiled_loss_tp_seq.py
        local, chunk = rows // tp_seq, max(1, chunk_rows // tp_seq)
        order = loss_backward_order(local, h, v, e, e, chunk, tp=tp_seq)
        return loss_backward_bytes(order, local, h, v, e, e, chunk, tp=tp_seq)
    # logits (kept by the caller), fp32 log-softmax (saved), its gradient and the logits' gradient
    return rows * v * (e + 4 + 4 + 4) if e < 4 else 4 * rows * v * 4


def _communication_bytes(e: int, *, engine: str, reduce_bucket_size: int) -> int:
    """The engine's gradient-reduction bucket: DeepSpeed allocates it at the configured size, whatever
    the model's (FSDP2: none apart from what the gradients' terms count)."""
    return reduce_bucket_size * e if engine == "deepspeed" else 0


def _zero12_reduce_bytes(m: ModelShape, e: int, *, world: int, reduce_bucket_size: int,
                         offload_optimizer: bool) -> int:
    """ZeRO-1/2 reducing its last bucket: a flat copy of the bucket's gradients (allreduce_bucket's
    _flatten_dense_tensors) and the fp32 partitions of the buckets reduced before it. Measured on
    CPU: one more partition-sized tensor is sometimes alive at that moment too (about 1 run in 5 of
    the validation's ZeRO-2 setting, -9.7% there); the model counts what is always there."""
    p_all = m.params
    part = math.ceil(p_all / world)
    bucket_elems = min(reduce_bucket_size, p_all)
    return bucket_elems * e + (0 if offload_optimizer else max(0, part - math.ceil(bucket_elems / world)) * 4)


def _root_grad_bytes(m: ModelShape, e: int) -> tuple[int, int]:
    """The whole gradients of the LM head (made by the loss backward) and of the embedding (0 when tied)."""
    head_grad = m.vocab_size * m.hidden_size * e
    embed_grad = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size * e
    return head_grad, embed_grad


def _zero3_scatter_bytes(m: ModelShape, e: int, *, world: int, reduce_bucket_size: int, device: str) -> int:
    """ZeRO-3 reducing a gradient bucket (stage3's ``__avg_scatter_grads`` -> ``reduce_scatter_coalesced``): the
    bucket's gradients copied into one flat input padded to a multiple of ``world``, and on CPU (gloo) the
    collective's own copy of that input (allocated inside torch's ``reduce_scatter_tensor``; NCCL scatters in place).
    Both recorded at the measured peak of tests/test_training_memory.py's ZeRO-3 tiled-loss setting (est29)."""
    bucket_elems = min(reduce_bucket_size, m.params)
    flat = math.ceil(bucket_elems / world) * world * e
    return flat * (2 if device == "cpu" else 1)


def _zero3_head_scatter_bytes(m: ModelShape, e: int, *, world: int, reduce_bucket_size: int, device: str) -> int:
    """ZeRO-3 reducing the LM head's whole gradient during the backward, when it is larger than the bucket: DeepSpeed
    does not copy a gradient that does not fit into the bucket, so the head's stays its own tensor, alone in the
    bucket's list, and the next gradient to arrive (the final norm's) overflows the bucket and reduce-scatters it
    (stage3's ``reduce_independent_p_g_buckets_and_remove_grads`` -> ``__avg_scatter_grads``) while every layer's
    activations are still alive. ``reduce_scatter_coalesced`` scatters one evenly divisible tensor in place, else
    a padded flat copy; on CPU gloo copies the input inside torch's ``reduce_scatter_tensor`` (NCCL does not).
    Recorded at the measured peak of tests/test_training_memory.py's ZeRO-3 tiled-loss setting with a 1e6-element
    bucket (est29b). 0 when the head's gradient fits the bucket (it is then copied into it and reduced with others)."""
    head = m.vocab_size * m.hidden_size
    if head <= reduce_bucket_size:
        return 0
    padded = math.ceil(head / world) * world * e
    return (0 if head % world == 0 else padded) + (padded if device == "cpu" else 0)


def _batch_token_bytes(*, batch: int, seq_len: int, rows: int) -> int:
    """The batch's int64 token tensors, held through every engine's micro-step (launch/loop.py): the whole sample's
    ``input_ids`` and ``labels`` ``(batch, seq_len)``, and this rank's cut of ``input_ids``, ``shift_labels`` and
    ``position_ids`` ``(batch, rows)`` (:func:`seqpar.sequence.batch.shard_batch`). 57,344 bytes at 2048 tokens over
    SP 2, recorded at the measured peak of tests/test_training_memory.py's ZeRO-3 tiled-loss setting (est30): the
    -0.05% the model had left under there."""
    return 8 * batch * (2 * seq_len + 3 * rows)


class _Overflow(NamedTuple):
    """Where ZeRO-3's gradient bucket first overflows during the backward (:func:`_zero3_first_overflow`)."""

    done: int
    """The layers whose backward has finished (the last ones)."""
    after_mlp: bool
    """The layer in flight has finished its MLP's backward (the overflowing gradient is attention's)."""
    arriving: int = 0
    """The elements of the weight gradients alive beside the reduction, not yet in the bucket: the one whose arrival
    overflows it (stage3 reduces the bucket before copying it in) and, in the MLP's backward, the MLP's later ones:
    the bucket's hook runs once the MLP's three weight backwards ran (recorded: one 524,288-byte weight gradient at
    gate_proj's overflow, two at up_proj's, est31c; three at down_proj's, est32; o_proj's own at its overflow,
    est32). 0 at attention's other gradients (not traced)."""
    mlp_ran: bool = False
    """The overflow is in the layer in flight's MLP backward: the MLP's weight backwards have run and freed its saved
    intermediates (recorded at down_proj's, up_proj's and gate_proj's overflows, est31c / est32)."""
    contents: int = 0
    """The elements in the bucket when it overflows (what its flat reduce-scatter input copies), where the overflow
    is traced: at down_proj's, up_proj's, gate_proj's and o_proj's gradients (est32: the flat input and gloo's copy
    were 2 x 6,621,440 / 2 x 7,145,728 / 2 x 7,670,016 / 2 x 8,389,120 B, the contents, not the bucket's size),
    and at attention's q, k, v and input norm gradients (est33: recorded at q_proj's, 2 x 8,405,504 B) and the
    post-attention norm's (est34: 2 x 8,388,864 B); 0 elsewhere (hybrids' mixers, the remainder): a full bucket is
    counted (not traced)."""
    at_o_proj: bool = False
    """The overflowing gradient is o_proj's, the first of attention's backward (est32, recorded at the 2.1e6-element
    bucket's peak): the post-attention norm's backward has freed its saved tensors, and o_proj's input gradient
    (rows x q heads' width) is alive beside its weight gradient (``arriving``)."""
    at_v_proj: bool = False
    """The first of q, k and v's weight gradients to arrive overflows the bucket: v_proj's (autograd runs the
    projections' backwards in the reverse of their forward order). Recorded (est34, a 2,103,000-element bucket, 2,101,376
    elements in it after o_proj's): v_proj's weight gradient (8,192 B) alive, attention's backward has freed its saved
    tensors and the post-attention norm's backward its own; the gradients of q and k and v_proj's input gradient are
    alive (3 x 262,144 B with the gradient coming down, and 131,072 B)."""
    at_mlp_norm: bool = False
    """The overflowing gradient is the post-attention norm's, after the MLP's (est34, recorded with a 2,097,279-element
    bucket: the flat input holds the contents, and only one hidden-size gradient is alive, not the MLP weight
    overflows' two: the MLP's input gradient has gone into the norm's backward)."""


def _zero3_first_overflow(m: ModelShape, reduce_bucket_size: int) -> _Overflow | None:
    """Where ZeRO-3's gradient bucket first overflows during the backward (an :class:`_Overflow`: the layers whose
    backward has finished, whether the layer in flight has finished its MLP's backward, and in its MLP's backward the
    arriving gradient), or None when it never does before the
    embedding's gradient (the end of backward's reduction). Stage3 reduces the bucket when the next gradient to
    arrive would take it past ``reduce_bucket_size`` elements (a gradient larger than the bucket is counted but never
    copied: the head's, :func:`_zero3_head_scatter_bytes`). The gradients arrive in backward order: the LM head's
    (untied), the final norm's, then each layer's from the last: down, up, gate, the post-attention norm, then
    o, q, k, v and the input norm (a remainder, biases, last)."""
    h, i = m.hidden_size, m.intermediate_size
    qd, kvd = m.num_attention_heads * m.d, m.num_key_value_heads * m.d
    mlp = [h * i] * 3 + [h]
    attention = [qd * h, qd * h, kvd * h, kvd * h, h]
    attention.append(max(0, m.layer_params - sum(mlp) - sum(attention)))
    elems = 0 if m.tie_word_embeddings else m.vocab_size * h
    if elems and elems + h > reduce_bucket_size:
        return _Overflow(0, False)
    elems += h
    for done in range(m.num_hidden_layers):
        for after_mlp, part in ((False, mlp), (True, attention)):
            for j, n in enumerate(part):
                if elems + n > reduce_bucket_size and elems > 0:
                    if after_mlp:  # o, q, k, v, norm: traced at o_proj's (est32; not for hybrids' mixers)
                        traced = j == 0 and not m.layer_kinds
                        # q's turn in this order, but v's gradient arrives first: traced where it overflows (est34)
                        at_v = j == 1 and not m.layer_kinds and elems + part[3] > reduce_bucket_size
                        # the flat input holds the bucket's contents at attention's other gradients too (est33,
                        # recorded at q_proj's: 2 x 8,405,504 B, the 2,101,376 elements in it, not the bucket's
                        # 2,103,000); what is in flight there: ``at_v_proj`` (est34)
                        return _Overflow(done, True, n if traced else part[3] if at_v else 0,
                                         contents=elems if not m.layer_kinds and j < 5 else 0, at_o_proj=traced,
                                         at_v_proj=at_v)
                    # down, up, gate, norm: the bucket's hook runs once the MLP's three weight backwards have
                    # run, so every MLP weight gradient from the overflowing one on is alive and its
                    # intermediates are freed (recorded: gate's overflow est31c, up's est31c, down's est32)
                    # (and at the MLP's norm: est34, recorded with a 2,097,279-element bucket, the flat input and
                    # gloo's copy 2 x 8,388,864 B, the contents, not a full bucket's 2 x 8,389,120)
                    return _Overflow(done, False, sum(part[j:3]) if j < 3 else n, True, contents=elems,
                                     at_mlp_norm=j == 3)
                elems += n
    return None


def _moments(m: ModelShape, e: int, state: _StateBytes, acts: _ActivationBytes, *, attention: int, logits: int,
             comm: int, zero12_reduce: int, world: int, engine: str, sharded: bool,
             zero3_scatter: int = 0, zero3_head_scatter: int = 0,
             overflow: _Overflow | None = None, tokens: int = 0, overflow_scatter: int = 0,
             logits_kept: int = 0) -> dict[str, float]:
    """The bytes alive at each candidate peak moment of the step; the peak is the largest. ``tokens``: the batch's
    token tensors (:func:`_batch_token_bytes`), alive through forward and backward. ``logits_kept``: the untiled
    loss's logits, which the training loop holds through the backward (counted at ZeRO-3's reduction inside it)."""
    p_layer, p_root, n_layers = m.layer_params, m.root_params, m.num_hidden_layers
    head_grad, embed_grad = _root_grad_bytes(m, e)
    static = state.params + state.optimizer + tokens
    if engine == "deepspeed" and sharded:
        static += state.grads_reduced  # ZeRO-3 allocates its gradient partition up front
    # ZeRO-3's last bucket at the end of backward: its flat reduce-scatter input (and gloo's copy) beside the
    # bucket. The root's whole gradients are copied into the bucket (comm) when they fit it; one larger than the
    # bucket stays its own tensor beside it. Counting the root's gradients instead of the flat input and gloo's copy
    # was -7.8% under the measurement (107.7 MiB); the larger of the two keeps either case counted.
    zero3_reduce = max(head_grad + embed_grad, zero3_scatter)
    # a bucket's worth reduced during the backward (_zero3_first_overflow): the layers whose backward has finished
    # have freed their saved tensors, and so has the layer in flight's MLP once its backward ran. Counting every
    # layer's activations there was +5.2% over the 2.1e6-element bucket's measurement (the overflow at the last
    # layer's o_proj gradient, its MLP's saved gate, up, act(gate) and product gone: recorded at the peak, est30)
    # at attention's backward the layer's q, k, v and input norm weight gradients are not made yet; down_proj's backward
    # has freed the product it saved before the MLP backward's peak; FSDP2 holds the final norm's weight gradient, and
    # unsharding the last layer as its backward starts, the all-gather's flat output beside the layer's copies (a deeper
    # model's prefetched layer, in ``params``, is not gathered yet then). All recorded at FSDP2's peaks (est37)
    h, qd, kvd = m.hidden_size, m.num_attention_heads * m.d, m.num_key_value_heads * m.d
    layer_grads = (p_layer - (0 if m.layer_kinds else h * qd + 2 * h * kvd + h)) * e
    norm_grad, unshard = (h * e, p_layer * e if n_layers == 1 else 0) if engine == "fsdp2" else (0, 0)
    mlp_grads = acts.mlp_grads - acts.mlp_product
    if engine == "deepspeed" and sharded:
        # ZeRO-3 copies each whole gradient into its bucket (``comm``) as it is made and frees it: the untiled MLP's
        # backward holds one weight gradient (down_proj's, h I) beside the three intermediate gradients, and
        # down_proj's backward has freed the product it saved (I per row; ``acts.backward`` counts it). Both
        # recorded at a one-layer model's measured peak (est31): the MLP weights' gradients made so far and the
        # product were +8.0% over there with the layer's whole gradients, +2.8% without the product's release.
        # Attention's transients: at most its four projections' gradients beside them (not the layer's whole ones)
        layer_grads = m.attention_params * e if any(k in ("attention", "both") for k in m.kinds) else p_layer * e
        if acts.mlp_grads:  # untiled
            mlp_grads = m.hidden_size * m.intermediate_size * e - acts.mlp_product
    freed = 0 if overflow is None else overflow[0] * acts.layer_freed + (acts.after_attention if overflow[1] else 0)
    if overflow is not None and engine == "deepspeed" and sharded:
        # inside a layer's MLP backward (est31c, 8 layers, a 1e6-element prefetch, the overflow at the 5th-last
        # layer's gate_proj gradient; recorded at the measured peak): the finished layers' gathered copies are
        # released (``layer_copies``: 4 x 3 x 524,288 B; counted, +10.3% over), the MLP's saved
        # intermediates are freed once its weight backwards ran (4 x 262,144 B), and the arriving gradient
        # is alive beside the reduction (gate_proj's, 524,288 B; at up_proj's, up's and gate's: 2 x 524,288 B,
        # recorded with a 1.9e6-element bucket). Attention's overflow (est30's 2.1e6-element
        # bucket, at o_proj's gradient) is as before: within the scatter term's unfilled room there (+0.7%)
        freed += sum(state.layer_copies[len(state.layer_copies) - overflow.done:]) if overflow.done else 0
        # (and with them the MLP's input, which only its projections saved: est33, recorded at gate_proj's overflow)
        freed += (acts.after_attention + acts.mlp_input if overflow.mlp_ran else 0) - overflow.arriving * e
        if overflow.contents and not overflow.after_mlp and not overflow.at_mlp_norm:
            freed -= acts.hidden_grad  # a second hidden-size gradient in flight (recorded, est32)
        if overflow.at_o_proj:
            # o_proj's gradient overflows (est32, the 2.1e6-element bucket, recorded at the measured peak): the
            # post-attention norm's backward has freed its saved tensors (3 x 262,144 + 4,096 B), and o_proj's input
            # gradient (262,144 B) is alive beside its weight's (16,384 B, ``arriving``)
            freed += acts.post_norm - acts.out_grad
        if overflow.at_v_proj:
            # attention's backward has run: its saved tensors and the post-attention norm's are freed (est34, recorded
            # at v_proj's overflow: the estimate was +929,792 B, +1.0%, counting them)
            freed += acts.post_norm + acts.attn_saved - acts.qkv_grads
    moments = {} if not state.forward_fetch else {
        # ZeRO-3's forward in the traced step: the first fetch's coalesced all-gather flat buffer stays alive until
        # the last parameter it gathered is used (the last layer's MLP in a model it gathers whole), beside the
        # whole copies made from it and every layer's activations but that MLP's saved tensors (est31: measured at
        # the last layer's post-attention norm, 4 layers)
        "forward_gather": static + comm + state.forward_fetch + acts.at_loss - acts.after_attention,
    }
    return moments | {
        # the loss's backward: every layer's activations and the logits' buffers (ZeRO-3: its bucket, made at init)
        "loss_backward": static + acts.at_loss + logits + (comm if engine == "deepspeed" and sharded else 0),
        # the last layer's backward (the first to run): the head's gradient made, then attention's
        # transients with the layer's gradients made so far (its MLP's and post-attention norm's saved tensors freed
        # by then: est37), or the MLP's with only the MLP weights' gradients made so far. The tiled MLP's transient
        # already holds them (accumulator + one chunk's): adding the layer's whole gradients counted 3 h I e
        # twice; untiled, only down_proj's is alive beside the three intermediate gradients (both measured at
        # FSDP2: tests/test_training_memory.py). The untiled loss's logits are held throughout (est37)
        "layer_backward": static + acts.backward + head_grad + norm_grad + comm + logits_kept + max(
            layer_grads + max(attention - acts.after_attention - acts.post_norm, 0), acts.mlp_transient + mlp_grads,
            unshard),
        # the end of backward: the root's gradients being reduced (FSDP2: copied into a flat fp32
        # reduce-scatter input while the last whole gradient is still alive, and the output shard),
        # the layers' reduced shards; ZeRO: every reduced gradient and the root's whole ones
        "grad_reduction": static + (
            p_root * 4 * (1 + 1 / world) + head_grad + n_layers * p_layer * 4 / world if engine == "fsdp2"
            else (zero12_reduce if not sharded else zero3_reduce - state.layers_gathered) + comm),
        # ZeRO-3 reducing during the backward, when the gradients overflow the bucket (est29b, both recorded at the
        # measured peak of tests/test_training_memory.py's ZeRO-3 tiled-loss setting): a head gradient larger than
        # the bucket is reduced first, before any layer's backward (every layer's activations, the head's gradient
        # and its scatter input and gloo's copy: _zero3_head_scatter_bytes; 1e6-element bucket, -5.5% -> -0.2%; and
        # the final norm's backward in flight, whose weight gradient's arrival overflows the bucket: est34, -0.29% ->
        # -121 B of scalars, ``acts.final_norm_in_flight``);
        # a bucket's worth is reduced inside a layer's backward (its flat input and gloo's copy, _zero3_scatter_bytes,
        # beside the bucket, which then holds the head's gradient; 2.1e6-element bucket: +5.2% -> +0.7% once less what
        # the finished backward freed: ``freed``). Neither happens when
        # the whole model's gradients fit the bucket: the one reduction is then the end of backward's. (0 from
        # _zero3_head_scatter_bytes, scattered in place on a GPU, leaves the head's case below the last layer's
        # backward, which counts the head's gradient too.)
        # The untiled loss's logits are alive there too: launch/loop.py holds them across engine.backward (est33:
        # rows x vocab x 4 = 32,768 B made by the LM head, recorded at the 8-layer overflow at gate_proj's gradient;
        # not counted at the other backward moments, whose settings were not recorded with them)
        "backward_reduction": static + acts.backward + comm + logits_kept + max(
            head_grad + zero3_head_scatter + acts.final_norm_in_flight if zero3_head_scatter else 0,
            (overflow_scatter or zero3_scatter) - freed if overflow is not None else 0),
    }


def estimate_training_memory(
    model_config: Any,
    *,
    seq_len: int,
    sp_size: int,
    dp_size: int = 1,
    engine: str = "fsdp2",
    zero_stage: int = 3,
    dtype: torch.dtype | str = torch.float32,
    activation_checkpointing: bool = False,
    tiled_loss: bool = False,
    tiled_mlp: int | str | bool = False,
    offload_activations: bool = False,
    mode: str = "ring",
    batch: int = 1,
    head_chunks: int | str = "auto",
    device: str = "cpu",
    offload_optimizer: bool = False,
    reduce_bucket_size: int = 500_000_000,
    stage3_param_persistence_threshold: int = ZERO3_PERSISTENCE,
    stage3_prefetch_bucket_size: int = ZERO3_PREFETCH,
    stage3_max_reuse_distance: int = ZERO3_REUSE,
    recompute_norm: bool = False,
    tp_size: int = 1,
    tp_sequence_parallel: bool = False,
    dkv_wire_dtype: str = "fp32",
    tp_loss_parallel: bool | str = "auto",
    cu_seqlens: Any = None,
    window: int | None = None,
    chunk_size: int | None = None,
    sinks: bool = False,
    sharding: str | None = None,
) -> dict[str, int]:
    """Peak bytes per rank of one training step (forward, backward, AdamW step), by category.

    Args:
        model_config: a Llama-family shape: a dict or transformers config with the Hugging Face
            fields (``vocab_size``, ``hidden_size``, ...), or a name in :data:`MODEL_SHAPES`. A hybrid
            model (a transformers config, or a dict naming its ``architecture`` / ``model_type``: Jamba,
            LFM2, MiniMax, RecurrentGemma, Falcon-H1, Bamba, Nemotron-H, Granite-4 hybrid, Zamba2,
            Qwen3-Next, Qwen3.5) counts each mixer layer's weights, saved activations and
            sequence-parallel exchange instead of attention's (:mod:`seqpar.memory.mixers`; tp_size 1).
        seq_len: tokens per sample over the whole SP group; sp_size / dp_size: the mesh.
        engine: ``"fsdp2"`` or ``"deepspeed"`` (``zero_stage`` 1, 2 or 3; FSDP2 shards like ZeRO-3).
        dtype: training dtype; low precision keeps an fp32 master partition and fp32 optimizer state.
        activation_checkpointing, tiled_loss, tiled_mlp, offload_activations: the settings of the
            same names (``offload_activations`` counts only on ``device="cuda"``: a no-op on CPU).
        mode: attention algorithm (``"ring"`` or ``"allgather"``) for the attention transients.
        batch: samples per rank per micro-step.
        head_chunks: attention's ``head_chunks``. device: ``"cpu"`` or ``"cuda"``.
        offload_optimizer: DeepSpeed's ``offload_optimizer`` (fp32 master and AdamW state on the host).
        reduce_bucket_size: DeepSpeed's gradient bucket, in elements (its default 5e8).
        stage3_param_persistence_threshold, stage3_prefetch_bucket_size, stage3_max_reuse_distance: DeepSpeed
            ZeRO-3's settings of those names in the config's ``zero_optimization`` block, in elements (defaults:
            DeepSpeed's, 1e5, 5e7 and 1e9): which tensors stay whole on every rank, how much the traced step's
            prefetch gathers at one fetch, and whether the forward's copies are kept for the backward
            (``engine="deepspeed"``, ``zero_stage=3`` only).
        recompute_norm: the lean RMSNorms of :mod:`seqpar.memory.norm` (save only their input).
        tp_size: tensor-parallel degree (``sequence_parallel.tp_size``; world = dp x sp x tp). Each rank
            holds ``1 / tp`` of the heads, the MLP width and the vocabulary (:meth:`ModelShape.tp_local`):
            weights, gradients, optimizer state and the attention / MLP activations shrink by ``tp``;
            the engine shards over the dp x sp ranks. The logits are the full vocabulary's (the plan's
            gathered head) unless the loss is vocab-parallel: with ``tiled_loss``, else as ``tp_loss_parallel``
            says (``"auto"``: with ``tp_sequence_parallel``).
        tp_sequence_parallel: Megatron-style sequence parallelism in the TP group: the residual stream
            (checkpointed layer inputs, the norms' saved tensors) holds ``seq_local / tp`` tokens; the
            column-parallel projections still save their all-gathered input, whole.
        dkv_wire_dtype: the ``sequence_parallel`` block's ``dkv_wire_dtype`` (``"fp32"`` or ``"bf16"``): what
            the ring's travelling dK/dV accumulators are held in, for the attention transients.
        tp_loss_parallel: the ``sequence_parallel`` block's ``tp_loss_parallel`` (``True``, ``False`` or
            ``"auto"``): whether the LM head's logits stay split on the vocabulary under TP.
        cu_seqlens, window, chunk_size, sinks, sharding: the data's masks as :func:`seqpar.attention` takes them
            (packed documents' global boundaries ``(0, ..., seq_len)``, the sliding window, chunked attention,
            whether the layers pass sink logits) and the sequence's sharding, for the attention transients: the
            ring's plan under them (:func:`seqpar.memory.attention.estimate_attention_memory`; ``mode="ring"``, or
            one SP rank). Every attention layer is taken to use them.

    Returns:
        ``{category: bytes}`` for :data:`CATEGORIES`, plus ``"peak"`` (the worst moment) and
        ``"moment"`` (which moment that is: ``"loss_backward"``, ``"layer_backward"``, ``"grad_reduction"``, ZeRO-3's
        ``"backward_reduction"`` or ``"forward_gather"``).
    """
    full = _model_shape(model_config)
    _check_run(engine, zero_stage, seq_len, sp_size)
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r}: expected a positive integer (the TP degree)")
    m = full.tp_local(tp_size)  # a rank's shape: the model itself at tp_size 1
    tp_seq = tp_size if tp_sequence_parallel else 1
    if tp_loss_parallel not in (True, False, "auto"):
        raise ValueError(f"tp_loss_parallel={tp_loss_parallel!r}: expected true, false or \"auto\" (the block's key)")
    loss_parallel = tp_sequence_parallel if tp_loss_parallel == "auto" else tp_loss_parallel
    vocab_parallel = tp_size > 1 and (loss_parallel or tiled_loss)
    dt = as_dtype(dtype)
    e = torch.empty((), dtype=dt).element_size()
    world = sp_size * dp_size
    rows = batch * seq_len // sp_size  # local tokens
    sharded = engine == "fsdp2" or zero_stage == 3

    zero3 = {"persistence": stage3_param_persistence_threshold, "prefetch": stage3_prefetch_bucket_size,
             "reuse": stage3_max_reuse_distance}
    for key, value in zip(("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
                           "stage3_max_reuse_distance"), zero3.values()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{key}={value!r}: expected a number of elements >= 0, as the zero_optimization "
                             "block's key of that name (or leave it out for DeepSpeed's default)")
    state = _state_bytes(m, e, world=world, engine=engine, sharded=sharded, offload_optimizer=offload_optimizer,
                         zero3={k: int(v) for k, v in zero3.items()})
    acts = _activation_bytes(m, e, rows=rows, sp_size=sp_size, mode=mode, tiled_mlp=tiled_mlp,
                             recompute_norm=recompute_norm, activation_checkpointing=activation_checkpointing,
                             offload_activations=offload_activations, device=device, tp_seq=tp_seq,
                             head_gathers=not tiled_loss, batch=batch)
    attention = _attention_transient_bytes(m, dt, rows=rows, seq_len=seq_len, sp_size=sp_size, mode=mode,
                                           batch=batch, head_chunks=head_chunks, dkv_wire_dtype=dkv_wire_dtype,
                                           masks=dict(cu_seqlens=cu_seqlens, window=window, chunk_size=chunk_size,
                                                      sinks=sinks, sharding=sharding))
    if not any(kind in ("attention", "both") for kind in m.kinds):
        attention = 0  # a model of mixer layers only: no attention call
    logits = _logits_loss_bytes(m if vocab_parallel else full, e, rows=rows, tiled_loss=tiled_loss, tp_seq=tp_seq)
    comm = _communication_bytes(e, engine=engine, reduce_bucket_size=reduce_bucket_size)
    zero12_reduce = _zero12_reduce_bytes(m, e, world=world, reduce_bucket_size=reduce_bucket_size,
                                         offload_optimizer=offload_optimizer)

    zero3_scatter = (_zero3_scatter_bytes(m, e, world=world, reduce_bucket_size=reduce_bucket_size, device=device)
                     if engine == "deepspeed" and sharded else 0)
    zero3_head_scatter = (_zero3_head_scatter_bytes(m, e, world=world, reduce_bucket_size=reduce_bucket_size,
                                                    device=device) if engine == "deepspeed" and sharded else 0)
    overflow = _zero3_first_overflow(m, reduce_bucket_size) if engine == "deepspeed" and sharded else None
    # the reduction inside the backward copies the bucket's contents where traced (else a full bucket is counted)
    overflow_scatter = (_zero3_scatter_bytes(m, e, world=world, reduce_bucket_size=overflow.contents, device=device)
                        if overflow is not None and overflow.contents else 0)
    moments = _moments(m, e, state, acts, attention=attention, logits=logits, comm=comm, zero12_reduce=zero12_reduce,
                       world=world, engine=engine, sharded=sharded, zero3_scatter=zero3_scatter,
                       zero3_head_scatter=zero3_head_scatter, overflow=overflow,
                       tokens=_batch_token_bytes(batch=batch, seq_len=seq_len, rows=rows),
                       overflow_scatter=overflow_scatter,
                       logits_kept=0 if tiled_loss else rows * (m if vocab_parallel else full).vocab_size * e)
    moment = max(moments, key=moments.get)
    head_grad, embed_grad = _root_grad_bytes(m, e)
    return {
        "parameters": int(state.params), "gradients": int(state.grads_reduced + head_grad + embed_grad),
        "optimizer_state": int(state.optimizer), "activations": int(acts.backward),
        "attention_transients": int(max(attention, acts.mlp_transient)), "logits_loss": int(logits),
        "communication": int(comm), "peak": int(moments[moment]), "moment": moment,
    }


def longest_sequence(model_config: Any, budget_bytes: int, *, sp_size: int, granularity: int = 1024,
                     **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """The longest ``seq_len`` (a multiple of ``granularity * sp_size``) whose modelled peak fits
    ``budget_bytes`` per rank, and its breakdown; ``(0, {})`` when not even one step fits. ``kwargs``:
    :func:`estimate_training_memory`'s (a ``window``, ``chunk_size`` or ``sinks`` holds at every length;
    ``cu_seqlens`` fixes the length, so it is refused here)."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("longest_sequence: cu_seqlens fixes seq_len (its last boundary); ask estimate_training_memory "
                         "at that length instead, or leave cu_seqlens out")
    step = granularity * sp_size

    def cost(n: int) -> int:
        return estimate_training_memory(model_config, seq_len=n * step, sp_size=sp_size, **kwargs)["peak"]

    lo = largest_fitting(cost, budget_bytes, limit=1 << 25)
    if not lo:
        return 0, {}
    best = lo * step
    return best, estimate_training_memory(model_config, seq_len=best, sp_size=sp_size, **kwargs)


def shape_dict(model_config: Any) -> dict[str, Any]:
    return asdict(ModelShape.from_config(MODEL_SHAPES.get(model_config, model_config)
                                         if isinstance(model_config, str) else model_config))
