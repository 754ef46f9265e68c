"""Audit 36 (session 37), the model judges' shared gradient walk (``fuzz_model_judges._worst_gradient``, 54c22db),
on made-up results judged by ``judge_model`` (float64 reference: each gradient within 1e-4 of its own max plus 1e-8
of the model's):

- a NaN gradient is WRONG (a NaN compares false with its allowance both ways);
- an empty gradient (a zero-size parameter) is skipped, not measured;
- an exact verdict names the worst gradient, not the last one walked.

Seen failing: the allowance test as ``diff > allowance`` (audit 36's J1) -> the NaN gradient "exact"; the empty
gradient measured (J2) -> max() of an empty tensor raised; the last gradient kept as the worst (J3) -> "worst
grad b"."""

from __future__ import annotations

import torch

from seqpar.testing.fuzz_model_judges import judge_model


def _result(grads: dict[str, torch.Tensor]) -> dict:
    return {"loss": 2.5, "grads": grads, "dtype": "float64"}


def test_the_gradient_walk_judges_nan_skips_empty_and_names_the_worst() -> None:
    g = torch.Generator().manual_seed(36)
    a, b = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    ref = _result({"a": a, "empty": torch.zeros(0, dtype=torch.float64), "b": b})

    nan = a.clone()
    nan[1, 2] = float("nan")
    verdict, detail = judge_model(ref, _result({"a": nan, "empty": torch.zeros(0, dtype=torch.float64), "b": b}))
    assert verdict == "WRONG" and "grad a" in detail, (verdict, detail)

    # a off by 5e-5 of its max, b by 1e-6 of its: both within 1e-4, a the worst
    got = {"a": a + 5e-5 * a.abs().max(), "empty": torch.zeros(0, dtype=torch.float64), "b": b + 1e-6 * b.abs().max()}
    verdict, detail = judge_model(ref, _result(got))
    assert verdict == "exact" and "worst grad a 5.0e-05" in detail, (verdict, detail)
