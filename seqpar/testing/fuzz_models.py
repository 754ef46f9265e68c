"""The fuzzer's ``model`` cases (:mod:`seqpar.testing.fuzz`): a tiny model of any decoder-only type
(:mod:`seqpar.testing.tiny_models`) under ``swap_attention`` on P ranks, against one process without seqpar.

Drawn: the model type; P in 1..4; mode (ring, allgather, ulysses, hybrid with u=2 at P=4, auto); sharding
(contiguous, zigzag; balanced with packing); the batch (two rows of a length P may not divide, so
``shard_batch`` pads the end; two rows with right padding under an ``attention_mask``; packed documents
from ``DataCollatorWithFlattening`` with random lengths, length-1 documents and one longer than a shard);
activation checkpointing (off, reentrant, non-reentrant; where the model supports it); the step (one
forward and backward; two forwards before one backward; gradient accumulation over two micro-batches);
``check_inputs`` on and off. The same cases through ZeRO, FSDP2 and TP are the ``engine`` kind
(:mod:`seqpar.testing.fuzz_engines`).

Then the memory features of the ``sequence_parallel`` block (``memory``; drawn after everything above, so a case
seed's other draws are those it had before them; the ``engine`` kind draws none): in 30% of the cases the model
type is redrawn among :data:`TILEABLE_TYPES` (the Llama-family causal LMs :mod:`seqpar.memory.tiling` takes) and
at least one feature is turned on, in 6% one feature goes on whatever the type (a type seqpar does not tile must
be refused by name on every rank). The features, each with its options: ``tiled_loss`` (the tile: the automatic
one or ``loss_tile_rows`` rows, one token, tiles that do and do not divide the shard; applied by capping
:data:`seqpar.memory.tiling.MAX_LOSS_CHUNK_ELEMENTS` in the ranks, the one knob of the tile size), ``tiled_mlp``
(``"auto"``, 1, 2..6 chunks, or 4096: one-token tiles), ``offload_activations`` (on CPU the swap's own
transfer is an exact no-op, so the ranks give it a stand-in that copies each checkpointed input away and back,
:class:`HostCopyTransfer`: the recompute and prefetch order run for real; it matters with checkpointing only),
``recompute_norm``, ``head_chunks`` (attention in passes over the K/V heads: 1, 2, or 3, which divides few
tiny models' K/V heads: refused by name); the vocabulary size (96, or odd: 97, 61, 31, which is under the hidden size so that the
automatic loss tile is the whole shard) and ignored labels (a prompt of ``ignored_prefix`` tokens of row 0 with
``-100`` labels, on rows and right-padded batches). All go through the config, as a user's: ``swap_attention``
applies them. The vocab-parallel loss is not drawn: it runs under TP only (the LM head split on the vocabulary,
with ``tp_sequence_parallel`` or the tiled loss), which this kind has no engine for; nor does the ``engine``
kind's ``tp2`` reach it today (its config sets neither, so the head's output is gathered).

Last, ``knobs`` (:func:`draw_knobs`): the ``sequence_parallel`` keys no draw above reaches, each rarely (``overlap``
off, ``check_finite``, ``mla_transfer="expanded"`` with the model type redrawn among the MLA ones half the time,
``ulysses_size="auto"``, ``links`` under ``mode="auto"``); none may change the maths. And ``config_knobs``
(:func:`draw_config_knobs`, from a generator of its own): ``high_priority_streams``, ``timeout_s``, ``apex``,
``mixer_kernels="auto"``, which no draw reached before fz30; on CPU none may change the maths either. And
``dkv_wire`` (:func:`draw_dkv_wire`, from a generator of its own, fz31): ``dkv_wire_dtype: "bf16"`` in the block, which
is not exact: the case then runs twice, with the wire at ``"fp32"`` (judged as every case, against one process) and
at ``"bf16"`` (judged against that fp32-wire run, :func:`judge_dkv_wire`, at :func:`dkv_wire_bound`).

Reference: one process without seqpar and without the memory features (they must not change the maths),
float64 where the model runs in it (else fp32), on the full batch, with the case's activation checkpointing;
packed documents each run alone and token-weighted (per-document semantics). The loss must agree within
``tol`` relative and every parameter's gradient (summed over the SP ranks) within
``tol * max|g_ref of that parameter| + floor * max|g_ref| over the model`` (tol 1e-4 in float64, 1e-3 in fp32).
The judges (that one, :func:`judge_model`, and the bf16 wire's) are :mod:`seqpar.testing.fuzz_model_judges`'s,
re-exported here.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from seqpar.testing.fuzz_attention import with_empty_documents
from seqpar.testing.fuzz_model_judges import (
    decoder_layers,
    dkv_wire_bound,
    judge_dkv_wire,
    judge_model,
    judge_model_wire,
    kind_dkv_wire_bound,
)

__all__ = ["draw_model", "draw_lengths", "draw_memory", "model_summary", "run_model_case", "model_task", "model_reference",
           "case_batches", "build_case_model", "enable_checkpointing", "judge_model", "sp_summed_grads", "TILEABLE_TYPES",
           "HostCopyTransfer", "MODEL_PLANTS", "CONFIG_KNOBS_RATE", "draw_config_knobs",
           "case_config", "DKV_WIRE_RATE", "draw_dkv_wire", "dkv_wire_bound", "judge_dkv_wire",
           "KIND_DKV_WIRE_RATE", "DKV_WIRE_KINDS", "draw_kind_dkv_wire", "decoder_layers", "kind_dkv_wire_bound",
           "judge_model_wire",
           "SWAP_RATE", "SWAPS", "draw_swap"]

_TYPES: list[str] = []


def _model_types() -> list[str]:
    if not _TYPES:
        from seqpar.testing.tiny_models import decoder_model_types

        _TYPES.extend(decoder_model_types())
    return _TYPES


def draw_lengths(rng: random.Random, world: int, batch: str) -> list[list[int]]:
    """The lengths of a case's two batches of kind ``batch`` (``rows``, ``padded``, ``packed``) at ``world``
    ranks: rows of a length the SP degree may not divide; a full row and a right-padded row of its own length;
    packed documents with length-1 ones and one longer than a shard of the world. An engine case's DP replicas
    draw theirs the same way (:mod:`seqpar.testing.fuzz_engines`), so every replica is sharded alike."""
    shard = 8
    seqs: list[list[int]] = []
    for _ in range(2):
        seq = rng.randint(world * shard - 2 * world + 1, world * shard) if world > 1 else rng.randint(10, 16)
        if batch == "packed":
            lens = [rng.randint(seq // world + 1, seq - 2)] if world > 1 else []
            while sum(lens) < seq:
                lens.append(min(seq - sum(lens), 1 if rng.random() < 0.3 else rng.randint(2, 7)))
            rng.shuffle(lens)
            seqs.append(lens)
        elif batch == "padded":
            seqs.append([seq, rng.randint(2, seq - 1)])  # row 0 full, row 1 right-padded
        else:
            seqs.append([seq])
    return seqs


def draw_model(rng: random.Random, memory: bool = False) -> dict[str, Any]:
    """A ``model`` case's draws (JSON-able); ``memory``: the memory features too (:func:`draw_memory`, after every
    other draw; the ``engine`` kind, which calls this without, applies none)."""
    types = _model_types()
    world = rng.randint(1, 4)
    mode = rng.choice(("ring", "ring", "allgather", "ulysses", "hybrid", "auto"))
    ulysses_size = 2 if mode == "hybrid" and world == 4 else (world if mode == "hybrid" else 1)
    batch = rng.choice(("rows", "rows", "padded", "packed"))
    sharding = rng.choice(("contiguous", "zigzag", "balanced") if batch == "packed" else ("contiguous", "zigzag"))
    seqs = draw_lengths(rng, world, batch)
    draws = {
        "kind": "model", "model_type": rng.choice(types), "world": world, "mode": mode,
        "ulysses_size": ulysses_size, "sharding": sharding, "batch": batch, "lengths": seqs,
        "checkpointing": rng.choice((None, None, "reentrant", "non-reentrant")),
        "step": rng.choice(("one", "one", "two-forwards", "accumulate")),
        "check_inputs": rng.random() < 0.7,
    }
    if memory:
        draws = _with_memory(rng, draws)
        draws["knobs"] = draw_knobs(rng, draws)  # after the memory draws: a case seed's draws above are unchanged
    return draws


_MLA_TYPES = ("axk1", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi_linear", "longcat_flash", "minicpm3",
              "sarvam_mla", "youtu")
"""Tiny model types whose attention is MLA (``kv_lora_rank``; seqpar.swap.mla): ``knobs`` draws ``mla_transfer``
among them more often than it would by chance."""


def draw_knobs(rng: random.Random, draws: dict[str, Any]) -> dict[str, Any]:
    """The ``knobs`` draws (JSON-able; only the keys that differ from the default): the ``sequence_parallel`` block's
    keys no other draw of this kind reaches, each rarely, so most cases keep every default and a few combine two:
    ``overlap`` false (the ring waits for each transfer), ``check_finite`` (a collective NaN/Inf check per layer),
    ``mla_transfer`` ``"expanded"`` (MLA layers send expanded K/V instead of the latent; then the model type is
    redrawn among the MLA ones half the time), ``ulysses_size`` ``"auto"`` under ``hybrid`` / ``auto`` (the degree
    chosen at ``init_process_groups``), and ``links`` under ``auto`` (link figures far from the defaults, so that
    the choice swings between ring, all-gather, Ulysses and hybrid without the probe). None may change the maths."""
    knobs: dict[str, Any] = {}
    if rng.random() < 0.15:
        knobs["overlap"] = False
    if rng.random() < 0.12:
        knobs["check_finite"] = True
    if rng.random() < 0.15:
        knobs["mla_transfer"] = "expanded"
        if rng.random() < 0.5 and not draws.get("memory"):
            draws["model_type"] = rng.choice(_MLA_TYPES)
    if draws["mode"] in ("hybrid", "auto") and rng.random() < 0.35:
        knobs["ulysses_size"] = "auto"
    if draws["mode"] == "auto" and rng.random() < 0.5:
        knobs["links"] = {"intra_gbps": rng.choice((0.01, 1.0, 450.0, 1e6)), "inter_gbps": rng.choice((0.01, 50.0, 1e6)),
                          "node_size": rng.choice((1, 2, 8)), "flops": rng.choice((1e9, 4e14, 1e18)),
                          "latency_s": rng.choice((1e-7, 2e-5, 1e-2))}
    return knobs


CONFIG_KNOBS_RATE = 0.3
"""How often a ``model`` case gets :func:`draw_config_knobs`' keys (one or more of them)."""


