"""The Backend protocol and the measurement points it is asked to time (knobs: ``lagom_tune.knobs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from lagom_tune.backends.registry import PROBE_OP, BackendInfo, backend_info, record_of
from lagom_tune.errors import UserError
from lagom_tune.knobs import Knob, KnobSpace
from lagom_tune.measurements import AGAIN, BANDWIDTH_COLUMNS, DEFAULT, TIMED_COLUMNS, again_key
from lagom_tune.workload.spec import Gemm, Workload

__all__ = ["Backend", "BackendOptions", "Knob", "KnobSpace", "LocalBackend", "Point", "RegisteredBackend", "get_backend"]

@dataclass(frozen=True)
class Point:
    """One thing to measure: an isolated GEMM, an isolated collective, or the two overlapped.

    A point with ``again`` set is measured exactly as the one without it (a backend never asks),
    under a key of its own, and its rows are of kind ``again`` (``measurements.AGAIN``).
    """

    kind: str  # "gemm" | "collective" | "overlap" | "default" | "iteration" (a whole workload replayed)
    config: tuple[tuple[str, Any], ...]
    gemm: Gemm | None = None
    op: str | None = None
    nbytes: int = 0
    ranks: int = 1
    workload: Workload | None = field(default=None, compare=False)
    again: bool = False  # a second measurement of the same point, at the profile's end

    @property
    def key(self) -> str:
        parts = [self.kind]
        if self.gemm is not None:
            parts.append(self.gemm.shape_key)
        if self.op is not None:
            parts.append(f"{self.op}:{self.nbytes}:{self.ranks}")
        parts += [f"{k}={val}" for k, val in self.config]
        key = "|".join(parts)
        return again_key(key) if self.again else key

    @property
    def row_kind(self) -> str:
        """The ``kind`` its rows record: its own, or ``again``."""
        return AGAIN if self.again else self.kind

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.config)


GIB = 1 << 30


def rank_bytes(point: Point) -> int:
    """Bytes one rank allocates to measure ``point``, at least: its GEMM's A, B and C and its
    collective's buffer; a replayed iteration holds every GEMM shape and buffer size of its
    workload at once.

    Args:
        point: a point of any kind.
    Returns:
        The bytes.
    """
    if point.workload is not None:
        w = point.workload
        return sum(g.nbytes for g in w.gemms().values()) + sum({c.nbytes for c in w.collectives()})
    return (point.gemm.nbytes if point.gemm is not None else 0) + point.nbytes


def check_memory(points: list[Point], fingerprint: dict[str, Any]) -> None:
    """Refuse, before any is measured, points a rank cannot hold (``fingerprint["rank_memory_GiB"]``:
    a GPU's memory, or a CPU rank's share of the memory available), naming the largest.

    Args:
        points: the points to measure.
        fingerprint: the backend's (without ``rank_memory_GiB`` nothing is checked).
    Raises:
        UserError: the largest point's need and what a rank has.
    """
    have = fingerprint.get("rank_memory_GiB")
    if not have or not points:
        return
    big = max(points, key=rank_bytes)
    need = rank_bytes(big) / GIB
    if need > have:
        parts = ([f"the GEMM {big.gemm.shape_key} ({big.gemm.nbytes / GIB:.1f} GiB)"] if big.gemm is not None else []) + \
                ([f"the {big.op} of {big.nbytes} bytes ({big.nbytes / GIB:.1f} GiB)"] if big.nbytes else [])
        what = f"an iteration of {big.workload.name}" if big.workload is not None else " beside ".join(parts)
        raise UserError(f"{what} needs {need:.1f} GiB on each rank, at least; a rank here has {have:.1f} GiB")


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor (the single-GPU contention probe moves its bytes once).

    Args:
        op: a collective op, or the probe's (:data:`~lagom_tune.backends.registry.PROBE_OP`).
        ranks: ranks in the communicator.
    Returns:
        busbw / algbw for the op.
    """
    n = max(ranks, 1)
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, PROBE_OP: 1.0}.get(op, (n - 1) / n)


