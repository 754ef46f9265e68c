"""``python -m seqpar.bench gpu-check [--out DIR] [--stages a,b]``: what a session holding a GPU runs first.

Every stage runs in its own subprocess under its own time limit, so a crash, a hang or an
out-of-memory in one is recorded and the next still runs. The summary (``DIR/gpu_check.json`` and
``DIR/gpu_check.md``, the markdown ready to paste into BENCHMARKS.md) names the device, torch, CUDA
and cuDNN versions and, per stage, pass/fail, its time and the tail of its output.

Stages (:data:`STAGES`, in order):

- ``choice``: the kernel seqpar picks (:mod:`seqpar.kernels.backends`) against torch's own
  ``torch._fused_sdp_choice`` on this device, over dtypes, head dims, GQA and causal blocks.
- ``cuda-tests``: ``pytest tests/test_cuda.py`` (kernels vs float64 SDPA in fp16/bf16/fp32 on every
  backend, GQA/MQA, odd head dims, the ThreadRing ring on one GPU).
- ``attention``: the attention suite's CUDA preset (``--quick``: S = 8K, 32K; cases that need more
  GPUs than the machine has are listed with the reason).
- ``simulate``: one rank of an 8-rank ring over 1M tokens (``attention --simulate 1048576:8``).
- ``dilated``: dilated attention forward+backward at 32K, 128K, 512K tokens, then doubling to the
  longest that fits.
- ``fairscale``: FairScale FSDP training steps of a tiny swapped Llama against the plain model
  (skipped, with the reason, when fairscale does not import: carry its wheel, see docs/gpu-runbook.md).
- ``peers``: the peers suite (PyTorch ``context_parallel`` among them) at P = 1 and 2.
- ``host-sync``: steady-state training steps of a tiny swapped Llama under
  ``torch.cuda.set_sync_debug_mode("error")``; lists every synchronising call site it saw.
- ``mixer-kernels``: ``mixer_kernels="auto"`` against ``"torch"`` (:mod:`seqpar.mixers.kernels`) on tiny
  hybrid models, for each Triton path that imports here: flash-linear-attention (GDN, lightning) and
  mamba_ssm's SSD Triton kernels (installable without building its CUDA extension); skipped, with the
  reason, when none imports. Mamba v1's selective scan and causal_conv1d need compiled CUDA extensions
  and stay unproven.

The lent machines stop a command after 10 minutes, so the limits of the first five stages add up to
8.5 minutes and those of the last three to 9.5: run them as two calls (docs/gpu-runbook.md), and
``mixer-kernels`` (2 minutes) on its own or with a short one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["STAGES", "Stage", "build_parser", "lm_step", "main", "one_rank_group", "render_markdown", "tiny_llama"]

NO_CUDA = (
    "gpu-check: no CUDA device (torch.cuda.is_available() is False, torch {torch}); run it on a "
    "machine with an NVIDIA GPU and a CUDA build of torch (see docs/gpu-runbook.md)."
)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The checkout gpu-check runs from (tests/ lives there; an editable install keeps it)."""


@dataclass(frozen=True)
class Stage:
    """One independent step of the check."""

    name: str
    limit_s: int
    """Wall-clock limit of the stage's subprocess."""
    what: str


STAGES = (
    Stage("choice", 60, "seqpar's kernel choice vs torch._fused_sdp_choice on this device"),
    Stage("cuda-tests", 180, "pytest tests/test_cuda.py"),
    Stage("simulate", 150, "attention --simulate 1048576:8 (one rank of an 8-rank ring, 1M tokens)"),
    Stage("host-sync", 60, "set_sync_debug_mode('error') around steady-state steps of a swapped model"),
    Stage("fairscale", 60, "FairScale FSDP steps of a swapped Llama vs the plain model"),
    Stage("attention", 240, "attention suite, CUDA preset (--quick)"),
    Stage("dilated", 150, "dilated attention at 32K/128K/512K and the longest that fits"),
    Stage("peers", 180, "peers suite (torch context_parallel, DeepSpeed Ulysses) at P = 1, 2"),
    Stage("mixer-kernels", 120, 'mixer_kernels "auto" (flash-linear-attention, mamba_ssm SSD Triton) vs "torch"'),
)
_BY_NAME = {s.name: s for s in STAGES}


