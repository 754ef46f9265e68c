"""What a new user hits first, followed from README.md and docs/ (session 28's user walk-through): a typo'd
key in any block names the key it meant, `python -m seqpar.bench --help` lists every command the docs name,
and an unswapped model sharing its config object with a swapped one is refused with that cause named."""

from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

from seqpar.bench import __main__ as bench_main
from seqpar.config import ConfigError, SeqParConfig
from seqpar.sequence.batch import shard_batch
from seqpar.swap import swap_attention

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("block", "meant"), [
    ({"size": 2, "mdoe": "ring"}, "mode"),
    ({"size": 2, "tiled_mlps": True}, "tiled_mlp"),
    ({"sp_size": 2}, "size"),                      # accelerate's / DeepSpeed's own word for it (docs/names.md)
    ({"size": 2, "cp_szie": 2}, "cp_size"),         # a misspelt alias finds the alias
    ({"size": 2, "pattern": {"type": "dilated", "segment_length": [4], "dilation_rates": [1]}},
     "segment_lengths"),
    ({"size": 2, "dynamic": {"max_token_per_rank": 64}}, "max_tokens_per_rank"),
])
def test_a_typo_in_the_block_names_the_key_meant(block, meant):
    """Seen failing: before the fix the message listed the 26 allowed keys and left the reader to find the one
    meant ("unknown key(s) ['sp_size'] in sequence_parallel; allowed keys are [...]"), and left out the
    aliases docs/names.md says are accepted."""
    with pytest.raises(ConfigError, match=rf": rename '[^']+' to '{meant}'; allowed keys"):
        SeqParConfig.load(block)


def test_the_block_lists_the_accepted_aliases():
    """Seen failing: before the fix the allowed keys omitted cp_size, context_parallel_degree,
    sequence_parallel_size and cp_comm_type, which the same loader accepts."""
    with pytest.raises(ConfigError, match=r"also accepted: \['cp_size', 'context_parallel_degree', "
                                          r"'sequence_parallel_size', 'cp_comm_type'\]"):
        SeqParConfig.load({"size": 2, "colour": "red"})


def test_a_misspelt_block_name_in_a_deepspeed_json_is_named(tmp_path):
    """Without a "sequence_parallel" key the whole JSON is read as the block; a misspelt block name is then
    one of many unknown keys. Seen failing: no hint before the fix."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_paralel": {"size": 2}}))
    with pytest.raises(ConfigError, match=r": rename 'sequence_paralel' to 'sequence_parallel'; allowed keys"):
        SeqParConfig.load(str(path))


def test_an_unknown_key_with_no_near_name_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        SeqParConfig.load({"size": 2, "colour": "red"})
    assert "rename" not in str(info.value) and "did you mean" not in str(info.value)


def test_launcher_blocks_name_the_key_meant(tmp_path):
    """`launch/train.py --validate-only` on a typo'd `train` or `fsdp` key. Seen failing: the `train` and `fsdp`
    blocks listed their keys without the hint the `model` block and the top level give."""
    base = json.loads((ROOT / "configs" / "fsdp_ring.json").read_text())
    for block, typo, meant in (("train", "setps", "steps"), ("fsdp", "verison", "version")):
        cfg = copy.deepcopy(base)
        cfg[block][typo] = 1
        path = tmp_path / f"{block}.json"
        path.write_text(json.dumps(cfg))
        run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(path),
                              "--validate-only"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert run.returncode != 0, run.stdout
        last = run.stderr.strip().splitlines()[-1]
        assert f"unknown key(s) ['{typo}'] in '{block}'" in last and f"'{meant}'" in last.split("allowed")[0], last


def test_bench_help_lists_every_command():
    """`python -m seqpar.bench --help` is where a user looks for what docs/performance.md names. Seen failing:
    the help listed the five suites only; gpu-check, gpu-perf, ssd, overlap, ring-memory, dynamic and
    interleave are dispatched before the parser runs and were invisible there."""
    dispatched = set(re.findall(r'argv\[:1\] == \["([a-z-]+)"\]', inspect.getsource(bench_main.main)))
    assert dispatched and dispatched == set(bench_main.COMMANDS), (dispatched, set(bench_main.COMMANDS))
    help_text = " ".join(bench_main.build_parser().format_help().split())
    for name in dispatched:
        assert f"{name}:" in help_text, name
    documented = (ROOT / "docs" / "performance.md").read_text()
    for name in ("overlap", "ring-memory", "ssd", "interleave", "gpu-check", "gpu-perf"):
        assert f"`{name}`" in documented and name in dispatched, name


def _tiny_llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2)


def _shared_config_refused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    config = _tiny_llama_config()
    swapped = transformers.LlamaForCausalLM(config)
    other = transformers.LlamaForCausalLM(config)  # e.g. a reference model built from the same object
    swap_attention(swapped, {"size": world_size}, group=dist.group.WORLD)
    ids = torch.randint(0, 64, (1, 8))
    local = shard_batch({"input_ids": ids}, group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"shares its config object with a swapped one.*copy\.deepcopy\(config\)"):
        other(**local)
    # the fix the message names: a model of its own config runs transformers' attention, on every rank
    own = transformers.LlamaForCausalLM(copy.deepcopy(_tiny_llama_config()))
    assert own(input_ids=ids).logits.shape == (1, 8, 64)


def test_a_model_sharing_a_swapped_models_config_is_refused_naming_the_cause(dist_pool):
    """Seen failing: the unswapped model's refusal said its layer "was left out by sequence_parallel.swap",
    which no swap config of the user's did; the cause (one config object for both models) went unnamed."""
    dist_pool.run(2, _shared_config_refused)


