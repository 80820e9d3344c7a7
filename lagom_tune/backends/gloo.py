"""CPU backend: real torch GEMMs on CPU threads and real gloo collectives between spawned ranks.

Its knobs (``gloo_knobs.py``, apart so that a gloo plan loads without torch) are the ones a CPU
data-parallel job really has, each verified to change measured time: intra-op threads per rank
(``torch.set_num_threads``) and DDP's ``bucket_cap_mb`` (which sizes the gradient all-reduces). Gloo's own ``_threads`` option is not a knob: it had no measurable
effect in torch 2.13.
"""

from __future__ import annotations

import datetime
import os
import platform
import queue
import socket
import statistics
import threading
import time
from typing import Any

import torch

from lagom_tune.backends.base import BackendOptions, LocalBackend, Point, RowSink, reduce_ranks
from lagom_tune.backends.gloo_knobs import gloo_knob_space
from lagom_tune.errors import RunError, UserError
from lagom_tune.workload.bucketing import bucket_group
from lagom_tune.workload.spec import Gemm, Workload

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STARTUP_S = 120.0  # seconds a rank may take to start (import torch, join the group) before it counts as hung


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooBackend(LocalBackend):
    name = "gloo"
    simulated = False

    def __init__(self, options: BackendOptions):
        if options.ranks < 2:
            raise UserError("--ranks must be at least 2 for the gloo backend (collectives need peers)")
        self.options = options
        self.knob_space = gloo_knob_space(ranks=options.ranks)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "simulated": False,
            "device": "cpu",
            "torch": str(torch.__version__),
            "cores": os.cpu_count(),
            "ranks": self.options.ranks,
            "nodes": 1,
            "host": platform.node(),
            "python": platform.python_version(),
            "processor": platform.machine(),
        }

    def plan_points(self, workload: Workload) -> list[Point]:
        ranks = self.options.ranks
        threads = self.knob_space["threads"].domain
        points: list[Point] = []
        gemms = sorted(workload.gemms().values(), key=lambda g: g.flops)
        for g in gemms:
            for t in threads:
                points.append(Point("gemm", (("threads", t),), gemm=g))
        # Every all-reduce size the search can produce (each bucket cap), plus a ladder for the fit
        # up to the largest possible bucket (everything in one).
        sizes: set[int] = set()
        groups = workload.communicators()
        for cap in self.knob_space["bucket_cap_mb"].domain + (1 << 30,):
            for grp in workload.groups:
                sizes |= {c.nbytes for c in bucket_group(grp, {name: cap for name in groups}).comm}
        largest = max(sizes, default=1 << 20)
        sizes |= {1 << p for p in range(14, 40, 2) if 1 << p < largest}
        for op in sorted({c.op for c in workload.collectives()}):
            for n in sorted(sizes):
                for chunk in self.knob_space["chunk_bytes"].domain if op == "all_reduce" else (0,):
                    if chunk == 0 or chunk < n:  # a chunk as large as the tensor is the whole tensor
                        points.append(Point("collective", (("chunk_bytes", chunk),), op=op, nbytes=n, ranks=ranks))
        # Overlapped pairs: small, middle and large backward GEMMs beside three message sizes.
        backward = sorted({g.shape_key: g for grp in workload.groups if grp.comm for g in grp.compute}.values(), key=lambda g: g.flops)
        picks = list({id(g): g for g in (backward[0], backward[len(backward) // 2], backward[-1])}.values()) if backward else []
        for g in picks:
            for n in sorted({max(1 << 16, largest // 16), max(1 << 16, largest // 4), largest}):
                for t in threads:
                    points.append(Point("overlap", (("threads", t),), gemm=g, op="all_reduce", nbytes=n, ranks=ranks))
        return points

    def measure(self, points: list[Point], repeats: int, sink: RowSink) -> None:
        if not points:
            return
        ctx = torch.multiprocessing.get_context("spawn")
        results = ctx.Queue()
        # After each point a rank waits for the parent's word that it is persisted, so the
        # parent's CSV writing never competes with a measurement for the CPU. One queue per rank,
        # written only by the parent: no lock is shared that a hung rank could hold.
        persisted = [ctx.Queue() for _ in range(self.options.ranks)]
        for q in persisted:
            q.cancel_join_thread()
        port = free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(r, self.options.ranks, port, points, repeats, self.options.timeout_s, results, persisted[r]), daemon=True)
            for r in range(self.options.ranks)
        ]
        for p in procs:
            p.start()
        try:
            _collect(procs, points, results, sink, self.options.timeout_s, persisted)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():  # stopped or ignoring SIGTERM: a hung rank must not hang us
                    p.kill()
                    p.join(timeout=5)


def _collect(procs, points: list[Point], results, sink: RowSink, timeout_s: float, persisted) -> None:
    """Merge per-rank timings (max over ranks per repeat); end the run if a rank dies or hangs."""
    # A rank stopped mid-message would block a direct read forever; a daemon thread does the
    # blocking reads so this loop can always notice the silence and end the run.
    inbox: queue.Queue = queue.Queue()

    def pump() -> None:
        while True:
            try:
                inbox.put(results.get())
            except (EOFError, OSError, ValueError):
                return

    threading.Thread(target=pump, daemon=True, name="lagom-results").start()
    pending: dict[int, dict[int, list[dict]]] = {}
    progress = {r: -1 for r in range(len(procs))}
    ready: set[int] = set()
    last_news = time.monotonic()
    done = 0

    def hung() -> RunError:
        if len(ready) < len(procs):
            late = min(set(progress) - ready)
            return RunError(f"rank {late} did not start within {max(timeout_s, STARTUP_S):.0f} s",
                            hint="the machine may be overloaded; rerun to resume")
        behind = min(progress, key=progress.get)
        return RunError(f"rank {behind} made no progress for {timeout_s:.0f} s (stuck at point {progress[behind] + 2} of {len(points)})",
                        hint="a rank is hung; rerun to resume, or raise --timeout for slow points")

    while done < len(points):
        try:
            msg = inbox.get(timeout=0.5)
        except queue.Empty:
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None):
                    raise RunError(f"rank {r} died (exit code {p.exitcode}) while measuring point {progress[r] + 2} of {len(points)}",
                                   hint="rerun the same command to resume from the last completed point")
            # --timeout is for measuring: starting a rank (importing torch, joining the group)
            # is allowed at least STARTUP_S, however loaded the machine.
            limit = timeout_s if len(ready) == len(procs) else max(timeout_s, STARTUP_S)
            if time.monotonic() - last_news > limit:
                raise hung()
            continue
        last_news = time.monotonic()
        if msg[0] == "error":
            raise RunError(f"rank {msg[1]} failed: {msg[2]}")
        if msg[0] == "ready":
            ready.add(msg[1])
            continue
        _, rank, idx, rows = msg
        progress[rank] = idx
        pending.setdefault(idx, {})[rank] = rows
        if len(pending[idx]) == len(procs):
            per_rank = pending.pop(idx)
            sink(points[idx], reduce_ranks(points[idx], list(per_rank.values())))
            done += 1
            for q in persisted:
                q.put(idx)


# ---------------------------------------------------------------------------------------------
# Inside a rank


def _rank_main(rank: int, world: int, port: int, points: list[Point], repeats: int, timeout_s: float, results, persisted) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        results.put(("ready", rank))
        for idx, point in enumerate(points):
            torch.set_num_threads(point.settings.get("threads", 1))
            rows = MEASURE[point.kind](point, repeats, dist)
            results.put(("rows", rank, idx, rows))
            # Longer than the parent's own limit, so the parent names a hung peer first.
            persisted.get(timeout=3 * timeout_s)
        dist.barrier()
        dist.destroy_process_group()
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the group: the parent says it once
        raise SystemExit(130) from None
    except Exception as e:  # reported to the parent, which names the rank
        results.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1)


def operands(g: Gemm, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random A and B for ``g`` (batched when ``g.batch > 1``), on ``device``."""
    dt = TORCH_DTYPES[g.dtype]
    shape_a = (g.batch, g.m, g.k) if g.batch > 1 else (g.m, g.k)
    shape_b = (g.batch, g.k, g.n) if g.batch > 1 else (g.k, g.n)
    return torch.randn(shape_a, dtype=dt, device=device), torch.randn(shape_b, dtype=dt, device=device)


def _gemm_rows(point: Point, repeats: int, dist) -> list[dict]:
    a, b = operands(point.gemm)
    # Repeat tiny GEMMs inside one timed region so each sample is well above timer resolution.
    t0 = time.perf_counter()
    torch.matmul(a, b)
    once = time.perf_counter() - t0
    inner = max(1, min(200, int(2e-3 / max(once, 1e-7))))
    for _ in range(2):
        torch.matmul(a, b)
    rows = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b)
        rows.append({"time_us": (time.perf_counter() - t0) / inner * 1e6, "inner": inner})
    return rows


def _buffer(nbytes: int) -> torch.Tensor:
    return torch.zeros(max(1, nbytes // 4), dtype=torch.float32)


def chunked_all_reduce(all_reduce, buf: torch.Tensor, chunk_bytes: int, **kwargs) -> list:
    """All-reduce a contiguous ``buf`` in chunks of ``chunk_bytes``, all in flight at once; returns
    the works. The one chunking used by the profile, the DDP comm hook and the all_reduce wrapper."""
    step = max(1, chunk_bytes // buf.element_size()) if chunk_bytes else buf.numel()
    flat = buf.view(-1)
    return [all_reduce(flat[i:i + step], async_op=True, **kwargs) for i in range(0, flat.numel(), step)]


def _coll_rows(point: Point, repeats: int, dist) -> list[dict]:
    buf = _buffer(point.nbytes)
    chunk = point.settings.get("chunk_bytes", 0)

    def once() -> None:
        for work in chunked_all_reduce(dist.all_reduce, buf, chunk):
            work.wait()

    once()
    rows = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        once()
        rows.append({"time_us": (time.perf_counter() - t0) * 1e6})
    return rows


def slowest_rank(dist, values: tuple[float, ...], device: Any = "cpu") -> tuple[float, ...]:
    """Each of ``values`` at its maximum over the ranks (so every rank sizes a measurement alike)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(float(v) for v in t.tolist())


def _overlap_rows(point: Point, repeats: int, dist) -> list[dict]:
    """Start the collective and ``n`` GEMMs together; time when each stream finishes.

    ``n`` is chosen so the GEMMs alone take about as long as the collective alone: the balanced
    case, where contention decides the window. The alone times are measured right before.
    """
    a, b = operands(point.gemm)
    buf = _buffer(point.nbytes)
    y = statistics.median(_gemm_rows(point, 3, dist)[i]["time_us"] for i in range(3)) / 1e6
    x = statistics.median(_coll_rows(point, 3, dist)[i]["time_us"] for i in range(3)) / 1e6
    y, x = slowest_rank(dist, (y, x))  # every rank must run the same number of GEMMs
    n = max(1, round(x / y))
    rows = []
    for _ in range(repeats):
        dist.barrier()
        stamp: list[float] = []
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        work.get_future().then(lambda _f, _stamp=stamp: _stamp.append(time.perf_counter()))
        for _ in range(n):
            torch.matmul(a, b)
        t_compute = time.perf_counter()
        work.wait()
        while not stamp:  # the callback runs on gloo's thread right after completion
            time.sleep(1e-5)
        t_comm = stamp[0]
        rows.append({
            "time_us": (t_compute - t0) * 1e6, "comm_us": (t_comm - t0) * 1e6,
            "window_us": (max(t_compute, t_comm) - t0) * 1e6, "n_compute": n,
            "compute_alone_us": y * n * 1e6, "comm_alone_us": x * 1e6,
        })
    return rows


def _iteration_rows(point: Point, repeats: int, dist) -> list[dict]:
    """Replay the whole workload under the point's settings: GEMMs on this thread, collectives in
    order on another, each waiting for the GEMM that readies it. Returns iteration times."""
    import threading

    from lagom_tune.search.space import settings_from_items

    settings = settings_from_items(point.config)
    caps = {g: kv["bucket_cap_mb"] for g, kv in settings.communicators.items() if "bucket_cap_mb" in kv}
    groups = [bucket_group(g, caps) for g in point.workload.groups]
    mats = {g.shape_key: operands(g) for grp in groups for g in grp.compute}
    buffers = {c.nbytes: _buffer(c.nbytes) for grp in groups for c in grp.comm}

    def play(grp) -> float:
        ready = [threading.Event() for _ in grp.compute]

        def communicate() -> None:
            for c in grp.comm:
                if c.after is not None:
                    ready[c.after].wait()
                dist.all_reduce(buffers[c.nbytes]) if c.op == "all_reduce" else dist.broadcast(buffers[c.nbytes], 0)

        dist.barrier()
        t0 = time.perf_counter()
        comm = threading.Thread(target=communicate)
        comm.start()
        for i, g in enumerate(grp.compute):
            torch.matmul(*mats[g.shape_key])
            ready[i].set()
        comm.join()
        return time.perf_counter() - t0

    for grp in groups:  # warm-up
        play(grp)
    rows = []
    for _ in range(repeats):
        total = sum(grp.repeat * play(grp) for grp in groups) + point.workload.exposed_ms / 1e3
        rows.append({"time_us": total * 1e6})
    return rows


MEASURE = {"gemm": _gemm_rows, "collective": _coll_rows, "overlap": _overlap_rows, "iteration": _iteration_rows}
