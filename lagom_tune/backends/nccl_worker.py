"""Inside a worker process of the nccl backend: GPU timing with CUDA events.

A worker is started fresh for each NCCL environment (see ``nccl_sweep.batches``), joins the
job's store under a prefix of its own, builds one process group per (layout, channels), and
measures its points in order, sending each point's rows to its parent as soon as they exist.

Timing rules (DESIGN.md §5): warm-ups, a barrier before each timed repeat, CUDA events on the
stream that runs the work, every repeat kept; the parent takes the max over ranks.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from typing import Any

from lagom_tune.backends.base import Point
from lagom_tune.backends.nccl_sweep import PROBE, channel_options, subgroups
from lagom_tune.backends.probe import Probe, probe_geometry, steps_for

TARGET_US = 200.0  # a timed GEMM sample spans at least this long (CUDA events resolve ~0.5 µs)
OVERLAP_MIN_S = 1e-3  # overlapped windows last at least this long


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world: int
    local_rank: int
    gpus_per_node: int
    store_host: str
    store_port: int
    prefix: str
    points: tuple[Point, ...]
    repeats: int
    timeout_s: float
    standin: bool = False  # CPU and gloo instead of CUDA and NCCL: tests of the orchestration only


def worker_main(spec: WorkerSpec, results) -> None:
    """Entry point of a worker process; reports ("rows", i, rows), then ("done",) or ("error", msg)."""
    import torch
    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.PrefixStore(spec.prefix, dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                                                           timeout=timeout, wait_for_workers=False))
        if spec.standin:
            dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world, timeout=timeout)
            meter: Any = StandInMeter(dist)
        else:
            torch.cuda.set_device(spec.local_rank)
            dist.init_process_group("nccl", store=store, rank=spec.rank, world_size=spec.world, timeout=timeout,
                                    device_id=torch.device("cuda", spec.local_rank))
            meter = CudaMeter(spec, torch, dist)
        for i, point in enumerate(spec.points):
            results.put(("rows", i, meter.measure(point, spec.repeats)))
        dist.barrier()
        dist.destroy_process_group()
        results.put(("done",))
    except Exception as e:  # the parent names the rank and ends the run
        results.put(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1)


class StandInMeter:
    """The gloo backend's CPU measurements behind the worker protocol (tests only)."""

    def __init__(self, dist):
        from lagom_tune.backends.gloo import MEASURE

        self.dist, self.table = dist, MEASURE

    def measure(self, point: Point, repeats: int) -> list[dict]:
        if point.op == PROBE:
            raise RuntimeError("the contention probe needs a CUDA GPU")
        return self.table[point.kind](point, repeats, self.dist)


