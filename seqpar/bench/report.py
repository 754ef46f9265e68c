"""What a benchmark run leaves behind: a plain table on stdout, a JSON file, PNG plots.

Every JSON file carries :func:`machine_info` (CPU model, cores, load, torch / deepspeed / python
versions, GPUs, git commit) next to the figures, so a number is never separated from where it came from.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import torch

__all__ = ["machine_info", "format_table", "write_json", "plot_series", "fmt_bytes", "fmt_s"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Where and with what the figures were taken."""
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "seqpar_commit": _git_commit(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    return info


def fmt_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``; ``None -> '-'``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_s(s: float | None) -> str:
    """Seconds with a unit that keeps 3 significant figures; ``None -> '-'``."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table; ``columns`` are ``(header, key)``; values are shown as ``str`` (floats 3 digits)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    body = [[cell(r.get(k)) for _, k in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, (h, _) in enumerate(columns)]
    line = "  ".join(h.ljust(w) for (h, _), w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line, sep, *("  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body)])


def write_json(path: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` (indented, keys in insertion order), creating the directory.

    Written to ``path + ".part"`` and renamed over ``path``: a run stopped mid-write (the device tool's time
    limit, ``timeout``) leaves the last complete file, never a truncated one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(payload, f, indent=1, default=str)
        f.write("\n")
    os.replace(path + ".part", path)


def plot_series(
    path: str,
    series: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]] | None = None,
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
    hline_label: str | None = None,
) -> str | None:
    """Lines (``label -> [(x, y), ...]``) into a PNG, in one panel (``series``) or side by side
    (``panels``: panel title -> series); labels ending in ``(cpu time)`` or ``(estimate)`` are dashed.
    Returns the path, or ``None`` when there is nothing to plot. Imports matplotlib (Agg) only here."""
    if panels is None:
        panels = {"": series or {}}
    panels = {t: {k: sorted(v) for k, v in ser.items() if v} for t, ser in panels.items()}
    panels = {t: ser for t, ser in panels.items() if ser}
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.4), dpi=110, squeeze=False, sharey=True)
    markers = "osD^vP*X<>"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (panel, ser) in zip(axes[0], panels.items()):
        base_index: dict[str, int] = {}
        for label, pts in ser.items():
            xs, ys = zip(*pts)
            base, dashed = label, False
            for suffix in (" (cpu time)", " (estimate)"):
                if label.endswith(suffix):
                    base, dashed = label[: -len(suffix)], True
            i = base_index.setdefault(base, len(base_index))  # a variant shares its base's colour
            ax.plot(xs, ys, marker=markers[i % len(markers)], color=colors[i % len(colors)], label=label,
                    linestyle="--" if dashed else "-", markersize=4)
        if hline is not None:
            ax.axhline(hline, color="grey", linestyle=":", linewidth=1, label=hline_label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