# --------------------------------------------------------------------------- stages run in-process
_DEVICE = "cuda"  # the in-process stages' device (a CPU smoke run of their logic patches it)


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A seeded 2-layer Llama (GQA 4/2 heads, vocab 256) on the check's device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attention_dropout=0.0, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(_DEVICE)


def one_rank_group() -> Any:
    """A one-process NCCL world (a GPU cannot host two NCCL ranks) and seqpar's groups on it."""
    import seqpar

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    return seqpar.init_process_groups(1, backend="nccl")


def lm_step(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One next-token training step; returns the loss (a device tensor)."""
    # no labels= (HF's own loss is not what is checked) and no .item(): nothing here syncs by itself
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def stage_choice() -> dict[str, Any]:
    """Every (dtype, head_dim, heads, causal) block: seqpar's kernel vs torch's own choice."""
    from seqpar.kernels.backends import BlockSpec, choose_backend, device_caps

    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    caps = device_caps(torch.device(_DEVICE))
    rows, differ = [], []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (40, 64, 100, 128, 256):
            for hq, hkv in ((8, 8), (8, 2)):
                for causal in (False, True):
                    q = torch.randn(1, hq, 256, d, device=_DEVICE, dtype=dtype, requires_grad=True)
                    k = torch.randn(1, hkv, 256, d, device=_DEVICE, dtype=dtype, requires_grad=True)
                    ours = choose_backend(BlockSpec.of(q, k, causal), caps).value
                    theirs = names.get(int(torch.ops.aten._fused_sdp_choice(
                        q, k, k, None, 0.0, causal, enable_gqa=hkv != hq)), "?")
                    row = {"dtype": str(dtype).replace("torch.", ""), "head_dim": d, "heads": f"{hq}/{hkv}",
                           "causal": causal, "seqpar": ours, "torch": theirs}
                    rows.append(row)
                    if ours != theirs:
                        differ.append(row)
    unexplained = [r for r in differ if not _explained(r)]
    return {"passed": not unexplained, "caps": dataclasses.asdict(caps), "rows": rows, "differ": differ,
            "unexplained": unexplained}


def _explained(row: dict[str, Any]) -> bool:
    # deliberate differences: seqpar keeps cuDNN to head_dim <= 128 (torch may take 256 on sm90),
    # and expands GQA K/V for the efficient kernel where a torch build may refuse GQA and use math
    gqa = row["heads"].split("/")[0] != row["heads"].split("/")[1]
    return (row["torch"] == "cudnn" and row["head_dim"] > 128) or (
        gqa and row["torch"] == "math" and row["seqpar"] == "efficient")


SYNC_WARNING = "called a synchronizing CUDA operation"
"""What torch warns (or raises) at each synchronising call under ``set_sync_debug_mode``."""


def _sync_check(step: Callable[[], Any], warmup: int, steps: int) -> dict[str, Any]:
    """``step`` in steady state: every call site that synchronised under 'warn' (each with the Python
    stack that led to it: a C++ warning carries only the innermost frame), then 'error' as the verdict."""
    import warnings

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    sites: dict[str, int] = {}
    stacks: dict[str, str] = {}

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        # torch's own wording (c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync); not its one-time notice
        # "Synchronization debug mode is a prototype feature ...", which the first switch to "warn" raises
        if SYNC_WARNING not in str(message):
            return
        where = f"{os.path.relpath(filename)}:{lineno}"
        sites[where] = sites.get(where, 0) + 1
        # the frames above this hook: which call of the step (or of torch around it) synchronised
        stacks.setdefault(where, "".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
            torch.cuda.set_sync_debug_mode(0)  # a sync still pending from the steps surfaces here
        finally:
            torch.cuda.set_sync_debug_mode(0)
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            step()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    except RuntimeError as e:
        error = "".join(traceback.format_exception_only(type(e), e)).strip()
        error += "\n" + "".join(traceback.format_tb(e.__traceback__)[-3:])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"passed": error is None and not sites, "sync_sites": sites, "steps": steps, "stacks": stacks,
            "error": error}


def stage_host_sync(warmup: int = 2, steps: int = 3) -> dict[str, Any]:
    """No host sync in steady state: (1) the ring algorithm as one rank of P = 4 (real kernels,
    loopback transfers on a side stream), per causal/zigzag and full/contiguous; (2) training steps of
    a swapped tiny Llama. A single GPU holds one NCCL rank only, so (2) runs at SP = 1, where
    seqpar.attention calls SDPA directly: the cross-rank input check needs a multi-GPU run."""
    from seqpar.attn.ring import AttentionOptions, RingAttention
    from seqpar.comm.loopback import LoopbackComm
    from seqpar.swap import swap_attention

    checks: dict[str, Any] = {}
    g = torch.Generator(device=_DEVICE).manual_seed(0)
    q, dout = (torch.randn(1, 8, 4096, 128, device=_DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 4096, 128, device=_DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for causal, sharding, chunks in ((True, "zigzag", 1), (False, "contiguous", 2)):
        opts = AttentionOptions(causal=causal, scale=128**-0.5, sharding=sharding, head_chunks=chunks)

        def ring_step(opts: AttentionOptions = opts) -> None:
            RingAttention.apply(q, k, v, LoopbackComm(1, 4), opts).backward(dout)
            q.grad = k.grad = v.grad = None

        checks[f"ring rank 1 of 4, causal={causal}, {sharding}, head_chunks={chunks}"] = _sync_check(
            ring_step, warmup, steps)

    manager = one_rank_group()
    model = tiny_llama()
    report = swap_attention(model, {"mode": "ring"}, group=manager.sp_group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (1, 512), device=_DEVICE)
    name = "swapped LlamaForCausalLM (2 layers, 4/2 heads, S=512), SGD step, SP=1"
    checks[name] = _sync_check(lambda: lm_step(model, ids, opt), warmup, steps)
    checks[name]["swap"] = str(report)
    passed = all(c["passed"] for c in checks.values()) and len(report) > 0
    return {"passed": passed, "checks": checks,
            "error": None if passed else "; ".join(f"{n}: {c['error'] or c['sync_sites']} {c['stacks']}"
                                                   for n, c in checks.items() if not c["passed"])}


def stage_dilated(seq_lens: Sequence[int] = (32768, 131072, 524288), budget_s: float = 150.0) -> dict[str, Any]:
    """The fixed lengths, then doubling from the last until out of memory or out of time."""
    from seqpar.bench.dilated import bench_dilated

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for s in seq_lens:
        rows += bench_dilated([s], dtype=torch.bfloat16, device=_DEVICE, repeats=1)
    longest, s, failed = seq_lens[-1], seq_lens[-1], None
    while time.perf_counter() - t0 < budget_s / 2:  # the next length costs about twice the last
        s *= 2
        try:
            rows += bench_dilated([s], dtype=torch.bfloat16, device=_DEVICE, repeats=1)
            longest = s
        except torch.cuda.OutOfMemoryError as e:
            failed = f"S={s}: out of memory ({str(e).splitlines()[0][:160]})"
            break
        finally:
            torch.cuda.empty_cache()
    return {"passed": True, "rows": rows, "longest": longest, "stopped": failed or "time budget"}


MIXER_KERNEL_PATHS: dict[str, tuple[str, str]] = {
    "gdn": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "lightning": ("fla.ops.simple_gla", "chunk_simple_gla"),
    "mamba2": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
}
"""The Triton paths the ``mixer-kernels`` stage proves, per mixer family: (module, function)."""

MIXER_KERNEL_RTOL = 2e-3
"""``mixer-kernels``: the largest ``max|auto - torch| / max|torch|`` allowed per tensor (loss, every
gradient; a gradient's scale floored at 1e-3 of the model's largest), fp32 models: the kernels' fp32
accumulation order (and TF32 in their matmuls) differs."""


def _on_kernel_device() -> bool:
    """Whether the check's device is one the mixer kernels run on (a CPU test of the stage patches it)."""
    return torch.device(_DEVICE).type == "cuda" and torch.cuda.is_available()


def _import_problem(module: str, name: str) -> str | None:
    """None when ``module.name`` imports here, else why not (a missing package, or a broken build)."""
    try:
        getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - an ImportError, or a Triton / CUDA mismatch at import
        return f"{module}.{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def _tiny_hybrid(family: str) -> torch.nn.Module:
    """A seeded 2-layer fp32 model whose first layer is ``family``'s mixer, on the check's device; dims
    of 32+ (the Triton kernels' tiles want at least 16)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, use_cache=False)
    if family == "gdn":
        cfg = transformers.Qwen3NextConfig(**common, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
                                           linear_key_head_dim=32, linear_value_head_dim=32,
                                           layer_types=["linear_attention", "full_attention"], num_experts=2,
                                           num_experts_per_tok=1, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64)
    elif family == "lightning":
        cfg = transformers.MiniMaxConfig(**common, head_dim=32, layer_types=["linear_attention", "full_attention"],
                                         block_size=64, num_local_experts=2, num_experts_per_tok=1)
    elif family == "mamba2":
        cfg = transformers.BambaConfig(**common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=64,
                                       mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=64)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(_DEVICE)


def _mixer_kernels_run(family: str, mixer_kernels: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss and every gradient of the tiny ``family`` model swapped (SP = 1) with ``mixer_kernels``."""
    from seqpar.swap import swap_attention

    model = _tiny_hybrid(family)
    report = swap_attention(model, {"mixer_kernels": mixer_kernels})
    if not any(m.route == "mixer" for m in report):
        raise AssertionError(f"{family}: no mixer swapped ({report})")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None})
    return out


