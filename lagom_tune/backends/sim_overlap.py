"""The SIMULATED GPU's two streams played together, CTA group by CTA group.

The ground truth of an overlap: not two rates switched the instant the other stream starts or ends
(the fitted model's timeline, ``lagom_tune.timeline``), but the mechanism under them:

* a GEMM kernel's CTAs run in groups (``sim_compute.group_shares``), each dispatched as a place
  frees up and running its tiles at the pace of the moment it started: a group that started
  beside a collective keeps its contended pace after the collective ends, and one that started
  alone keeps its pace when channel blocks arrive;
* a collective's channel blocks hold their SMs from its start to its end: groups dispatched while
  it runs find fewer places, and groups waiting for a place start the moment it ends;
* a collective runs at its contended rate while the GEMM's CTAs run beside it (their HBM traffic
  slows its steps, ``sim_comm.copy_slowdown``) and alone in the gaps (a kernel's launch, the
  compute stream done); its steps are microseconds, so it moves continuously.

So a collective ending part way through a kernel frees the places its blocks held for the waiting
groups only, and a kernel's tail stretches by the groups that started before the change.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lagom_tune.backends.sim_clusters import Cluster
from lagom_tune.backends.sim_compute import IDLE, Contention, choose_kernel, condition, gemm_run, group_shares
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
    """
    def cond(g: Gemm, load: Contention):
        return condition(c, g, choose_kernel(c, g), load)

    now, i, j = 0.0, 0, 0
    kernel: _Kernel | None = None
    left = comm[0].alone_s if comm else 0.0  # the current collective's remaining time alone
    comm_start: float | None = None
    spans: list[Span] = []
    while i < len(compute) or j < len(comm):
        comm_on = j < len(comm) and (comm[j].after is None or comm[j].after < i)
        if comm_on and comm_start is None:
            comm_start = now
        load = comm[j].load if comm_on else IDLE
        if i < len(compute):
            g = compute[i]
            if kernel is None:
                runs = deque([tiles, len(list(same))] for tiles, same in itertools.groupby(group_shares(c, choose_kernel(c, g))))
                kernel = _Kernel(g, now, now + cond(g, load).launch_s, runs)
            if now >= kernel.ready:
                run = cond(g, load)
                kernel.dispatch(now, run.places, run.tile_s)
        computing = kernel is not None and bool(kernel.running)
        rate = 1.0
        if comm_on and computing:
            slowdown = comm[j].slowdown(cond(kernel.gemm, load).drawn)
            if not 0 < slowdown < math.inf:
                raise ValueError(f"slowdown {slowdown!r} of {comm[j].name}: times alone and slowdowns must be positive numbers")
            rate = 1.0 / slowdown
        events = []
        if kernel is not None:
            events.append(kernel.running[0][0] if kernel.running else kernel.ready)
        if comm_on:
            events.append(now + left / rate)
        if not all(now <= t < math.inf for t in events):  # min() would pass over a NaN
            raise ValueError(f"events at {events!r} after {now!r}: times alone and slowdowns must be positive numbers")
        nxt = min(events)
        if comm_on:
            left = 0.0 if nxt == now + left / rate else left - (nxt - now) * rate
        now = nxt
        if kernel is not None:
            kernel.retire(now)
            if not kernel.running and not kernel.waiting and now >= kernel.ready:
                spans.append(Span(kernel.gemm.name, "compute", kernel.start, now))
                kernel, i = None, i + 1
        if comm_on and left <= 0.0:
            spans.append(Span(comm[j].name, "comm", comm_start, now))
            j, comm_start = j + 1, None
            left = comm[j].alone_s if j < len(comm) else 0.0
    y_alone = sum(gemm_run(c, g)[0] for g in compute)
    return Timeline(now, tuple(spans), float(y_alone), float(sum(x.alone_s for x in comm)))