@pytest.mark.parametrize("config", ["fsdp_ring", "deepspeed_ring"])
def test_run_cpu_sh_takes_the_port_from_master_port(tmp_path, config):
    """docs/getting-started.md's `NPROC=4 bash launch/run_cpu.sh ...`, a second job on one machine. Seen failing:
    the script started torchrun / deepspeed on their default port 29500 whatever MASTER_PORT said (both launchers
    read their own --master_port flag, not the variable), so a second job collided with the first."""
    for launcher in ("torchrun", "deepspeed"):  # stand-ins that print the command line they were given
        stub = tmp_path / launcher
        stub.write_text('#!/usr/bin/env bash\necho "$@"\n')
        stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "MASTER_PORT": "29613", "NPROC": "2"}
    run = subprocess.run(["bash", str(ROOT / "launch" / "run_cpu.sh"), config, "--steps", "1"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "--master_port 29613 launch/train.py" in run.stdout, run.stdout


def test_launcher_refuses_a_model_without_sdpa_by_name(tmp_path):
    """`"model": {"architecture": "gpt_neo", ...}` (docs/getting-started.md: any transformers model type). Seen
    failing: the launcher built every model with attn_implementation="sdpa", so GPT-Neo died in transformers'
    `from_config` ("GPTNeoForCausalLM does not support an attention implementation through
    torch.nn.functional.scaled_dot_product_attention yet") instead of reaching the swap, which names the module
    that stops it."""
    cfg = {"sequence_parallel": {"size": 1},
           "model": {"architecture": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                     "attention_types": [[["global", "local"], 1]]},
           "train": {"engine": "fsdp", "seq_len": 64, "steps": 1, "seed": 0}, "fsdp": {"version": 2}}
    path = tmp_path / "neo.json"
    path.write_text(json.dumps(cfg))
    env = {**__import__("os").environ, "MASTER_PORT": "0"}
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(path), "--no-progress"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode != 0
    assert "does not support an attention implementation" not in run.stderr, run.stderr[-2000:]
    assert "SwapError" in run.stderr and "'transformer.h.0.attn.attention' (GPTNeoSelfAttention)" in run.stderr, \
        run.stderr[-2000:]


@pytest.mark.parametrize("key", ["sequence_parallel_size", "data_parallel_size"])
def test_validate_only_refuses_deepspeeds_own_mesh_keys(tmp_path, key):
    """docs/names.md: DeepSpeed's top-level `sequence_parallel_size` stays refused (DeepSpeed would build its own
    mesh), and docs/integrations.md: `--validate-only` checks every block before queueing a job. Seen failing:
    `--validate-only` printed "valid" for it; the refusal came only from `initialize`, after the job started."""
    cfg = json.loads((ROOT / "configs" / "deepspeed_ring.json").read_text())
    cfg[key] = 2
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(path),
                          "--validate-only"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode != 0, run.stderr[-1000:]
    assert f"has '{key}', which makes DeepSpeed build its own mesh" in run.stderr, run.stderr[-1000:]
