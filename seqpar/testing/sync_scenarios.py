"""The configurations the host-sync checker runs (:mod:`seqpar.testing.syncs`): :class:`Scenario` and
:data:`SCENARIOS`, every mode and feature, and the sizes of their batches."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Scenario", "SCENARIOS", "MIXER_FAMILIES", "SEQ_PER_RANK", "HEAD_DIM", "LAYERS", "documents"]


@dataclass(frozen=True)
class Scenario:
    """One configuration the checker runs on every rank.

    ``kind``: ``"attention"`` (``seqpar.attention`` calls as layers), ``"dilated"``, ``"mha"`` (a swapped
    ``nn.TransformerEncoder``), ``"hf"`` (a swapped tiny Llama), ``"gather"`` (``gather_sequence``),
    ``"mixer"`` (a family of :data:`MIXERS`, named by ``extra["mixer"]``), ``"moe"`` (the router
    statistics over the SP group), ``"offload"`` (``CudaTransfer`` on stubbed streams). ``extra``:
    mode options, ``"gpus"`` (the simulated GPUs, default both), ``"batch_syncs"`` (an expected count
    that theory in the tests does not derive)."""

    name: str
    kind: str = "attention"
    mode: str = "ring"
    sharding: str = "zigzag"
    q_heads: int = 8
    kv_heads: int = 2
    documents: bool = False
    window: int | None = None
    sinks: bool = False
    head_chunks: int | str = "auto"
    ulysses: int | None = None  # hybrid: the Ulysses degree (needs P > u)
    min_world: int = 2
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def applies(self, world: int) -> bool:
        if world < self.min_world:
            return False
        if self.mode == "ulysses" and self.q_heads % world:
            return False
        if self.ulysses is not None and not 1 < self.ulysses < world:
            return False
        return True


SEQ_PER_RANK = 16
HEAD_DIM = 64
LAYERS = 2


def documents(seq: int) -> tuple[int, ...]:
    """Uneven packed documents over ``seq`` tokens: cuts at 3/16, 1/2 and 9/16 of the sequence."""
    return (0, 3 * seq // 16, seq // 2, 9 * seq // 16, seq)


SCENARIOS: list[Scenario] = [
    Scenario("ring-dense-contiguous", sharding="contiguous"),
    Scenario("ring-dense-zigzag"),
    Scenario("ring-head-chunks-1", head_chunks=1),
    Scenario("ring-documents", documents=True),
    Scenario("ring-documents-balanced", documents=True, sharding="balanced"),
    Scenario("ring-window", window=5),
    Scenario("ring-window-documents-sinks", window=5, documents=True, sinks=True),
    Scenario("ring-no-overlap", extra={"overlap": False}),
    Scenario("allgather-dense", mode="allgather"),
    Scenario("allgather-documents-window-sinks", mode="allgather", documents=True, window=5, sinks=True),
    Scenario("ulysses-mha", mode="ulysses", kv_heads=8),
    Scenario("ulysses-gqa", mode="ulysses"),  # kv_heads 2 < u at P = 4, 8
    Scenario("ulysses-mqa", mode="ulysses", kv_heads=1),
    Scenario("ulysses-documents-window-sinks", mode="ulysses", documents=True, window=5, sinks=True),
    Scenario("ulysses-balanced-documents", mode="ulysses", documents=True, sharding="balanced"),
    Scenario("hybrid-u2", mode="hybrid", ulysses=2, min_world=4),
    Scenario("hybrid-u2-mqa-documents-window-sinks", mode="hybrid", ulysses=2, kv_heads=1, documents=True,
             window=5, sinks=True, min_world=4),
    Scenario("hybrid-u4", mode="hybrid", ulysses=4, min_world=8),
    Scenario("auto", mode="auto", extra={"warmup": True}),  # the first call probes the links, once per run
    Scenario("dilated-ring", kind="dilated", sharding="contiguous"),
    Scenario("dilated-allgather", kind="dilated", mode="allgather", sharding="contiguous"),
    Scenario("gather-sequence-balanced", kind="gather", sharding="balanced", documents=True),
    Scenario("mha-route", kind="mha", q_heads=4, kv_heads=4),
    Scenario("mha-route-mask-only", kind="mha", q_heads=4, kv_heads=4, extra={"hint": False}),
    Scenario("hf-route", kind="hf", q_heads=4, kv_heads=2),
    Scenario("hf-route-documents", kind="hf", q_heads=4, kv_heads=2, documents=True),
    Scenario("hf-route-tiling-recompute-norm", kind="hf", q_heads=4, kv_heads=2,
             extra={"tiling": True, "recompute_norm": True}),
]

SCENARIOS.append(Scenario("moe-router-statistics", kind="moe", extra={"gpus": ("h100",)}))
SCENARIOS.append(Scenario("offload", kind="offload", extra={"gpus": ("h100",)}))

# Mixers (kind "mixer"): each family's sequence-parallel layer, built from a tiny transformers layer, called
# LAYERS times on one batch; extra["mixer"] names its builder in seqpar.testing.sync_mixers.MIXERS. Every family runs dense
# (contiguous) and with packed documents (zigzag: two chunks per rank, documents crossing them). A new
# family: a builder decorated with @mixer("name") and its name in MIXER_FAMILIES.
MIXER_FAMILIES = ("conv", "mamba", "mamba2", "gdn", "lightning", "rglru", "state-passing")
# No kernel choice depends on the GPU here: simulated as an H100 only.
SCENARIOS += [
    Scenario(f"mixer-{family}-{sharding}{'-documents' if docs else ''}", kind="mixer", sharding=sharding,
             documents=docs, extra={"mixer": family, "gpus": ("h100",)})
    for family in MIXER_FAMILIES for sharding, docs in (("contiguous", False), ("zigzag", True))
]

