"""Fit a cost model to a run folder's measurements and measure its held-out error (k-fold MAPE).

The fit minimises relative error (each row weighted by 1/measured), the same quantity the
reported MAPE measures. Held-out error is computed on whole points, never on repeats of a
point that was also in the training set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd

from lagom_tune.backends.base import PAIRED
from lagom_tune.errors import UserError
from lagom_tune.model.contention import (
    COMM_FEATURES, GEMM_FEATURES, SCHEMA_VERSION, CostModel, CpuPairwiseModel, Linear, comm_features, gemm_features,
)
from lagom_tune.model.ranking import RankingSummary, rank_settings
from lagom_tune.search.timeline import simulate
from lagom_tune.workload.spec import Collective, Gemm


def fit_linear(features: np.ndarray, names: tuple[str, ...], target: np.ndarray) -> Linear:
    """Least squares on relative error with non-negative slopes (a negative one is dropped and refitted)."""
    active = list(range(len(names)))
    while True:
        a = np.column_stack([np.ones(len(target))] + [features[:, c] for c in active]) / target[:, None]
        coef, *_ = np.linalg.lstsq(a, np.ones(len(target)), rcond=None)
        slopes = dict(zip(active, coef[1:]))
        negative = [c for c, s in slopes.items() if s < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda c: slopes[c]))
    return Linear(float(coef[0]), tuple((names[c], float(slopes.get(c, 0.0))) for c in range(len(names))))


def point_medians(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: medians over repeats."""
    num = [c for c in ("time_us", "comm_us", "window_us", "compute_alone_us", "comm_alone_us", "n_compute") if c in df.columns]
    keys = [c for c in ("point", "kind", "gemm", "m", "n", "k", "batch", "dtype", "op", "nbytes", "ranks", "nodes",
                        "threads", "algo", "proto", "channels", "buffsize", "chunk_bytes", "baseline") if c in df.columns]
    return df.groupby("point", sort=True).agg({**{k: "first" for k in keys if k != "point"}, **{c: "median" for c in num}}).reset_index()


MIN_SLOWDOWN = 0.97  # a measured compute slowdown below this is a measurement error (DESIGN.md §10)


def consistent_baselines(pts: pd.DataFrame) -> pd.DataFrame:
    """Overlapped points' compute baselines, timed the way their overlapped times were.

    An overlapped row whose ``baseline`` is ``"paired"`` had its alone times measured right
    before it, the same way: kept. Any other (profiles before 2026-11-30, without the column) is
    legacy: its ``compute_alone_us`` was timed from single launches, 1.2-2.1x slower than the
    same launches back to back on an H200, and is replaced by ``n_compute`` times the median
    ``time_us`` of that shape's ``gemm`` point (at the same thread count where GEMM points have
    one). A legacy row whose shape has no GEMM point gets NaN: unknown, rather than a figure known
    to be off (the GPU fit then infers that shape's time alone). Pure pandas; idempotent.

    Args:
        pts: point medians (:func:`point_medians`).

    Returns:
        A copy with consistent ``compute_alone_us``.
    """
    out = pts.copy()
    if "compute_alone_us" not in out or "n_compute" not in out:
        return out
    paired = out["baseline"].eq(PAIRED) if "baseline" in out else pd.Series(False, index=out.index)
    legacy = out.index[(out["kind"] == "overlap") & ~paired]
    if legacy.empty:
        return out
    gemm = out[out["kind"] == "gemm"]
    keys = ["gemm", "threads"] if "threads" in gemm and gemm["threads"].notna().any() else ["gemm"]
    per_shape = gemm.groupby(keys)["time_us"].median()
    lookup = pd.MultiIndex.from_frame(out.loc[legacy, keys]) if len(keys) > 1 else pd.Index(out.loc[legacy, "gemm"])
    base = per_shape.reindex(lookup).to_numpy(dtype=float)
    out.loc[legacy, "compute_alone_us"] = out.loc[legacy, "n_compute"].to_numpy(float) * base
    return out


def compute_slowdowns(pts: pd.DataFrame) -> pd.Series:
    """Each overlapped point's measured compute slowdown: overlapped GEMM-stream time over its
    alone time, after :func:`consistent_baselines`. Indexed like the overlapped rows of ``pts``."""
    over = consistent_baselines(pts)
    over = over[over["kind"] == "overlap"]
    return over["time_us"] / over["compute_alone_us"]


@dataclass(frozen=True)
class LowSlowdown:
    """An overlapped point that measured its GEMMs faster beside communication than alone."""

    point: str
    gemm: str
    channels: float
    buffsize: float
    slowdown: float


