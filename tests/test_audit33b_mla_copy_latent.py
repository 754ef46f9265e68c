"""A deep copy of a swapped MLA model keeps the latent ring (mut33b, L3/L2): on SP=2 (zigzag, the latent ring) the
copy's layers stash their latent (``LatentCall``) on their OWN call frames with their OWN ``kv_b_proj``.
test_house32_deepcopy_mla pins the copy's numbers, which stay right when the copy's ``expand_kv`` reads the
source's frames (L3: no frame of the source is running, so it falls back to expanded K/V: right values, the latent
ring silently lost). Here each forward's stashes are counted and their projection's owner checked."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from test_mla_models import VOCAB, tiny_mla  # noqa: E402

import seqpar.swap.mla as mla  # noqa: E402
from seqpar.config import SeqParConfig  # noqa: E402
from seqpar.sequence.batch import shard_batch  # noqa: E402
from seqpar.swap import swap_attention  # noqa: E402


def _run(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """``{model: (latent stashes, of which with this model's own kv_b_proj)}`` for one forward each."""
    policy = tiny_mla("deepseek_v3")
    swap_attention(policy, SeqParConfig(size=world, sharding="zigzag"), group=dist.group.WORLD)
    frozen = copy.deepcopy(policy)
    seen: list = []
    real = mla.LatentCall

    class Recording(real):  # the stash's projection, as expand_kv built it
        def __init__(self, c, r, proj, *rest, **kw):
            seen.append(proj)
            super().__init__(c, r, proj, *rest, **kw)

    mla.LatentCall = Recording
    out = {}
    try:
        ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3301))
        for name, model in (("copy", frozen), ("policy", policy)):
            seen.clear()
            own = {id(m) for m in model.modules()}
            with torch.no_grad():
                model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, group=dist.group.WORLD,
                                    sharding="zigzag"))
            out[name] = (len(seen), sum(id(p) in own for p in seen))
    finally:
        mla.LatentCall = real
    return out


@pytest.mark.timeout(300)
def test_a_deep_copy_stashes_its_own_latent(dist_pool) -> None:
    for rank, out in enumerate(dist_pool.run(2, _run, timeout=240)):
        for name in ("policy", "copy"):
            n, own = out[name]
            assert n > 0, f"rank {rank}: the {name}'s forward stashed no latent (expanded K/V moved): {out}"
            assert own == n, f"rank {rank}: the {name}'s stashes hold another model's kv_b_proj: {out}"
