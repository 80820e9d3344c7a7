"""Fit a cost model to a run folder's measurements and measure its held-out error (k-fold MAPE).

The fit minimises relative error (each row weighted by 1/measured), the same quantity the
reported MAPE measures. Held-out error is computed on whole points, never on repeats of a
point that was also in the training set.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd

from lagom_tune.backends.registry import backend_info, backend_names, usable_cores
from lagom_tune.errors import UserError
from lagom_tune.knobs import KnobSpace
from lagom_tune.measurements import CHOICE_COLUMNS, CHOICE_KNOBS, DEFAULT, chosen_settings
from lagom_tune.model.contention import (
    COMM_FEATURES, FIT_REVISION, GEMM_FEATURES, SCHEMA_VERSION, CostModel, CpuPairwiseModel, comm_features, fit_linear, gemm_features,
    model_document, read_model_file,
)
from lagom_tune.model.fit_workers import run_each
from lagom_tune.model.gpu_fit import fit_gpu
from lagom_tune.model.plots import plotted_column, write_fit_plots
from lagom_tune.model.ranking import RankingSummary, rank_settings
from lagom_tune.model.rows import (
    ACCURACY_NAMES, ACCURACY_TARGETS, again_rows, fitted_rows, gemm_of_row, largest_first, paired_gemm_alone, point_medians, recorded_defaults,
    remeasured_pairs, rows_digest, slowdown_warnings, two_rate_slowdowns,
)
from lagom_tune.profile.store import row_settings
from lagom_tune.timeline import simulate
from lagom_tune.workload.spec import Collective
from lagom_tune.yaml_io import write_yaml


def _fit_cpu(pts: pd.DataFrame) -> CpuPairwiseModel:
    gemm = pts[pts["kind"] == "gemm"]
    coll = pts[pts["kind"] == "collective"]
    over = pts[pts["kind"] == "overlap"]
    if gemm.empty or coll.empty:
        raise UserError("the points hold no GEMM or no collective measurement to fit")
    compute = {}
    for t, rows in gemm.groupby("threads"):
        feats = np.array([[gemm_features(gemm_of_row(r))[n] for n in GEMM_FEATURES] for r in rows.to_dict("records")])
        compute[int(t)] = fit_linear(feats, GEMM_FEATURES, rows["time_us"].to_numpy(float))
    comm = {}
    for op, rows in coll.groupby("op"):
        chunks = rows["chunk_bytes"].fillna(0) if "chunk_bytes" in rows else pd.Series(0, index=rows.index)
        feats = np.array([[comm_features(int(b), int(c))[n] for n in COMM_FEATURES] for b, c in zip(rows["nbytes"], chunks)])
        comm[str(op)] = fit_linear(feats, COMM_FEATURES, rows["time_us"].to_numpy(float))
    compute_slow, comm_slow = {}, {}
    for t in compute:
        rows = over[over["threads"] == t] if not over.empty else over
        pairs = [two_rate_slowdowns(r) for r in rows.to_dict("records")]
        sy = [s for s, _ in pairs if s is not None]
        sx = [s for _, s in pairs if s is not None]
        compute_slow[t] = float(np.clip(np.median(sy), 1.0, 20.0)) if sy else 1.0
        comm_slow[t] = float(np.clip(np.median(sx), 1.0, 20.0)) if sx else 1.0
    # a measured shape's time alone: the median of its own point and of its pairs' alone times, as
    # the GPU model takes it (on a 2-core VM one GEMM point read 863 µs, its three pairs 394 µs
    # before them: the point was the drifted one)
    alone = pd.concat([gemm[["gemm", "threads", "time_us"]], paired_gemm_alone(pts)])
    measured = {(str(g), int(t)): float(us) for (g, t), us in alone.groupby(["gemm", "threads"])["time_us"].median().items()}
    return CpuPairwiseModel(compute, comm, compute_slow, comm_slow, measured=measured)


def predict_point(model: CostModel, row: Mapping[str, Any]) -> dict[str, float]:
    """Predicted microseconds for a point, in the columns it was measured in.

    Args:
        model: a fitted model.
        row: a point's row (medians of repeats; a Series or a record).
    Returns:
        ``time_us`` for GEMMs and collectives; ``window_us``, ``time_us`` and ``comm_us`` for
        overlapped points (played on the two-stream timeline).
    """
    settings = row_settings(row)
    if row["kind"] == "gemm":
        return {"time_us": model.compute_time(gemm_of_row(row), settings) * 1e6}
    def col(name: str, default: int) -> int:
        return int(row[name]) if name in row and not pd.isna(row[name]) else default

    coll = Collective("c", str(row["op"]), int(row["nbytes"]), ranks=col("ranks", 2), nodes=col("nodes", 1))
    if row["kind"] == "collective":
        return {"time_us": _timed_alone(model, coll, settings) * 1e6}
    g = gemm_of_row(row)
    # The point's n GEMMs back to back beside one collective, played as one op of n times the
    # time: one pair of slowdowns holds throughout, so the ends are the same, and a 64 GiB
    # all-reduce's point (tens of thousands of GEMMs) costs what a small one does.
    n = int(row["n_compute"])
    pair = (model.compute_slowdown(g, coll, settings), model.comm_slowdown(coll, g, settings))
    tl = simulate([g], [n * model.compute_time(g, settings)], [coll], [model.comm_time(coll, settings)], lambda a, b: pair)
    comp_end = max(s.end for s in tl.spans if s.stream == "compute")
    comm_end = max(s.end for s in tl.spans if s.stream == "comm")
    return {"window_us": tl.makespan * 1e6, "time_us": comp_end * 1e6, "comm_us": comm_end * 1e6}


def _timed_alone(model: CostModel, coll: Collective, settings: dict) -> float:
    """A collective point as the profiler timed it: alone, back to back on one buffer. The GPU
    model knows that such repeats read an L2-resident buffer faster than in a workload."""
    repeated = getattr(model, "repeated_comm_time", None)  # asked by capability: only the GPU model has it
    return repeated(coll, settings) if repeated is not None else model.comm_time(coll, settings)


MAPE_DECIMALS = 4  # a held-out MAPE is kept to 0.01% (printed to 0.1%)
# The error on collectives timed with nothing set, predicted at the algorithm and protocol the
# backend was seen choosing and its other defaults: the default baseline's own accuracy. These
# points are never fitted, so the model fitted on every other point predicts them.
DEFAULT_ACCURACY = "collective_default"
NOISE_METHOD = ("half the gap between the medians of a point's even and odd repeats, over its median, averaged over "
                "points: what a model that knew each point's true time would still score; drift between points "
                "measured at different times is not in it")


def repeat_noise(df: pd.DataFrame) -> dict[str, float]:
    """How far each held-out quantity's point medians move with the repeats that happened to be
    drawn: an estimate of the floor under its MAPE, which no model goes below (:data:`NOISE_METHOD`).

    For independent repeats the medians of two halves of a point's repeats differ by about twice
    what the median of all of them differs from the point's true time, so half their gap is that
    median's error. A lower bound: conditions that drift between points (another job on the
    machine, a clock that changes) move whole points, which the split within a point cannot see.

    Args:
        df: measurement rows (every repeat).
    Returns:
        Quantity (``ACCURACY_NAMES``, :data:`DEFAULT_ACCURACY`) -> fraction, rounded as MAPE is,
        for the quantities with points of at least two repeats.
    """
    out = {}
    for (kind, col), name in {**ACCURACY_NAMES, (DEFAULT, "time_us"): DEFAULT_ACCURACY}.items():
        rows = df[(df["kind"] == kind) & (df[col] > 0)] if col in df.columns else df.iloc[:0]
        if rows.empty:
            continue
        halves = rows.groupby(["point", rows["repeat"].astype(int) % 2])[col].median().unstack()
        if halves.shape[1] < 2:
            continue
        gap = ((halves[0] - halves[1]).abs() / 2 / rows.groupby("point")[col].median()).dropna()
        if not gap.empty:
            out[name] = round(float(gap.mean()), MAPE_DECIMALS)
    return out


REMEASURED_METHOD = ("a quantity measured twice: a few points of each kind measured again at the profile's end, and "
                     "each overlapped pair's GEMM and collective timed alone right before it where the same shape or "
                     "collective (op, size, settings) has a point of its own; half the gap between the two medians over "
                     "their mean, averaged over pairs: drift between moments (and anything timed differently) that the "
                     "repeats within one point cannot show")


def remeasured_noise(pts: pd.DataFrame, defaults: Mapping[str, Any] | None = None,
                     again: pd.DataFrame | None = None) -> dict[str, dict[str, float]]:
    """Quantities measured twice at different moments (:func:`~lagom_tune.model.rows.remeasured_pairs`):
    how far apart the two medians sit (:data:`REMEASURED_METHOD`), a second floor under a MAPE
    beside :func:`repeat_noise`, which cannot see drift between points.

    Args:
        pts: point medians.
        defaults: the knob settings a row that records none of a knob ran at (:func:`~lagom_tune.model.rows.recorded_defaults`).
        again: point medians of the points measured again at the profile's end, or None.
    Returns:
        Quantity (``ACCURACY_NAMES``' values) -> ``gap`` (fraction, rounded as MAPE is),
        ``median_ratio`` (remeasured over first, to 4 decimals) and ``pairs``, for the quantities
        with at least one pair.
    """
    pairs = remeasured_pairs(pts, defaults, again)
    out = {}
    for name, rows in pairs.groupby("quantity"):
        gap = (rows["first_us"] - rows["again_us"]).abs() / (rows["first_us"] + rows["again_us"])
        out[str(name)] = {"gap": round(float(gap.mean()), MAPE_DECIMALS),
                          "median_ratio": round(float((rows["again_us"] / rows["first_us"]).median()), 4), "pairs": len(rows)}
    return out


# A prediction behind a MAPE: the quantity, the point, its measured median, the model's prediction
# (out of fold, but for the collectives timed with nothing set, which no fit holds), relative error.
HELDOUT_COLUMNS = ("quantity", "point", "measured_us", "predicted_us", "error")


@dataclass(frozen=True)
class FitResult:
    """A fitted model and its measured accuracy.

    Attributes:
        model: fitted on every point.
        mape: held-out MAPE per quantity (``ACCURACY_NAMES``), to :data:`MAPE_DECIMALS` as model.yaml records it.
        folds: the k of the k-fold split.
        points: measured points per kind.
        ranking: how well held-out predictions rank channel/buffer settings per GEMM shape
            (GPU profiles with overlapped points; else None).
        warnings: lines for ``show`` about measurements the fit refused, and points no held-out
            figure holds (a fold that could not be fitted, a point its fold could not predict).
        scored: held-out points behind each quantity's MAPE (fewer than ``points`` when some were
            not predicted: see ``warnings``).
        noise: each quantity's repeat noise (:func:`repeat_noise`), the floor under its MAPE.
        remeasured: each quantity measured again at another moment (:func:`remeasured_noise`).
        heldout: every prediction behind ``mape`` (:data:`HELDOUT_COLUMNS`), a row per point and
            quantity: ``mape`` is the mean of its ``error`` per quantity (``show RUN --heldout``).
    """

    model: CostModel
    mape: dict[str, float]
    folds: int
    points: dict[str, int]
    ranking: RankingSummary | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    scored: dict[str, int] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    remeasured: dict[str, dict[str, float]] = field(default_factory=dict)
    heldout: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(HELDOUT_COLUMNS)), compare=False)

    def to_dict(self, rows: pd.DataFrame, simulated: bool) -> dict[str, Any]:
        accuracy: dict[str, Any] = {
            "mape": dict(self.mape),
            "method": f"{self.folds}-fold cross-validation over measured points (medians of repeats)",
            "points": self.points,
            "scored": dict(self.scored),
            "noise": dict(self.noise),
            "noise_method": NOISE_METHOD,
            "remeasured": {k: dict(val) for k, val in self.remeasured.items()},
            "remeasured_method": REMEASURED_METHOD,
            "rows": len(rows),
            "rows_digest": rows_digest(rows),
            "fit_revision": FIT_REVISION,
            "warnings": list(self.warnings),
        }
        if self.ranking is not None:
            accuracy["ranking"] = self.ranking.to_dict()
        return {"schema_version": SCHEMA_VERSION, "kind": "lagom-model", **self.model.to_dict(), "simulated": simulated,
                "accuracy": accuracy}


def nothing_set_points(df: pd.DataFrame, space: KnobSpace) -> pd.DataFrame:
    """The collectives timed with nothing set whose backend choice was observed and is in the
    knob space, as collective points at that choice (its channels the nearest offered, where
    observed: ``KnobSpace.usable``) and the backend's other defaults (what the search predicts
    them at, ``search.space.observed_defaults``).

    Args:
        df: measurement rows.
        space: the backend's knobs on the profiled machine.
    Returns:
        Point medians of kind ``collective``; empty without such rows.
    """
    if not set(CHOICE_COLUMNS) <= set(df.columns) or not set(CHOICE_KNOBS) <= set(space.names()):
        return pd.DataFrame()
    own = point_medians(df[df["kind"] == DEFAULT]).dropna(subset=list(CHOICE_COLUMNS))
    defaults = recorded_defaults(space)
    points = []
    for _, row in own.iterrows():
        nodes = 1 if pd.isna(row.get("nodes", 1)) else int(row.get("nodes", 1))
        usable = space.usable(chosen_settings(row), str(row["op"]), nodes, CHOICE_KNOBS)
        if usable:
            points.append({**row.to_dict(), **defaults, **usable, "kind": "collective"})
    return pd.DataFrame(points)


def fit_model(df: pd.DataFrame, *, device: dict[str, Any] | None = None, simulated: bool = False,
              folds: int = 5, seed: int = 0, progress: Callable[[int, int], None] | None = None,
              space: KnobSpace | None = None, workers: int = 1) -> FitResult:
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
        workers: the most processes fitting the folds at once (``fit_workers.run_each``: a
            script that asks for more must guard its top level; ``fit_run`` takes every usable core).
        space: the backend's knobs on the profiled machine, to score the collectives timed with
            nothing set (:data:`DEFAULT_ACCURACY`; None: not scored).

    Returns:
        The model fitted on every point, with its held-out accuracy.
    """
    pts = point_medians(fitted_rows(df))
    if pts.empty:
        raise UserError("the profile holds no measurements to fit")

    tick = progress or (lambda done, total: None)
    fold_of = fold_assignment(pts, folds, seed)
    variants = _variants(pts, device)
    # every fold's fit of every variant, in that order: they share nothing, and run side by side
    tasks = [(f, v, pts[fold_of != f], pts[fold_of == f]) for f in range(folds) if (fold_of == f).any() for v in variants]
    total = len(tasks) + 1  # and the fit on every point
    tick(0, total)
    models = run_each(_fit, [(train, device, simulated, v) for _, v, train, _ in tasks],
                      workers=workers, done=lambda n: tick(n, total))
    held = {v: _HeldOut() for v in variants}
    for (f, v, _, test), model in zip(tasks, models):
        if isinstance(model, UserError):
            held[v].failed.append(f"fold {f + 1} of {folds} could not be fitted from the other folds' points ({model}): its "
                                  f"{len(test)} points are in no held-out figure")
            continue
        held[v].add(model, test)
    chosen = _choose_variant(held)
    model = _fit(pts, device, simulated, chosen)
    tick(total, total)
    predictions = list(held[chosen].predictions)
    own = nothing_set_points(df, space) if space is not None else pd.DataFrame()
    for _, row in own.iterrows():
        try:
            predictions.append(_prediction(DEFAULT_ACCURACY, row, row["time_us"], predict_point(model, row)["time_us"]))
        except UserError:  # a setting the model cannot predict (a thread count it never saw)
            continue
    errors = _errors_by_quantity(predictions)
    # rounded once, as model.yaml records it: `profile` prints what `show` later reads from the file
    mape = {k: round(float(np.mean(e)), MAPE_DECIMALS) for k, e in errors.items()}
    scored = {k: len(e) for k, e in errors.items()}
    counts = {str(k): int(n) for k, n in pts["kind"].value_counts().items()}
    over = pts[pts["kind"] == "overlap"]
    ranking = None
    if device is not None and not over.empty and "channels" in over and over["channels"].notna().all():
        ranking = rank_settings(over, pd.Series(held[chosen].window, dtype=float),
                                f"out-of-fold: each point predicted by the model of the {folds}-fold split that held it out")
    # the GPU fit leaves such points out of its contention terms; the CPU family has none to leave them out of
    warnings = (tuple(slowdown_warnings(pts)) if device is not None else ()) + held[chosen].warnings()
    noise = {k: val for k, val in repeat_noise(df).items() if k in mape}
    again = point_medians(again_rows(df))
    remeasured = {k: val for k, val in remeasured_noise(pts, recorded_defaults(space), again).items() if k in mape}
    return FitResult(model, mape, folds, counts, ranking, warnings, scored, noise, remeasured,
                     pd.DataFrame(predictions, columns=list(HELDOUT_COLUMNS)))


