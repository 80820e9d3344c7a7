"""A SIMULATED GPU cluster: a what-if tool, never a measurement. Every row and file says so.

Its ground truth lives here and nowhere else; the fitted model (model/gpu.py) shares no code with
it, so recovering these mechanics from the simulator's "measurements" is a real test of the fit.

Mechanics, per device (figures from DESIGN.md §10 and public specs):

* GEMM: tiles of 128x256 (128x128 when m or n < 1024), one per SM per wave; a wave takes the
  longer of its tiles' math and the HBM traffic of all tiles in flight; waves quantise, so
  taking SMs away for NCCL channels can add a whole wave.
* Communication takes one SM per channel, and HBM bandwidth in proportion to what it moves
  (about 3 bytes of HBM traffic per byte all-reduced, 2 otherwise), more with larger buffers
  (L2 spill); a GEMM beside it gets fewer SMs and less HBM.
* Collective bandwidth grows with channels and saturates at the link:
  ``bw = L * (1 - exp(-channels * per_channel / L))``, scaled by protocol efficiency (LL 50%,
  LL128 92%, Simple 100%), thread count and pipelining (buffsize / 8 per step); latency per
  step by protocol; ring uses 2(n-1) steps, tree 2*log2(n); across nodes the link is InfiniBand.
* A collective beside a GEMM slows with the GEMM's HBM pressure.
* Optional multiplicative noise, deterministic for a seed and point.
"""

from __future__ import annotations

import hashlib
import math
import platform
from typing import Any

import numpy as np

from lagom_tune.backends.base import BackendOptions, LocalBackend, Point, RowSink, bandwidth_columns, bus_factor
from lagom_tune.backends.nccl_knobs import nccl_config, nccl_knob_space
from lagom_tune.backends.sim_clusters import CLUSTERS, DEFAULT_CLUSTER, GB, Cluster
from lagom_tune.errors import UserError
from lagom_tune.workload.spec import DTYPES, Gemm, Workload

IB = {100: 12.5 * GB, 400: 50 * GB}
GPUS_PER_NODE = 8  # every simulated cluster's node
PROTO = {  # efficiency, latency per step (s)
    "ll": (0.5, 1.0e-6),
    "ll128": (0.92, 1.8e-6),
    "simple": (1.0, 4.0e-6),
}
HBM_PER_BYTE = {"all_reduce": 3.0}
LAUNCH = 4e-6


def _reuse(tiles: int) -> float:
    return min(8.0, max(1.0, math.sqrt(tiles) / 2))


def _tile(g: Gemm) -> tuple[int, int]:
    return (128, 128) if min(g.m, g.n) < 1024 else (128, 256)


