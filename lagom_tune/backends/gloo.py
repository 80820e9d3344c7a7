"""CPU backend: real torch GEMMs on CPU threads and real gloo collectives between spawned ranks.

This module is the orchestration: which points to measure, and the rank processes that measure
them (spawned, joined in one gloo group, watched for death and silence, their rows merged). How a
rank times each kind of point is ``gloo_timing.py``; its knobs are ``gloo_knobs.py`` (apart so that
a gloo plan loads without torch): the ones a CPU data-parallel job really has, each verified to
change measured time: intra-op threads per rank (``torch.set_num_threads``) and DDP's
``bucket_cap_mb`` (which sizes the gradient all-reduces). Gloo's own ``_threads`` option is not a
knob: it had no measurable effect in torch 2.13.
"""

from __future__ import annotations

import datetime
import os
import platform
import queue
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from lagom_tune.backends.base import GIB, BackendOptions, LocalBackend, Point, RowSink, reduce_ranks
from lagom_tune.backends.gloo_knobs import gloo_knob_space
from lagom_tune.backends.gloo_timing import MEASURE, point_threads
from lagom_tune.backends.parent_watch import end_reported, exit_with_parent, start_shielded
from lagom_tune.backends.registry import usable_cores
from lagom_tune.errors import RunError, UserError
from lagom_tune.workload.bucketing import bucket_group
from lagom_tune.workload.spec import Workload

STARTUP_S = 120.0  # seconds a rank may take to start (import torch, join the group) before it counts as hung


