"""What session 28's new-user walk reported and left (reports/usr28.md, "Reported, not fixed"): `--validate-only`
runs the swap's refusals on the model it would build; a config error raised after the process groups start is one
`train.py: error:` line per rank and exit 2, not a traceback per rank; `swap_attention` refuses a `size` that
contradicts its SP group by name."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from launch_module import train_module

from seqpar.sequence.batch import shard_batch
from seqpar.swap import SwapError, swap_attention

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p) for p in (ROOT / "configs").glob("*.json"))

# GPT-Neo computes its own attention scores: the swap finds nothing to route and its probe names the modules.
NEO_MODEL = {"architecture": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
             "attention_types": [[["global", "local"], 1]]}
NEO_REFUSAL = "swap_attention found nothing to swap in GPTNeoForCausalLM"
NEO_MODULE = "'transformer.h.0.attn.attention' (GPTNeoSelfAttention)"


def _neo_config(path: Path, size: int) -> str:
    path.write_text(json.dumps({"sequence_parallel": {"size": size}, "model": NEO_MODEL,
                                "train": {"engine": "fsdp", "seq_len": 64, "steps": 1, "seed": 0},
                                "fsdp": {"version": 2}}))
    return str(path)


# ----------------------------------------------------------------------------- 1. --validate-only runs the swap
@pytest.mark.parametrize("config", CONFIGS, ids=[Path(c).stem for c in CONFIGS])
def test_validate_only_passes_every_shipped_config(config, capsys):
    """Every shipped config builds its model and passes the swap's checks in `--validate-only` (in process: the
    same `main` the command runs), with no process group made. Seen failing (fsdp_ring, deepspeed_ring, ...) with the
    swap's size check comparing `size` against a world of 1 when there is no group: every config of size 2 was
    refused by its own validation."""
    assert train_module().main(["--config", config, "--validate-only"]) == {}
    assert f"{config}: valid" in capsys.readouterr().out
    assert not dist.is_initialized()


def test_validate_only_refuses_a_model_the_swap_refuses(tmp_path):
    """`--validate-only` on a GPT-Neo config prints the swap's refusal, naming the module, and exits 2 with one
    `train.py: error:` line and no traceback. Seen failing: it printed "<config>: valid" and exited 0 (the model was
    never built, so the swap's refusal came only once the job ran)."""
    path = _neo_config(tmp_path / "neo.json", 1)
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", path, "--validate-only"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, (run.stdout, run.stderr[-2000:])
    assert "valid" not in run.stdout and "Traceback" not in run.stderr, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("train.py: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"train.py: error: SwapError: {NEO_REFUSAL}"), run.stderr[-2000:]
    assert NEO_MODULE in run.stderr
    with pytest.raises(SwapError, match=NEO_REFUSAL):  # the in-process form, validate(), raises it
        train_module().validate(["--config", path])



def test_the_refusals_advice_validates(tmp_path):
    """The refusal's own advice works: GPT-Neo at sequence_parallel.size 1 with swap "none" is valid (at size 1
    with the default swap the launcher still swaps and the probe refuses it). Seen failing: the message said
    "(sequence_parallel.size 1, no swap)" with no key to set, and size 1 alone is refused (the test's first half)."""
    refused = train_module()
    with pytest.raises(SwapError, match='size 1 and swap "none"'):
        refused.validate(["--config", _neo_config(tmp_path / "size1.json", 1)])
    path = tmp_path / "none.json"
    config = json.loads(Path(_neo_config(path, 1)).read_text())
    config["sequence_parallel"]["swap"] = "none"
    path.write_text(json.dumps(config))
    train_module().validate(["--config", str(path)])

# ----------------------------------------------------------------------------- 2. errors after the groups start
def _cli_on_rank(rank: int, world: int, argv: list[str]) -> tuple[object, str]:
    """``launch/train.py``'s command on this rank: its exit code and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train_module().cli(argv)
            code: object = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def test_a_config_error_after_the_groups_start_is_one_line_per_rank(dist_pool, tmp_path):
    """Two errors that only the job can see, on 2 gloo ranks: the swap refusing GPT-Neo (after the groups start)
    and `--sp-size 3` on a world of 2. Each rank exits 2 with one `train.py: error: [rank R]` line, the text
    `--validate-only` prints, and no traceback; no rank hangs (the pool's timeout). Seen failing: each rank raised
    the exception out of `main` (a Python traceback per rank; the launcher had no handler)."""
    neo = _neo_config(tmp_path / "neo.json", 2)
    with pytest.raises(SwapError) as info:
        train_module().validate(["--config", neo])
    cases = [(["--config", neo, "--no-progress"], f"SwapError: {info.value}"),
             (["--config", str(ROOT / "configs" / "fsdp_ring.json"), "--sp-size", "3", "--steps", "1",
               "--no-progress"],
              "ValueError: world size 2 is not divisible by sequence_parallel.size 3")]
    for argv, expected in cases:
        results = dist_pool.run(2, _cli_on_rank, argv, timeout=300)
        for rank, (code, err) in enumerate(results):
            assert code == 2, (rank, code, err[-2000:])
            assert "Traceback" not in err, err[-2000:]
            errors = [line for line in err.splitlines() if line.startswith("train.py: error: ")]
            assert len(errors) == 1, err[-2000:]
            assert err[err.index("train.py: error: "):].startswith(f"train.py: error: [rank {rank}] {expected}"), \
                err[-2000:]


def test_a_bug_keeps_its_traceback(monkeypatch):
    """A ValueError that no seqpar check raised (here torch's) is a bug: the command re-raises it, traceback and
    all, instead of turning it into a config error. Seen failing with the source check of `config_error_message`
    removed: torch's error became `train.py: error:` and exit 2."""
    train = train_module()

    def broken(args):
        torch.nn.Conv1d(1, 1, 1, padding_mode="sideways")  # torch raises ValueError

    monkeypatch.setattr(train, "build_plan", broken)
    with pytest.raises(ValueError, match="padding_mode"):
        train.cli(["--config", CONFIGS[0]])
    assert train.config_error_message(ValueError("not raised")) is None  # no traceback: not a seqpar raise


# ----------------------------------------------------------------------------- 3. a contradicting size
def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).double()


def _size_checked(rank: int, world: int) -> None:
    import seqpar

    manager = seqpar.init_process_groups(sp_size=2)
    for group in (None, manager.sp_group):  # the default manager's group, or the one passed
        with pytest.raises(SwapError, match=r"sequence_parallel\.size = 4 contradicts the SP group .* of 2 rank"):
            swap_attention(_llama(), {"size": 4}, group=group)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    reference = _llama()(input_ids=ids).logits  # one process, float64: (1, 16, vocab)
    mine = reference[:, 8 * rank:8 * (rank + 1)]  # contiguous sharding (undeclared): 8 positions per rank
    for config in ({"size": 2}, {}, {"mode": "ring"}):  # a matching size, and none (1, the default: not set)
        model = _llama()
        swap_attention(model, config)
        local = shard_batch({"input_ids": ids}, group=manager.sp_group)
        torch.testing.assert_close(model(**local).logits, mine, rtol=1e-10, atol=1e-10)


def test_a_size_that_contradicts_the_group_is_refused(dist_pool):
    """`swap_attention(model, {"size": 4})` under a manager of SP size 2, on 2 gloo ranks: a SwapError naming
    `size` and the group's size, on every rank; a matching size and an absent one still swap, and the swapped
    model's logits equal one process's (float64). Seen failing: size 4 swapped silently onto the size-2 group."""
    dist_pool.run(2, _size_checked, timeout=300)
