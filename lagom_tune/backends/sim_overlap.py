"""The SIMULATED GPU's two streams played together, CTA group by CTA group.

The ground truth of an overlap: not two rates switched the instant the other stream starts or ends
(the fitted model's timeline, ``lagom_tune.timeline``), but the mechanism under them:

* a GEMM kernel's CTAs run in groups (``sim_compute.group_shares``), each dispatched as a place
  frees up and running its tiles at the pace of the moment it started: a group that started
  beside a collective keeps its contended pace after the collective ends, and one that started
  alone keeps its pace when channel blocks arrive;
* a collective's channel blocks hold their SMs from its start to its end: groups dispatched while
  it runs find fewer places, and groups waiting for a place start the moment it ends. One that
  starts while the GEMM's CTAs fill the SMs waits, making no progress, until enough of them have
  finished (freed SMs go to its blocks first);
* a collective runs at its contended rate while the GEMM's CTAs run beside it (their HBM traffic
  slows its steps, ``sim_comm.copy_slowdown``) and alone in the gaps (a kernel's launch, the
  compute stream done); its steps are microseconds, so it moves continuously.

So a collective ending part way through a kernel frees the places its blocks held for the waiting
groups only, and a kernel's tail stretches by the groups that started before the change.

Known simplification: a group's pace is its kernel's under the load of the moment as
``sim_compute.condition`` has it, with as many CTAs running as fit, so a short tail of groups
started after the blocks leave is charged a full device's share of HBM. For narrow, memory-bound
GEMMs a partial overlap can then come out slower than a whole one (an audit, 2026-12-03: up to
1.115x in 91 of the cases it tried; none among the paper presets' spans).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lagom_tune.backends.sim_clusters import Cluster
from lagom_tune.backends.sim_compute import IDLE, Condition, Contention, choose_kernel, condition, gemm_run, group_shares
from lagom_tune.timeline import Span, Timeline
from lagom_tune.workload.spec import Gemm


@dataclass(frozen=True)
class CommRun:
    """One collective as the co-simulation plays it."""

    name: str
    after: int | None  # it waits for this computation to end (None: for none)
    alone_s: float
    load: Contention  # what it takes from a GEMM beside it
    slowdown: Callable[[float], float]  # its slowdown beside a GEMM drawing this many HBM bytes/s


@dataclass
class _Kernel:
    """A kernel in flight: its groups waiting, as runs of ``[tiles each, groups]`` in dispatch
    order, and running, as ``(end, groups)`` started together (a heap)."""

    gemm: Gemm
    start: float
    ready: float  # launch done: groups may start
    waiting: deque[list[int]]
    running: list[tuple[float, int]] = field(default_factory=list)
    groups_running: int = 0

    def dispatch(self, now: float, places: int, tile_s: float) -> None:
        """Start waiting groups, in order, on the places free at ``now``."""
        while self.waiting and self.groups_running < places:
            run = self.waiting[0]
            n = min(run[1], places - self.groups_running)
            heapq.heappush(self.running, (now + run[0] * tile_s, n))
            self.groups_running += n
            run[1] -= n
            if not run[1]:
                self.waiting.popleft()

    def retire(self, now: float) -> None:
        """Groups whose tiles are done by ``now`` leave their places."""
        while self.running and self.running[0][0] <= now:
            self.groups_running -= heapq.heappop(self.running)[1]


def play(c: Cluster, compute: Sequence[Gemm], comm: Sequence[CommRun]) -> Timeline:
    """One overlap group on the simulated device: its GEMMs in order on one stream, its collectives
    in order on the other.

    Args:
        c: the simulated device.
        compute: the GEMMs, in stream order.
        comm: the collectives, in stream order.
    Returns:
        The Timeline (makespan, spans, times alone) as the ground truth has it.
    Raises:
        ValueError: a time alone or a slowdown that is not a positive finite number.
    """
    for x in comm:
        if not 0 <= x.alone_s < math.inf:
            raise ValueError(f"time alone {x.alone_s!r} of {x.name}: times alone and slowdowns must be positive numbers")
    now, i, j = 0.0, 0, 0
    kernel: _Kernel | None = None
    left = comm[0].alone_s if comm else 0.0  # the current collective's remaining time alone
    comm_start: float | None = None
    resident = False  # the current collective's channel blocks hold their SMs
    spans: list[Span] = []
    while i < len(compute) or j < len(comm):
        comm_on = j < len(comm) and (comm[j].after is None or comm[j].after < i)
        if comm_on and comm_start is None:
            comm_start = now
        load = comm[j].load if comm_on else IDLE
        if comm_on and not resident:
            # The blocks wait for SMs the GEMM's running CTAs hold; freed ones go to them first.
            resident = kernel is None or kernel.groups_running <= _condition(c, kernel.gemm, load).places
        if kernel is None and i < len(compute):
            g = compute[i]
            # Whole kernels in one step where nothing can change during them: a collective only
            # becomes ready at a kernel's end, so one not running now stays off for this kernel.
            whole = _whole_kernel(c, g, comm[j] if comm_on else None, left)
            if whole is not None:
                seconds, used = whole
                spans.append(Span(g.name, "compute", now, now + seconds))
                now, left, i = now + seconds, left - used, i + 1
                continue
            kernel = _Kernel(g, now, now + _condition(c, g, load).launch_s, deque(list(r) for r in group_shares(c, choose_kernel(c, g))))
        if kernel is not None and now >= kernel.ready:
            run = _condition(c, kernel.gemm, load)
            kernel.dispatch(now, run.places, run.tile_s)
        rate = 1.0 if resident else 0.0
        if resident and kernel is not None and kernel.running:
            rate = 1.0 / _slowdown(comm[j], _condition(c, kernel.gemm, load).drawn)
        events = []
        if kernel is not None:
            events.append(kernel.running[0][0] if kernel.running else kernel.ready)
        if comm_on and rate:
            events.append(now + left / rate)
        if not events:
            raise ValueError(f"{comm[j].name} waits for computation {comm[j].after}, which the group does not have")
        if not all(now <= t < math.inf for t in events):  # min() would pass over a NaN
            raise ValueError(f"events at {events!r} after {now!r}: times alone and slowdowns must be positive numbers")
        nxt = min(events)
        if comm_on and rate:
            left = 0.0 if nxt == now + left / rate else left - (nxt - now) * rate
        now = nxt
        if kernel is not None:
            kernel.retire(now)
            if not kernel.running and not kernel.waiting and now >= kernel.ready:
                spans.append(Span(kernel.gemm.name, "compute", kernel.start, now))
                kernel, i = None, i + 1
        if comm_on and resident and left <= 0.0:
            spans.append(Span(comm[j].name, "comm", comm_start, now))
            j, comm_start, resident = j + 1, None, False
            left = comm[j].alone_s if j < len(comm) else 0.0
    y_alone = sum(gemm_run(c, g)[0] for g in compute)
    return Timeline(now, tuple(spans), float(y_alone), float(sum(x.alone_s for x in comm)))


def _condition(c: Cluster, g: Gemm, load: Contention) -> Condition:
    return condition(c, g, choose_kernel(c, g), load)


def _slowdown(x: CommRun, drawn: float) -> float:
    slowdown = x.slowdown(drawn)
    if not 0 < slowdown < math.inf:
        raise ValueError(f"slowdown {slowdown!r} of {x.name}: times alone and slowdowns must be positive numbers")
    return slowdown


def _whole_kernel(c: Cluster, g: Gemm, x: CommRun | None, left: float) -> tuple[float, float] | None:
    """A kernel launched now with nothing changing until it ends: alone (no collective running), or
    beside a collective that outlasts it. Its seconds and the collective's time alone it uses (its
    launch at the alone rate, its CTAs' run at the contended one); None when the collective ends
    part way."""
    if x is None:
        return gemm_run(c, g)[0], 0.0
    seconds = gemm_run(c, g, x.load)[0]
    run = _condition(c, g, x.load)
    used = run.launch_s + (seconds - run.launch_s) / _slowdown(x, run.drawn)
    return (seconds, used) if used < left else None
