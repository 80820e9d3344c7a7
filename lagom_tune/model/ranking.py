"""How well a fitted model ranks settings: what the search relies on, beyond the MAPE.

For each job, a GEMM shape beside one collective (a sweep pairs every shape with each of the
workload's collectives), over its overlapped points (channel counts x buffer sizes):

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

from lagom_tune.measurements import KNOB_COLUMNS

MIN_CHANNEL_COUNTS = 3  # a rank correlation over fewer settings says little


@dataclass(frozen=True)
class ShapeRanking:
    """One job's ranking figures: a GEMM shape beside one collective.

    Attributes:
        shape: the shape key (``BxMxNxK:dtype``).
        collective: the collective beside it (op, ranks, nodes and, where two share them, bytes; "" when the points do not say).
        spearman: median over buffer sizes of the rank correlation across channel counts (NaN
            when no buffer size has ``MIN_CHANNEL_COUNTS`` channel counts with distinct windows).
        best_gap: measured window of the model's best setting / best measured window - 1.
        points: overlapped points of the shape that were predicted.
    """

    shape: str
    spearman: float
    best_gap: float
    points: int
    collective: str = ""


@dataclass(frozen=True)
class RankingSummary:
    """Ranking figures over all shapes.

    Attributes:
        method: how the predictions were made (out-of-fold with its split, or in-sample).
        median_spearman: the median job's Spearman (jobs without one left out).
        median_best_gap: the median job's best-setting gap.
        worst_best_gap: the largest best-setting gap of any job.
        shapes: per job, sorted by shape key, then collective.
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
                "shapes": [{"shape": s.shape, **({"collective": s.collective} if s.collective else {}), "spearman": r4(s.spearman),
                            "best_gap": r4(s.best_gap), "points": s.points} for s in self.shapes]}


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


def shape_ranking(shape: str, rows: pd.DataFrame, collective: str = "") -> ShapeRanking:
    """The figures for one job.

    Args:
        shape: the shape key.
        rows: its overlapped points beside one collective, with ``channels``, ``buffsize``,
            ``window_us`` (measured) and ``predicted_window_us``.
        collective: the collective, as :func:`jobs` names it.

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
    return ShapeRanking(shape, rho, float(chosen / rows["window_us"].min() - 1), len(rows), collective)


JOB_COLUMNS = ("op", "ranks", "nodes")  # with the shape, what tells one overlapped job from another (and its bytes, below)


def jobs(rows: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Overlapped points split into jobs, each a GEMM shape beside one collective, named.

    Two collectives of one op differ by their bytes; but a probe sized by its settings (its bytes
    follow its channels and buffer) is one job at every size: bytes split a group only where a
    setting recurs in it.

    Args:
        rows: overlapped points (``gemm``; any of :data:`JOB_COLUMNS`, ``nbytes`` and the settings).
    Returns:
        (the collective's name, its points) per job, by shape, op, ranks, nodes and bytes.
    """
    base = ["gemm", *(c for c in JOB_COLUMNS if c in rows)]
    settings = [c for c in KNOB_COLUMNS if c in rows]
    out = []
    for key, group in sorted(rows.groupby(base, dropna=False), key=lambda kv: tuple(map(str, kv[0]))):
        name = ", ".join([str(key[1]), *(f"{int(x)} {c}" for c, x in zip(base[2:], key[2:]) if not pd.isna(x))]) if len(key) > 1 else ""
        if "nbytes" in group and settings and group.duplicated(settings).any():
            out += [(f"{name}, {int(n)} B", g) for n, g in sorted(group.groupby("nbytes"), key=lambda kv: kv[0])]
        else:
            out.append((name, group))
    return out


def rank_settings(over: pd.DataFrame, predicted_window_us: pd.Series, method: str) -> RankingSummary:
    """Ranking figures of predicted against measured overlapped windows.

    Args:
        over: overlapped point medians (``gemm``, ``channels``, ``buffsize``, ``window_us``).
        predicted_window_us: the predicted window of each point, indexed like ``over``; points
            without a prediction are left out.
        method: how the predictions were made, recorded in the summary.

    Returns:
        Per-job figures (a shape beside one collective: the ranking a search relies on is among
        one job's settings; a shape's points beside two collectives ranked as one let a model that
        ordered one of them backwards score perfectly) and their medians.
    """
    rows = over.assign(predicted_window_us=predicted_window_us.reindex(over.index))
    rows = rows[rows["predicted_window_us"].notna() & (rows["window_us"] > 0)]
    shapes = tuple(shape_ranking(str(g["gemm"].iloc[0]), g, name) for name, g in jobs(rows))
    rhos = [s.spearman for s in shapes if s.spearman == s.spearman]
    gaps = [s.best_gap for s in shapes]
    return RankingSummary(method, float(np.median(rhos)) if rhos else float("nan"), float(np.median(gaps)) if gaps else float("nan"),
                          float(max(gaps)) if gaps else float("nan"), shapes)
