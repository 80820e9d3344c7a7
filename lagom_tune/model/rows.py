"""Measurement rows as the model layer reads them: one row per point, the GEMM and settings a
row was taken at, and the consistent baselines every slowdown is computed against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import pandas as pd

from lagom_tune.knobs import KnobSpace
from lagom_tune.measurements import AGAIN, CHOSEN_COLUMNS, DEFAULT, DESCRIBING_COLUMNS, KNOB_COLUMNS, PAIRED, TIMED_COLUMNS, first_of
from lagom_tune.profile.store import row_settings
from lagom_tune.workload.spec import Gemm


# What a model is scored on: each fitted kind's measured columns, and the quantity each one names.
ACCURACY_TARGETS = {"gemm": ("time_us",), "collective": ("time_us",), "overlap": ("window_us", "time_us", "comm_us")}
ACCURACY_NAMES = {("gemm", "time_us"): "gemm", ("collective", "time_us"): "collective", ("overlap", "window_us"): "overlap_window",
                  ("overlap", "time_us"): "overlap_compute", ("overlap", "comm_us"): "overlap_comm"}

DIGEST_TIME = "{:.9g}"  # a time as the digest reads it: pandas releases parse a CSV's floats a last bit apart


def rows_digest(df: pd.DataFrame) -> str:
    """A fingerprint of measurement rows (their points, repeats and times), in any order: what a
    model records of the rows it was fitted to, so that rows re-measured since (a resume whose
    refit was interrupted) are told apart from them even when their number is the same.

    The same rows give the same digest under any pandas release: each row is hashed as text, its
    time to 9 significant digits (pandas 2.0 and 3.1 read the same CSV's times a last bit apart).

    Args:
        df: measurement rows (``RunFolder.read``).
    Returns:
        16 hex digits.
    """
    return _summed_hash((df["point"].astype(str) + "|" + df["repeat"].astype("int64").astype(str) + "|"
                         + df["time_us"].astype("float64").map(DIGEST_TIME.format)).astype(object))


def legacy_rows_digest(df: pd.DataFrame) -> str:
    """The digest models recorded until 2026-12-06 (the exact times, hashed by pandas: one pandas
    release's reading of a CSV; accepted beside :func:`rows_digest` so their models are not called
    stale).

    Args:
        df: measurement rows.
    Returns:
        16 hex digits.
    """
    return _summed_hash(df[["point", "repeat", "time_us"]].astype({"point": str, "repeat": "int64", "time_us": "float64"}))


def _summed_hash(rows: pd.DataFrame | pd.Series) -> str:
    """The sum of pandas' hashes of ``rows``, one a row (so in any order), as 16 hex digits."""
    total = int(pd.util.hash_pandas_object(rows, index=False).sum()) if len(rows) else 0  # wraps: uint64
    return f"{total % 2 ** 64:016x}"


def point_medians(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: medians over repeats.

    Args:
        df: measurement rows (one per repeat).
    Returns:
        One row per point, its describing columns first, timed columns as medians.
    """
    num = [c for c in (*TIMED_COLUMNS, "n_compute") if c in df.columns]
    keys = [c for c in (*DESCRIBING_COLUMNS, "baseline", *CHOSEN_COLUMNS) if c in df.columns and c != "point"]
    return df.groupby("point", sort=True).agg({**{k: "first" for k in keys}, **{c: "median" for c in num}}).reset_index()


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
    alone time, after :func:`consistent_baselines`.

    Args:
        pts: point medians.
    Returns:
        The slowdowns, indexed like the overlapped rows of ``pts``.
    """
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
    """Lines for ``show`` about :func:`low_slowdowns` (empty when there are none).

    Args:
        pts: point medians.
        threshold: the lowest believable slowdown.
        listed: how many of the lowest to name.
    Returns:
        At most one line.
    """
    low = low_slowdowns(pts, threshold)
    if not low:
        return []
    worst = "; ".join(f"{x.gemm} at {x.channels:g} channel(s), buffsize {x.buffsize / 2**20:g} MiB: {x.slowdown:.3f}"
                      for x in low[:listed])
    return [f"{len(low)} overlapped point(s) measured a GEMM slowdown below {threshold} (a measurement error; left out of "
            f"the contention fit), lowest: {worst}"]


def contention_points(pts: pd.DataFrame, threshold: float = MIN_SLOWDOWN) -> pd.DataFrame:
    """The overlapped points the contention fit uses: consistent baselines, and no point whose
    measured compute slowdown is below ``threshold``.

    Args:
        pts: point medians.
        threshold: the lowest believable slowdown.
    Returns:
        The overlapped rows kept.
    """
    over = consistent_baselines(pts)
    over = over[over["kind"] == "overlap"]
    slow = over["time_us"] / over["compute_alone_us"]
    return over[~(slow < threshold)]


def times_alone(gemm: pd.DataFrame, over: pd.DataFrame) -> dict[str, float]:
    """Each shape's time alone in seconds: the median of its own point and of the alone times
    measured beside each of its overlapped pairs (real measurements too, taken just before the pair).

    Args:
        gemm: GEMM point medians.
        over: overlapped point medians (rows without ``compute_alone_us`` are skipped).
    Returns:
        Seconds per GEMM, by shape.
    """
    own = pd.Series((gemm["time_us"] / 1e6).to_numpy(float), index=gemm["gemm"].to_numpy())
    return {str(k): float(v) for k, v in pd.concat([own, paired_alone(over)]).groupby(level=0, sort=False).median().items()}


def paired_alone(over: pd.DataFrame) -> pd.Series:
    """Seconds per GEMM alone as each overlapped pair measured it just before (its
    ``compute_alone_us`` over its ``n_compute``), indexed by shape, one entry per pair that has one.

    Args:
        over: overlapped point medians.
    Returns:
        The seconds, with the shape as the index (repeated across a shape's pairs).
    """
    rows = over[over["compute_alone_us"].notna()]
    return pd.Series((rows["compute_alone_us"] / rows["n_compute"] / 1e6).to_numpy(float), index=rows["gemm"].to_numpy())


def fitted_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows a model is fitted to and scored on: all but the collectives timed at the backend's
    own choices (``default`` rows), which set no knob to fit, and the points measured again
    (:func:`again_rows`).

    Args:
        df: measurement rows.
    Returns:
        The rows of GEMMs, collectives and overlapped pairs.
    """
    return df[~df["kind"].isin((DEFAULT, AGAIN))]


def again_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of points measured a second time at the profile's end (kind ``again``).

    Args:
        df: measurement rows.
    Returns:
        Those rows.
    """
    return df[df["kind"] == AGAIN]


def recorded_defaults(space: KnobSpace | None) -> dict[str, Any]:
    """The knob settings a measurement row that records none of a knob was taken at: the
    backend's defaults, for the knobs ``measurements.csv`` has columns for.

    Args:
        space: the backend's knobs on the profiled machine (None: unknown, no defaults).
    Returns:
        Knob name -> default.
    """
    return {k: val for k, val in space.defaults().items() if k in KNOB_COLUMNS} if space else {}


def remeasured_points(df: pd.DataFrame, defaults: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Each point measured again (what ``show --remeasured`` lists): its median, the later
    measurements' median, their ratio, how many and when (:func:`remeasured_pairs`), the most
    offset first.

    Args:
        df: measurement rows.
        defaults: :func:`recorded_defaults`.
    Returns:
        Columns ``quantity``, ``point``, ``when``, ``point_us``, ``remeasured_us``, ``ratio``
        (remeasured over the point's) and ``pairs``; empty when no point was measured again.
    """
    pairs = remeasured_pairs(point_medians(fitted_rows(df)), defaults, point_medians(again_rows(df)))
    out = pairs.groupby(["quantity", "point", "when"], sort=False).agg(
        point_us=("first_us", "first"), remeasured_us=("again_us", "median"), pairs=("again_us", "size")).reset_index()
    out.insert(5, "ratio", out["remeasured_us"] / out["point_us"])
    return largest_first(out, (out["ratio"] - 1).abs()).round({"point_us": 1, "remeasured_us": 1, "ratio": 3})


def largest_first(table: pd.DataFrame, by: pd.Series) -> pd.DataFrame:
    """``table``'s rows, the largest of ``by`` first (the tables ``show`` lists most off first).

    Args:
        table: any rows.
        by: one value per row, on ``table``'s index.
    Returns:
        The rows reordered, indexed from 0.
    """
    return table.iloc[by.to_numpy().argsort(kind="stable")[::-1]].reset_index(drop=True)


AT_THE_END = "profile's end"  # a point measured again after every other
BEFORE_A_PAIR = "before a pair"  # a GEMM or collective an overlapped pair timed alone right before it


def remeasured_pairs(pts: pd.DataFrame, defaults: Mapping[str, Any] | None = None,
                     again: pd.DataFrame | None = None) -> pd.DataFrame:
    """Points measured a second time, later, two ways. Each overlapped pair times its GEMM and its
    collective alone right before it (``baseline`` paired): where the pair's shape (at its thread
    count) or its collective (op, size and settings) has a point of its own, the two medians are
    one quantity measured at two moments. And a profile measures a few points of each kind again
    at its end (``again``): every quantity of such a point, overlapped ones too. The gap between
    the two is what the machine's drift between moments does, which the repeats of one point
    cannot show, plus any difference in how the two were timed (the H200 runs of 2026-11-30
    timed GEMM points and pairs' baselines differently).

    Args:
        pts: point medians (:func:`point_medians`).
        defaults: the backend's knob defaults, which a row that does not record a knob ran at (the
            gloo backend's pairs all-reduce in one call, its collective points record their chunk).
        again: point medians of the points measured again (:func:`again_rows`), or None.
    Returns:
        One row per such pair: ``quantity`` (``ACCURACY_NAMES``' values), ``point`` (the id of
        the point measured first), ``first_us`` (its median), ``again_us`` (the later one's; per
        GEMM for a pair's GEMM) and ``when`` (:data:`AT_THE_END` or :data:`BEFORE_A_PAIR`).
    """
    defaults = dict(defaults or {})
    found: list[tuple[str, str, float, float, str]] = []
    first_points = pts.set_index("point", drop=False)
    for r in (again.to_dict("records") if again is not None else ()):
        first = first_of(str(r["point"]))
        if first not in first_points.index:
            continue
        f = first_points.loc[first]
        for col in ACCURACY_TARGETS.get(f["kind"], ()):
            if col in r and r[col] > 0 and f[col] > 0:
                found.append((ACCURACY_NAMES[(f["kind"], col)], first, f[col], r[col], AT_THE_END))
    gemm = pts[pts["kind"] == "gemm"]
    by_shape = {(r["gemm"], _threads(r)): r for r in gemm.to_dict("records")}
    for r in paired_gemm_alone(pts).to_dict("records"):
        # GEMM points record their thread count where it is a compute knob (gloo); elsewhere the
        # pair's threads are the collective's (NCCL_NTHREADS) and the shape's point has none
        first = by_shape.get((r["gemm"], _threads(r)), by_shape.get((r["gemm"], None)))
        if first is not None:
            found.append(("gemm", first["point"], first["time_us"], r["time_us"], BEFORE_A_PAIR))
    coll = pts[pts["kind"] == "collective"]
    by_coll = {_collective_key(r, defaults): r for r in coll.to_dict("records")}
    for r in _paired(pts).to_dict("records"):
        first = by_coll.get(_collective_key(r, defaults))
        if first is not None and r.get("comm_alone_us", 0) > 0:
            found.append(("collective", first["point"], first["time_us"], r["comm_alone_us"], BEFORE_A_PAIR))
    return pd.DataFrame(found, columns=["quantity", "point", "first_us", "again_us", "when"])


def paired_gemm_alone(pts: pd.DataFrame) -> pd.DataFrame:
    """The time alone of one GEMM as each overlapped pair measured it right before itself
    (``baseline`` paired: the same launches as the pair's; older rows were timed otherwise).

    Args:
        pts: point medians.
    Returns:
        Columns ``gemm``, ``threads`` (NaN where the rows record none) and ``time_us``, one row per
        pair that measured one.
    """
    over = _paired(pts)
    over = over[(over["compute_alone_us"] > 0) & (over["n_compute"] > 0)] if "compute_alone_us" in over else over.iloc[:0]
    threads = over["threads"] if "threads" in over else pd.Series(float("nan"), index=over.index)
    return pd.DataFrame({"gemm": over["gemm"], "threads": threads, "time_us": paired_alone(over).to_numpy(float) * 1e6})


def _paired(pts: pd.DataFrame) -> pd.DataFrame:
    """The overlapped points whose alone times were measured right before them, the same way."""
    return pts[(pts["kind"] == "overlap") & pts["baseline"].eq(PAIRED)] if "baseline" in pts else pts.iloc[:0]


def _threads(row: Mapping[str, Any]) -> int | None:
    t = row.get("threads")
    return None if t is None or pd.isna(t) else int(t)


def _collective_key(row: Mapping[str, Any], defaults: dict[str, Any]) -> tuple:
    """A collective's op, size, ranks and every knob setting, those the row does not record at
    their defaults: a pair matches a collective point only where all agree."""
    return (row.get("op"), row.get("nbytes"), row.get("ranks"), tuple(sorted({**defaults, **row_settings(row)}.items())))


def gemm_of_row(row: Mapping[str, Any]) -> Gemm:
    """The GEMM a measurement row describes.

    Args:
        row: a GEMM or overlapped point's row.
    Returns:
        The Gemm (named ``g``).
    """
    return Gemm("g", int(row["m"]), int(row["n"]), int(row["k"]), str(row["dtype"]), int(row["batch"]))


def two_rate_slowdowns(row: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """Solve the two-rate model for one overlapped measurement (both streams start at 0): the
    factors by which computation and communication ran slower while both were running.

    Args:
        row: an overlapped point's row (its alone and overlapped times).
    Returns:
        (compute slowdown, communication slowdown); None where the measurement leaves no time
        to solve for, or a baseline is not a positive time.
    """
    w, x, ty, tc = row["compute_alone_us"], row["comm_alone_us"], row["time_us"], row["comm_us"]
    if tc <= ty:
        w1 = w - (ty - tc)
        return (tc / w1 if w1 > 0 else None), (tc / x if x > 0 else None)
    x1 = x - (tc - ty)
    return (ty / w if w > 0 else None), (ty / x1 if x1 > 0 else None)


def overlap_slowdowns(pts: pd.DataFrame) -> pd.DataFrame:
    """The overlapped rows of ``pts`` with their two-rate slowdowns as columns ``gemm_slowdown`` and
    ``comm_slowdown`` (None where the overlap does not determine one).

    Args:
        pts: point medians whose overlapped rows carry consistent baselines.
    Returns:
        A copy of the overlapped rows with the two columns added.
    """
    over = pts[pts["kind"] == "overlap"].copy()
    both = over.apply(two_rate_slowdowns, axis=1)
    over["gemm_slowdown"] = [a for a, _ in both]
    over["comm_slowdown"] = [b for _, b in both]
    return over


@dataclass(frozen=True)
class SlowdownTable:
    """A probe profile's contention, per GEMM shape (rows) and channel count (columns): the median
    two-rate slowdown of the GEMM and of the collective, and per channel count the bytes/s the
    collective moves alone at its largest size."""

    gemm: pd.DataFrame
    comm: pd.DataFrame
    comm_rate: pd.Series


def slowdown_table(pts: pd.DataFrame) -> SlowdownTable:
    """The per-shape, per-channel-count slowdowns of a probe profile (the H200 tables the simulator
    is calibrated on and tested against).

    Args:
        pts: point medians of a run folder whose overlapped rows carry consistent baselines.
    Returns:
        The SlowdownTable.
    """
    pts = consistent_baselines(pts)
    by = overlap_slowdowns(pts).groupby(["gemm", "channels"])
    alone = pts[pts["kind"] == "collective"]
    alone = alone[alone["nbytes"] == alone.groupby("channels")["nbytes"].transform("max")]
    rate = (alone["nbytes"] / (alone["time_us"] * 1e-6)).groupby(alone["channels"]).median()
    return SlowdownTable(by["gemm_slowdown"].median().unstack(), by["comm_slowdown"].median().unstack(), rate)