def low_slowdowns(pts: pd.DataFrame, threshold: float = MIN_SLOWDOWN) -> list[LowSlowdown]:
    """The overlapped points whose measured compute slowdown is below ``threshold`` (a measurement
    error: they are left out of the contention fit), slowest-looking first.

    Args:
        pts: point medians.
        threshold: the smallest credible slowdown.

    Returns:
        One record per such point, sorted by slowdown.
    """
    slow = compute_slowdowns(pts)
    low = slow[slow < threshold].sort_values()
    rows = pts.loc[low.index].reindex(columns=["point", "gemm", "channels", "buffsize"])  # CPU rows have no channels
    return [LowSlowdown(str(p), str(g), float(c), float(b), float(s))
            for p, g, c, b, s in zip(rows["point"], rows["gemm"], rows["channels"], rows["buffsize"], low)]


def slowdown_warnings(pts: pd.DataFrame, threshold: float = MIN_SLOWDOWN, listed: int = 3) -> list[str]:
    """Lines for ``show`` about :func:`low_slowdowns` (empty when there are none)."""
    low = low_slowdowns(pts, threshold)
    if not low:
        return []
    worst = "; ".join(f"{x.gemm} at {x.channels:g} channel(s), buffsize {x.buffsize / 2**20:g} MiB: {x.slowdown:.3f}"
                      for x in low[:listed])
    return [f"{len(low)} overlapped point(s) measured a GEMM slowdown below {threshold} (a measurement error; left out of "
            f"the contention fit), lowest: {worst}"]


def contention_points(pts: pd.DataFrame, threshold: float = MIN_SLOWDOWN) -> pd.DataFrame:
    """The overlapped points the contention fit uses: consistent baselines, and no point whose
    measured compute slowdown is below ``threshold``."""
    over = consistent_baselines(pts)
    over = over[over["kind"] == "overlap"]
    slow = over["time_us"] / over["compute_alone_us"]
    return over[~(slow < threshold)]


def gemm_of_row(row: pd.Series) -> Gemm:
    """The GEMM a measurement row describes."""
    return Gemm("g", int(row["m"]), int(row["n"]), int(row["k"]), str(row["dtype"]), int(row["batch"]))


def two_rate_slowdowns(row: pd.Series) -> tuple[float | None, float | None]:
    """Solve the two-rate model for one overlapped measurement (both streams start at 0): the
    factors by which computation and communication ran slower while both were running."""
    w, x, ty, tc = row["compute_alone_us"], row["comm_alone_us"], row["time_us"], row["comm_us"]
    if tc <= ty:
        w1 = w - (ty - tc)
        return (tc / w1 if w1 > 0 else None), tc / x
    x1 = x - (tc - ty)
    return ty / w, (ty / x1 if x1 > 0 else None)


def _fit_cpu(pts: pd.DataFrame) -> CpuPairwiseModel:
    gemm = pts[pts["kind"] == "gemm"]
    coll = pts[pts["kind"] == "collective"]
    over = pts[pts["kind"] == "overlap"]
    if gemm.empty or coll.empty:
        raise UserError("the profile has no GEMM or no collective measurements to fit")
    compute = {}
    for t, rows in gemm.groupby("threads"):
        feats = np.array([[gemm_features(gemm_of_row(r))[n] for n in GEMM_FEATURES] for _, r in rows.iterrows()])
        compute[int(t)] = fit_linear(feats, GEMM_FEATURES, rows["time_us"].to_numpy(float))
    comm = {}
    for op, rows in coll.groupby("op"):
        chunks = rows["chunk_bytes"].fillna(0) if "chunk_bytes" in rows else pd.Series(0, index=rows.index)
        feats = np.array([[comm_features(int(b), int(c))[n] for n in COMM_FEATURES] for b, c in zip(rows["nbytes"], chunks)])
        comm[str(op)] = fit_linear(feats, COMM_FEATURES, rows["time_us"].to_numpy(float))
    compute_slow, comm_slow = {}, {}
    for t in compute:
        rows = over[over["threads"] == t] if not over.empty else over
        pairs = [two_rate_slowdowns(r) for _, r in rows.iterrows()]
        sy = [s for s, _ in pairs if s is not None]
        sx = [s for _, s in pairs if s is not None]
        compute_slow[t] = float(np.clip(np.median(sy), 1.0, 20.0)) if sy else 1.0
        comm_slow[t] = float(np.clip(np.median(sx), 1.0, 20.0)) if sx else 1.0
    measured = {(str(r["gemm"]), int(r["threads"])): float(r["time_us"]) for _, r in gemm.iterrows()}
    return CpuPairwiseModel(compute, comm, compute_slow, comm_slow, measured=measured)


