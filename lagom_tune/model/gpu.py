"""The Lagom cost model for GPUs (paper Eqs. 4-6), fitted instead of only stated, and the form the
measurements of a real GPU asked for (DESIGN.md §6 and §10).

Computation ``i`` beside collective ``j`` with ``NC`` channels and buffer ``C``, on a device of
``lambda`` SMs and HBM bandwidth ``Bbar``. Two forms; model.yaml's ``form`` says which was fitted.

``lagom-eq4-6``, the paper's::

    g_ij = ceil(mu_i / (lambda - NC))                                  # mu_i: 128x128 tiles
    y_ij = g_ij * (theta_i + (lambda - NC) * D_i / (Bbar - V(NC, C)))  # V: a fitted table

``lagom-waves-v2``, what one H200 showed (``tests/data/h200-2026-11-29``)::

    g_ij = waves(mu_i, free(lambda, NC, G), w)
    y_ij = g_ij * theta_i * (1 + rho_i [NC > 0]) + mu_i * D_i / (Bbar - V_j),    V_j = v_base + v_per_byte * bw_j(NC, NT, C)

* ``mu_i``, the CTAs the GEMM's kernel runs, is chosen per shape by the fit: a tile count
  (:data:`CTA_TILES`, :data:`NARROW_TILES` for an output at most 64 wide, split-K :data:`SPLITS`) or a persistent grid of ``lambda - s`` CTAs
  (:data:`GRID_SPARE`): cuBLAS's Hopper kernels keep a grid of about one CTA per SM, a few SMs
  idle, so the first channels cost nothing and the next push CTAs into a second wave.
* Math quantises in waves, bytes do not: a short last wave moves only its own CTAs' bytes, so the
  shape's whole traffic ``mu_i * D_i`` shares the bandwidth left (the paper charges every wave as
  a full one). Eq. 5's memory term is this one when all waves are full.
* ``waves`` counts a partial wave of ``r`` CTAs as ``min(1, r / w)`` of a wave: ``w = 1`` is Eq. 4's
  ceil; the H200 measured ``w = 2`` (one CTA pushed out by a channel adds half a wave, two or more
  a whole one: 1.5x at 2 channels, 1.8-2.0x from 4 up to 48 for 40-50 µs GEMMs).
* ``free`` (:func:`free_sms`): the SMs the channel blocks leave, one per block (``G = 0``,
  Eq. 4's ``lambda - NC``) or whole TPCs over ``G`` GPCs (Hopper runs GEMMs in 2-CTA clusters,
  which need both SMs of a TPC: a GPC's odd block spoils one). The fit picks ``G`` with ``w``,
  by the same loss (both H200 mpt-7b runs fit TPCs better, the llama3-8b run one SM per block).
* ``rho_i``, the shape's co-run cost: its math runs this much longer whenever any collective runs
  beside it (L2 evictions, HBM latency), fitted per shape against its time alone (0-40%; the
  H200's large GEMMs lost ~20% to a single copy block, one-wave ones ~5%). Never-measured shapes
  take the median.
* ``V_j``, HBM bandwidth the running collective takes: a base (any channel running: DRAM row and
  L2 interference) plus HBM bytes per communicated byte times the collective's fitted bandwidth,
  so it follows channels, threads and buffer size through the communication fit.

Communication ``x = a + bus_bytes / bw`` per (op, algorithm, protocol, nodes), fitted with torch on
relative error. Fits since 2026-11-30 use the ``steps`` curve: each channel copies at ``beta``
once it has ``n0`` threads (a soft minimum of sharpness ``q``), the channels' sum meets the link
``L`` as a soft minimum of power ``p``, and every pipeline step of ``C/8`` bytes pays a handshake
``h``: ``1/bw = 1/carried(NC, NT) + h / (NC * C / 8)``. Fits since 2026-12-06 (``steps-depth``)
add that a collective takes at least its algorithm's pipeline steps however few bytes a channel
carries (``nccl_knobs.pipeline_steps``: a ring all-gather's ``n - 1``), each with its handshake:
``x = a + bus_bytes / bw + h * max(0, depth - bus_bytes / (NC * C / 8))``; the ``steps`` curve had
only ``a`` for them, which then overcharged every large collective (simulated 8xH100 all-to-all: a
26 us ``a`` where the launch is 5 us, NCCL's default all-to-all predicted 5-8% slow; 2026-12-06).
Fits since 2026-12-06 (``steps-rolloff``) let the channels' sum roll off before it meets the link:
``offered / (1 + offered / R)``, contention that costs each added channel more (``R``, fitted; a
group whose channels never roll off fits it beyond any link). 8xH200 showed it (DESIGN.md §10):
an all-reduce of 128 MB with its CTAs capped at 2/4/8 moved 74/134/234 GB/s busbw, which ``R``
about 830 GB/s at 41 GB/s a channel meets within 2 GB/s each, long before the ~370 GB/s its links
carry at NCCL's defaults; one soft minimum against the link misses either that roll-off or the
cap (simulated 8xH100: NCCL's default all-to-all predicted 4-6% slow).
Older files hold the ``exp-pipeline`` curve,
``bw = L * (1 - exp(-NC * beta * (NT/512)^tau / L)) / (1 + c / (C/8))``, and are read as written. That is
its time in a workload, where the computation beside it has evicted its buffers from L2. Timed
alone, back to back on one buffer (how the profiler measures it), a collective whose footprint
``nbytes + NC * C`` fits in L2 reads from L2: its bandwidth is ``bw * (1 + warm_gain * h)``, ``h =
min(1, l2_bytes / footprint)^2`` (a 25 MB probe copies 2.4x faster alone than beside a GEMM;
``fit.fit_model`` keeps the term only where held-out overlapped points ask for it, else
``warm_gain = 0``).
Beside a GEMM it slows by ``1 + kappa * memory_share_i`` (eq4-6: the fitted memory part of the
GEMM's time), or ``1 + kappa * u_i + kappa_channel * NC / lambda + kappa_traffic * t_ij + drag_i *
pace_ij`` (waves-v2: ``u_i`` is the share of ``Bbar`` the GEMM draws alone, its least traffic over
its time, which the shape fixes where the fitted math/memory split may not; ``t_ij`` the share its
fitted traffic draws beside the collective; ``drag_i`` the shape's own drag beyond those terms,
scaled by its pace beside the collective, time alone over time contended, since a slowed GEMM
issues less traffic; a shape whose own points fit better with its drag alone (``own_drag``) drops
the shared terms; the probe slowed 1.2x beside 1x GEMMs and 2x beside batched k=128 ones).

A legacy overlapped row (no ``baseline`` column) whose shape has no GEMM point has no usable time
alone: the fit starts that shape from its fastest overlapped GEMM, then from its own estimate.
Overlapped points are weighted by how long the two streams ran together, since a slowdown solved
from a short overlap is ill-conditioned; outliers count linearly (Huber), not squared.

A shape's time alone comes from its own point and from the alone times recorded with its
overlapped pairs; waves-v2 returns it as measured (``alone_s``: the terms model the shape beside
collectives, where a kernel's waves may quantise unlike its time alone, e.g. a persistent grid
with uneven tiles per CTA; it never runs faster beside one). A shape never measured is predicted
from the others, fitted jointly with non-negative coefficients (a launch cost too; waves-v2 under
Huber's loss, as the shapes' own terms): per wave, math
in proportion to the block's ``k``; memory (waves-v2) in proportion to what it must move, A and B
read and C written once, plus what its blocks move beyond that when they share nothing (panel
re-reads: a GEMM one tile wide has none, a square one many; split-K's fp32 partials); memory
(eq4-6) in proportion to each block's A and B panels and its C tile, as Eq. 5 charges them.
waves-v2 runs each shape as the cheapest of its candidate kernels (:func:`kernels`, as a library
picks its fastest; the kernels re-assigned and the terms refitted until no shape changes kernel;
model files written before 2026-11-30's fifth session run 128x128 tiles). Leave-one-shape-out,
against 128x128 tiles for every shape and a launch cost clipped at zero after an unconstrained fit:
simulated A40 MoE shapes 14-15% -> 6%, the three real H200 runs 12.2, 6.7, 3.9% -> 5.1, 5.0, 4.4%.
What the regression misses on the measured shapes it carries to new shapes near them (residuals,
smoothed over log2 sides, k and batch and shrunk toward none: :data:`RESIDUAL_OCTAVES`,
:data:`RESIDUAL_PRIOR`; model files written before 2026-12-01 have none): the real H200 runs
5.1, 5.0, 4.4% -> 4.3, 3.9, 4.5%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Mapping

import numpy as np
import pandas as pd

from lagom_tune import validate as v
from lagom_tune.backends.base import bus_factor
from lagom_tune.backends.nccl_knobs import channel_run, pipeline_steps
from lagom_tune.errors import UserError
from lagom_tune.workload.spec import DTYPES, Collective, Gemm, gemm_of_key

TILE = 128  # the paper's tile edge: Eq. 4's mu_i, and the estimate for shapes never measured
FORM_EQ46 = "lagom-eq4-6"
FORM_WAVES = "lagom-waves-v2"
FORMS = (FORM_EQ46, FORM_WAVES)

CTA_TILES = ((128, 128), (128, 256), (256, 128))  # tile shapes cuBLAS picks for bf16/fp16 GEMMs
NARROW = 64  # ... and for an output at most this wide, 64-wide tiles (a 128-wide one would compute half zeros)
NARROW_TILES = ((128, NARROW), (NARROW, 128))
SPLITS = (1, 2, 4)  # split-K factors: a short, deep GEMM runs more CTAs, each over a part of k
MIN_SPLIT_K = 2 * TILE  # a split keeps at least two 128-deep steps of k per CTA
SPLIT_PARTIAL_BYTES = 4  # a split-K partial tile is written and read back in fp32
GRID_SPARE = range(0, 9)  # a persistent kernel's grid leaves 0..8 SMs idle
WAVE_WIDTHS = (1.0, 2.0, 4.0)  # candidates for w; 1 is Eq. 4's ceil
PLACEMENTS = (0, 8)  # candidates for G: 0, a channel block takes one SM; 8, the GPCs of an H100/H200 (Hopper: 2-CTA clusters)
TPC = 2  # SMs per TPC: a 2-CTA thread-block cluster needs both of a TPC's SMs
CORUN_GRID = tuple(i / 40 for i in range(17))  # candidates for a shape's co-run slowdown: 0 to 40%
MIN_FREE_HBM = 0.05  # the bandwidth left to a GEMM never falls below 5% of Bbar
MAX_V_PER_BYTE = 6.0  # HBM bytes per communicated byte, at most (a copy reads and writes 2, an all-reduce about 3)
TIE = 1e-6  # relative difference in loss below which two candidate CTA counts fit equally well
HUBER_DELTA = 0.1  # relative error beyond which a point counts linearly, not squared (a point timed while the GPU ran slow)
# A never-measured shape takes the regression's residuals on the measured shapes near it: a kernel
# smoother over log2 (short side, long side, k, batch), a Gaussian of RESIDUAL_OCTAVES, shrunk
# toward no correction as if RESIDUAL_PRIOR exact neighbours said 0 (far from every measured
# shape, the regression alone).
RESIDUAL_OCTAVES = 1.0
RESIDUAL_PRIOR = 0.25
MAX_RESIDUAL = 3.0  # |log(measured / regression)| at most this (20x): beyond, a shape is not evidence about its neighbours
L2_SHARPNESS = 2.0  # h = min(1, l2 / footprint)^2: streaming past the L2 size loses hits quickly

COMM_PARAMS = ("latency_us", "link_GBps", "per_channel_GBps", "threads_exp", "pipeline_bytes", "warm_gain", "l2_bytes")
STEP_PARAMS = ("latency_us", "link_GBps", "per_channel_GBps", "threads_knee", "threads_exp", "saturation", "handshake_us",
               "warm_gain", "l2_bytes")
ROLLOFF_PARAMS = STEP_PARAMS + ("rolloff_GBps",)
CURVE_EXP, CURVE_STEPS, CURVE_DEPTH, CURVE_ROLLOFF = "exp-pipeline", "steps", "steps-depth", "steps-rolloff"
CURVE_PARAMS = {CURVE_EXP: COMM_PARAMS, CURVE_STEPS: STEP_PARAMS, CURVE_DEPTH: STEP_PARAMS, CURVE_ROLLOFF: ROLLOFF_PARAMS}
CURVES = tuple(CURVE_PARAMS)
DEPTH_CURVES = (CURVE_DEPTH, CURVE_ROLLOFF)  # those that charge a short collective its pipeline steps
DIVISORS = ("link_GBps", "per_channel_GBps", "rolloff_GBps")  # parameters times are divided by: positive, never 0
SOFT_CAP_POWERS = ("threads_exp", "saturation", "threads_knee")  # ... and, in the steps curve, those a soft minimum takes logs of
MAX_GBPS = 1e6  # a bandwidth parameter above 1 PB/s is no link's (1e300 overflowed to NaN times in the search)
MAX_GEMM_S = 3600.0  # a GEMM's wave (theta) or time alone, at most: an hour (theta 1e300 gave a plan its 1.017x)
STEPS_PER_BUFFER = 8  # NCCL moves a channel's buffer in 8 steps


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


def kernels(g: Gemm, sms: int, narrow: bool = True) -> list[tuple[tuple[int, int], int]]:
    """The kernels a library may run for ``g`` on ``sms`` SMs: each tile shape (:data:`CTA_TILES`,
    and :data:`NARROW_TILES` for an output at most :data:`NARROW` wide unless ``narrow`` is False:
    model files written before 2026-12-01 were fitted without them), unsplit or, where its output
    tiles leave SMs idle, split-K (:data:`SPLITS`) with at least :data:`MIN_SPLIT_K` of k per CTA
    (splitting adds CTAs only where there are too few to fill the device, at the cost of the
    partials' traffic); Eq. 4's 128x128 tile unsplit first."""
    tiles = CTA_TILES + (NARROW_TILES if narrow and min(g.m, g.n) <= NARROW else ())
    return [(tile, s) for tile in tiles for s in SPLITS
            if s == 1 or (kernel_ctas(g, tile) < sms and g.k // s >= MIN_SPLIT_K)]


def kernel_ctas(g: Gemm, tile: tuple[int, int] = (TILE, TILE), split: int = 1) -> int:
    """CTAs of a one-tile-per-CTA kernel: output tiles times the split."""
    return math.ceil(g.m / tile[0]) * math.ceil(g.n / tile[1]) * g.batch * split


def cta_kflop(g: Gemm, tile: tuple[int, int] = (TILE, TILE), split: int = 1) -> float:
    """kFLOP one CTA of a ``tile`` kernel split ``split`` ways computes (Eq. 4's ``theta`` per kFLOP
    times this is its math per wave)."""
    return 2 * tile[0] * tile[1] * g.k / split / 1e3


def extra_traffic(g: Gemm, tile: tuple[int, int] = (TILE, TILE), split: int = 1) -> float:
    """Bytes a kernel of ``tile`` blocks split ``split`` ways would move beyond A and B read once
    and C written once, if no two blocks shared a panel: each A row panel once per block column,
    each B column panel once per block row, and a split's fp32 partial tiles written and read back."""
    rereads = (g.m * g.k * (math.ceil(g.n / tile[1]) - 1) + g.k * g.n * (math.ceil(g.m / tile[0]) - 1)) * DTYPES[g.dtype]
    partials = 2 * split * g.m * g.n * SPLIT_PARTIAL_BYTES if split > 1 else 0
    return (rereads + partials) * g.batch


def cta_candidates(g: Gemm, sms: int) -> list[int]:
    """The CTA counts ``mu_i`` the fit chooses among for ``g`` (see the module docstring)."""
    return sorted({kernel_ctas(g, tile, s) for tile, s in kernels(g, sms)} | {sms - s for s in GRID_SPARE})


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


def free_sms(sms: int, channels, gpcs: int = 0):
    """SMs a GEMM's CTAs can use while ``channels`` channel blocks run (placement ``G = gpcs``).

    ``G = 0``: each block takes one SM (Eq. 4's ``lambda - NC``). ``G > 0``: the block scheduler
    spreads the blocks over ``G`` GPCs and packs them within one, and a GEMM launched in 2-CTA
    clusters (Hopper) loses every TPC a block sits on: two blocks share a TPC, an odd one spoils
    a whole one (so 8 blocks over 8 GPCs cost what 16 do).

    Args:
        sms: the device's SMs.
        channels: channel blocks running (a number or an array).
        gpcs: ``G``, 0 for one SM per block.

    Returns:
        The free SMs, at least 1 (a float or an array).
    """
    scalar = np.ndim(channels) == 0
    ch = float(channels) if scalar else np.asarray(channels, dtype=float)
    if gpcs:
        per_gpc, extra = ch // gpcs, ch % gpcs  # ``extra`` GPCs hold one block more
        lost = TPC * (extra * -(-(per_gpc + 1) // TPC) + (gpcs - extra) * -(-per_gpc // TPC))  # -(-x // n): ceil(x / n)
    else:
        lost = ch
    return max(1.0, sms - lost) if scalar else np.maximum(1.0, sms - lost)


def comm_group(op: str, algo: str, proto: str, nodes: int) -> str:
    """The key of a communication group: its curve is fitted per (op, algorithm, protocol, nodes)."""
    return f"{op}|{algo}|{proto}|{int(nodes)}"


def comm_group_of_row(row: Mapping[str, Any]) -> str:
    """The communication group a measurement row belongs to."""
    return comm_group(str(row["op"]), str(row["algo"]), str(row["proto"]), int(row["nodes"]) if not pd.isna(row["nodes"]) else 1)


# ---------------------------------------------------------------------------------------------
# Fitted terms


@dataclass(frozen=True)
class GemmFit:
    """A measured GEMM shape's terms: seconds of math per wave, effective HBM bytes per CTA, CTAs,
    and (waves-v2) how much longer its math runs whenever a collective runs beside it."""

    theta: float
    dbytes: float
    ctas: int
    corun: float = 0.0
    drag: float = 0.0  # waves-v2: how much more a collective beside this shape slows, at the shape's rate alone
    own_drag: bool = False  # the drag is all of it (fitted on the shape's own overlapped points), not beyond the shared terms
    alone: float = 0.0  # waves-v2: the measured time alone in seconds (0: from the terms)


@dataclass(frozen=True)
class ShapeRegression:
    """Shapes never measured: ``theta`` from the tile's math (per kFLOP), ``D`` from the bytes the
    GEMM moves at least (:func:`min_traffic`) and those its kernel moves beyond (:func:`extra_traffic`),
    or (eq4-6, and files written before 2026-11-30's third session) from the bytes a block reads (A
    and B panels) and writes (its C tile); plus a launch cost. ``kernel_choice``: the kernel is the
    cheapest of :func:`kernels` by these terms (as a library picks the fastest it has), else Eq. 4's
    128x128 tile."""

    theta_per_kflop: float = 0.0
    d_per_block_byte: float = 0.0  # eq4-6: per byte of a block's A and B panels
    d_per_tile_byte: float = 0.0  # ... and of its C tile
    launch_s: float = 0.0
    corun: float = 0.0  # the measured shapes' median
    d_per_min_byte: float = 0.0  # waves-v2: per byte of A and B read and C written once
    d_per_reread_byte: float = 0.0  # ... and per byte the kernel moves beyond that
    kernel_choice: bool = False
    residuals: dict[str, float] = field(default_factory=dict)  # waves-v2: log(measured / regression) per measured shape
    narrow_tiles: bool = False  # the candidates include NARROW_TILES (fits since 2026-12-01)

    def terms(self, g: Gemm, tile: tuple[int, int] = (TILE, TILE), split: int = 1) -> GemmFit:
        """The terms of ``g`` run as a kernel of ``tile`` blocks split ``split`` ways."""
        ctas = kernel_ctas(g, tile, split)
        per_block = self.d_per_block_byte * block_bytes(g) + self.d_per_tile_byte * tile_bytes(g)
        moved = self.d_per_min_byte * min_traffic(g) + self.d_per_reread_byte * extra_traffic(g, tile, split)
        return GemmFit(self.theta_per_kflop * cta_kflop(g, tile, split), per_block + moved / ctas, ctas, self.corun)

    def estimate(self, g: Gemm, sms: int, hbm: float) -> GemmFit:
        """The terms of a shape never measured on a device of ``sms`` SMs and ``hbm`` bytes/s, its
        math and memory scaled together so that its time alone takes the residuals of the measured
        shapes near it (:meth:`correction`)."""
        fit = self.regressed(g, sms, hbm)
        kernel = _kernel_seconds(fit, sms, hbm)
        if not self.residuals or kernel <= 0:
            return fit
        scale = max(0.0, ((self.launch_s + kernel) * self.correction(g) - self.launch_s) / kernel)
        return replace(fit, theta=fit.theta * scale, dbytes=fit.dbytes * scale)

    def regressed(self, g: Gemm, sms: int, hbm: float) -> GemmFit:
        """The regression's terms of ``g`` alone: the cheapest candidate kernel (waves-v2), else
        Eq. 4's 128x128 tile."""
        if not self.kernel_choice:
            return self.terms(g)
        return min((self.terms(g, tile, s) for tile, s in kernels(g, sms, self.narrow_tiles)), key=lambda f: _kernel_seconds(f, sms, hbm))

    def correction(self, g: Gemm) -> float:
        """The factor on the regression's time of ``g`` from the residuals of the measured shapes
        of its dtype near it (1 with none near)."""
        here = residual_coordinates(g)
        weights, residuals = [], []
        for key, r in self.residuals.items():
            dtype, there = _key_coordinates(key)
            if dtype == g.dtype:  # an fp32 shape says nothing about a bf16 one's kernel
                weights.append(math.exp(-sum((a - b) ** 2 for a, b in zip(here, there)) / (2 * RESIDUAL_OCTAVES ** 2)))
                residuals.append(r)
        return math.exp(float(np.dot(weights, residuals)) / (sum(weights) + RESIDUAL_PRIOR)) if weights else 1.0

    def seconds(self, g: Gemm, sms: int, hbm: float) -> float:
        """Seconds alone of a shape never measured, as the regression (and its residuals near ``g``)
        predict them."""
        return self.launch_s + _kernel_seconds(self.estimate(g, sms, hbm), sms, hbm)


def residual_coordinates(g: Gemm) -> tuple[float, float, float, float]:
    """Where a shape lies for :meth:`ShapeRegression.correction`: log2 of its short and long output
    sides, its k and its batch (a GEMM and its transpose run alike)."""
    return (math.log2(min(g.m, g.n)), math.log2(max(g.m, g.n)), math.log2(g.k), math.log2(g.batch))


@lru_cache(maxsize=4096)
def _key_coordinates(key: str) -> tuple[str, tuple[float, float, float, float]]:
    g = gemm_of_key(key)
    return g.dtype, residual_coordinates(g)


def _kernel_seconds(f: GemmFit, sms: int, hbm: float) -> float:
    """A kernel's seconds alone by its terms on an idle device, a partial wave counted as a full one."""
    return math.ceil(f.ctas / sms) * f.theta + f.ctas * f.dbytes / hbm


@dataclass(frozen=True)
class CommFit:
    """One (op, algorithm, protocol, nodes) group's communication curve (see the module docstring).

    ``curve`` says which: ``steps-rolloff`` (fits since 2026-12-06: ``steps-depth`` whose channels'
    sum rolls off before the link), ``steps-depth`` (fits since 2026-12-06: ``steps`` with at least the
    algorithm's pipeline steps), ``steps`` (fits since 2026-11-30: channels sharing a link, plus a
    handshake per pipeline step) or ``exp-pipeline`` (model files written before).
    """

    latency_us: float
    link_GBps: float
    per_channel_GBps: float
    threads_exp: float  # exp-pipeline: (NT/512)^tau; steps: the sharpness of the thread knee
    pipeline_bytes: float  # exp-pipeline only
    warm_gain: float = 0.0
    l2_bytes: float = 0.0
    curve: str = CURVE_EXP
    threads_knee: float = 0.0  # steps: threads at which a channel reaches its copy rate
    saturation: float = 1.0  # steps: how sharply the channels' sum meets the link (1: smoothly, large: a hard cap)
    handshake_us: float = 0.0  # steps: per pipeline step of buffsize/8
    rolloff_GBps: float = math.inf  # steps-rolloff: the offered rate at which contention halves what channels carry
    sensitivity: float = 1.0  # how strongly this group's collectives feel a GEMM beside them (waves-v2; 1: as fitted overall)

    def bandwidth(self, channels: float, threads: float, buffsize: float) -> float:
        """Bus bytes/s with cold buffers (in a workload), per-step handshakes included."""
        if self.curve == CURVE_EXP:
            return float(channel_bandwidth(np, self.link_GBps, self.per_channel_GBps, self.threads_exp, self.pipeline_bytes,
                                           channels, threads, buffsize))
        return float(step_bandwidth(np, self.link_GBps, self.per_channel_GBps, self.threads_knee, self.threads_exp,
                                    self.saturation, self.handshake_us, channels, threads, buffsize, self.rolloff_GBps))

    def seconds(self, bus_bytes: float, nbytes: float, channels: float, threads: float, buffsize: float,
                repeated: bool = False, depth: int = 1) -> float:
        """Seconds to move ``bus_bytes``; ``repeated``: timed back to back on one buffer (L2-warm);
        ``depth``: the algorithm's pipeline steps (``nccl_knobs.pipeline_steps``; the ``steps-depth``
        curve's floor on the handshakes)."""
        warm = self.warm_gain * l2_hit_share(np, self.l2_bytes, nbytes, channels, buffsize) if repeated else 0.0
        short = float(short_steps(np, depth, bus_bytes, channels, buffsize)) if self.curve in DEPTH_CURVES else 0.0
        return (self.latency_us + self.handshake_us * short) * 1e-6 + bus_bytes / (self.bandwidth(channels, threads, buffsize) * (1 + warm))

    def to_dict(self) -> dict[str, Any]:
        names = CURVE_PARAMS[self.curve]
        return {"curve": self.curve, **{n: float(getattr(self, n)) for n in names}, "sensitivity": self.sensitivity}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str = "comm") -> "CommFit":
        """Reads every curve; files written before the L2 terms existed have no ``warm_gain`` (no
        warm speed-up), before the step curve no ``curve`` (exp-pipeline). ``path`` names the
        record in errors."""
        d = v.mapping(d, path)
        curve = v.one_of(v.field(d, "curve", path, str, CURVE_EXP), CURVES, f"{path}.curve")

        def param(name: str, default: Any = ...) -> float:  # every parameter is fitted positive (log-parameters)
            value = v.field(d, name, path, float, default, minimum=0.0, maximum=MAX_GBPS if name in DIVISORS else None)
            if value == 0 and name in (DIVISORS + (SOFT_CAP_POWERS if curve != CURVE_EXP else ())):  # times infinite or NaN
                raise UserError(f"{path}.{name}: must be > 0, got 0")
            return value

        sensitivity = param("sensitivity", 1.0)
        if curve != CURVE_EXP:
            return cls(**{n: param(n) for n in CURVE_PARAMS[curve]}, pipeline_bytes=0.0, curve=curve, sensitivity=sensitivity)
        return cls(**{n: param(n) for n in COMM_PARAMS[:5]}, **{n: param(n, 0.0) for n in COMM_PARAMS[5:]},
                   sensitivity=sensitivity)


@dataclass(frozen=True)
class Contention:
    """How a running collective slows a GEMM and a GEMM slows the collective.

    ``lagom-eq4-6`` uses ``v_table`` ((channels, buffsize) -> HBM bytes/s, interpolated in channels)
    and ``kappa``; ``lagom-waves-v2`` uses ``wave_width``, ``gpcs``, ``v_base``, ``v_per_byte``, ``kappa`` and
    ``kappa_channel``.
    """

    form: str = FORM_WAVES
    wave_width: float = 1.0
    gpcs: int = 0  # waves-v2: the placement of channel blocks, see free_sms (0: one SM per block)
    v_base: float = 0.0  # bytes/s any running collective takes from HBM
    v_per_byte: float = 0.0  # HBM bytes per bus byte it moves
    v_table: Mapping[tuple[int, int], float] = field(default_factory=dict)
    kappa: float = 0.0  # collective slowdown per unit of the GEMM's memory share
    kappa_channel: float = 0.0  # ... and per channel, as a fraction of the SMs
    kappa_traffic: float = 0.0  # ... and per unit of the GEMM's fitted HBM traffic share while contended (waves-v2)


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
        return self.gemms.get(g.shape_key) or self.new_shapes.estimate(g, self.sms, self.hbm)

    def hbm_taken(self, coll: Collective | None, settings: Mapping[str, Any]) -> float:
        """``V``: HBM bytes/s the collective takes at ``settings`` (0 with no channels)."""
        channels = int(settings.get("channels", 0)) if coll is not None else 0
        if not channels:
            return 0.0
        c = self.contention
        if c.form == FORM_EQ46:
            return self._v_table(channels, int(settings["buffsize"]))
        fit = self.comm_params(coll.op, settings["algo"], settings["proto"], coll.nodes)
        return c.v_base + c.v_per_byte * fit.bandwidth(channels, *channel_run(settings["proto"], settings["threads"], settings["buffsize"]))

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
        bandwidth = max(MIN_FREE_HBM * self.hbm, self.hbm - hbm_taken)
        if self.form == FORM_EQ46:
            free = max(1, self.sms - channels)
            return launch + math.ceil(fit.ctas / free) * (fit.theta + free * fit.dbytes / bandwidth)
        free = free_sms(self.sms, channels, self.contention.gpcs)
        corun = 1 + fit.corun if channels else 1.0
        seconds = launch + waves(fit.ctas, free, self.contention.wave_width) * fit.theta * corun + fit.ctas * fit.dbytes / bandwidth
        if fit.alone:  # measured alone: that time, and never faster beside a collective
            return max(seconds, fit.alone) if channels else fit.alone
        return seconds

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
        return fit.seconds(nbytes * bus_factor(op, ranks), nbytes, s["channels"], *channel_run(s["proto"], s["threads"], s["buffsize"]),
                           repeated, pipeline_steps(op, s["algo"], ranks))

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
        # never faster beside a GEMM than alone: a shape's drag may be negative (it slowed the
        # collective less than the shared terms say), and at settings it was not measured at the
        # sum could fall below 1 (a CPU stand-in fold once predicted -10)
        drag = self.comm_params(coll.op, settings["algo"], settings["proto"], coll.nodes).sensitivity * self.comm_drag(gemm, coll, settings)
        return max(1.0, 1 + drag)

    def comm_drag(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        """waves-v2: the extra slowdown of a collective beside ``gemm``, before its group's sensitivity."""
        c, fit = self.contention, self.gemm_fit(gemm)
        contended = self._contended_time(gemm, coll, settings)
        drag = fit.drag * self.gemm_time(gemm) / contended
        if fit.own_drag:  # measured beside collectives: its own drag, at its pace
            return drag
        return (c.kappa * self.hbm_demand(gemm) + c.kappa_channel * int(settings.get("channels", 0)) / self.sms
                + c.kappa_traffic * self._traffic_share(fit, contended) + drag)

    def pace(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        """The GEMM's rate beside ``coll`` relative to alone (1: unslowed): its traffic, and so its
        drag on the collective, scales with it."""
        return self.gemm_time(gemm) / self._contended_time(gemm, coll, settings)

    def traffic_share(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        """The share of HBM bandwidth the GEMM's fitted traffic draws while it runs beside ``coll``
        (a collective's steps wait behind it)."""
        return self._traffic_share(self.gemm_fit(gemm), self._contended_time(gemm, coll, settings))

    def _contended_time(self, gemm: Gemm, coll: Collective, settings: Mapping[str, Any]) -> float:
        return self.gemm_time(gemm, int(settings.get("channels", 0)), self.hbm_taken(coll, settings))

    def _traffic_share(self, fit: GemmFit, contended_s: float) -> float:
        return min(1.0, fit.ctas * fit.dbytes / (self.hbm * contended_s))

    # -- artifact ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        c, r = self.contention, self.new_shapes
        params: dict[str, Any] = {
            "gemms": {k: {"theta": f.theta, "dbytes": f.dbytes, "ctas": f.ctas, "corun": f.corun, "drag": f.drag,
                           "own_drag": f.own_drag, "alone_s": f.alone}
                      for k, f in sorted(self.gemms.items())},
            "theta_per_kflop": r.theta_per_kflop,
            "d_per_block_byte": r.d_per_block_byte,
            "d_per_tile_byte": r.d_per_tile_byte,
            "d_per_min_byte": r.d_per_min_byte,
            "d_per_reread_byte": r.d_per_reread_byte,
            "kernel_choice": r.kernel_choice,
            "residuals": dict(sorted(r.residuals.items())),
            "narrow_tiles": r.narrow_tiles,
            "launch_s": r.launch_s,
            "corun": r.corun,
            "comm": {k: f.to_dict() for k, f in sorted(self.comm.items())},
            "kappa": c.kappa,
        }
        if c.form == FORM_EQ46:
            params["v_table"] = [{"channels": ch, "buffsize": b, "bytes_per_s": val} for (ch, b), val in sorted(c.v_table.items())]
        else:
            params.update(wave_width=c.wave_width, gpcs=c.gpcs, v_base=c.v_base, v_per_byte=c.v_per_byte, kappa_channel=c.kappa_channel,
                          kappa_traffic=c.kappa_traffic)
        return {
            "family": self.family,
            "form": c.form,
            "simulated": self.simulated,
            "units": {"theta": "seconds of math per wave", "dbytes": "HBM bytes per CTA", "ctas": "CTAs the GEMM's kernel runs (mu_i)",
                      "v_table": "HBM bytes/s taken by communication", "v_base": "HBM bytes/s taken by any running collective",
                      "v_per_byte": "HBM bytes per bus byte communicated", "wave_width": "CTAs at which a partial wave costs a full one",
                      "gpcs": "GPCs channel blocks spread over, each odd one spoiling a TPC (0: a block takes one SM)",
                      "latency_us": "µs", "link_GBps": "GB/s bus bandwidth ceiling", "per_channel_GBps": "GB/s",
                      "pipeline_bytes": "bytes", "warm_gain": "bandwidth gain of a repeated launch served from L2",
                      "l2_bytes": "bytes of L2 a repeated launch can reuse",
                      "kappa": "collective slowdown per unit of the GEMM's memory share (eq4-6) or HBM demand alone (waves-v2)",
                      "kappa_channel": "collective slowdown per channel, as a fraction of the SMs",
                      "kappa_traffic": "collective slowdown per unit of the GEMM's fitted HBM traffic share beside it",
                      "corun": "fraction a shape's math slows whenever a collective runs beside it (waves-v2)",
                      "drag": "collective slowdown a shape adds beyond the shared terms (or all of it: own_drag), at its rate alone (waves-v2)",
                      "kernel_choice": "a shape never measured runs the cheapest candidate kernel (false: 128x128 tiles)",
                      "alone_s": "a measured shape's time alone in seconds, which the model returns as measured (waves-v2; 0: from the terms)",
                      "own_drag": "the drag is all of the slowdown the shape causes, fitted on its own overlapped points (false: beyond the shared terms)",
                      "theta_per_kflop": "seconds of math per wave per kFLOP one CTA computes (shapes never measured)",
                      "d_per_block_byte": "HBM bytes charged per byte of a block's A and B panels (eq4-6, shapes never measured)",
                      "d_per_tile_byte": "HBM bytes charged per byte of a block's C tile (eq4-6, shapes never measured)",
                      "d_per_min_byte": "HBM bytes charged per byte of A and B read and C written once (waves-v2, shapes never measured)",
                      "d_per_reread_byte": "HBM bytes charged per byte the kernel moves beyond that (waves-v2, shapes never measured)",
                      "launch_s": "seconds of launch per GEMM (shapes never measured)",
                      "residuals": "log(measured / regression) of each measured shape, taken by the shapes never measured near it",
                      "narrow_tiles": "the candidate kernels include 128x64 and 64x128 tiles for outputs at most 64 wide",
                      "curve": "the communication curve: steps-rolloff, steps-depth or steps (channels share a link, a handshake per step) or exp-pipeline",
                      "threads_exp": "exp-pipeline: the exponent tau of (threads/512)^tau; steps: how sharply a channel reaches its copy rate at threads_knee",
                      "threads_knee": "threads per channel at which a channel reaches its copy rate (steps)",
                      "saturation": "how sharply the channels' sum meets link_GBps (1: smoothly; large: a hard cap)",
                      "handshake_us": "µs per pipeline step of buffsize/8 (steps)",
                      "rolloff_GBps": "the offered rate at which contention halves what the channels carry (steps-rolloff)",
                      "sensitivity": "factor on the collective's slowdown beside a GEMM for this group (1: as fitted overall)"},
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
                                        gpcs=v.field(p, "gpcs", pp, int, 0, minimum=0),
                                        v_base=v.field(p, "v_base", pp, float), v_per_byte=v.field(p, "v_per_byte", pp, float),
                                        kappa=v.field(p, "kappa", pp, float), kappa_channel=v.field(p, "kappa_channel", pp, float),
                                        kappa_traffic=v.field(p, "kappa_traffic", pp, float, 0.0))
            return cls(
                sms=v.field(dev, "sms", f"{path}.device", int, minimum=1),
                hbm=v.field(dev, "hbm_GBps", f"{path}.device", float, minimum=v.POSITIVE) * 1e9,
                gemms={k: _gemm_fit(k, x, f"{pp}.gemms.{k}") for k, x in gemms.items()},
                new_shapes=ShapeRegression(v.field(p, "theta_per_kflop", pp, float), v.field(p, "d_per_block_byte", pp, float, 0.0),
                                           v.field(p, "d_per_tile_byte", pp, float, 0.0), v.field(p, "launch_s", pp, float, 0.0),
                                           v.field(p, "corun", pp, float, 0.0), v.field(p, "d_per_min_byte", pp, float, 0.0),
                                           v.field(p, "d_per_reread_byte", pp, float, 0.0),
                                           v.field(p, "kernel_choice", pp, bool, False),
                                           _residuals(p.get("residuals", {}), f"{pp}.residuals"),
                                           v.field(p, "narrow_tiles", pp, bool, False)),
                comm={k: CommFit.from_dict(val, f"{pp}.comm.{k}") for k, val in v.field(p, "comm", pp, dict).items()},
                contention=contention, simulated=bool(d.get("simulated", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{pp}: malformed GPU model parameters ({e})") from None


def _residuals(d: Any, path: str) -> dict[str, float]:
    """The shape regression's residuals as ``to_dict`` writes them (absent before 2026-12-01),
    checked: a shape key of positive sides and a known dtype for each, at most
    :data:`MAX_RESIDUAL` either way."""
    residuals = v.number_map(d, path)
    for key, r in residuals.items():
        shape_of_key(key, f"{path}.{key}")
        if abs(r) > MAX_RESIDUAL:
            raise UserError(f"{path}.{key}: {r} is beyond +-{MAX_RESIDUAL} (a shape {math.exp(MAX_RESIDUAL):.0f}x off the regression)")
    return residuals


def shape_of_key(key: str, path: str) -> Gemm:
    """The GEMM a shape key names (``BxMxNxK:dtype``), refused unless every side is at least 1 and
    the dtype is one of :data:`~lagom_tune.workload.spec.DTYPES`.

    Args:
        key: the shape key, as a file holds it.
        path: its field path, for the error.
    Returns:
        The Gemm.
    Raises:
        UserError: one line naming the key.
    """
    try:
        return gemm_of_key(key)
    except ValueError:
        raise UserError(f"{path}: {key!r} is not a GEMM shape (BxMxNxK:dtype, each side at least 1, dtype one of {', '.join(DTYPES)})") from None


def _gemm_fit(key: str, d: Any, path: str) -> GemmFit:
    """A measured shape's terms as ``LagomGpuModel.to_dict`` writes them, checked."""
    d = v.mapping(d, path)
    g = shape_of_key(key, path)
    fit = GemmFit(v.field(d, "theta", path, float, minimum=0.0, maximum=MAX_GEMM_S),
                  v.field(d, "dbytes", path, float, minimum=0.0, maximum=MAX_GEMM_S * MAX_GBPS * 1e9),
                  v.field(d, "ctas", path, int, 0, minimum=0) or blocks(g),  # 0 (or absent): Eq. 4's 128x128 blocks
                  v.field(d, "corun", path, float, 0.0), v.field(d, "drag", path, float, 0.0),
                  v.field(d, "own_drag", path, bool, False), v.field(d, "alone_s", path, float, 0.0, minimum=0.0, maximum=MAX_GEMM_S))
    if fit.theta == 0 and fit.dbytes == 0 and fit.alone == 0:  # a GEMM of no time: the search divided by it
        raise UserError(f"{path}: theta, dbytes and alone_s are all 0; a GEMM takes some time")
    return fit


# ---------------------------------------------------------------------------------------------
# Formulas the model and its fit (``gpu_fit``) share


def channel_bandwidth(xp, link, per_ch, tau, pipe, channels, threads, buffsize):
    """Bus bandwidth (bytes/s) of a collective at ``channels``/``threads``/``buffsize``; ``xp`` is numpy
    (predictions) or torch (the fit's gradients)."""
    ch_bw = per_ch * 1e9 * (threads / 512.0) ** tau
    return link * 1e9 * (1 - xp.exp(-channels * ch_bw / (link * 1e9))) / (1 + pipe / (buffsize / 8.0))


def step_bandwidth(xp, link, per_ch, knee, sharpness, saturation, handshake_us, channels, threads, buffsize,
                   rolloff=math.inf):
    """Bus bandwidth (bytes/s) of the ``steps`` curves: each channel copies at ``per_ch`` GB/s once it
    has ``knee`` threads (a soft minimum of the given sharpness), the channels' sum rolls off as
    ``offered / (1 + offered / rolloff)`` (GB/s; inf: not at all, the curves before ``steps-rolloff``)
    and meets the link as a soft minimum of power ``saturation``, and every step of ``buffsize / 8``
    bytes pays a handshake. ``xp`` is numpy (predictions) or torch (the fit's gradients)."""
    rate = per_ch * 1e9 * _soft_cap(xp, knee / threads, sharpness)
    offered = channels * rate
    offered = offered / (1 + offered / (rolloff * 1e9))
    carried = offered * _soft_cap(xp, offered / (link * 1e9), saturation)
    step_bytes = channels * buffsize / STEPS_PER_BUFFER  # bus bytes moved per round of steps
    return 1 / (1 / carried + handshake_us * 1e-6 / step_bytes)


def short_steps(xp, depth, bus_bytes, channels, buffsize):
    """The pipeline steps a collective takes beyond those its bytes fill (``steps-depth``): ``depth``
    less the steps of ``buffsize / 8`` bytes each of ``channels`` channels moves, at least 0.
    ``xp`` is numpy (predictions) or torch (the fit's gradients)."""
    filled = bus_bytes / (channels * buffsize / STEPS_PER_BUFFER)
    return xp.clip(depth - filled, 0, None) if xp is np else (depth - filled).clamp(min=0)


def _soft_cap(xp, ratio, power):
    """``(1 + ratio ** power) ** (-1 / power)``, the factor of a soft minimum, computed in logs: a
    sharp knee (a large fitted power) overflowed the direct form (``8.0 ** 2000``: OverflowError
    in a prediction) where the factor itself is simply ``1 / ratio``."""
    z = power * xp.log(ratio)
    return xp.exp(-xp.logaddexp(z * 0, z) / power)


def l2_hit_share(xp, l2_bytes, nbytes, channels, buffsize):
    """The share of a repeated launch's reads served from L2: its footprint is the user buffer
    plus a buffer per channel."""
    ratio = l2_bytes / (nbytes + channels * buffsize)
    return (xp.clip(ratio, 0.0, 1.0) if xp is np else ratio.clamp(max=1.0)) ** L2_SHARPNESS