class SimCluster:
    """The ground truth: times in seconds for one rank of the cluster."""

    def __init__(self, cluster: Cluster, nodes: int = 1, ib_gbps: int = 400):
        self.c = cluster
        self.nodes = nodes
        self.ib = IB[ib_gbps]

    # -- communication -------------------------------------------------------------------------

    def comm_bw(self, op: str, ranks: int, nodes: int, algo: str, proto: str, channels: int, threads: int, buffsize: int) -> float:
        eff, _ = PROTO[proto]
        ceiling = self.c.link if nodes <= 1 else min(self.c.link, self.ib * (1.0 if algo == "ring" else 1.15))
        per_channel = self.c.per_channel * min(1.0, (threads / 512) ** 0.35)
        bw = ceiling * (1 - math.exp(-channels * per_channel / ceiling))
        pipeline = 1 / (1 + (16 << 10) / (buffsize / 8))
        return bw * eff * pipeline * (0.93 if algo == "tree" and nodes <= 1 else 1.0)

    def comm_time(self, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any]) -> float:
        _, lat = PROTO[s["proto"]]
        steps = 2 * (ranks - 1) if s["algo"] == "ring" or op != "all_reduce" else 2 * max(1, math.ceil(math.log2(ranks)))
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            steps = ranks - 1
        inter = 5e-6 * (nodes > 1) * steps / max(1, ranks // max(nodes, 1))
        bw = self.comm_bw(op, ranks, nodes, s["algo"], s["proto"], s["channels"], s["threads"], s["buffsize"])
        return LAUNCH + steps * lat + inter + nbytes * bus_factor(op, ranks) / bw

    def comm_hbm_demand(self, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any]) -> float:
        """HBM bytes/s the collective draws while it runs (L2 spills grow with the buffer)."""
        bw = self.comm_bw(op, ranks, nodes, s["algo"], s["proto"], s["channels"], s["threads"], s["buffsize"])
        spill = 1 + 0.5 * min(1.0, s["channels"] * s["buffsize"] / 8 / self.c.l2)
        return bw * HBM_PER_BYTE.get(op, 2.0) * spill

    # -- computation ---------------------------------------------------------------------------

    def gemm_time(self, g: Gemm, channels: int = 0, hbm_taken: float = 0.0) -> float:
        tm, tn = _tile(g)
        tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch
        sms = self.c.sms - channels
        dt = DTYPES[g.dtype]
        t_math = 2 * tm * tn * g.k / (self.c.tflops / self.c.sms)
        # Tiles in flight share operand rows and columns through L2: HBM sees a fraction.
        tile_bytes = (tm * g.k + g.k * tn + tm * tn) * dt / _reuse(tiles)
        hbm = max(0.1 * self.c.hbm, 0.9 * self.c.hbm - hbm_taken)
        total, left = LAUNCH, tiles
        while left > 0:
            in_wave = min(sms, left)
            total += max(t_math, in_wave * tile_bytes / hbm) + 0.8e-6
            left -= in_wave
        thrash = 1 + 0.04 * min(1.0, channels * 4e6 / self.c.l2) if channels else 1.0
        return total * thrash

    def gemm_hbm_pressure(self, g: Gemm) -> float:
        """Fraction of HBM bandwidth the GEMM uses on average when alone."""
        tm, tn = _tile(g)
        tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch
        moved = tiles * (tm * g.k + g.k * tn + tm * tn) * DTYPES[g.dtype] / _reuse(tiles)
        return min(1.0, moved / self.gemm_time(g) / self.c.hbm)

    def overlap(self, g: Gemm, n: int, op: str, nbytes: int, ranks: int, nodes: int, s: dict[str, Any]) -> dict[str, float]:
        """n GEMMs and one collective started together: when each stream ends."""
        y0 = self.gemm_time(g) * n
        x0 = self.comm_time(op, nbytes, ranks, nodes, s)
        y1 = self.gemm_time(g, s["channels"], self.comm_hbm_demand(op, nbytes, ranks, nodes, s)) * n
        x1 = x0 * (1 + 0.25 * self.gemm_hbm_pressure(g))
        # Both run at contended rates until the first ends; the other finishes alone.
        if x1 <= y1:
            t_comm = x1
            t_comp = x1 + (1 - x1 / y1) * y0
        else:
            t_comp = y1
            t_comm = y1 + (1 - y1 / x1) * x0
        return {"time_us": t_comp * 1e6, "comm_us": t_comm * 1e6, "window_us": max(t_comp, t_comm) * 1e6,
                "compute_alone_us": y0 * 1e6, "comm_alone_us": x0 * 1e6, "n_compute": n}


def _ground_truth_iteration(sim: "SimCluster", workload: Workload, items) -> float:
    """The simulator's own answer for a whole iteration: each group played on two streams with
    the ground-truth times and slowdowns (the schedule is the timeline's; the physics is ours)."""
    from lagom_tune.search.space import settings_from_items
    from lagom_tune.search.timeline import simulate

    settings = settings_from_items(items)
    total = workload.exposed_ms / 1e3
    for grp in workload.groups:
        cfg = {c.name: settings.for_collective(c) for c in grp.comm}
        y = [sim.gemm_time(g) for g in grp.compute]
        x = [sim.comm_time(c.op, c.nbytes, c.ranks, c.nodes, cfg[c.name]) for c in grp.comm]

        def slowdowns(g, c, cfg=cfg):
            s = cfg[c.name]
            contended = sim.gemm_time(g, s["channels"], sim.comm_hbm_demand(c.op, c.nbytes, c.ranks, c.nodes, s))
            return contended / sim.gemm_time(g), 1 + 0.25 * sim.gemm_hbm_pressure(g)

        total += grp.repeat * simulate(grp.compute, y, grp.comm, x, slowdowns).makespan
    return total


def _noise(key: str, repeat: int, seed: int, sigma: float) -> float:
    if sigma <= 0:
        return 1.0
    h = int.from_bytes(hashlib.blake2b(f"{seed}|{key}|{repeat}".encode(), digest_size=8).digest(), "little")
    return float(np.exp(sigma * np.random.default_rng(h).standard_normal()))


