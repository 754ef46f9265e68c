"""``python -m seqpar.bench interleave`` (issue 30 §5: the loose bench scripts' one tool), without processes:
the per-round figures and their medians from the ranks' raw records, and a bad method refused before any
pool starts. (A real run on 2 CPU ranks takes ~10 s of pool start-up; the suites' own tests cover run_case.)"""

from __future__ import annotations

import pytest

from seqpar.bench.interleave import build_parser, run_rounds, summarize


def _rank(wall: list[float], cpu: list[float], phases: dict[str, float] | None = None) -> dict:
    rec = {"timing": {"wall_s": wall, "cpu_s": cpu}}
    if phases is not None:
        rec["profile"] = {"phases_cpu_s": phases}
    return rec


def test_summarize_keeps_every_round_and_takes_medians() -> None:
    rounds = [  # 3 rounds x 2 ranks, 2 repeats each
        [_rank([1.0, 3.0], [0.5, 0.7], {"kernel": 0.2}), _rank([2.0, 1.0], [0.9, 0.1], {"kernel": 0.4, "merge": 0.2})],
        [_rank([5.0, 5.0], [2.0, 2.0], {"kernel": 1.0}), _rank([4.0, 4.0], [1.0, 1.0], {"kernel": 3.0})],
        [_rank([0.5, 0.5], [0.3, 0.3], {"kernel": 0.1}), _rank([0.6, 0.6], [0.2, 0.2], {"kernel": 0.1})],
    ]
    s = summarize(rounds)
    # per round: slowest rank per repeat (wall), largest rank per repeat (cpu), median over the repeats
    assert s["time_s_rounds"] == [2.5, 5.0, 0.6]
    assert s["cpu_s_rounds"] == pytest.approx([0.8, 2.0, 0.3])
    assert s["time_s"] == 2.5 and s["cpu_s"] == pytest.approx(0.8)
    # phases: mean over ranks (a phase a rank did not record counts 0), median over rounds
    assert s["phases_cpu_s"] == pytest.approx({"kernel": 0.3, "merge": 0.0})


def test_summarize_without_a_profile_has_no_phases() -> None:
    s = summarize([[_rank([1.0], [1.0]), _rank([1.0], [1.0])]])
    assert "phases_cpu_s" not in s and s["cpu_s_rounds"] == [1.0]


def test_an_unknown_method_is_refused_before_any_pool_starts() -> None:
    args = build_parser().parse_args(["--methods", "ring,deepspeed", "--world", "2"])
    with pytest.raises(SystemExit, match="unknown method.*deepspeed"):
        run_rounds(args)


def test_compiled_summary_takes_the_slowest_rank_per_round_and_median_ratios() -> None:
    """``interleave --compile`` (seqpar.bench.compiled): per round, tokens/s from the slowest rank's median
    step of each of eager and compiled; the ratio per round and the medians over rounds."""
    from seqpar.bench.compiled import summarize_compiled

    def rank(rounds: list[tuple[list[float], list[float]]], compile_s: float, grad: float) -> dict:
        return {"rounds": [{"eager": e, "compiled": c} for e, c in rounds], "compile_s": compile_s,
                "first_loss": {"eager": 1.0, "compiled": 1.0}, "grad_max_rel_diff": grad}

    per_rank = [rank([([1.0, 3.0], [1.0, 1.0]), ([2.0, 2.0], [4.0, 4.0]), ([1.0, 1.0], [0.5, 0.5])], 9.0, 1e-6),
                rank([([1.0, 1.0], [2.0, 2.0]), ([1.0, 1.0], [1.0, 1.0]), ([2.0, 2.0], [1.0, 1.0])], 7.0, 3e-6)]
    s = summarize_compiled(per_rank, seq_len=100)
    assert s["eager_tokens_per_s_rounds"] == [50.0, 50.0, 50.0]  # slowest medians 2, 2, 2
    assert s["compiled_tokens_per_s_rounds"] == [50.0, 25.0, 100.0]  # slowest medians 2, 4, 1
    assert s["ratio_rounds"] == [1.0, 0.5, 2.0] and s["ratio_median"] == 1.0
    assert s["compiled_tokens_per_s"] == 50.0 and s["compile_s"] == 9.0 and s["grad_max_rel_diff"] == 3e-6
    assert "eager_forward_cpu_s" not in s  # records without the forward's CPU (older JSON): not reported


def test_compiled_summary_reports_the_busiest_ranks_forward_cpu() -> None:
    """The forward's thread CPU per step (``*_forward_cpu_s``): per round the busiest rank's median over
    repeats, then the median over rounds, beside the whole step's. Seen failing: with the rank's minimum
    taken instead of the maximum (the eager figure became 1.0), and with the key read from ``cpu``."""
    from seqpar.bench.compiled import summarize_compiled

    def rank(fwd: list[tuple[list[float], list[float]]]) -> dict:
        rounds = [{"eager": [1.0], "compiled": [1.0], "cpu": {"eager": [5.0], "compiled": [5.0]},
                   "forward_cpu": {"eager": e, "compiled": c}} for e, c in fwd]
        return {"rounds": rounds, "compile_s": 1.0, "first_loss": {}, "grad_max_rel_diff": 0.0}

    per_rank = [rank([([1.0, 3.0], [1.0, 1.0]), ([2.0, 2.0], [4.0, 4.0]), ([1.0, 1.0], [0.5, 0.5])]),
                rank([([1.0, 1.0], [2.0, 2.0]), ([1.0, 1.0], [1.0, 1.0]), ([3.0, 3.0], [1.0, 1.0])])]
    s = summarize_compiled(per_rank, seq_len=100)
    assert s["eager_forward_cpu_s"] == 2.0  # busiest medians per round 2, 2, 3
    assert s["compiled_forward_cpu_s"] == 2.0  # busiest medians per round 2, 4, 1
    assert s["eager_cpu_s"] == 5.0


def test_the_compiled_bench_configures_qwen3_5_as_its_hybrid_pattern_at_the_bench_sizes() -> None:
    """``interleave --compile --model qwen3_5_text``: the benchmarked Qwen3.5 has Qwen3.5's pattern (three
    Gated DeltaNet layers, then attention) at the bench's sizes, not the tiny test model's heads; an unknown
    model type is refused naming a known one. Seen failing: with ``FAMILY_SIZES`` emptied (the tiny model's
    fields under SIZES), transformers refused the config (``num_hidden_layers`` 4, 2 ``layer_types``)."""
    from seqpar.bench.compiled import SIZES, bench_config

    config = bench_config("qwen3_5_text")
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (SIZES["hidden_size"], 4, 32)
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim) == (4, 8, 32)
    with pytest.raises(SystemExit, match="qwen3_5_text"):
        bench_config("no_such_model")
