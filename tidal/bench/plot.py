"""Latency plots of a benchmark run (matplotlib, Agg backend)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from tidal.bench.metrics import RequestRecord


def plot_results(records: Sequence[RequestRecord], path: str, title: str = "") -> str:
    """TTFT and TPOT histograms, and per-request latency over the run; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _hist(axes[0], ttft, "TTFT (ms)", "tab:blue")
    _hist(axes[1], tpot, "TPOT (ms)", "tab:orange")
    _timeline(axes[2], ok, [r for r in records if not r.success])
    return save_figure(fig, path, title)


def save_figure(fig: Any, path: str, title: Optional[str] = None) -> str:
    """Titles, lays out, writes (PNG by the path's suffix) and closes the figure; returns path."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _hist(ax: Any, values: Sequence[float], label: str, color: str) -> None:
    if values:
        ax.hist(values, bins=min(50, max(5, len(values) // 4)), color=color, alpha=0.8)
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(values, q))
            ax.axvline(v, color="k", linestyle=style, label=f"p{q} {v:.1f}")
        ax.legend()
    ax.set_xlabel(label)
    ax.set_ylabel("requests")
    ax.set_title(f"{label.split()[0]} distribution (n={len(values)})")


def _timeline(ax: Any, ok: Sequence[RequestRecord], failed: Sequence[RequestRecord]) -> None:
    starts = [r.start for r in ok]
    ax.scatter(starts, [r.e2e * 1000 for r in ok], s=8, label="e2e", alpha=0.7)
    ax.scatter(starts, [r.ttft * 1000 for r in ok], s=8, label="TTFT", alpha=0.7)
    if failed:
        ax.scatter([r.start for r in failed], [0.0] * len(failed), s=14, marker="x",
                   color="red", label="failed")
    ax.set_xlabel("request start (s since run start)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("per-request latency over time")
    ax.legend()