class SimBackend(LocalBackend):
    """The simulated cluster behind the Backend protocol; labelled ``simulated`` everywhere."""

    name = "sim"
    simulated = True

    def __init__(self, options: BackendOptions):
        hw = options.hardware or DEFAULT_CLUSTER
        if hw not in CLUSTERS:
            raise UserError(f"unknown --hardware {hw!r}; simulated clusters: {', '.join(CLUSTERS)}")
        ib = int(options.extra.get("ib_gbps", 400))
        if ib not in IB:
            raise UserError(f"--ib-gbps must be one of {', '.join(map(str, IB))}")
        if options.nodes is not None and options.nodes < 1:
            raise UserError("--nodes must be at least 1")
        self.cluster = CLUSTERS[hw]
        self.hardware_said = options.hardware is not None
        self.options = options
        self.ib_gbps = ib
        self.nodes = options.nodes or 1  # sized to the workload by plan_points when --nodes was not given
        self.sim = SimCluster(self.cluster, self.nodes, ib)
        self.knob_space = nccl_knob_space(self.cluster.max_channels, self.cluster.default_channels)

    def fingerprint(self) -> dict[str, Any]:
        c = self.cluster
        return {"backend": "sim", "simulated": True, "cluster": c.name, "device": f"{c.device} (simulated)", "gpu": c.device,
                "sms": c.sms, "hbm_GBps": c.hbm / GB, "nodes": self.nodes, "gpus_per_node": GPUS_PER_NODE,
                "ranks": GPUS_PER_NODE * self.nodes, "ib_gbps": self.ib_gbps if self.nodes > 1 else None,
                **({} if self.hardware_said else {"hardware_note": f"--hardware not given: the default {c.name}"}),
                "seed": self.options.seed, "noise": self.options.noise, "host": platform.node()}

    def plan_points(self, workload: Workload) -> list[Point]:
        self._fit_layout(workload)
        space = self.knob_space
        points: list[Point] = []
        for g in sorted(workload.gemms().values(), key=lambda g: g.flops):
            points.append(Point("gemm", (), gemm=g))
        colls = {(c.op, c.nbytes, c.ranks, c.nodes) for c in workload.collectives()}
        cells = [(a, p, ch, t, b) for a in space["algo"].domain for p in space["proto"].domain
                 for ch in space["channels"].domain for t in space["threads"].domain for b in space["buffsize"].domain]
        for op, nbytes, ranks, nodes in sorted(colls):
            for size in sorted({nbytes, max(1 << 16, nbytes // 8)}):
                for a, p, ch, t, b in cells:
                    if a == "tree" and op != "all_reduce":
                        continue
                    points.append(Point("collective", nccl_config(a, p, ch, t, b, nodes), op=op, nbytes=size, ranks=ranks))
        # Overlapped pairs: every GEMM shape that runs beside a collective, against each
        # collective of the workload, over channels and buffer sizes (Simple, ring, 512 threads).
        beside = {g.shape_key: g for grp in workload.groups if grp.comm for g in grp.compute}
        for g in sorted(beside.values(), key=lambda g: g.flops):
            for op, nbytes, ranks, nodes in sorted(colls):
                for ch in space["channels"].domain:
                    for b in space["buffsize"].domain:
                        points.append(Point("overlap", nccl_config("ring", "simple", ch, 512, b, nodes), gemm=g, op=op, nbytes=nbytes, ranks=ranks))
        return points

    def _fit_layout(self, workload: Workload) -> None:
        """Nodes of 8 GPUs enough for the workload's communicators: inferred without --nodes,
        else checked (a 16-rank workload on one simulated node was recorded as 8 ranks)."""
        colls = workload.collectives()
        needed = max([1] + [max(c.nodes, math.ceil(c.ranks / GPUS_PER_NODE)) for c in colls])
        if self.options.nodes is None:
            if needed != self.nodes:
                self.nodes = needed
                self.sim = SimCluster(self.cluster, needed, self.ib_gbps)
        elif self.options.nodes < needed:
            raise UserError(f"the workload needs {needed} nodes of {GPUS_PER_NODE} GPUs (its largest communicator); "
                            f"--nodes {self.options.nodes} is too few (leave --nodes out to size the cluster to it)")

    def iteration(self, workload: Workload, items) -> float:
        return _ground_truth_iteration(self.sim, workload, items)

    def measure(self, points: list[Point], repeats: int, sink: RowSink) -> None:
        for p in points:
            s = p.settings
            nodes = s.get("nodes", 1)
            rows = []
            for r in range(repeats):
                z = _noise(p.key, r, self.options.seed, self.options.noise)
                if p.kind == "iteration":
                    row = {"time_us": self.iteration(p.workload, p.config) * 1e6 * z}
                elif p.kind == "gemm":
                    row = {"time_us": self.sim.gemm_time(p.gemm) * 1e6 * z}
                elif p.kind == "collective":
                    t = self.sim.comm_time(p.op, p.nbytes, p.ranks, nodes, s)
                    row = {"time_us": t * 1e6 * z, **bandwidth_columns(p.op, p.nbytes, p.ranks, t * z)}
                else:
                    y = self.sim.gemm_time(p.gemm)
                    x = self.sim.comm_time(p.op, p.nbytes, p.ranks, nodes, s)
                    row = self.sim.overlap(p.gemm, max(1, round(x / y)), p.op, p.nbytes, p.ranks, nodes, s)
                    for col in ("time_us", "comm_us", "window_us"):
                        row[col] *= z
                    # The alone times are measurements too (taken just before the pair): own noise.
                    for col in ("compute_alone_us", "comm_alone_us"):
                        row[col] *= _noise(f"{p.key}|{col}", r, self.options.seed, self.options.noise)
                rows.append({**row, "repeat": r, "simulated": True})
            sink(p, rows)