def draw_config_knobs(case_seed: int) -> dict[str, Any] | None:
    """The ``config_knobs`` draws (JSON-able; None for most cases): the ``sequence_parallel`` block's keys that no
    draw of any kind reached before fz30, each of which must leave the maths as it is on CPU:
    ``high_priority_streams`` (NCCL's high-priority streams; documented "no effect on gloo"), ``timeout_s`` (the
    collectives' timeout of the SP / DP groups seqpar makes; far above a case's run), ``apex`` (apex's fused kernels
    where installed, else a log line and the plain path) and ``mixer_kernels="auto"`` (flash-linear-attention /
    mamba_ssm on CUDA where importable, else transformers' torch path).

    Drawn from a generator of its own (``f"{case_seed}:config_knobs"``), never the case's: every case seed keeps
    every draw it had before (fz30), as ``empty_docs`` does (fz28)."""
    rng = random.Random(f"{case_seed}:config_knobs")
    if rng.random() >= CONFIG_KNOBS_RATE:
        return None
    knobs: dict[str, Any] = {}
    while not knobs:  # at least one, now and then several
        if rng.random() < 0.4:
            knobs["high_priority_streams"] = True
        if rng.random() < 0.3:
            knobs["timeout_s"] = rng.choice((600, 3600))
        if rng.random() < 0.3:
            knobs["apex"] = True
        if rng.random() < 0.4:
            knobs["mixer_kernels"] = "auto"
    return knobs


