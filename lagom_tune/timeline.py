"""Two-stream timeline of one overlap group (DESIGN.md §6, "Makespan").

Computations run in order on one stream, collectives in order on another. Each op progresses at a
rate set by what runs beside it at that moment, re-evaluated whenever an op starts or ends, so
slowing one collective shifts the windows of everything after it (the paper's "cascade"). A
collective with ``after = i`` waits until computation ``i`` has finished.

Below both the model (which checks its fit on overlapped points with it) and the search (which
plays whole iterations with it), it imports nothing from lagom-tune: an op is anything with a
``name`` (a ``workload.spec.Gemm``), a collective anything with a ``name`` and an ``after`` (a
``workload.spec.Collective``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Protocol, Sequence


class Op(Protocol):
    """A computation on the compute stream."""

    name: str


class CommOp(Protocol):
    """A collective on the communication stream: it waits for computation ``after`` (None: for none)."""

    name: str
    after: int | None


# (computation, collective) -> (computation's slowdown, collective's slowdown) while both run.
Slowdowns = Callable[[Any, Any], tuple[float, float]]


@dataclass(frozen=True)
class Span:
    """One op's time on its stream, in seconds from the group's start."""

    name: str
    stream: str  # "compute" | "comm"
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """A played group: when it ended, each op's span, and the streams' times alone."""

    makespan: float
    spans: tuple[Span, ...]
    y_alone: float  # sum of computation times alone
    x_alone: float  # sum of collective times alone

    @cached_property
    def compute_time(self) -> float:
        """Y: total time computations took, contention included."""
        return sum(s.duration for s in self.spans if s.stream == "compute")

    @cached_property
    def comm_time(self) -> float:
        """X: total time collectives took, contention included."""
        return sum(s.duration for s in self.spans if s.stream == "comm")

    @property
    def stream_bound(self) -> float:
        """max(Y, X): no schedule of these (contended) op times can beat it."""
        return max(self.compute_time, self.comm_time)


def simulate(compute: Sequence[Op], y: Sequence[float], comm: Sequence[CommOp], x: Sequence[float],
             slowdowns: Slowdowns) -> Timeline:
    """Play one overlap group on the two streams.

    Args:
        compute: the computations, in stream order.
        y: each computation's time alone, in seconds.
        comm: the collectives, in stream order.
        x: each collective's time alone, in seconds.
        slowdowns: both ops' slowdown factors while they run beside each other.
    Returns:
        The Timeline (makespan, spans, alone times).
    """
    n, m = len(compute), len(comm)
    i = j = 0
    left_y = y[0] if n else 0.0  # remaining alone-time of the current op
    left_x = x[0] if m else 0.0
    now = 0.0
    start_y = start_x = 0.0
    spans: list[Span] = []
    x_started = False
    while i < n or j < m:
        comp_on = i < n
        comm_on = j < m and (comm[j].after is None or comm[j].after < i)
        if comm_on and not x_started:
            start_x, x_started = now, True
        if not comp_on and not comm_on:  # cannot happen: `after` always names an existing computation
            raise RuntimeError("timeline stalled")
        sy = sx = 1.0
        if comp_on and comm_on:
            sy, sx = slowdowns(compute[i], comm[j])
        dt_y = left_y * sy if comp_on else float("inf")
        dt_x = left_x * sx if comm_on else float("inf")
        for on, t in ((comp_on, dt_y), (comm_on, dt_x)):  # min() would pass over a NaN and spin for ever
            if on and not 0 <= t < float("inf"):
                raise ValueError(f"op time {t!r} in the timeline: times alone and slowdowns must be positive numbers")
        dt = min(dt_y, dt_x)
        now += dt
        if comp_on:
            left_y -= dt / sy
        if comm_on:
            left_x -= dt / sx
        if comp_on and dt_y <= dt:
            spans.append(Span(compute[i].name, "compute", start_y, now))
            i += 1
            start_y = now
            left_y = y[i] if i < n else 0.0
        if comm_on and dt_x <= dt:
            spans.append(Span(comm[j].name, "comm", start_x, now))
            j += 1
            x_started = False
            left_x = x[j] if j < m else 0.0
    return Timeline(now, tuple(spans), float(sum(y)), float(sum(x)))
