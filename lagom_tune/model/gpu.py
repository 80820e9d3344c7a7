"""The Lagom cost model for GPUs (paper Eqs. 4-6), fitted instead of only stated, and the form the
measurements of a real GPU asked for (DESIGN.md §6 and §10).

Computation ``i`` beside collective ``j`` with ``NC`` channels and buffer ``C``, on a device of
``lambda`` SMs and HBM bandwidth ``Bbar``. Two forms; model.yaml's ``form`` says which was fitted.

``lagom-eq4-6``, the paper's::

    g_ij = ceil(mu_i / (lambda - NC))                                  # mu_i: 128x128 tiles
    y_ij = g_ij * (theta_i + (lambda - NC) * D_i / (Bbar - V(NC, C)))  # V: a fitted table

``lagom-waves-v2``, what one H200 showed (``tests/data/h200-2026-11-29``)::

    g_ij = waves(mu_i, lambda - NC, w)
    y_ij = g_ij * theta_i + mu_i * D_i / (Bbar - V_j),    V_j = v_base + v_per_byte * bw_j(NC, NT, C)

* ``mu_i``, the CTAs the GEMM's kernel runs, is chosen per shape by the fit: a tile count
  (:data:`CTA_TILES`, split-K :data:`SPLITS`) or a persistent grid of ``lambda - s`` CTAs
  (:data:`GRID_SPARE`): cuBLAS's Hopper kernels keep a grid of about one CTA per SM, a few SMs
  idle, so the first channels cost nothing and the next push CTAs into a second wave.
* Math quantises in waves, bytes do not: a short last wave moves only its own CTAs' bytes, so the
  shape's whole traffic ``mu_i * D_i`` shares the bandwidth left (the paper charges every wave as
  a full one). Eq. 5's memory term is this one when all waves are full.
* ``waves`` counts a partial wave of ``r`` CTAs as ``min(1, r / w)`` of a wave: ``w = 1`` is Eq. 4's
  ceil; the H200 measured ``w = 2`` (one CTA pushed out by a channel adds half a wave, two or more
  a whole one: 1.5x at 2 channels, 1.8-2.0x from 4 up to 48 for 40-50 µs GEMMs).
* ``V_j``, HBM bandwidth the running collective takes: a base (any channel running: DRAM row and
  L2 interference) plus HBM bytes per communicated byte times the collective's fitted bandwidth,
  so it follows channels, threads and buffer size through the communication fit.

Communication ``x = a + bus_bytes / bw`` with ``bw = L * (1 - exp(-NC * beta * (NT/512)^tau / L)) /
(1 + c / (C/8))`` per (op, algorithm, protocol, nodes), fitted with torch on relative error. That is
its time in a workload, where the computation beside it has evicted its buffers from L2. Timed
alone, back to back on one buffer (how the profiler measures it), a collective whose footprint
``nbytes + NC * C`` fits in L2 reads from L2: its bandwidth is ``bw * (1 + warm_gain * h)``, ``h =
min(1, l2_bytes / footprint)^2`` (a 25 MB probe copies 2.4x faster alone than beside a GEMM).
Beside a GEMM it slows by ``1 + kappa * memory_share_i`` (eq4-6: the fitted memory part of the
GEMM's time), or ``1 + kappa * u_i + kappa_channel * NC / lambda`` (waves-v2: ``u_i`` is the share of
``Bbar`` the GEMM draws alone, its least traffic over its time, which the shape fixes where the
fitted math/memory split may not; the probe slowed 1.2x beside 1x GEMMs and 2x beside batched
k=128 ones, and more with more channels).

A legacy overlapped row (no ``baseline`` column) whose shape has no GEMM point has no usable time
alone: the fit starts that shape from its fastest overlapped GEMM, then from its own estimate.
Overlapped points are weighted by how long the two streams ran together, since a slowdown solved
from a short overlap is ill-conditioned; outliers count linearly (Huber), not squared.

A shape's time alone comes from its own point and from the alone times recorded with its
overlapped pairs. A shape never measured is predicted from the others: per wave, math in
proportion to the block's ``k``; memory in proportion to the bytes its CTAs read (A and B panels)
and write (C tiles), fitted jointly with non-negative coefficients.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

import numpy as np
import pandas as pd
import torch

from lagom_tune import validate as v
from lagom_tune.backends.base import bus_factor
from lagom_tune.errors import UserError
from lagom_tune.workload.spec import DTYPES, Collective, Gemm

TILE = 128  # the paper's tile edge: Eq. 4's mu_i, and the estimate for shapes never measured
FORM_EQ46 = "lagom-eq4-6"
FORM_WAVES = "lagom-waves-v2"
FORMS = (FORM_EQ46, FORM_WAVES)

CTA_TILES = ((128, 128), (128, 256), (256, 128))  # tile shapes cuBLAS picks for bf16/fp16 GEMMs
SPLITS = (1, 2)  # split-K factors: a short, deep GEMM runs twice the CTAs
GRID_SPARE = range(0, 9)  # a persistent kernel's grid leaves 0..8 SMs idle
WAVE_WIDTHS = (1.0, 2.0, 4.0)  # candidates for w; 1 is Eq. 4's ceil
MIN_FREE_HBM = 0.05  # the bandwidth left to a GEMM never falls below 5% of Bbar
MAX_V_PER_BYTE = 6.0  # HBM bytes per communicated byte, at most (a copy reads and writes 2, an all-reduce about 3)
TIE = 1e-6  # relative difference in loss below which two candidate CTA counts fit equally well
HUBER_DELTA = 0.1  # relative error beyond which a point counts linearly, not squared (a point timed while the GPU ran slow)
L2_SHARPNESS = 2.0  # h = min(1, l2 / footprint)^2: streaming past the L2 size loses hits quickly

COMM_PARAMS = ("latency_us", "link_GBps", "per_channel_GBps", "threads_exp", "pipeline_bytes", "warm_gain", "l2_bytes")


def blocks(g: Gemm) -> int:
    """Eq. 4's ``mu_i``: 128x128 tiles (CTAs of a one-tile-per-CTA kernel)."""
    return math.ceil(g.m / TILE) * math.ceil(g.n / TILE) * g.batch