def stage_mixer_kernels(seq_len: int = 256) -> dict[str, Any]:
    """Each importable Triton mixer path (:data:`MIXER_KERNEL_PATHS`): a tiny fp32 model swapped with
    ``mixer_kernels="auto"`` (the kernel, its calls counted) against ``"torch"``, same weights and batch:
    loss and every gradient within :data:`MIXER_KERNEL_RTOL`. ``passed`` is None (skipped) with the
    reason when no path imports or there is no CUDA device."""
    if not _on_kernel_device():
        return {"passed": None, "skipped": "no CUDA device: the mixer kernels run on CUDA only"}
    problems = {family: _import_problem(*path) for family, path in MIXER_KERNEL_PATHS.items()}
    ready = [family for family, problem in problems.items() if problem is None]
    if not ready:
        return {"passed": None, "skipped": "no mixer kernel imports here (pip install flash-linear-attention; "
                                           "mamba_ssm's SSD Triton kernels without its CUDA extension): "
                                           + "; ".join(f"{f}: {p}" for f, p in problems.items())}
    results: dict[str, Any] = {}
    g = torch.Generator(device=_DEVICE).manual_seed(0)
    ids = torch.randint(0, 256, (1, seq_len), device=_DEVICE, generator=g)
    for family in ready:
        module, name = MIXER_KERNEL_PATHS[family]
        kernel_module = importlib.import_module(module)
        kernel = getattr(kernel_module, name)
        calls: list[int] = []

        def counted(*args: Any, _kernel: Any = kernel, _calls: list[int] = calls, **kwargs: Any) -> Any:
            _calls.append(1)
            return _kernel(*args, **kwargs)

        setattr(kernel_module, name, counted)  # seqpar looks the kernel up at each call
        try:
            ref = _mixer_kernels_run(family, "torch", ids)
            torch_calls = len(calls)
            got = _mixer_kernels_run(family, "auto", ids)
        finally:
            setattr(kernel_module, name, kernel)
        # each tensor on its own scale, floored at 1e-3 of the model's largest gradient: a gradient that is
        # ~0 in exact arithmetic (a top-1 router's gate) is rounding noise on both paths
        top = max(float(v.abs().max()) for k, v in ref.items() if k != "loss")
        errors = {k: float((got[k] - ref[k]).abs().max()) / max(float(ref[k].abs().max()), 1e-3 * top, 1e-30)
                  for k in ref}
        worst = max(errors, key=errors.get)
        results[family] = {"kernel": f"{module}.{name}", "calls_auto": len(calls) - torch_calls,
                           "calls_torch": torch_calls, "worst": worst, "worst_rel_error": errors[worst],
                           "loss_rel_error": errors["loss"],
                           "passed": torch_calls == 0 and len(calls) > 0 and errors[worst] <= MIXER_KERNEL_RTOL}
    passed = all(r["passed"] for r in results.values())
    return {"passed": passed, "results": results, "not_importable": {f: p for f, p in problems.items() if p},
            "error": None if passed else f"auto vs torch beyond {MIXER_KERNEL_RTOL} or kernel not called: {results}"}


