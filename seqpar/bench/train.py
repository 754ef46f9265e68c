"""The ``train`` suite: tokens/s and peak memory per rank of the main job at SP = 1, 2, 4.

It runs ``launch/train.py`` (the repository's training script: a small Llama on a long-range recall
task, under DeepSpeed or FSDP) once per SP size and reads the metrics JSON the script writes
(``tokens_per_s`` over the steady-state steps, ``peak_mem_bytes`` per rank and what kind of figure
that is, per-step ``loss``). Launchers:

- ``torchrun`` (default): ``python -m torch.distributed.run --nproc_per_node SP launch/train.py ...``
- ``deepspeed``: ``deepspeed --num_gpus SP launch/train.py ...`` (for the DeepSpeed configs)

with ``OMP_NUM_THREADS=1`` (one thread per rank, as in the other suites). The suite is listed as not
run, with the reason, when ``launch/train.py`` or the config is missing or the launcher is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["TrainBenchConfig", "repo_root", "command", "configure", "count", "run", "render", "plots"]


@dataclass(frozen=True)
class TrainBenchConfig:
    """What one ``train`` run covers."""

    config: str
    """Path of the launch/train.py config (relative paths are taken from the repository root)."""
    sp_sizes: list[int]
    seq_len: int
    steps: int
    seed: int = 0
    launcher: str = "torchrun"
    timeout_s: float = 900.0


def repo_root() -> Path:
    """The checkout this package runs from (``seqpar/`` lives in it)."""
    return Path(__file__).resolve().parents[2]


def command(cfg: TrainBenchConfig, sp: int, metrics_out: str) -> list[str]:
    """The launch command of one run."""
    root = repo_root()
    script = str(root / "launch" / "train.py")
    config = cfg.config if os.path.isabs(cfg.config) else str(root / cfg.config)
    flags = ["--config", config, "--sp-size", str(sp), "--seq-len", str(cfg.seq_len), "--steps", str(cfg.steps),
             "--seed", str(cfg.seed), "--metrics-out", metrics_out, "--no-progress", "--log-level", "WARNING"]
    if cfg.launcher == "deepspeed":
        return [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(sp), script, *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp), script, *flags]


def _problem(cfg: TrainBenchConfig) -> str | None:
    root = repo_root()
    if not (root / "launch" / "train.py").exists():
        return f"{root / 'launch' / 'train.py'} does not exist (installed without the repository?)"
    config = cfg.config if os.path.isabs(cfg.config) else str(root / cfg.config)
    if not os.path.exists(config):
        return f"config {config} does not exist"
    if cfg.launcher == "deepspeed" and shutil.which("deepspeed") is None:
        return "the deepspeed launcher is not on PATH (pip install deepspeed)"
    return None


def configure(args: Any) -> TrainBenchConfig:
    """A :class:`TrainBenchConfig` from the CLI's resolved arguments."""
    return TrainBenchConfig(config=args.train_config, sp_sizes=list(args.sp_sizes), seq_len=args.train_seq_len,
                            steps=args.train_steps, seed=args.seed, launcher=args.train_launcher)


def count(cfg: TrainBenchConfig) -> int:
    """Progress steps of :func:`run`."""
    return len(cfg.sp_sizes)