def fold_assignment(pts: pd.DataFrame, folds: int, seed: int = 0) -> pd.Series:
    """Each point's fold: within each kind (stratified: a kind's points spread over the folds), points in
    the order of a seeded hash of their ``point`` id, dealt round-robin. A point's place depends on
    its own kind's points alone (a split drawn from one generator across kinds moved every GEMM
    point's fold when a profile's collective points changed in number, and a held-out figure with it).

    Args:
        pts: point medians (:func:`~lagom_tune.model.rows.point_medians`).
        folds: k of the k-fold split.
        seed: the hash's seed.
    Returns:
        The fold (0 to ``folds - 1``) of each row of ``pts``, on its index.
    """
    def rank(point: str) -> bytes:
        return hashlib.blake2b(f"{seed}:{point}".encode(), digest_size=8).digest()

    fold_of = pd.Series(0, index=pts.index)
    for _, idx in pts.groupby("kind").groups.items():
        order = sorted(idx, key=lambda i: rank(str(pts.at[i, "point"])))
        fold_of[order] = np.arange(len(order)) % folds
    return fold_of


def _prediction(quantity: str, row: Mapping[str, Any], measured: float, predicted: float) -> tuple:
    """A row of :data:`HELDOUT_COLUMNS`."""
    return quantity, str(row["point"]), float(measured), float(predicted), abs(predicted - measured) / measured