_IN_PROCESS: dict[str, Callable[[], dict[str, Any]]] = {
    "choice": stage_choice, "host-sync": stage_host_sync, "dilated": stage_dilated,
    "mixer-kernels": stage_mixer_kernels,
}


def _bench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "seqpar.bench", *args, "--no-progress"]


def _command(stage: Stage, out_dir: str, result_json: str) -> list[str]:
    suites = os.path.join(out_dir, "suites")
    if stage.name in _IN_PROCESS:
        return [sys.executable, "-m", "seqpar.bench.gpu_check", "--run-stage", stage.name, "--json", result_json]
    if stage.name == "fairscale":  # an engine adapter: lives above the core, in launch/
        return [sys.executable, os.path.join(REPO_ROOT, "launch", "fairscale_check.py"), "--json", result_json]
    if stage.name == "cuda-tests":
        return [sys.executable, "-m", "pytest", "-q", "-rfE", os.path.join(REPO_ROOT, "tests", "test_cuda.py"),
                "-p", "no:cacheprovider"]
    if stage.name == "attention":
        return _bench_cmd("attention", "--quick", "--out", os.path.join(suites, "attention"))
    if stage.name == "simulate":
        return _bench_cmd("attention", "--methods", "sdpa", "--seq-lens", "8192", "--worlds", "1",
                          "--simulate", "1048576:8", "--out", os.path.join(suites, "simulate"))
    if stage.name == "peers":
        return _bench_cmd("peers", "--quick", "--worlds", "1,2", "--out", os.path.join(suites, "peers"))
    raise ValueError(f"unknown stage {stage.name!r}")


