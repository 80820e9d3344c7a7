"""`search --validate N`: replay the default settings and the plan on the profiling backend, interleaved."""

from __future__ import annotations

import statistics
from typing import Any

from lagom_tune.backends.base import BackendOptions, Point, check_memory
from lagom_tune.backends.registry import backend_info
from lagom_tune.errors import UserError
from lagom_tune.comparison import interleaved, ratio_interval
from lagom_tune.knobs import Settings, settings_items
from lagom_tune.precision import ms_round
from lagom_tune.workload.spec import Workload


def backend_from_fingerprint(fp: dict[str, Any]):
    """The backend that produced a run folder, rebuilt from its fingerprint.

    Args:
        fp: the run folder's fingerprint (``meta.yaml``).
    Returns:
        The Backend, ready to replay iterations.
    Raises:
        UserError: for a backend that can only replay on the profiled cluster (nccl).
    """
    info = backend_info(fp["backend"])
    if not info.replays_locally:
        raise UserError(f"--validate replays on the profiling backend, which for {info.name} means your cluster: "
                        "measure the plan there with `lagom-tune trial plan.yaml -- torchrun ... train.py`")
    # Each backend reads the options it needs (the simulator ignores ``ranks``: it sizes itself from the workload).
    return info.create(BackendOptions(
        ranks=int(fp.get("ranks", 2)), hardware=fp.get("cluster"),
        nodes=int(fp.get("nodes", 1)), seed=int(fp.get("seed") or 0), noise=float(fp.get("noise") or 0.0),
        extra={"ib_gbps": fp["ib_gbps"]} if fp.get("ib_gbps") else {}))  # recorded for multi-node clusters only


def validate(workload: Workload, fingerprint: dict[str, Any], candidates: dict[str, Settings], repeats: int) -> dict[str, Any]:
    """Iteration time of each candidate, ``repeats`` rounds interleaved, each in the reverse order
    of the one before (d, p, p, d, ...: :mod:`lagom_tune.comparison`).

    Args:
        workload: the workload to replay (whole iterations).
        fingerprint: the run folder's fingerprint (rebuilds its backend).
        candidates: name -> settings, e.g. ``{"default": ..., "plan": ...}``.
        repeats: rounds; each replays every candidate once.
    Returns:
        The plan's ``validated`` section: method, median and spread per candidate, and, when both
        are there, the default-over-plan speedup read as ``trial`` reads its rounds (the geometric
        mean of the per-round ratios, with its ``comparison.CI_LEVEL`` interval from 2 repeats on;
        ``comparison.ratio_interval``) and the ratios themselves (``ratios``, in round order: the
        default ran first in the first round and every other one after it), with ``same_settings``
        when the plan keeps the defaults, so that any difference is noise.
    """
    backend = backend_from_fingerprint(fingerprint)
    ranks = workload.world_size
    runs = list(interleaved(list(candidates), repeats))
    points = [Point("iteration", settings_items(candidates[name]), ranks=ranks, workload=workload) for _, name in runs]
    check_memory(points, backend.fingerprint())
    by_round: dict[int, dict[str, float]] = {}
    order = iter(runs)

    def record(point: Point, rows: list[dict[str, Any]]) -> None:
        r, name = next(order)
        by_round.setdefault(r, {})[name] = rows[0]["time_us"] / 1e3

    backend.measure(points, 1, record)
    times = {name: [arms[name] for arms in by_round.values()] for name in candidates}
    med = {name: ms_round(statistics.median(t)) for name, t in times.items()}
    out = {
        "method": f"{'simulated' if backend.simulated else 'measured'} replay of the workload on {backend.name}, "
                  f"{repeats} interleaved repeats, each round in the reverse order of the last",
        "simulated": backend.simulated,
        "repeats": repeats,
        "iteration_ms": med,
        "spread_ms": {name: [ms_round(min(t)), ms_round(max(t))] for name, t in times.items()},
    }
    if "default" in med and "plan" in med:
        ratios = [arms["default"] / arms["plan"] for _, arms in sorted(by_round.items())]
        speedup, low, high = ratio_interval(ratios)
        out["speedup"] = round(speedup, 4)
        if repeats >= 2:  # one round's ratio has no interval
            out["interval"] = [round(low, 4), round(high, 4)]
        out["ratios"] = [round(x, 4) for x in ratios]
        if settings_items(candidates["default"]) == settings_items(candidates["plan"]):
            out["same_settings"] = True  # a plan that keeps the defaults: the speedup is the replay's noise
    return out
