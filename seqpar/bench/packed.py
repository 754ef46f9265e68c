"""Packed vs padded training throughput for the same documents (issue 10).

``python -m seqpar.bench.packed [--docs 16] [--lo 64] [--hi 2048] [--repeats 3]``

Documents of long-tailed lengths (log-uniform between ``lo`` and ``hi``, seeded) go through one
fwd+bwd of a tiny Llama two ways:

- padded: one row per document, right-padded to the longest, transformers' own sdpa path with the
  padding mask (the usual unpacked batch);
- packed: every document in one row, as ``transformers.DataCollatorWithFlattening`` makes it,
  through the seqpar swap on one rank (``seqpar.attention(cu_seqlens=...)`` separates them).

Reported: real (non-pad) tokens per second of wall time and of process CPU time (CPU time is the
steadier figure on a shared machine), best of ``repeats``.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch


def lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return [int(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * float(x))) for x in u]


def _model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _best(step, repeats: int) -> tuple[float, float]:
    step()  # warm-up
    wall, cpu = math.inf, math.inf
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        step()
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu


def run(docs: int, lo: int, hi: int, repeats: int) -> dict[str, float]:
    import transformers

    from seqpar.swap import swap_attention

    lens = lengths(docs, lo, hi)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in lens]
    tokens = sum(lens)

    padded_model = _model()
    longest = max(lens)
    ids = torch.zeros(docs, longest, dtype=torch.long)
    mask = torch.zeros(docs, longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    labels = ids.masked_fill(mask == 0, -100)

    def padded() -> None:
        padded_model.zero_grad()
        padded_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()

    packed_model = copy.deepcopy(padded_model)
    swap_attention(packed_model)
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": r.tolist()} for r in rows])

    def packed() -> None:
        packed_model.zero_grad()
        packed_model(**batch).loss.backward()

    pw, pc = _best(padded, repeats)
    kw, kc = _best(packed, repeats)
    return {"docs": docs, "tokens": tokens, "padded_tokens": docs * longest,
            "padded_tok_s_wall": tokens / pw, "packed_tok_s_wall": tokens / kw,
            "padded_tok_s_cpu": tokens / pc, "packed_tok_s_cpu": tokens / kc,
            "speedup_wall": pw / kw, "speedup_cpu": pc / kc}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--lo", type=int, default=64)
    p.add_argument("--hi", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: steadier figures on a shared machine)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    for key, value in run(a.docs, a.lo, a.hi, a.repeats).items():
        print(f"{key:>20}: {value:.2f}" if isinstance(value, float) else f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