DKV_WIRE_RATE = 0.2
"""How often a ``model`` case gets :func:`draw_dkv_wire`'s ``dkv_wire_dtype: "bf16"``."""


def draw_dkv_wire(case_seed: int) -> str | None:
    """The ``dkv_wire`` draw: ``"bf16"`` (the config's ``dkv_wire_dtype``; about :data:`DKV_WIRE_RATE` of the cases)
    or None (the default, ``"fp32"``). Every mode is kept: under ``allgather`` / ``ulysses`` the config must refuse
    it by name on every rank (docs/configuration.md); ``auto`` may pick a mode whose wire is not a ring (then it must
    not change the gradients at all, which the bound allows).

    Drawn from a generator of its own (``f"{case_seed}:dkv_wire"``), never the case's: every case seed keeps every
    draw it had before (fz31), as ``config_knobs`` does (fz30)."""
    rng = random.Random(f"{case_seed}:dkv_wire")
    return "bf16" if rng.random() < DKV_WIRE_RATE else None


SWAP_RATE = 0.15
"""How often a ``model`` case passes an explicit ``swap`` (:func:`draw_swap`) instead of the default ``"auto"``."""
SWAPS = ("hf", "hf", "sdpa", ["*Attention"])
"""The explicit ``swap`` values drawn: ``"hf"`` (the route ``"auto"`` takes for a transformers model: the same
run), ``"sdpa"`` (a transformers attention module does not call ``scaled_dot_product_attention`` itself: refused
by name, "found nothing to swap"), and a list of class-name patterns (``"*Attention"``: the model's attention
modules by name, where their names end so)."""


def draw_swap(case_seed: int) -> str | list[str] | None:
    """The ``swap`` draw (JSON-able; None: the default ``"auto"``), from a generator of its own
    (``f"{case_seed}:swap"``), never the case's: every case seed keeps every draw it had before (fz31)."""
    rng = random.Random(f"{case_seed}:swap")
    return rng.choice(SWAPS) if rng.random() < SWAP_RATE else None