# ------------------------------------------------------------------------------------ the runner
def environment() -> dict[str, Any]:
    """Device, versions and what this process can import (for the summary's header)."""
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1), "gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
    }
    for name in ("transformers", "fairscale", "deepspeed"):
        spec = importlib.util.find_spec(name)
        info[name] = importlib.import_module(name).__version__ if spec is not None else None
    return info


def run_stage(stage: Stage, out_dir: str, scale: float = 1.0) -> dict[str, Any]:
    """Run one stage in a subprocess under its limit; never raises."""
    with tempfile.TemporaryDirectory() as tmp:
        result_json = os.path.join(tmp, "result.json")
        cmd = _command(stage, out_dir, result_json)
        limit = max(1, int(stage.limit_s * scale))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False, cwd=REPO_ROOT)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            output = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
            output += f"\n[gpu-check: stopped after {limit} s]"
        row: dict[str, Any] = {"stage": stage.name, "what": stage.what, "limit_s": limit,
                               "wall_s": round(time.perf_counter() - t0, 1), "returncode": rc,
                               "command": " ".join(cmd), "output_tail": output[-3000:]}
        details = None
        if os.path.exists(result_json):
            with open(result_json) as f:
                details = json.load(f)
            row["details"] = details
    if rc is None:
        row["status"] = "timeout"
    elif details is not None and details.get("passed") is None:
        row["status"] = "skipped"
    elif rc == 0 and (details is None or details.get("passed")) and _ran_tests(stage, output):
        row["status"] = "pass"
    else:
        row["status"] = "fail"
    return row