def available_memory() -> int:
    """Bytes of memory available to new processes now (Linux's MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class GlooBackend(LocalBackend):
    """Ranks spawned on this machine; ``name`` and ``simulated`` come from the registry record."""

    def __init__(self, options: BackendOptions):
        if options.ranks < 2:
            raise UserError("--ranks must be at least 2 for the gloo backend (collectives need peers)")
        cores = usable_cores()
        if options.ranks > cores:  # 64 ranks on 2 cores ran out of memory after 80 s, one killed rank at a time
            raise UserError(f"--ranks {options.ranks} exceeds the {cores} CPU cores this process may use: each gloo rank "
                            "needs a core of its own, or its timings measure the scheduler, not the workload")
        self.options = options
        self.knob_space = gloo_knob_space(ranks=options.ranks)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "simulated": self.simulated,
            "device": "cpu",
            "torch": str(torch.__version__),
            "cores": usable_cores(),  # the job's share of the node, which the threads knob is bounded by
            "ranks": self.options.ranks,
            "rank_memory_GiB": round(available_memory() / GIB / self.options.ranks, 1),  # the ranks share the machine's
            "nodes": 1,
            "host": platform.node(),
            "python": platform.python_version(),
            "processor": platform.machine(),
        }

    def plan_points(self, workload: Workload) -> list[Point]:
        ranks = self.options.ranks
        # every collective is measured between all the spawned ranks: one of another size would be
        # recorded at this one, and a plan searched from it refused (4 ranks beside a world of 2)
        sizes = {c.group: c.ranks for c in workload.collectives()}
        if len(set(sizes.values())) > 1:
            raise UserError(f"workload {workload.name}: its communicators span different numbers of ranks "
                            f"({', '.join(f'{g} {n}' for g, n in sorted(sizes.items()))}); the gloo backend measures every "
                            "collective between all its ranks, so it profiles one size at a time")
        size = next(iter(sizes.values()), ranks)
        if size != ranks:
            raise UserError(f"workload {workload.name}: its collectives span {size} ranks, but the gloo backend would measure "
                            f"them between {ranks}; profile with --ranks {size}")
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
        _quiet_resource_tracker()
        results = ctx.Queue()
        # After each point a rank waits for the parent's word that it is persisted, so the
        # parent's CSV writing never competes with a measurement for the CPU. One queue per rank,
        # written only by the parent: no lock is shared that a hung rank could hold.
        persisted = [ctx.Queue() for _ in range(self.options.ranks)]
        for q in persisted:
            q.cancel_join_thread()
        # The parent holds the ranks' rendezvous store on a port the kernel gives it and keeps, so
        # no other process (a second profile, a test beside this one) can take the port between
        # choosing it and the ranks meeting there, as it could from a port found free and let go.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=RANK_PATIENCE * self.options.timeout_s))
        procs = [
            ctx.Process(target=_rank_main, args=(r, self.options.ranks, store.port, points, repeats, self.options.timeout_s, results, persisted[r],
                                                 os.getpid()), daemon=True)
            for r in range(self.options.ranks)
        ]
        for p in procs:
            start_shielded(p)
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


def _quiet_resource_tracker() -> None:
    """Ctrl-C reaches the whole process group; when a rank dies inside a queue operation the
    multiprocessing resource tracker reclaims the queue's semaphore at exit and warns about it on
    our stderr (4 lines after "interrupted", in about 1 run of 10). The reclaiming is what it is
    for; only its warning is silenced, in the tracker and the ranks (``-W`` options reach spawned
    interpreters through ``sys.warnoptions``), not in this process."""
    option = "ignore::UserWarning:multiprocessing.resource_tracker"
    if option not in sys.warnoptions:
        sys.warnoptions.append(option)


RANK_PATIENCE = 3  # a rank's timeouts, in multiples of the parent's --timeout
DEATH_NOTICE_S = 1.0  # how long a rank's failure waits for a peer's death to show (it is the cause, then)


def _stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


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
        stopped = [r for r, p in enumerate(procs) if _stopped(p.pid)]
        least = min(progress.values())
        # the others wait in the collective for the one that stopped: ties name every rank at the least
        behind = stopped or [r for r in progress if progress[r] == least]
        who = f"rank {behind[0]}" if len(behind) == 1 else "ranks " + ", ".join(map(str, behind))
        why = f"{'is' if len(behind) == 1 else 'are'} stopped (SIGSTOP or a debugger): no progress" if stopped else "made no progress"
        return RunError(f"{who} {why} for {timeout_s:.0f} s (stuck at point {least + 2} of {len(points)})",
                        hint="a rank is hung; rerun to resume, or raise --timeout for slow points")

    def dead() -> RunError | None:
        for r, p in enumerate(procs):
            if not p.is_alive() and p.exitcode not in (0, None):
                return RunError(f"rank {r} died (exit code {p.exitcode}) while measuring point {progress[r] + 2} of {len(points)}",
                                hint="rerun the same command to resume from the last completed point")
        return None

    while done < len(points):
        try:
            msg = inbox.get(timeout=0.5)
        except queue.Empty:
            died = dead()
            if died:
                raise died
            # --timeout is for measuring: starting a rank (importing torch, joining the group)
            # is allowed at least STARTUP_S, however loaded the machine.
            limit = timeout_s if len(ready) == len(procs) else max(timeout_s, STARTUP_S)
            if time.monotonic() - last_news > limit:
                raise hung()
            continue
        last_news = time.monotonic()
        if msg[0] == "error":  # a peer killed outright shows first as this rank's broken connection
            deadline = time.monotonic() + DEATH_NOTICE_S
            while time.monotonic() < deadline and not dead():
                time.sleep(0.05)
            died = dead()
            if died:
                raise RunError(f"{died}; rank {msg[1]} then failed: {msg[2].splitlines()[0][:200]}", hint=died.hint)
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


def _rank_main(rank: int, world: int, port: int, points: list[Point], repeats: int, timeout_s: float, results, persisted,
               parent: int) -> None:
    """A rank's process: join the group, time each point (``gloo_timing.MEASURE``), report its rows,
    and wait for the parent's word that they are persisted before the next."""
    exit_with_parent(parent)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A rank waits longer than its parent's limit, so the parent names a hung peer first (a rank's
    # own gloo timeout, as long as the parent's, now and then won the race and named itself).
    patience = RANK_PATIENCE * timeout_s
    try:
        timeout = datetime.timedelta(seconds=patience)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        results.put(("ready", rank))
        for idx, point in enumerate(points):
            torch.set_num_threads(point_threads(point))
            rows = MEASURE[point.kind](point, repeats, dist)
            results.put(("rows", rank, idx, rows))
            persisted.get(timeout=patience)
        dist.barrier()
    except Exception as e:  # reported to the parent, which names the rank
        results.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1)
    end_reported(results)  # its gloo group, left as it is (a teardown can hang before torch 2.8)
