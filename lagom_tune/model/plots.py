"""Pictures of a fit, written into the run folder: measured vs predicted, and GEMM slowdown vs channels."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd

from lagom_tune.artifact_io import atomic_write_bytes
from lagom_tune.model.rows import compute_slowdowns
from lagom_tune.profile.store import RunFolder


def plotted_column(kind: str) -> str:
    """The measured column ``fit.png`` compares for a point of ``kind``.

    Args:
        kind: a point kind.
    Returns:
        ``window_us`` for overlapped points, else ``time_us``.
    """
    return "window_us" if kind == "overlap" else "time_us"


def write_fit_plots(run: RunFolder, pts: pd.DataFrame, predicted: pd.Series, simulated: bool) -> list[Path]:
    """Write ``fit.png`` (measured vs predicted) and ``slowdown.png`` into the run folder.

    Args:
        run: where the pictures go.
        pts: point medians (``rows.point_medians``).
        predicted: the model's prediction of each point's :func:`plotted_column`, indexed like ``pts``.
        simulated: label every picture SIMULATED.

    Returns:
        The files written.
    """
    import matplotlib  # imported here: only fitting draws, and matplotlib takes a second to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = " (SIMULATED)" if simulated else ""
    out = []
    fig, ax = plt.subplots(figsize=(6, 6))
    for kind, rows in pts.groupby("kind"):
        col = plotted_column(str(kind))
        ax.scatter(rows[col], predicted.loc[rows.index], s=8, alpha=0.6, label=f"{kind} ({col})")
    lo, hi = pts["time_us"].min() * 0.8, pts[["time_us"] + (["window_us"] if "window_us" in pts else [])].max().max() * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured µs", ylabel="predicted µs", title=f"fit: measured vs predicted{tag}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.append(_save(fig, run.fit_plot_path))
    plt.close(fig)

    over = pts[pts["kind"] == "overlap"]
    x_col = "channels" if "channels" in over and over["channels"].notna().any() else "threads"
    if not over.empty and x_col in over:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        over = over.assign(slowdown=compute_slowdowns(pts))  # against consistent baselines
        for shape, rows in over.groupby("gemm"):
            series = rows.groupby(x_col)["slowdown"].median()
            ax.plot(series.index, series.values, marker="o", ms=3, lw=1, label=shape)
        ax.set(xlabel=x_col, ylabel="GEMM stream time, overlapped / alone", title=f"computation slowdown beside a collective{tag}")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        out.append(_save(fig, run.slowdown_plot_path))
        plt.close(fig)
    return out


def _save(fig, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, written whole or not at all (a fit killed mid-write left an
    empty fit.png, which the report embedded)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return atomic_write_bytes(path, buf.getvalue())