def block_bytes(g: Gemm) -> float:
    """Operand bytes one block reads: its panels of A and B."""
    return 2 * TILE * g.k * DTYPES[g.dtype]


def tile_bytes(g: Gemm) -> float:
    """Bytes one block writes: its tile of C (what dominates when k is small)."""
    return TILE * TILE * DTYPES[g.dtype]


def min_traffic(g: Gemm) -> float:
    """Bytes a GEMM moves at least: A and B read once, C written once."""
    return (g.m * g.k + g.k * g.n + g.m * g.n) * g.batch * DTYPES[g.dtype]


def cta_candidates(g: Gemm, sms: int) -> list[int]:
    """The CTA counts ``mu_i`` the fit chooses among for ``g`` (see the module docstring)."""
    tiles = {math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch * s for tm, tn in CTA_TILES for s in SPLITS}
    return sorted(tiles | {sms - s for s in GRID_SPARE})


def waves(ctas, free, width: float):
    """Waves of ``ctas`` CTAs on ``free`` SMs: the full ones, plus a partial wave of ``r`` CTAs
    counted as ``min(1, r / width)`` of one (``width <= 1``: Eq. 4's ceil).

    Args:
        ctas: CTAs the kernel runs (a number or an array).
        free: SMs it can use (a number or an array).
        width: CTAs at which a partial wave costs a full one.

    Returns:
        The number of waves (fractional when ``width > 1``), a float or an array.
    """
    full = np.floor(np.asarray(ctas, dtype=float) / free)
    rest = ctas - full * free
    out = full + np.where(rest > 1e-9, np.minimum(1.0, rest / max(width, 1.0)), 0.0)
    return float(out) if np.ndim(out) == 0 else out


def comm_group(op: str, algo: str, proto: str, nodes: int) -> str:
    """The key of a communication group: its curve is fitted per (op, algorithm, protocol, nodes)."""
    return f"{op}|{algo}|{proto}|{int(nodes)}"


def comm_group_of_row(row: pd.Series) -> str:
    """The communication group a measurement row belongs to."""
    return comm_group(str(row["op"]), str(row["algo"]), str(row["proto"]), int(row["nodes"]) if not pd.isna(row["nodes"]) else 1)


# ---------------------------------------------------------------------------------------------
# Fitted terms


@dataclass(frozen=True)
class GemmFit:
    """A measured GEMM shape's terms: seconds of math per wave, effective HBM bytes per CTA, CTAs."""

    theta: float
    dbytes: float
    ctas: int


@dataclass(frozen=True)
class ShapeRegression:
    """Shapes never measured: ``theta`` from the 128x128 tile's math (per kFLOP), ``D`` from the
    bytes a tile reads (A and B panels) and writes (its C tile), plus a launch cost."""

    theta_per_kflop: float = 0.0
    d_per_block_byte: float = 0.0
    d_per_tile_byte: float = 0.0
    launch_s: float = 0.0

    def estimate(self, g: Gemm) -> GemmFit:
        """The terms of a shape never measured, with Eq. 4's 128x128 tiles as its CTAs."""
        return GemmFit(self.theta_per_kflop * 2 * TILE * TILE * g.k / 1e3,
                       self.d_per_block_byte * block_bytes(g) + self.d_per_tile_byte * tile_bytes(g), blocks(g))


