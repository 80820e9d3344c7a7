"""The SIMULATED GPU's communication: NCCL's channels as pipelines of fixed-size steps over a
shared link, and what a GEMM beside them takes away. A mechanism, not the fitted model's
saturating curve (model/gpu.py): the model has to earn its accuracy on it.

* **A channel** is one CTA of ``threads`` threads (LL128's: its own 640) that moves the collective's data in steps of
  ``buffsize / 8`` bytes (NCCL's Simple step; LL and LL128 move payload plus flags, at 50% and
  ~94% efficiency). A step costs its bytes at the channel's copy rate (at most
  ``Cluster.per_channel``, less with fewer threads) plus the protocol's per-step handshake.
* **The link** (NVLink, PCIe or InfiniBand between nodes) caps the channels' sum: each channel
  gets an equal share of it once they would exceed it.
* **Algorithms**: a ring all-reduce runs ``2 (n - 1)`` steps per chunk, all-gather and
  reduce-scatter ``n - 1``, a tree all-reduce ``2 log2 n`` with 10% more per-step work inside a node
  (reduction and broadcast both on NVLink); a collective takes at least those steps, each
  paying its handshake (no separate pipeline-fill term). A step is an eighth of the protocol's
  buffer: NCCL_BUFFSIZE sizes Simple's only; LL's and LL128's are NCCL's own (524,288 and
  4,915,200 B, flags included, ``nccl_knobs.PROTOCOL_BUFFERS``), so their times do not move with buffsize (until
  2026-12-03 every protocol's step was buffsize/8, an audit's finding).
* **NVLS** (NVLink SHARP, Hopper's NVSwitch; all-reduce within a node, Simple only): the switch
  reduces. Each rank's 1/n of the buffer is loaded reduced from every rank's memory and stored
  back to all of them by multicast, so a rank sends and receives ``S (1 + 1/n)`` bytes of an
  ``S``-byte all-reduce (NVIDIA/nccl#1083), not the ring's ``2 S (n - 1) / n``, at a rate
  calibrated to NCCL's ~480 GB/s busbw on 8xH100 (:data:`NVLS_ALL_REDUCE_BUSBW`), reached at
  NCCL's 16 NVLS channels and shared evenly below that. Its HBM traffic is the rank's buffer read
  once by the switch and written once by the multicast: ``2 S``.
* **HBM**: a collective reads and writes its data through HBM (a ring or tree all-reduce about 3
  bytes per byte on the bus, others 2). Beside a GEMM it gets its share of the bandwidth left and
  waits longer per step as HBM's queue fills.

Calibrated from published figures, cited in :data:`REFERENCE_BUSBW` and DESIGN.md §10 (8xH200
all-reduce with CTAs capped), and checked against them in ``tests/test_sim_observations.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from lagom_tune.backends.nccl_knobs import channel_run, cluster_offers_ll128, pipeline_steps, sized_by
from lagom_tune.backends.sim_clusters import GB, Cluster
from lagom_tune.backends.sim_compute import hbm_share, latency_beside

LAUNCH_S = 5.0e-6  # a collective's launch and first handshake
PROTOCOLS = {  # payload efficiency, per-step handshake (s)
    "ll": (0.5, 0.6e-6),
    "ll128": (0.94, 1.2e-6),
    "simple": (1.0, 3.5e-6),
}
STEPS_PER_BUFFER = 8  # NCCL splits a channel's buffer into 8 steps
THREADS_FULL_RATE = 256  # a channel CTA reaches its full copy rate from this many threads
TREE_WORK = 1.1  # a tree step reduces and broadcasts: more work per byte than a ring step
HBM_PER_BUS_BYTE = {"all_reduce": 3.0}  # others 2: read once, write once
# NCCL's NVLS channels on Hopper (comm->nvlsChannels, NCCL_NVLS_NCHANNELS): its source says NVLS
# "should not need more than 16 channels to get peak BW"; a tuner's channel count overrides it.
NVLS_CHANNELS = 16
# Bytes/s per direction NVLS's multimem loads and stores move on NVLink 4, from the published busbw
# (NVLS_ALL_REDUCE_BUSBW, below): busbw = 2 (n - 1) / n * S / t and t = S (1 + 1/n) / carried, so on
# 8 GPUs 480 GB/s is 309 GB/s carried; at NCCL's 16 NVLS channels and 4 MiB buffers each channel
# also pays Simple's handshake per 512 KiB step, so the rate before it is 354 GB/s of the 450 line.
_NVLS_CARRIED = 480 * GB * 9 / 14
_NVLS_STEP = (4 << 20) / STEPS_PER_BUFFER
NVLS_RATE = NVLS_CHANNELS * _NVLS_STEP / (_NVLS_STEP / (_NVLS_CARRIED / NVLS_CHANNELS) - PROTOCOLS["simple"][1])
IB = {100: 12.5 * GB, 400: 50 * GB}  # per GPU, one NIC each


@dataclass(frozen=True)
class Link:
    """What one collective's channels share: bytes/s, and whether it leaves the node."""

    rate: float
    inter_node: bool


