"""Workloads generated from a model's architecture and a parallelism, never hand-typed numbers.

Each builder derives GEMM shapes from the transformer's dimensions and collective sizes from its
parameter counts, so a preset can be checked against the model it describes (tests compare the
``cpu-demo`` preset with ``examples/train_gpt.py``'s real parameter count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lagom_tune.errors import UserError
from lagom_tune.workload.spec import DTYPES, Collective, Gemm, OverlapGroup, Workload


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer, as a GPT-2-style block (LayerNorm, biased linears, GELU MLP)."""

    name: str
    hidden: int
    ffn: int
    heads: int
    layers: int
    vocab: int
    max_seq: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _linear_backward(name: str, tokens: int, fan_in: int, fan_out: int, dtype: str) -> tuple[Gemm, Gemm]:
    """dX = dY @ W  (tokens x fan_in, reduced over fan_out); dW = dY^T @ X (fan_out x fan_in, reduced over tokens)."""
    return (
        Gemm(f"{name}.dgrad", tokens, fan_in, fan_out, dtype),
        Gemm(f"{name}.wgrad", fan_out, fan_in, tokens, dtype),
    )


def gpt_ddp(arch: Arch, *, seq: int, mbs: int, ranks: int, dtype: str = "fp32", grad_dtype: str = "fp32") -> Workload:
    """Data-parallel (DDP) training of ``arch``: forward, then backward with gradient all-reduces.

    One all-reduce per parameter tensor (biases and LayerNorms ride with the weight beside them),
    issued once its weight-gradient GEMM is done: DDP's bucketing (``bucket_cap_mb``) coalesces
    these, which the search models as a communicator-level knob.
    """
    if seq > arch.max_seq:
        raise UserError(f"--seq {seq} exceeds {arch.name}'s context of {arch.max_seq}")
    d, f, t, h = arch.hidden, arch.ffn, seq * mbs, arch.heads
    gb = DTYPES[grad_dtype]

    fwd: list[Gemm] = []
    for layer in range(arch.layers):
        p = f"L{layer}"
        fwd += [
            Gemm(f"{p}.qkv", t, 3 * d, d, dtype),
            Gemm(f"{p}.scores", seq, seq, arch.head_dim, dtype, batch=mbs * h),
            Gemm(f"{p}.context", seq, arch.head_dim, seq, dtype, batch=mbs * h),
            Gemm(f"{p}.proj", t, d, d, dtype),
            Gemm(f"{p}.fc1", t, f, d, dtype),
            Gemm(f"{p}.fc2", t, d, f, dtype),
        ]
    fwd.append(Gemm("head", t, arch.vocab, d, dtype))

    bwd: list[Gemm] = []
    grads: list[tuple[str, int, int]] = []  # (tensor name, parameter count, index of the GEMM that readies it)

    def linear(name: str, fan_in: int, fan_out: int, extra_params: int) -> None:
        bwd.extend(_linear_backward(name, t, fan_in, fan_out, dtype))
        grads.append((name, fan_in * fan_out + extra_params, len(bwd) - 1))

    linear("head", d, arch.vocab, 2 * d)  # + final LayerNorm
    for layer in reversed(range(arch.layers)):
        p = f"L{layer}"
        linear(f"{p}.fc2", f, d, d)
        linear(f"{p}.fc1", d, f, f + 2 * d)  # + fc1 bias + ln2
        linear(f"{p}.proj", d, d, d)
        bwd += [
            Gemm(f"{p}.scores.dgrad_p", seq, seq, arch.head_dim, dtype, batch=mbs * h),
            Gemm(f"{p}.context.dgrad_v", seq, arch.head_dim, seq, dtype, batch=mbs * h),
            Gemm(f"{p}.scores.dgrad_q", seq, arch.head_dim, seq, dtype, batch=mbs * h),
            Gemm(f"{p}.scores.dgrad_k", seq, arch.head_dim, seq, dtype, batch=mbs * h),
        ]
        linear(f"{p}.qkv", d, 3 * d, 3 * d + 2 * d)  # + qkv bias + ln1
    # Token and position embeddings have no GEMM: their gradients are ready after the last one.
    grads.append(("embeddings", (arch.vocab + arch.max_seq) * d, len(bwd) - 1))

    comm = tuple(
        Collective(f"grad.{name}", "all_reduce", n * gb, group="dp", ranks=ranks, after=idx) for name, n, idx in grads
    )
    return Workload(
        name=f"{arch.name}-ddp{ranks}",
        groups=(
            OverlapGroup("forward", tuple(fwd)),
            OverlapGroup("backward", tuple(bwd), comm),
        ),
        meta={
            "model": arch.name,
            "parallel": f"ddp={ranks}",
            "seq": seq,
            "mbs": mbs,
            "dtype": dtype,
            "parameters": sum(n for _, n, _ in grads),
            "note": "GEMMs and gradient all-reduces only; element-wise ops and the optimizer step are not modelled",
        },
    )


# The example training script's model (examples/train_gpt.py defaults); a test keeps them equal.
CPU_DEMO_ARCH = Arch("tiny-gpt", hidden=256, ffn=1024, heads=4, layers=4, vocab=8192, max_seq=128)


@dataclass(frozen=True)
class Preset:
    description: str
    build: Callable[..., Workload]


def _cpu_demo(seq: int | None = None, mbs: int | None = None, ranks: int | None = None, **_: Any) -> Workload:
    w = gpt_ddp(CPU_DEMO_ARCH, seq=seq or 128, mbs=mbs or 4, ranks=ranks or 2)
    return Workload("cpu-demo", w.groups, w.exposed_ms, {**w.meta, "preset": "cpu-demo"})


PRESETS: dict[str, Preset] = {
    "cpu-demo": Preset("tiny GPT (4 layers, d=256) trained with DDP on 2 gloo ranks: the `make demo` workload", _cpu_demo),
}


def build_preset(name: str, **shape: Any) -> Workload:
    if name not in PRESETS:
        raise UserError(f"unknown workload {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name].build(**{k: val for k, val in shape.items() if val is not None})
