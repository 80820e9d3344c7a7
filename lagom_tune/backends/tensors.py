"""Torch tensors for a measurement, on any device: GEMM operands, collective buffers, and a value
agreed across ranks. Shared by the gloo backend's ranks and the nccl backend's workers."""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from lagom_tune.backends.gpu_timing import operand_sets
from lagom_tune.workload.spec import Gemm

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def operands(g: Gemm, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random A and B for ``g`` (batched when ``g.batch > 1``).

    Args:
        g: the GEMM (shape and dtype).
        device: where to allocate them.
    Returns:
        A (m x k) and B (k x n), with a leading batch dimension when ``g.batch > 1``.
    """
    dt = TORCH_DTYPES[g.dtype]
    shape_a = (g.batch, g.m, g.k) if g.batch > 1 else (g.m, g.k)
    shape_b = (g.batch, g.k, g.n) if g.batch > 1 else (g.k, g.n)
    return torch.randn(shape_a, dtype=dt, device=device), torch.randn(shape_b, dtype=dt, device=device)


def rotating_matmul(g: Gemm, device: Any, cache_bytes: int) -> Callable[[], torch.Tensor]:
    """A launcher of ``g`` that multiplies the next of ``gpu_timing.operand_sets`` copies of A and B
    at each call (a CUDA graph captured over ``n`` calls replays them in that order).

    Args:
        g: the GEMM.
        device: where the operands live.
        cache_bytes: the device's last-level cache in bytes.
    Returns:
        A function that launches one GEMM and returns its product.
    """
    sets = itertools.cycle([operands(g, device) for _ in range(operand_sets(g, cache_bytes))])

    def launch() -> torch.Tensor:
        a, b = next(sets)
        return torch.matmul(a, b)

    return launch


def buffer(nbytes: int) -> torch.Tensor:
    """A CPU fp32 buffer of about ``nbytes`` (at least one element) for a collective.

    Args:
        nbytes: the collective's size in bytes.
    Returns:
        The zeroed tensor.
    """
    return torch.zeros(max(1, nbytes // 4), dtype=torch.float32)


def slowest_rank(dist: Any, values: tuple[float, ...], device: Any = "cpu") -> tuple[float, ...]:
    """Each of ``values`` at its maximum over the ranks (so every rank sizes a measurement alike).

    Args:
        dist: ``torch.distributed``, with a process group.
        values: this rank's values.
        device: where the group's tensors live.
    Returns:
        The maxima, in order.
    """
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(float(v) for v in t.tolist())
