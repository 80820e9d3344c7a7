"""Build a workload from a torch.profiler Chrome trace (``prof.export_chrome_trace``).

Computations are GEMM ops (``aten::mm``/``addmm``/``bmm`` on CPU; GEMM kernels on GPU, shaped by
the CPU op that launched them through their shared ``External id``); collectives are gloo ops
(``gloo:all_reduce``...) or NCCL kernels (``ncclDevKernel_*``). Each set of collectives that
overlap the same GEMMs becomes one overlap group; a collective waits for the GEMM that ended
last before it started (``after``). GEMMs beside no collective become compute-only groups, and
the rest of the traced step (element-wise ops, optimizer...) becomes ``exposed_ms``. Shapes need
``record_shapes=True``. The trace's own times are kept in ``meta`` for comparison.
"""

from __future__ import annotations

import json
import bisect
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lagom_tune.errors import UserError
from lagom_tune.workload.presets import GPUS_PER_NODE, nodes_spanned
from lagom_tune.workload.spec import MAX_RANKS, Collective, Gemm, OverlapGroup, Workload, mesh_dim_of

CPU_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm"}
GPU_GEMM = re.compile(r"gemm|cutlass|sm\d+_xmma|nvjet", re.I)
COLLECTIVE_OPS = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce", "allgather": "all_gather", "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter", "alltoall": "all_to_all",
    "all_to_all": "all_to_all", "all_to_allv": "all_to_all", "alltoall_base": "all_to_all", "broadcast": "broadcast",
}
# Bytes per element under every spelling a trace uses: a CPU op's "Input type" (aten's C++ names)
# and an NCCL kernel's "dtype" (c10's ScalarType names).
ELEMENT_BYTES = {
    "float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
    "BFloat16": 2, "Half": 2, "Float": 4, "Double": 8, "Int": 4, "Long": 8, "Byte": 1, "Char": 1,
}
GEMM_DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16"}  # others are measured as fp32


@dataclass(frozen=True)
class _Event:
    name: str
    start: float  # µs
    end: float
    args: dict

    @property
    def dur(self) -> float:
        return self.end - self.start


def _collective_op(name: str, args: dict) -> str | None:
    """The collective a trace event ran: a gloo op by its name; an NCCL kernel by the op torch
    recorded on it (``Collective name``), else by the kernel's name. NCCL runs all-to-all as a
    ``SendRecv`` kernel, which only the recorded name tells apart from a point-to-point send."""
    m = re.match(r"gloo:(\w+)$", name)
    if m:
        return COLLECTIVE_OPS.get(m.group(1).lower())
    m = re.match(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    if not m:
        return None
    recorded = args.get("Collective name")
    if isinstance(recorded, str) and recorded:
        return COLLECTIVE_OPS.get(recorded.lower())
    return COLLECTIVE_OPS.get(m.group(1).lower())


def _count(x: Any) -> bool:
    """Whether ``x`` is a whole number of elements (a trace's shapes are JSON: anything may be there)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _first_type(types: Any) -> str:
    """The element type of a trace op's first input ("float" when the trace does not say)."""
    first = types[0] if isinstance(types, list) and types else "float"
    return first if isinstance(first, str) else "float"


def _type_bytes(types: Any) -> int:
    """Bytes per element of a trace op's first input (4 when the trace does not say)."""
    return ELEMENT_BYTES.get(_first_type(types), 4)


def _gemm_from_dims(name: str, dims: Any, types: Any) -> Gemm | None:
    """The GEMM a CPU op ran, from its input shapes; None when they are not those of a GEMM."""
    try:
        if name == "aten::addmm":
            (m, k), (_, n) = dims[1], dims[2]
            b = 1
        elif name == "aten::mm":
            (m, k), (_, n) = dims[0], dims[1]
            b = 1
        else:  # aten::bmm
            (b, m, k), (_, _, n) = dims[0], dims[1]
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    if not all(_count(x) and x > 0 for x in (b, m, n, k)):
        return None
    return Gemm(name.split("::")[1], m, n, k, GEMM_DTYPES.get(_first_type(types), "fp32"), b)


# An op and the event that ran it in the trace.
TimedGemm = tuple[_Event, Gemm]
TimedCollective = tuple[_Event, Collective]


def _read_spans(path: Path) -> tuple[dict, list[dict]]:
    """The trace's JSON and its complete events (``ph == "X"`` with a duration).

    Args:
        path: the Chrome trace.
    Returns:
        The whole document and its spans.
    Raises:
        UserError: for a missing file, a file that is not JSON, or JSON without ``traceEvents``.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"trace not found: {path}") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or a number over 4,300 digits; RecursionError: nested thousands deep
        raise UserError(f"{path} is not a JSON Chrome trace: {e}") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise UserError(f"{path}: no traceEvents list (export it with prof.export_chrome_trace)")
    return data, [_checked_span(e, path) for e in events if _is_span(e)]


def _is_span(e: Any) -> bool:
    """A complete event (``ph == "X"``) with a name, a start and a non-negative duration."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    return (isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("name"), str) and number(e.get("ts"))
            and number(e.get("dur")) and e["dur"] >= 0)


