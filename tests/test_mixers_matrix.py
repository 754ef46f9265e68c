"""Issue 21's exactness matrix in one place: every listed hybrid model (Qwen3-Next, Qwen3.5, OLMo-hybrid,
Kimi-Linear, Falcon-H1, Bamba, Nemotron-H, Granite-4 hybrid, Zamba2, Jamba, MiniMax, LFM2), built tiny with one
layer of each kind by its family's test module, swapped at SP=2 and SP=4 with contiguous and with zigzag
sharding, fed a packed batch (the 5 documents of tests/mixer_parity.py, one crossing shard edges, then a long
one), its fp32 loss and every reduced gradient against each document run alone by transformers itself in float64.

The packed batch covers both halves of a mixer's sharding at once: the recurrence and the convolution restart at
each document start, and the document crossing shard edges takes its state (and conv halo) from the shard before
it, for zigzag also into a rank's second chunk; so no dense run is added here (tests/test_all_models.py runs
every model dense at SP=2, zigzag).

The long document (1024 positions in all) makes every rank run the delta rule's wide scan over more than one of
the kernels' own 64-position chunks (KDA's default chunk size, not a smaller one for speed), checkpointed in
pieces (:data:`PIECE` positions: the test's value of ``delta_rule.RECOMPUTE``, 1024 by default, so that the
recompute fires at this length); ``_matrix`` counts the pieces on each rank. One attention mode per cell (the
mixers do not depend on it; each family's own test runs every mode), and one pool task per SP size, the float64
reference computed once per model, keep the 48 cells cheap."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixer_parity import (  # noqa: E402
    LENGTHS,
    VOCAB,
    documents,
    packed_batch,
    per_document_reference,
    sharded_parity,
)

from seqpar.sequence.sharding import padded_length, shard_index  # noqa: E402

SHARDINGS = ("contiguous", "zigzag")
# one attention mode per (SP size, sharding): both shardings meet both ring and all-gather over the two sizes
MODE = {(2, "contiguous"): "allgather", (2, "zigzag"): "ring", (4, "contiguous"): "ring", (4, "zigzag"): "allgather"}


# The batch: mixer_parity's 5 short documents, then one long enough that at SP=4, zigzag (8 chunks of 128
# positions) the chunk each rank holds at the end lies inside it: a wide scan of 2 kernel chunks on every rank.
LONG = 1024 - sum(LENGTHS)
KERNEL_CHUNK = 64  # the chunk of transformers' GDN and KDA torch kernels (their default chunk_size)
PIECE = KERNEL_CHUNK  # delta_rule.RECOMPUTE during the matrix: a 128-position wide scan is cut in 2 pieces
DELTA_RULE_MODELS = ("qwen3_next", "qwen3_5_text", "olmo_hybrid", "kimi_linear")


def matrix_documents() -> list[torch.Tensor]:
    """mixer_parity's documents, then one of :data:`LONG` tokens."""
    g = torch.Generator().manual_seed(5)
    return [*documents(), torch.randint(0, VOCAB, (LONG,), generator=g)]


def _chunk_size(kernel: Callable) -> int:
    """The chunk size ``kernel`` runs with: a ``functools.partial``'s, else its signature's default."""
    while isinstance(kernel, functools.partial):
        if "chunk_size" in kernel.keywords:
            return kernel.keywords["chunk_size"]
        kernel = kernel.func
    return inspect.signature(kernel).parameters["chunk_size"].default


