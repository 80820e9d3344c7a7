"""The cost-model protocol the timeline and every optimizer evaluate through, and its CPU family.

``cpu-pairwise`` is DESIGN.md §6's fallback for hardware without SM structure: a fitted time for
each GEMM (intercept + FLOPs + bytes, per thread count), for each collective (latency + bytes
over bandwidth), and per-pair slowdown factors while the two overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np
import pandas as pd

from lagom_tune import validate as v
from lagom_tune.errors import UserError
from lagom_tune.model.gpu import LagomGpuModel
from lagom_tune.model.rows import legacy_rows_digest, rows_digest
from lagom_tune.profile.store import CsvHealth, ModelExpectation
from lagom_tune.workload.spec import Collective, Gemm
from lagom_tune.yaml_io import read_yaml

SCHEMA_VERSION = 1

# What the fit makes of a run's rows. Bump it with any change to the fit that would fit another
# model to the same measurements (a family's terms or candidates, its losses, its folds): a
# model.yaml records the revision that fitted it, and ``show``, ``report`` and ``search`` say when
# it is another one (:func:`fit_revision_note`). 1: the fit of 2026-12-06 (roll-off curve, folds by
# point hash); files fitted before then record none. 2: 2026-12-07, the CPU family takes a measured
# shape's time alone from its point and its overlapped pairs' alone times (the GPU family's fit is
# unchanged).
FIT_REVISION = 2


class CostModel(Protocol):
    """Seconds for each op alone, and the factor by which it slows while the other stream runs."""

    family: str
    simulated: bool

    def compute_time(self, gemm: Gemm, settings: Mapping[str, Any]) -> float: ...

    def comm_time(self, coll: Collective, settings: Mapping[str, Any]) -> float: ...

    def compute_slowdown(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float: ...

    def comm_slowdown(self, coll: Collective, gemm: Gemm, settings: Mapping[str, Any]) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Linear:
    """``intercept_us + sum(coef * feature)``; features are named so model.yaml says its units."""

    intercept_us: float
    coefs: tuple[tuple[str, float], ...]

    def __call__(self, **features: float) -> float:
        return self.intercept_us + sum(c * features[name] for name, c in self.coefs)

    def to_dict(self) -> dict[str, float]:
        return {"intercept_us": self.intercept_us, **{f"{name}_us": c for name, c in self.coefs}}

    @classmethod
    def from_dict(cls, d: Any, path: str, names: tuple[str, ...]) -> "Linear":
        d = v.mapping(d, path)
        return cls(v.field(d, "intercept_us", path, float), tuple((n, v.field(d, f"{n}_us", path, float)) for n in names))


def fit_linear(features: np.ndarray, names: tuple[str, ...], target: np.ndarray) -> Linear:
    """Least squares on relative error with a non-negative intercept and slopes (a negative one is
    dropped and the rest refitted): a negative intercept (-813 µs on a gloo run) predicted small
    GEMMs at the 1 µs floor, far below anything a kernel takes.

    Args:
        features: one row per sample, one column per name.
        names: the features' names.
        target: the measured values (all positive).
    Returns:
        The Linear model (dropped features get slope 0, a dropped intercept 0).
    """
    INTERCEPT = -1
    active = [INTERCEPT, *range(len(names))]
    fitted: dict[int, float] = {}
    while active:
        a = np.column_stack([np.ones(len(target)) if c == INTERCEPT else features[:, c] for c in active]) / target[:, None]
        coef, *_ = np.linalg.lstsq(a, np.ones(len(target)), rcond=None)
        fitted = dict(zip(active, coef))
        negative = [c for c, x in fitted.items() if x < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda c: fitted[c]))
        fitted = {}
    return Linear(float(fitted.get(INTERCEPT, 0.0)), tuple((names[c], float(fitted.get(c, 0.0))) for c in range(len(names))))


GEMM_FEATURES = ("per_gflop", "per_mb", "per_m_outputs")
COMM_FEATURES = ("per_mb", "per_call")


def gemm_features(g: Gemm) -> dict[str, float]:
    """The CPU GEMM model's features.

    Output elements matter on CPU beyond FLOPs: bmm shapes with a large m x n and short k run
    several times slower per FLOP than square ones (measured on the demo workload).

    Args:
        g: the GEMM.
    Returns:
        GFLOPs, MB moved and millions of output elements, by ``GEMM_FEATURES`` name.
    """
    return {"per_gflop": g.flops / 1e9, "per_mb": g.nbytes / 1e6, "per_m_outputs": g.m * g.n * g.batch / 1e6}


def comm_features(nbytes: int, chunk_bytes: int = 0) -> dict[str, float]:
    """Bytes, and the number of calls a chunked all-reduce makes (each pays a latency).

    Args:
        nbytes: the collective's size.
        chunk_bytes: the chunk size (0: one call).
    Returns:
        MB and calls, by ``COMM_FEATURES`` name.
    """
    calls = -(-nbytes // chunk_bytes) if chunk_bytes else 1
    return {"per_mb": nbytes / 1e6, "per_call": float(calls)}


@dataclass(frozen=True)
class CpuPairwiseModel:
    """Fitted per thread count (compute) and per op (communication).

    GEMM shapes that were measured are predicted by their measurements: the median of the shape's
    own point and of the alone times its overlapped pairs took just before each pair (since fit
    revision 2; its own point alone before); the fitted line serves shapes never measured. On an
    oversubscribed CPU a line through noisy medians can be badly wrong for a measured shape,
    and the search must not trust it over the measurement.
    """

    compute: dict[int, Linear]
    comm: dict[str, Linear]
    compute_slow: dict[int, float]
    comm_slow: dict[int, float]
    simulated: bool = False
    family: str = "cpu-pairwise"
    measured: dict[tuple[str, int], float] = field(default_factory=dict)  # (shape, threads) -> median µs

    def _threads(self, settings: Mapping[str, Any], table: dict[int, Any]) -> int:
        t = int(settings.get("threads", 1))
        if t not in table:
            raise UserError(f"the model was not fitted for threads={t} (fitted: {sorted(table)})")
        return t

    def compute_time(self, gemm: Gemm, settings: Mapping[str, Any]) -> float:
        t = self._threads(settings, self.compute)
        if (gemm.shape_key, t) in self.measured:
            return self.measured[(gemm.shape_key, t)] / 1e6
        return max(self.compute[t](**gemm_features(gemm)), 1.0) / 1e6

    def comm_time(self, coll: Collective, settings: Mapping[str, Any]) -> float:
        fit = self.comm.get(coll.op)
        if fit is None:  # another op's curve would be a guess: gloo times each op as itself or not at all
            raise UserError(f"the model has no fit for {coll.op} (fitted: {', '.join(sorted(self.comm)) or 'none'})")
        return max(fit(**comm_features(coll.nbytes, int(settings.get("chunk_bytes", 0)))), 1.0) / 1e6

    def compute_slowdown(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        return self.compute_slow[self._threads(settings, self.compute_slow)]

    def comm_slowdown(self, coll: Collective, gemm: Gemm, settings: Mapping[str, Any]) -> float:
        return self.comm_slow[self._threads(settings, self.comm_slow)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "simulated": self.simulated,
            "units": {"*_us": "microseconds per unit of the named feature (GFLOP; MB = 1e6 bytes; m_outputs = 1e6 output elements; call = one collective call of a chunked all-reduce)", "slowdown": "time ratio, overlapped / alone"},
            "params": {
                "compute": {f"threads={t}": f.to_dict() for t, f in sorted(self.compute.items())},
                "comm": {op: f.to_dict() for op, f in sorted(self.comm.items())},
                "compute_slowdown": {f"threads={t}": s for t, s in sorted(self.compute_slow.items())},
                "comm_slowdown": {f"threads={t}": s for t, s in sorted(self.comm_slow.items())},
                "measured_gemms_us": {f"threads={t}": {k: us for (k, tt), us in sorted(self.measured.items()) if tt == t}
                                      for t in sorted({tt for _, tt in self.measured})},
            },
        }

    @classmethod
    def from_dict(cls, d: dict, path: str) -> "CpuPairwiseModel":
        p = v.mapping(v.field(d, "params", path, dict), f"{path}.params")

        def by_threads(key: str) -> tuple[dict, dict[int, str]]:
            """A ``threads=N`` table and its keys by N."""
            where = f"{path}.params.{key}"
            table = v.mapping(v.field(p, key, f"{path}.params", dict), where)
            for name in table:
                if not (isinstance(name, str) and name.startswith("threads=") and name[8:].isdigit()):
                    raise UserError(f"{where}: bad key {name!r} (expected threads=N)")
            return table, {int(name[8:]): name for name in table}

        def numbers(key: str) -> dict[int, float]:  # slowdowns: ratios of times, which the search divides by
            table, names = by_threads(key)
            return {t: v.field(table, name, f"{path}.params.{key}", float, minimum=v.POSITIVE) for t, name in names.items()}

        def measured() -> dict[tuple[str, int], float]:
            tables, names = by_threads("measured_gemms_us")
            out = {}
            for t, name in names.items():
                where = f"{path}.params.measured_gemms_us.{name}"
                table = v.mapping(tables[name], where)
                out.update({(str(k), t): v.field(table, k, where, float, minimum=v.POSITIVE) for k in table})
            return out

        compute, names = by_threads("compute")
        for key in ("compute_slowdown", "comm_slowdown"):  # the fit writes one per thread count it fitted
            counts = sorted(by_threads(key)[1])
            if counts != sorted(names):  # `comm_slowdown: {}` passed show and report, and search failed
                raise UserError(f"{path}.params.{key}: thread counts {counts}, but {path}.params.compute fits {sorted(names)}; "
                                "each needs a slowdown")
        return cls(
            compute={t: Linear.from_dict(compute[name], f"{path}.params.compute", GEMM_FEATURES) for t, name in names.items()},
            comm={op: Linear.from_dict(x, f"{path}.params.comm.{op}", COMM_FEATURES)
                  for op, x in v.mapping(v.field(p, "comm", f"{path}.params", dict), f"{path}.params.comm").items()},
            compute_slow=numbers("compute_slowdown"),
            comm_slow=numbers("comm_slowdown"),
            simulated=bool(d.get("simulated", False)),
            measured=measured() if "measured_gemms_us" in p else {},
        )


FAMILIES: dict[str, Any] = {"cpu-pairwise": CpuPairwiseModel, "lagom-gpu": LagomGpuModel}  # model.yaml's family -> reader


# The sections a model.yaml may hold (what the families' to_dict and the fit write); any other is refused by name.
MODEL_SECTIONS = ("schema_version", "kind", "family", "form", "simulated", "units", "device", "params", "accuracy")


def model_from_dict(d: Any, path: str = "model", expected: ModelExpectation | None = None) -> CostModel:
    """The cost model a ``model.yaml`` describes, of the family it names.

    Args:
        d: the loaded YAML.
        path: its field path, for errors.
        expected: what its run folder's profiles say it must be (``RunFolder.fitted_as``); None: any.
    Returns:
        The CostModel.
    Raises:
        UserError: for an unknown schema version or family, a model other than ``expected`` (another
            family: a GPU model asked for a CPU run's knobs; another GPU; another simulated label),
            or a bad field.
    """
    d = v.known_keys(v.document(d, path, "model file"), MODEL_SECTIONS, path)
    v.schema_version(d, path, SCHEMA_VERSION)
    family = v.one_of(v.field(d, "family", path, str), FAMILIES, f"{path}.family")
    simulated = v.field(d, "simulated", path, bool, False)
    if expected is not None:
        said = {"family": family, "simulated": simulated}
        if expected.sms is not None and isinstance(d.get("device"), dict):
            said["device.sms"] = d["device"].get("sms")
        wanted = {"family": expected.family, "simulated": expected.simulated, "device.sms": expected.sms}
        for key, value in said.items():
            if value != wanted[key]:
                raise UserError(f"{path}.{key}: {value}, but its run's profiles say {wanted[key]} (a model.yaml copied from "
                                f"another run?); rerun `lagom-tune fit` on the run folder")
    return FAMILIES[family].from_dict(d, path)


def accuracy_record(d: Any, path: str) -> dict[str, Any]:
    """A ``model.yaml``'s ``accuracy`` section, checked: what ``show``, ``search`` and the plan
    read from it (``FitResult.to_dict`` writes it).

    Args:
        d: the loaded section (None: absent).
        path: its field path, for errors.
    Returns:
        The section ({} when absent).
    Raises:
        UserError: naming the first bad field.
    """
    acc = v.mapping(d if d is not None else {}, path)
    v.field(acc, "rows", path, int, None, minimum=0)
    v.field(acc, "rows_digest", path, str, None)
    v.field(acc, "fit_revision", path, int, None, minimum=1)  # absent before 2026-12-06
    mape = v.number_map(v.field(acc, "mape", path, dict, {}), f"{path}.mape", minimum=0.0)
    v.number_map(v.field(acc, "scored", path, dict, {}), f"{path}.scored", minimum=0.0)  # absent before 2026-12-02
    noise = v.number_map(v.field(acc, "noise", path, dict, {}), f"{path}.noise", minimum=0.0)  # absent before 2026-12-06
    v.field(acc, "noise_method", path, str, "")
    remeasured = v.mapping(v.field(acc, "remeasured", path, dict, {}), f"{path}.remeasured")  # absent before 2026-12-07
    for name, entry in remeasured.items():
        where = f"{path}.remeasured.{name}"
        entry = v.mapping(entry, where)
        v.field(entry, "gap", where, float, minimum=0.0)
        v.field(entry, "median_ratio", where, float, minimum=v.POSITIVE)
        v.field(entry, "pairs", where, int, minimum=1)
    v.field(acc, "remeasured_method", path, str, "")
    warnings = v.field(acc, "warnings", path, list, [])
    for i, line in enumerate(warnings):
        if not isinstance(line, str):
            raise UserError(f"{path}.warnings[{i}]: expected str, got {line!r}")
    ranking = v.field(acc, "ranking", path, dict, {})
    v.field(ranking, "method", f"{path}.ranking", str, "")
    for key in ("median_spearman", "median_best_gap", "worst_best_gap"):  # NaN: undefined (constant predictions)
        v.field(ranking, key, f"{path}.ranking", float, None, finite=False)
    shapes = v.field(ranking, "shapes", f"{path}.ranking", list, [])
    for i, shape in enumerate(shapes):
        where = f"{path}.ranking.shapes[{i}]"
        shape = v.mapping(shape, where)
        v.field(shape, "shape", where, str)
        v.field(shape, "collective", where, str, "")  # absent before 2026-12-02: one job per shape
        v.field(shape, "spearman", where, float, finite=False)
        v.field(shape, "best_gap", where, float, finite=False)
        v.field(shape, "points", where, int, minimum=0)
    return {**acc, "mape": mape, "noise": noise, "remeasured": remeasured, "method": v.field(acc, "method", path, str, ""), "warnings": warnings,
            "ranking": {**ranking, "shapes": shapes} if ranking else {}}


def stale_reason(accuracy: dict[str, Any], rows: pd.DataFrame, run_path: str | Path) -> str | None:
    """Why a model no longer describes its run's measurements, or None: it was fitted to other
    rows (a resumed profile whose refit was interrupted left the partial profile's model, fitted to
    as many rows when the resume re-measured points cut from the CSV).

    Args:
        accuracy: the model's ``accuracy`` record (:func:`accuracy_record`).
        rows: the complete rows ``measurements.csv`` holds now.
        run_path: the run folder, for the advice.
    Returns:
        One line with what to do, or None (also for a model that recorded neither count nor digest).
    """
    fitted, digest = accuracy.get("rows"), accuracy.get("rows_digest")
    if isinstance(fitted, int) and not isinstance(fitted, bool) and fitted != len(rows):
        return (f"model.yaml was fitted to {fitted} measurement rows, measurements.csv now holds {len(rows)}; "
                f"rerun `lagom-tune fit {run_path}`")
    if digest is not None and digest != rows_digest(rows) and digest != legacy_rows_digest(rows):
        return (f"model.yaml was fitted to other measurement rows than measurements.csv holds now (as many, measured "
                f"again since); rerun `lagom-tune fit {run_path}`")
    return None


def fit_revision_note(accuracy: dict[str, Any], run_path: str | Path) -> str | None:
    """Why a model's figures and predictions may not be what this lagom-tune would fit to the same
    rows, or None: another revision of the fit (:data:`FIT_REVISION`) made it.

    Args:
        accuracy: the model's ``accuracy`` record (:func:`accuracy_record`).
        run_path: the run folder, for the advice.
    Returns:
        One line with what to do, or None when this revision fitted it.
    """
    fitted = accuracy.get("fit_revision")
    if fitted == FIT_REVISION:
        return None
    if fitted is None:
        by = "an older lagom-tune (before fit revisions were recorded)"
    else:
        by = f"{'an older' if fitted < FIT_REVISION else 'a newer'} lagom-tune (fit revision {fitted})"
    return (f"model.yaml was fitted by {by}; this one fits revision {FIT_REVISION}, which may predict otherwise from the "
            f"same measurements: `lagom-tune fit {run_path}` refits it, measuring nothing")


def run_problems(health: CsvHealth, model_doc: dict[str, Any] | None, rows: pd.DataFrame, run_path: str | Path) -> list[str]:
    """What ``show`` and ``report`` warn of for a run folder: its CSV's problems, a model fitted
    to other rows once the rows are whole (before, the rows are what is named), and a model that
    another revision of the fit made.

    Args:
        health: the CSV's health (``RunFolder.read``).
        model_doc: its ``model.yaml`` as read (None or {}: no model).
        rows: the complete rows read.
        run_path: the run folder.
    Returns:
        One line per problem.
    """
    stale = stale_reason(model_doc["accuracy"], rows, run_path) if model_doc and health.whole else None
    revision = fit_revision_note(model_doc["accuracy"], run_path) if model_doc else None
    return health.problems() + [line for line in (stale, revision) if line]


def read_model_file(path: str | Path, expected: ModelExpectation | None = None) -> dict[str, Any]:
    """``model.yaml`` as loaded, once its model and accuracy sections are checked.

    Args:
        path: the model file.
        expected: what its run folder's profiles say it must be; None: any.
    Returns:
        The document.
    Raises:
        UserError: for a file that is missing, not YAML, or has a bad field.
    """
    d = read_yaml(path, "model file")
    model_from_dict(d, str(path), expected)
    return {**d, "accuracy": accuracy_record(d.get("accuracy"), f"{path}.accuracy")}


def load_model(path: str | Path, expected: ModelExpectation | None = None) -> tuple[CostModel, dict[str, Any]]:
    """The model and its accuracy record from ``model.yaml``.

    Args:
        path: the model file.
        expected: what its run folder's profiles say it must be; None: any.
    Returns:
        The CostModel and its ``accuracy`` mapping ({} when absent).
    """
    return model_document(read_yaml(path, "model file"), str(path), expected)


def model_document(d: Any, path: str, expected: ModelExpectation | None = None) -> tuple[CostModel, dict[str, Any]]:
    """The model and its accuracy record from a loaded ``model.yaml``, checked as every verb reads it
    (``fit`` checks what it is about to write with it, so it never writes what the others refuse).

    Args:
        d: the loaded YAML.
        path: its path, for errors.
        expected: what its run folder's profiles say it must be; None: any.
    Returns:
        The CostModel and its ``accuracy`` mapping ({} when absent).
    Raises:
        UserError: naming the field, as :func:`model_from_dict` and :func:`accuracy_record` do.
    """
    model = model_from_dict(d, path, expected)
    return model, accuracy_record(d.get("accuracy") if isinstance(d, dict) else None, f"{path}.accuracy")
