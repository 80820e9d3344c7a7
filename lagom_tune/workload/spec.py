"""Workload types (DESIGN.md §4) with validated YAML round-trip."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from lagom_tune import validate as v
from lagom_tune.errors import UserError
from lagom_tune.yaml_io import read_yaml, write_yaml

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
SCHEMA_VERSION = 1
MAX_RANKS = 1 << 20  # ranks (and nodes) of a communicator, at most: a million GPUs, beyond any job
MAX_REPEAT = 10 ** 6  # a group's repeats in one iteration, at most (80 layers x 64 micro-batches is 5,120)
MAX_EXPOSED_MS = 1e7  # exposed time per iteration, at most: under three hours (1e308 printed 300-digit times)
MAX_DIM = 1 << 24  # a GEMM side (m, n, k) or batch, at most: 16M, beyond any layer (a 400-digit m overflowed floats)
MAX_NBYTES = 1 << 44  # bytes one collective moves, at most: 16 TiB
WORKLOAD_FIELDS = ("schema_version", "kind", "name", "exposed_ms", "meta", "groups")
KIND = "lagom-workload"
FILE_MARK = rf"\Aschema_version: \d+\r?\nkind: {KIND}$"  # a workload file's first two lines, as written (``workload import`` replaces only such a file)
GROUP_FIELDS = ("name", "repeat", "compute", "comm")


@dataclass(frozen=True)
class Gemm:
    """A (batched) matrix multiply ``[batch] x (m x k) @ (k x n)``."""

    name: str
    m: int
    n: int
    k: int
    dtype: str = "fp32"
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def nbytes(self) -> int:
        """Bytes read and written once (A, B, C): the memory side of a roofline."""
        return (self.m * self.k + self.k * self.n + self.m * self.n) * self.batch * DTYPES[self.dtype]

    @property
    def shape_key(self) -> str:
        return f"{self.batch}x{self.m}x{self.n}x{self.k}:{self.dtype}"


def gemm_of_key(key: str, name: str = "g") -> Gemm:
    """The GEMM a shape key (``Gemm.shape_key``: ``BxMxNxK:dtype``) names.

    Args:
        key: the shape key.
        name: the name to give it.
    Returns:
        The Gemm.
    Raises:
        ValueError: for a key that names no GEMM (malformed, a side below 1, an unknown dtype).
    """
    dims, dtype = key.split(":")
    b, m, n, k = (int(x) for x in dims.split("x"))
    if min(b, m, n, k) < 1 or dtype not in DTYPES:
        raise ValueError(f"{key!r}: every side at least 1 and a dtype of {', '.join(DTYPES)}")
    return Gemm(name, m, n, k, dtype, b)


def mesh_dim_of(group_desc: Any) -> str | None:
    """The DeviceMesh dimension a group was made for, from the description DeviceMesh gives it
    (``mesh_<dim name>``); None for other groups and for the mesh's reuse of the world group.

    Args:
        group_desc: the ``group_desc`` the group was made with.
    Returns:
        The dimension's name, or None.
    """
    if isinstance(group_desc, str) and group_desc.startswith("mesh_") and group_desc != "mesh_default":
        return group_desc[len("mesh_"):]
    return None


@dataclass(frozen=True)
class Collective:
    """One collective. ``nbytes`` follows nccl-tests: the full buffer (AG output, RS input, AR buffer).

    ``after`` is the index of the computation in the same group that must finish before the
    collective may start (a gradient is ready only once its weight-gradient GEMM is done).
    """

    name: str
    op: str
    nbytes: int
    group: str = "dp"
    ranks: int = 2
    nodes: int = 1
    after: int | None = None

    @cached_property
    def rule_key(self) -> str:
        """What a per-collective setting can be keyed on at run time: NCCL's tuner sees the op,
        the communicator and the size, never the caller's name, so collectives alike in all three
        share one setting."""
        return f"{self.op}@{self.group}:{self.nbytes}"


@dataclass(frozen=True)
class OverlapGroup:
    """Computations in order on one stream, collectives in order on another, ``repeat`` times."""

    name: str
    compute: tuple[Gemm, ...]
    comm: tuple[Collective, ...] = ()
    repeat: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    groups: tuple[OverlapGroup, ...]
    exposed_ms: float = 0.0
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def gemms(self) -> dict[str, Gemm]:
        """Distinct GEMM shapes, keyed by shape."""
        return {g.shape_key: g for grp in self.groups for g in grp.compute}

    def collectives(self) -> list[Collective]:
        return [c for grp in self.groups for c in grp.comm]

    def communicators(self) -> dict[str, list[Collective]]:
        out: dict[str, list[Collective]] = {}
        for c in self.collectives():
            out.setdefault(c.group, []).append(c)
        return out

    @property
    def largest_communicator(self) -> int:
        """Ranks in the workload's largest communicator (1 without collectives)."""
        return max((c.ranks for c in self.collectives()), default=1)

    @property
    def world_size(self) -> int:
        """The job's ranks: ``meta.world`` where the workload records it (a preset's degrees
        multiplied: HSDP's 16 ranks hold communicators of 8 and of 2; an imported trace's world),
        else its largest communicator's."""
        return int(self.meta.get("world") or self.largest_communicator)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "name": self.name,
            "exposed_ms": self.exposed_ms,
            "meta": dict(self.meta),
            "groups": [
                {
                    "name": g.name,
                    "repeat": g.repeat,
                    "compute": [asdict(x) for x in g.compute],
                    "comm": [{k: val for k, val in asdict(c).items() if val is not None} for c in g.comm],
                }
                for g in self.groups
            ],
        }

    @property
    def digest(self) -> str:
        blob = json.dumps({k: val for k, val in self.to_dict().items() if k != "meta"}, sort_keys=True)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> Path:
        return write_yaml(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, path: str = "workload") -> "Workload":
        d = v.document(data, path, "workload file")
        kind = d.get("kind", KIND)  # optional in hand-written workloads; another artifact's is refused (before its fields are)
        if kind != KIND:
            raise UserError(f"{path}.kind: expected {KIND!r}, got {kind!r} (is this a workload file?)")
        v.schema_version(d, path, SCHEMA_VERSION, default=SCHEMA_VERSION)
        v.known_keys(d, WORKLOAD_FIELDS, path)
        groups = []
        sizes: dict[str, tuple[tuple[int, int], str]] = {}  # communicator -> its ranks and nodes, and where first given
        index_of: dict[str, int] = {}
        for i, gd in enumerate(v.seq(v.field(d, "groups", path, list), f"{path}.groups")):
            gp = f"{path}.groups[{i}]"
            gd = v.known_keys(v.mapping(gd, gp), GROUP_FIELDS, gp)
            compute = tuple(_gemm(x, f"{gp}.compute[{j}]") for j, x in enumerate(v.field(gd, "compute", gp, list, [])))
            comm = tuple(_collective(x, f"{gp}.comm[{j}]", len(compute)) for j, x in enumerate(v.field(gd, "comm", gp, list, [])))
            if not compute and not comm:
                raise UserError(f"{gp}: a group needs at least one computation or collective")
            _check_group(compute, comm, sizes, gp)
            name = v.name(gd, "name", gp)
            if name in index_of:  # tables and the report's timelines name groups: two could not be told apart
                raise UserError(f"{gp}.name: {name!r} is also groups[{index_of[name]}]'s; group names are unique")
            index_of[name] = len(groups)  # (a scan per group made a 6,000-group trace's workload take seconds)
            groups.append(OverlapGroup(name, compute, comm, v.field(gd, "repeat", gp, int, 1, minimum=1, maximum=MAX_REPEAT)))
        if not groups:
            raise UserError(f"{path}.groups: a workload needs at least one group")
        w = cls(
            name=v.name(d, "name", path),
            groups=tuple(groups),
            exposed_ms=v.field(d, "exposed_ms", path, float, 0.0, minimum=0.0, maximum=MAX_EXPOSED_MS),
            meta=v.mapping(v.field(d, "meta", path, dict, {}), f"{path}.meta"),
        )
        # the job's ranks (search writes them into the plan) hold its largest communicator
        world = v.field(w.meta, "world", f"{path}.meta", int, None, minimum=1, maximum=MAX_RANKS)
        if world is not None and world < w.largest_communicator:
            raise UserError(f"{path}.meta.world: {world} ranks cannot hold a communicator of {w.largest_communicator}; "
                            "give the job's ranks, at least its largest communicator's")
        return w


