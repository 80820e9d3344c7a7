"""Inside a gloo rank: how each kind of point is timed on CPU threads (``MEASURE``).

Every function takes the point, the number of repeats and ``torch.distributed`` (joined to the
other ranks), and returns one row per repeat; a barrier starts each timed repeat, and the parent
keeps the slowest rank's time (``base.reduce_ranks``). The nccl backend's CPU stand-in uses them too.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

import torch

from lagom_tune.backends.base import Point
from lagom_tune.backends.chunking import chunked_all_reduce
from lagom_tune.backends.tensors import buffer, operands, slowest_rank
from lagom_tune.knobs import settings_from_items
from lagom_tune.measurements import PAIRED, overlap_columns, timed_columns
from lagom_tune.workload.bucketing import bucket_group


def after_barrier(dist: Any, run: Callable[[], Any]) -> float:
    """Seconds ``run`` takes on this rank, started as every rank leaves one barrier (each timed
    repeat of every kind starts so; the parent keeps the slowest rank's, ``base.reduce_ranks``).

    Args:
        dist: ``torch.distributed``.
        run: the work to time.
    Returns:
        Its wall-clock seconds.
    """
    dist.barrier()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def gemm_rows(point: Point, repeats: int, dist: Any) -> list[dict]:
    """Time the point's GEMM on this rank's threads.

    Args:
        point: a ``gemm`` point.
        repeats: timed repeats.
        dist: ``torch.distributed`` (for the barrier before each repeat).
    Returns:
        One row per repeat: ``time_us`` per GEMM, and ``inner``, the GEMMs in the timed region.
    """
    a, b = operands(point.gemm)
    # Repeat tiny GEMMs inside one timed region so each sample is well above timer resolution.
    t0 = time.perf_counter()
    torch.matmul(a, b)
    once = time.perf_counter() - t0
    inner = max(1, min(200, int(2e-3 / max(once, 1e-7))))
    for _ in range(2):
        torch.matmul(a, b)

    def gemms() -> None:
        for _ in range(inner):
            torch.matmul(a, b)

    return [timed_columns(after_barrier(dist, gemms) / inner * 1e6, inner) for _ in range(repeats)]


def collective_rows(point: Point, repeats: int, dist: Any) -> list[dict]:
    """Time the point's all-reduce, in chunks of its ``chunk_bytes`` setting.

    Args:
        point: a ``collective`` point.
        repeats: timed repeats.
        dist: ``torch.distributed``.
    Returns:
        One row per repeat: ``time_us``.
    """
    buf = buffer(point.nbytes)
    chunk = point.settings.get("chunk_bytes", 0)

    def once() -> None:
        for work in chunked_all_reduce(dist.all_reduce, buf, chunk):
            work.wait()

    once()
    return [timed_columns(after_barrier(dist, once) * 1e6) for _ in range(repeats)]


def start_all_reduce(dist: Any, buf: torch.Tensor, t0: float) -> Callable[[], float]:
    """Start an all-reduce of ``buf``; its end is stamped on gloo's thread as it completes, so the
    calling thread may be busy (with GEMMs) meanwhile.

    Args:
        dist: ``torch.distributed``.
        buf: the tensor reduced.
        t0: the ``time.perf_counter()`` its end is measured from.
    Returns:
        A function that waits for the all-reduce and returns its end, in seconds after ``t0``.
    """
    stamp: list[float] = []
    work = dist.all_reduce(buf, async_op=True)
    work.get_future().then(lambda _f: stamp.append(time.perf_counter()))

    def end() -> float:
        work.wait()
        while not stamp:  # the callback runs right after completion, on gloo's thread
            time.sleep(1e-5)
        return stamp[0] - t0

    return end


def overlap_rows(point: Point, repeats: int, dist: Any) -> list[dict]:
    """Per repeat: the ``n`` GEMMs alone, the all-reduce alone, then both started together (the
    GPU backend's order, ``nccl_worker``), each timed after a barrier; the overlapped run times when
    each stream finishes. A repeat's alone times are the same work as its overlapped run, timed
    right before it, so a slowdown is never taken against a baseline from another moment.

    ``n`` is sized once, before the repeats (every rank alike), so the GEMMs alone take about as
    long as the all-reduce alone: the balanced case, where contention decides the window.

    Args:
        point: an ``overlap`` point (a GEMM and an all-reduce).
        repeats: timed repeats.
        dist: ``torch.distributed``.
    Returns:
        One row per repeat: compute (``time_us``), communication (``comm_us``) and window ends,
        ``n_compute``, and both alone times.
    """
    a, b = operands(point.gemm)
    buf = buffer(point.nbytes)
    y = statistics.median(r["time_us"] for r in gemm_rows(point, 3, dist)) / 1e6
    x = statistics.median(r["time_us"] for r in collective_rows(point, 3, dist)) / 1e6
    y, x = slowest_rank(dist, (y, x))  # every rank must run the same number of GEMMs
    n = max(1, round(x / y))

    def gemms() -> None:
        for _ in range(n):
            torch.matmul(a, b)

    rows = []
    for _ in range(repeats):
        compute_alone = after_barrier(dist, gemms)
        dist.barrier()
        comm_alone = start_all_reduce(dist, buf, time.perf_counter())()
        dist.barrier()
        t0 = time.perf_counter()
        comm_end = start_all_reduce(dist, buf, t0)
        gemms()
        t_compute = time.perf_counter() - t0
        t_comm = comm_end()
        # paired: without the mark the GPU fit's rebaselining took gloo rows for legacy ones, and
        # slowdown.png plotted the wrong slowdowns
        rows.append({**overlap_columns(t_compute * 1e6, t_comm * 1e6, n, compute_alone * 1e6, comm_alone * 1e6),
                     "baseline": PAIRED})
    return rows


def point_threads(point: Point) -> int:
    """The intra-op threads a rank times ``point`` at: its ``threads`` setting, or for an
    ``iteration`` point the process-wide one of the settings it replays (read as a plain setting
    it was never there, and every replay ran at one thread whatever the plan said).

    Args:
        point: a measurement point.
    Returns:
        The thread count (1 when the point sets none).
    """
    if point.kind == "iteration":
        return int(settings_from_items(point.config).process.get("threads", 1))
    return int(point.settings.get("threads", 1))


def iteration_rows(point: Point, repeats: int, dist: Any) -> list[dict]:
    """Replay the whole workload under the point's settings: GEMMs on this thread, collectives in
    order on another, each waiting for the GEMM that readies it.

    Args:
        point: an ``iteration`` point (its workload, and settings as its config).
        repeats: timed repeats.
        dist: ``torch.distributed``.
    Returns:
        One row per repeat: the iteration's ``time_us`` (exposed time included).
    """
    settings = settings_from_items(point.config)
    caps = {g: kv["bucket_cap_mb"] for g, kv in settings.communicators.items() if "bucket_cap_mb" in kv}
    groups = [bucket_group(g, caps) for g in point.workload.groups]
    mats = {g.shape_key: operands(g) for grp in groups for g in grp.compute}
    buffers = {c.nbytes: buffer(c.nbytes) for grp in groups for c in grp.comm}

    def play(grp) -> float:
        ready = [threading.Event() for _ in grp.compute]

        def communicate() -> None:
            for c in grp.comm:
                if c.after is not None:
                    ready[c.after].wait()
                if c.op == "all_reduce":  # in the plan's chunks, as the shim runs it (it was replayed whole)
                    for work in chunked_all_reduce(dist.all_reduce, buffers[c.nbytes], settings.for_collective(c).get("chunk_bytes", 0)):
                        work.wait()
                else:
                    dist.broadcast(buffers[c.nbytes], 0)

        def both() -> None:
            comm = threading.Thread(target=communicate)
            comm.start()
            for i, g in enumerate(grp.compute):
                torch.matmul(*mats[g.shape_key])
                ready[i].set()
            comm.join()

        return after_barrier(dist, both)

    for grp in groups:  # warm-up
        play(grp)
    rows = []
    for _ in range(repeats):
        total = sum(grp.repeat * play(grp) for grp in groups) + point.workload.exposed_ms / 1e3
        rows.append(timed_columns(total * 1e6))
    return rows


# Point kind -> its timing.
MEASURE: dict[str, Callable[[Point, int, Any], list[dict]]] = {
    "gemm": gemm_rows, "collective": collective_rows, "overlap": overlap_rows, "iteration": iteration_rows,
}