KIND_DKV_WIRE_RATE = 0.25
"""How often an ``engine``, ``dynamic`` or ``trainer`` case gets :func:`draw_kind_dkv_wire`'s ``"bf16"``."""
DKV_WIRE_KINDS = ("engine", "dynamic", "trainer")
"""The kinds that draw ``dkv_wire`` from :func:`draw_kind_dkv_wire` (fz33; the ``model`` kind from
:func:`draw_dkv_wire`, fz31)."""


def draw_kind_dkv_wire(case_seed: int, kind: str) -> str | None:
    """fz33: ``"bf16"`` (about :data:`KIND_DKV_WIRE_RATE` of the cases; the ``sequence_parallel`` block's
    ``dkv_wire_dtype``, which each of :data:`DKV_WIRE_KINDS` sets in the config its ranks pass) or None (the default
    ``"fp32"``); None for the other kinds. Every mode is kept, as in the ``model`` kind: ``allgather`` / ``ulysses``
    must refuse it by name on every rank. Judged against the kind's own float64 reference at
    :func:`kind_dkv_wire_bound` (:func:`judge_model_wire`; the trainer kind's :func:`~seqpar.testing.fuzz_trainers.
    judge_trainer` with ``wire``), not exactly.

    Drawn from a generator of its own (``f"{case_seed}:{kind}_dkv_wire"``), never the case's: every case seed keeps
    every draw it had before."""
    if kind not in DKV_WIRE_KINDS:
        return None
    rng = random.Random(f"{case_seed}:{kind}_dkv_wire")
    return "bf16" if rng.random() < KIND_DKV_WIRE_RATE else None


TILEABLE_TYPES = ("exaone", "gemma", "internlm3", "iquestcoder", "llama", "mistral", "phi3", "qwen2")
"""The tiny model types whose causal LM is one :mod:`seqpar.memory.tiling` tiles (``CAUSAL_LM_CLASSES``); the
memory cases draw among them (tests/test_fuzz.py checks the list against the tiling module's classes)."""
_ONE_TOKEN_MLP_TILES = 4096  # tiled_mlp chunks beyond any shard's rows: mlp_chunks caps them to one row each


def draw_memory(rng: random.Random, model_type: str, at_least_one: bool) -> dict[str, Any]:
    """The ``memory`` draws (JSON-able): ``tiled_loss``, ``loss_tile_rows`` (None: the automatic tile),
    ``tiled_mlp`` (False, ``"auto"`` or chunks), ``offload_activations``, ``recompute_norm``, ``vocab`` (the model's
    vocabulary size), ``ignored_prefix`` (row 0's first tokens labelled -100), ``head_chunks`` (attention's K/V
    heads per pass: ``"auto"``, 1, 2, or 3, which does not divide most tiny models' 2 K/V heads: a refusal by
    name). ``at_least_one``: one feature at least is on (else exactly one, for a refusal probe on a type seqpar
    may not tile)."""
    from seqpar.testing.tiny_models import VOCAB

    mem: dict[str, Any] = {
        "tiled_loss": rng.random() < 0.6,
        "loss_tile_rows": rng.choice((None, None, 1, rng.randint(2, 7))),
        "tiled_mlp": rng.choice((False, False, "auto", 1, rng.randint(2, 6), rng.randint(2, 6), _ONE_TOKEN_MLP_TILES)),
        "offload_activations": rng.random() < 0.4,
        "recompute_norm": rng.random() < 0.4,
        "vocab": rng.choice((VOCAB, VOCAB, 97, 61, 31)),
        "ignored_prefix": rng.choice((0, 0, 1, rng.randint(2, 8))),
    }
    features = ("tiled_loss", "tiled_mlp", "offload_activations", "recompute_norm")
    if not at_least_one:  # exactly one feature, the rest off
        keep = rng.choice(features)
        for f in features:
            if f != keep:
                mem[f] = False
        mem[keep] = mem[keep] or (2 if keep == "tiled_mlp" else True)
        mem["vocab"] = VOCAB  # a type's tiny config may tie other fields to the vocabulary
    elif not any(mem[f] is not False for f in features):
        mem[rng.choice(features)] = True
    if mem["tiled_mlp"] is True:
        mem["tiled_mlp"] = 2
    if not mem["tiled_loss"]:
        mem["loss_tile_rows"] = None
    # attention's memory knob (K/V heads per pass); drawn last, so the draws above are those it had before
    head_chunks = rng.choice(("auto", "auto", "auto", 1, 2, 2, 3))  # the tiny models have 2 K/V heads mostly
    mem["head_chunks"] = head_chunks if at_least_one else "auto"
    return mem


def _with_memory(rng: random.Random, draws: dict[str, Any]) -> dict[str, Any]:
    u = rng.random()
    if u < 0.30:
        draws["model_type"] = rng.choice(TILEABLE_TYPES)
        draws["memory"] = draw_memory(rng, draws["model_type"], at_least_one=True)
    elif u < 0.36:
        draws["memory"] = draw_memory(rng, draws["model_type"], at_least_one=False)
    else:
        draws["memory"] = None
    return draws