@dataclass(frozen=True)
class CommFit:
    """One (op, algorithm, protocol, nodes) group's communication curve (see the module docstring)."""

    latency_us: float
    link_GBps: float
    per_channel_GBps: float
    threads_exp: float
    pipeline_bytes: float
    warm_gain: float = 0.0
    l2_bytes: float = 0.0

    def bandwidth(self, channels: float, threads: float, buffsize: float) -> float:
        """Bus bytes/s with cold buffers (in a workload)."""
        return float(_bandwidth(np, self.link_GBps, self.per_channel_GBps, self.threads_exp, self.pipeline_bytes,
                                channels, threads, buffsize))

    def seconds(self, bus_bytes: float, nbytes: float, channels: float, threads: float, buffsize: float,
                repeated: bool = False) -> float:
        """Seconds to move ``bus_bytes``; ``repeated``: timed back to back on one buffer (L2-warm)."""
        warm = self.warm_gain * _l2_hits(np, self.l2_bytes, nbytes, channels, buffsize) if repeated else 0.0
        return self.latency_us * 1e-6 + bus_bytes / (self.bandwidth(channels, threads, buffsize) * (1 + warm))

    def to_dict(self) -> dict[str, float]:
        return {n: float(getattr(self, n)) for n in COMM_PARAMS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CommFit":
        """Reads files written before the L2 terms existed (no ``warm_gain``: no warm speed-up)."""
        return cls(**{n: float(d[n]) for n in COMM_PARAMS[:5]}, **{n: float(d.get(n, 0.0)) for n in COMM_PARAMS[5:]})


@dataclass(frozen=True)
class Contention:
    """How a running collective slows a GEMM and a GEMM slows the collective.

    ``lagom-eq4-6`` uses ``v_table`` ((channels, buffsize) -> HBM bytes/s, interpolated in channels)
    and ``kappa``; ``lagom-waves-v2`` uses ``wave_width``, ``v_base``, ``v_per_byte``, ``kappa`` and
    ``kappa_channel``.
    """

    form: str = FORM_WAVES
    wave_width: float = 1.0
    v_base: float = 0.0  # bytes/s any running collective takes from HBM
    v_per_byte: float = 0.0  # HBM bytes per bus byte it moves
    v_table: Mapping[tuple[int, int], float] = field(default_factory=dict)
    kappa: float = 0.0  # collective slowdown per unit of the GEMM's memory share
    kappa_channel: float = 0.0  # ... and per channel, as a fraction of the SMs


# ---------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class LagomGpuModel:
    """The fitted GPU cost model (the ``CostModel`` protocol), in either form.

    Attributes:
        sms: the device's SMs (``lambda``).
        hbm: its HBM bandwidth in bytes/s (``Bbar``).
        gemms: each measured GEMM shape's terms.
        new_shapes: the estimate for shapes never measured.
        comm: each communication group's curve.
        contention: the slowdown terms, and the form they belong to.
        simulated: whether it was fitted on simulated measurements.
    """

    sms: int
    hbm: float  # bytes/s
    gemms: dict[str, GemmFit]  # by GEMM shape
    new_shapes: ShapeRegression
    comm: dict[str, CommFit]  # by comm_group
    contention: Contention
    simulated: bool = False
    family: str = "lagom-gpu"
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def form(self) -> str:
        return self.contention.form

    # -- computation ---------------------------------------------------------------------------

    def gemm_fit(self, g: Gemm) -> GemmFit:
        """The shape's fitted terms, or the estimate for a shape never measured."""
        return self.gemms.get(g.shape_key) or self.new_shapes.estimate(g)

    def hbm_taken(self, coll: Collective | None, settings: Mapping[str, Any]) -> float:
        """``V``: HBM bytes/s the collective takes at ``settings`` (0 with no channels)."""
        channels = int(settings.get("channels", 0)) if coll is not None else 0
        if not channels:
            return 0.0
        c = self.contention
        if c.form == FORM_EQ46:
            return self._v_table(channels, int(settings["buffsize"]))
        fit = self.comm_params(coll.op, settings["algo"], settings["proto"], coll.nodes)
        return c.v_base + c.v_per_byte * fit.bandwidth(channels, settings["threads"], settings["buffsize"])

    def _v_table(self, channels: int, buffsize: int) -> float:
        table = self.contention.v_table
        if (channels, buffsize) in table:
            return table[(channels, buffsize)]
        same = sorted((c, val) for (c, b), val in table.items() if b == buffsize) or sorted((c, val) for (c, _), val in table.items())
        if not same:
            return 0.0
        cs, vs = zip(*same)
        return float(np.interp(channels, cs, vs))

    def gemm_time(self, g: Gemm, channels: int = 0, hbm_taken: float = 0.0) -> float:
        """Seconds for ``g`` with ``channels`` SMs held by communication taking ``hbm_taken`` bytes/s."""
        fit = self.gemm_fit(g)
        launch = 0.0 if g.shape_key in self.gemms else self.new_shapes.launch_s
        free = max(1, self.sms - channels)
        bandwidth = max(MIN_FREE_HBM * self.hbm, self.hbm - hbm_taken)
        if self.form == FORM_EQ46:
            return launch + math.ceil(fit.ctas / free) * (fit.theta + free * fit.dbytes / bandwidth)
        return launch + waves(fit.ctas, free, self.contention.wave_width) * fit.theta + fit.ctas * fit.dbytes / bandwidth

    def compute_time(self, gemm: Gemm, settings: Mapping[str, Any]) -> float:
        return self.gemm_time(gemm)

    def compute_slowdown(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        channels = int(settings["channels"])
        return self.gemm_time(gemm, channels, self.hbm_taken(coll, settings)) / self.gemm_time(gemm)

    def hbm_demand(self, g: Gemm) -> float:
        """The fraction of HBM bandwidth ``g`` uses alone, at least: the bytes it must move (A and B
        read once, C written once) over its time alone. From the shape, not from the fitted split
        of math and memory, which the compute measurements may not pin down."""
        return min(1.0, min_traffic(g) / self.gemm_time(g) / self.hbm)

    def memory_share(self, g: Gemm) -> float:
        """The fraction of ``g``'s time alone that is memory traffic (the fitted split)."""
        fit = self.gemm_fit(g)
        if self.form == FORM_EQ46:
            math_s, mem_s = fit.theta, self.sms * fit.dbytes / self.hbm
        else:
            math_s, mem_s = waves(fit.ctas, self.sms, self.contention.wave_width) * fit.theta, fit.ctas * fit.dbytes / self.hbm
        return mem_s / (math_s + mem_s) if math_s + mem_s > 0 else 0.0

    # -- communication -------------------------------------------------------------------------

    def comm_params(self, op: str, algo: str, proto: str, nodes: int) -> CommFit:
        key = comm_group(op, algo, proto, nodes)
        if key not in self.comm:
            raise UserError(f"the model has no fit for {op} with algo={algo}, proto={proto} on {nodes} node(s)")
        return self.comm[key]

    def comm_seconds(self, op: str, nbytes: int, ranks: int, nodes: int, s: Mapping[str, Any], repeated: bool = False) -> float:
        """Seconds for one collective; ``repeated``: as timed alone, back to back on one buffer."""
        fit = self.comm_params(op, s["algo"], s["proto"], nodes)
        return fit.seconds(nbytes * bus_factor(op, ranks), nbytes, s["channels"], s["threads"], s["buffsize"], repeated)

    def comm_time(self, coll: Collective, settings: Mapping[str, Any]) -> float:
        """The collective in a workload (cold buffers)."""
        return self.comm_seconds(coll.op, coll.nbytes, coll.ranks, coll.nodes, settings)

    def repeated_comm_time(self, coll: Collective, settings: Mapping[str, Any]) -> float:
        """The collective as a benchmark times it alone: launched back to back on one buffer."""
        return self.comm_seconds(coll.op, coll.nbytes, coll.ranks, coll.nodes, settings, repeated=True)

    def comm_slowdown(self, coll: Collective, gemm: Gemm, settings: Mapping[str, Any]) -> float:
        c = self.contention
        if c.form == FORM_EQ46:
            return 1 + c.kappa * self.memory_share(gemm)
        return 1 + c.kappa * self.hbm_demand(gemm) + c.kappa_channel * int(settings.get("channels", 0)) / self.sms

    # -- artifact ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        c, r = self.contention, self.new_shapes
        params: dict[str, Any] = {
            "gemms": {k: {"theta": f.theta, "dbytes": f.dbytes, "ctas": f.ctas} for k, f in sorted(self.gemms.items())},
            "theta_per_kflop": r.theta_per_kflop,
            "d_per_block_byte": r.d_per_block_byte,
            "d_per_tile_byte": r.d_per_tile_byte,
            "launch_s": r.launch_s,
            "comm": {k: f.to_dict() for k, f in sorted(self.comm.items())},
            "kappa": c.kappa,
        }
        if c.form == FORM_EQ46:
            params["v_table"] = [{"channels": ch, "buffsize": b, "bytes_per_s": val} for (ch, b), val in sorted(c.v_table.items())]
        else:
            params.update(wave_width=c.wave_width, v_base=c.v_base, v_per_byte=c.v_per_byte, kappa_channel=c.kappa_channel)
        return {
            "family": self.family,
            "form": c.form,
            "simulated": self.simulated,
            "units": {"theta": "seconds of math per wave", "dbytes": "HBM bytes per CTA", "ctas": "CTAs the GEMM's kernel runs (mu_i)",
                      "v_table": "HBM bytes/s taken by communication", "v_base": "HBM bytes/s taken by any running collective",
                      "v_per_byte": "HBM bytes per bus byte communicated", "wave_width": "CTAs at which a partial wave costs a full one",
                      "latency_us": "µs", "link_GBps": "GB/s bus bandwidth ceiling", "per_channel_GBps": "GB/s",
                      "pipeline_bytes": "bytes", "warm_gain": "bandwidth gain of a repeated launch served from L2",
                      "l2_bytes": "bytes of L2 a repeated launch can reuse",
                      "kappa": "collective slowdown per unit of the GEMM's memory share (eq4-6) or HBM demand alone (waves-v2)",
                      "kappa_channel": "collective slowdown per channel, as a fraction of the SMs"},
            "device": {"sms": self.sms, "hbm_GBps": self.hbm / 1e9},
            "params": params,
        }

    @classmethod
    def from_dict(cls, d: dict, path: str) -> "LagomGpuModel":
        """Reads both forms; a file without ``form`` (written before waves-v2) is ``lagom-eq4-6``."""
        dev = v.mapping(v.field(d, "device", path, dict), f"{path}.device")
        pp = f"{path}.params"
        p = v.mapping(v.field(d, "params", path, dict), pp)
        gemms = v.mapping(v.field(p, "gemms", pp, dict), f"{pp}.gemms")
        form = v.one_of(v.field(d, "form", path, str, FORM_EQ46), FORMS, f"{path}.form")
        try:
            if form == FORM_EQ46:
                table = {(int(r["channels"]), int(r["buffsize"])): float(r["bytes_per_s"]) for r in v.field(p, "v_table", pp, list)}
                contention = Contention(FORM_EQ46, v_table=table, kappa=v.field(p, "kappa", pp, float))
            else:
                contention = Contention(FORM_WAVES, wave_width=v.field(p, "wave_width", pp, float, minimum=1.0),
                                        v_base=v.field(p, "v_base", pp, float), v_per_byte=v.field(p, "v_per_byte", pp, float),
                                        kappa=v.field(p, "kappa", pp, float), kappa_channel=v.field(p, "kappa_channel", pp, float))
            return cls(
                sms=v.field(dev, "sms", f"{path}.device", int), hbm=v.field(dev, "hbm_GBps", f"{path}.device", float) * 1e9,
                gemms={k: GemmFit(float(x["theta"]), float(x["dbytes"]), int(x.get("ctas", 0)) or blocks(_gemm_of_key(k)))
                       for k, x in gemms.items()},
                new_shapes=ShapeRegression(v.field(p, "theta_per_kflop", pp, float), v.field(p, "d_per_block_byte", pp, float),
                                           v.field(p, "d_per_tile_byte", pp, float, 0.0), v.field(p, "launch_s", pp, float, 0.0)),
                comm={k: CommFit.from_dict(val) for k, val in v.field(p, "comm", pp, dict).items()},
                contention=contention, simulated=bool(d.get("simulated", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{pp}: malformed GPU model parameters ({e})") from None


def _gemm_of_key(key: str) -> Gemm:
    """The GEMM a shape key (``BxMxNxK:dtype``) names."""
    dims, dtype = key.split(":")
    b, m, n, k = (int(x) for x in dims.split("x"))
    return Gemm("g", m, n, k, dtype, b)


# ---------------------------------------------------------------------------------------------
# Communication fit


def _bandwidth(xp, link, per_ch, tau, pipe, channels, threads, buffsize):
    ch_bw = per_ch * 1e9 * (threads / 512.0) ** tau
    return link * 1e9 * (1 - xp.exp(-channels * ch_bw / (link * 1e9))) / (1 + pipe / (buffsize / 8.0))


def _l2_hits(xp, l2_bytes, nbytes, channels, buffsize):
    """The share of a repeated launch's reads served from L2: its footprint is the user buffer
    plus a buffer per channel."""
    ratio = l2_bytes / (nbytes + channels * buffsize)
    return (xp.clip(ratio, 0.0, 1.0) if xp is np else ratio.clamp(max=1.0)) ** L2_SHARPNESS


def alone_comm_rows(pts: pd.DataFrame) -> pd.DataFrame:
    """Every alone-timed collective in the point medians: the collective points, and the alone time
    measured with each overlapped pair. Columns: group, bus_bytes, nbytes, channels, threads,
    buffsize, seconds."""
    coll = pts[pts["kind"] == "collective"].assign(seconds=lambda d: d["time_us"] / 1e6)
    over = pts[(pts["kind"] == "overlap") & pts["comm_alone_us"].notna()].assign(seconds=lambda d: d["comm_alone_us"] / 1e6) \
        if "comm_alone_us" in pts else pts.iloc[:0].assign(seconds=0.0)
    rows = pd.concat([coll, over])
    rows = rows[rows["seconds"] > 0]
    ranks = rows["ranks"].fillna(1) if "ranks" in rows else pd.Series(1, index=rows.index)
    return pd.DataFrame({
        "group": [comm_group_of_row(r) for _, r in rows.iterrows()],
        "bus_bytes": [b * bus_factor(op, int(n)) for b, op, n in zip(rows["nbytes"], rows["op"], ranks)],
        "nbytes": rows["nbytes"].to_numpy(float), "channels": rows["channels"].to_numpy(float),
        "threads": rows["threads"].to_numpy(float), "buffsize": rows["buffsize"].to_numpy(float),
        "seconds": rows["seconds"].to_numpy(float)})


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a while: the communication fit's tensors are tiny, and intra-op
    threads only add synchronisation (seconds per fit when other processes share the CPUs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fit_comm(rows: pd.DataFrame, steps: int = 1000) -> dict[str, CommFit]:
    """Fit each group's curve on relative error with torch, every row timed alone and repeated.

    All groups are optimised in one Adam loop: each group's loss is its own mean, so its
    parameters move exactly as in a fit of its own (Adam is elementwise), at a fraction of the time.

    Args:
        rows: :func:`alone_comm_rows`'s frame.
        steps: Adam steps.

    Returns:
        comm_group -> its fit.
    """
    if rows.empty:
        return {}
    keys = sorted(rows["group"].unique())
    group = torch.tensor(rows["group"].map({k: i for i, k in enumerate(keys)}).to_numpy(), dtype=torch.long)
    t = {c: torch.tensor(rows[c].to_numpy(float), dtype=torch.float64)
         for c in ("bus_bytes", "nbytes", "channels", "threads", "buffsize", "seconds")}
    best_bw = rows.assign(bw=rows["bus_bytes"] / rows["seconds"] / 1e9).groupby("group")["bw"].max().reindex(keys).to_numpy()
    # log-parameters keep every quantity positive
    start = [[5.0, b * 1.1, b / 8, 0.3, 16e3, 0.3, 32e6] for b in best_bw]  # in COMM_PARAMS order
    raw = torch.tensor(start, dtype=torch.float64).log().requires_grad_()
    share = 1.0 / torch.bincount(group, minlength=len(keys)).to(torch.float64)[group]  # each group's loss is its mean
    opt = torch.optim.Adam([raw], lr=0.05)
    with _one_torch_thread():
        for _ in range(steps):
            opt.zero_grad()
            lat, link, per_ch, tau, pipe, gain, l2 = raw.exp()[group].T
            bw = _bandwidth(torch, link, per_ch, tau, pipe, t["channels"], t["threads"], t["buffsize"])
            pred = lat * 1e-6 + t["bus_bytes"] / (bw * (1 + gain * _l2_hits(torch, l2, t["nbytes"], t["channels"], t["buffsize"])))
            loss = (((pred - t["seconds"]) / t["seconds"]).pow(2) * share).sum()
            loss.backward()
            opt.step()
    return {k: CommFit(*(float(x) for x in p)) for k, p in zip(keys, raw.detach().exp())}


# ---------------------------------------------------------------------------------------------
# Computation fit


@dataclass(frozen=True)
class _Observations:
    """Contended per-GEMM times, one per usable overlapped point (arrays aligned)."""

    shape: np.ndarray  # shape keys
    channels: np.ndarray
    buffsize: np.ndarray
    comm_bw: np.ndarray  # the collective's cold bus bandwidth at the point's settings, bytes/s
    seconds: np.ndarray  # one GEMM's time beside it
    weight: np.ndarray  # the share of the GEMM stream's time the collective ran beside it


def fit_gpu(pts: pd.DataFrame, device: dict[str, Any], simulated: bool, form: str = FORM_WAVES, iterations: int = 6) -> LagomGpuModel:
    """Fit from point medians (one row per measured point).

    Args:
        pts: point medians (``fit.point_medians``); legacy baselines are made consistent here.
        device: ``sms`` and ``hbm_GBps``.
        simulated: whether the measurements came from the simulator.
        form: ``lagom-waves-v2`` (default) or the paper's ``lagom-eq4-6``.
        iterations: alternations between the per-shape terms and the shared contention terms.

    Returns:
        The fitted model.
    """
    from lagom_tune.model.fit import consistent_baselines, contention_points, gemm_of_row

    if form not in FORMS:
        raise ValueError(f"unknown GPU model form {form!r}")
    sms, hbm = int(device["sms"]), float(device["hbm_GBps"]) * 1e9
    pts = consistent_baselines(pts)
    gemm = pts[pts["kind"] == "gemm"]
    if gemm.empty or pts[pts["kind"] == "collective"].empty:
        raise UserError("the profile has no GEMM or no collective measurements to fit")
    comm = fit_comm(alone_comm_rows(pts))
    over = contention_points(pts)
    # A shape's time alone: its own point, and the alone times measured beside each of its
    # overlapped pairs (real measurements too, taken just before the pair).
    seen: dict[str, list[float]] = {}
    for _, r in gemm.iterrows():
        seen.setdefault(r["gemm"], []).append(r["time_us"] / 1e6)
    for _, r in over[over["compute_alone_us"].notna()].iterrows():
        seen.setdefault(r["gemm"], []).append(r["compute_alone_us"] / r["n_compute"] / 1e6)
    alone = {k: float(np.median(val)) for k, val in seen.items()}
    shapes = {r["gemm"]: gemm_of_row(r) for _, r in pts[pts["gemm"].notna()].iterrows()}
    regression = _fit_new_shapes(alone, shapes, sms, hbm, form)

    # A shape overlapped without a consistent baseline (legacy rows, no GEMM point) starts from
    # its fastest overlapped GEMM and then from the fit's own time alone, a few rounds.
    unknown = {k: float((rows["time_us"] / rows["n_compute"]).min()) / 1e6
               for k, rows in over[over["compute_alone_us"].isna()].groupby("gemm") if k not in alone}
    for _ in range(3 if unknown else 1):
        filled = _fill_baselines(over, {**unknown, **alone})
        obs = _observations(filled, comm, sms)
        if form == FORM_EQ46:
            gemms, contention = _fit_eq46(obs, alone, shapes, sms, hbm, iterations)
        else:
            gemms, contention = _fit_waves(obs, alone, shapes, regression, sms, hbm, iterations)
        model = LagomGpuModel(sms, hbm, gemms, regression, comm, contention, simulated)
        unknown = {k: model.gemm_time(shapes[k]) for k in unknown if k in gemms}
    return replace(model, contention=_fit_comm_slowdown(model, filled))


def _fill_baselines(over: pd.DataFrame, alone: dict[str, float]) -> pd.DataFrame:
    """Overlapped rows with every missing ``compute_alone_us`` set from ``alone`` (seconds per GEMM)."""
    missing = over["compute_alone_us"].isna()
    if not missing.any():
        return over
    out = over.copy()
    out.loc[missing, "compute_alone_us"] = out.loc[missing, "n_compute"] * out.loc[missing, "gemm"].map(alone) * 1e6
    return out


def _observations(over: pd.DataFrame, comm: dict[str, CommFit], sms: int) -> _Observations:
    """One GEMM's contended time at each overlapped point whose two-rate solution exists, weighted
    by the share of the GEMM stream's time the collective ran beside it: a collective that ended
    early moves the measured time little, and the slowdown solved from it is ill-conditioned."""
    from lagom_tune.model.fit import two_rate_slowdowns

    s_y = pd.Series([two_rate_slowdowns(r)[0] for _, r in over.iterrows()], index=over.index, dtype=float)
    rows = over[(s_y > 0) & (over["channels"] < sms)]
    s_y = s_y.loc[rows.index]
    share = (rows["comm_us"] / rows["time_us"]).clip(upper=1.0)
    return _Observations(
        shape=rows["gemm"].to_numpy(object), channels=rows["channels"].to_numpy(float), buffsize=rows["buffsize"].to_numpy(float),
        comm_bw=np.array([comm[comm_group_of_row(r)].bandwidth(r["channels"], r["threads"], r["buffsize"]) for _, r in rows.iterrows()]),
        seconds=(s_y * rows["compute_alone_us"] / rows["n_compute"] / 1e6).to_numpy(float), weight=share.to_numpy(float))


def _fit_new_shapes(alone: dict[str, float], shapes: dict[str, Gemm], sms: int, hbm: float, form: str) -> ShapeRegression:
    """Shapes never measured: per wave, math in proportion to the block's k, and memory in proportion
    to the bytes its blocks read and write; fitted jointly over the measured shapes on relative
    error, with non-negative coefficients."""
    from lagom_tune.model.fit import fit_linear

    measured = [k for k in alone if k in shapes]
    if not measured:
        return ShapeRegression()

    def features(g: Gemm) -> list[float]:
        n_waves = math.ceil(blocks(g) / sms)
        in_flight = n_waves * sms if form == FORM_EQ46 else blocks(g)  # Eq. 5 charges full waves
        return [n_waves * 2 * TILE * TILE * g.k / 1e3, in_flight * block_bytes(g) / hbm, in_flight * tile_bytes(g) / hbm]

    lin = fit_linear(np.array([features(shapes[k]) for k in measured]), ("math", "read", "write"), np.array([alone[k] for k in measured]))
    slopes = dict(lin.coefs)
    return ShapeRegression(slopes["math"], slopes["read"], slopes["write"], max(lin.intercept_us, 0.0))


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """Weighted least squares with non-negative coefficients (two or fewer columns: try the
    unconstrained solution, then each column alone). Returns the coefficients and the weighted SSE."""
    aw, yw = a * w[:, None], y * w
    tries = [np.linalg.lstsq(aw, yw, rcond=None)[0]]
    for j in range(a.shape[1]):
        col = aw[:, j]
        c = np.zeros(a.shape[1])
        c[j] = max(0.0, (col @ yw) / (col @ col)) if col @ col > 0 else 0.0
        tries.append(c)
    best = min((c for c in tries if (c >= 0).all()), key=lambda c: float(((aw @ c - yw) ** 2).sum()))
    return best, float(((aw @ best - yw) ** 2).sum())


def _huber(r: np.ndarray) -> np.ndarray:
    """Huber's loss of relative errors ``r``: squared up to :data:`HUBER_DELTA`, linear beyond."""
    a = np.abs(r)
    return np.where(a <= HUBER_DELTA, 0.5 * a ** 2, HUBER_DELTA * (a - 0.5 * HUBER_DELTA))


def _two_term_fits(math: np.ndarray, memory: np.ndarray, y: np.ndarray, weight: np.ndarray,
                   rounds: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``y ~ theta * math + D * memory`` with ``theta, D >= 0``, on relative error under Huber's loss
    (iteratively reweighted: one outlying point, a GPU that ran slow while it was timed, must not
    bend a shape's terms); one fit per candidate row of ``math``/``memory`` at once.

    Args:
        math: waves per point, one row per candidate (K x n).
        memory: bytes-to-seconds factor per point (K x n).
        y: measured seconds (n).
        weight: each point's importance (n).
        rounds: reweighting rounds.

    Returns:
        ``theta`` (K), ``D`` (K) and each candidate's weighted Huber loss (K).
    """
    w2 = np.broadcast_to((weight / y) ** 2, math.shape)
    for _ in range(rounds):
        s00, s01, s11 = (w2 * math * math).sum(1), (w2 * math * memory).sum(1), (w2 * memory * memory).sum(1)
        t0, t1 = (w2 * math * y).sum(1), (w2 * memory * y).sum(1)
        det = s00 * s11 - s01 ** 2
        with np.errstate(divide="ignore", invalid="ignore"):
            both = np.stack([(s11 * t0 - s01 * t1) / det, (s00 * t1 - s01 * t0) / det], axis=1)
            only_math = np.stack([np.maximum(t0 / s00, 0.0), np.zeros_like(t0)], axis=1)
            only_memory = np.stack([np.zeros_like(t1), np.maximum(t1 / s11, 0.0)], axis=1)
        options = np.stack([both, only_math, only_memory])  # 3 x K x 2
        feasible = (options >= 0).all(axis=2) & np.isfinite(options).all(axis=2)
        options = np.where(np.isfinite(options), options, 0.0)  # a singular system: that option is infeasible
        pred = options[..., 0:1] * math + options[..., 1:2] * memory
        sse = np.where(feasible, (w2 * (pred - y) ** 2).sum(axis=2), np.inf)
        coef = options[sse.argmin(axis=0), np.arange(math.shape[0])]
        r = (coef[:, 0:1] * math + coef[:, 1:2] * memory - y) / y
        w2 = (weight / y) ** 2 * np.minimum(1.0, HUBER_DELTA / np.maximum(np.abs(r), 1e-12))
    return coef[:, 0], coef[:, 1], (weight * _huber(r)).sum(axis=1)


def _fit_waves(obs: _Observations, alone: dict[str, float], shapes: dict[str, Gemm], regression: ShapeRegression,
               sms: int, hbm: float, iterations: int) -> tuple[dict[str, GemmFit], Contention]:
    """waves-v2: per shape ``mu_i`` (among :func:`cta_candidates`), ``theta_i`` and ``D_i`` by linear
    least squares given ``V``; ``V``'s two terms by a grid over all shapes given theirs; the wave
    width that fits best."""
    def shapes_step(contention: Contention) -> tuple[dict[str, GemmFit], float]:
        taken = np.minimum(contention.v_base + contention.v_per_byte * obs.comm_bw, (1 - MIN_FREE_HBM) * hbm)
        gemms, loss = {}, 0.0
        for key, g in shapes.items():
            sel = obs.shape == key
            if key in alone or sel.any():
                gemms[key], err = _fit_shape_waves(g, alone.get(key), obs.channels[sel], taken[sel], obs.seconds[sel],
                                                   obs.weight[sel], sms, hbm, contention.wave_width, regression)
                loss += err
        return gemms, loss

    best: tuple[float, dict[str, GemmFit], Contention] | None = None
    for width in WAVE_WIDTHS:
        contention = Contention(FORM_WAVES, wave_width=width)
        gemms, loss = shapes_step(contention)
        for _ in range(iterations):
            contention = _fit_v(obs, gemms, contention, sms, hbm)
            gemms, loss = shapes_step(contention)
        if best is None or loss < best[0]:
            best = (loss, gemms, contention)
    _, gemms, contention = best
    return gemms, contention


def _fit_shape_waves(g: Gemm, alone: float | None, channels: np.ndarray, taken: np.ndarray, seconds: np.ndarray,
                     weights: np.ndarray, sms: int, hbm: float, width: float, regression: ShapeRegression) -> tuple[GemmFit, float]:
    """One shape's ``(mu, theta, D)``: the CTA count whose least-squares fit has the smallest
    relative error. Without overlapped points ``mu`` is unidentifiable: Eq. 4's tiles, and the alone
    time split between math and memory as the regression over all shapes splits it. Without a
    consistent time alone (``None``) the overlapped points alone decide."""
    if not len(seconds):
        est = regression.estimate(g)
        math_s, mem_s = waves(est.ctas, sms, width) * est.theta, est.ctas * est.dbytes / hbm
        if math_s + mem_s <= 0:
            return GemmFit(alone / waves(est.ctas, sms, width), 0.0, est.ctas), 0.0
        scale = alone / (math_s + mem_s)
        return GemmFit(est.theta * scale, est.dbytes * scale, est.ctas), 0.0
    # the time alone counts as one more point (weighting it more fitted the H200 worse: its GEMM
    # points were timed minutes before the overlaps)
    anchor = [] if alone is None else [alone]
    free = np.concatenate([[sms] * len(anchor), sms - channels])
    bandwidth = np.concatenate([[hbm] * len(anchor), hbm - taken])
    y = np.concatenate([anchor, seconds])
    weight = np.concatenate([[1.0] * len(anchor), weights])
    ctas = np.array(cta_candidates(g, sms), dtype=float)
    theta, d, loss = _two_term_fits(waves(ctas[:, None], free[None, :], width), ctas[:, None] / bandwidth[None, :], y, weight)
    # candidates come fewest CTAs first, and the first that fits as well as the best is taken:
    # where the data cannot tell grids apart (no point at the channel counts that would), the
    # model assumes no slowdown the data did not show
    i = int(np.argmax(loss <= loss.min() * (1 + TIE)))
    return GemmFit(float(theta[i]), float(d[i]), int(ctas[i])), float(loss[i])


def _fit_v(obs: _Observations, gemms: dict[str, GemmFit], contention: Contention, sms: int, hbm: float) -> Contention:
    """``v_base`` and ``v_per_byte`` by a coarse, then a fine, grid on the weighted Huber loss of the
    relative error of every contended observation, the shapes' terms held."""
    known = np.array([k in gemms for k in obs.shape], dtype=bool)
    if not known.any():
        return contention
    fits = [gemms[k] for k in obs.shape[known]]
    theta = np.array([f.theta for f in fits])
    traffic = np.array([f.ctas * f.dbytes for f in fits])
    n_waves = waves(np.array([f.ctas for f in fits], dtype=float), sms - obs.channels[known], contention.wave_width)
    bw, y, weight = obs.comm_bw[known], obs.seconds[known], obs.weight[known]

    def sse(base: np.ndarray, per_byte: np.ndarray) -> np.ndarray:
        taken = np.minimum(base[:, None] + per_byte[:, None] * bw[None, :], (1 - MIN_FREE_HBM) * hbm)
        pred = n_waves * theta + traffic / (hbm - taken)
        return (weight * _huber((pred - y) / y)).sum(axis=1)

    top = (1 - MIN_FREE_HBM) * hbm
    bases, per_bytes = np.linspace(0, top, 19), np.linspace(0, MAX_V_PER_BYTE, 25)
    for _ in range(2):
        b_grid, p_grid = (x.ravel() for x in np.meshgrid(bases, per_bytes))
        i = int(np.argmin(sse(b_grid, p_grid)))
        db, dp = bases[1] - bases[0], per_bytes[1] - per_bytes[0]
        bases = np.linspace(max(0.0, b_grid[i] - db), min(top, b_grid[i] + db), 11)
        per_bytes = np.linspace(max(0.0, p_grid[i] - dp), p_grid[i] + dp, 11)
    return replace(contention, v_base=float(b_grid[i]), v_per_byte=float(p_grid[i]))


def _fit_eq46(obs: _Observations, alone: dict[str, float], shapes: dict[str, Gemm], sms: int, hbm: float,
              iterations: int) -> tuple[dict[str, GemmFit], Contention]:
    """The paper's form: ``theta_i``, ``D_i`` per shape by least squares given ``V``, and ``V`` per
    (channels, buffsize) from each observation where memory matters, alternately."""
    v_table: dict[tuple[int, int], float] = {}
    gemms: dict[str, GemmFit] = {}
    for _ in range(iterations):
        # (1) per GEMM, theta and D by least squares given V: y/g = theta + D * free / (Bbar - V)
        for key, g in shapes.items():
            sel = obs.shape == key
            if key not in alone and not sel.any():
                continue
            rows = ([(sms, 0.0, alone[key])] if key in alone else []) + [(sms - c, v_table.get((int(c), int(b)), 0.0), y)
                                               for c, b, y in zip(obs.channels[sel], obs.buffsize[sel], obs.seconds[sel])]
            a = np.array([[1.0, free / max(MIN_FREE_HBM * hbm, hbm - vv)] for free, vv, _ in rows])
            t = np.array([y / math.ceil(blocks(g) / free) for free, _, y in rows])
            (theta, d), _ = _nonneg_lstsq(a, t, 1 / t)
            gemms[key] = GemmFit(float(theta), float(d), blocks(g))
        # (2) per (channels, buffsize), V from each observation where memory matters
        sums: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for key, c, b, y in zip(obs.shape, obs.channels, obs.buffsize, obs.seconds):
            f = gemms.get(key)
            if f is None or f.dbytes <= 0:
                continue
            free = sms - c
            per_wave = y / math.ceil(f.ctas / free) - f.theta
            if per_wave <= 0:
                continue
            mem_share = free * f.dbytes / hbm / (f.theta + free * f.dbytes / hbm)
            v_row = hbm - free * f.dbytes / per_wave
            sums.setdefault((int(c), int(b)), []).append((min(max(v_row, 0.0), (1 - MIN_FREE_HBM) * hbm), mem_share))
        v_table = {k: float(np.average([x for x, _ in vals], weights=[w + 1e-9 for _, w in vals])) for k, vals in sums.items()}
    return gemms, Contention(FORM_EQ46, v_table=v_table)


def _fit_comm_slowdown(model: LagomGpuModel, over: pd.DataFrame) -> Contention:
    """``kappa`` (and for waves-v2 ``kappa_channel``) by non-negative least squares on the
    collective's slowdown while both ran, each point weighted by the share of the collective's
    time the GEMMs ran beside it. The pair's alone time was timed repeated (L2-warm): it is
    converted to the cold time the model's overlap starts from before the slowdown is solved."""
    from lagom_tune.model.fit import gemm_of_row, two_rate_slowdowns

    memory, per_channel, extra, weight = [], [], [], []
    for _, r in over.iterrows():
        fit = model.comm.get(comm_group_of_row(r))
        if fit is None or pd.isna(r["comm_alone_us"]):
            continue
        bus = r["nbytes"] * bus_factor(str(r["op"]), int(r["ranks"]) if not pd.isna(r["ranks"]) else 1)
        args = (bus, r["nbytes"], r["channels"], r["threads"], r["buffsize"])
        cold = r.copy()
        cold["comm_alone_us"] = r["comm_alone_us"] * fit.seconds(*args) / fit.seconds(*args, repeated=True)
        _, s_x = two_rate_slowdowns(cold)
        if s_x is None or not s_x > 0:
            continue
        g = gemm_of_row(r)
        memory.append(model.memory_share(g) if model.form == FORM_EQ46 else model.hbm_demand(g))
        per_channel.append(r["channels"] / model.sms)
        extra.append(s_x - 1)
        weight.append(min(1.0, r["time_us"] / r["comm_us"]))
    c = model.contention
    if not extra:
        return c
    y, w = np.array(extra), np.array(weight)
    if c.form == FORM_EQ46:
        (kappa,), _ = _nonneg_lstsq(np.array(memory)[:, None], y, w)
        return replace(c, kappa=float(kappa))
    (kappa, kappa_channel), _ = _nonneg_lstsq(np.column_stack([memory, per_channel]), y, w)
    return replace(c, kappa=float(kappa), kappa_channel=float(kappa_channel))
