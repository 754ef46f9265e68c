"""Every decoder-only causal LM of the installed transformers, at SP=2: exact or refused by name (issue 19 §1).

The builder and runner live in ``tests/all_models.py`` (``python -m tests.all_models --table`` prints
the table of docs/models.md). One pass over every model type on the session's 2-rank pool feeds every test here.
"""

from __future__ import annotations

import re

import pytest

transformers = pytest.importorskip("transformers")

import all_models  # noqa: E402 - tests/ is on sys.path, as for dist_harness
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

# Model types whose tiny config does not run even in one process without seqpar, recorded when this
# test landed (transformers 5.24.0), with the exception. The count may only fall: a better tiny config
# moves a model into the table; a new failure must be looked at, not skipped.
CANNOT_RUN = {
}


@pytest.fixture(scope="module")
def results(dist_pool):  # noqa: ANN001, ANN201
    return all_models.run_all(dist_pool)


def test_the_filter_keeps_decoders_only() -> None:
    types = all_models.decoder_model_types()
    for kept in ("llama", "gpt2", "mixtral", "qwen3_next", "mamba", "gemma3_text", "deepseek_v3"):
        assert kept in types, kept
    for dropped in ("bert", "roberta", "bart", "marian", "whisper", "trocr", "gemma3", "llama4", "musicgen"):
        assert dropped not in types and all_models.excluded_reason(dropped), dropped


def test_every_decoder_is_exact_or_refused_by_name(results) -> None:  # noqa: ANN001
    failures = {t: f"{r['status']}: {r['detail']}" for t, r in results.items() if r["status"] in ("wrong", "crash")}
    assert not failures, "silently wrong or failing under seqpar:\n" + "\n".join(
        f"  {t}: {d}" for t, d in sorted(failures.items()))
    for t, r in results.items():
        if r["status"] == "refused":  # the SwapError names the module (its dotted path), else the model's class
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t]
            assert re.search(r"'\w+(\.\w+)+'", r["detail"]) or model_class in r["detail"], (t, r)
    assert sum(r["status"] == "exact" for r in results.values()) >= len(results) // 2, all_models.counts(results)


def test_models_that_cannot_run_do_not_grow(results) -> None:  # noqa: ANN001
    cannot = {t: r["detail"] for t, r in results.items() if r["status"] == "cannot_run"}
    new = {t: d for t, d in cannot.items() if t not in CANNOT_RUN}
    assert len(cannot) <= len(CANNOT_RUN), f"{len(cannot)} tiny configs cannot run (recorded: {len(CANNOT_RUN)}); new: {new}"


def test_docs_table_is_current(results) -> None:  # noqa: ANN001
    table = all_models.page_table()
    if f"transformers {transformers.__version__} " not in table:
        pytest.skip(f"docs/models.md's table is for another transformers than {transformers.__version__}")
    assert all_models.page_counts() == all_models.counts(results), (
        "docs/models.md's all-models table is stale: run `python -m tests.all_models --write-docs`")
    assert table == all_models.table(results), (
        "docs/models.md's all-models table is stale: run `python -m tests.all_models --write-docs`")


def test_each_gradient_is_judged_on_its_own_scale() -> None:
    """A parameter whose gradient is 1e-6 of the model's largest, doubled, is wrong (judged on the model's scale
    it passed: issue 28 §2); rounding of a gradient that is ~0 in exact arithmetic is judged on the model's."""
    import torch

    g = torch.Generator().manual_seed(0)
    ref = {"loss": 2.0, "grads": {"big": torch.randn(8, 8, generator=g, dtype=torch.float64),
                                  "a_log": 1e-6 * torch.randn(4, generator=g, dtype=torch.float64),
                                  "k_bias": 1e-12 * torch.randn(4, generator=g, dtype=torch.float64)}}
    noisy = {n: t * (1 + 1e-7 * torch.randn(t.shape, generator=g, dtype=t.dtype)) for n, t in ref["grads"].items()}
    noisy["k_bias"] = noisy["k_bias"] + 1e-9  # rounding noise of the model's scale on a ~0 gradient
    assert all_models.compare(ref, {"loss": 2.0, "grads": noisy})[0]
    doubled = all_models.mutate_grads(noisy, {"a_log": 2.0})
    exact, text = all_models.compare(ref, {"loss": 2.0, "grads": doubled})
    assert not exact and "a_log" in text, text
    assert not all_models.compare(ref, {"loss": 2.0 * (1 + 2e-4), "grads": noisy})[0]