def _memory_summary(mem: dict[str, Any] | None) -> str:
    if not mem:
        return ""
    from seqpar.testing.tiny_models import VOCAB

    parts = []
    if mem.get("tiled_loss"):
        parts.append("tiled_loss" + (f"(tile={mem['loss_tile_rows']})" if mem.get("loss_tile_rows") else ""))
    if mem.get("tiled_mlp") not in (None, False):
        parts.append(f"tiled_mlp={mem['tiled_mlp']}")
    for key in ("offload_activations", "recompute_norm"):
        if mem.get(key):
            parts.append(key)
    if mem.get("head_chunks", "auto") != "auto":
        parts.append(f"head_chunks={mem['head_chunks']}")
    if mem.get("vocab", VOCAB) != VOCAB:
        parts.append(f"vocab={mem['vocab']}")
    if mem.get("ignored_prefix"):
        parts.append(f"ignored={mem['ignored_prefix']}")
    return " mem[" + " ".join(parts) + "]"


def model_summary(draws: dict[str, Any]) -> str:
    d = draws
    n_batches = 1 if d["step"] == "one" else 2
    return (f"model {d['model_type']} P={d['world']} {d['mode']}" + (f"(u={d['ulysses_size']})" if d["mode"] == "hybrid" else "")
            + f" {d['sharding']} {d['batch']}={d['lengths'][:n_batches]} ckpt={d['checkpointing']} step={d['step']}"
            + ("" if d["check_inputs"] else " no-check") + _memory_summary(d.get("memory")) + _knobs_summary(d.get("knobs"))
            + _knobs_summary(d.get("config_knobs"), "config") + (f" dkv={d['dkv_wire']}" if d.get("dkv_wire") else "")
            + (f" swap={d['swap']}" if d.get("swap") else ""))


def _knobs_summary(knobs: dict[str, Any] | None, word: str = "knobs") -> str:
    if not knobs:
        return ""
    return f" {word}[" + " ".join(f"{k}={v}" if k != "links" else "links=" + ",".join(f"{a}={b:g}" for a, b in v.items())
                                for k, v in knobs.items()) + "]"


def case_batches(draws: dict[str, Any]) -> list[dict[str, Any]]:
    """The case's full batches (1 or 2, per ``step``), from its case seed."""
    from seqpar.testing.tiny_models import VOCAB

    mem = draws.get("memory") or {}
    vocab, ignored = mem.get("vocab", VOCAB), mem.get("ignored_prefix", 0)
    g = torch.Generator().manual_seed(draws["case_seed"])
    out = []
    empty = draws.get("empty_docs") or []  # zero-length documents per batch (fuzz_attention.draw_empty_documents)
    for i, lens in enumerate(draws["lengths"][: 1 if draws["step"] == "one" else 2]):
        if draws["batch"] == "packed":
            import transformers

            docs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
            b = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": x} for x in docs])
            plain = dict(b)
            if i < len(empty) and empty[i]:  # the collator drops an empty sample: its boundaries get the repeats
                cu = torch.tensor(with_empty_documents(b["cu_seq_lens_q"].tolist(), empty[i]), dtype=b["cu_seq_lens_q"].dtype)
                b = {**plain, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone()}
            out.append({"docs": docs, "batch": dict(b), "plain": plain})
        elif draws["batch"] == "padded":
            seq, keep = lens
            ids = torch.randint(3, vocab, (2, seq), generator=g)
            mask = torch.ones(2, seq, dtype=torch.long)
            mask[1, keep:] = 0
            ids[1, keep:] = 0
            labels = ids.masked_fill(mask == 0, -100)
            labels[0, :ignored] = -100  # a prompt without loss (memory cases)
            out.append({"batch": {"input_ids": ids, "attention_mask": mask, "labels": labels}})
        else:
            ids = torch.randint(3, vocab, (2, lens[0]), generator=g)
            labels = ids.clone()
            labels[0, :ignored] = -100  # a prompt without loss (memory cases)
            out.append({"batch": {"input_ids": ids, "labels": labels}})
    return out


ROW_INDEXED_PACKING = frozenset({"llama4_text"})
"""Model types whose packed row is, by transformers' own design, not its documents run alone, so that the
reference of a packed batch is the row itself (transformers' packed mask from ``position_ids``): Llama 4's
NoPE layers scale each query by a temperature of its index in the row (``torch.arange``, not
``position_ids``), so a document after the first gets other temperatures than alone (case 1156417737: two
documents of 9 tokens, P = 1, loss 4.6e-4 off its documents run alone). seqpar reproduces the row at every P
(docs/models.md)."""