def _ran_tests(stage: Stage, output: str) -> bool:
    # pytest exits 0 when every test is skipped: on a GPU machine that means CUDA was not seen
    return stage.name != "cuda-tests" or " passed" in output


def _in_process_main(name: str, result_json: str) -> int:
    try:
        result = _IN_PROCESS[name]()
    except Exception as e:  # recorded, so that the summary says why
        result = {"passed": False, "error": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}
    with open(result_json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if result.get("passed") is not False else 1


def render_markdown(summary: dict[str, Any]) -> str:
    """The summary as a BENCHMARKS.md section."""
    env = summary["environment"]
    lines = [
        f"### gpu-check on {env['device']} (sm{''.join(map(str, env['capability']))}, {env['memory_gib']} GiB, "
        f"{env['gpus']} GPU(s))",
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, Python {env['python']}, "
        f"transformers {env['transformers']}, fairscale {env['fairscale']}, deepspeed {env['deepspeed']}; "
        f"{summary['date']}; `{summary['command']}`",
        "",
        "| stage | status | time (s) | what |",
        "| --- | --- | ---: | --- |",
    ]
    for r in summary["stages"]:
        lines.append(f"| {r['stage']} | {r['status']} | {r['wall_s']} | {r['what']} |")
    for r in summary["stages"]:
        d = r.get("details") or {}
        note = d.get("skipped") or d.get("error") or (d.get("unexplained") and f"differs from torch: {d['unexplained']}")
        if r["status"] != "pass" or note:
            tail = (note or r["output_tail"]).strip().splitlines()[-12:]
            lines += ["", f"**{r['stage']}** ({r['status']}):", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m seqpar.bench gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="DIR", default="gpu-check", help="summary and suite outputs (default ./gpu-check)")
    p.add_argument("--stages", default=",".join(s.name for s in STAGES),
                   help=f"comma list, in order (default all: {','.join(s.name for s in STAGES)})")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every stage's time limit")
    p.add_argument("--run-stage", choices=sorted(_IN_PROCESS), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stages; 0 when every stage that ran passed (or was skipped), 1 otherwise, 2 without CUDA."""
    args = build_parser().parse_args(argv)
    if args.run_stage:
        return _in_process_main(args.run_stage, args.json)
    if not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__), file=sys.stderr)
        return 2
    names = [n.strip() for n in args.stages.split(",") if n.strip()]
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown:
        print(f"gpu-check: unknown stage(s) {unknown}; choose from {list(_BY_NAME)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    summary: dict[str, Any] = {
        "command": " ".join(["python -m seqpar.bench gpu-check", *(argv if argv is not None else sys.argv[2:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": environment(), "stages": [],
    }
    for name in names:
        print(f"gpu-check: {name} ...", flush=True)
        row = run_stage(_BY_NAME[name], args.out, args.time_scale)
        summary["stages"].append(row)
        print(f"gpu-check: {name}: {row['status']} ({row['wall_s']} s)", flush=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:  # after every stage: partial results survive
            json.dump(summary, f, indent=1, default=str)
    md = render_markdown(summary)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all(r["status"] in ("pass", "skipped") for r in summary["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
