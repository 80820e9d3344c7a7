"""What the nccl backend measures, and in which worker process (pure logic, tested on CPU).

NCCL reads ``NCCL_ALGO``, ``NCCL_PROTO``, ``NCCL_NTHREADS`` and ``NCCL_BUFFSIZE`` once per process,
so points that differ in any of them are measured in different worker processes (one
:class:`Batch` each). Channels are a per-communicator setting: one process group per value, with
``ProcessGroupNCCL.Options().config.min_ctas = max_ctas = channels``.

The sweep is one factor at a time around the defaults, because the fitted communication model
separates the factors: every (algorithm, protocol) over every channel count; threads and buffer
size over three channel counts, for each pair whose channels they size (NCCL_NTHREADS: Simple and
LL; NCCL_BUFFSIZE: Simple; ``nccl_knobs.sized_by``); overlapped pairs over channels and buffer sizes, on the ring and on
the op's own default where that is another (NVLS within an NVSwitch node). Beside the sweep, each of
the workload's collectives is timed once more with nothing set (a ``default`` point), in a worker
that runs the tuner plugin with no rules, which records the algorithm and protocol NCCL chose,
and has NCCL log the channels it ran each call on (``nccl_log.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from lagom_tune.backends.base import Point
from lagom_tune.backends.nccl_controls import OVERRIDING_ENV, TUNER_COLL, CommunicatorConfig, build_options
from lagom_tune.backends.nccl_knobs import NVLS, measured_pairs, nccl_config, nccl_knob_space, overlap_algos, sized_by
from lagom_tune.backends.nccl_log import FILE_ENV, LOG_ENV, LOG_NAME
from lagom_tune.backends.nccl_tuner import PLUGIN_ENV, RULES_ENV
from lagom_tune.backends.registry import PROBE_OP
from lagom_tune.errors import UserError
from lagom_tune.knobs import KnobSpace
from lagom_tune.measurements import DEFAULT
from lagom_tune.workload.spec import Workload

PROCESS_KEYS = ("algo", "proto", "threads", "buffsize")
# The batch of collectives timed with nothing set: NCCL's own algorithm, protocol, channels,
# threads and buffer, which the tuner plugin (loaded with no rules) observes.
OBSERVING = (("tuner", "observe"),)
# NCCL's environment spellings.
ALGO_ENV = {"ring": "Ring", "tree": "Tree", NVLS: "NVLS"}
PROTO_ENV = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}
PER_OP_SYNTAX = (2, 24)  # NCCL_ALGO="allreduce:tree;allgather:ring" since NCCL 2.24

# The single-GPU contention probe stands in for a collective: "copy" is its algorithm and protocol.
PROBE = PROBE_OP  # the op of the probe's rows (registered as the nccl backend's instrument)
PROBE_SIZES = (4 << 20, 32 << 20, 256 << 20)
PROBE_THREADS = 512
# An overlapped job is sized once per shape, at NCCL's default channels and buffer size: the
# probe's bytes are what it copies then in the time of the GEMMs beside it, a collective's GEMMs as
# many as last about as long as it does then; the same job at every setting of that shape.
JOB_REFERENCE = {k: nccl_knob_space().defaults()[k] for k in ("channels", "buffsize")}


def job_key(point: Point) -> tuple:
    """What an overlapped point's job is sized for: its shape and its collective (not its knobs).

    Args:
        point: an overlapped point.
    Returns:
        The key of its job.
    """
    return (point.gemm.shape_key, point.op, point.nbytes, point.ranks, point.settings.get("nodes", 1))


@dataclass(frozen=True)
class Batch:
    """Points measured by one fresh worker process, under one NCCL environment."""

    process: tuple[tuple[str, Any], ...]  # the process-scope settings, () for GEMMs and the probe
    points: tuple[Point, ...]

    @property
    def ops(self) -> set[str]:
        return {p.op for p in self.points if p.op}


def _add(points: dict[str, Point], p: Point) -> None:
    points.setdefault(p.key, p)


def _gemm_points(workload: Workload) -> list[Point]:
    return [Point("gemm", (), gemm=g) for g in sorted(workload.gemms().values(), key=lambda g: g.flops)]


def _beside(workload: Workload):
    """GEMM shapes that run beside a collective somewhere in the workload."""
    shapes = {g.shape_key: g for grp in workload.groups if grp.comm for g in grp.compute}
    return sorted(shapes.values(), key=lambda g: g.flops)


def plan_collective_points(workload: Workload, space: KnobSpace, world: int, gpus_per_node: int) -> list[Point]:
    """Every point a multi-GPU profile of ``workload`` measures, in a deterministic order.

    Args:
        workload: the workload (its GEMM shapes and collectives).
        space: the NCCL knobs on this machine.
        world: ranks in the job.
        gpus_per_node: ranks per node.
    Returns:
        GEMM, collective and overlapped points, without duplicates.
    Raises:
        UserError: for a collective this job cannot lay out (``check_layout``).
    """
    proto, chan, thr, buf = (space[k] for k in ("proto", "channels", "threads", "buffsize"))
    few_channels = sorted({chan.domain[min(1, len(chan.domain) - 1)], chan.default, chan.domain[-1]})
    points: dict[str, Point] = {p.key: p for p in _gemm_points(workload)}
    colls = sorted({(c.op, c.nbytes, c.ranks, c.nodes) for c in workload.collectives()})
    for op, nbytes, ranks, nodes in colls:
        check_layout(world, gpus_per_node, ranks, nodes)
        for size in sorted({nbytes, max(1 << 16, nbytes // 8)}):
            def coll(cfg: tuple) -> None:
                _add(points, Point("collective", cfg, op=op, nbytes=size, ranks=ranks))

            for a, p in measured_pairs(space, op, nodes):
                for ch in chan.domain:
                    coll(nccl_config(a, p, ch, thr.default, buf.default, nodes))
                # the threads and buffer sizes at a few channel counts, for each pair whose channels
                # they size: the fit has one group per pair and learns a knob only from its own rows
                for ch in few_channels:
                    for t in (thr.domain if sized_by(p, "threads") else ()):
                        coll(nccl_config(a, p, ch, t, buf.default, nodes))
                    for b in (buf.domain if sized_by(p, "buffsize") else ()):
                        coll(nccl_config(a, p, ch, thr.default, b, nodes))
    for op, nbytes, ranks, nodes in colls:  # each at NCCL's own choices, which the tuner plugin observes
        _add(points, Point(DEFAULT, (("nodes", nodes),), op=op, nbytes=nbytes, ranks=ranks))
    for g in _beside(workload):
        for op, nbytes, ranks, nodes in colls:
            for a in overlap_algos(space, op, nodes):
                for ch in chan.domain:
                    for b in buf.domain:
                        _add(points, Point("overlap", nccl_config(a, proto.default, ch, thr.default, b, nodes),
                                           gemm=g, op=op, nbytes=nbytes, ranks=ranks))
    return list(points.values())


def plan_probe_points(workload: Workload, space: KnobSpace, sms: int) -> list[Point]:
    """Single-GPU mode: the workload's GEMMs, the probe alone, and each GEMM beside the probe.

    The probe's overlapped size is chosen when measured (so it lasts as long as the GEMMs beside
    it); its points carry ``nbytes=0`` and their rows the bytes actually copied.

    Args:
        workload: the workload (its GEMM shapes).
        space: the NCCL knobs on this GPU.
        sms: the GPU's SMs (the probe uses fewer channels than that).
    Returns:
        The points, without duplicates.
    """
    chan = [c for c in space["channels"].domain if c < sms]
    bufs = space["buffsize"].domain
    points: dict[str, Point] = {p.key: p for p in _gemm_points(workload)}
    for size in PROBE_SIZES:
        for ch in chan:
            for b in bufs:
                _add(points, Point("collective", nccl_config("copy", "copy", ch, PROBE_THREADS, b, 1), op=PROBE, nbytes=size, ranks=1))
    for g in _beside(workload):
        for ch in chan:
            for b in bufs:
                _add(points, Point("overlap", nccl_config("copy", "copy", ch, PROBE_THREADS, b, 1), gemm=g, op=PROBE, nbytes=0, ranks=1))
    return list(points.values())


def check_layout(world: int, gpus_per_node: int, ranks: int, nodes: int) -> None:
    """Refuse a workload whose communicators this job cannot lay out.

    Args:
        world: ranks in the job.
        gpus_per_node: ranks per node.
        ranks: the collective's communicator size.
        nodes: nodes the collective spans.
    Raises:
        UserError: naming what the job would need.
    """
    nodes_total = max(1, world // max(1, gpus_per_node))
    if ranks > world or world % ranks:
        raise UserError(f"the workload has a {ranks}-rank collective but this job has {world} ranks; "
                        f"launch a multiple of {ranks} ranks with torchrun")
    if nodes > nodes_total:
        raise UserError(f"the workload has a collective across {nodes} nodes but this job spans {nodes_total}")
    if nodes == 1 and ranks > gpus_per_node:
        raise UserError(f"the workload has a {ranks}-rank collective within one node but this job has {gpus_per_node} GPUs per node")
    if nodes > 1 and (ranks % nodes or gpus_per_node % (ranks // nodes) or nodes_total % nodes):
        # a communicator takes the same share of each of its nodes, and the job tiles into them
        raise UserError(f"the workload has a {ranks}-rank collective across {nodes} nodes, which this job of {nodes_total} "
                        f"nodes of {gpus_per_node} GPUs cannot tile into equal slices of {nodes} nodes")


def subgroups(world: int, ranks: int, nodes: int, gpus_per_node: int) -> list[list[int]]:
    """Communicators of ``ranks`` ranks that tile the job the way the workload lays them out:
    consecutive ranks within a node; across ``nodes`` nodes, the same slice of consecutive ranks
    of each of ``nodes`` neighbouring nodes (a data-parallel group of 2 over 2 nodes: ``[i, i +
    gpus_per_node]``), never more nodes than the workload's collective spans.

    Args:
        world: ranks in the job.
        ranks: ranks per communicator.
        nodes: nodes one communicator spans.
        gpus_per_node: ranks per node.
    Returns:
        Each communicator's global ranks (a layout :func:`check_layout` accepts).
    """
    if nodes == 1:
        return [list(range(i * ranks, (i + 1) * ranks)) for i in range(world // ranks)]
    per_node = ranks // nodes
    return [[(block * nodes + node) * gpus_per_node + part * per_node + r for node in range(nodes) for r in range(per_node)]
            for block in range(world // gpus_per_node // nodes) for part in range(gpus_per_node // per_node)]


def process_settings(p: Point) -> tuple[tuple[str, Any], ...]:
    """The settings of ``p`` that only a fresh process can change (none for GEMMs and the probe).

    Args:
        p: a point.
    Returns:
        ``(name, value)`` pairs of its process-scope NCCL settings.
    """
    if p.kind == "gemm" or p.op == PROBE:
        return ()
    if p.kind == DEFAULT:
        return OBSERVING
    s = p.settings
    return tuple((k, s[k]) for k in PROCESS_KEYS if k in s)


def batches(points: list[Point]) -> list[Batch]:
    """Group points by the environment their worker needs, keeping first-seen order. Points
    measured again (``Point.again``) get workers of their own, after the others': a second
    measurement in the same worker right after the first would show no drift.

    Args:
        points: the points to measure.
    Returns:
        One Batch per distinct process environment (and again).
    """
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        groups.setdefault((process_settings(p), p.again), []).append(p)
    return [Batch(process, tuple(v)) for (process, _), v in groups.items()]


def worker_env(process: Mapping[str, Any], ops: set[str], nccl_version: tuple[int, ...] | None,
               base: Mapping[str, str], tuner_plugin: str | None = None,
               log_dir: str | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment of a worker measuring under ``process`` settings, and what was removed.

    Variables that override every communicator's own channel config (``NCCL_MIN_CTAS`` ...) are
    dropped, since the sweep sets channels per communicator; so are the user's own
    ``NCCL_ALGO``/``NCCL_PROTO``/``NCCL_NTHREADS``/``NCCL_BUFFSIZE``, which the sweep owns. The
    batch that observes NCCL's own choices (:data:`OBSERVING`) runs lagom-tune's tuner plugin with
    no rules, in place of any the user names, and has NCCL log what it runs each call with to a
    file of its own in ``log_dir`` (``nccl_log``: the channels), in place of the user's ``NCCL_DEBUG*``.

    Args:
        process: the batch's process settings (``algo``, ``proto``, ``threads``, ``buffsize``), or
            :data:`OBSERVING`'s.
        ops: the collective ops the batch measures (``NCCL_ALGO``'s per-op syntax names them).
        nccl_version: NCCL's version, or None when unknown (then the global syntax is used).
        base: the parent's environment.
        tuner_plugin: the built tuner plugin, for the observing batch (None: NCCL's log alone
            says its choices).
        log_dir: a folder for the observing batch's NCCL logs (None: not logged; no channels seen).
    Returns:
        The worker's environment, and the user's variables it dropped or gave another value.
    """
    process_vars = {k.name: k.env for k in nccl_knob_space().knobs if k.env}  # NCCL_NTHREADS, NCCL_BUFFSIZE
    owned = ("NCCL_ALGO", "NCCL_PROTO", *process_vars.values())
    observing = tuple(process.items()) == OBSERVING
    observers = (PLUGIN_ENV, RULES_ENV, *((*LOG_ENV, FILE_ENV) if log_dir else ())) if observing else ()
    removed = [k for k in (*OVERRIDING_ENV, *owned, *observers) if k in base]
    env = {k: val for k, val in base.items() if k not in removed}
    if observing and tuner_plugin:
        env[PLUGIN_ENV] = tuner_plugin
    if observing and log_dir:
        env.update(LOG_ENV, **{FILE_ENV: str(Path(log_dir) / LOG_NAME)})
    for name, var in process_vars.items():
        if name in process:
            env[var] = str(int(process[name]))
    funcs = sorted({TUNER_COLL[op] for op in ops if op in TUNER_COLL and op != "all_to_all"})
    per_op = nccl_version is not None and tuple(nccl_version[:2]) >= PER_OP_SYNTAX
    for key, var, names in (("algo", "NCCL_ALGO", ALGO_ENV), ("proto", "NCCL_PROTO", PROTO_ENV)):
        if key not in process or not funcs:
            continue
        value = names[process[key]]
        env[var] = ";".join(f"{f}:{value}" for f in funcs) if per_op else value
    return env, [k for k in removed if env.get(k) != base[k]]


def channel_options(options_cls: Any, ranks: int, channels: int) -> Any:
    """``ProcessGroupNCCL.Options`` pinning a communicator to ``channels`` CTAs (min = max).

    Args:
        options_cls: ``ProcessGroupNCCL.Options``.
        ranks: the communicator's size.
        channels: its channels.
    Returns:
        The Options.
    """
    return build_options(options_cls, CommunicatorConfig("profile", ranks, channels, channels))
