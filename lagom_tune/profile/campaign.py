"""A profiling campaign: plan the points, skip what the run folder already holds, measure the rest."""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Any, Callable

from lagom_tune import __version__
from lagom_tune.backends.base import Backend, Point, check_memory
from lagom_tune.backends.registry import backend_info
from lagom_tune.errors import UserError, stops_deferred
from lagom_tune.measurements import collective_columns, gemm_columns, identity_columns
from lagom_tune.profile.store import RunFolder
from lagom_tune.workload.spec import Workload

Progress = Callable[[int, int, str], None]


def _now() -> str:
    """Now, in UTC, to the second (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _resume_state(run: RunFolder, workload: Workload, backend: Backend, fingerprint: dict[str, Any],
                  repeats: int, planned: set[str]) -> tuple[str | None, set[str]]:
    """When the run folder's profile started and which points it holds (none for a new folder);
    refused (UserError) when they are not this profile's (``planned``: its points' keys)."""
    if not run.exists():
        return None, set()
    meta = run.read_meta()
    if meta.get("workload_digest") != workload.digest or meta["fingerprint"].get("backend") != backend.name:
        held_doc = meta.get("workload") if isinstance(meta.get("workload"), dict) else {}
        held, held_backend = held_doc.get("name", "?"), meta["fingerprint"].get("backend")
        if (held, held_backend) == (workload.name, backend.name):  # one name, another shape: say which
            theirs = held_doc.get("meta") if isinstance(held_doc.get("meta"), dict) else {}
            differ = [f"{k} {theirs.get(k)}, not {v}" for k, v in workload.meta.items() if k in theirs and theirs[k] != v]
            raise UserError(f"{run.path} holds a profile of {held!r} on {held_backend} of another shape ("
                            + ("; ".join(differ) if differ else "other GEMMs or collectives: the workload changed since")
                            + "); resume it with the same options, or choose a new --out")
        raise UserError(f"{run.path} holds a profile of workload {held!r} on the {held_backend} backend, "
                        f"not of {workload.name!r} on {backend.name}; choose a new --out")
    changed = backend_info(backend.name).setup_change(meta["fingerprint"], fingerprint)
    if changed:  # its points and these would be one profile of two setups
        raise UserError(f"{run.path} was profiled on another setup ({changed}); resume it on the same one, or choose a new --out")
    if meta.get("repeats") != repeats:
        raise UserError(f"{run.path} was profiled with --repeats {meta.get('repeats')}; resume with the same value")
    if run.csv_path.exists():
        rows, health = run.read()
        foreign = sorted(set(rows["point"].astype(str)).union(health.short_points) - planned)
        if foreign:  # measured and fitted with this profile's, they would make one model of two setups
            made = (meta.get("tool") or {}).get("version")
            by = f" (this folder was profiled by lagom-tune {made}, this is {__version__})" if made and made != __version__ else ""
            raise UserError(f"{run.csv_path} holds {len(foreign)} point(s) this profile does not measure (e.g. "
                            f"{foreign[0]}): rows of another run or setup{by}; choose a new --out")
        run.drop_incomplete(rows, health)  # a point cut short is measured again, whole
        return meta.get("started"), set(rows["point"].astype(str))
    return meta.get("started"), set()


def _agreed_todo(run: RunFolder, workload: Workload, backend: Backend, fingerprint: dict[str, Any], points: list[Point],
                 repeats: int) -> tuple[str, list[Point], Callable[[], None]]:
    """When the profile started and the points left to measure, the same on every process.

    The writer reads the run folder; every rank of a distributed backend then measures the same
    points (and raises the same error).

    Args:
        run: the run folder.
        workload: the workload being profiled.
        backend: the backend (its writer reads the folder, ``share`` tells the others).
        fingerprint: this run's (a resumed folder must have been started on the same setup).
        points: every point of the profile, in order.
        repeats: repeats per point (a resumed profile must keep them).
    Returns:
        The start time (now, for a new folder), the points not yet in the folder, in order, and
        the function that releases the writer's lock on the folder (a no-op on the others).
    Raises:
        UserError: on every process, for a folder that holds another profile or is being profiled.
    """
    state: tuple = ("ok", None, [])
    release: Callable[[], None] = lambda: None
    if backend.writer:
        try:
            release = run.lock()
            started, done = _resume_state(run, workload, backend, fingerprint, repeats, {p.key for p in points})
            state = ("ok", started, [p.key for p in points if p.key not in done])
        except UserError as e:
            release()
            state = ("error", str(e), [])
    state = backend.share(state)
    if state[0] == "error":
        raise UserError(state[1])
    wanted = set(state[2])
    return state[1] or _now(), [p for p in points if p.key in wanted], release


AGAIN_PER_KIND = 3  # points of each fitted kind measured a second time, at the profile's end
AGAIN_KINDS = ("gemm", "collective", "overlap")


def again_points(points: list[Point], per_kind: int = AGAIN_PER_KIND) -> list[Point]:
    """The points a profile measures a second time after all the others: up to ``per_kind`` of each
    fitted kind, spread over the kind's points in the order they are measured and weighted to its
    start (positions 0, n/k, 2n/k, ...), so each pair of measurements lies far apart in time. The
    gap between the two is the machine's drift between moments, which the repeats within one
    point cannot show (``model.yaml``'s ``accuracy.remeasured``).

    Args:
        points: every point of the profile, in the order they are measured.
        per_kind: how many of each kind.
    Returns:
        Copies of the chosen points with ``again`` set, kind by kind.
    """
    out = []
    for kind in AGAIN_KINDS:
        mine = [p for p in points if p.kind == kind]
        k = min(per_kind, len(mine))
        out += [dataclasses.replace(mine[i * len(mine) // k], again=True) for i in range(k)]
    return out


def point_columns(point: Point, backend: Backend) -> dict[str, Any]:
    """The columns every row of ``point`` carries ahead of its measured ones.

    Args:
        point: the measured point.
        backend: the backend that measured it.
    Returns:
        Point key and kind, backend, the GEMM's shape, the collective's op and size, and the
        point's knob settings.
    """
    base = identity_columns(point.key, point.row_kind, backend.name, backend.simulated)
    if point.gemm is not None:
        base.update(gemm_columns(point.gemm))
    if point.op is not None:
        base.update(collective_columns(point.op, point.nbytes, point.ranks))
    base.update(point.settings)
    return base


class _Recorder:
    """Writes measured rows into the run folder and keeps ``meta.yaml``'s progress in step.

    Rows reach the CSV at most a second after their point completes (a simulated backend
    completes thousands of points a second; rewriting the CSV per point would be quadratic).
    """

    def __init__(self, run: RunFolder, workload: Workload, backend: Backend, fingerprint: dict[str, Any], repeats: int,
                 total: int, todo: int, started: str, progress: Progress | None):
        self.run, self.workload, self.backend, self.repeats = run, workload, backend, repeats
        self.fingerprint = fingerprint
        self.total, self.todo, self.started, self.progress = total, todo, started, progress
        self.finished = 0
        self.workload_record = workload.to_dict()  # written with every flush: made once
        self.buffer: list[dict] = []
        self.last_flush = time.monotonic()

    def write_meta(self, complete: bool) -> None:
        """Write ``meta.yaml`` with the progress so far."""
        self.run.write_meta({
            "tool": {"name": "lagom-tune", "version": __version__},
            "simulated": self.backend.simulated,
            "fingerprint": self.fingerprint,
            "workload_digest": self.workload.digest,
            "repeats": self.repeats,
            "points_total": self.total,
            "points_done": self.total - self.todo + self.finished,
            "complete": complete,
            "started": self.started,
            "updated": _now(),
            "workload": self.workload_record,
        })

    def start(self) -> None:
        """Record the profile as started (or resumed) before anything is measured."""
        self.write_meta(complete=not self.todo)
        if self.progress:
            self.progress(self.total - self.todo, self.total, "resuming" if self.todo < self.total else "measuring")

    def flush(self) -> None:
        """Append the buffered rows to the CSV, then update ``meta.yaml``: whole, however many stop
        signals arrive meanwhile (a burst of Ctrl-Cs cut one between the two, the rows then written
        twice or ``meta.yaml`` left behind the CSV)."""
        with stops_deferred():
            if self.buffer:
                self.run.append_rows(self.buffer)
                self.buffer.clear()
                self.write_meta(complete=self.finished == self.todo)
        self.last_flush = time.monotonic()

    def sink(self, point: Point, rows: list[dict]) -> None:
        """The backend's ``RowSink``: one completed point's rows (one per repeat)."""
        base = point_columns(point, self.backend)
        self.buffer.extend({**base, **r} for r in rows)
        self.finished += 1
        if time.monotonic() - self.last_flush >= 1.0:
            self.flush()
        if self.progress:
            self.progress(self.total - self.todo + self.finished, self.total, point.row_kind)


def run_profile(workload: Workload, backend: Backend, out: str | Path, *, repeats: int = 5,
                progress: Progress | None = None) -> RunFolder:
    """Measure every point of ``workload`` on ``backend`` into ``out``, resuming a partial run, and
    last a few of them again (:func:`again_points`).

    Args:
        workload: what to profile.
        backend: what measures it (every process of a distributed backend calls this).
        out: the run folder to create or resume.
        repeats: timed repeats per point (a resumed folder must have been started with the same).
        progress: called with (points done, points in all, what is being measured).
    Returns:
        The run folder (on the writer, holding every point's rows and ``meta.yaml``).
    Raises:
        UserError: for bad repeats or a folder that holds another profile.
    """
    if repeats < 1:
        raise UserError("--repeats must be at least 1")
    run = RunFolder(Path(out))
    if not workload.collectives() or not workload.gemms():  # the fit needs both, and there is no overlap to tune
        raise UserError(f"workload {workload.name} has no {'collective' if workload.gemms() else 'GEMM'}: "
                        "nothing overlaps, so there is nothing to measure or tune")
    backend.info.check_ops({c.op for c in workload.collectives()})
    points = backend.plan_points(workload)  # first: a simulated backend sizes its cluster to the workload
    points += again_points(points)
    if backend.info.gpu_model and not any(p.kind == "overlap" for p in points):  # its contention fit needs them
        raise UserError(f"workload {workload.name} runs no GEMM beside a collective (no group has both): the GPU "
                        "model's contention has nothing to be fitted from; profile a workload whose groups overlap them")
    fingerprint = backend.fingerprint()  # on every process: a distributed backend gathers it from all ranks
    check_memory(points, fingerprint)  # every process alike: refused before the folder is touched
    started, todo, release = _agreed_todo(run, workload, backend, fingerprint, points, repeats)
    if not backend.writer:
        backend.measure(todo, repeats, lambda point, rows: None)
        return run
    try:
        recorder = _Recorder(run, workload, backend, fingerprint, repeats, len(points), len(todo), started, progress)
        recorder.start()
        try:
            backend.measure(todo, repeats, recorder.sink)
        finally:
            recorder.flush()  # what was measured is kept, whatever ended the run
    finally:
        with stops_deferred():
            release()
    return run
