"""A SIMULATED GPU cluster: a what-if tool, never a measurement. Every row and file says so.

Its ground truth is a mechanism, not the fitted model's equations (model/gpu.py shares no code
with it), so recovering it from the simulator's "measurements" is a real test of the model:

* computation (``sim_compute.py``): GEMM kernels chosen like cuBLAS, tiles scheduled on SMs in
  waves (a persistent grid or one CTA per tile), channel blocks holding SMs, HBM arbitrated
  between requesters, L2 evictions and HBM queueing while a collective streams; calibrated on one
  H200 (``tests/data/h200-2026-11-30``);
* communication (``sim_comm.py``): channels as pipelines of steps (an eighth of the protocol's
  buffer) with per-protocol handshakes, sharing a link through a contended fabric; calibrated to
  published nccl-tests, AutoCCL and Lagom figures;
* the two beside each other (``sim_overlap.py``): the collective holds SMs, draws HBM and evicts
  L2; the GEMM's HBM traffic slows the collective's steps. Played CTA group by CTA group: a group
  keeps the pace of the moment it started, groups waiting for a place start when the channel
  blocks leave (not the model's two rates switched at once on its timeline).

Every figure is checked against its source in ``tests/test_sim_observations.py``. Optional
multiplicative noise, deterministic for a seed and point.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from typing import Any

import numpy as np

from lagom_tune.backends.base import BackendOptions, LocalBackend, Point, RowSink, bandwidth_columns, bus_factor
from lagom_tune.backends.nccl_knobs import channels_for_call, knob_space_from_fingerprint, measured_pairs, nccl_config, overlap_algos
from lagom_tune.backends.sim_clusters import CLUSTERS, DEFAULT_CLUSTER, GB, Cluster
from lagom_tune.backends.sim_comm import IB, comm_seconds, copy_slowdown, hbm_draw, link_of
from lagom_tune.backends.sim_compute import IDLE, Contention, gemm_run
from lagom_tune.backends.sim_nccl_choice import nccl_choice
from lagom_tune.backends.sim_overlap import CommRun, play
from lagom_tune.errors import UserError
from lagom_tune.knobs import BackendChoices, KnobSpace, Settings, settings_from_items
from lagom_tune.measurements import ALONE_COLUMNS, CHOSEN, DEFAULT, OVERLAPPED_COLUMNS, PAIRED, overlap_columns, timed_columns
from lagom_tune.timeline import Timeline
from lagom_tune.workload.presets import GPUS_PER_NODE, nodes_spanned
from lagom_tune.workload.spec import Gemm, OverlapGroup, Workload


@dataclass(frozen=True)
class OverlapCost:
    """One iteration's computation slowdown while overlapped (its GEMMs' time beside collectives
    over their time alone) and how much longer the two streams take one after the other."""

    compute_slowdown: float
    serial_over_overlapped: float


class SimCluster:
    """The ground truth: times in seconds for one rank of the cluster."""

    def __init__(self, cluster: Cluster, nodes: int = 1, ib_gbps: int = 400):
        self.c = cluster
        self.nodes = nodes
        self.ib_gbps = ib_gbps

    def comm_time(self, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any], gemm_hbm: float = 0.0) -> float:
        """A collective's time alone, or beside a GEMM drawing ``gemm_hbm`` bytes/s of HBM."""
        bus = nbytes * bus_factor(op, ranks)
        return comm_seconds(self.c, op, bus, ranks, link_of(self.c, nodes, self.ib_gbps), s, gemm_hbm)

    def contention(self, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any], seconds: float | None = None) -> Contention:
        """What the collective takes from a GEMM beside it: its channel blocks' SMs, its HBM traffic
        (over ``seconds``, its time alone, computed when not given), L2."""
        t = self.comm_time(op, nbytes, ranks, nodes, s) if seconds is None else seconds
        return Contention(int(s["channels"]), hbm_draw(op, s["algo"], ranks, nbytes * bus_factor(op, ranks), t), True)

    def own_choice(self, space: KnobSpace, op: str, nbytes: int, ranks: int, nodes: int) -> dict[str, Any]:
        """What the simulated NCCL runs a call with when nothing is set: the algorithm and protocol
        NCCL's cost model gives it (``sim_nccl_choice``), on its default channels, fewer for a call
        too small to give each of them NCCL's minimum traffic (``nccl_knobs.channels_for_call``).

        Args:
            space: the cluster's NCCL knobs (the pairs it offers, its default channels).
            op: the collective.
            nbytes: its bytes.
            ranks: communicator size.
            nodes: nodes it spans.
        Returns:
            ``algo``, ``proto`` and ``channels``.
        """
        algo, proto = nccl_choice(self.c, op, nbytes, ranks, nodes, measured_pairs(space, op, nodes),
                                  link_of(self.c, nodes, self.ib_gbps).rate)
        return {"algo": algo, "proto": proto, "channels": channels_for_call(op, nbytes, proto, space["channels"].default)}

    def nothing_set(self, space: KnobSpace, op: str, nbytes: int, ranks: int, nodes: int) -> dict[str, Any]:
        """The settings a call runs with when nothing is set: :meth:`own_choice` over the space's
        other defaults (threads, buffer size).

        Args:
            space: the cluster's NCCL knobs.
            op: the collective.
            nbytes: its bytes.
            ranks: communicator size.
            nodes: nodes it spans.
        Returns:
            Every knob's value.
        """
        return {**space.defaults(op, nodes), **self.own_choice(space, op, nbytes, ranks, nodes)}

    def own_choices(self, workload: Workload, space: KnobSpace) -> BackendChoices:
        """:meth:`own_choice` for each of ``workload``'s collectives, as a profile's ``default``
        rows record them (what ``search`` takes as NCCL's defaults).

        Args:
            workload: the workload.
            space: the cluster's NCCL knobs.
        Returns:
            The choices, by rule key.
        """
        return BackendChoices({c.rule_key: self.own_choice(space, c.op, c.nbytes, c.ranks, c.nodes) for c in workload.collectives()})

    def gemm_time(self, g: Gemm, load: Contention = IDLE) -> float:
        """A GEMM's seconds, alone or beside what a collective takes."""
        return gemm_run(self.c, g, load)[0]

    def probe_slowdowns(self, g: Gemm, blocks: int, copy_hbm: float) -> tuple[float, float]:
        """A GEMM beside a copy kernel of ``blocks`` blocks that draws ``copy_hbm`` bytes/s of HBM
        alone, the probe of the H200 tables the computation is calibrated on: the GEMM's slowdown
        and the copy's."""
        contended, drawn = gemm_run(self.c, g, Contention(blocks, copy_hbm, True))
        return contended / self.gemm_time(g), copy_slowdown(self.c, copy_hbm, drawn)

    def slowdowns(self, g: Gemm, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any]) -> tuple[float, float]:
        """The GEMM's and the collective's slowdowns while both run for all of the GEMM's run."""
        x = self.comm_run(op, None, op, nbytes, ranks, nodes, s)
        contended, drawn = gemm_run(self.c, g, x.load)
        return contended / self.gemm_time(g), x.slowdown(drawn)

    def comm_run(self, name: str, after: int | None, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any]) -> CommRun:
        """A collective as the co-simulation plays it: its time alone, its load on a GEMM beside it,
        and its slowdown beside one."""
        alone = self.comm_time(op, nbytes, ranks, nodes, s)
        return CommRun(name, after, alone, self.contention(op, nbytes, ranks, nodes, s, alone),
                       lambda drawn: self.comm_time(op, nbytes, ranks, nodes, s, drawn) / alone)

    def play(self, workload: Workload, settings: Settings) -> list[tuple[OverlapGroup, Timeline]]:
        """The simulator's own answer for each overlap group of ``workload``: its GEMMs' CTA groups
        and its collectives played together (``sim_overlap.py``), not the model's timeline."""
        played = []
        for grp in workload.groups:
            comm = [self.comm_run(c.name, c.after, c.op, c.nbytes, c.ranks, c.nodes, settings.for_collective(c)) for c in grp.comm]
            played.append((grp, play(self.c, grp.compute, comm)))
        return played

    def iteration(self, workload: Workload, settings: Settings) -> float:
        """Seconds for one iteration of ``workload``: its groups played, plus its exposed time."""
        return workload.exposed_ms / 1e3 + sum(grp.repeat * t.makespan for grp, t in self.play(workload, settings))

    def overlap_cost(self, workload: Workload, settings: Settings) -> OverlapCost:
        """What overlapping costs the computation of one iteration, and what it saves over running
        the two streams one after the other (Lee et al.'s two figures)."""
        played = self.play(workload, settings)

        def per_iteration(seconds) -> float:
            return sum(grp.repeat * seconds(t) for grp, t in played)

        exposed, compute_alone = workload.exposed_ms / 1e3, per_iteration(lambda t: t.y_alone)
        serial = exposed + per_iteration(lambda t: t.y_alone + t.x_alone)
        return OverlapCost(per_iteration(lambda t: t.compute_time) / compute_alone if compute_alone else 1.0,
                           serial / (exposed + per_iteration(lambda t: t.makespan)))

    def overlap(self, g: Gemm, n: int, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any]) -> dict[str, float]:
        """n GEMMs and one collective started together: when each stream ends."""
        played = play(self.c, [g] * n, [self.comm_run(op, None, op, nbytes, ranks, nodes, s)])
        ends = {stream: max(sp.end for sp in played.spans if sp.stream == stream) for stream in ("compute", "comm")}
        t_comp, t_comm, y0, x0 = ends["compute"], ends["comm"], played.y_alone, played.x_alone
        row = overlap_columns(t_comp * 1e6, t_comm * 1e6, n, y0 * 1e6, x0 * 1e6)
        row["n_compute"] = row.pop("n_compute")  # after the alone times, where the simulator's CSV has always had it
        return row


