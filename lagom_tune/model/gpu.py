"""The Lagom cost model for GPUs (paper Eqs. 4-6), fitted instead of only stated.

Computation ``i`` beside collective ``j`` with ``NC`` channels and buffer ``C``::

    g_ij = ceil(mu_i / ((lambda - NC) * TB))                       # waves on the SMs left
    f_ij = theta_i + (lambda - NC) * TB * D_i / (Bbar - V(NC, C))  # one wave
    y_ij = g_ij * f_ij

``lambda`` (SMs) and ``Bbar`` (HBM bandwidth) come from the device; ``mu_i`` (blocks) from the
shape with 128x128 tiles, ``TB = 1`` block per SM; ``theta_i`` and ``D_i`` (effective HBM bytes per
block) are fitted per GEMM, ``V(NC, C)`` (HBM bandwidth communication takes) per channel count
and buffer size, by alternating least squares. Communication ``x = a + bus_bytes / bw`` with
``bw = L * (1 - exp(-NC * beta * (NT/512)^tau / L)) / (1 + c / (C/8))`` per (op, algorithm,
protocol, nodes), fitted with torch on relative error; beside a GEMM it slows by
``1 + kappa * memory_share_i``.

A shape's time alone comes from its own point and from the alone times recorded with each of its
overlapped pairs. A shape never measured is predicted from the others: per wave, math in
proportion to the block's ``k`` and memory in proportion to the bytes a wave reads (A and B
panels) and writes (C tiles), fitted jointly with non-negative coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd
import torch

from lagom_tune import validate as v
from lagom_tune.backends.base import bus_factor
from lagom_tune.errors import UserError
from lagom_tune.workload.spec import DTYPES, Collective, Gemm

TILE = 128
COMM_PARAMS = ("latency_us", "link_GBps", "per_channel_GBps", "threads_exp", "pipeline_bytes")


def blocks(g: Gemm) -> int:
    return math.ceil(g.m / TILE) * math.ceil(g.n / TILE) * g.batch


def block_bytes(g: Gemm) -> float:
    """Operand bytes one block reads: its panels of A and B."""
    return 2 * TILE * g.k * DTYPES[g.dtype]


def tile_bytes(g: Gemm) -> float:
    """Bytes one block writes: its tile of C (what dominates when k is small)."""
    return TILE * TILE * DTYPES[g.dtype]


def comm_group(op: str, algo: str, proto: str, nodes: int) -> str:
    return f"{op}|{algo}|{proto}|{int(nodes)}"


@dataclass(frozen=True)
class LagomGpuModel:
    sms: int
    hbm: float  # bytes/s
    theta: dict[str, float]  # s per wave, by GEMM shape
    dbytes: dict[str, float]  # effective HBM bytes per block, by GEMM shape
    theta_per_kflop: float  # for shapes never measured: theta ~ per-block math ...
    d_per_block_byte: float  # ... and D ~ the block's operand bytes, plus a launch cost
    v_table: dict[tuple[int, int], float]  # (channels, buffsize) -> bytes/s taken from HBM
    comm: dict[str, dict[str, float]]  # comm_group -> COMM_PARAMS
    kappa: float
    simulated: bool = False
    launch_s: float = 0.0
    d_per_tile_byte: float = 0.0  # ... and the tile it writes
    family: str = "lagom-gpu"
    meta: dict = field(default_factory=dict, compare=False)

    # -- computation ---------------------------------------------------------------------------

    def _theta_d(self, g: Gemm) -> tuple[float, float]:
        key = g.shape_key
        if key in self.theta:
            return self.theta[key], self.dbytes[key]
        return (self.theta_per_kflop * 2 * TILE * TILE * g.k / 1e3,
                self.d_per_block_byte * block_bytes(g) + self.d_per_tile_byte * tile_bytes(g))

    def _v(self, channels: int, buffsize: int) -> float:
        if (channels, buffsize) in self.v_table:
            return self.v_table[(channels, buffsize)]
        same = sorted((c, val) for (c, b), val in self.v_table.items() if b == buffsize) or sorted(
            (c, val) for (c, _), val in self.v_table.items())
        if not same:
            return 0.0
        cs, vs = zip(*same)
        return float(np.interp(channels, cs, vs))

    def gemm_time(self, g: Gemm, channels: int = 0, buffsize: int = 0) -> float:
        theta, d = self._theta_d(g)
        free = max(1, self.sms - channels)
        waves = math.ceil(blocks(g) / free)
        v_taken = self._v(channels, buffsize) if channels else 0.0
        launch = 0.0 if g.shape_key in self.theta else self.launch_s
        return launch + waves * (theta + free * d / max(0.05 * self.hbm, self.hbm - v_taken))

    def compute_time(self, gemm: Gemm, settings: Mapping[str, Any]) -> float:
        return self.gemm_time(gemm)

    def compute_slowdown(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        return self.gemm_time(gemm, int(settings["channels"]), int(settings["buffsize"])) / self.gemm_time(gemm)

    def memory_share(self, g: Gemm) -> float:
        theta, d = self._theta_d(g)
        mem = self.sms * d / self.hbm
        return mem / (theta + mem) if theta + mem > 0 else 0.0

    # -- communication -------------------------------------------------------------------------

    def comm_params(self, op: str, algo: str, proto: str, nodes: int) -> dict[str, float]:
        key = comm_group(op, algo, proto, nodes)
        if key not in self.comm:
            raise UserError(f"the model has no fit for {op} with algo={algo}, proto={proto} on {nodes} node(s)")
        return self.comm[key]

    def comm_seconds(self, op: str, nbytes: int, ranks: int, nodes: int, s: Mapping[str, Any]) -> float:
        p = self.comm_params(op, s["algo"], s["proto"], nodes)
        return float(_comm_formula(np, p["latency_us"], p["link_GBps"], p["per_channel_GBps"], p["threads_exp"],
                                   p["pipeline_bytes"], nbytes * bus_factor(op, ranks), s["channels"], s["threads"], s["buffsize"]))

    def comm_time(self, coll: Collective, settings: Mapping[str, Any]) -> float:
        return self.comm_seconds(coll.op, coll.nbytes, coll.ranks, coll.nodes, settings)

    def comm_slowdown(self, coll: Collective, gemm: Gemm, settings: Mapping[str, Any]) -> float:
        return 1 + self.kappa * self.memory_share(gemm)

    # -- artifact ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "simulated": self.simulated,
            "units": {"theta": "seconds per wave", "dbytes": "HBM bytes per block", "v_table": "HBM bytes/s taken by communication",
                      "latency_us": "µs", "link_GBps": "GB/s bus bandwidth ceiling", "per_channel_GBps": "GB/s",
                      "pipeline_bytes": "bytes", "kappa": "collective slowdown per unit of the GEMM's memory share"},
            "device": {"sms": self.sms, "hbm_GBps": self.hbm / 1e9},
            "params": {
                "gemms": {k: {"theta": self.theta[k], "dbytes": self.dbytes[k]} for k in sorted(self.theta)},
                "theta_per_kflop": self.theta_per_kflop,
                "d_per_block_byte": self.d_per_block_byte,
                "d_per_tile_byte": self.d_per_tile_byte,
                "launch_s": self.launch_s,
                "v_table": [{"channels": c, "buffsize": b, "bytes_per_s": val} for (c, b), val in sorted(self.v_table.items())],
                "comm": self.comm,
                "kappa": self.kappa,
            },
        }

    @classmethod
    def from_dict(cls, d: dict, path: str) -> "LagomGpuModel":
        dev = v.mapping(v.field(d, "device", path, dict), f"{path}.device")
        p = v.mapping(v.field(d, "params", path, dict), f"{path}.params")
        gemms = v.mapping(v.field(p, "gemms", f"{path}.params", dict), f"{path}.params.gemms")
        try:
            v_table = {(int(r["channels"]), int(r["buffsize"])): float(r["bytes_per_s"]) for r in v.field(p, "v_table", f"{path}.params", list)}
            comm = {k: {n: float(val[n]) for n in COMM_PARAMS} for k, val in v.field(p, "comm", f"{path}.params", dict).items()}
            return cls(
                sms=v.field(dev, "sms", f"{path}.device", int), hbm=v.field(dev, "hbm_GBps", f"{path}.device", float) * 1e9,
                theta={k: float(x["theta"]) for k, x in gemms.items()}, dbytes={k: float(x["dbytes"]) for k, x in gemms.items()},
                theta_per_kflop=v.field(p, "theta_per_kflop", f"{path}.params", float),
                d_per_block_byte=v.field(p, "d_per_block_byte", f"{path}.params", float),
                launch_s=v.field(p, "launch_s", f"{path}.params", float, 0.0), v_table=v_table, comm=comm,
                d_per_tile_byte=v.field(p, "d_per_tile_byte", f"{path}.params", float, 0.0),
                kappa=v.field(p, "kappa", f"{path}.params", float), simulated=bool(d.get("simulated", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}.params: malformed GPU model parameters ({e})") from None


def _comm_formula(xp, lat_us, link, per_ch, tau, pipe, bus_bytes, channels, threads, buffsize):
    ch_bw = per_ch * 1e9 * (threads / 512.0) ** tau
    bw = link * 1e9 * (1 - xp.exp(-channels * ch_bw / (link * 1e9))) / (1 + pipe / (buffsize / 8.0))
    return lat_us * 1e-6 + bus_bytes / bw


# ---------------------------------------------------------------------------------------------
# Fitting


def fit_comm(coll: pd.DataFrame, steps: int = 400) -> dict[str, dict[str, float]]:
    """Fit each (op, algo, proto, nodes) group's bandwidth curve on relative error with torch."""
    out = {}
    for (op, algo, proto, nodes), rows in coll.groupby(["op", "algo", "proto", "nodes"]):
        bus = torch.tensor([b * bus_factor(op, r) for b, r in zip(rows["nbytes"], rows["ranks"])], dtype=torch.float64)
        ch = torch.tensor(rows["channels"].to_numpy(float), dtype=torch.float64)
        th = torch.tensor(rows["threads"].to_numpy(float), dtype=torch.float64)
        bs = torch.tensor(rows["buffsize"].to_numpy(float), dtype=torch.float64)
        y = torch.tensor(rows["time_us"].to_numpy(float) / 1e6, dtype=torch.float64)
        best_bw = float((bus / y).max()) / 1e9
        # log-parameters keep every quantity positive
        raw = torch.tensor([math.log(5.0), math.log(best_bw * 1.1), math.log(best_bw / 8), math.log(0.3), math.log(16e3)],
                           dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([raw], lr=0.05)
        for _ in range(steps):
            opt.zero_grad()
            lat, link, per_ch, tau, pipe = raw.exp()
            pred = _comm_formula(torch, lat, link, per_ch, tau, pipe, bus, ch, th, bs)
            loss = ((pred - y) / y).pow(2).mean()
            loss.backward()
            opt.step()
        out[comm_group(op, algo, proto, nodes)] = dict(zip(COMM_PARAMS, (float(x) for x in raw.detach().exp())))
    return out


def fit_gpu(pts: pd.DataFrame, device: dict[str, Any], simulated: bool, iterations: int = 8) -> LagomGpuModel:
    """Fit from point medians (one row per measured point)."""
    from lagom_tune.model.fit import gemm_of_row, two_rate_slowdowns
    sms, hbm = int(device["sms"]), float(device["hbm_GBps"]) * 1e9
    gemm = pts[pts["kind"] == "gemm"]
    coll = pts[pts["kind"] == "collective"]
    over = pts[pts["kind"] == "overlap"].copy()
    if gemm.empty or coll.empty:
        raise UserError("the profile has no GEMM or no collective measurements to fit")
    # A shape's time alone: its own point, and the alone times measured beside each of its
    # overlapped pairs (real measurements too, taken just before the pair).
    seen: dict[str, list[float]] = {}
    for _, r in gemm.iterrows():
        seen.setdefault(r["gemm"], []).append(r["time_us"] / 1e6)
    for _, r in over.iterrows():
        seen.setdefault(r["gemm"], []).append(r["compute_alone_us"] / r["n_compute"] / 1e6)
    alone = {k: float(np.median(v)) for k, v in seen.items()}
    shapes = {r["gemm"]: gemm_of_row(r) for _, r in pts[pts["gemm"].notna()].iterrows()}
    slow = over.apply(two_rate_slowdowns, axis=1) if not over.empty else pd.Series(dtype=object)
    over["s_y"] = [s[0] for s in slow] if len(over) else []
    over["s_x"] = [s[1] for s in slow] if len(over) else []
    # Contended per-GEMM observations: (shape, channels, buffsize, seconds)
    obs = [(r["gemm"], int(r["channels"]), int(r["buffsize"]), r["s_y"] * r["compute_alone_us"] / r["n_compute"] / 1e6)
           for _, r in over.iterrows() if r["s_y"] is not None and r["s_y"] > 0 and int(r["channels"]) < sms]

    v_table: dict[tuple[int, int], float] = {}
    theta: dict[str, float] = {}
    dbytes: dict[str, float] = {}
    for _ in range(iterations):
        # (1) per GEMM, theta and D by least squares given V: y/g = theta + D * free / (Bbar - V)
        for key, g in shapes.items():
            if key not in alone:
                continue
            rows = [(sms, 0.0, alone[key])] + [(sms - c, v_table.get((c, b), 0.0), y) for k, c, b, y in obs if k == key]
            a = np.array([[1.0, free / max(0.05 * hbm, hbm - vv)] for free, vv, _ in rows])
            t = np.array([y / math.ceil(blocks(g) / free) for free, _, y in rows])
            w = 1 / t
            coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
            if coef[1] < 0 or coef[0] < 0:  # keep both physical: fall back to one term
                coef = np.array([t[0], 0.0]) if coef[1] < 0 else np.array([0.0, t[0] / a[0, 1]])
            theta[key], dbytes[key] = float(coef[0]), float(coef[1])
        # (2) per (channels, buffsize), V from each observation where memory matters
        sums: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for key, c, b, y in obs:
            if key not in theta or dbytes[key] <= 0:
                continue
            free = sms - c
            per_wave = y / math.ceil(blocks(shapes[key]) / free) - theta[key]
            if per_wave <= 0:
                continue
            mem_share = free * dbytes[key] / hbm / (theta[key] + free * dbytes[key] / hbm)
            v_row = hbm - free * dbytes[key] / per_wave
            sums.setdefault((c, b), []).append((min(max(v_row, 0.0), 0.95 * hbm), mem_share))
        v_table = {k: float(np.average([x for x, _ in vals], weights=[w + 1e-9 for _, w in vals])) for k, vals in sums.items()}
    # Shapes never measured: per wave, math in proportion to the block's k, and memory in
    # proportion to the bytes a wave of blocks reads and writes; fitted jointly over the measured
    # shapes on relative error, with non-negative coefficients.
    from lagom_tune.model.fit import fit_linear

    measured = [k for k in theta if k in alone]
    per_kflop = per_byte = per_tile_byte = launch = 0.0
    if measured:
        def waves(g: Gemm) -> int:
            return math.ceil(blocks(g) / sms)

        feats = np.array([[waves(shapes[k]) * 2 * TILE * TILE * shapes[k].k / 1e3, waves(shapes[k]) * sms * block_bytes(shapes[k]) / hbm,
                           waves(shapes[k]) * sms * tile_bytes(shapes[k]) / hbm] for k in measured])
        lin = fit_linear(feats, ("math", "read", "write"), np.array([alone[k] for k in measured]))
        slopes = dict(lin.coefs)
        launch, per_kflop, per_byte, per_tile_byte = max(lin.intercept_us, 0.0), slopes["math"], slopes["read"], slopes["write"]
    model = LagomGpuModel(sms, hbm, theta, dbytes, per_kflop, per_byte, v_table, fit_comm(coll), 0.0, simulated, launch, per_tile_byte)
    # kappa: collective slowdown per unit of the GEMM's memory share
    xs = [(model.memory_share(shapes[r["gemm"]]), r["s_x"] - 1) for _, r in over.iterrows() if r["s_x"] is not None]
    if xs:
        share = np.array([a for a, _ in xs])
        extra = np.array([b for _, b in xs])
        kappa = float(max(0.0, (share @ extra) / (share @ share))) if (share @ share) > 0 else 0.0
        model = LagomGpuModel(sms, hbm, theta, dbytes, per_kflop, per_byte, v_table, model.comm, kappa, simulated, launch, per_tile_byte)
    return model
