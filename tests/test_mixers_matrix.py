"""Issue 21's exactness matrix in one place: every listed hybrid model (Qwen3-Next, Qwen3.5, OLMo-hybrid,
Kimi-Linear, Falcon-H1, Bamba, Nemotron-H, Granite-4 hybrid, Zamba2, Jamba, MiniMax, LFM2), built tiny with one
layer of each kind by its family's test module, swapped at SP=2 and SP=4 with contiguous and with zigzag
sharding, fed the packed batch of 5 documents of tests/mixer_parity.py (one crossing shard edges), its fp32 loss
and every reduced gradient against each document run alone by transformers itself in float64.

The packed batch covers both halves of a mixer's sharding at once: the recurrence and the convolution restart at
each document start, and the document crossing shard edges takes its state (and conv halo) from the shard before
it, for zigzag also into a rank's second chunk; so no dense run is added here (tests/test_all_models.py runs
every model dense at SP=2, zigzag). One attention mode per cell (the
mixers do not depend on it; each family's own test runs every mode), and one pool task per SP size, the float64
reference computed once per model, keep the 48 cells cheap."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixer_parity import LENGTHS, documents, packed_batch, per_document_reference, sharded_parity  # noqa: E402

from seqpar.sequence.sharding import padded_length, shard_index  # noqa: E402

SHARDINGS = ("contiguous", "zigzag")
# one attention mode per (SP size, sharding): both shardings meet both ring and all-gather over the two sizes
MODE = {(2, "contiguous"): "allgather", (2, "zigzag"): "ring", (4, "contiguous"): "ring", (4, "zigzag"): "allgather"}


def _small_kda_chunks(patch: Callable[[object, str, object], None]) -> None:
    # KDA's torch kernel solves its 64-position chunks with a 63-step Python loop: chunks of 8 keep this fast
    # (the float64 reference and the swapped model both call the module's function: either chunk size is
    # exact). Idempotent, and the same patch test_mixers_gdn applies on the pool's ranks.
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    if not isinstance(kimi.chunk_kimi_delta_attention, functools.partial):
        patch(kimi, "chunk_kimi_delta_attention", functools.partial(kimi.chunk_kimi_delta_attention, chunk_size=8))


def models() -> dict:
    """name -> (tiny(dtype) -> model, the swap's expected routes); each family's own tiny model."""
    import test_mixers_conv as conv
    import test_mixers_gdn as gdn
    import test_mixers_lightning as lightning
    import test_mixers_mamba as mamba
    import test_mixers_ssd as ssd

    out = {name: (functools.partial(gdn.tiny, name), gdn.routes(name))
           for name in ("qwen3_next", "qwen3_5_text", "olmo_hybrid", "kimi_linear")}
    out.update({name: (functools.partial(ssd.tiny, name), ssd.ROUTES[name])
                for name in ("falcon_h1", "bamba", "nemotron_h", "granitemoehybrid", "zamba2")})
    out["jamba"] = (functools.partial(mamba.tiny, "jamba"), mamba.mixer_routes("jamba"))
    out["minimax"] = (lightning.tiny, lightning.ROUTES)
    out["lfm2"] = (conv.tiny_lfm2, {"model.layers.0.conv": "mixer", "model.layers.1.self_attn": "hf",
                                    "model.layers.2.conv": "mixer"})
    return out


MODELS = ("qwen3_next", "qwen3_5_text", "olmo_hybrid", "kimi_linear", "falcon_h1", "bamba", "nemotron_h",
          "granitemoehybrid", "zamba2", "jamba", "minimax", "lfm2")


def _crossing_documents(world: int, sharding: str) -> list[int]:
    """Lengths of the packed documents whose tokens land on more than one rank (under ``shard_batch``)."""
    cu = packed_batch(documents())["cu_seq_lens_q"].tolist()
    seq = padded_length(cu[-1], world, sharding)
    owner = torch.empty(seq, dtype=torch.long)
    for r in range(world):
        owner[shard_index(seq, r, world, sharding)] = r
    return [b - a for a, b in zip(cu, cu[1:]) if len(set(owner[a:b].tolist())) > 1]


def _matrix(rank: int, world: int, references: dict) -> tuple[list[tuple[str, str, str, float]], list[str]]:
    """Every model x both shardings at SP=``world`` against ``references`` (model -> float64 loss and
    gradients): (model, sharding, mode, seconds) of each cell run, and the failed cells' messages."""
    table = models()  # imports test_mixers_gdn, which reads the unpatched KDA kernel: before the patch
    _small_kda_chunks(setattr)
    done, failed = [], []
    for name in MODELS:
        tiny, routes = table[name]
        for sharding in SHARDINGS:
            mode = MODE[(world, sharding)]
            start = time.perf_counter()
            try:
                ran = sharded_parity(tiny, routes, world, sharding, [{"mode": mode}], reference=references[name])
                assert ran == [mode], ran
            except AssertionError as e:
                # every rank compares the same all-reduced loss and gradients, so every rank fails the same
                # check and they stay in step: go on, to report every failing cell at once
                failed.append(f"{name} SP={world} {sharding} ({mode}): {str(e)[:400]}")
            done.append((name, sharding, mode, time.perf_counter() - start))
    return done, failed


@pytest.fixture(scope="module")
def references() -> dict:
    """Each model's float64 reference, built once in this process for both SP sizes (not on every rank)."""
    table = models()
    threads = torch.get_num_threads()
    # one thread, as on the pool's ranks: these tiny float64 runs are dispatch-bound, and two threads on a
    # loaded 2-core machine made them 100x slower (15 s instead of 0.1 s per model)
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            _small_kda_chunks(patch.setattr)
            return {name: per_document_reference(table[name][0], documents()) for name in MODELS}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(900)  # 24 cells in one pool task, on a loaded 2-core machine
@pytest.mark.parametrize("world", [2, 4])
def test_every_model_every_sharding_packed(dist_pool, references, world):
    for sharding in SHARDINGS:
        assert _crossing_documents(world, sharding), (world, sharding, LENGTHS)
    done, failed = dist_pool.run(world, _matrix, references, timeout=600)[0]
    assert not failed, "\n".join(failed)
    assert [(n, s) for n, s, _, _ in done] == [(n, s) for n in MODELS for s in SHARDINGS]

