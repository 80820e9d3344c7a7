"""Inside a worker process of the nccl backend: GPU timing with CUDA events.

A worker is started fresh for each NCCL environment (see ``nccl_sweep.batches``), joins the
job's store under a prefix of its own, builds one process group per (layout, channels), and
measures its points in order, sending each point's rows to its parent as soon as they exist.

Timing rules (DESIGN.md §5 and §10, ``gpu_timing``): warm-ups, a barrier before each timed repeat,
CUDA events on the stream that runs the work, short launches replayed from CUDA graphs, every
baseline timed the same way right before what it is compared with, every repeat kept; the parent
takes the max over ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, replace
from typing import Any

from lagom_tune.backends.base import Point
from lagom_tune.backends.gpu_timing import MAX_LAUNCHES, Launches, launch_count, launches, time_overlapped, time_run
from lagom_tune.backends.nccl_sweep import JOB_REFERENCE, PROBE, channel_options, job_key, subgroups
from lagom_tune.backends.parent_watch import end_reported, exit_with_parent
from lagom_tune.backends.probe import Probe, probe_geometry, steps_for
from lagom_tune.backends.nccl_log import FILE_ENV, LogReader, last_call, log_path, warnings
from lagom_tune.backends.nccl_tuner import PLUGIN_ENV, choice_between, hold_tuner, read_nccl_choices
from lagom_tune.measurements import CHOSEN_COLUMNS, DEFAULT, PAIRED, overlap_columns, timed_columns

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
    # overlapped jobs an earlier batch sized, (job_key, n GEMMs, probe bytes): the same job at every setting
    jobs: tuple[tuple[tuple, int, int], ...] = ()


def worker_main(spec: WorkerSpec, results, parent: int) -> None:
    """Entry point of a worker process; reports ("rows", i, rows), then ("done", jobs) with the
    overlapped jobs it knows (``WorkerSpec.jobs``' form), or ("error", msg).

    Args:
        spec: the worker's rank, rendezvous and points.
        results: the queue to its parent.
        parent: the parent's pid (the worker ends once it has gone).
    """
    import torch
    import torch.distributed as dist

    exit_with_parent(parent)
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
        if not spec.standin:  # a gloo group is left as it is (its teardown can hang before torch 2.8)
            dist.destroy_process_group()
        results.put(("done", tuple((k, n, b) for k, (n, b) in getattr(meter, "jobs", {}).items())))
        if spec.standin:
            end_reported(results)
    except Exception as e:  # the parent names the rank and ends the run
        log = os.environ.get(FILE_ENV)  # where NCCL wrote its warnings instead of the terminal
        said = warnings(LogReader(log_path(log)).new_text()) if log else []
        results.put(("error", f"{type(e).__name__}: {e}" + "".join(f"; NCCL WARN {w}" for w in said)))
        raise SystemExit(1)


class StandInMeter:
    """The gloo backend's CPU measurements behind the worker protocol (tests only)."""

    def __init__(self, dist):
        from lagom_tune.backends.gloo_timing import MEASURE  # local: this module imports torch only in a worker

        self.dist, self.table = dist, MEASURE

    def measure(self, point: Point, repeats: int) -> list[dict]:
        if point.op == PROBE:
            raise RuntimeError("the contention probe needs a CUDA GPU")
        if point.kind == DEFAULT:  # gloo has no choice of its own to observe
            return [{**row, **dict.fromkeys(CHOSEN_COLUMNS)} for row in self.table["collective"](point, repeats, self.dist)]
        return self.table[point.kind](point, repeats, self.dist)


def collective_words(nbytes: int, ranks: int, element_size: int) -> int:
    """The elements of a collective's buffer of about ``nbytes`` (nccl-tests sizes: an all-gather's
    output, a reduce-scatter's input): a multiple of ``ranks``, at least one per rank. NCCL hands
    its tuner this many elements' bytes for any op.

    Args:
        nbytes: the size asked for.
        ranks: the communicator's size.
        element_size: bytes per element.
    Returns:
        The elements.
    """
    return max(ranks, nbytes // element_size // ranks * ranks)


def collective_call(dist, op: str, nbytes: int, ranks: int, group, device, dtype):
    """A closure running ``op`` on ``nbytes`` (nccl-tests sizes: AG output, RS input) in ``group``.

    Args:
        dist: ``torch.distributed``.
        op: the collective op.
        nbytes: its size.
        ranks: the group's size.
        group: the process group (None: the world).
        device: where the buffers live.
        dtype: their element type.
    Returns:
        A function that launches the collective once.
    """
    import torch

    words = collective_words(nbytes, ranks, torch.tensor([], dtype=dtype).element_size())
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
    """GEMMs, collectives, overlapped pairs and the probe, timed the one way ``gpu_timing`` defines.

    An overlapped point times, in every repeat, the compute run alone, the communication alone
    (on the side stream it overlaps on), then both together: the baselines are the same launches
    on the same streams, measured right before. The job is the same across a shape's settings
    (the same ``n`` GEMMs; for the probe the same bytes), so windows compare across channels and
    buffer sizes the way the search compares them.
    """

    def __init__(self, spec: WorkerSpec, torch, dist):
        self.spec, self.torch, self.dist = spec, torch, dist
        self.device = torch.device("cuda", spec.local_rank)
        self.groups: dict[tuple, Any] = {}
        # overlapped job per shape and collective (job_key): (n GEMMs, probe bytes); earlier batches' given
        self.jobs: dict[tuple, tuple[int, int]] = {k: (n, b) for k, n, b in spec.jobs}
        self.side = torch.cuda.Stream(device=self.device)
        # the tuner plugin NCCL runs in this worker (the batch that observes NCCL's own choices):
        # the same library NCCL loads, held so its counts can be read
        plugin = os.environ.get(PLUGIN_ENV)
        self.tuner = hold_tuner(plugin) if plugin else None
        # ... and NCCL's log there: what it ran each call with, channels included
        log = os.environ.get(FILE_ENV)
        self.nccl_log = LogReader(log_path(log)) if log else None

    # -- plumbing ------------------------------------------------------------------------------

    def barrier(self) -> None:
        self.dist.barrier(device_ids=[self.spec.local_rank])
        self.torch.cuda.synchronize(self.device)

    def group(self, point: Point):
        """The process group for the point's layout and channels (min_ctas = max_ctas = channels;
        NCCL's own channels for a point that sets none)."""
        s = point.settings
        key = (point.ranks, s.get("nodes", 1), s.get("channels"))
        if key not in self.groups:
            opts = channel_options(self.dist.ProcessGroupNCCL.Options, point.ranks, s["channels"]) if "channels" in s else None
            layout = subgroups(self.spec.world, point.ranks, s.get("nodes", 1), self.spec.gpus_per_node)
            mine, _ = self.dist.new_subgroups_by_enumeration(layout, backend="nccl", pg_options=opts)
            self.groups[key] = mine
        return self.groups[key]

    def per_launch_us(self, fn, warmup: int = 3, count: int = 5) -> float:
        """One launch's time, from ``count`` direct launches after ``warmup`` (first calls set up)."""
        for _ in range(warmup):
            fn()
        # the better of two: a worker's first timed run also pays one-off set-up (events, the spacer)
        return min(time_run(self.torch, Launches(fn, count)) for _ in range(2)) / count

    def matmul(self, point: Point):
        """One launch of the point's GEMM, on operands rotated past the L2 (``tensors.rotating_matmul``)."""
        from lagom_tune.backends.tensors import rotating_matmul  # local: this module imports torch only in a worker

        return rotating_matmul(point.gemm, self.device, self.torch.cuda.get_device_properties(self.device).L2_cache_size)

    def comm(self, point: Point, nbytes: int | None = None, settings: dict | None = None):
        """One launch of the point's collective (or probe of ``nbytes``), and the probe if it is one."""
        if point.op == PROBE:
            s = settings or point.settings
            probe = Probe(probe_geometry(nbytes or point.nbytes, s["channels"], s["buffsize"]), s["threads"], self.device)
            return probe.launch, probe
        fn = collective_call(self.dist, point.op, point.nbytes, point.ranks, self.group(point), self.device, self.torch.float32)
        return fn, None

    def probe_bytes_lasting(self, point: Point, seconds: float) -> int:
        """Bytes the probe at NCCL's default channels and buffer size copies in ``seconds``,
        from a timed 16 MiB trial: the overlapped probe's job at every setting of a shape."""
        s = {**point.settings, **JOB_REFERENCE}
        launch, trial = self.comm(point, 16 << 20, s)
        trial_s = self.per_launch_us(launch, warmup=1, count=1) / 1e6
        steps = steps_for(seconds, trial.geometry.steps, trial_s)
        return trial.geometry.nbytes * steps // trial.geometry.steps

    def repeat(self, run, repeats: int, stream=None) -> list[float]:
        out = []
        for _ in range(repeats):
            self.barrier()
            with self.torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                out.append(time_run(self.torch, run))
        return out

    # -- measurements --------------------------------------------------------------------------

    def measure(self, point: Point, repeats: int) -> list[dict]:
        rows = getattr(self, point.kind)(point, repeats)
        self.torch.cuda.empty_cache()
        return rows

    def timed_launches(self, fn, capturable: bool = True) -> Launches:
        """Launches of ``fn`` lasting ``gpu_timing.RUN_S`` (one if it is that long already)."""
        once = self.per_launch_us(fn)
        return launches(self.torch, fn, launch_count(once / 1e6), once, capturable)

    def gemm(self, point: Point, repeats: int) -> list[dict]:
        run = self.timed_launches(self.matmul(point))
        return [timed_columns(t / run.n, run.n, run.how) for t in self.repeat(run, repeats)]

    def collective(self, point: Point, repeats: int) -> list[dict]:
        fn, probe = self.comm(point)
        if probe is None:  # a collective: one launch a repeat, never captured (see gpu_timing)
            fn()  # the first call also creates the communicator
            run = Launches(fn, 1)
        else:
            run = self.timed_launches(fn)
        extra = {"nbytes": probe.geometry.nbytes} if probe else {}
        return [{**timed_columns(t / run.n, run.n, run.how), **extra} for t in self.repeat(run, repeats, self.side)]

    def default(self, point: Point, repeats: int) -> list[dict]:
        """The collective with nothing set (NCCL's own algorithm, protocol and channels), timed as
        :meth:`collective` times one, with what NCCL chose for its first call: the algorithm and
        protocol the tuner plugin this worker runs (with no rules) saw NCCL pick, and the channels
        NCCL's log says it ran them on (``nccl_log``; a communicator's rank 0 logs its calls). The
        log's algorithm and protocol stand where the plugin saw none; where the two disagree, the
        channels, which belong to the log's, are left unknown."""
        fn, _ = self.comm(point)
        before = read_nccl_choices(self.tuner) if self.tuner is not None else ()
        fn()  # the first call also creates the communicator; NCCL asks the tuner as it enqueues
        after = read_nccl_choices(self.tuner) if self.tuner is not None else ()
        ran = last_call(self.nccl_log.new_text(), point.op) if self.nccl_log is not None else None
        element = self.torch.tensor([], dtype=self.torch.float32).element_size()  # collective_call's buffers
        chosen = choice_between(before, after, point.op, collective_words(point.nbytes, point.ranks, element) * element,
                                point.settings.get("nodes", 1) > 1)
        if ran is not None and chosen in (None, (ran.algo, ran.proto)):
            seen: tuple = (ran.algo, ran.proto, ran.channels)
        else:
            seen = (*(chosen or (None, None)), None)
        observed = dict(zip(CHOSEN_COLUMNS, seen))
        return [{**row, **observed} for row in self.collective(point, repeats)]

    def job(self, point: Point, gemm_s: float) -> tuple[int, int]:
        """The overlapped job of the point's shape: ``n`` GEMMs, and the probe's bytes (0 for a
        collective, whose size the workload fixes); sized once, at NCCL's default channels and
        buffer size (:data:`~lagom_tune.backends.nccl_sweep.JOB_REFERENCE`), whichever setting
        comes first, and kept for every other (later batches receive it in ``WorkerSpec.jobs``)."""
        from lagom_tune.backends.tensors import slowest_rank  # local: this module imports torch only in a worker

        key = job_key(point)
        if key not in self.jobs:
            (y,) = slowest_rank(self.dist, (gemm_s,), self.device)  # every rank runs the same number of GEMMs
            n = launch_count(y)  # at least the GEMM point's launches: one measurement (see gpu_timing)
            if point.op == PROBE:  # the probe copies what it can meanwhile at NCCL's defaults
                self.jobs[key] = (n, self.probe_bytes_lasting(point, n * y))
            else:  # as many GEMMs as last about as long as the collective at NCCL's default channels
                ref = replace(point, config=tuple({**point.settings, "channels": JOB_REFERENCE["channels"]}.items()))
                fn, _ = self.comm(ref)
                (x,) = slowest_rank(self.dist, (self.per_launch_us(fn, warmup=1) / 1e6,), self.device)
                self.jobs[key] = (max(n, min(MAX_LAUNCHES, round(x / y))), 0)
        return self.jobs[key]

    def overlap(self, point: Point, repeats: int) -> list[dict]:
        """Per repeat: the ``n`` GEMMs alone, the collective (or probe) alone on the side stream,
        then both together, released by one event."""
        mm = self.matmul(point)
        once = self.per_launch_us(mm)
        n, probe_bytes = self.job(point, once / 1e6)
        compute = launches(self.torch, mm, n, once)
        fn, probe = self.comm(point, probe_bytes or None)
        fn()  # compiles the probe, or creates the communicator
        comm = Launches(fn, 1)
        extra = {"nbytes": probe.geometry.nbytes} if probe else {}
        rows = []
        for _ in range(repeats):
            self.barrier()
            compute_alone = time_run(self.torch, compute)
            self.barrier()
            with self.torch.cuda.stream(self.side):
                comm_alone = time_run(self.torch, comm)
            self.barrier()
            both = time_overlapped(self.torch, compute, comm, self.side)
            rows.append({**overlap_columns(both.compute_us, both.comm_us, n, compute_alone, comm_alone),
                         "baseline": PAIRED, "timing": compute.how, **extra})
        return rows
