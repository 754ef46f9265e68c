"""``python -m seqpar.bench memory --model llama3-8b --gpus 8 --gpu-mem 80``: the longest sequence a
whole model trains at, per configuration, with the per-rank breakdown (modelled, no GPU needed).

The model shapes are config dicts in :data:`seqpar.memory.training.MODEL_SHAPES` (no download). Each
configuration is ZeRO-3 over ``--gpus`` ranks, all of them one SP group, activation checkpointing on,
in ``--dtype`` (bf16 by default), and adds one tool at a time: the tiled loss, the tiled MLP, the
offload of checkpointed inputs, the lean RMSNorms (``recompute_norm``), then on several GPUs
attention's ``head_chunks`` 8 (one K/V head per ring pass) or Ulysses instead of the ring; on one GPU the optimizer state and fp32 master weights are offloaded
to the host as well (as ALST does), since an 8B model's AdamW state alone exceeds 80 GB.

``--layouts tp8,sp8,tp2xsp4`` compares meshes of tensor x sequence parallelism instead (``tpAxspB``:
TP degree A, SP degree B, their product the GPUs): one configuration, every memory tool on (ZeRO-3 over
the SP ranks with the optimizer offloaded, activation checkpointing, tiled loss and MLP, offloaded
checkpoints, lean norms), each layout with TP > 1 with and without ``tp_sequence_parallel``.

``--window W``, ``--chunk-size C``, ``--sinks`` and ``--sharding`` describe the data's mask: the ring's
attention term then follows the plan the ring runs for it (:mod:`seqpar.memory.masked`: skipped and pieced
blocks). The Ulysses row is left out under a mask (its estimate does not model masks and refuses them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from seqpar.memory.training import CATEGORIES, MODEL_SHAPES, longest_sequence, shape_dict

__all__ = ["ModelMemoryConfig", "CONFIGURATIONS", "LAYOUT_TOOLS", "parse_layouts", "configure", "count", "run",
           "render"]

# ALST (Arctic Long Sequence Training, arXiv 2506.13996): Llama-8B, H100 80 GB, published figures
PUBLISHED = {"alst": {1: "500K", 8: "3.7M"}}

CONFIGURATIONS: list[tuple[str, dict[str, Any]]] = [
    ("AC only", {}),
    ("+ tiled loss", {"tiled_loss": True}),
    ("+ tiled loss + tiled MLP", {"tiled_loss": True, "tiled_mlp": "auto"}),
    ("+ tiled loss + tiled MLP + offload", {"tiled_loss": True, "tiled_mlp": "auto", "offload_activations": True}),
    ("+ tiled loss + tiled MLP + offload + recompute norm",
     {"tiled_loss": True, "tiled_mlp": "auto", "offload_activations": True, "recompute_norm": True}),
    # attention settings: they change nothing on one GPU (plain SDPA), so those rows are for SP > 1
    ("+ tiled loss + tiled MLP + offload + recompute norm, head_chunks 8",
     {"tiled_loss": True, "tiled_mlp": "auto", "offload_activations": True, "recompute_norm": True,
      "head_chunks": 8}),
    ("+ tiled loss + tiled MLP + offload + recompute norm, Ulysses",
     {"tiled_loss": True, "tiled_mlp": "auto", "offload_activations": True, "recompute_norm": True,
      "mode": "ulysses"}),
]
_ATTENTION_KEYS = ("head_chunks", "mode")

# --layouts: the one configuration every mesh layout runs with (a 70B model's fp32 AdamW state, 1.1 TB,
# fits 8 GPUs only on the host)
LAYOUT_TOOLS: dict[str, Any] = {"tiled_loss": True, "tiled_mlp": "auto", "offload_activations": True,
                                "recompute_norm": True, "offload_optimizer": True}


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"tp8,sp8,tp2xsp4"`` -> ``[(8, 1), (1, 8), (2, 4)]`` as ``(tp, sp)``."""
    layouts = []
    for item in text.split(","):
        tp = sp = 1
        for part in item.strip().lower().split("x"):
            if part.startswith("tp") and part[2:].isdigit():
                tp = int(part[2:])
            elif part.startswith("sp") and part[2:].isdigit():
                sp = int(part[2:])
            else:
                raise SystemExit(f"--layouts: {item!r} is not tpA, spB or tpAxspB (e.g. tp8,sp8,tp2xsp4)")
        layouts.append((tp, sp))
    return layouts


@dataclass(frozen=True)
class ModelMemoryConfig:
    model: str
    gpus: list[int]
    gpu_mem_gb: float
    reserve: float
    dtype: str
    mode: str
    layouts: list[tuple[int, int]] | None = None
    masks: dict[str, Any] = field(default_factory=dict)  # window, chunk_size, sinks, sharding: given ones only


def configure(args: Any) -> ModelMemoryConfig:
    if args.model not in MODEL_SHAPES:
        raise SystemExit(f"--model {args.model!r}: choose one of {sorted(MODEL_SHAPES)}")
    dtype = args.model_dtype
    layouts = parse_layouts(args.layouts) if getattr(args, "layouts", None) else None
    if layouts is not None:
        gpus = sorted({tp * sp for tp, sp in layouts})
        if args.gpus and gpus != [args.gpus]:
            raise SystemExit(f"--layouts {args.layouts} covers {gpus} GPUs, --gpus says {args.gpus}")
    else:
        gpus = [args.gpus] if args.gpus else [1, 8]
    masks = {k: v for k, v in (("window", getattr(args, "window", None)), ("chunk_size", getattr(args, "chunk_size", None)),
                               ("sinks", getattr(args, "sinks", False) or None),
                               ("sharding", getattr(args, "sharding", None))) if v is not None}
    for key in ("window", "chunk_size"):
        if masks.get(key) is not None and masks[key] < 1:
            raise SystemExit(f"--{key.replace('_', '-')} {masks[key]}: a positive number of tokens, or leave it out")
    return ModelMemoryConfig(model=args.model, gpus=gpus, gpu_mem_gb=args.gpu_mem, reserve=args.gpu_reserve,
                             dtype=dtype, mode="ring", layouts=layouts, masks=masks)