def _check_group(compute: tuple[Gemm, ...], comm: tuple[Collective, ...], sizes: dict[str, tuple[tuple[int, int], str]],
                 path: str) -> None:
    """Refuse two ops of one name in a group (a timeline keys each op's settings by name) and a
    communicator of two sizes or two layouts (a plan's rules and roles are per communicator; one
    communicator's collectives all span the same nodes, and the simulator timed one over NVLink
    and another over InfiniBand); ``sizes`` holds the communicators met so far, with where each
    was first given."""
    for kind, ops in (("compute", compute), ("comm", comm)):
        seen: dict[str, int] = {}
        for j, op in enumerate(ops):
            if op.name in seen:
                raise UserError(f"{path}.{kind}[{j}].name: {op.name!r} is also {kind}[{seen[op.name]}]'s; names in a group are unique")
            seen[op.name] = j
    for j, c in enumerate(comm):
        (ranks, nodes), where = sizes.setdefault(c.group, ((c.ranks, c.nodes), f"{path}.comm[{j}]"))
        if ranks != c.ranks:
            raise UserError(f"{path}.comm[{j}].ranks: communicator {c.group!r} has {ranks} ranks in {where}, "
                            f"{c.ranks} here; give communicators of other sizes other names")
        if nodes != c.nodes:
            raise UserError(f"{path}.comm[{j}].nodes: communicator {c.group!r} spans {nodes} node(s) in {where}, "
                            f"{c.nodes} here; one communicator's collectives span the same nodes")