def _errors_by_quantity(predictions: list[tuple]) -> dict[str, list[float]]:
    """Each quantity's relative errors (rows of :data:`HELDOUT_COLUMNS`), quantities in the order first predicted."""
    out: dict[str, list[float]] = {}
    for p in predictions:
        out.setdefault(p[0], []).append(p[-1])
    return out


@dataclass
class _HeldOut:
    """Out-of-fold predictions (rows of :data:`HELDOUT_COLUMNS`), and each overlapped point's predicted window."""

    predictions: list[tuple] = field(default_factory=list)
    window: dict[Any, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # a line per fold that could not be fitted
    unpredicted: list[str] = field(default_factory=list)  # why, per held-out point its fold's model could not predict

    def add(self, model: CostModel, test: pd.DataFrame) -> None:
        for index, row in zip(test.index, test.to_dict("records")):
            try:
                pred = predict_point(model, row)
            except UserError as e:  # e.g. a thread count absent from this fold's training points
                self.unpredicted.append(str(e))
                continue
            for col in ACCURACY_TARGETS[row["kind"]]:
                measured = float(row[col])
                if measured > 0:
                    self.predictions.append(_prediction(ACCURACY_NAMES[(row["kind"], col)], row, measured, pred[col]))
            if row["kind"] == "overlap":
                self.window[index] = pred["window_us"]

    def warnings(self) -> tuple[str, ...]:
        """What the held-out figures leave out, one line each (none when every point was scored)."""
        lines = list(self.failed)
        if self.unpredicted:
            lines.append(f"{len(self.unpredicted)} held-out points could not be predicted by the model of the fold that held "
                         f"them out (first: {self.unpredicted[0]}): they are in no held-out figure")
        return tuple(lines)


# Whether collectives timed back to back ran faster from L2 than they do in a workload is not told
# apart from their curve by the isolated points: the overlapped ones decide (a GEMM beside a
# collective evicts its buffers), held out, and the L2 term must earn its place. Fitted where it
# is absent (the simulator has none), it trades against the collective's slowdown beside a GEMM,
# fits the overlapped points about as well, and biases the search toward settings whose buffers
# overflow L2 (a deployed H200 plan predicted 6.7% faster replayed 2.5% slower).
WARM_MARGIN = 0.05  # the L2 term is kept only if it cuts the held-out error of overlapped collectives by more than 5%


def _variants(pts: pd.DataFrame, device: dict[str, Any] | None) -> tuple[bool | None, ...]:
    """The fits to compare: with and without the L2-warm term (GPU with overlapped points), else one."""
    if device is None:
        return (None,)
    return (False, True) if (pts["kind"] == "overlap").any() else (True,)


def _choose_variant(held: dict[bool | None, _HeldOut]) -> bool | None:
    """The simpler fit (first) unless the next cuts the overlapped collectives' held-out error by
    more than :data:`WARM_MARGIN`."""
    variants = list(held)
    if len(variants) == 1:
        return variants[0]
    simple, warm = (np.mean(_errors_by_quantity(held[v].predictions).get("overlap_comm", [np.inf])) for v in variants)
    return variants[1] if warm < simple * (1 - WARM_MARGIN) else variants[0]


def _fit(pts: pd.DataFrame, device: dict[str, Any] | None, simulated: bool, warm: bool | None) -> CostModel:
    """The CPU family (``device`` None), or the GPU model with or without the L2-warm term."""
    return _fit_cpu(pts) if device is None else fit_gpu(pts, device, simulated, warm=bool(warm))


def new_shape_mape(df: pd.DataFrame, *, device: dict[str, Any] | None = None, folds: int = 5, seed: int = 0) -> float:
    """Held-out MAPE of isolated GEMM time for shapes the fit never saw in any point (alone or
    overlapped): the model's extrapolation to new shapes, stricter than ``fit_model``'s ``gemm``.

    Args:
        df: a run folder's measurements.
        device: the GPU's ``sms`` and ``hbm_GBps`` (None: the CPU family).
        folds: folds of shapes.
        seed: the shuffle's seed.
    Returns:
        The MAPE over held-out shapes.
    """
    pts = point_medians(fitted_rows(df))
    shapes = sorted(pts.loc[pts["kind"] == "gemm", "gemm"].unique())
    order = np.random.default_rng(seed).permutation(len(shapes))
    errors = []
    for f in range(folds):
        held = {shapes[i] for i in order[f::folds]}
        if not held:
            continue
        train = pts[~pts["gemm"].isin(held)]
        model = _fit(train, device, False, False)  # GEMMs alone: the L2 term of collectives plays no part
        for row in pts[(pts["kind"] == "gemm") & pts["gemm"].isin(held)].to_dict("records"):
            try:
                errors.append(abs(predict_point(model, row)["time_us"] - row["time_us"]) / row["time_us"])
            except UserError:
                continue
    return float(np.mean(errors)) if errors else float("nan")


def fit_device(fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """What :func:`fit_model` takes as ``device`` for a profile of this fingerprint: the GPU's SMs
    and HBM bandwidth, or None (the CPU family) for a backend that is no GPU's or is not known.

    Args:
        fingerprint: a run folder's ``meta.yaml`` fingerprint.
    Returns:
        ``{"sms": ..., "hbm_GBps": ...}`` or None.
    """
    info = backend_info(fingerprint["backend"]) if fingerprint.get("backend") in backend_names() else None
    return {"sms": fingerprint["sms"], "hbm_GBps": fingerprint["hbm_GBps"]} if info is not None and info.gpu_model else None


def current_accuracy(run) -> dict[str, Any] | None:
    """The accuracy record of the run's ``model.yaml`` when refitting could only write it again:
    this revision of the fit (:data:`FIT_REVISION`) made it from exactly the rows
    ``measurements.csv`` holds now (their digest).

    Args:
        run: the run folder (``profile.store.RunFolder``).
    Returns:
        The record; None when there is no model, or one that is unreadable, another revision's,
        or fitted to other rows.
    """
    if not run.model_path.exists():
        return None
    try:
        accuracy = read_model_file(run.model_path)["accuracy"]
    except UserError:
        return None  # a refit writes a good one over it
    if accuracy.get("fit_revision") != FIT_REVISION or accuracy.get("rows_digest") != rows_digest(run.measurements()):
        return None
    return accuracy


def fit_run_unless_current(run, progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, Any], bool]:
    """What ``profile`` does once it has measured: fit the run (:func:`fit_run`) unless its
    ``model.yaml`` is already this fit of these rows (:func:`current_accuracy`), as after a rerun of
    a finished profile, which measures nothing.

    Args:
        run: the run folder (``profile.store.RunFolder``).
        progress: called with (fits done, fits) while fitting.
    Returns:
        ``model.yaml``'s accuracy record, and whether this call fitted it.
    """
    accuracy = current_accuracy(run)
    if accuracy is not None:
        return accuracy, False
    fit_run(run, progress)
    return read_model_file(run.model_path)["accuracy"], True


def _fit_of(run, progress: Callable[[int, int], None] | None = None) -> tuple[FitResult, pd.DataFrame, bool]:
    """The run folder's fit (:func:`fit_model` on every usable core), its measurements, and whether
    they are simulated; nothing written."""
    df = run.measurements()
    meta = run.read_meta()
    simulated = bool(meta.get("simulated", False))
    with np.errstate(all="ignore"):  # a model left non-finite is refused where it is written
        result = fit_model(df, device=fit_device(meta["fingerprint"]), simulated=simulated, progress=progress,
                           space=run.knob_space(meta), workers=usable_cores())
    return result, df, simulated


def held_out_points(run) -> pd.DataFrame:
    """Every prediction behind the run's accuracy figures, the most off first (``show RUN
    --heldout``): the fit ``lagom-tune fit`` makes, refitted here, writing nothing.

    Args:
        run: the run folder (``profile.store.RunFolder``).
    Returns:
        :data:`HELDOUT_COLUMNS`, and ``ratio`` (predicted over measured) before ``error``, a row
        per point and quantity, the largest error first.
    """
    held = _fit_of(run)[0].heldout
    table = held.assign(ratio=held["predicted_us"] / held["measured_us"])[[*HELDOUT_COLUMNS[:-1], "ratio", "error"]]
    return largest_first(table, table["error"]).round({"measured_us": 2, "predicted_us": 2, "ratio": 3, "error": 4})


def fit_run(run, progress: Callable[[int, int], None] | None = None) -> FitResult:
    """Fit the run folder's measurements and write ``model.yaml`` (and the fit's plots) beside them.

    Args:
        run: the run folder (``profile.store.RunFolder``).
        progress: called with (fits done, fits) during cross-validation.
    Returns:
        The FitResult.
    """
    result, df, simulated = _fit_of(run, progress)
    # numpy's overflow and invalid-value warnings are not printed: a model they leave non-finite is refused below
    with np.errstate(all="ignore"):
        pts = point_medians(fitted_rows(df))  # every point predicted before anything is written: a model that cannot is not written
        predicted = pd.Series([predict_point(result.model, r)[plotted_column(str(r["kind"]))] for r in pts.to_dict("records")],
                              index=pts.index)
    doc = result.to_dict(df, simulated)
    try:  # what search would refuse is not written over the model there (1e-300 µs times fitted an inf link rate)
        model_document(doc, str(run.model_path))
    except UserError as e:
        raise UserError(f"{run.csv_path}: the fit gave no usable model ({e}); a time there is far from any other "
                        f"(edited?): {run.model_path.name} is left as it was") from None
    # the pictures first, the model last: model.yaml is what says the fit is done, so a kill between
    # the two leaves the old model (refitted on the next run), never a new one beside old pictures
    write_fit_plots(run, pts, predicted, simulated)
    write_yaml(run.model_path, doc)
    return result