def _noise(key: str, repeat: int, seed: int, sigma: float) -> float:
    if sigma <= 0:
        return 1.0
    h = int.from_bytes(hashlib.blake2b(f"{seed}|{key}|{repeat}".encode(), digest_size=8).digest(), "little")
    return float(np.exp(sigma * np.random.default_rng(h).standard_normal()))


class SimBackend(LocalBackend):
    """The simulated cluster behind the Backend protocol; labelled ``simulated`` everywhere."""

    def __init__(self, options: BackendOptions):
        hw = DEFAULT_CLUSTER if options.hardware is None else options.hardware  # '' is refused, not the default
        if hw not in CLUSTERS:
            raise UserError(f"unknown --hardware {hw!r}; simulated clusters: {', '.join(CLUSTERS)}")
        ib = int(options.extra.get("ib_gbps", 400))
        if ib not in IB:
            raise UserError(f"ib_gbps {ib} (--ib-gbps, or a run's fingerprint.ib_gbps): the simulated InfiniBand rates are {', '.join(map(str, IB))} Gb/s")
        if options.nodes is not None and options.nodes < 1:
            raise UserError("--nodes must be at least 1")
        self.cluster = CLUSTERS[hw]
        self.hardware_said = options.hardware is not None
        self.options = options
        self.ib_gbps = ib
        self.nodes = options.nodes or 1  # sized to the workload by plan_points when --nodes was not given
        self.ranks = GPUS_PER_NODE * self.nodes  # the job's, once plan_points has seen its workload
        self.sim = SimCluster(self.cluster, self.nodes, ib)
        self.knob_space = knob_space_from_fingerprint({"cluster": self.cluster.name})  # the one a plan of it is read with
        # rounds each point has been measured: measured again (a plan replayed round after round),
        # it draws the next rounds' noise, as a real device would not time it the same twice
        self._rounds: dict[str, int] = {}

    def fingerprint(self) -> dict[str, Any]:
        c = self.cluster
        return {"backend": self.name, "simulated": self.simulated, "cluster": c.name, "device": f"{c.device} (simulated)", "gpu": c.device,
                "sms": c.sms, "hbm_GBps": c.hbm / GB, "rank_memory_GiB": c.memory_GiB, "nodes": self.nodes, "gpus_per_node": GPUS_PER_NODE,
                "ranks": self.ranks, "ib_gbps": self.ib_gbps if self.nodes > 1 else None,
                **({} if self.hardware_said else {"hardware_note": f"--hardware not given: the default {c.name}"}),
                "seed": self.options.seed, "noise": self.options.noise, "host": platform.node()}

    def plan_points(self, workload: Workload) -> list[Point]:
        self._fit_layout(workload)
        space = self.knob_space
        points: list[Point] = []
        for g in sorted(workload.gemms().values(), key=lambda g: g.flops):
            points.append(Point("gemm", (), gemm=g))
        colls = {(c.op, c.nbytes, c.ranks, c.nodes) for c in workload.collectives()}
        for op, nbytes, ranks, nodes in sorted(colls):
            cells = [(a, p, ch, t, b) for a, p in measured_pairs(space, op, nodes)
                     for ch in space["channels"].domain for t in space["threads"].domain for b in space["buffsize"].domain]
            for size in sorted({nbytes, max(1 << 16, nbytes // 8)}):
                for a, p, ch, t, b in cells:
                    points.append(Point("collective", nccl_config(a, p, ch, t, b, nodes), op=op, nbytes=size, ranks=ranks))
        for op, nbytes, ranks, nodes in sorted(colls):  # each at the simulated NCCL's own choice
            points.append(Point(DEFAULT, (("nodes", nodes),), op=op, nbytes=nbytes, ranks=ranks))
        # Overlapped pairs: every GEMM shape that runs beside a collective, against each
        # collective of the workload, over channels and buffer sizes (the protocol and threads at
        # their defaults, as the nccl sweep's), on the ring and on the op's own default algorithm
        # where that is another (NVLS all-reduce).
        beside = {g.shape_key: g for grp in workload.groups if grp.comm for g in grp.compute}
        proto, threads = space["proto"].default, space["threads"].default
        for g in sorted(beside.values(), key=lambda g: g.flops):
            for op, nbytes, ranks, nodes in sorted(colls):
                for algo in overlap_algos(space, op, nodes):
                    for ch in space["channels"].domain:
                        for b in space["buffsize"].domain:
                            points.append(Point("overlap", nccl_config(algo, proto, ch, threads, b, nodes), gemm=g, op=op,
                                                nbytes=nbytes, ranks=ranks))
        # each point once, first come first: a workload's collective size may be another's eighth (measured twice, refused on read)
        return list({p.key: p for p in points}.values())

    def _fit_layout(self, workload: Workload) -> None:
        """Nodes of 8 GPUs for the workload's ranks and communicators: inferred without --nodes, else
        checked (a 16-rank workload on one simulated node was recorded as 8 ranks, an 8-rank one on a
        million nodes as 8 million; a 32-rank HSDP job whose communicators span 2 nodes needs 4)."""
        colls = workload.collectives()
        crowded = next((c for c in colls if c.ranks > c.nodes * GPUS_PER_NODE), None)
        if crowded is not None:  # it was simulated on one NVLink node while the cluster was sized to more
            raise UserError(f"collective {crowded.name}: {crowded.ranks} ranks cannot be on {crowded.nodes} node(s) of "
                            f"{GPUS_PER_NODE} simulated GPUs; give its communicator nodes: {nodes_spanned(crowded.ranks)} "
                            "or more")
        needed = max([nodes_spanned(workload.world_size)] + [c.nodes for c in colls])  # none is crowded: each holds its ranks
        if self.options.nodes is None:
            if needed != self.nodes:
                self.nodes = needed
                self.sim = SimCluster(self.cluster, needed, self.ib_gbps)
        elif self.options.nodes != needed:  # more would be recorded as the world size of a plan no job matches
            raise UserError(f"the workload needs {needed} nodes of {GPUS_PER_NODE} GPUs (its ranks and its communicators'); "
                            f"--nodes {self.options.nodes} is too {'few' if self.options.nodes < needed else 'many'} "
                            "(leave --nodes out to size the cluster to it)")
        # the job's ranks, as its plan records them (an fsdp=4 job's plan said 8, the node's GPUs),
        # where its nodes hold them evenly as the plan requires; else the nodes' GPUs
        world = workload.world_size
        self.ranks = world if world % self.nodes == 0 else GPUS_PER_NODE * self.nodes
        if self.nodes == 1 and "ib_gbps" in self.options.extra:  # it would be accepted and recorded as nothing
            raise UserError(f"--ib-gbps {self.ib_gbps}: the workload's communicators fit one node of {GPUS_PER_NODE} GPUs, "
                            "joined by NVLink or PCIe, not InfiniBand; leave --ib-gbps out")

    def iteration(self, workload: Workload, items) -> float:
        return self.sim.iteration(workload, settings_from_items(items))

    def _overlap(self, p: Point, nodes: int) -> dict[str, float]:
        """An overlap point's row without noise. Its job is sized as the nccl backend sizes one
        (``nccl_sweep.JOB_REFERENCE``): as many GEMMs as last about as long as the collective with
        nothing set, the same job at every setting of the shape and collective, so that its points'
        windows compare settings, not amounts of work."""
        y = self.sim.gemm_time(p.gemm)
        x = self.sim.comm_time(p.op, p.nbytes, p.ranks, nodes, self.sim.nothing_set(self.knob_space, p.op, p.nbytes, p.ranks, nodes))
        return self.sim.overlap(p.gemm, max(1, round(x / y)), p.op, p.nbytes, p.ranks, nodes, p.settings)

    def measure(self, points: list[Point], repeats: int, sink: RowSink) -> None:
        for p in points:
            s = p.settings
            nodes = s.get("nodes", 1)
            rows = []
            first = self._rounds.get(p.key, 0)
            self._rounds[p.key] = first + repeats
            played = self._overlap(p, nodes) if p.kind == "overlap" else {}  # deterministic: once, noise per repeat
            own = self.sim.nothing_set(self.knob_space, p.op, p.nbytes, p.ranks, nodes) if p.kind == DEFAULT else {}
            for r in range(repeats):
                z = _noise(p.key, first + r, self.options.seed, self.options.noise)
                if p.kind == "iteration":
                    row = timed_columns(self.iteration(p.workload, p.config) * 1e6 * z)
                elif p.kind == "gemm":
                    row = timed_columns(self.sim.gemm_time(p.gemm) * 1e6 * z)
                elif p.kind in ("collective", DEFAULT):
                    t = self.sim.comm_time(p.op, p.nbytes, p.ranks, nodes, own or s)
                    row = {**timed_columns(t * 1e6 * z), **bandwidth_columns(p.op, p.nbytes, p.ranks, t * z),
                           **{column: own[k] for k, column in CHOSEN.items() if own}}
                else:
                    row = dict(played)
                    for col in OVERLAPPED_COLUMNS:
                        row[col] *= z
                    # The alone times are measurements too, taken just before the pair the same way
                    # (paired, as on a GPU): own noise.
                    for col in ALONE_COLUMNS:
                        row[col] *= _noise(f"{p.key}|{col}", first + r, self.options.seed, self.options.noise)
                    row["baseline"] = PAIRED
                rows.append({**row, "repeat": r})  # the identity columns (simulated: True) come with the point
            sink(p, rows)