def _layout_runs(layouts: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    return [(tp, sp, tsp) for tp, sp in layouts for tsp in ((False, True) if tp > 1 else (False,))]


def _configurations(gpus: int, masked: bool = False) -> list[tuple[str, dict[str, Any]]]:
    return [(n, t) for n, t in CONFIGURATIONS if (gpus > 1 or not any(k in t for k in _ATTENTION_KEYS))
            and not (masked and t.get("mode") == "ulysses")]


def count(cfg: ModelMemoryConfig) -> int:
    if cfg.layouts is not None:
        return len(_layout_runs(cfg.layouts))
    return sum(len(_configurations(g, bool(cfg.masks))) for g in cfg.gpus)


def run(cfg: ModelMemoryConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    budget = int(cfg.gpu_mem_gb * 2**30 * (1 - cfg.reserve))
    rows = []
    for tp, sp, tp_seq in _layout_runs(cfg.layouts or []):
        name = " x ".join(x for x in (f"TP {tp}" if tp > 1 else "", f"SP {sp}" if sp > 1 else "") if x)
        name += ", tp_sequence_parallel" if tp_seq else ""
        progress(f"{name}")
        kw = dict(dp_size=1, engine="deepspeed", zero_stage=3, dtype=cfg.dtype, activation_checkpointing=True,
                  mode=cfg.mode, device="cuda", tp_size=tp, tp_sequence_parallel=tp_seq, **LAYOUT_TOOLS, **cfg.masks)
        seq, breakdown = longest_sequence(cfg.model, budget, sp_size=sp, **kw)
        rows.append({"gpus": tp * sp, "configuration": name, "tools": {**LAYOUT_TOOLS, "tp_size": tp,
                     "sp_size": sp, "tp_sequence_parallel": tp_seq}, "longest_seq": seq, "breakdown": breakdown,
                     "published_alst": None})
    for gpus in ([] if cfg.layouts is not None else cfg.gpus):
        for name, tools in _configurations(gpus, bool(cfg.masks)):
            progress(f"{name} on {gpus}")
            kw = dict(dp_size=1, engine="deepspeed", zero_stage=3, dtype=cfg.dtype, activation_checkpointing=True,
                      mode=cfg.mode, device="cuda", offload_optimizer=gpus == 1)
            kw.update(tools)
            kw.update(cfg.masks)
            seq, breakdown = longest_sequence(cfg.model, budget, sp_size=gpus, **kw)
            rows.append({"gpus": gpus, "configuration": name, "tools": tools, "longest_seq": seq,
                         "breakdown": breakdown, "published_alst": PUBLISHED["alst"].get(gpus)})
    return {"kind": "model", "model": cfg.model, "shape": shape_dict(cfg.model), "budget_bytes": budget,
            "gpu_mem_gb": cfg.gpu_mem_gb, "reserve": cfg.reserve, "dtype": cfg.dtype, "results": rows,
            "modelled": True, "layouts": cfg.layouts, "masks": cfg.masks}


def _tokens(n: int) -> str:
    """Tokens in binary units, as sequence lengths are counted (1K = 1024)."""
    return f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n // 1024}K"


def render(payload: dict[str, Any]) -> str:
    from seqpar.bench.report import fmt_bytes, format_table

    table = []
    for r in payload["results"]:
        b = r["breakdown"]
        row = {"gpus": r["gpus"], "cfg": r["configuration"], "seq": _tokens(r["longest_seq"]) if r["longest_seq"] else "-",
               "alst": r["published_alst"] or "", "moment": b.get("moment", "")}
        row.update({c: fmt_bytes(b.get(c)) for c in CATEGORIES})
        row["peak"] = fmt_bytes(b.get("peak"))
        table.append(row)
    cols = [("GPUs", "gpus"), ("configuration", "cfg"), ("longest seq", "seq"), ("ALST published", "alst"),
            ("peak/rank", "peak"), ("at", "moment")] + [(c.replace("_", " "), c) for c in CATEGORIES]
    mesh = ("the layouts' TP x SP, ZeRO-3 over the SP ranks with the optimizer on the host, tiled loss and MLP, "
            "offloaded checkpoints, lean norms" if payload.get("layouts") else "SP over all GPUs")
    head = (f"{payload['model']}: longest trainable sequence per configuration (MODELLED, not measured): ZeRO-3, "
            f"{payload['dtype']}, activation checkpointing, {mesh}, {payload['gpu_mem_gb']:g} GB per GPU "
            f"less {payload['reserve']:.0%} reserve = {fmt_bytes(payload['budget_bytes'])} usable")
    if payload.get("masks"):
        head += "; the data's mask: " + ", ".join(f"{k} {v}" for k, v in payload["masks"].items())
    return "\n".join([head, format_table(table, cols)])


def plots(payload: dict[str, Any], out_dir: str) -> list[str]:
    return []