def _checked_span(e: dict, path: Path) -> dict:
    """The span with ``args`` a mapping (``{}`` when the trace has none or something else).

    Raises:
        UserError: for a span whose end (``ts + dur``) is past any float: imported, every time was inf.
    """
    if not math.isfinite(e["ts"] + e["dur"]):
        raise UserError(f"{path}: span {e['name']!r}: ts {e['ts']} + dur {e['dur']} µs ends past any time; is this a trace?")
    return {**e, "args": e["args"] if isinstance(e.get("args"), dict) else {}}


def _collective_bytes(ev: _Event, op: str, ranks: int) -> int:
    """The bytes a collective event moved, as nccl-tests (and the presets) size it: an all-gather
    by its output, every other op by its input; from the input's shape and type (a gloo op), or
    NCCL's element counts and the kernel's ``dtype`` (a GPU kernel, which has no input type: its
    elements were counted as 4 bytes, and an all-gather as one rank's shard, of ``ranks``)."""
    dims = ev.args.get("Input Dims")
    first = dims[0] if isinstance(dims, list) and dims and isinstance(dims[0], list) else []
    nelems = math.prod(first) if first and all(_count(x) for x in first) else 0
    kernel_dtype = ev.args.get("dtype")
    if "Input type" in ev.args or not isinstance(kernel_dtype, str) or kernel_dtype not in ELEMENT_BYTES:
        size = _type_bytes(ev.args.get("Input type"))
    else:
        size = ELEMENT_BYTES[kernel_dtype]
    if op == "all_gather":
        out = ev.args.get("Out msg nelems", 0)
        if _count(out) and out:
            return out * size
        nelems *= ranks  # a gloo all-gather's input is this rank's shard
    msg = ev.args.get("In msg nelems", 0)
    return nelems * size or (msg * size * (ranks if op == "all_gather" else 1) if _count(msg) else 0)


@dataclass(frozen=True)
class _Communicator:
    role: str
    ranks: int
    nodes: int
    nodes_guessed: bool  # the trace did not list the group's ranks: laid out over consecutive ranks