def link_of(c: Cluster, nodes: int, ib_gbps: int) -> Link:
    """The link a collective across ``nodes`` nodes runs on."""
    return Link(c.link, False) if nodes <= 1 else Link(min(c.link, IB[ib_gbps]), True)


def channel_rate(c: Cluster, threads: int) -> float:
    """Bytes/s one channel CTA copies with ``threads`` threads."""
    return c.per_channel * min(1.0, threads / THREADS_FULL_RATE)


def comm_seconds(c: Cluster, op: str, bus_bytes: float, ranks: int, link: Link, s: Mapping[str, Any],
                 gemm_hbm: float = 0.0) -> float:
    """A collective's time: its bus bytes through ``channels`` pipelines sharing ``link``.

    Args:
        c: the simulated device.
        op: the collective.
        bus_bytes: bytes each rank moves on the bus (nccl-tests' busbw times time).
        ranks: communicator size.
        link: what its channels share.
        s: its settings (algo, proto, channels, threads, buffsize).
        gemm_hbm: bytes/s of HBM a GEMM running beside it draws (0 alone).

    Returns:
        Seconds.
    """
    eff, handshake = PROTOCOLS[s["proto"]]
    channels = int(s["channels"])
    algo = s["algo"]
    if s["proto"] == "ll128" and not cluster_offers_ll128(c):
        raise ValueError(f"NCCL does not offer LL128 on {c.name} (compute capability {c.compute_capability}, "
                         f"{'NVLink' if c.nvlink else 'not NVLink between every pair'})")
    if algo == "nvls":
        if not c.nvls or link.inter_node or op != "all_reduce" or s["proto"] != "simple":
            raise ValueError(f"NVLS runs all-reduce, Simple, within one node of an NVSwitch Hopper; not {op} {s['proto']} on {c.name}")
        wire = bus_bytes * nvls_wire_per_bus_byte(ranks)
        rate = min(channels * NVLS_RATE / NVLS_CHANNELS * min(1.0, int(s["threads"]) / THREADS_FULL_RATE), NVLS_RATE) / channels
    else:
        wire = bus_bytes
        rate = channel_share(c, link, channels, int(channel_run(s["proto"], s["threads"], s["buffsize"])[0])) * eff
    if algo == "tree" and not link.inter_node:
        rate /= TREE_WORK
    if gemm_hbm:
        # Beside a GEMM: HBM is shared (max-min fair, as for the GEMM) and its latency grows with
        # the GEMM's traffic, which slows a channel's copies (bytes in flight over latency) and
        # its handshakes alike.
        need = rate * channels * hbm_per_wire_byte(op, algo, ranks)
        rate /= copy_slowdown(c, need, gemm_hbm)
        handshake *= latency_beside(c, need, gemm_hbm)
    per_channel_bytes = wire / channels
    n_steps = max(math.ceil(per_channel_bytes / step_payload(s["proto"], int(s["buffsize"]))), pipeline_steps(op, algo, ranks))
    return LAUNCH_S + n_steps * (per_channel_bytes / n_steps / rate + handshake)


def step_payload(proto: str, buffsize: int) -> float:
    """Payload bytes one step of a channel moves: an eighth of the protocol's buffer, less its flags."""
    payload = 1.0 if sized_by(proto, "buffsize") else PROTOCOLS[proto][0]  # NCCL's own buffers hold the flags too
    return channel_run(proto, 0, buffsize)[1] / STEPS_PER_BUFFER * payload


def copy_slowdown(c: Cluster, need: float, gemm_hbm: float) -> float:
    """How much slower channels copying ``need`` bytes/s of HBM traffic run beside a GEMM drawing
    ``gemm_hbm``: their share of HBM, and the latency of each copy (bytes in flight over latency)."""
    return need / hbm_share(need, gemm_hbm, c.hbm_effective) * latency_beside(c, need, gemm_hbm)


def channel_share(c: Cluster, link: Link, channels: int, threads: int) -> float:
    """Bytes/s each of ``channels`` channels moves: their copy rates, slowed by contention in the
    switch fabric (``1 / (1/sum + 1/fabric)``) and capped by the link."""
    offered = channels * channel_rate(c, threads)
    carried = offered / (1 + offered / c.fabric) if math.isfinite(c.fabric) else offered
    return min(carried, link.rate) / channels


