"""How well a fitted model ranks settings: what the search relies on, beyond the MAPE.

For each GEMM shape, over its overlapped points (channel counts x buffer sizes):

* ``spearman``: the rank correlation between predicted and measured overlapped windows
  (``window_us``) across channel counts, at each buffer size, median over buffer sizes;
* ``best_gap``: how much longer the measured window of the model's best setting (the point with
  the smallest predicted window, over channels x buffer sizes) is than the best measured window,
  as a fraction (0 when the model picks the measured best).

The predictions should be out-of-fold (each point predicted by a model that did not see it):
:func:`lagom_tune.model.fit.fit_model` computes these figures from the same k-fold predictions its
MAPE uses, and says so in ``method``.

Spearman is computed as the Pearson correlation of ranks (ties averaged), with pandas alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

MIN_CHANNEL_COUNTS = 3  # a rank correlation over fewer settings says little


@dataclass(frozen=True)
class ShapeRanking:
    """One GEMM shape's ranking figures.

    Attributes:
        shape: the shape key (``BxMxNxK:dtype``).
        spearman: median over buffer sizes of the rank correlation across channel counts (NaN
            when no buffer size has ``MIN_CHANNEL_COUNTS`` channel counts with distinct windows).
        best_gap: measured window of the model's best setting / best measured window - 1.
        points: overlapped points of the shape that were predicted.
    """

    shape: str
    spearman: float
    best_gap: float
    points: int


@dataclass(frozen=True)
class RankingSummary:
    """Ranking figures over all shapes.

    Attributes:
        method: how the predictions were made (out-of-fold with its split, or in-sample).
        median_spearman: the median shape's Spearman (shapes without one left out).
        median_best_gap: the median shape's best-setting gap.
        worst_best_gap: the largest best-setting gap of any shape.
        shapes: per shape, sorted by shape key.
    """

    method: str
    median_spearman: float
    median_best_gap: float
    worst_best_gap: float
    shapes: tuple[ShapeRanking, ...]

    def to_dict(self) -> dict[str, Any]:
        """The ``accuracy.ranking`` record of model.yaml."""
        def r4(x: float) -> float:
            return round(float(x), 4)  # NaN stays NaN (YAML's .nan)

        return {"method": self.method, "median_spearman": r4(self.median_spearman), "median_best_gap": r4(self.median_best_gap),
                "worst_best_gap": r4(self.worst_best_gap),
                "shapes": [{"shape": s.shape, "spearman": r4(s.spearman), "best_gap": r4(s.best_gap), "points": s.points}
                           for s in self.shapes]}


def spearman(a: pd.Series, b: pd.Series) -> float:
    """Spearman's rank correlation of two aligned series (NaN if either is constant).

    Args:
        a: one series.
        b: the other, with the same index.
    Returns:
        The correlation.
    """
    ra, rb = a.rank(), b.rank()
    if ra.nunique() < 2 or rb.nunique() < 2:
        return float("nan")
    return float(np.corrcoef(ra.to_numpy(float), rb.to_numpy(float))[0, 1])


def shape_ranking(shape: str, rows: pd.DataFrame) -> ShapeRanking:
    """The figures for one shape.

    Args:
        shape: the shape key.
        rows: its overlapped points, with ``channels``, ``buffsize``, ``window_us`` (measured) and
            ``predicted_window_us``.

    Returns:
        Its :class:`ShapeRanking`.
    """
    per_buffer = []
    for _, same in rows.groupby("buffsize"):
        by_channels = same.groupby("channels")[["window_us", "predicted_window_us"]].median()
        if len(by_channels) >= MIN_CHANNEL_COUNTS:
            per_buffer.append(spearman(by_channels["predicted_window_us"], by_channels["window_us"]))
    rho = float(np.nanmedian(per_buffer)) if any(x == x for x in per_buffer) else float("nan")
    chosen = rows.loc[rows["predicted_window_us"].idxmin(), "window_us"]
    return ShapeRanking(shape, rho, float(chosen / rows["window_us"].min() - 1), len(rows))


def rank_settings(over: pd.DataFrame, predicted_window_us: pd.Series, method: str) -> RankingSummary:
    """Ranking figures of predicted against measured overlapped windows.

    Args:
        over: overlapped point medians (``gemm``, ``channels``, ``buffsize``, ``window_us``).
        predicted_window_us: the predicted window of each point, indexed like ``over``; points
            without a prediction are left out.
        method: how the predictions were made, recorded in the summary.

    Returns:
        Per-shape figures and their medians.
    """
    rows = over.assign(predicted_window_us=predicted_window_us.reindex(over.index))
    rows = rows[rows["predicted_window_us"].notna() & (rows["window_us"] > 0)]
    shapes = tuple(shape_ranking(str(k), g) for k, g in sorted(rows.groupby("gemm"), key=lambda kv: str(kv[0])))
    rhos = [s.spearman for s in shapes if s.spearman == s.spearman]
    gaps = [s.best_gap for s in shapes]
    return RankingSummary(method, float(np.median(rhos)) if rhos else float("nan"), float(np.median(gaps)) if gaps else float("nan"),
                          float(max(gaps)) if gaps else float("nan"), shapes)