def bandwidth_columns(op: str, nbytes: int, ranks: int, seconds: float) -> dict[str, float]:
    """nccl-tests' bandwidth columns for one timed collective.

    Args:
        op: the collective op.
        nbytes: its size (nccl-tests' convention).
        ranks: ranks in the communicator.
        seconds: its time.
    Returns:
        ``algbw_GBps`` and ``busbw_GBps`` (NaN for a time of 0).
    """
    algbw = nbytes / seconds / 1e9 if seconds > 0 else math.nan
    return dict(zip(BANDWIDTH_COLUMNS, (algbw, algbw * bus_factor(op, ranks))))


def reduce_ranks(point: Point, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per repeat from every rank's rows: a repeat takes as long as its slowest rank
    (nccl-tests' convention); collectives gain nccl-tests' ``algbw``/``busbw`` columns.

    Args:
        point: the measured point.
        per_rank: each rank's rows, one per repeat.
    Returns:
        The merged rows, with ``repeat`` numbered from 0.
    Raises:
        ValueError: when the ranks returned different numbers of repeats.
    """
    if len({len(rows) for rows in per_rank}) > 1:
        raise ValueError(f"ranks returned different numbers of repeats for {point.key}")
    merged = []
    for rep, rows in enumerate(zip(*per_rank)):
        row = dict(rows[0])
        for col in TIMED_COLUMNS:
            if col in row:
                row[col] = max(r[col] for r in rows)
        row["repeat"] = rep
        if point.op and point.kind in ("collective", DEFAULT):
            row.update(bandwidth_columns(point.op, int(row.get("nbytes", point.nbytes)), point.ranks, row["time_us"] / 1e6))
        merged.append(row)
    return merged


def trimmed_mean(values: list[float], keep: float = 0.75) -> float:
    """Mean of the fastest ``keep`` fraction (AutoCCL's statistic; robust to a slow outlier).

    Args:
        values: the repeats' times.
        keep: the fraction kept (at least one value).
    Returns:
        The mean of the kept values.
    """
    fastest = sorted(values)[:max(1, math.ceil(len(values) * keep))]
    return sum(fastest) / len(fastest)


RowSink = Callable[[Point, list[dict[str, Any]]], None]


class Backend(Protocol):
    name: str  # its registry record's (``RegisteredBackend``)
    simulated: bool  # its registry record's
    knob_space: KnobSpace
    writer: bool  # this process owns the run folder (rank 0 of a distributed backend)

    def share(self, value: Any) -> Any:
        """The writer's ``value`` on every process of the backend (so all ranks agree on a sweep)."""

    def fingerprint(self) -> dict[str, Any]:
        """Environment facts recorded in ``meta.yaml`` (and compared by ``apply``)."""

    def plan_points(self, workload: Workload) -> list[Point]:
        """Every point worth measuring for ``workload``, in a deterministic order."""

    def measure(self, points: list[Point], repeats: int, sink: RowSink) -> None:
        """Measure ``points`` and hand each one's raw rows (one per repeat) to ``sink`` as it completes."""


class RegisteredBackend:
    """A backend whose ``name`` and ``simulated`` are read from its registry record, the one source
    (``registry.py``: the record whose factory is the backend's class)."""

    @property
    def info(self) -> BackendInfo:
        """The backend's registry record."""
        return record_of(type(self))

    @property
    def name(self) -> str:
        """What ``--backend`` calls it."""
        return self.info.name

    @property
    def simulated(self) -> bool:
        """Whether its numbers come from a simulator."""
        return self.info.simulated


class LocalBackend(RegisteredBackend):
    """A backend driven from this one process: it owns the run folder and needs no agreement."""

    writer = True

    def share(self, value: Any) -> Any:
        return value


MAX_NOISE = 0.5  # a simulated measurement's multiplicative noise (sigma), at most


@dataclass
class BackendOptions:
    ranks: int = 2
    hardware: str | None = None
    nodes: int | None = None  # None: a backend that simulates a cluster sizes it to the workload
    seed: int = 0
    noise: float = 0.0  # 0 to MAX_NOISE
    timeout_s: float = 60.0
    extra: dict = field(default_factory=dict)


def get_backend(name: str, options: BackendOptions) -> Backend:
    """Build the backend called ``name`` (its registry record's factory).

    Args:
        name: a registered backend (``--backend``).
        options: ranks, hardware, nodes, seed, ... (each backend reads what it needs).
    Returns:
        The Backend.
    Raises:
        UserError: one line naming the available backends, for an unknown name.
    """
    return backend_info(name).create(options)