def collective_call(dist, op: str, nbytes: int, ranks: int, group, device, dtype):
    """A closure running ``op`` on ``nbytes`` (nccl-tests sizes: AG output, RS input) in ``group``."""
    import torch

    words = max(ranks, nbytes // torch.tensor([], dtype=dtype).element_size() // ranks * ranks)
    big = torch.ones(words, dtype=dtype, device=device)
    part = torch.ones(words // ranks, dtype=dtype, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = torch.empty_like(big)
    calls = {
        "all_reduce": lambda: dist.all_reduce(big, group=group),
        "all_gather": lambda: gather(big, part, group=group),
        "reduce_scatter": lambda: scatter(part, big, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, big, group=group),
        "broadcast": lambda: dist.broadcast(big, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group),
    }
    return calls[op]


class CudaMeter:
    """GEMMs, collectives, overlapped pairs and the probe, timed with CUDA events."""

    def __init__(self, spec: WorkerSpec, torch, dist):
        self.spec, self.torch, self.dist = spec, torch, dist
        self.device = torch.device("cuda", spec.local_rank)
        self.groups: dict[tuple, Any] = {}
        self.side = torch.cuda.Stream(device=self.device)

    # -- plumbing ------------------------------------------------------------------------------

    def barrier(self) -> None:
        self.dist.barrier(device_ids=[self.spec.local_rank])
        self.torch.cuda.synchronize(self.device)

    def group(self, point: Point):
        """The process group for the point's layout and channels (min_ctas = max_ctas = channels)."""
        s = point.settings
        key = (point.ranks, s.get("nodes", 1), s["channels"])
        if key not in self.groups:
            opts = channel_options(self.dist.ProcessGroupNCCL.Options, point.ranks, s["channels"])
            layout = subgroups(self.spec.world, point.ranks, s.get("nodes", 1))
            mine, _ = self.dist.new_subgroups_by_enumeration(layout, backend="nccl", pg_options=opts)
            self.groups[key] = mine
        return self.groups[key]

    def events(self):
        ev = self.torch.cuda.Event
        return ev(enable_timing=True), ev(enable_timing=True)

    def time_us(self, fn, inner: int = 1) -> float:
        start, end = self.events()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / inner

    def matmul(self, point: Point):
        from lagom_tune.backends.gloo import operands

        a, b = operands(point.gemm, self.device)
        return lambda: self.torch.matmul(a, b)

    def comm(self, point: Point, nbytes: int | None = None):
        if point.op == PROBE:
            s = point.settings
            probe = Probe(probe_geometry(nbytes or point.nbytes, s["channels"], s["buffsize"]), s["threads"], self.device)
            return probe.launch, probe
        fn = collective_call(self.dist, point.op, point.nbytes, point.ranks, self.group(point), self.device, self.torch.float32)
        return fn, None

    def probe_lasting(self, point: Point, seconds: float):
        """The probe of ``point``'s channels and buffer size, sized from a timed 16 MiB trial."""
        s = point.settings
        trial = probe_geometry(16 << 20, s["channels"], s["buffsize"])
        launch, _ = self.comm(point, trial.nbytes)
        launch()  # compiles
        steps = steps_for(seconds, trial.steps, self.time_us(launch) / 1e6)
        return self.comm(point, trial.nbytes * steps // trial.steps)

    def repeat(self, fn, repeats: int, inner: int = 1) -> list[float]:
        out = []
        for _ in range(repeats):
            self.barrier()
            out.append(self.time_us(fn, inner))
        return out

    # -- measurements --------------------------------------------------------------------------

    def measure(self, point: Point, repeats: int) -> list[dict]:
        rows = getattr(self, point.kind)(point, repeats)
        self.torch.cuda.empty_cache()
        return rows

    def gemm(self, point: Point, repeats: int) -> list[dict]:
        mm = self.matmul(point)
        for _ in range(3):
            mm()
        once = self.time_us(mm)
        inner = max(1, min(100, round(TARGET_US / max(once, 1e-3))))
        return [{"time_us": t, "inner": inner} for t in self.repeat(mm, repeats, inner)]

    def collective(self, point: Point, repeats: int) -> list[dict]:
        fn, probe = self.comm(point)
        for _ in range(2):  # the first call also creates the communicator
            fn()
        extra = {"nbytes": probe.geometry.nbytes} if probe else {}
        return [{"time_us": t, **extra} for t in self.repeat(fn, repeats)]

    def overlap(self, point: Point, repeats: int) -> list[dict]:
        """The collective (or probe) on a side stream, ``n`` GEMMs on the main one, started together;
        ``n`` (and the probe's size) are chosen so both streams alone last about as long."""
        mm = self.matmul(point)
        for _ in range(3):
            mm()
        from lagom_tune.backends.gloo import slowest_rank

        y = statistics.median(self.time_us(mm) for _ in range(3)) / 1e6
        (y,) = slowest_rank(self.dist, (y,), self.device)  # every rank must run the same number of GEMMs
        if point.op == PROBE:  # the probe is sized to last as long as n GEMMs of at least 1 ms
            n = max(1, round(OVERLAP_MIN_S / y))
            fn, probe = self.probe_lasting(point, n * y)
        else:
            fn, probe = self.comm(point)
            fn()
        x = statistics.median(self.time_us(fn) for _ in range(3)) / 1e6
        (x,) = slowest_rank(self.dist, (x,), self.device)
        if point.op != PROBE:  # as many GEMMs as last about as long as the collective
            n = max(1, round(x / y))
        rows = []
        for _ in range(repeats):
            self.barrier()
            start, comp_end = self.events()
            _, comm_end = self.events()
            start.record()
            self.side.wait_event(start)
            with self.torch.cuda.stream(self.side):
                fn()
                comm_end.record()
            for _ in range(n):
                mm()
            comp_end.record()
            self.torch.cuda.synchronize(self.device)
            t_comp, t_comm = start.elapsed_time(comp_end) * 1e3, start.elapsed_time(comm_end) * 1e3
            rows.append({"time_us": t_comp, "comm_us": t_comm, "window_us": max(t_comp, t_comm), "n_compute": n,
                         "compute_alone_us": y * n * 1e6, "comm_alone_us": x * 1e6,
                         **({"nbytes": probe.geometry.nbytes} if probe else {})})
        return rows
