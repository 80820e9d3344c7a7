"""Workloads generated from a model's architecture and a parallelism, never hand-typed numbers.

Every GEMM shape is derived from the transformer's dimensions and the run shape (tokens per
micro-batch ``T = mbs * seq``); every collective size from parameter or activation counts, in
the nccl-tests convention (the full buffer: all-gather output, reduce-scatter input, all-reduce
buffer, all-to-all send buffer). Derivations, per layer:

* attention: QKV projection ``T x (d + 2*kv*hd) x d``; scores ``(mbs*h) x [seq x seq x hd]``;
  context ``(mbs*h) x [seq x hd x seq]``; output projection ``T x d x d`` (``h``, ``kv`` and the
  projections' output dimension divided by the tensor-parallel degree).
* MLP: gated (SwiGLU) ``T x 2f x d`` then ``T x d x f``; plain ``T x f x d`` then ``T x d x f``.
* MoE: a router ``T x E x d``; each rank runs its ``E/ep`` experts on ``T*top_k*ep/E`` tokens each
  (uniform routing), as a batched GEMM; shared experts are a dense MLP of ``shared * f_e``.
* backward: every forward GEMM ``m x n x k`` becomes a data-gradient ``m x k x n`` and a
  weight-gradient ``n x k x m`` GEMM (attention's two batched GEMMs each become two).

Iteration structure per parallelism (DESIGN.md §4; each an overlap group):

* ``ddp=N``: forward, then backward with one gradient all-reduce per parameter tensor issued when
  its weight gradient is ready (``bucket_cap_mb`` coalesces them, see bucketing.py).
* ``fsdp=N``: layer ``l+1``'s all-gather (its parameters, compute dtype) overlaps layer ``l``'s
  forward; in backward, layer ``l-1``'s all-gather and layer ``l``'s gradient reduce-scatter (in the
  reduce dtype: by default the compute dtype, as FSDP2's ``MixedPrecisionPolicy`` with only
  ``param_dtype`` set; torchtitan reduces in fp32) overlap layer ``l-1``'s backward. Embedding and
  head run without overlap.
* ``fsdp=N,dp=M``: HSDP, as FSDP2 and torchtitan run it: FSDP within each group of ``N``
  consecutive ranks, replicated ``M`` times (a rank's replicas ``N`` ranks apart); after each
  layer's reduce-scatter, an all-reduce of its gradient shard (``1/N`` of the layer, reduce
  dtype) across the ``M`` replicas (``dp_replicate``), beside the same backward.
* ``tp=N,dp=M``: Megatron tensor parallelism with Domino-style overlap: the micro-batch (even) is
  split in two halves and one half's all-reduce (``T/2 x d`` activations, after attention and
  after the MLP, forward and backward) overlaps the other half's GEMMs, and the other way round:
  every phase twice a layer; with ``dp > 1`` each layer's gradient all-reduce (by default fp32, as
  Megatron reduces bf16 training's gradients) on the data-parallel communicator, over as many nodes as the
  job has (``tp x dp`` GPUs), overlaps one half's backward attention.
* ``fsdp=N,tp=M``: torchtitan's 2-D parallelism: tensor parallelism with sequence parallelism
  within each block of ``M`` consecutive ranks, FSDP2 over the ``N`` blocks (each layer's ``1/M``
  tp shard, norms whole). A layer's all-gathers of the sequence-sharded input and reduce-scatters
  of the output (``T x d`` activations, around attention and around the MLP, mirrored in backward)
  sit on the critical path in groups of their own; FSDP's all-gather and reduce-scatter overlap
  the layer's GEMMs as under ``fsdp=N``. ``fsdp=N,tp=M,dp=K``: 3-D, HSDP over the 2-D blocks:
  each layer's gradient shard all-reduced across the ``K`` replicas as under ``fsdp=N,dp=K``.
* ``ep=N``: expert parallelism; a micro-batch's dispatch and combine all-to-alls (``T*top_k x d``
  per rank) overlap the other micro-batch's expert GEMMs, forward and backward; attention and
  router are data-parallel and run without overlap.

Element-wise ops, norms, the loss and the optimizer step are not modelled.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from lagom_tune.errors import UserError
from lagom_tune.workload.spec import DTYPES, MAX_RANKS, Collective, Gemm, OverlapGroup, Workload, load_workload

GPUS_PER_NODE = 8  # the nodes presets lay communicators over, and every simulated cluster's

# Communicator roles, named as torchtitan names its DeviceMesh dimensions, so that a plan's roles
# are the mesh dimensions whose groups the runtime shim gives their settings (README, "apply").
DP_REPLICATE = "dp_replicate"  # replicated data parallelism: DDP's (and HSDP's) gradient all-reduce
DP_SHARD = "dp_shard"  # sharded data parallelism: FSDP's all-gathers and reduce-scatters
TP = "tp"  # tensor parallelism
EP = "ep"  # expert parallelism

# The dtype a family reduces gradients in when --reduce-dtype is not given, as its framework does
# by default (None: the compute dtype). DDP and FSDP2 reduce in the gradients' (the parameters')
# dtype; Megatron accumulates and all-reduces bf16/fp16 training's gradients in fp32
# (accumulate_allreduce_grads_in_fp32). Expert parallelism models no gradient reduction.
REDUCE_DTYPE_DEFAULT: dict[str, str | None] = {"ddp": None, "fsdp": None, "fsdp+tp": None, "tp": "fp32"}


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer."""

    name: str
    hidden: int
    ffn: int
    heads: int
    layers: int
    vocab: int
    max_seq: int
    kv_heads: int | None = None  # grouped-query attention; None: same as heads
    gated: bool = False  # SwiGLU MLP (three matrices)
    bias: bool = True  # biases on linears
    tied_embeddings: bool = False
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    norms: int = 2  # norms a layer holds: one before attention and one before the MLP (phi-2's parallel block shares one)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def attention_params(self) -> int:
        d, hd = self.hidden, self.head_dim
        qkv_out = d + 2 * self.kv * hd
        return d * qkv_out + d * d + (qkv_out + d if self.bias else 0)

    def mlp_params(self, ffn: int) -> int:
        mats = 3 if self.gated else 2
        return mats * self.hidden * ffn + ((2 if self.gated else 1) * ffn + self.hidden if self.bias else 0)

    def norm_params(self) -> int:
        """Parameters of a layer's norms: LayerNorm's weight and bias, or RMSNorm's weight, each."""
        return self.norms * (2 * self.hidden if self.bias else self.hidden)

    def is_moe_layer(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.dense_layers

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of one transformer layer (what FSDP gathers per layer)."""
        if self.is_moe_layer(layer):
            mlp = self.experts * self.mlp_params(self.expert_ffn) + self.hidden * self.experts
            if self.shared_experts:
                mlp += self.mlp_params(self.shared_experts * self.expert_ffn)
        else:
            mlp = self.mlp_params(self.ffn)
        return self.attention_params() + mlp + self.norm_params()


def _bwd(g: Gemm) -> tuple[Gemm, Gemm]:
    """Data gradient (m x k, reduced over n) and weight gradient (n x k, reduced over m)."""
    return (replace(g, name=f"{g.name}.dgrad", n=g.k, k=g.n), replace(g, name=f"{g.name}.wgrad", m=g.n, n=g.k, k=g.m))


def _attn_bwd(g: Gemm) -> tuple[Gemm, Gemm]:
    """A batched attention GEMM's two input gradients."""
    return (replace(g, name=f"{g.name}.grad_a", n=g.k, k=g.n), replace(g, name=f"{g.name}.grad_b", m=g.k, n=g.n, k=g.m))


def attention_gemms(a: Arch, prefix: str, seq: int, mbs: int, dtype: str, tp: int = 1) -> list[Gemm]:
    """The forward GEMMs of one attention block (QKV, scores, context, output projection).

    Args:
        a: the architecture.
        prefix: the GEMMs' name prefix (``L3``).
        seq: sequence length.
        mbs: micro-batch size.
        dtype: the GEMMs' dtype.
        tp: tensor-parallel degree (heads split over it).
    Returns:
        The GEMMs, in order.
    Raises:
        UserError: when the heads do not split over ``tp``.
    """
    t, d, hd = seq * mbs, a.hidden, a.head_dim
    if a.heads % tp or a.kv % tp and a.kv >= tp:
        raise UserError(f"{a.name}: {a.heads} heads ({a.kv} KV heads) do not split over tp={tp}")
    h, kv = a.heads // tp, max(1, a.kv // tp)
    return [
        Gemm(f"{prefix}.qkv", t, (h + 2 * kv) * hd, d, dtype),
        Gemm(f"{prefix}.scores", seq, seq, hd, dtype, batch=mbs * h),
        Gemm(f"{prefix}.context", seq, hd, seq, dtype, batch=mbs * h),
        Gemm(f"{prefix}.out", t, d, h * hd, dtype),
    ]


def mlp_gemms(a: Arch, prefix: str, tokens: int, ffn: int, dtype: str, tp: int = 1, batch: int = 1) -> list[Gemm]:
    """The forward GEMMs of one MLP (up, gated when the architecture is, and down).

    Args:
        a: the architecture.
        prefix: the GEMMs' name prefix.
        tokens: tokens through it.
        ffn: its hidden size.
        dtype: the GEMMs' dtype.
        tp: tensor-parallel degree (``ffn`` split over it).
        batch: experts run as one batched GEMM.
    Returns:
        The GEMMs, in order.
    """
    f = ffn // tp
    up = 2 * f if a.gated else f
    return [Gemm(f"{prefix}.up", tokens, up, a.hidden, dtype, batch), Gemm(f"{prefix}.down", tokens, a.hidden, f, dtype, batch)]


def layer_gemms(a: Arch, layer: int, seq: int, mbs: int, dtype: str, tp: int = 1, ep: int = 1) -> list[Gemm]:
    """The forward GEMMs of one transformer layer (attention, then MLP or routed experts).

    Args:
        a: the architecture.
        layer: the layer's index.
        seq: sequence length.
        mbs: micro-batch size.
        dtype: the GEMMs' dtype.
        tp: tensor-parallel degree.
        ep: expert-parallel degree.
    Returns:
        The GEMMs, in order.
    """
    p = f"L{layer}"
    gemms = attention_gemms(a, p, seq, mbs, dtype, tp)
    t = seq * mbs
    if a.is_moe_layer(layer):
        gemms.append(Gemm(f"{p}.router", t, a.experts, a.hidden, dtype))
        gemms += moe_expert_gemms(a, p, t, dtype, ep)
        if a.shared_experts:
            gemms += mlp_gemms(a, f"{p}.shared", t, a.shared_experts * a.expert_ffn, dtype)
    else:
        gemms += mlp_gemms(a, f"{p}.mlp", t, a.ffn, dtype, tp)
    return gemms


def moe_expert_gemms(a: Arch, prefix: str, tokens: int, dtype: str, ep: int) -> list[Gemm]:
    """The GEMMs of one rank's experts, as one batched MLP.

    Args:
        a: the architecture.
        prefix: the GEMMs' name prefix.
        tokens: tokens entering the layer on this rank.
        dtype: the GEMMs' dtype.
        ep: expert-parallel degree.
    Returns:
        The GEMMs.
    Raises:
        UserError: when the experts do not split over ``ep``.
    """
    if a.experts % ep:
        raise UserError(f"{a.name}: {a.experts} experts do not split over ep={ep}")
    per_expert = max(1, tokens * a.top_k * ep // a.experts)
    return mlp_gemms(a, f"{prefix}.experts", per_expert, a.expert_ffn, dtype, batch=a.experts // ep)


def backward_of(gemms: list[Gemm]) -> list[Gemm]:
    """The backward GEMMs of ``gemms``: each one's two gradients, in reverse order.

    Args:
        gemms: forward GEMMs, in order.
    Returns:
        The backward GEMMs, in order.
    """
    out: list[Gemm] = []
    for g in reversed(gemms):
        out.extend(_attn_bwd(g) if g.batch > 1 and (".scores" in g.name or ".context" in g.name) else _bwd(g))
    return out


def nodes_spanned(ranks: int, gpus_per_node: int = GPUS_PER_NODE) -> int:
    """The fewest nodes of ``gpus_per_node`` ranks that hold ``ranks`` consecutive ranks (at least one)."""
    return max(1, -(-ranks // gpus_per_node))


def replica_nodes(group: int, replicas: int) -> int:
    """The nodes a data-parallel group of ``replicas`` ranks spans when each replica is a block of
    ``group`` consecutive ranks (its tp or fsdp group): a rank's replicas sit ``group`` ranks
    apart, on other nodes as far as the job has nodes (a tp=4,dp=2 job fits one node, and its dp
    group with it)."""
    return min(replicas, nodes_spanned(group * replicas))


def replicated_gradients(params: int, element: int, ranks: int, block: int, replicas: int) -> tuple[Collective, ...]:
    """HSDP's all-reduce of each reduce-scatter's output across the replicas (none without them).

    Args:
        params: parameters the reduce-scatter reduces.
        element: bytes of one, in the reduce dtype.
        ranks: ranks it scatters over: its output is one rank's share (FSDP2 pads each to a whole one).
        block: consecutive ranks one replica holds (its fsdp group, or its fsdp x tp block).
        replicas: replicas of the block (dp_replicate's degree).
    Returns:
        The all-reduce, or nothing for one replica.
    """
    if replicas < 2:
        return ()
    return (Collective("all_reduce.replicate_grads", "all_reduce", -(-params // ranks) * element, group=DP_REPLICATE, ranks=replicas,
                       nodes=replica_nodes(block, replicas)),)


# ---------------------------------------------------------------------------------------------
# Parallelisms


def gpt_ddp(arch: Arch, *, seq: int, mbs: int, ranks: int, dtype: str = "fp32", reduce_dtype: str | None = None) -> Workload:
    """Data-parallel (DDP) training: forward, then backward with per-tensor gradient all-reduces.

    Models a GPT-2-style block (LayerNorm, biased linears, GELU MLP), as examples/train_gpt.py.

    Args:
        arch: the architecture.
        seq: sequence length.
        mbs: micro-batch size.
        ranks: data-parallel ranks.
        dtype: the GEMMs' dtype.
        reduce_dtype: the gradient all-reduces' dtype (None: ``dtype``).
    Returns:
        The Workload.
    """
    _check_seq(arch, seq)
    d, f, t = arch.hidden, arch.ffn, seq * mbs
    gb = DTYPES[reduce_dtype or dtype]

    fwd: list[Gemm] = []
    for layer in range(arch.layers):
        fwd += attention_gemms(arch, f"L{layer}", seq, mbs, dtype) + mlp_gemms(arch, f"L{layer}.mlp", t, f, dtype)
    fwd.append(Gemm("head", t, arch.vocab, d, dtype))

    bwd: list[Gemm] = []
    grads: list[tuple[str, int, int]] = []  # (tensor, parameter count, index of the GEMM that readies it)

    def linear(g: Gemm, extra_params: int) -> None:
        bwd.extend(_bwd(g))
        grads.append((g.name, g.n * g.k + extra_params, len(bwd) - 1))

    linear(Gemm("head", t, arch.vocab, d, dtype), 2 * d)  # + final LayerNorm
    for layer in reversed(range(arch.layers)):
        qkv, scores, context, out = attention_gemms(arch, f"L{layer}", seq, mbs, dtype)
        up, down = mlp_gemms(arch, f"L{layer}.mlp", t, f, dtype)
        linear(down, d)
        linear(up, f + 2 * d)  # + bias + ln2
        linear(out, d)
        bwd += [*_attn_bwd(context), *_attn_bwd(scores)]
        linear(qkv, 3 * d + 2 * d)  # + bias + ln1
    # Token and position embeddings have no GEMM: their gradients are ready after the last one.
    grads.append(("embeddings", (arch.vocab + arch.max_seq) * d, len(bwd) - 1))

    comm = tuple(Collective(f"grad.{name}", "all_reduce", n * gb, group=DP_REPLICATE, ranks=ranks, nodes=nodes_spanned(ranks), after=idx)
                 for name, n, idx in grads)
    return Workload(
        name=f"{arch.name}-ddp{ranks}",
        groups=(OverlapGroup("forward", tuple(fwd)), OverlapGroup("backward", tuple(bwd), comm)),
        meta={"model": arch.name, "parallel": f"ddp={ranks}", "world": ranks, "seq": seq, "mbs": mbs, "dtype": dtype,
              "reduce_dtype": reduce_dtype or dtype, "parameters": sum(n for _, n, _ in grads)},
    )


def fsdp(arch: Arch, *, seq: int, mbs: int, ranks: int, dp: int = 1, dtype: str = "bf16",
         reduce_dtype: str | None = None) -> Workload:
    """FSDP (ZeRO-3): per-layer all-gather prefetch in forward and backward, reduce-scatter of
    gradients; with ``dp > 1``, HSDP: each shard's gradients all-reduced across the replicas.

    Args:
        arch: the architecture.
        seq: sequence length.
        mbs: micro-batch size.
        ranks: sharding ranks.
        dp: replicas of the sharded group (HSDP; 1: plain FSDP).
        dtype: the GEMMs' and all-gathers' dtype.
        reduce_dtype: the gradient reductions' dtype (None: ``dtype``).
    Returns:
        The Workload.
    """
    _check_seq(arch, seq)
    b, t, nodes = DTYPES[dtype], seq * mbs, nodes_spanned(ranks)
    rb = DTYPES[reduce_dtype or dtype]
    groups = []
    # Layers differ only in MoE models (dense leading layers); group identical layers.
    for kind, layers in _layer_kinds(arch).items():
        lp = arch.layer_params(layers[0])
        fwd = tuple(layer_gemms(arch, layers[0], seq, mbs, dtype))
        ag = Collective("all_gather.next_layer", "all_gather", lp * b, group=DP_SHARD, ranks=ranks, nodes=nodes)
        rs = Collective("reduce_scatter.grads", "reduce_scatter", lp * rb, group=DP_SHARD, ranks=ranks, nodes=nodes)
        replicas = replicated_gradients(lp, rb, ranks, ranks, dp)
        groups.append(OverlapGroup(f"forward.{kind}", fwd, (ag,), repeat=len(layers)))
        groups.append(OverlapGroup(f"backward.{kind}", tuple(backward_of(list(fwd))),
                                   (replace(ag, name="all_gather.prev_layer"), rs, *replicas), repeat=len(layers)))
    head = Gemm("head", t, arch.vocab, arch.hidden, dtype)
    groups.append(OverlapGroup("head", (head, *_bwd(head))))
    return _workload(arch, {"fsdp": ranks, **({"dp": dp} if dp > 1 else {})}, groups, seq, mbs, dtype, reduce_dtype or dtype)


def tensor_parallel(arch: Arch, *, seq: int, mbs: int, tp: int, dp: int = 1, dtype: str = "bf16",
                    reduce_dtype: str | None = REDUCE_DTYPE_DEFAULT["tp"]) -> Workload:
    """Megatron TP with Domino-style overlap of one half-batch's all-reduce with the other's GEMMs.

    Args:
        arch: the architecture.
        seq: sequence length.
        mbs: micro-batch size.
        tp: tensor-parallel degree.
        dp: data-parallel degree (gradient all-reduces across it).
        dtype: the GEMMs' and activation all-reduces' dtype.
        reduce_dtype: the gradient all-reduces' dtype (None: ``dtype``).
    Returns:
        The Workload.
    """
    _check_seq(arch, seq)
    if arch.experts:
        raise UserError(f"{arch.name} is an MoE model: use --parallel ep=N")
    if mbs < 2 or mbs % 2:  # an odd micro-batch lost a sample to mbs // 2
        raise UserError(f"tensor parallelism with Domino overlap splits the micro-batch in two halves: --mbs must be even (got {mbs})")
    b, half = DTYPES[dtype], mbs // 2
    act = seq * half * arch.hidden * b  # one half-batch's activations
    ar = lambda name: Collective(name, "all_reduce", act, group=TP, ranks=tp, nodes=nodes_spanned(tp))
    attn = attention_gemms(arch, "L", seq, half, dtype, tp)
    mlp = mlp_gemms(arch, "L.mlp", seq * half, arch.ffn, dtype, tp)
    # Each layer runs every phase twice, once per half-batch (one half's GEMMs beside the other's
    # all-reduce, then the other way round): 2 x layers (the groups held one half, so an iteration
    # was half its real time beside a full-size gradient all-reduce).
    twice = 2 * arch.layers
    groups = [
        OverlapGroup("forward.attention", tuple(attn), (ar("all_reduce.attn_out.other_half"),), repeat=twice),
        OverlapGroup("forward.mlp", tuple(mlp), (ar("all_reduce.mlp_out.other_half"),), repeat=twice),
        OverlapGroup("backward.mlp", tuple(backward_of(mlp)), (ar("all_reduce.mlp_in_grad.other_half"),), repeat=twice),
    ]
    bwd_attn = tuple(backward_of(attn))
    if dp > 1:  # the layer's gradients, once per layer, beside its second half-batch's backward attention
        shard = arch.layer_params() // tp
        grad_bytes = DTYPES[reduce_dtype or dtype]
        dp_grads = Collective("all_reduce.dp_grads", "all_reduce", shard * grad_bytes, group=DP_REPLICATE, ranks=dp,
                              nodes=replica_nodes(tp, dp))
        groups.append(OverlapGroup("backward.attention", bwd_attn, (ar("all_reduce.attn_in_grad.other_half"),), repeat=arch.layers))
        groups.append(OverlapGroup("backward.attention.dp_grads", bwd_attn, (ar("all_reduce.attn_in_grad.other_half.dp"), dp_grads),
                                   repeat=arch.layers))
    else:
        groups.append(OverlapGroup("backward.attention", bwd_attn, (ar("all_reduce.attn_in_grad.other_half"),), repeat=twice))
    head = Gemm("head", seq * mbs, arch.vocab // tp, arch.hidden, dtype)
    groups.append(OverlapGroup("head", (head, *_bwd(head))))
    return _workload(arch, {"tp": tp, "dp": dp}, groups, seq, mbs, dtype, (reduce_dtype or dtype) if dp > 1 else None)


def fsdp_tensor_parallel(arch: Arch, *, seq: int, mbs: int, ranks: int, tp: int, dp: int = 1, dtype: str = "bf16",
                         reduce_dtype: str | None = None) -> Workload:
    """torchtitan's 2-D parallelism: tensor parallelism with sequence parallelism within each block
    of ``tp`` consecutive ranks, FSDP2 over the ``ranks`` blocks (mesh ``dp_shard`` x ``tp``).

    Each layer's four sequence-parallel collectives (all-gather of the sequence-sharded input and
    reduce-scatter of the output, around attention and around the MLP; mirrored in backward), and
    the embedding's and the head's, sit on the critical path: without async TP the GEMMs wait for
    them, so they run in groups of their own. FSDP's all-gathers (the layer's tp shard, compute dtype) and reduce-scatters overlap the
    layer's GEMMs as in ``fsdp``; their overlap with the TP collectives is not modelled (an upper
    bound on the iteration: FSDP's collectives share no time with TP's). With ``dp > 1``, 3-D
    (mesh ``dp_replicate`` x ``dp_shard`` x ``tp``): HSDP over the 2-D blocks, each layer's
    reduce-scatter output all-reduced across the replicas beside the same backward.

    Args:
        arch: the architecture.
        seq: sequence length.
        mbs: micro-batch size.
        ranks: sharding ranks (the dp_shard degree).
        tp: tensor-parallel degree.
        dp: replicas of the sharded 2-D block (dp_replicate; 1: 2-D).
        dtype: the GEMMs', all-gathers' and TP collectives' dtype.
        reduce_dtype: FSDP's gradient reductions' dtype (None: ``dtype``).
    Returns:
        The Workload.
    Raises:
        UserError: for an MoE model (its experts: use ep=N) or heads that do not split over ``tp``.
    """
    _check_seq(arch, seq)
    if arch.experts:
        raise UserError(f"{arch.name} is an MoE model: use --parallel ep=N")
    b, rb, layers = DTYPES[dtype], DTYPES[reduce_dtype or dtype], arch.layers
    norms = arch.norm_params()  # sequence parallelism keeps the norms whole on every tp rank
    shard = -(-(arch.layer_params() - norms) // tp) + norms  # what FSDP gathers of a layer on one tp rank
    nodes = replica_nodes(tp, ranks)
    ag = Collective("all_gather.next_layer", "all_gather", shard * b, group=DP_SHARD, ranks=ranks, nodes=nodes)
    rs = Collective("reduce_scatter.grads", "reduce_scatter", shard * rb, group=DP_SHARD, ranks=ranks, nodes=nodes)
    replicas = replicated_gradients(shard, rb, ranks, ranks * tp, dp)
    act = seq * mbs * arch.hidden * b  # the whole sequence's activations: all-gather output, reduce-scatter input
    sp = lambda name, op: Collective(name, op, act, group=TP, ranks=tp, nodes=nodes_spanned(tp))
    fwd = layer_gemms(arch, 0, seq, mbs, dtype, tp)
    head = Gemm("head", seq * mbs, arch.vocab // tp, arch.hidden, dtype)  # the output projection, vocab-parallel
    groups = [
        OverlapGroup("forward.layer", tuple(fwd), (ag,), repeat=layers),
        OverlapGroup("forward.layer.tp", (), (sp("all_gather.attention_in", "all_gather"), sp("reduce_scatter.attention_out", "reduce_scatter"),
                                              sp("all_gather.mlp_in", "all_gather"), sp("reduce_scatter.mlp_out", "reduce_scatter")),
                     repeat=layers),
        OverlapGroup("backward.layer", tuple(backward_of(fwd)), (replace(ag, name="all_gather.prev_layer"), rs, *replicas), repeat=layers),
        OverlapGroup("backward.layer.tp", (), (sp("all_gather.mlp_out_grad", "all_gather"), sp("reduce_scatter.mlp_in_grad", "reduce_scatter"),
                                               sp("all_gather.attention_out_grad", "all_gather"),
                                               sp("reduce_scatter.attention_in_grad", "reduce_scatter")),
                     repeat=layers),
        OverlapGroup("head", (head, *_bwd(head))),
        # the vocab-parallel embedding's output reduce-scattered to sequence shards (its gradient
        # gathered in backward), the head's input gathered (its gradient reduce-scattered)
        OverlapGroup("embedding_and_head.tp", (), (sp("reduce_scatter.embedding_out", "reduce_scatter"), sp("all_gather.head_in", "all_gather"),
                                                   sp("reduce_scatter.head_in_grad", "reduce_scatter"),
                                                   sp("all_gather.embedding_out_grad", "all_gather"))),
    ]
    return _workload(arch, {"fsdp": ranks, "tp": tp, **({"dp": dp} if dp > 1 else {})}, groups, seq, mbs, dtype, reduce_dtype or dtype)


def expert_parallel(arch: Arch, *, seq: int, mbs: int, ep: int, dtype: str = "bf16") -> Workload:
    """Expert parallelism: one micro-batch's dispatch/combine all-to-alls beside the other's expert GEMMs.

    Args:
        arch: the architecture.
        seq: sequence length.
        mbs: micro-batch size.
        ep: expert-parallel degree.
        dtype: the GEMMs' and collectives' dtype.
    Returns:
        The Workload.
    """
    _check_seq(arch, seq)
    if not arch.experts:
        raise UserError(f"{arch.name} has no experts: use --parallel fsdp=N or tp=N")
    b, t = DTYPES[dtype], seq * mbs
    a2a = lambda name: Collective(name, "all_to_all", t * arch.top_k * arch.hidden * b, group=EP, ranks=ep, nodes=nodes_spanned(ep))
    moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.layers))
    experts = moe_expert_gemms(arch, "L", t, dtype, ep)
    attn = attention_gemms(arch, "L", seq, mbs, dtype) + [Gemm("L.router", t, arch.experts, arch.hidden, dtype)]
    groups = [
        OverlapGroup("forward.experts", tuple(experts), (a2a("all_to_all.dispatch.other_mb"), a2a("all_to_all.combine.other_mb")), repeat=moe_layers),
        OverlapGroup("backward.experts", tuple(backward_of(experts)), (a2a("all_to_all.combine_grad.other_mb"), a2a("all_to_all.dispatch_grad.other_mb")), repeat=moe_layers),
        OverlapGroup("attention", tuple(attn + backward_of(attn)), repeat=arch.layers),
    ]
    if arch.shared_experts:
        shared = mlp_gemms(arch, "L.shared", t, arch.shared_experts * arch.expert_ffn, dtype)
        groups.append(OverlapGroup("shared_experts", tuple(shared + backward_of(shared)), repeat=moe_layers))
    if arch.dense_layers:
        dense = mlp_gemms(arch, "L.mlp", t, arch.ffn, dtype)
        groups.append(OverlapGroup("dense_mlp", tuple(dense + backward_of(dense)), repeat=arch.dense_layers))
    return _workload(arch, {"ep": ep}, groups, seq, mbs, dtype)


def _layer_kinds(arch: Arch) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {}
    for i in range(arch.layers):
        kinds.setdefault("moe_layer" if arch.is_moe_layer(i) else "layer", []).append(i)
    return kinds


def _check_seq(arch: Arch, seq: int) -> None:
    if seq > arch.max_seq:
        raise UserError(f"--seq {seq} exceeds {arch.name}'s context of {arch.max_seq}")


def _workload(arch: Arch, degrees: dict[str, int], groups: list[OverlapGroup], seq: int, mbs: int, dtype: str,
              reduce_dtype: str | None = None) -> Workload:
    """The preset's workload, named and described by its ``degrees`` in order (``{"fsdp": 8, "dp": 2}``:
    ``<model>-fsdp8-dp2``, ``--parallel fsdp=8,dp=2``, a world of 16 ranks)."""
    reduced = {"reduce_dtype": reduce_dtype} if reduce_dtype else {}  # a workload that reduces gradients says in what
    return Workload(f"{arch.name}-{'-'.join(f'{k}{n}' for k, n in degrees.items())}", tuple(groups),
                    meta={"model": arch.name, "parallel": ",".join(f"{k}={n}" for k, n in degrees.items()),
                          "world": math.prod(degrees.values()), "seq": seq, "mbs": mbs, "dtype": dtype, **reduced,
                          "layer_parameters": arch.layer_params(arch.dense_layers if arch.experts else 0)})


# ---------------------------------------------------------------------------------------------
# Architectures (public model cards) and presets

ARCHS: dict[str, Arch] = {
    "phi-2": Arch("phi-2", hidden=2560, ffn=10240, heads=32, layers=32, vocab=51200, max_seq=2048, norms=1),
    "llama3-8b": Arch("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=32, vocab=128256, max_seq=8192,
                      gated=True, bias=False),
    "mpt-7b": Arch("mpt-7b", hidden=4096, ffn=16384, heads=32, layers=32, vocab=50432, max_seq=2048, bias=False,
                   tied_embeddings=True),
    "deepseek-moe-16b": Arch("deepseek-moe-16b", hidden=2048, ffn=10944, heads=16, layers=28, vocab=102400, max_seq=4096,
                             gated=True, bias=False, experts=64, top_k=6, expert_ffn=1408, shared_experts=2, dense_layers=1),
    "olmoe-1b-7b": Arch("olmoe-1b-7b", hidden=2048, ffn=1024, heads=16, layers=16, vocab=50304, max_seq=4096, gated=True,
                        bias=False, experts=64, top_k=8, expert_ffn=1024),
    "llama3-70b": Arch("llama3-70b", hidden=8192, ffn=28672, heads=64, kv_heads=8, layers=80, vocab=128256, max_seq=8192,
                       gated=True, bias=False),
    "gpt3-175b": Arch("gpt3-175b", hidden=12288, ffn=49152, heads=96, layers=96, vocab=50257, max_seq=2048),
}

# The Lagom paper's micro-batch sizes (its Table 2) per model and parallelism family.
PAPER_MBS = {("phi-2", "fsdp"): 2, ("phi-2", "tp"): 8, ("llama3-8b", "fsdp"): 1, ("llama3-8b", "tp"): 4,
             ("mpt-7b", "fsdp"): 1, ("mpt-7b", "tp"): 2, ("deepseek-moe-16b", "ep"): 2, ("olmoe-1b-7b", "ep"): 2}
DEFAULT_SEQ = 2048
MAX_SEQ = 1 << 22  # --seq at most: 4M tokens, past any model's context
MAX_MBS = 1 << 16  # --mbs at most

# The example training script's model (examples/train_gpt.py defaults); a test keeps them equal.
CPU_DEMO_ARCH = Arch("tiny-gpt", hidden=256, ffn=1024, heads=4, layers=4, vocab=8192, max_seq=128)


PARALLEL_EXAMPLES = "fsdp=8, fsdp=8,dp=2 (HSDP), fsdp=2,tp=8 (2-D), fsdp=2,tp=4,dp=2 (3-D), tp=8,dp=2, ep=8 or ddp=2"


def parse_parallel(spec: str) -> dict[str, int]:
    """``fsdp=8`` | ``fsdp=8,dp=2`` | ``fsdp=2,tp=8[,dp=2]`` | ``tp=8,dp=2`` | ``ep=8`` | ``ddp=2`` -> {"fsdp": 8} ...

    Args:
        spec: ``--parallel``'s value.
    Returns:
        Parallelism -> degree.
    Raises:
        UserError: for anything but one of fsdp (with dp, tp or both), tp (with dp), ep, ddp.
    """
    out: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        m = re.fullmatch(r"(fsdp|tp|dp|ep|ddp)=(\d+)", part)
        if not m or int(m.group(2)) < 1:
            raise UserError(f"--parallel {spec!r}: expected e.g. {PARALLEL_EXAMPLES}")
        if m.group(1) in out:  # the last one won, silently
            raise UserError(f"--parallel {spec!r}: {m.group(1)}= is given twice")
        out[m.group(1)] = int(m.group(2))
    family = parallel_family(out)
    if family is None:
        raise UserError(f"--parallel {spec!r}: name one of fsdp, tp, ep, ddp (or fsdp with tp: 2-D)")
    if "dp" in out and family not in ("tp", "fsdp", "fsdp+tp"):
        raise UserError(f"--parallel {spec!r}: dp= goes with tp= or fsdp=")
    if math.prod(out.values()) > MAX_RANKS:
        raise UserError(f"--parallel {spec!r}: {math.prod(out.values())} ranks, more than {MAX_RANKS}")
    for name in family.split("+"):
        if out[name] < 2:  # a collective over one rank moves nothing: there is no overlap to tune
            raise UserError(f"--parallel {spec!r}: {name}={out[name]} runs no collective; give {name}=2 or more")
    return out


def parallel_family(degrees: dict[str, int]) -> str | None:
    """The preset family ``degrees`` name: fsdp, tp, ep, ddp, or fsdp+tp (2-D); None for another mix.

    Args:
        degrees: parallelism -> degree (``parse_parallel``'s keys).
    Returns:
        The family, or None.
    """
    families = {"fsdp", "tp", "ep", "ddp"} & set(degrees)
    if families == {"fsdp", "tp"}:
        return "fsdp+tp"
    return families.pop() if len(families) == 1 else None


def build_model(model: str, parallel: str | None = None, seq: int | None = None, mbs: int | None = None,
                dtype: str = "bf16", reduce_dtype: str | None = None, **_: Any) -> Workload:
    """A model preset's workload under a parallelism.

    Args:
        model: an architecture's name (``ARCHS``).
        parallel: ``--parallel`` (default: ep=8 for MoE models, else fsdp=8).
        seq: sequence length (default: 2048, at most the model's).
        mbs: micro-batch size (default: the paper's for the model and parallelism, else 1; 2 for
            tensor parallelism, whose two half-batches need an even one).
        dtype: the GEMMs' dtype.
        reduce_dtype: ``--reduce-dtype``, the gradient reductions' dtype (default: the family's
            framework's, ``REDUCE_DTYPE_DEFAULT``).
    Returns:
        The Workload.
    Raises:
        UserError: for an MoE model under tensor parallelism or DDP (its experts: use ep=N), or a
            reduce dtype the parallelism has no gradient reduction for.
    """
    arch = ARCHS[model]
    par = parse_parallel(("ep=8" if arch.experts else "fsdp=8") if parallel is None else parallel)  # '' is refused, not the default
    family = parallel_family(par)
    if arch.experts and family in ("tp", "ddp", "fsdp+tp"):  # none of these presets builds a router or experts
        raise UserError(f"{arch.name} is an MoE model: use --parallel ep=N")
    # Domino's two half-batches need an even micro-batch: 1, the default of a model the paper gives none, was refused
    mbs = mbs or PAPER_MBS.get((model, family), 2 if family == "tp" else 1)
    seq = seq or min(DEFAULT_SEQ, arch.max_seq)
    if reduce_dtype is not None:
        _check_reduce_dtype(reduce_dtype)
        if family == "ep" or (family == "tp" and par.get("dp", 1) == 1):  # the option would be ignored
            raise UserError(f"--reduce-dtype: {','.join(f'{k}={n}' for k, n in par.items())} reduces no gradients across ranks "
                            f"({'expert parallelism models none' if family == 'ep' else 'give dp=2 or more'})")
    reduced = reduce_dtype or REDUCE_DTYPE_DEFAULT.get(family)
    if family == "fsdp+tp":
        return fsdp_tensor_parallel(arch, seq=seq, mbs=mbs, ranks=par["fsdp"], tp=par["tp"], dp=par.get("dp", 1), dtype=dtype,
                                    reduce_dtype=reduced)
    if family == "fsdp":
        return fsdp(arch, seq=seq, mbs=mbs, ranks=par["fsdp"], dp=par.get("dp", 1), dtype=dtype, reduce_dtype=reduced)
    if family == "tp":
        return tensor_parallel(arch, seq=seq, mbs=mbs, tp=par["tp"], dp=par.get("dp", 1), dtype=dtype, reduce_dtype=reduced)
    if family == "ep":
        return expert_parallel(arch, seq=seq, mbs=mbs, ep=par["ep"], dtype=dtype)
    return gpt_ddp(arch, seq=seq, mbs=mbs, ranks=par["ddp"], dtype=dtype, reduce_dtype=reduced)


def _check_reduce_dtype(value: str) -> None:
    """Check ``--reduce-dtype``'s value.

    Args:
        value: the option's value.
    Raises:
        UserError: for a dtype the workloads have no size for.
    """
    if value not in DTYPES:
        raise UserError(f"--reduce-dtype {value!r}: expected one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class Preset:
    description: str
    build: Callable[..., Workload]
    sized_by_ranks: bool = False  # --ranks sets its world (cpu-demo's DDP); model presets take --parallel


def _cpu_demo(seq: int | None = None, mbs: int | None = None, ranks: int | None = None, parallel: str | None = None,
              reduce_dtype: str | None = None, **_: Any) -> Workload:
    if reduce_dtype is not None:  # the example script trains and reduces in fp32: another would size calls it never makes
        _reject("--reduce-dtype applies to model presets; cpu-demo is examples/train_gpt.py, which reduces its fp32 gradients")
    if parallel is not None:
        ddp = parse_parallel(parallel).get("ddp") or _reject(f"cpu-demo is a DDP workload: --parallel ddp=N, not {parallel!r}")
        if ranks is not None and ranks != ddp:  # one was silently dropped (an audit, 2026-12-03)
            _reject(f"--ranks {ranks} and --parallel {parallel} give cpu-demo two world sizes; give one of them")
        ranks = ddp
    w = gpt_ddp(CPU_DEMO_ARCH, seq=seq or 128, mbs=mbs or 4, ranks=ranks or 2)
    return Workload("cpu-demo", w.groups, w.exposed_ms, {**w.meta, "preset": "cpu-demo"})


def _reject(message: str):
    raise UserError(message)


def _degrees(parallel: str) -> dict[str, int]:
    """``--parallel``'s degrees, a data-parallel degree of 1 written or not (``tp=8`` is ``tp=8,dp=1``)."""
    par = parse_parallel(parallel)
    return {"dp": 1, **par} if {"tp", "fsdp"} & set(par) else par


def _model_preset(model: str, parallel: str | None = None) -> Preset:
    """A model's preset; with ``parallel``, one that fixes it (a Table 2 configuration: its name
    says the parallelism, so another ``--parallel`` is refused, not silently taken)."""
    a = ARCHS[model]
    kind = f"MoE, {a.experts} experts top-{a.top_k}" if a.experts else f"d={a.hidden}, ffn={a.ffn}"
    default = parallel or ("ep=8" if a.experts else "fsdp=8")
    fixed = parallel is not None

    def build(parallel: str | None = None, seq: int | None = None, mbs: int | None = None, **kw: Any) -> Workload:
        if fixed and parallel is not None and _degrees(parallel) != _degrees(default):
            _reject(f"this preset is {model} with {default} (its name says so): --parallel {parallel} asks for another; "
                    f"use the preset {model} with --parallel {parallel}")
        return build_model(model, default if parallel is None else parallel, seq, mbs, **kw)

    return Preset(f"{model} ({a.layers} layers, {kind}); --parallel {default} by default", build)


PRESETS: dict[str, Preset] = {
    "cpu-demo": Preset("tiny GPT (4 layers, d=256) trained with DDP on 2 gloo ranks: the `make demo` workload", _cpu_demo, True),
    **{name: _model_preset(name) for name in ARCHS},
}

# The Lagom paper's Table 2 configurations, by name.
TABLE2 = {
    f"{m}-fsdp{n}": (m, f"fsdp={n}") for m in ("phi-2", "llama3-8b", "mpt-7b") for n in (8, 16)
} | {
    f"{m}-tp8-dp{d}": (m, f"tp=8,dp={d}") for m in ("phi-2", "llama3-8b", "mpt-7b") for d in (1, 2)
} | {f"{m}-ep8": (m, "ep=8") for m in ("deepseek-moe-16b", "olmoe-1b-7b")}

for _name, (_model, _par) in TABLE2.items():
    PRESETS[_name] = Preset(f"Lagom paper Table 2: {_model} with {_par}, the paper's micro-batch size",
                            _model_preset(_model, _par).build)


def build_preset(name: str, **shape: Any) -> Workload:
    """The workload of preset ``name``.

    Args:
        name: a preset's name (``PRESETS``).
        **shape: ``parallel``, ``seq``, ``mbs``, ``reduce_dtype``, ``ranks`` (None: the preset's default).
    Returns:
        The Workload.
    Raises:
        UserError: for an unknown preset or shape.
    """
    if name not in PRESETS:
        raise UserError(f"unknown workload {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name].build(**{k: val for k, val in shape.items() if val is not None})


PRESET_SHAPE = ("parallel", "seq", "mbs", "reduce_dtype")  # the options that reshape a preset (--ranks also sizes gloo's ranks)


def resolve_workload(name_or_file: str, **shape: Any) -> Workload:
    """A preset name (see ``lagom-tune workload list``) or a path to a workload YAML.

    Args:
        name_or_file: a preset's name or a workload file.
        **shape: the preset's parallelism and sizes (``parallel``, ``seq``, ``mbs``, ``reduce_dtype``,
            ``ranks``).
    Returns:
        The Workload.
    Raises:
        UserError: for a name that is neither, or a file with shape options given.
    """
    if not name_or_file.strip():  # Path("") is the current folder
        raise UserError("--workload is empty: give a preset (see `lagom-tune workload list`) or a workload file")
    if name_or_file in PRESETS:  # checked as its file would be: --seq x --mbs may make a side no loader takes
        return Workload.from_dict(build_preset(name_or_file, **shape).to_dict(), f"{name_or_file} (preset)")
    if Path(name_or_file).suffix in (".yaml", ".yml") or Path(name_or_file).exists():
        given = [k for k in PRESET_SHAPE if shape.get(k) is not None]
        if given:  # a file's shapes are its own: the option was ignored
            raise UserError(f"--{given[0].replace('_', '-')} applies to presets; {name_or_file} is a workload file, whose shapes are its own")
        return load_workload(name_or_file)
    raise UserError(f"unknown workload {name_or_file!r}: not a preset (see `lagom-tune workload list`) nor a file")