@contextlib.contextmanager
def _counted_pieces() -> Iterator[list[tuple[int, int]]]:
    """Within: the wide scan is checkpointed in pieces of :data:`PIECE` positions, and each checkpointed
    piece is noted as ``(kernel chunk size, positions)``. Both patches are undone on exit."""
    from seqpar.mixers import delta_rule

    pieces: list[tuple[int, int]] = []
    checkpoint, recompute = delta_rule.checkpoint, delta_rule.RECOMPUTE

    def counted(fn: Callable, kernel: Callable, q: torch.Tensor, *args: object, **kwargs: object) -> object:
        pieces.append((_chunk_size(kernel), q.shape[1]))
        return checkpoint(fn, kernel, q, *args, **kwargs)

    delta_rule.checkpoint, delta_rule.RECOMPUTE = counted, PIECE
    try:
        yield pieces
    finally:
        delta_rule.checkpoint, delta_rule.RECOMPUTE = checkpoint, recompute


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
    cu = packed_batch(matrix_documents())["cu_seq_lens_q"].tolist()
    seq = padded_length(cu[-1], world, sharding)
    owner = torch.empty(seq, dtype=torch.long)
    for r in range(world):
        owner[shard_index(seq, r, world, sharding)] = r
    return [b - a for a, b in zip(cu, cu[1:]) if len(set(owner[a:b].tolist())) > 1]


def _matrix(rank: int, world: int, references: dict) -> tuple[list[tuple[str, str, str, float]], list[str]]:
    """Every model x both shardings at SP=``world`` against ``references`` (model -> float64 loss and
    gradients): (model, sharding, mode, seconds) of each cell run, and the failed cells' messages (this rank's
    count of checkpointed wide-scan pieces included)."""
    table = models()
    docs = matrix_documents()
    done, failed = [], []
    for name in MODELS:
        tiny, routes = table[name]
        with _counted_pieces() as pieces:
            for sharding in SHARDINGS:
                mode = MODE[(world, sharding)]
                start = time.perf_counter()
                try:
                    ran = sharded_parity(tiny, routes, world, sharding, [{"mode": mode}], reference=references[name][:2],
                                         docs=docs, atol=references[name][2])
                    assert ran == [mode], ran
                except AssertionError as e:
                    # every rank compares the same all-reduced loss and gradients, so every rank fails the same
                    # check and they stay in step: go on, to report every failing cell at once
                    failed.append(f"{name} SP={world} {sharding} ({mode}): {str(e)[:400]}")
                done.append((name, sharding, mode, time.perf_counter() - start))
        if name in DELTA_RULE_MODELS and not any(p == (KERNEL_CHUNK, PIECE) for p in pieces):
            failed.append(f"{name} SP={world} rank {rank}: no checkpointed wide-scan piece of {PIECE} positions "
                          f"with the kernel's {KERNEL_CHUNK}-position chunks (pieces: {pieces})")
    return done, failed


def _reference(tiny: Callable[[torch.dtype], torch.nn.Module]) -> tuple[float, dict, dict[str, float]]:
    """float64 loss and gradients of each document alone, and per parameter twice the error of the same run in
    fp32 (at 1024 positions GDN's fp32 kernel alone errs by up to 6e-5 on a gradient entry, above the 1e-6
    that mixer_parity allows at its 45): the SP run may err as much as twice one process in fp32."""
    docs = matrix_documents()
    loss, grads = per_document_reference(tiny, docs)
    _, grads32 = per_document_reference(lambda _: tiny(torch.float32), docs)
    return loss, grads, {n: 2 * float((grads32[n].double() - g).abs().max()) for n, g in grads.items()}


@pytest.fixture(scope="module")
def references() -> dict:
    """Each model's :func:`_reference`, built once in this process for both SP sizes (not on every rank)."""
    table = models()
    threads = torch.get_num_threads()
    # one thread, as on the pool's ranks: these tiny float64 runs are dispatch-bound, and two threads on a
    # loaded 2-core machine made them 100x slower (15 s instead of 0.1 s per model)
    torch.set_num_threads(1)
    try:
        return {name: _reference(table[name][0]) for name in MODELS}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(900)  # 24 cells in one pool task, on a loaded 2-core machine
@pytest.mark.parametrize("world", [2, 4])
def test_every_model_every_sharding_packed(dist_pool, references, world):
    for sharding in SHARDINGS:
        assert _crossing_documents(world, sharding), (world, sharding, LENGTHS)
    per_rank = dist_pool.run(world, _matrix, references, timeout=600)
    failed = [f for _, rank_failed in per_rank for f in rank_failed]
    assert not failed, "\n".join(failed)
    assert [(n, s) for n, s, _, _ in per_rank[0][0]] == [(n, s) for n in MODELS for s in SHARDINGS]