def _communicator(args: dict, world: int, gpus_per_node: int, groups: dict[str, dict]) -> _Communicator:
    """The communicator of a collective event, from what torch recorded on it: its ``Group size``,
    the DeviceMesh dimension its ``Process Group Description`` names (``mesh_tp``: role ``tp``,
    the role a plan's rules and the runtime shim match it by), and the nodes its ``Process Group
    Ranks`` span at ``gpus_per_node`` ranks a node (else the ranks the trace's ``pg_config`` gives
    its ``Process Group Name``, in ``groups``). A group no mesh dimension names is ``dp`` when it
    spans the world (the default group, a 1-D mesh), else ``group<size>`` (the runtime tells such
    roles apart by size). Events without these arguments (gloo ops, older traces) are the world's,
    and a group whose ranks the trace does not list whole (torch truncates long lists) is taken to
    be consecutive ranks."""
    size = args.get("Group size")
    ranks = size if _count(size) and 0 < size <= MAX_RANKS else world
    config = groups.get(str(args.get("Process Group Name")), {})
    role = (mesh_dim_of(args.get("Process Group Description", config.get("pg_desc")))
            or ("dp" if ranks == world else f"group{ranks}"))
    members = _rank_list(args.get("Process Group Ranks")) or _rank_list(config.get("ranks"))
    if members is not None and len(members) == ranks:
        return _Communicator(role, ranks, len({r // gpus_per_node for r in members}), False)
    return _Communicator(role, ranks, nodes_spanned(ranks, gpus_per_node), True)


def _rank_list(x: Any) -> list[int] | None:
    """Global ranks as torch records them on a collective (a list, or its text), or None when
    they are not there whole."""
    if isinstance(x, str):
        try:
            x = json.loads(x)
        except ValueError:  # "[0, 1, 2, ...]": cut short
            return None
    return x if isinstance(x, list) and x and all(_count(r) for r in x) else None


def _timed_ops(spans: list[dict], world: int, gpus_per_node: int,
               groups: dict[str, dict]) -> tuple[list[TimedGemm], list[TimedCollective], bool, set[str]]:
    """The trace's GEMMs and collectives, each with its event, in start order.

    Args:
        spans: the trace's complete events.
        world: the collectives' world size.
        gpus_per_node: ranks a node holds (how many nodes a communicator spans).
        groups: the trace's process groups by name (``distributedInfo.pg_config``).
    Returns:
        GEMMs, collectives, whether the trace has GPU kernels (then GEMMs are the kernels,
        shaped by the CPU op that launched them; else the CPU ops themselves), and the roles whose
        nodes were guessed (:func:`_communicator`). A role's collectives span the most nodes any
        of its groups does (one role, one layout: a workload refuses two).
    """
    shapes_by_id = {e["args"]["External id"]: e for e in spans
                    if e["name"] in CPU_GEMMS and isinstance(e["args"].get("External id"), (int, str))}
    gemms: list[TimedGemm] = []
    colls: list[TimedCollective] = []
    gpu_kernels = any(e.get("cat") == "kernel" for e in spans)
    nodes: dict[str, int] = {}
    guessed: set[str] = set()
    for e in spans:
        ev = _Event(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["args"])
        op = _collective_op(ev.name, ev.args)
        if op:
            comm = _communicator(ev.args, world, gpus_per_node, groups)
            nbytes = _collective_bytes(ev, op, comm.ranks)
            if nbytes > 0 and comm.ranks > 1:  # over one rank a collective moves nothing
                colls.append((ev, Collective(f"{op}.{len(colls)}", op, nbytes, comm.role, comm.ranks)))
                nodes[comm.role] = max(nodes.get(comm.role, 1), comm.nodes)
                if comm.nodes_guessed:
                    guessed.add(comm.role)
            continue
        source = None
        if gpu_kernels and e.get("cat") == "kernel" and GPU_GEMM.search(ev.name):
            kernel_id = ev.args.get("External id")
            source = shapes_by_id.get(kernel_id) if isinstance(kernel_id, (int, str)) else None
        elif not gpu_kernels and ev.name in CPU_GEMMS:
            source = e
        if source is not None:
            g = _gemm_from_dims(source["name"], source["args"].get("Input Dims", []), source["args"].get("Input type", []))
            if g is not None:
                gemms.append((ev, g))
    gemms.sort(key=lambda x: x[0].start)
    colls = sorted(((ev, replace(c, nodes=nodes[c.group])) for ev, c in colls), key=lambda x: x[0].start)
    return gemms, colls, gpu_kernels, guessed


def _overlap_groups(gemms: list[TimedGemm], colls: list[TimedCollective]) -> tuple[list[OverlapGroup], dict[str, float], set[int]]:
    """One group per cluster of collectives whose windows overlap, or that one GEMM overlaps, with
    the GEMMs beside them.

    Args:
        gemms: the GEMMs, in start order.
        colls: the collectives, in start order.
    Returns:
        The groups (``overlap.N``), each group's traced milliseconds, and the indices of the
        GEMMs they took.
    """
    clusters: list[list[TimedCollective]] = []
    reach = -math.inf  # the latest end in the current cluster
    for item in colls:  # windows merge while they overlap
        if clusters and item[0].start <= reach:
            clusters[-1].append(item)
        else:
            clusters.append([item])
            reach = -math.inf
        reach = max(reach, item[0].end)
    used: set[int] = set()
    groups: list[OverlapGroup] = []
    traced: dict[str, float] = {}
    # GEMMs beside a window [lo, hi) start before hi and at most the longest GEMM before lo: a
    # bisection bounds the scan (a trace of tens of thousands of ops took minutes).
    starts = [e.start for e, _ in gemms]
    longest = max((e.dur for e, _ in gemms), default=0.0)
    # Windows one GEMM overlaps are one group: four all-reduces inside one long GEMM, with gaps
    # between them, were four groups, three without computation, played one after another (a
    # workload of 1.45 ms where the trace ran 1.0).
    bridged: list[list[TimedCollective]] = []
    for cluster in clusters:
        if bridged:
            prev_hi, lo = max(e.end for e, _ in bridged[-1]), min(e.start for e, _ in cluster)
            span = range(bisect.bisect_left(starts, lo - longest), bisect.bisect_left(starts, prev_hi))
            if any(gemms[i][0].end > lo for i in span):
                bridged[-1].extend(cluster)
                continue
        bridged.append(list(cluster))
    clusters = bridged
    for ci, cluster in enumerate(clusters):
        lo, hi = min(e.start for e, _ in cluster), max(e.end for e, _ in cluster)
        candidates = range(bisect.bisect_left(starts, lo - longest), bisect.bisect_left(starts, hi))
        # each GEMM once, beside the first window it overlaps (one beside two back-to-back
        # all-reduces was counted in both groups: a workload of 4 GEMMs where the trace ran 3)
        idx = [i for i in candidates if gemms[i][0].end > lo and i not in used]
        used |= set(idx)
        compute = [replace_name(gemms[i][1], f"g{i}") for i in idx]
        comm = []
        for e, c in cluster:  # a collective waits for the GEMM that ended last before it started
            done_before = [j for j, i in enumerate(idx) if gemms[i][0].end <= e.start]
            comm.append(Collective(c.name, c.op, c.nbytes, c.group, c.ranks, c.nodes, done_before[-1] if done_before else None))
        label = f"overlap.{ci}"
        start = min([lo] + [gemms[i][0].start for i in idx])
        end = max([hi] + [gemms[i][0].end for i in idx])
        traced[label] = round((end - start) / 1e3, 3)
        groups.append(OverlapGroup(label, tuple(compute), tuple(comm)))
    return groups, traced, used


def _compute_groups(gemms: list[TimedGemm], used: set[int], first: int) -> tuple[list[OverlapGroup], dict[str, float]]:
    """One compute-only group per run of GEMMs beside no collective.

    Args:
        gemms: the GEMMs, in start order.
        used: indices of the GEMMs an overlap group took.
        first: the number of groups before these (they are named ``compute.N`` after it).
    Returns:
        The groups and each one's traced milliseconds (the sum of its GEMMs').
    """
    groups: list[OverlapGroup] = []
    traced: dict[str, float] = {}
    run: list[int] = []

    def flush() -> None:
        if run:
            nm = f"compute.{first + len(groups)}"
            groups.append(OverlapGroup(nm, tuple(replace_name(gemms[i][1], f"g{i}") for i in run)))
            traced[nm] = round(sum(gemms[i][0].dur for i in run) / 1e3, 3)
            run.clear()

    for i in range(len(gemms)):
        if i in used:
            flush()
        else:
            run.append(i)
    flush()
    return groups, traced


def _in_trace_order(groups: list[OverlapGroup], gemms: list[TimedGemm], colls: list[TimedCollective]) -> list[OverlapGroup]:
    """The groups ordered by when their first op started in the trace."""
    start_of = {c.name: e.start for e, c in colls}  # collective names are unique (op.N)
    first_start = {}
    for g in groups:
        idx = [int(op.name.split(".")[0][1:]) for op in g.compute]
        first_start[g.name] = min([gemms[i][0].start for i in idx] + [start_of[x.name] for x in g.comm])
    return sorted(groups, key=lambda g: first_start[g.name])


def import_trace(path: str | Path, *, name: str | None = None, ranks: int | None = None,
                 gpus_per_node: int = GPUS_PER_NODE) -> Workload:
    """Read a Chrome trace and return its overlap groups as a workload.

    Args:
        path: a torch.profiler Chrome trace of one step (``record_shapes=True``).
        name: the workload's name (default: the file's stem).
        ranks: the collectives' world size (default: the trace's ``distributedInfo``, else 2).
        gpus_per_node: ranks per node of the traced job (how many nodes each communicator spans).
    Returns:
        The Workload: overlap groups, compute-only groups, and the rest of the step as
        ``exposed_ms``; ``meta`` keeps the trace's own times.
    Raises:
        UserError: for a file that is not a trace, or a trace without shaped GEMMs.
    """
    path = Path(path)
    data, spans = _read_spans(path)
    info = data.get("distributedInfo")
    world = ranks or (info.get("world_size", 2) if isinstance(info, dict) else 2)
    if not (_count(world) and 1 <= world <= MAX_RANKS):
        if ranks:
            raise UserError(f"--ranks {ranks} is not a number of ranks (1 to {MAX_RANKS})")
        raise UserError(f"{path}: distributedInfo.world_size is {world!r}, not a number of ranks (1 to {MAX_RANKS}); give --ranks")
    if world < 2:  # over one rank a collective moves nothing: there is no overlap to tune
        raise UserError(f"{path}: a trace of one rank runs no collective; give --ranks with the job's world size (2 or more)")
    if not 1 <= gpus_per_node <= MAX_RANKS:
        raise UserError(f"--gpus-per-node {gpus_per_node} is not a number of ranks a node holds (1 to {MAX_RANKS})")
    config = info.get("pg_config") if isinstance(info, dict) else None
    groups = {str(g["pg_name"]): g for g in config if isinstance(g, dict) and "pg_name" in g} if isinstance(config, list) else {}
    gemms, colls, gpu_kernels, guessed = _timed_ops(spans, world, gpus_per_node, groups)
    if not gemms:
        events = data.get("traceEvents", [])
        broken = sum(1 for e in events if isinstance(e, dict) and e.get("ph") == "X" and not _is_span(e))
        why = (f"; {broken} complete event(s) left out for a missing name or a bad ts/dur (a start and a non-negative "
               "duration in µs)") if broken else " (record the trace with record_shapes=True)"
        raise UserError(f"{path}: no GEMMs with shapes found{why}")
    if not colls:  # it was written, and `profile` then refused it: "workload ... has no collective"
        raise UserError(f"{path}: {len(gemms)} GEMMs and no collective with a size (gloo ops with Input Dims, or NCCL "
                        "kernels): nothing to overlap; trace a distributed training step with record_shapes=True")
    # The step: from the first to the last GEMM or collective (one profiled step per trace).
    step_start = min(e.start for e, _ in gemms + colls)
    step_end = max(e.end for e, _ in gemms + colls)
    overlapped, traced, used = _overlap_groups(gemms, colls)
    alone, alone_traced = _compute_groups(gemms, used, len(overlapped))
    traced.update(alone_traced)
    groups = _in_trace_order(overlapped + alone, gemms, colls)
    step_ms = (step_end - step_start) / 1e3
    exposed = max(0.0, step_ms - sum(traced.values()))
    imported = Workload(
        name=path.stem if name is None else name,
        groups=tuple(groups),
        exposed_ms=round(exposed, 3),
        meta={"source": str(path), "world": world, "traced_step_ms": round(step_ms, 3), "traced_group_ms": traced,
              "gemms": len(gemms), "collectives": len(colls), "device": "gpu" if gpu_kernels else "cpu",
              "gpus_per_node": gpus_per_node,
              **({"nodes_guessed": sorted(guessed)} if guessed else {}),  # roles whose ranks the trace did not list
              "note": "exposed_ms is the traced step time not covered by GEMMs or collectives"},
    )
    # checked as a workload file is: import wrote files its own loader then refused (a 1e12 ms step, a blank name)
    return Workload.from_dict(imported.to_dict(), f"{path} (imported)")


def replace_name(g: Gemm, name: str) -> Gemm:
    """``g`` renamed ``name.<its name>`` (its shape unchanged).

    Args:
        g: a GEMM.
        name: the prefix.
    Returns:
        The renamed GEMM.
    """
    return Gemm(f"{name}.{g.name}", g.m, g.n, g.k, g.dtype, g.batch)


def summary(w: Workload) -> dict[str, Any]:
    """Traced step time vs the time the imported groups cover (for `workload import`'s report).

    Args:
        w: a workload ``import_trace`` made.
    Returns:
        Traced step, group and exposed milliseconds, and the counts of groups, GEMMs and collectives.
    """
    covered = sum(w.meta.get("traced_group_ms", {}).values())
    return {"traced_step_ms": w.meta.get("traced_step_ms"), "groups_ms": round(covered, 3), "exposed_ms": w.exposed_ms,
            "groups": len(w.groups), "gemms": w.meta.get("gemms"), "collectives": w.meta.get("collectives")}
