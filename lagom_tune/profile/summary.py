"""Measurement summaries anyone can compare: collectives in nccl-tests' columns."""

from __future__ import annotations

import pandas as pd

from lagom_tune.backends.base import bandwidth_columns, trimmed_mean

SETTING_COLUMNS = ("algo", "proto", "channels", "threads", "buffsize", "chunk_bytes", "nodes")


def collective_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per collective point: size, ranks, settings, median and trimmed-mean time (fastest
    75% of repeats, AutoCCL's statistic), and ``algbw``/``busbw`` from the median, as nccl-tests prints."""
    coll = df[df["kind"] == "collective"]
    if coll.empty:
        return pd.DataFrame()
    settings = [c for c in SETTING_COLUMNS if c in coll.columns and coll[c].notna().any()]
    rows = []
    for _, rep in coll.groupby("point", sort=False):
        first = rep.iloc[0]
        median = float(rep["time_us"].median())
        op, size, ranks = str(first["op"]), int(first["nbytes"]), int(first["ranks"])
        bw = bandwidth_columns(op, size, ranks, median / 1e6)
        rows.append({"op": op, "size_B": size, "ranks": ranks, **{c: _plain(first[c]) for c in settings},
                     "time_us": round(median, 2), "trimmed_us": round(trimmed_mean(rep["time_us"].tolist()), 2),
                     "algbw_GBps": round(bw["algbw_GBps"], 3), "busbw_GBps": round(bw["busbw_GBps"], 3), "repeats": len(rep)})
    return pd.DataFrame(rows).sort_values(["op", "size_B", *settings], kind="stable").reset_index(drop=True)


def _plain(value):
    """A setting as written: CSV columns with gaps read back as floats (4194304.0 -> 4194304)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