def _gemm(x: Any, path: str) -> Gemm:
    x = v.known_keys(v.mapping(x, path), tuple(f.name for f in fields(Gemm)), path)
    return Gemm(
        name=v.name(x, "name", path),
        m=v.field(x, "m", path, int, minimum=1, maximum=MAX_DIM),
        n=v.field(x, "n", path, int, minimum=1, maximum=MAX_DIM),
        k=v.field(x, "k", path, int, minimum=1, maximum=MAX_DIM),
        dtype=v.one_of(v.field(x, "dtype", path, str, "fp32"), DTYPES, f"{path}.dtype"),
        batch=v.field(x, "batch", path, int, 1, minimum=1, maximum=MAX_DIM),
    )


def _collective(x: Any, path: str, n_compute: int) -> Collective:
    x = v.known_keys(v.mapping(x, path), tuple(f.name for f in fields(Collective)), path)
    after = v.field(x, "after", path, int, None, minimum=0)
    if after is not None and after >= n_compute:
        raise UserError(f"{path}.after: {after} names no computation (the group has {n_compute})")
    ranks = v.field(x, "ranks", path, int, 2, minimum=2)  # over one rank a collective moves nothing
    nodes = v.field(x, "nodes", path, int, 1, minimum=1)
    if ranks > MAX_RANKS:
        raise UserError(f"{path}.ranks: {ranks} ranks, more than {MAX_RANKS}")
    if nodes > ranks:
        raise UserError(f"{path}.nodes: {nodes} nodes for {ranks} ranks; a node holds at least one")
    return Collective(
        name=v.name(x, "name", path),
        op=v.one_of(v.field(x, "op", path, str), OPS, f"{path}.op"),
        nbytes=v.field(x, "nbytes", path, int, minimum=1, maximum=MAX_NBYTES),
        group=v.name(x, "group", path, "dp"),
        ranks=ranks,
        nodes=nodes,
        after=after,
    )


def load_workload(path: str | Path) -> Workload:
    """Read and check a workload file.

    Args:
        path: the workload YAML.
    Returns:
        The Workload.
    Raises:
        UserError: naming the field, for anything the format does not allow.
    """
    data = read_yaml(path, "workload file")
    v.document(data, str(path), "workload file")  # an empty file or a list named by the file, not by "workload"
    return Workload.from_dict(data, "workload")
