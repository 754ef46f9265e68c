"""``python -m seqpar.bench.mla``: MLA ring bytes per rank per layer, latent vs expanded K/V (BENCHMARKS.md).

The figures come from :func:`seqpar.attn.latent.ring_bytes_per_rank`, the formula that
``tests/test_mla_models.py::test_latent_ring_bytes_per_layer`` checks byte for byte against what a
DeepSeek-V3 forward + backward hands to torch.distributed at SP=2 and 4 (both transfers). Defaults:
DeepSeek-V3's attention dims (128 heads, qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512), bf16
blocks, fp32 gradient accumulators, batch 1, a dense ring (documents and windows only lower both).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from seqpar.attn.latent import MLADims, ring_bytes_per_rank

__all__ = ["DEEPSEEK_V3", "table", "main"]

DEEPSEEK_V3 = MLADims(heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
CASES = ((32768, 8), (131072, 8), (131072, 32), (1048576, 64))


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(dims: MLADims = DEEPSEEK_V3, cases: Sequence[tuple[int, int]] = CASES, elem_bytes: int = 2,
          acc_bytes: int = 4) -> str:
    """A markdown table: per (S, P), bytes one rank sends per layer (forward + backward), both transfers."""
    rows = [f"| S | P | latent ({dims.latent_width} values/token) | expanded ({dims.expanded_width} values/token) "
            "| ratio |", "|---|---|---|---|---|"]
    for seq, world in cases:
        got = {t: ring_bytes_per_rank(dims, seq_local=seq // world, world=world, transfer=t, elem_bytes=elem_bytes,
                                      acc_bytes=acc_bytes) for t in ("latent", "expanded")}
        rows.append(f"| {seq} | {world} | {_gib(got['latent'])} | {_gib(got['expanded'])} "
                    f"| {got['expanded'] / got['latent']:.1f}x |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar.bench.mla", description=__doc__.splitlines()[0])
    parser.add_argument("--elem-bytes", type=int, default=2, help="bytes per K/V or latent value (bf16: 2)")
    args = parser.parse_args(argv)
    print(table(elem_bytes=args.elem_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