def build_case_model(draws: dict[str, Any], dtype: torch.dtype) -> Any:
    """The case's tiny model. Packed batches: MoE router losses and Bamba's z-loss off, on both sides. The
    reference runs each document alone, and a router loss is a statistic of the tokens of one call (the
    load-balancing loss a product of per-expert means), so per-document runs cannot give the packed call's
    value (jamba, P=1: loss 5e-4 off with no SP at all); the z-loss is a mean over the call's tokens, which
    the token-weighted per-document losses weigh otherwise (case 2143272812: tiny bamba, packed [5, 1, 8],
    3.6e-3 off; seqpar's is the packed call's, as one process computes it on the row)."""
    from seqpar.testing.tiny_models import VOCAB, build_model

    vocab = (draws.get("memory") or {}).get("vocab", VOCAB)
    model = build_model(draws["model_type"], dtype) if vocab == VOCAB else _build_with_vocab(draws["model_type"], dtype, vocab)
    if draws["batch"] == "packed":
        if getattr(model.config, "output_router_logits", False):
            model.config.output_router_logits = False
        if getattr(model, "z_loss_coefficient", 0):
            model.z_loss_coefficient = 0.0
    return model


def _build_with_vocab(model_type: str, dtype: torch.dtype, vocab: int) -> Any:
    """:func:`seqpar.testing.tiny_models.build_model` with another vocabulary size (the same seeded init)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    from seqpar.testing.tiny_models import tiny_config

    config = tiny_config(model_type)
    config.vocab_size = vocab
    torch.manual_seed(0)
    model = getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).to(dtype)
    model.train()
    return model


def enable_checkpointing(model: Any, how: str | None) -> None:
    """transformers' activation checkpointing (``"reentrant"`` / ``"non-reentrant"``; ``None``: off), where the
    model supports it."""
    if how is not None and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"})


def model_reference(draws: dict[str, Any], batches: list[dict[str, Any]]) -> dict[str, Any]:
    """One process, no seqpar, the case's checkpointing: ``{"ok", "dtype", "loss", "grads"}`` (loss summed over the batches) or
    ``{"ok": False, "error"}`` when the tiny model does not run even so."""

    errors = []
    for dtype in (torch.float64, torch.float32):
        try:
            model = build_case_model(draws, dtype)
            # the same checkpointing as the SP run: transformers' reentrant checkpointing alone changes some
            # models' gradients (flex_olmo's embedding, 90% off in one process), which is not seqpar's to answer
            enable_checkpointing(model, draws["checkpointing"])
            total = 0.0
            for b in batches:
                if "docs" in b and draws["model_type"] in ROW_INDEXED_PACKING:
                    loss = model(**b.get("plain", b["batch"])).loss  # the packed row as transformers runs it (see the constant)
                elif "docs" in b:  # each document alone, token-weighted (per-document semantics)
                    loss, count = 0.0, 0
                    for d in b["docs"]:
                        if len(d) > 1:
                            ids = torch.tensor([d])
                            loss = loss + model(input_ids=ids, labels=ids).loss * (len(d) - 1)
                            count += len(d) - 1
                    loss = loss / count
                else:
                    out = model(**b["batch"])
                    loss = _real_token_z_loss(model, out, b["batch"].get("attention_mask"))
                if loss is None or not torch.isfinite(loss):
                    raise RuntimeError(f"loss is {loss}")
                total = total + loss
            total.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
            if bad:  # the model alone gives no gradient to compare with (granite_swa right-padded, case 680605197)
                raise RuntimeError(f"non-finite gradient of {bad[0]} (and {len(bad) - 1} more) in one process")
            return {"ok": True, "dtype": str(dtype).removeprefix("torch."), "loss": float(total.detach()), "grads": grads}
        except Exception as e:  # noqa: BLE001 - the model cannot run here: the case is skipped
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    return {"ok": False, "error": errors[-1]}


def _real_token_z_loss(model: Any, out: Any, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``out.loss`` with a z-loss (Bamba: ``z_loss_coefficient * mean(logsumexp(logits)**2)``) taken over the
    real tokens only, as seqpar defines it (docs/models.md): transformers' forward averages it over every
    position, right padding included, whose logits depend on how its attention treats a padded query (case
    1086484656: tiny Bamba, one row right-padded, 1.3e-3 relative). Unchanged without padding or z-loss."""
    coef = getattr(model, "z_loss_coefficient", 0) or 0
    if out.loss is None or coef <= 0 or attention_mask is None or bool(attention_mask.all()):
        return out.loss
    squares = out.logits.logsumexp(dim=-1).to(out.loss.dtype).pow(2)  # (batch, seq)
    real = attention_mask.to(squares.dtype)
    return out.loss + coef * ((squares * real).sum() / real.sum() - squares.mean())


