"""Measurement summaries anyone can compare: collectives in nccl-tests' columns, and what the
backend chose for the workload's collectives when nothing was set."""

from __future__ import annotations

import pandas as pd

from lagom_tune.backends.base import bandwidth_columns, trimmed_mean
from lagom_tune.knobs import BackendChoices
from lagom_tune.measurements import CHOICE_COLUMNS, CHOICE_KNOBS, DEFAULT, SETTING_COLUMNS, WHOLE_COLUMNS, chosen_settings
from lagom_tune.profile.store import row_settings
from lagom_tune.workload.spec import Workload


def backend_choices(df: pd.DataFrame, workload: Workload) -> BackendChoices:
    """What the backend ran each of the workload's collectives with when nothing was set: the
    algorithm and protocol its ``default`` rows record (NCCL's own, seen by the tuner plugin), and
    the channels where NCCL's log gave them.

    Args:
        df: a run folder's measurements.
        workload: its workload.
    Returns:
        The choices, by rule key; none for a profile without such rows (gloo's, a profile before
        2026-12-05) or where the plugin saw nothing.
    """
    if not set(CHOICE_COLUMNS) <= set(df.columns):
        return BackendChoices()
    seen = {}
    for _, r in df[df["kind"] == DEFAULT].iterrows():
        nodes = r.get("nodes")
        chosen = chosen_settings(r)
        if chosen:
            seen[(str(r["op"]), int(r["nbytes"]), int(r["ranks"]), 1 if pd.isna(nodes) else int(nodes))] = chosen
    return BackendChoices({c.rule_key: seen[key] for c in workload.collectives()
                           if (key := (c.op, c.nbytes, c.ranks, c.nodes)) in seen})


def collective_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per collective point: size, ranks, settings, median and trimmed-mean time (fastest
    75% of repeats, AutoCCL's statistic), and ``algbw``/``busbw`` from the median, as nccl-tests prints.
    A collective timed with nothing set (a ``default`` point) shows the algorithm and protocol the
    backend chose (``?`` where not observed) and the channels it ran (where observed), ``own`` true.

    Args:
        df: a run folder's measurements.
    Returns:
        The table, sorted by op, size and settings (empty without collective points).
    """
    coll = df[df["kind"].isin(("collective", DEFAULT))]
    if coll.empty:
        return pd.DataFrame()
    # asked once: within the loop it was a pass over every row per point, most of a large profile's time
    has_defaults = DEFAULT in set(coll["kind"])
    rows = []
    for _, rep in coll.groupby("point", sort=False):
        first = rep.iloc[0]
        own = first["kind"] == DEFAULT
        chosen = (chosen_settings(first) or dict.fromkeys(CHOICE_KNOBS, "?")) if own else {}
        median = float(rep["time_us"].median())
        op, size, ranks = str(first["op"]), int(first["nbytes"]), int(first["ranks"])
        bw = bandwidth_columns(op, size, ranks, median / 1e6)
        nodes = {"nodes": int(first["nodes"])} if "nodes" in first and not pd.isna(first["nodes"]) else {}
        rows.append({"op": op, "size_B": size, "ranks": ranks, **row_settings(first), **chosen, **nodes,
                     **({"own": own} if has_defaults else {}),
                     "time_us": round(median, 2), "trimmed_us": round(trimmed_mean(rep["time_us"].tolist()), 2),
                     "algbw_GBps": round(bw["algbw_GBps"], 3), "busbw_GBps": round(bw["busbw_GBps"], 3), "repeats": len(rep)})
    out = pd.DataFrame(rows)
    # whole numbers stay whole beside a point that sets none (NCCL's own channels)
    out = out.astype({c: "Int64" for c in out.columns if c in WHOLE_COLUMNS})
    settings = [c for c in out.columns if c in SETTING_COLUMNS]
    return out.sort_values(["op", "size_B", *settings], kind="stable").reset_index(drop=True)
