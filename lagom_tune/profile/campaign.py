"""A profiling campaign: plan the points, skip what the run folder already holds, measure the rest."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Callable

from lagom_tune import __version__
from lagom_tune.backends.base import Backend, Point
from lagom_tune.errors import UserError
from lagom_tune.profile.store import RunFolder
from lagom_tune.workload.spec import Workload

Progress = Callable[[int, int, str], None]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _resume_state(run: RunFolder, workload: Workload, backend: str, repeats: int) -> tuple[str | None, set[str]]:
    """When the run folder's profile started and which points it holds (none for a new folder)."""
    if run.path.exists() and not run.path.is_dir():
        raise UserError(f"--out {run.path} exists and is not a folder")
    if not run.exists():
        return None, set()
    meta = run.read_meta()
    if meta.get("workload_digest") != workload.digest or meta["fingerprint"].get("backend") != backend:
        raise UserError(f"{run.path} holds a profile of another workload or backend; choose a new --out")
    if meta.get("repeats") != repeats:
        raise UserError(f"{run.path} was profiled with --repeats {meta.get('repeats')}; resume with the same value")
    if run.csv_path.exists():
        run.drop_incomplete()  # a point cut short is measured again, whole
    return meta.get("started"), run.done_points() if run.csv_path.exists() else set()


def run_profile(workload: Workload, backend: Backend, out: str | Path, *, repeats: int = 5,
                progress: Progress | None = None) -> RunFolder:
    """Measure every point of ``workload`` on ``backend`` into ``out``, resuming a partial run."""
    if repeats < 1:
        raise UserError("--repeats must be at least 1")
    run = RunFolder(Path(out))
    points = backend.plan_points(workload)  # first: a simulated backend sizes its cluster to the workload
    fingerprint = backend.fingerprint()
    # The writer reads the run folder; every rank of a distributed backend then measures the same
    # points (and raises the same error).
    state: tuple = ("ok", None, [])
    if backend.writer:
        try:
            started, done = _resume_state(run, workload, backend.name, repeats)
            state = ("ok", started, [p.key for p in points if p.key not in done])
        except UserError as e:
            state = ("error", str(e), [])
    state = backend.share(state)
    if state[0] == "error":
        raise UserError(state[1])
    started = state[1] or _now()
    wanted = set(state[2])
    todo = [p for p in points if p.key in wanted]
    if not backend.writer:
        backend.measure(todo, repeats, lambda point, rows: None)
        return run

    def write_meta(complete: bool) -> None:
        run.write_meta({
            "tool": {"name": "lagom-tune", "version": __version__},
            "simulated": backend.simulated,
            "fingerprint": fingerprint,
            "workload_digest": workload.digest,
            "repeats": repeats,
            "points_total": len(points),
            "points_done": len(points) - len(todo) + finished[0],
            "complete": complete,
            "started": started,
            "updated": _now(),
            "workload": workload.to_dict(),
        })

    finished = [0]
    buffer: list[dict] = []
    last_flush = [time.monotonic()]

    def flush() -> None:
        # Rows reach the CSV at most a second after their point completes (a simulated backend
        # completes thousands of points a second; rewriting the CSV per point would be quadratic).
        if buffer:
            run.append_rows(buffer)
            buffer.clear()
            write_meta(complete=finished[0] == len(todo))
        last_flush[0] = time.monotonic()

    write_meta(complete=not todo)
    if progress:
        progress(len(points) - len(todo), len(points), "resuming" if len(todo) < len(points) else "measuring")

    def sink(point: Point, rows: list[dict]) -> None:
        base = {"point": point.key, "kind": point.kind, "backend": backend.name, "simulated": backend.simulated}
        if point.gemm is not None:
            g = point.gemm
            base.update(gemm=g.shape_key, m=g.m, n=g.n, k=g.k, batch=g.batch, dtype=g.dtype, flops=g.flops)
        if point.op is not None:
            base.update(op=point.op, nbytes=point.nbytes, ranks=point.ranks)
        base.update(point.settings)
        buffer.extend({**base, **r} for r in rows)
        finished[0] += 1
        if time.monotonic() - last_flush[0] >= 1.0:
            flush()
        if progress:
            progress(len(points) - len(todo) + finished[0], len(points), point.kind)

    try:
        backend.measure(todo, repeats, sink)
    finally:
        flush()  # what was measured is kept, whatever ended the run
    return run