class HostCopyTransfer:
    """A stand-in for :class:`seqpar.memory.offload.CudaTransfer` on CPU (whose own transfer leaves the inputs
    where they are): each offloaded input is copied away and back (a fresh tensor each way), so the offloaded
    recompute, its RNG replay and the backward prefetch order run as on a GPU."""

    def applies(self, args: tuple[Any, ...]) -> bool:
        return any(isinstance(a, torch.Tensor) for a in args)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def prefetch(self, handle: torch.Tensor) -> torch.Tensor:
        return handle.clone()

    def fetch(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


class _ScaledBackTransfer(HostCopyTransfer):
    def fetch(self, handle: torch.Tensor) -> torch.Tensor:
        return handle * 1.001


MODEL_PLANTS = ("tile_loss_own_count", "mlp_last_tile_grads", "offload_scaled_input")
"""Deliberately broken memory features, for the fuzzer's own tests (:func:`model_task`'s ``plant``):
``"tile_loss_own_count"``: each loss tile's sum divided by its own token count (a per-tile mean) instead of
leaving the division to the total; ``"mlp_last_tile_grads"``: the tiled MLP's parameter gradients those of its
last tile alone; ``"offload_scaled_input"``: an offloaded layer input comes back scaled by 1.001 (the recompute then
differs from the forward)."""


def _memory_settings(draws: dict[str, Any], plant: str | None) -> Any:
    """Undo callable for what a memory case changes in the rank beyond the config: the loss tile's cap
    (``loss_tile_rows``), the stand-in offload transfer, a plant."""
    from seqpar.memory import offload, tiling
    from seqpar.testing.tiny_models import VOCAB

    mem = draws.get("memory") or {}
    saved = (tiling.MAX_LOSS_CHUNK_ELEMENTS, offload.CudaTransfer, tiling._chunk_loss_and_grad, tiling._TiledMLP.backward)
    if mem.get("loss_tile_rows"):
        # loss_chunk_rows caps a tile at MAX_LOSS_CHUNK_ELEMENTS // vocab rows: the tile of this many rows (or fewer)
        tiling.MAX_LOSS_CHUNK_ELEMENTS = mem["loss_tile_rows"] * mem.get("vocab", VOCAB)
    offload.CudaTransfer = HostCopyTransfer if plant != "offload_scaled_input" else _ScaledBackTransfer
    if plant is not None and plant not in MODEL_PLANTS:
        raise ValueError(f"unknown plant {plant!r}")
    if plant == "tile_loss_own_count":
        chunk = saved[2]

        def per_tile_mean(hidden_c: Any, weight: Any, target_c: Any, ignore_index: int, *args: Any) -> Any:
            loss, dlogits = chunk(hidden_c, weight, target_c, ignore_index, *args)
            return loss / (target_c != ignore_index).sum().clamp(min=1), dlogits
        tiling._chunk_loss_and_grad = per_tile_mean
    elif plant == "mlp_last_tile_grads":
        original = saved[3]

        def last_tile(ctx: Any, grad_out: torch.Tensor) -> Any:
            rows = grad_out.numel() // grad_out.shape[-1]
            keep = torch.zeros_like(grad_out).reshape(-1, grad_out.shape[-1])
            last = ((rows - 1) // ctx.chunk_rows) * ctx.chunk_rows
            keep[last:] = 1
            parts = original(ctx, grad_out * keep.view_as(grad_out))  # the last tile's parameter gradients
            full = original(ctx, grad_out)
            return (None, full[1], None, *parts[3:])
        tiling._TiledMLP.backward = staticmethod(last_tile)

    def undo() -> None:
        tiling.MAX_LOSS_CHUNK_ELEMENTS, offload.CudaTransfer, tiling._chunk_loss_and_grad = saved[:3]
        tiling._TiledMLP.backward = staticmethod(saved[3])
    return undo


def model_task(ctx: Any, draws: dict[str, Any], batches: list[dict[str, Any]], dtype_name: str,
               plant: str | None = None) -> dict[str, Any]:
    """Pool task (every rank): the case under seqpar; rank 0 returns the loss and the gradients summed over
    the SP ranks, every rank ``{"ok": False, "error"}`` on an exception. ``plant``: one of :data:`MODEL_PLANTS`."""
    import warnings

    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the kernels' fallback notes, once per model type and rank
    undo = _memory_settings(draws, plant)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's rename
            return _model_task(ctx, draws, batches, dtype_name)
    finally:
        undo()
        transformers.logging.set_verbosity(verbosity)


def case_config(draws: dict[str, Any], world: int) -> dict[str, Any]:
    """The ``sequence_parallel`` block a ``model`` case's ranks pass to ``init_process_groups`` and
    ``swap_attention`` (``world`` ranks, one SP group): the drawn mode, sharding, Ulysses degree and check, the
    memory features, ``knobs``, ``config_knobs``, ``dkv_wire`` and ``swap``."""
    cfg = {"size": world, "mode": draws["mode"], "sharding": draws["sharding"],
           "ulysses_size": draws["ulysses_size"], "check_inputs": draws["check_inputs"]}
    mem = draws.get("memory") or {}
    cfg.update({k: mem[k] for k in ("tiled_loss", "tiled_mlp", "offload_activations", "recompute_norm", "head_chunks")
                if k in mem})
    cfg.update(draws.get("knobs") or {})
    cfg.update(draws.get("config_knobs") or {})
    if draws.get("dkv_wire"):
        cfg["dkv_wire_dtype"] = draws["dkv_wire"]
    if draws.get("swap"):
        cfg["swap"] = draws["swap"]
    return cfg


def _model_task(ctx: Any, draws: dict[str, Any], batches: list[dict[str, Any]], dtype_name: str) -> dict[str, Any]:
    import seqpar
    from seqpar.testing.verdicts import error_record

    try:
        cfg = case_config(draws, ctx.world_size)
        manager = seqpar.init_process_groups(config=cfg)
        model = build_case_model(draws, getattr(torch, dtype_name))
        seqpar.swap_attention(model, cfg)
        enable_checkpointing(model, draws["checkpointing"])
        losses = []
        for b in batches:
            out = model(**seqpar.shard_batch(b["batch"]))
            if draws["step"] == "accumulate":
                out.loss.backward()
            losses.append(out.loss)
        if draws["step"] != "accumulate":
            sum(losses).backward()
        grads = sp_summed_grads(model, manager.sp_group)
        return {"ok": True, "loss": float(sum(x.detach() for x in losses)), "grads": grads if ctx.rank == 0 else None}
    except Exception as e:  # noqa: BLE001 - classified by the driver
        return {"ok": False, "error": error_record(e)}


def sp_summed_grads(model: Any, group: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the SP ``group`` (collective: every rank of it calls), for each
    parameter that has a gradient on *some* rank; a rank without one adds zeros.

    Which parameters get a gradient can differ between ranks: a mixture-of-experts block gives none to an
    expert no token of the rank's shard was routed to (LongCat-Flash's zero-computation experts take every
    token of a shard now and then: fuzzer case 1535814214, the expert weights of layer 0 gradient-less on
    rank 1 only). Deciding presence on each rank alone made the ranks all-reduce different parameter lists,
    a collective mismatch that aborted a rank; presence is decided over the group first (one MAX all-reduce).
    """
    import torch.distributed as dist

    params = list(model.named_parameters())
    present = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int32)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
    grads = {}
    for (name, p), anywhere in zip(params, present.tolist(), strict=True):
        if anywhere:
            g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[name] = g
    return grads


def run_model_case(pools: Any, draws: dict[str, Any], timeout: float, plant: str | None = None) -> tuple[str, str]:
    """Verdict and detail of a ``model`` case (``"skipped"``: the tiny model does not run even without
    seqpar, so there is nothing to compare). ``plant``: one of :data:`MODEL_PLANTS` (the fuzzer's own tests)."""
    batches = case_batches(draws)
    ref = model_reference(draws, batches)
    if draws.get("dkv_wire"):  # first the bf16 wire: a refusal (allgather, ulysses) ends the case by itself
        ended, wired = run_ranks(pools, draws, ref, model_task, batches, plant, timeout)
        if ended is not None:
            return ended
    ended, per_rank = run_ranks(pools, {**draws, "dkv_wire": None}, ref, model_task, batches, plant, timeout)
    if ended is not None:
        return ended
    verdict = judge_model(ref, per_rank[0])  # the fp32 wire: exact against one process, as every case
    if verdict[0] != "exact" or not draws.get("dkv_wire"):
        return verdict
    wire = judge_dkv_wire(draws, ref, per_rank[0], wired[0])
    return wire if wire[0] != "exact" else ("exact", f"{verdict[1]}; {wire[1]}")


def run_ranks(pools: Any, draws: dict[str, Any], ref: dict[str, Any], task: Any, batches: Any, plant: str | None,
              timeout: float) -> tuple[tuple[str, str] | None, list[dict[str, Any]]]:
    """``(None, every rank's result)`` of the pool task ``task(ctx, draws, batches, ref["dtype"], plant)`` on
    ``draws["world"]`` ranks, or ``(verdict, [])`` where the case ends before the judging: ``"skipped"`` where
    the one-process reference ``ref`` could not run, the ranks' crash or refusal
    (:func:`~seqpar.testing.verdicts.classify_errors`). The ``model`` and ``engine`` kinds' run."""
    from seqpar.testing.verdicts import classify_errors

    if not ref["ok"]:
        return ("skipped", f"cannot run without seqpar: {ref['error']}"), []
    per_rank = pools.run(draws["world"], task, draws, batches, ref["dtype"], plant, timeout=timeout)
    return classify_errors(per_rank), per_rank