KNOB_COLUMNS = ("algo", "proto", "channels", "threads", "buffsize", "chunk_bytes")


def row_settings(row: pd.Series) -> dict:
    """The knob settings a measurement row was taken at (integers as integers)."""
    out = {}
    for k in KNOB_COLUMNS:
        if k in row and not pd.isna(row[k]):
            out[k] = row[k] if isinstance(row[k], str) else int(row[k])
    return out


def predict_point(model: CostModel, row: pd.Series) -> dict[str, float]:
    """Predicted microseconds for a point, in the columns it was measured in."""
    settings = row_settings(row)
    if row["kind"] == "gemm":
        return {"time_us": model.compute_time(gemm_of_row(row), settings) * 1e6}
    def col(name: str, default: int) -> int:
        return int(row[name]) if name in row and not pd.isna(row[name]) else default

    coll = Collective("c", str(row["op"]), int(row["nbytes"]), ranks=col("ranks", 2), nodes=col("nodes", 1))
    if row["kind"] == "collective":
        return {"time_us": _timed_alone(model, coll, settings) * 1e6}
    g = gemm_of_row(row)
    n = int(row["n_compute"])
    tl = simulate([g] * n, [model.compute_time(g, settings)] * n, [coll], [model.comm_time(coll, settings)],
                  lambda a, b: (model.compute_slowdown(a, b, settings), model.comm_slowdown(b, a, settings)))
    comp_end = max(s.end for s in tl.spans if s.stream == "compute")
    comm_end = max(s.end for s in tl.spans if s.stream == "comm")
    return {"window_us": tl.makespan * 1e6, "time_us": comp_end * 1e6, "comm_us": comm_end * 1e6}


def _timed_alone(model: CostModel, coll: Collective, settings: dict) -> float:
    """A collective point as the profiler timed it: alone, back to back on one buffer. The GPU
    model knows that such repeats read an L2-resident buffer faster than in a workload."""
    from lagom_tune.model.gpu import LagomGpuModel

    if isinstance(model, LagomGpuModel):
        return model.repeated_comm_time(coll, settings)
    return model.comm_time(coll, settings)


ACCURACY_TARGETS = {"gemm": ("time_us",), "collective": ("time_us",), "overlap": ("window_us", "time_us", "comm_us")}
ACCURACY_NAMES = {("gemm", "time_us"): "gemm", ("collective", "time_us"): "collective", ("overlap", "window_us"): "overlap_window",
                  ("overlap", "time_us"): "overlap_compute", ("overlap", "comm_us"): "overlap_comm"}


@dataclass(frozen=True)
class FitResult:
    """A fitted model and its measured accuracy.

    Attributes:
        model: fitted on every point.
        mape: held-out MAPE per quantity (``ACCURACY_NAMES``).
        folds: the k of the k-fold split.
        points: measured points per kind.
        ranking: how well held-out predictions rank channel/buffer settings per GEMM shape
            (GPU profiles with overlapped points; else None).
        warnings: lines for ``show`` about measurements the fit refused.
    """

    model: CostModel
    mape: dict[str, float]
    folds: int
    points: dict[str, int]
    ranking: RankingSummary | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self, rows: int, simulated: bool) -> dict[str, Any]:
        accuracy: dict[str, Any] = {
            "mape": {k: round(val, 4) for k, val in self.mape.items()},
            "method": f"{self.folds}-fold cross-validation over measured points (medians of repeats)",
            "points": self.points,
            "rows": rows,
            "warnings": list(self.warnings),
        }
        if self.ranking is not None:
            accuracy["ranking"] = self.ranking.to_dict()
        return {"schema_version": SCHEMA_VERSION, "kind": "lagom-model", **self.model.to_dict(), "simulated": simulated,
                "accuracy": accuracy}


