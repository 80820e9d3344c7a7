"""The single-GPU contention probe: an NCCL channel's footprint without a second GPU.

A persistent Triton kernel of ``channels`` blocks (one per NCCL channel) of ``NCCL_NTHREADS``
threads (512 by default), each copying its share of ``nbytes`` in steps of ``buffsize / 8`` bytes
(NCCL's step with ``NCCL_STEPS`` = 8 slots) into its own 8-slot staging ring, reading a source
slice that wraps around; everything is read and written through HBM. A block moves 32 KiB per
loop iteration (16 words a thread at 512 threads), about what a Simple-protocol channel keeps in
flight, so one block copies like one channel moves data.

Per-block bandwidth, measured on one H200 (2026-11-30, ``bench/results/gpu_check.md``): about 45
GB/s copied (90 GB/s of HBM traffic) per block up to 16 blocks, falling to 26 GB/s at 64 blocks
as HBM saturates (1.65 TB/s copied). NCCL's published per-channel figure on H200 NVLink is about
30 GB/s of bus bandwidth (74/134/234 GB/s busbw at 2/4/8 channels, DESIGN.md §10); a ring
all-reduce step reads the input and the peer's data and writes the peer's buffer, so a channel
causes about three times its busbw in HBM traffic: 90 GB/s, the probe's figure. The previous
probe (4 KiB per iteration) moved 9-14 GB/s per block.

What still differs from NCCL: no peer traffic (no NVLink or network, so no waiting on a peer and
no link contention), no reduction arithmetic, no LL/LL128 flag protocol; and the hardware may
place a probe block beside a GEMM block on one SM. The fit (V per channels and buffer size)
absorbs what it measures; the run folder says ``probe`` wherever it was used.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

WORD = 4  # float32
BLOCK_WORDS = 8192  # words a block moves per loop iteration: 32 KiB in flight, like a Simple channel
SLOTS = 8  # NCCL_STEPS
MAX_SOURCE_BYTES = 256 << 20


@dataclass(frozen=True)
class ProbeGeometry:
    channels: int
    chunk_words: int  # words per step (buffsize / 8)
    steps: int  # steps per channel
    slice_chunks: int  # chunks in a channel's source slice before it wraps

    @property
    def nbytes(self) -> int:
        """Bytes the probe copies in all (what its rows report)."""
        return self.channels * self.steps * self.chunk_words * WORD

    @property
    def source_words(self) -> int:
        return self.channels * self.slice_chunks * self.chunk_words

    @property
    def stage_words(self) -> int:
        return self.channels * SLOTS * self.chunk_words


def probe_geometry(nbytes: int, channels: int, buffsize: int, max_source_bytes: int = MAX_SOURCE_BYTES) -> ProbeGeometry:
    """How ``channels`` blocks copy about ``nbytes`` with NCCL's step size for ``buffsize``.

    Args:
        nbytes: bytes to copy.
        channels: thread blocks, one per channel.
        buffsize: NCCL's staging buffer (a step moves an eighth of it).
        max_source_bytes: the most source memory to allocate (the copy wraps around it).
    Returns:
        The ProbeGeometry.
    Raises:
        ValueError: for no channels or a buffer too small for one step.
    """
    if channels < 1 or buffsize < SLOTS * WORD:
        raise ValueError(f"probe needs channels >= 1 and buffsize >= {SLOTS * WORD} bytes")
    chunk_words = max(BLOCK_WORDS, buffsize // SLOTS // WORD // BLOCK_WORDS * BLOCK_WORDS)
    chunk_bytes = chunk_words * WORD
    steps = max(1, math.ceil(nbytes / (channels * chunk_bytes)))
    slice_chunks = max(1, min(steps, max_source_bytes // (channels * chunk_bytes)))
    return ProbeGeometry(channels, chunk_words, steps, slice_chunks)


def steps_for(target_s: float, trial_steps: int, trial_s: float) -> int:
    """Steps that make the probe last about ``target_s``, scaled from a timed trial.

    Args:
        target_s: the wanted duration.
        trial_steps: the trial's steps.
        trial_s: the trial's duration.
    Returns:
        At least one step.
    """
    return max(1, round(trial_steps * target_s / max(trial_s, 1e-9)))


@functools.cache
def _kernel():
    """The Triton kernel (``probe_kernel.py``), compiled on first use (Triton ships with CUDA builds of torch)."""
    try:
        from lagom_tune.backends.probe_kernel import probe_copy  # local: imports Triton, which a CPU machine may lack
    except ImportError:
        raise RuntimeError("the contention probe needs Triton (CUDA builds of torch ship it; else pip install triton)") from None
    return probe_copy


class Probe:
    """Buffers for one geometry and a launcher on the current CUDA stream."""

    def __init__(self, geometry: ProbeGeometry, threads: int, device):
        import torch

        self.geometry = geometry
        self.warps = max(1, threads // 32)
        self.src = torch.ones(geometry.source_words, dtype=torch.float32, device=device)
        self.stage = torch.empty(geometry.stage_words, dtype=torch.float32, device=device)

    def launch(self, steps: int | None = None, place=None) -> None:
        """Run the copy on the current stream: ``steps`` steps per block (default the geometry's);
        with ``place`` (an int32 tensor of ``channels`` entries) each block also writes its SM's id there."""
        g = self.geometry
        _kernel()[(g.channels,)](self.src, self.stage, steps or g.steps, g.slice_chunks, self.stage if place is None else place,
                                 CHUNK=g.chunk_words, BLOCK=BLOCK_WORDS, PLACE=place is not None, num_warps=self.warps)

    def placement(self) -> list[int]:
        """The SM id (``%smid``) each block ran on, from one launch on an idle device (how the
        block scheduler spreads the probe's blocks before a GEMM is launched beside them)."""
        import torch

        place = torch.full((self.geometry.channels,), -1, dtype=torch.int32, device=self.src.device)
        self.launch(place=place)
        return [int(x) for x in place.cpu()]


@dataclass(frozen=True)
class Placement:
    """How ``blocks`` probe blocks sat on a device's SMs, counted by TPC (two SMs; ``%smid // 2``,
    the pairing NVIDIA's SM numbering is read with, not a documented guarantee).

    Attributes:
        blocks: blocks launched.
        sms_used: distinct SMs they ran on.
        most_per_sm: the most blocks on one SM.
        tpcs_used: TPCs holding at least one block.
        tpcs_half_used: TPCs with blocks on one of their two SMs only (the other idle, yet no use to a
            2-CTA cluster).
        free_tpcs: TPCs holding none: the places left to a GEMM launched in 2-CTA clusters.
    """

    blocks: int
    sms_used: int
    most_per_sm: int
    tpcs_used: int
    tpcs_half_used: int
    free_tpcs: int


def placement_summary(smids: list[int], sms: int) -> Placement:
    """Count where a launch's blocks ran (:meth:`Probe.placement`) on a device of ``sms`` SMs.

    Args:
        smids: each block's SM id.
        sms: the device's SMs.
    Returns:
        The Placement.
    Raises:
        ValueError: for a negative SM id (a block that recorded none).
    """
    if any(s < 0 for s in smids):
        raise ValueError(f"{sum(1 for s in smids if s < 0)} of {len(smids)} blocks recorded no SM id")
    per_sm = Counter(smids)
    sms_per_tpc = Counter(sm // 2 for sm in per_sm)
    return Placement(len(smids), len(per_sm), max(per_sm.values(), default=0), len(sms_per_tpc),
                     sum(1 for n in sms_per_tpc.values() if n == 1), sms // 2 - len(sms_per_tpc))
