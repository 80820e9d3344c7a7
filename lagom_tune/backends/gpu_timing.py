"""The one way the nccl backend times GPU work (DESIGN.md §10, "GPU timing rule").

A quantity and its baseline are timed the same way: the same ``n`` back-to-back launches on the
same stream, the baseline right before the quantity, so slow drift (clocks, temperature) cancels.
Launches shorter than :data:`GRAPH_BELOW_US` are captured once in a CUDA graph and replayed, so the
CPU's launch gaps (10-20 µs per ``torch.matmul``) never enter a figure; longer ones are launched
directly. Every timed run starts behind a short GPU sleep, so the CPU has queued the whole run
before the GPU reaches the start event, and lasts at least :data:`RUN_S` (:func:`launch_count`):
a GEMM point, the probe alone, and a shape's overlapped job (its GEMMs are the GEMM point's
launches), so a GEMM point and that job's baseline are one measurement.

A GEMM's back-to-back launches multiply different copies of A and B (:func:`operand_sets`), enough
to span three times the L2, so each reads its operands from HBM as in a training step, where other
kernels run between two uses of a weight (on one pair, the H200 ran MPT-7B's ``4x128x2048x2048`` at
4.7 TB/s of the bytes it must move, above the 4.26 TB/s it copies: partly from L2).

NCCL collectives are never captured: capturing one ties every rank's replay together and needs
the communicator set up for capture. They are launched directly (one collective is long enough
to hide its launch behind the spacer), alone and overlapped alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from lagom_tune.workload.spec import DTYPES, Gemm

GRAPH_BELOW_US = 50.0  # launches shorter than this are replayed from a captured CUDA graph
RUN_S = 1e-3  # a timed run lasts at least this long (it pays a few to tens of µs once; see launch_count)
MAX_LAUNCHES = 1000  # ... in at most this many launches (the nodes of one CUDA graph)
SPACER_CYCLES = 100_000  # ~50 µs of GPU sleep at 2 GHz: time for the CPU to queue a run

CACHE_SPAN = 3  # a GEMM's rotated operands span at least this many times the L2 (a launch finds none of its own there)
MAX_OPERAND_SETS = 64  # ... in at most this many copies (a GEMM of a few MB spans 3x a 50 MB L2 with ~64)
OPERANDS = f"rotated past {CACHE_SPAN}x the L2"  # how GEMM points are timed, as the run's fingerprint says

GRAPHED, STREAMED = "graph", "stream"


def launch_count(one_s: float) -> int:
    """Back-to-back launches in a timed run of work that takes ``one_s`` seconds once: enough to last
    :data:`RUN_S`, at most :data:`MAX_LAUNCHES`. A run pays a cost once (20-70 µs on the H200 for
    1-3 directly launched GEMMs, less for a graph) that 1 ms amortises: on 2026-11-30 the H200's
    runs of 200 µs made GEMM points of Llama-3-8B's 90-700 µs GEMMs 8-37% slower than the same
    shapes' 1 ms baselines, and probe points of 2-10 launches 3-9% slower than the bandwidth curve
    fitted to runs of one long launch.

    Args:
        one_s: one launch's seconds.
    Returns:
        The launch count, at least 1.
    """
    return max(1, min(MAX_LAUNCHES, round(RUN_S / one_s)))


def operand_sets(g: Gemm, cache_bytes: int) -> int:
    """Copies of A and B that back-to-back launches of ``g`` cycle through, so that none finds its
    operands in the cache the launch before filled: enough to span :data:`CACHE_SPAN` times the
    cache, one when A and B alone exceed that, at most :data:`MAX_OPERAND_SETS`.

    Args:
        g: the GEMM.
        cache_bytes: the device's last-level cache (a GPU's L2) in bytes.
    Returns:
        The number of operand sets, at least 1.
    """
    ab = (g.m * g.k + g.k * g.n) * g.batch * DTYPES[g.dtype]
    return max(1, min(MAX_OPERAND_SETS, math.ceil(CACHE_SPAN * cache_bytes / ab)))


@dataclass
class Launches:
    """``n`` back-to-back launches of one callable: replayed from a CUDA graph or launched directly.

    Calling it enqueues the whole run on the current stream and returns at once.
    """

    fn: Callable[[], Any]
    n: int
    graph: Any = None  # torch.cuda.CUDAGraph when captured

    @property
    def how(self) -> str:
        """``"graph"`` or ``"stream"``: recorded in every row timed with it."""
        return GRAPHED if self.graph is not None else STREAMED

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.n):
                self.fn()


def launches(torch: Any, fn: Callable[[], Any], n: int, per_launch_us: float, capturable: bool = True) -> Launches:
    """``n`` launches of ``fn``, captured in a CUDA graph when each is shorter than ``GRAPH_BELOW_US``.

    Args:
        torch: the torch module (a fake one in CPU tests; without ``cuda.CUDAGraph`` nothing is captured).
        fn: one launch (it must have run once already, so libraries have set up their workspaces).
        n: launches per run.
        per_launch_us: a measured time of one launch.
        capturable: False for work that must not be captured (NCCL collectives).

    Returns:
        The replayable run.
    """
    graph_cls = getattr(torch.cuda, "CUDAGraph", None)
    if not capturable or graph_cls is None or per_launch_us >= GRAPH_BELOW_US:
        return Launches(fn, n)
    graph = graph_cls()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()  # the first replay uploads the graph; keep it out of every figure
    torch.cuda.synchronize()
    return Launches(fn, n, graph)


def spacer(torch: Any) -> None:
    """Keep the current stream busy ~50 µs so the CPU queues a timed run before the GPU starts it.

    Args:
        torch: the torch module (a fake in tests); nothing is done without ``torch.cuda._sleep``.
    """
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SPACER_CYCLES)


def events(torch: Any) -> tuple[Any, Any]:
    """A pair of timing events.

    Args:
        torch: the torch module.
    Returns:
        Two ``torch.cuda.Event(enable_timing=True)``.
    """
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_run(torch: Any, run: Callable[[], None]) -> float:
    """Microseconds ``run`` takes on the current stream, measured with CUDA events behind a spacer.

    Args:
        torch: the torch module.
        run: launches the work (on the current stream).
    Returns:
        The elapsed microseconds.
    """
    start, end = events(torch)
    spacer(torch)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


@dataclass(frozen=True)
class Overlapped:
    """One overlapped run: both streams start at the same event; each end is timed from it."""

    compute_us: float
    comm_us: float


def time_overlapped(torch: Any, compute: Callable[[], None], comm: Callable[[], None], side: Any) -> Overlapped:
    """``comm`` on the ``side`` stream and ``compute`` on the current one, released by one event.

    Args:
        torch: the torch module.
        compute: launches the computation (current stream).
        comm: launches the communication (on ``side``).
        side: the side stream.
    Returns:
        When each stream finished, in microseconds from the common start.
    """
    start, comp_end = events(torch)
    _, comm_end = events(torch)
    spacer(torch)
    start.record()
    side.wait_event(start)
    with torch.cuda.stream(side):
        comm()
        comm_end.record()
    compute()
    comp_end.record()
    torch.cuda.synchronize()
    return Overlapped(start.elapsed_time(comp_end) * 1e3, start.elapsed_time(comm_end) * 1e3)