def fit_model(df: pd.DataFrame, *, device: dict[str, Any] | None = None, simulated: bool = False,
              folds: int = 5, seed: int = 0, progress: Callable[[int, int], None] | None = None) -> FitResult:
    """Fit on all points; report MAPE of ``folds``-fold held-out predictions per op kind, and (GPU
    profiles) the ranking figures of the same held-out predictions.

    Args:
        df: measurement rows (every repeat).
        device: ``sms`` and ``hbm_GBps``: selects the GPU family (Lagom's model); without it the
            CPU per-pair model is fitted.
        simulated: whether the rows came from the simulator.
        folds: k of the k-fold split (stratified by kind).
        seed: the split's seed.
        progress: called with (done, total) fits.

    Returns:
        The model fitted on every point, with its held-out accuracy.
    """
    pts = point_medians(df)
    if pts.empty:
        raise UserError("the profile holds no measurements to fit")

    tick = progress or (lambda done, total: None)
    tick(0, folds + 1)
    model = _fit(pts, device, simulated)
    tick(1, folds + 1)
    rng = np.random.default_rng(seed)
    fold_of = pd.Series(0, index=pts.index)
    for _, idx in pts.groupby("kind").groups.items():  # stratified: every fold sees every kind
        order = rng.permutation(np.asarray(idx))
        fold_of[order] = np.arange(len(order)) % folds
    errors: dict[str, list[float]] = {}
    held_out_window: dict[Any, float] = {}
    for f in range(folds):
        train, test = pts[fold_of != f], pts[fold_of == f]
        if test.empty:
            continue
        try:
            fold_model = _fit(train, device, simulated)
        except UserError:
            continue
        finally:
            tick(f + 2, folds + 1)
        for _, row in test.iterrows():
            try:
                pred = predict_point(fold_model, row)
            except UserError:  # e.g. a thread count absent from this fold's training points
                continue
            for col in ACCURACY_TARGETS[row["kind"]]:
                measured = float(row[col])
                if measured > 0:
                    errors.setdefault(ACCURACY_NAMES[(row["kind"], col)], []).append(abs(pred[col] - measured) / measured)
            if row["kind"] == "overlap":
                held_out_window[row.name] = pred["window_us"]
    mape = {k: float(np.mean(val)) for k, val in errors.items()}
    counts = {str(k): int(n) for k, n in pts["kind"].value_counts().items()}
    over = pts[pts["kind"] == "overlap"]
    ranking = None
    if device is not None and not over.empty and "channels" in over and over["channels"].notna().all():
        ranking = rank_settings(over, pd.Series(held_out_window, dtype=float),
                                f"out-of-fold: each point predicted by the model of the {folds}-fold split that held it out")
    # the GPU fit leaves such points out of its contention terms; the CPU family has none to leave them out of
    warnings = tuple(slowdown_warnings(pts)) if device is not None else ()
    return FitResult(model, mape, folds, counts, ranking, warnings)


def _fit(pts: pd.DataFrame, device: dict[str, Any] | None, simulated: bool) -> CostModel:
    if device is None:
        return _fit_cpu(pts)
    from lagom_tune.model.gpu import fit_gpu

    return fit_gpu(pts, device, simulated)


def new_shape_mape(df: pd.DataFrame, *, device: dict[str, Any] | None = None, folds: int = 5, seed: int = 0) -> float:
    """Held-out MAPE of isolated GEMM time for shapes the fit never saw in any point (alone or
    overlapped): the model's extrapolation to new shapes, stricter than ``fit_model``'s ``gemm``."""
    pts = point_medians(df)
    shapes = sorted(pts.loc[pts["kind"] == "gemm", "gemm"].unique())
    order = np.random.default_rng(seed).permutation(len(shapes))
    errors = []
    for f in range(folds):
        held = {shapes[i] for i in order[f::folds]}
        if not held:
            continue
        train = pts[~pts["gemm"].isin(held)]
        model = _fit(train, device, False)
        for _, row in pts[(pts["kind"] == "gemm") & pts["gemm"].isin(held)].iterrows():
            try:
                errors.append(abs(predict_point(model, row)["time_us"] - row["time_us"]) / row["time_us"])
            except UserError:
                continue
    return float(np.mean(errors)) if errors else float("nan")


def fit_run(run, progress: Callable[[int, int], None] | None = None) -> FitResult:
    """Fit the run folder's measurements and write ``model.yaml`` beside them."""
    from lagom_tune.artifact_io import write_yaml

    df = run.measurements()
    meta = run.read_meta()
    simulated = bool(meta.get("simulated", False))
    fp = meta["fingerprint"]
    device = {"sms": fp["sms"], "hbm_GBps": fp["hbm_GBps"]} if fp.get("backend") in ("sim", "nccl") else None
    result = fit_model(df, device=device, simulated=simulated, progress=progress)
    write_yaml(run.model_path, result.to_dict(len(df), simulated))
    from lagom_tune.model.plots import write_fit_plots

    write_fit_plots(run.path, df, result.model, simulated)
    return result
