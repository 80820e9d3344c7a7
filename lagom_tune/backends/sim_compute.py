"""The SIMULATED GPU's computation: GEMM kernels as tiles scheduled on SMs, and what channel blocks
running beside them take away. A mechanism, not a formula: nothing here is the fitted model's
equations (model/gpu.py), so the model has to earn its accuracy on what this produces.

The mechanism, per device (calibrated on one H200, 2026-11-30, ``tests/data/h200-2026-11-30``:
the constants below from its GEMM times and slowdown pattern, the L2 and HBM-latency ones, which
no data sheet gives, in ``sim_clusters.MemoryCalibration`` by ``bench/calibrate_sim.py``; other
devices scaled by their SMs, HBM bandwidth and peak TFLOP/s):

* **Kernel choice.** Like cuBLAS, the kernel is chosen once, alone: among tile shapes
  (:data:`TILES`, and :data:`NARROW_TILES` for an output at most 64 wide) and split-K factors,
  the one with the shortest time on an idle device. NCCL's
  blocks arriving later do not change that choice, which is where wave quantisation bites.
* **A persistent grid.** The kernel launches ``min(CTAs, SMs - GRID_SPARE)`` CTAs; CTA ``j`` owns
  tiles ``j, j + grid, ...`` (a static schedule). One CTA fills an SM (registers and shared
  memory), so an SM holding a channel block cannot host one: CTAs that find no SM wait until a
  CTA finishes all its tiles. One CTA pushed out of a one-wave kernel doubles it.
* **A tile's time** is the longer of its math (``2 tm tn k`` at the SM's rate, smaller tiles at a
  lower efficiency) and its HBM traffic at the SM's share of the bandwidth left, plus a fixed
  prologue/epilogue. Tiles running together share operand panels through L2 (in-wave reuse);
  a later wave finds panels an earlier one loaded (cross-wave reuse) unless a collective
  streaming through L2 has evicted them; no reuse reads less than A and B once (a batch of GEMMs
  one tile wide shares nothing).
* **Beside communication** the GEMM loses the SMs of the channel blocks, the HBM bandwidth the
  collective draws (shared in proportion to demand once the two ask more than HBM gives), L2
  panels the collective evicts as its share of bandwidth grows, and time to HBM latency, which
  rises as the collective's traffic joins the GEMM's in the memory queue.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from lagom_tune.backends.sim_clusters import Cluster
from lagom_tune.workload.spec import DTYPES, Gemm

TILES = ((128, 256), (256, 128), (128, 128))  # cuBLAS's Hopper bf16 tile shapes
# ... and for an output at most NARROW wide (a 128-wide tile would compute at least half zeros):
# 64-wide tiles (cuBLAS's kernel names carry the tile: ampere_bf16_s16816gemm_bf16_128x64_...,
# sm90_..._tilesize128x64x64_...)
NARROW = 64
NARROW_TILES = ((128, NARROW), (NARROW, 128))
# A smaller tile's math rate: it loads more operand bytes per FLOP (tm tn / (tm + tn): 85, 64 and
# 43 FLOP per element loaded); 128x128's 0.86 is assumed, the narrow tiles' 0.70 follows it (the
# same power, 0.52, of that ratio).
TILE_EFFICIENCY = {(128, 256): 1.0, (256, 128): 1.0, (128, 128): 0.86, (128, NARROW): 0.70, (NARROW, 128): 0.70}
SPLITS = (1, 2, 4)  # split-K factors for short, deep GEMMs
PERSISTENT_WAVES = 2  # kernels of at most this many waves run a persistent grid; larger ones one CTA per tile
SPARE_SLOTS = 1  # a persistent grid leaves one slot (a TPC on Hopper) idle
LAUNCH_S = 3.0e-6  # kernel launch and ramp, back to back on one stream (H200: 8 us for the smallest GEMMs)
CORUN_LAUNCH_S = 1.5e-6  # a launch waits for the block dispatcher while another kernel holds SMs (H200: small GEMMs +1-2 us beside one block)
TILE_FIXED_S = 0.6e-6  # per tile: prologue (first k-panel) and epilogue (C written)
SPLIT_REDUCE_BYTES = 4  # a split-K partial tile is written and read back in fp32


@dataclass(frozen=True)
class Kernel:
    """The kernel chosen for a GEMM: its tile, split-K factor and grid."""

    tile: tuple[int, int]
    split: int
    tiles: int  # work units: output tiles times the split
    grid: int  # CTAs launched: a persistent grid, or one per tile
    persistent: bool

    def groups(self, cluster: int) -> int:
        """Co-scheduled groups of ``cluster`` CTAs its grid launches."""
        return math.ceil(self.grid / cluster)

    def shares(self, cluster: int) -> list[int]:
        """Tiles per co-scheduled group of ``cluster`` CTAs under the static schedule (CTA j owns
        tiles j, j + grid, ...); a group lasts as long as its busiest CTA. Smallest first: CTAs are
        dispatched in no order their shares know, so a group that waits owns a typical (the
        largest) share, not the remainder."""
        base, extra = divmod(self.tiles, self.grid)
        ctas = [base + (1 if j < extra else 0) for j in range(self.grid)]
        return sorted(max(ctas[i:i + cluster]) for i in range(0, len(ctas), cluster))


@dataclass(frozen=True)
class Contention:
    """What a running collective takes from a GEMM beside it."""

    blocks: int = 0  # channel blocks resident on SMs (one SM each)
    hbm: float = 0.0  # bytes/s of HBM bandwidth the collective asks for
    evicts_l2: bool = False  # it streams through L2, so a wave finds nothing the previous one loaded


IDLE = Contention()


def slots(c: Cluster, blocks: int, cluster: int) -> int:
    """Places a kernel's groups of ``cluster`` CTAs can run while ``blocks`` channel blocks hold SMs.

    One CTA per SM (a GEMM CTA takes an SM's registers and shared memory). The block scheduler
    spreads the channel blocks across GPCs and packs them within one; a block spoils the TPC (two
    SMs) it sits on for a thread-block cluster of two, two blocks share one TPC.
    """
    if cluster == 1:
        return max(1, c.sms - blocks)
    per_gpc = [blocks // c.gpcs + (1 if g < blocks % c.gpcs else 0) for g in range(c.gpcs)]
    spoiled = sum(math.ceil(b / cluster) for b in per_gpc)
    return max(1, c.sms // cluster - spoiled)


def _tile_counts(g: Gemm, tile: tuple[int, int]) -> int:
    return math.ceil(g.m / tile[0]) * math.ceil(g.n / tile[1]) * g.batch


def tile_seconds(c: Cluster, g: Gemm, kernel: Kernel, running: int, load: Contention = IDLE) -> tuple[float, float]:
    """One tile's time on one SM while ``running`` CTAs run together, and the HBM bandwidth those
    CTAs draw.

    Args:
        c: the simulated device.
        g: the GEMM.
        kernel: its chosen kernel.
        running: CTAs running at once (they share HBM bandwidth).
        load: what a collective beside it takes.

    Returns:
        (seconds per tile, bytes/s the GEMM draws from HBM).
    """
    tm, tn = kernel.tile
    k = g.k / kernel.split
    dt = DTYPES[g.dtype]
    waves = max(1.0, kernel.tiles / running)
    # The first wave misses; later ones find part of their panels in L2. A collective streaming
    # through L2 evicts panels in proportion to its traffic; CTAs launched wave after wave (not a
    # persistent grid, which prefetches its next tile's panels) lose the cross-wave hits outright.
    cal, cap = c.memory, c.hbm_effective
    misses = 1 - cal.cross_wave_hits * (1 - 1 / waves)
    if load.evicts_l2:
        misses += cal.eviction_per_utilisation * min(1.0, load.hbm / cap) ** cal.eviction_power
        if not kernel.persistent:
            misses = max(misses, cal.evicted_misses)
    math_s = 2 * tm * tn * k / (c.tflops / c.sms * TILE_EFFICIENCY[kernel.tile])
    out = tm * tn * (SPLIT_REDUCE_BYTES * 2 if kernel.split > 1 else dt)
    # L2 saves re-reads, never the first: no tile reads less than its share of A and B read once
    # (a batch of GEMMs one tile wide has nothing to share).
    operands = max((tm + tn) * k * dt * misses / cal.in_wave_reuse, (g.m + g.n) * g.k * g.batch * dt / kernel.tiles)
    wave_bytes = (operands + out) * running
    # A miss stalls for HBM's latency, which grows as the collective's traffic joins the GEMM's own
    # in the queue in front of HBM.
    latency = latency_beside(c, wave_bytes / (math_s + TILE_FIXED_S), load.hbm)
    math_s *= 1 + cal.miss_stall * misses * latency
    demand = wave_bytes / (math_s + TILE_FIXED_S)
    got = hbm_share(demand, load.hbm, cap)
    tile_s = max(math_s, wave_bytes / got) + TILE_FIXED_S
    return tile_s, wave_bytes / tile_s


def queue_latency(c: Cluster, drawn: float) -> float:
    """HBM latency, relative to an idle device's, while ``drawn`` bytes/s of traffic queue for it."""
    rho = min(c.memory.max_utilisation, drawn / c.hbm_effective)
    return 1 + c.memory.queue_delay * rho / (1 - rho)


def latency_beside(c: Cluster, own: float, other: float) -> float:
    """HBM latency seen by a requester drawing ``own`` bytes/s once another draws ``other`` beside
    it, relative to its latency alone (its own traffic is part of its time alone)."""
    return queue_latency(c, own + other) / queue_latency(c, own) if other else 1.0


def hbm_share(demand: float, other: float, cap: float) -> float:
    """Bytes/s a requester asking ``demand`` gets beside one asking ``other``: all it asks while
    the sum fits, else a share in proportion to what it asks (requests in flight win slots in the
    memory controllers' queues in proportion to their number)."""
    return min(demand, cap) if demand + other <= cap else cap * demand / (demand + other)


def _makespan(shares: list[int], places: int, tile_s: float) -> float:
    """Static shares list-scheduled on ``places``: groups start in order as places free up."""
    if len(shares) <= places:
        return max(shares) * tile_s
    free = [share * tile_s for share in shares[:places]]
    heapq.heapify(free)
    for share in shares[places:]:
        heapq.heappush(free, heapq.heappop(free) + share * tile_s)
    return max(free)


@dataclass(frozen=True)
class Condition:
    """How a kernel's CTAs run under one load: what the co-simulation of a kernel beside a
    collective that starts or ends part way through (``sim_overlap.py``) steps through."""

    places: int  # groups of CTAs that can run at once
    tile_s: float  # one tile's seconds on one SM
    drawn: float  # HBM bytes/s the running CTAs draw
    launch_s: float  # from launch to the first CTA running


@lru_cache(maxsize=65536)
def condition(c: Cluster, g: Gemm, kernel: Kernel, load: Contention = IDLE) -> Condition:
    """How ``kernel`` runs beside ``load`` (idle: alone)."""
    places = slots(c, load.blocks, c.cta_cluster)
    running = min(min(kernel.groups(c.cta_cluster), places) * c.cta_cluster, kernel.tiles)
    tile_s, drawn = tile_seconds(c, g, kernel, running, load)
    return Condition(places, tile_s, drawn, LAUNCH_S + (CORUN_LAUNCH_S if load.blocks else 0.0))


def group_shares(c: Cluster, kernel: Kernel) -> list[tuple[int, int]]:
    """Tiles each group of co-scheduled CTAs owns, in the order groups are dispatched, as runs of
    ``(tiles, groups)``: a persistent grid's static shares, or one tile per CTA of a grid of one
    CTA per tile (one run however many tiles)."""
    if kernel.persistent:
        return [(tiles, len(list(same))) for tiles, same in itertools.groupby(kernel.shares(c.cta_cluster))]
    return [(1, kernel.groups(c.cta_cluster))]


def kernel_run(c: Cluster, g: Gemm, kernel: Kernel, load: Contention = IDLE) -> tuple[float, float]:
    """A kernel alone (``load`` idle) or beside a collective for all of its run: its seconds, and
    the HBM bytes/s it draws while it runs (what the collective beside it competes with)."""
    run = condition(c, g, kernel, load)
    if kernel.persistent:
        return run.launch_s + _makespan(kernel.shares(c.cta_cluster), run.places, run.tile_s), run.drawn
    return run.launch_s + math.ceil(kernel.groups(c.cta_cluster) / run.places) * run.tile_s, run.drawn  # full waves of free places


@lru_cache(maxsize=4096)
def choose_kernel(c: Cluster, g: Gemm) -> Kernel:
    """The kernel a library would pick for ``g``: the fastest candidate on an idle device."""
    best: tuple[float, Kernel] | None = None
    persistent_grid = (c.sms // c.cta_cluster - SPARE_SLOTS) * c.cta_cluster
    for tile in TILES + (NARROW_TILES if min(g.m, g.n) <= NARROW else ()):
        out_tiles = _tile_counts(g, tile)
        for split in SPLITS:
            if split > 1 and (out_tiles * split > PERSISTENT_WAVES * persistent_grid or g.k // split < 512):
                continue
            tiles = out_tiles * split
            persistent = tiles <= PERSISTENT_WAVES * persistent_grid
            kernel = Kernel(tile, split, tiles, min(tiles, persistent_grid) if persistent else tiles, persistent)
            t, _ = kernel_run(c, g, kernel)
            if best is None or t < best[0] * (1 - 1e-9):
                best = (t, kernel)
    assert best is not None
    return best[1]


@lru_cache(maxsize=65536)
def gemm_run(c: Cluster, g: Gemm, load: Contention = IDLE) -> tuple[float, float]:
    """A GEMM on the simulated device, alone or beside a collective for all of its run (a pure
    function of frozen inputs, asked for the same GEMM and load many times).

    Args:
        c: the simulated device.
        g: the GEMM.
        load: SMs, HBM bandwidth and L2 a collective running beside it takes.

    Returns:
        (seconds, HBM bytes/s it draws while it runs).
    """
    return kernel_run(c, g, choose_kernel(c, g), load)
