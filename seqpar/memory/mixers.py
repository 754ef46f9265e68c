"""Per-rank bytes of the hybrid models' mixer layers (issue 21), for :mod:`seqpar.memory.training`.

A hybrid decoder (Jamba, LFM2, MiniMax, RecurrentGemma, Falcon-H1 / Bamba / Nemotron-H / Granite-4 hybrid /
Zamba2, Qwen3-Next / Qwen3.5) replaces the attention of some layers by a recurrent or convolutional
mixer. :func:`mixer_shape` reads, from the transformers config fields alone, which layers carry which
mixer (``config.layer_types`` as transformers 5.24 normalises it: ``"full_attention"``,
``"sliding_attention"``, ``"linear_attention"``, ``"mamba"``, ``"conv"``, ``"hybrid"``, ``"moe"``,
``"mlp"``) and the mixer's sizes. :class:`MixerShape` then gives, per mixer layer:

- ``params``: the mixer's weights (replacing the attention's q/k/v/o of a Llama layer);
- ``saved_bytes(e, sp_size)``: bytes per local token (``seq_len / P``) the mixer keeps for backward, as
  transformers' torch path keeps them (seqpar's sharded path runs the same kernels per chunk, plus the
  state correction at ``P > 1``): projections, the convolution's input and output, gates, and the
  scan's intermediates (see each family's function for its terms);
- ``state_bytes(batch, e, sp_size, chunks)``: the per-layer transients of the sequence-parallel exchange,
  flat in S: the convolution halo ``(k - 1) x channels`` (received, and its gradient sent back) and the
  all-gathered chunk summaries ``P x chunks x (|T| + |state|)`` (the transition and the zero-state final
  state of every rank's chunks, :func:`seqpar.mixers.state_passing.chunk_initial_states`), whose
  reduce-scatter backward needs a buffer of the same size.

The families' terms are derived from the installed transformers 5.24 torch paths (named per family
below). The Mamba (v1) terms are measured (saved-tensor hooks on ``JambaMambaMixer``, fp32) and the whole
model is validated against the measured peak of a Jamba training step in
``tests/test_training_memory.py::test_hybrid_estimate_within_10_percent``; the other families' terms
are modelled, not yet validated by a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MixerShape", "mixer_shape", "FAMILY_OF_MODEL", "ATTENTION_KINDS", "MIXER_KINDS"]

FAMILY_OF_MODEL = {
    "jamba": "mamba", "zamba": "mamba", "mamba": "mamba", "falcon_mamba": "mamba",
    "lfm2": "short_conv", "lfm2_moe": "short_conv",
    "minimax": "lightning",
    "recurrent_gemma": "rglru",
    "falcon_h1": "ssd", "bamba": "ssd", "nemotron_h": "ssd", "granitemoehybrid": "ssd", "zamba2": "ssd",
    "mamba2": "ssd",
    "qwen3_next": "gdn", "qwen3_5": "gdn", "qwen3_5_text": "gdn", "qwen3_5_moe": "gdn", "qwen3_5_moe_text": "gdn",
    "olmo_hybrid": "gdn",
}
"""transformers ``model_type`` -> the mixer family its non-attention layers use."""

ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention"})
MIXER_KINDS = frozenset({"linear_attention", "mamba", "conv", "recurrent"})
# "hybrid": Falcon-H1 runs attention and Mamba2 side by side in every layer; Zamba/Zamba2's hybrid layers
# add a shared attention block to the Mamba layer. Both count as a mixer and an attention layer.
BOTH_KINDS = frozenset({"hybrid"})


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class MixerShape:
    """One mixer layer's sizes (``dims``: the family's named sizes, as ``(name, value)`` pairs)."""

    family: str
    dims: tuple[tuple[str, int], ...]

    def __getattr__(self, name: str) -> int:
        for key, value in self.__dict__.get("dims", ()):
            if key == name:
                return value
        raise AttributeError(name)

    # ------------------------------------------------------------------ weights
    def params(self, hidden: int) -> int:
        """Parameters of one mixer layer (hidden size ``hidden``)."""
        h = hidden
        f = self.family
        if f == "mamba":  # in_proj, conv (+bias), x_proj, dt_proj (+bias), A_log, D, out_proj, dt/B/C norms
            d, n, r, k = self.d_inner, self.d_state, self.dt_rank, self.d_conv
            return h * 2 * d + d * k + d + d * (r + 2 * n) + r * d + d + d * n + d + d * h + r + 2 * n
        if f == "short_conv":  # in_proj (B, C, x), depthwise conv, out_proj
            k = self.d_conv
            return h * 3 * h + h * k + h * h
        if f == "lightning":  # qkv, output gate, output norm, out_proj
            hd = self.heads * self.head_dim
            return h * 3 * hd + h * hd + hd + hd * h
        if f == "rglru":  # linear_x, linear_y, linear_out (+biases), conv, input/a gates (block diagonal), a
            w, k, heads = self.width, self.d_conv, self.heads
            return 3 * (h * w + w) + w * k + w + 2 * (w * w // heads + w) + w
        if f == "ssd":  # in_proj (z, xBC, dt), conv on xBC, dt_bias, A_log, D, gated norm, out_proj
            d, gn, heads, k = self.heads * self.head_dim, self.groups * self.d_state, self.heads, self.d_conv
            return h * (2 * d + 2 * gn + heads) + (d + 2 * gn) * (k + 1) + 3 * heads + self.norm * d + d * h
        if f == "gdn":  # in_proj_qkvz, in_proj_ba, conv on qkv, dt_bias, A_log, norm, out_proj
            qk, v, hv, k = self.k_heads * self.k_dim, self.v_heads * self.v_dim, self.v_heads, self.d_conv
            return h * (2 * qk + 2 * v) + h * 2 * hv + (2 * qk + v) * k + 2 * hv + self.v_dim + v * h
        raise ValueError(f"unknown mixer family {f!r}")

    # ------------------------------------------------------------------ activations
    def saved_bytes(self, e: int, sp_size: int) -> int:
        """Bytes per local token one mixer layer keeps for backward (its input and output left out:
        the layer's norms and the next layer count them). ``e``: the training dtype's bytes; the scans'
        intermediates are fp32 whatever the dtype, as transformers' torch paths compute them."""
        f = self.family
        if f == "mamba":
            # measured on JambaMambaMixer (fp32, saved-tensor hooks): 12 d N + 37.6 d + 30 N bytes per token.
            # The scan keeps exp(dt A), dt B and the per-step state, each (d_inner, d_state) fp32; the rest:
            # in_proj's output (x, z), the conv's output and its activation, dt before / after softplus, the
            # scan output and the gate (~9.4 d units) and the dt / B / C projections with their RMS norms.
            # In a training step the peak holds one more (d, N) fp32 per token: the scan's backward starts
            # with the gradient of its stacked per-step states beside the saved tensors (measured: a Jamba
            # step at P=1 peaks at 4 (d, N) fp32 per token of its Mamba layer, 49.2 MiB vs 49.4 modelled).
            # At P > 1 the correction keeps exp(cumsum(dt A)) for the positions before a chunk's first
            # document start (every local token when no document starts there), and its einsum with C and
            # the incoming state a reordered copy of it: two more (d, N) fp32 per token.
            d, n = self.d_inner, self.d_state
            scan = 4 + (2 if sp_size > 1 else 0)
            return scan * d * n * 4 + math.ceil(9.4 * d * e) + 30 * n * e // 4 + 4 * self.dt_rank * e
        if f == "short_conv":
            # LFM2's ShortConv: in_proj's (B, C, x) output, B * x (the conv input, with its halo), the conv
            # output, C * conv (out_proj's input)
            return 6 * self.hidden * e
        if f == "lightning":
            # MiniMax's torch path: qkv and its SiLU output (q, k, v), per block the decayed q k^T scores
            # (heads x block per token, twice: scores and their decay), the block's kv state (heads x dim^2
            # per block, fp32), the output norm's fp32 input and output, the sigmoid gate and its product
            hd, heads, bs = self.heads * self.head_dim, self.heads, self.block_size
            return 6 * hd * e + 2 * heads * bs * e + 4 * hd * e + 2 * hd * 4 + 2 * heads * self.head_dim ** 2 * 4 // bs
        if f == "rglru":
            # RecurrentGemma's recurrent block: linear_y and its GELU, linear_x, the conv (input with halo,
            # output), the RG-LRU's two gates (pre-activation, sigmoid), log a, a, sqrt(1 - a^2), the gated
            # input, the scanned state (fp32) and y * x
            w = self.width
            return 10 * w * e + 4 * w * 4
        if f == "ssd":
            # transformers' Mamba2 torch path (falcon_h1 / bamba torch_forward, chunk size cs): in_proj's
            # output, the conv's xBC input and output, dt and softplus(dt) (heads, fp32), B and C repeated to
            # the heads, x * dt, the segment sums exp(segsum) (heads x cs per token), C B^T per chunk
            # (heads x cs x N ... contracted: heads x cs), the chunk states (heads x head_dim x N per chunk),
            # y, D x and the gated RMS norm (fp32)
            d, gn, heads, cs, n = self.heads * self.head_dim, self.groups * self.d_state, self.heads, self.chunk, self.d_state
            proj = (2 * d + 2 * gn + heads) * e + 2 * (d + 2 * gn) * e
            scan = (2 * heads + 2 * heads * n + d + 3 * heads * cs + 6 * d) * 4
            states = 2 * heads * self.head_dim * n * 4 // cs
            return proj + scan + states
        if f == "gdn":
            # transformers' torch_chunk_gated_delta_rule (qwen3_next, chunk 64): in_proj_qkvz / ba outputs, the
            # conv's qkv input and output, l2-normalised q and k (fp32, repeated to the value heads), g and
            # beta (fp32), per chunk the decay mask and the intra-chunk matrices (value heads x 64 per token,
            # about four), the chunk states (v_heads x k_dim x v_dim per chunk, fp32), w / u, the output and
            # the gated RMS norm
            qk, v, hv, dk, dv = self.k_heads * self.k_dim, self.v_heads * self.v_dim, self.v_heads, self.k_dim, self.v_dim
            proj = (2 * qk + 2 * v + 2 * hv) * e + 2 * (2 * qk + v) * e
            scan = (2 * 2 * hv * dk + 3 * hv + 4 * hv * 64 + 2 * hv * (dk + dv) + 4 * v) * 4
            states = 2 * hv * dk * dv * 4 // 64
            return proj + scan + states
        raise ValueError(f"unknown mixer family {f!r}")

    def state_bytes(self, batch: int, e: int, sp_size: int, chunks: int) -> int:
        """The sequence-parallel exchange's transients of one mixer layer on a rank (0 at ``sp_size`` 1):
        the conv halo (``chunks`` pieces of ``(k - 1) x channels``, and its gradient) and the all-gathered
        chunk summaries ``P x chunks x (|T| + |state|)`` fp32 with the reduce-scatter buffer of its backward."""
        if sp_size == 1:
            return 0
        f = self.family
        if f == "mamba":
            halo_ch, t, s = self.d_inner, self.d_inner * self.d_state, self.d_inner * self.d_state
        elif f == "short_conv":
            halo_ch, t, s = self.hidden, 0, 0
        elif f == "lightning":
            halo_ch, t, s = 0, self.heads, self.heads * self.head_dim ** 2
        elif f == "rglru":
            halo_ch, t, s = self.width, self.width, self.width
        elif f == "ssd":
            halo_ch, t = self.heads * self.head_dim + 2 * self.groups * self.d_state, self.heads
            s = self.heads * self.head_dim * self.d_state
        elif f == "gdn":
            halo_ch = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
            t, s = self.v_heads * self.k_dim ** 2, self.v_heads * self.k_dim * self.v_dim
        else:
            raise ValueError(f"unknown mixer family {f!r}")
        halo = 2 * chunks * batch * (self.d_conv - 1) * halo_ch * e if halo_ch else 0
        summaries = 2 * sp_size * chunks * batch * (t + s) * 4
        return halo + summaries


def mixer_shape(config: Any) -> tuple[MixerShape | None, tuple[str, ...]]:
    """The mixer of a transformers config (object, or a dict naming ``architecture`` / ``model_type``) and
    every layer's kind: ``"attention"``, ``"mixer"``, ``"both"`` or ``"mlp"`` (no position mixing).
    ``(None, ())`` for a model without mixer layers (Llama family: the estimator's original path)."""
    model_type = _get(config, "model_type", "architecture")
    family = FAMILY_OF_MODEL.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return None, ()
    if isinstance(config, dict):  # the launcher's "model" block: the config class fills the defaults
        from transformers import CONFIG_MAPPING

        fields = {k: v for k, v in config.items() if k not in ("architecture", "model_type")}
        config = CONFIG_MAPPING[model_type](**fields)
    h = int(config.hidden_size)
    types = list(_get(config, "layer_types", "layers_block_type", default=[]))
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"{model_type}: layer_types has {len(types)} entries for {config.num_hidden_layers} layers; "
                         "give a config whose layer_types covers every layer")
    kinds = []
    for t in types:
        kinds.append("both" if t in BOTH_KINDS else "attention" if t in ATTENTION_KINDS
                     else "mixer" if t in MIXER_KINDS else "mlp")
    if family == "mamba":
        d_inner = int(_get(config, "mamba_expand", "expand", default=2)) * h
        dims = {"d_inner": d_inner, "d_state": int(_get(config, "mamba_d_state", "state_size")),
                "d_conv": int(_get(config, "mamba_d_conv", "conv_kernel")),
                "dt_rank": int(_get(config, "mamba_dt_rank", "time_step_rank", default=math.ceil(h / 16)))}
        if dims["dt_rank"] == 0 or str(_get(config, "mamba_dt_rank")) == "auto":
            dims["dt_rank"] = math.ceil(h / 16)
    elif family == "short_conv":
        dims = {"hidden": h, "d_conv": int(_get(config, "conv_L_cache", default=3))}
    elif family == "lightning":
        heads = int(config.num_attention_heads)
        dims = {"heads": heads, "head_dim": int(_get(config, "head_dim", default=h // heads)),
                "block_size": int(_get(config, "block_size", default=256)), "d_conv": 1}
    elif family == "rglru":
        dims = {"width": int(_get(config, "lru_width", default=h)), "heads": int(config.num_attention_heads),
                "d_conv": int(_get(config, "conv1d_width", default=4))}
    elif family == "ssd":
        # field names: falcon_h1 / bamba / granitemoehybrid (mamba_*), nemotron_h (mamba_num_heads, head_dim,
        # ssm_state_size, n_groups), zamba2 (n_mamba_heads, mamba_headdim, mamba_ngroups)
        heads = int(_get(config, "mamba_n_heads", "n_mamba_heads", "mamba_num_heads", "num_heads"))
        dims = {"heads": heads,
                "head_dim": int(_get(config, "mamba_d_head", "mamba_headdim", "mamba_head_dim", "head_dim")),
                "d_state": int(_get(config, "mamba_d_state", "ssm_state_size", "state_size")),
                "groups": int(_get(config, "mamba_n_groups", "mamba_ngroups", "n_groups", default=1)),
                "d_conv": int(_get(config, "mamba_d_conv", "conv_kernel", default=4)),
                "chunk": int(_get(config, "mamba_chunk_size", "chunk_size", default=256)),
                "norm": 0 if _get(config, "mamba_rms_norm") is False else 1}  # Falcon-H1 may leave the gated norm out
    else:  # gdn
        dims = {"k_heads": int(config.linear_num_key_heads), "v_heads": int(config.linear_num_value_heads),
                "k_dim": int(config.linear_key_head_dim), "v_dim": int(config.linear_value_head_dim),
                "d_conv": int(_get(config, "linear_conv_kernel_dim", default=4))}
    return MixerShape(family, tuple(dims.items())), tuple(kinds)