def run(cfg: TrainBenchConfig, progress: Callable[[str], None], *, pools: Any = None) -> dict[str, Any]:
    """One training run per SP size; returns the payload (failed or skipped runs carry the reason).

    ``pools`` is not used: each run is a job of its own launcher (``torchrun``/``deepspeed``), as a user's is."""
    rows: list[dict[str, Any]] = []
    why = _problem(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="seqpar-bench-train-") as tmp:
        for sp in cfg.sp_sizes:
            progress(f"train SP={sp}")
            row: dict[str, Any] = {"sp_size": sp, "seq_len": cfg.seq_len, "steps": cfg.steps}
            if why:
                rows.append({**row, "status": "skipped", "reason": why})
                continue
            metrics_path = os.path.join(tmp, f"sp{sp}.json")
            cmd = command(cfg, sp, metrics_path)
            row["command"] = " ".join(cmd)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=repo_root(), env=env, capture_output=True, text=True,
                                      timeout=cfg.timeout_s)
            except subprocess.TimeoutExpired:
                rows.append({**row, "status": "failed", "reason": f"timed out after {cfg.timeout_s:.0f} s"})
                continue
            row["wall_s"] = time.perf_counter() - t0
            if proc.returncode != 0 or not os.path.exists(metrics_path):
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                rows.append({**row, "status": "failed", "reason": f"exit {proc.returncode}: " + " | ".join(tail)})
                continue
            with open(metrics_path) as f:
                m = json.load(f)
            rows.append({**row, "status": "ok", "tokens_per_s": m["tokens_per_s"],
                         "peak_mem_bytes": m["peak_mem_bytes"], "peak_mem_kind": m.get("peak_mem_kind"),
                         "loss": m["loss"], "step_seconds": m.get("step_seconds"), "engine": m.get("engine"),
                         "mode": m.get("mode"), "sharding": m.get("sharding"), "world_size": m.get("world_size")})
    base = next((r for r in rows if r["status"] == "ok" and r["sp_size"] == 1), None)
    for r in rows:
        if r["status"] == "ok" and base is not None:
            r["speedup_vs_sp1"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["mem_vs_sp1"] = max(r["peak_mem_bytes"]) / max(base["peak_mem_bytes"])
    return {"config": asdict(cfg), "results": rows}


def render(payload: dict[str, Any]) -> str:
    """Tokens/s and peak memory per rank per SP size."""
    from seqpar.bench.report import fmt_bytes, format_table

    rows = []
    for r in payload["results"]:
        if r["status"] != "ok":
            continue
        rows.append({"sp": r["sp_size"], "engine": r.get("engine"), "mode": r.get("mode"), "S": r["seq_len"],
                     "tps": f"{r['tokens_per_s']:.0f}", "x": r.get("speedup_vs_sp1"),
                     "mem": fmt_bytes(max(r["peak_mem_bytes"])), "mx": r.get("mem_vs_sp1"),
                     "loss": f"{r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}"})
    cols = [("SP", "sp"), ("engine", "engine"), ("mode", "mode"), ("seq_len", "S"), ("tokens/s", "tps"),
            ("x SP=1", "x"), ("peak/rank", "mem"), ("mem x SP=1", "mx"), ("loss", "loss")]
    c = payload["config"]
    out = [f"train: {c['config']} via {c['launcher']}, {c['steps']} steps (tokens/s over steps after the first)",
           format_table(rows, cols)]
    kinds = {r.get("peak_mem_kind") for r in payload["results"] if r["status"] == "ok"}
    if kinds:
        out.append("peak memory is: " + "; ".join(sorted(k for k in kinds if k)))
    for r in payload["results"]:
        if r["status"] != "ok":
            out.append(f"SP={r['sp_size']} {r['status']}: {r['reason']}")
    return "\n".join(out)


def plots(payload: dict[str, Any], out_dir: str) -> list[str]:
    """Tokens/s and peak memory per rank against SP size."""
    from seqpar.bench.report import plot_series

    ok = [r for r in payload["results"] if r["status"] == "ok"]
    paths = [
        plot_series(os.path.join(out_dir, "train_tokens_per_s.png"),
                    {"tokens/s": [(r["sp_size"], r["tokens_per_s"]) for r in ok]},
                    title=f"launch/train.py throughput, seq_len {payload['config']['seq_len']}",
                    xlabel="SP size (ranks)", ylabel="tokens/s"),
        plot_series(os.path.join(out_dir, "train_peak_memory.png"),
                    {"peak per rank": [(r["sp_size"], max(r["peak_mem_bytes"]) / 2**20) for r in ok]},
                    title="launch/train.py peak memory per rank", xlabel="SP size (ranks)", ylabel="MiB"),
    ]
    return [p for p in paths if p]