def nvls_wire_per_bus_byte(ranks: int) -> float:
    """Bytes an NVLS all-reduce sends (and receives) per rank per bus byte: ``S (1 + 1/n)`` over
    ``2 S (n - 1) / n``."""
    return (ranks + 1) / (2 * max(ranks - 1, 1))


def hbm_per_wire_byte(op: str, algo: str, ranks: int) -> float:
    """HBM bytes per byte a rank sends: NVLS's ``2 S`` (its buffer read once by the switch,
    written once by the multicast) for the ``S (1 + 1/n)`` it sends; otherwise a ring or tree
    all-reduce 3 (read, reduce into, write), the rest 2."""
    return 2 * ranks / (ranks + 1) if algo == "nvls" else HBM_PER_BUS_BYTE.get(op, 2.0)


def hbm_draw(op: str, algo: str, ranks: int, bus_bytes: float, seconds: float) -> float:
    """Bytes/s of HBM the collective draws while it runs."""
    wire = bus_bytes * (nvls_wire_per_bus_byte(ranks) if algo == "nvls" else 1.0)
    return wire / max(seconds, 1e-12) * hbm_per_wire_byte(op, algo, ranks)


@dataclass(frozen=True)
class PublishedBusbw:
    """A published nccl-tests bus bandwidth and the run it was measured in: ``ops`` on ``ranks``
    GPUs of one node at ``nbytes``, with NCCL's defaults but the ring (bytes/s)."""

    lo: float
    hi: float
    source: str
    ranks: int = 8
    nbytes: int = 1 << 30
    ops: tuple[str, ...] = ("all_reduce", "all_gather")


# Published bus bandwidths of ring collectives with NCCL's other defaults, the observations the
# simulated links and channels are calibrated from (tested in tests/test_sim_observations.py). On
# Hopper with NVSwitch, NCCL's default all-reduce is NVLink SHARP (NVLS): :data:`NVLS_ALL_REDUCE_BUSBW`,
# which :data:`NVLS_RATE` is calibrated from.
REFERENCE_BUSBW = {
    # A user's A40s with NVLink bridges (github.com/NVIDIA/nccl-tests issue 74, 2021-03-05, NCCL
    # 2.8.3): on the four GPUs of one socket (two bridged pairs, PCIe P2P between them),
    # all_reduce_perf at 32 MiB reads an average busbw "a bit higher than ~36.6" GB/s (the top read
    # here as at most 10% higher). The only published A40 collective found; the simulated node is
    # eight such GPUs (its link solved for AutoCCL's gain, which this figure does not see: NCCL's
    # 8 default channels fall short of the link). The thread does not say how many channels NCCL
    # ran; read at the 8 Lagom gives as NCCL's default on its A40 NVLink nodes (DESIGN.md §10).
    "a40-nvlink": PublishedBusbw(36.6 * GB, 40.3 * GB, "4xA40 with NVLink bridges, one socket, NCCL 2.8.3: all_reduce_perf "
                                 "32 MiB busbw a bit above ~36.6 GB/s (NVIDIA/nccl-tests issue 74)",
                                 ranks=4, nbytes=32 << 20, ops=("all_reduce",)),
    "a100-nvlink": PublishedBusbw(230 * GB, 250 * GB, "8xA100 SXM4 NVLink 3, nccl-tests all_reduce_perf at large sizes: 230-250 "
                                  "GB/s (docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests)"),
    # NCCL's maintainer: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an
    # effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running
    # non-allreduce operations, or when running with NCCL_ALGO=RING" (github.com/NVIDIA/nccl-tests
    # issue 212, 2024-05-06); a user's 8xH100 with NVLS disabled: 368.76 GB/s (issue 309, 2025-05-23).
    # (Until 2026-12-03 this held the NVLS figure, 460-480, against the simulated ring.)
    "h100-nvlink": PublishedBusbw(370 * GB, 370 * GB, "8xH100 SXM5 NVLink 4, nccl-tests ring (NCCL_ALGO=RING or non-all-reduce "
                                  "ops): ~370 GB/s busbw (NVIDIA/nccl-tests issues 212 and 309)"),
    "h200-nvlink": PublishedBusbw(370 * GB, 370 * GB, "8xH200 NVLink 4, as H100 (the same NVLink 4 and NVSwitch; the sources "
                                  "give H100)"),
}
NVLS_ALL_REDUCE_BUSBW = (480 * GB, "8xH100, NCCL's default all-reduce (NVLS) at large sizes: peak busbw ~480 GB/s "
                         "(algbw ~275; NVIDIA/nccl-tests issue 212); NVLS for 2 MB-16 GB on 8 GPUs (issue 309)")
