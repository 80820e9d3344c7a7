"""Presets are derived from architectures: check them against hand-computed shapes and bytes."""

import json
from dataclasses import replace

import pytest

from lagom_tune.errors import UserError
from lagom_tune.workload.presets import PRESETS, TABLE2, build_preset, parse_parallel

from conftest import cli


def test_llama3_8b_fsdp8_gathers_one_layer_in_bf16():
    # Hand count: attention 4096*(4096 + 2*1024) + 4096*4096 = 41,943,040; SwiGLU 3*4096*14336 =
    # 176,160,768; two RMSNorms 8,192. Total 218,112,000 parameters, 2 bytes each in bf16.
    r = cli("workload", "show", "llama3-8b", "--parallel", "fsdp=8", "--json", check=True)
    w = json.loads(r.stdout)
    fwd = next(g for g in w["groups"] if g["name"] == "forward.layer")
    bwd = next(g for g in w["groups"] if g["name"] == "backward.layer")
    assert fwd["repeat"] == 32
    (ag,) = fwd["comm"]
    assert ag["op"] == "all_gather" and ag["nbytes"] == 218_112_000 * 2 and ag["ranks"] == 8
    rs = [c for c in bwd["comm"] if c["op"] == "reduce_scatter"]
    assert len(rs) == 1 and rs[0]["nbytes"] == ag["nbytes"]
    shapes = {g["name"]: (g["m"], g["n"], g["k"], g["batch"]) for g in fwd["compute"]}
    assert shapes["L0.qkv"] == (2048, 4096 + 2 * 8 * 128, 4096, 1)  # mbs 1 x seq 2048 tokens, GQA
    assert shapes["L0.mlp.up"] == (2048, 2 * 14336, 4096, 1)  # gate and up fused
    assert shapes["L0.scores"] == (2048, 2048, 128, 32)


def test_phi2_gathers_its_layer_with_the_one_layernorm_its_parallel_block_shares():
    """phi-2's attention and MLP read one input LayerNorm (Hugging Face's PhiDecoderLayer); the
    preset counted two, 5,120 parameters a layer more than the checkpoint holds. Hand count:
    attention 2560*3*2560 + 7680 + 2560*2560 + 2560 = 26,224,640; MLP 2*2560*10240 + 10240 + 2560 =
    52,441,600; one LayerNorm 5,120. 32 such layers, the embedding 51200*2560, the head with its
    bias and the final LayerNorm make the published 2,779,683,840."""
    layer = 78_671_360
    assert 32 * layer + 51200 * 2560 + (51200 * 2560 + 51200) + 2 * 2560 == 2_779_683_840
    w = build_preset("phi-2", parallel="fsdp=8")
    (ag,) = next(g for g in w.groups if g.name == "forward.layer").comm
    assert ag.nbytes == layer * 2


def test_reduce_dtype_sizes_the_gradient_reductions_and_nothing_else():
    """torchtitan's FSDP2 reduces bf16 training's gradients in fp32: a plan from the bf16 default
    holds its reduce-scatter rules to half the bytes NCCL is asked for, and they match no call.
    ``--reduce-dtype`` sizes every gradient reduction (FSDP's reduce-scatters, DDP's and tp's dp
    all-reduces) and leaves GEMMs, all-gathers and activation all-reduces as they were."""
    def sizes(w):
        return {(g.name, c.name): c.nbytes for g in w.groups for c in g.comm}

    for parallel, reduction, default in (("fsdp=8", "reduce_scatter.grads", "bf16"), ("ddp=8", "grad.", "bf16"),
                                          ("tp=8,dp=2", "all_reduce.dp_grads", "fp32")):
        base = build_preset("phi-2", parallel=parallel)
        assert base.meta["reduce_dtype"] == default
        for dtype, scale in (("fp32", 4), ("fp16", 2)):
            w = build_preset("phi-2", parallel=parallel, reduce_dtype=dtype)
            assert w.meta["reduce_dtype"] == dtype and [g.compute for g in w.groups] == [g.compute for g in base.groups]
            new, old = sizes(w), sizes(base)
            for key, n in old.items():
                ratio = scale / {"bf16": 2, "fp32": 4}[default] if key[1].startswith(reduction) else 1
                assert new[key] == n * ratio, (parallel, dtype, key)
    # the default is unchanged: every Table 2 workload (and the committed plans' digests) as before
    assert build_preset("phi-2-fsdp16", reduce_dtype="bf16").digest == build_preset("phi-2-fsdp16").digest
    assert "reduce_dtype" not in build_preset("phi-2", parallel="tp=8").meta  # no gradient reduction to size


def test_hsdp_all_reduces_each_shard_across_the_replicas():
    """torchtitan's HSDP (mesh dp_replicate x dp_shard): FSDP within a node, then each layer's
    reduce-scatter output, one rank's shard, all-reduced across the replicas on dp_replicate, in
    the reduce dtype, beside the same backward; nothing else changes. `--parallel fsdp=8,dp=2`
    was refused ("dp= goes with tp="), so an HSDP job had no workload its rules could match."""
    plain, w = build_preset("llama3-8b", parallel="fsdp=8"), build_preset("llama3-8b", parallel="fsdp=8,dp=2", reduce_dtype="fp32")
    assert w.name == "llama3-8b-fsdp8-dp2" and w.meta["parallel"] == "fsdp=8,dp=2"
    bwd = next(g for g in w.groups if g.name == "backward.layer")
    ag, rs, ar = bwd.comm
    assert (ar.op, ar.group, ar.ranks, ar.nodes, ar.nbytes) == ("all_reduce", "dp_replicate", 2, 2, 218_112_000 // 8 * 4)
    assert (rs.group, rs.nbytes, ag.nbytes) == ("dp_shard", 218_112_000 * 4, 218_112_000 * 2) and bwd.repeat == 32
    assert [g.compute for g in w.groups] == [g.compute for g in plain.groups]
    assert [c for c in w.collectives() if c.group == "dp_shard"] == [replace(c, nbytes=c.nbytes * (2 if c.op == "reduce_scatter" else 1))
                                                                   for c in plain.collectives()]
    # four replicas of 4 ranks fill two nodes: each replica group spans both; a shard a node holds, no more
    assert {(c.group, c.nodes) for c in build_preset("phi-2", parallel="fsdp=4,dp=4").collectives()} == {("dp_shard", 1), ("dp_replicate", 2)}
    # a sharded group over two nodes, replicated twice: 32 ranks, each rank's replica 16 ranks away
    wide = build_preset("phi-2", parallel="fsdp=16,dp=2")
    assert wide.world_size == 32 and {(c.group, c.ranks, c.nodes) for c in wide.collectives()} == {("dp_shard", 16, 2),
                                                                                               ("dp_replicate", 2, 2)}
    # a Table 2 FSDP preset takes its own parallelism written with dp=1, and refuses HSDP
    assert build_preset("phi-2-fsdp16", parallel="fsdp=16,dp=1").digest == build_preset("phi-2-fsdp16").digest
    with pytest.raises(UserError, match="asks for another"):
        build_preset("phi-2-fsdp16", parallel="fsdp=8,dp=2")


def test_an_hsdp_job_is_simulated_on_the_nodes_its_replicas_span():
    """The simulated job of fsdp=8,dp=2 is 16 GPUs on two nodes, its replicas' all-reduce over
    InfiniBand, and every collective is planned at NCCL's own choice too. A job of more ranks than
    its communicators span (fsdp=16,dp=2: 32 ranks, every communicator over 2 nodes) is simulated
    on the nodes its ranks fill; HSDP wider than a node was refused until 2026-12-06."""
    from lagom_tune.backends.base import BackendOptions, get_backend

    w = build_preset("phi-2", parallel="fsdp=8,dp=2")
    b = get_backend("sim", BackendOptions(hardware="h100-nvlink"))
    points = b.plan_points(w)
    fp = b.fingerprint()
    assert (fp["nodes"], fp["ranks"]) == (2, 16)
    defaults = {(p.op, p.ranks) for p in points if p.kind == "default"}
    assert defaults == {("all_gather", 8), ("reduce_scatter", 8), ("all_reduce", 2)}
    for parallel in ("fsdp=16,dp=2", "fsdp=2,tp=8,dp=2"):
        b = get_backend("sim", BackendOptions(hardware="h100-nvlink"))
        b.plan_points(build_preset("phi-2", parallel=parallel))
        assert (b.fingerprint()["nodes"], b.fingerprint()["ranks"]) == (4, 32), parallel
    with pytest.raises(UserError, match=r"needs 4 nodes of 8 GPUs \(its ranks and its communicators'\); --nodes 2 is too few"):
        get_backend("sim", BackendOptions(hardware="h100-nvlink", nodes=2)).plan_points(build_preset("phi-2", parallel="fsdp=16,dp=2"))


def test_2d_fsdp_tp_gathers_a_layers_tp_shard_and_puts_sequence_parallel_collectives_on_the_critical_path():
    """torchtitan's 2-D (mesh dp_shard x tp): each tp rank's GEMMs are the tp preset's shapes over
    the whole micro-batch; FSDP gathers the layer's tp shard with its norms whole, beside the
    layer's GEMMs; the four sequence-parallel collectives a layer (all-gather in, reduce-scatter
    out, around attention and the MLP) run alone, mirrored in backward, and once each way around
    the embedding and the head.
    No preset took both, so a torchtitan 2-D job had no workload its rules could match."""
    w = build_preset("llama3-8b", parallel="fsdp=2,tp=8", reduce_dtype="fp32")
    assert w.name == "llama3-8b-fsdp2-tp8" and w.meta["parallel"] == "fsdp=2,tp=8" and w.meta["reduce_dtype"] == "fp32"
    groups = {g.name: g for g in w.groups}
    # llama3-8b's layer (218,112,000 parameters, two RMSNorms of 4,096) over tp=8, norms whole
    shard = (218_112_000 - 8192) // 8 + 8192
    fwd, bwd = groups["forward.layer"], groups["backward.layer"]
    assert [(c.op, c.group, c.ranks, c.nodes, c.nbytes) for c in fwd.comm] == [("all_gather", "dp_shard", 2, 2, shard * 2)]
    assert [(c.op, c.nbytes) for c in bwd.comm] == [("all_gather", shard * 2), ("reduce_scatter", shard * 4)]
    shapes = {g.name: (g.m, g.n, g.k, g.batch) for g in fwd.compute}
    assert shapes["L0.qkv"] == (2048, (32 + 2 * 8) // 8 * 128, 4096, 1) and shapes["L0.mlp.down"] == (2048, 4096, 14336 // 8, 1)
    act = 2048 * 4096 * 2  # one micro-batch's whole sequence, bf16
    for name in ("forward.layer.tp", "backward.layer.tp"):
        g = groups[name]
        assert not g.compute and g.repeat == 32 and [c.op for c in g.comm] == ["all_gather", "reduce_scatter"] * 2
        assert {(c.group, c.ranks, c.nodes, c.nbytes) for c in g.comm} == {("tp", 8, 1, act)}
    ends = groups["embedding_and_head.tp"]  # torchtitan's embedding (row-wise: output reduce-scattered) and head (input gathered)
    assert [c.op for c in ends.comm] == ["reduce_scatter", "all_gather"] * 2 and ends.repeat == 1
    assert groups["head"].compute[0].n == 128256 // 8
    # tp=4 blocks, fsdp=2: one node holds the job and its dp_shard groups
    assert {(c.group, c.nodes) for c in build_preset("phi-2", parallel="fsdp=2,tp=4").collectives()} == {("dp_shard", 1), ("tp", 1)}
    # the reduce dtype sizes FSDP's reduce-scatters only, never the activations' collectives
    bf16 = build_preset("llama3-8b", parallel="fsdp=2,tp=8")
    assert [c for c in w.collectives() if c.op != "reduce_scatter" or c.group == "tp"] == \
        [c for c in bf16.collectives() if c.op != "reduce_scatter" or c.group == "tp"]


def test_3d_all_reduces_each_blocks_gradient_shard_across_the_replicas():
    """torchtitan's 3-D (dp_replicate x dp_shard x tp): the 2-D job within each block of fsdp x tp
    ranks, and HSDP's all-reduce of each layer's reduce-scatter output (one rank's share of its tp
    shard) across the replicas on dp_replicate, beside the same backward; nothing else changes."""
    two, w = build_preset("llama3-8b", parallel="fsdp=2,tp=4"), build_preset("llama3-8b", parallel="fsdp=2,tp=4,dp=2")
    assert w.name == "llama3-8b-fsdp2-tp4-dp2" and w.meta["parallel"] == "fsdp=2,tp=4,dp=2" and w.world_size == 16
    shard = (218_112_000 - 8192) // 4 + 8192
    bwd = next(g for g in w.groups if g.name == "backward.layer")
    ar = bwd.comm[-1]
    assert (ar.op, ar.group, ar.ranks, ar.nodes, ar.nbytes) == ("all_reduce", "dp_replicate", 2, 2, shard // 2 * 2)
    assert [replace(g, comm=tuple(c for c in g.comm if c.group != "dp_replicate")) for g in w.groups] == list(two.groups)


@pytest.mark.parametrize("parallel, world", [("fsdp=8", 8), ("fsdp=8,dp=2", 16), ("fsdp=2,tp=8", 16), ("fsdp=2,tp=4,dp=2", 16),
                                             ("tp=4,dp=2", 8),
                                             ("tp=8", 8), ("ddp=4", 4)])
def test_a_presets_world_is_its_degrees_multiplied(parallel, world):
    """A job's ranks are its parallel degrees multiplied, not its largest communicator (HSDP's 16
    ranks hold communicators of 8 and 2): what a simulated plan records as its world size."""
    from lagom_tune.backends.base import BackendOptions, get_backend

    w = build_preset("phi-2", parallel=parallel)
    assert w.world_size == w.meta["world"] == world
    b = get_backend("sim", BackendOptions(hardware="h100-nvlink"))
    b.plan_points(w)
    assert b.fingerprint()["ranks"] == world  # an fsdp=4 job's plan said 8, the simulated node's GPUs


def test_a_workload_files_world_holds_its_largest_communicator(tmp_path):
    """meta.world, where a workload file gives it, is the plan's world size: fewer ranks than a
    communicator of it holds is refused by name."""
    from lagom_tune.workload.spec import load_workload

    w = build_preset("phi-2", parallel="fsdp=8,dp=2")
    doc = w.to_dict()
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps({**doc, "meta": {**doc["meta"], "world": 4}}))
    with pytest.raises(UserError, match="workload.meta.world: 4 ranks cannot hold a communicator of 8"):
        load_workload(path)
    path.write_text(json.dumps({**doc, "meta": {}}))
    assert load_workload(path).world_size == 8  # without it, its largest communicator's


def test_a_2d_job_is_simulated_on_two_nodes_with_each_communicators_collectives():
    """fsdp=2,tp=8 on the simulated H100s: 16 GPUs on two nodes, and each of the four collectives
    (two ops on two communicators, tp within a node, dp_shard across) profiled at NCCL's own choice."""
    from lagom_tune.backends.base import BackendOptions, get_backend

    w = build_preset("phi-2", parallel="fsdp=2,tp=8")
    b = get_backend("sim", BackendOptions(hardware="h100-nvlink"))
    points = b.plan_points(w)
    assert (b.fingerprint()["nodes"], b.fingerprint()["ranks"]) == (2, 16)
    assert {(p.op, p.ranks) for p in points if p.kind == "default"} == {("all_gather", 8), ("reduce_scatter", 8),
                                                                      ("all_gather", 2), ("reduce_scatter", 2)}


def test_phi2_tp8_domino_shapes_and_all_reduce_bytes():
    w = build_preset("phi-2-tp8-dp2")  # the paper's micro-batch 8, split in two halves of 4
    attn = next(g for g in w.groups if g.name == "forward.attention")
    shapes = {g.name: (g.m, g.n, g.k, g.batch) for g in attn.compute}
    assert shapes["L.qkv"] == (4 * 2048, 3 * 2560 // 8, 2560, 1)
    assert shapes["L.scores"] == (2048, 2048, 80, 4 * 32 // 8)
    assert attn.comm[0].nbytes == 4 * 2048 * 2560 * 2 and attn.comm[0].group == "tp"
    # every phase runs once per half-batch: twice a layer (the groups held one half, so the
    # iteration was half its real time beside a full-size gradient all-reduce)
    assert attn.repeat == 2 * 32 and all(g.repeat == 2 * 32 for g in w.groups if g.name in ("forward.mlp", "backward.mlp"))
    bwd = [g for g in w.groups if g.name.startswith("backward.attention")]
    assert sum(g.repeat for g in bwd) == 2 * 32
    dp = [(c, g.repeat) for g in bwd for c in g.comm if c.group == "dp_replicate"]
    # Phi-2 layer: attention 4*2560^2 + 4*2560 biases; MLP 2*2560*10240 + 10240 + 2560; 1 LayerNorm.
    layer = 4 * 2560**2 + 4 * 2560 + 2 * 2560 * 10240 + 10240 + 2560 + 2 * 2560
    # once a layer, in fp32 (Megatron all-reduces bf16 training's gradients in fp32), over 2 nodes
    assert len(dp) == 1 and dp[0][1] == 32 and dp[0][0].nbytes == layer // 8 * 4 and dp[0][0].ranks == 2 and dp[0][0].nodes == 2
    # a tp=4,dp=2 job fits one node: its data-parallel group too (it was simulated over InfiniBand)
    small = build_preset("phi-2", parallel="tp=4,dp=2")
    assert {c.nodes for c in small.collectives()} == {1}
    with pytest.raises(UserError, match="--mbs must be even"):
        build_preset("phi-2", parallel="tp=8,dp=2", mbs=3)  # a sample was lost to mbs // 2


def test_a_preset_without_the_papers_micro_batch_gets_one_its_parallelism_takes():
    """`--parallel tp=8` on Llama-3-70B (no paper micro-batch) was refused for the default mbs of 1
    the user never gave; an MoE model under tp= or ddp= was refused for that, or built dense with
    no experts at all (OLMoE under ddp=8: 0.58B parameters of its 6.9B)."""
    assert build_preset("llama3-70b", parallel="tp=8").meta["mbs"] == 2
    for parallel in ("tp=8", "ddp=8"):
        with pytest.raises(UserError, match="is an MoE model: use --parallel ep=N"):
            build_preset("olmoe-1b-7b", parallel=parallel)


def test_moe_all_to_all_and_expert_gemms():
    w = build_preset("olmoe-1b-7b-ep8")
    fwd = next(g for g in w.groups if g.name == "forward.experts")
    tokens = 2 * 2048  # the paper's micro-batch 2
    assert all(c.op == "all_to_all" and c.nbytes == tokens * 8 * 2048 * 2 for c in fwd.comm)
    up = fwd.compute[0]
    assert up.batch == 64 // 8 and up.m == tokens * 8 * 8 // 64 and up.n == 2 * 1024


def test_backward_gemms_mirror_forward_flops():
    w = build_preset("mpt-7b-fsdp8")
    fwd = next(g for g in w.groups if g.name == "forward.layer")
    bwd = next(g for g in w.groups if g.name == "backward.layer")
    assert sum(g.flops for g in bwd.compute) == 2 * sum(g.flops for g in fwd.compute)


@pytest.mark.parametrize("name", sorted(TABLE2))
def test_every_table2_configuration_resolves(name):
    w = build_preset(name)
    assert w.collectives() and w.world_size in (2, 8, 16)


def test_scale_presets():
    assert build_preset("llama3-70b").meta["layer_parameters"] > 800_000_000
    assert build_preset("gpt3-175b", parallel="tp=8,dp=2", mbs=2).collectives()


@pytest.mark.parametrize("spec", ["fsdp", "tp=8,ep=8", "fsdp=2,ep=4", "tp=2,dp=2,ep=2", "dp=2", "fsdp=0", "zero=3", "fsdp=1000000000000", "tp=8,dp=1000000"])
def test_bad_parallel_specs(spec):
    with pytest.raises(UserError, match="--parallel"):
        parse_parallel(spec)


@pytest.mark.parametrize("spec", ["fsdp=1", "ddp=1", "ep=1", "tp=1,dp=8"])
def test_one_rank_runs_no_collective(spec):
    """fsdp=1 hung the sim's fit and ddp=1 crashed it (ZeroDivisionError): a collective over one
    rank moves nothing, so there is nothing to tune."""
    with pytest.raises(UserError, match="runs no collective"):
        parse_parallel(spec)


def test_wrong_parallel_for_the_model():
    with pytest.raises(UserError, match="MoE"):
        build_preset("olmoe-1b-7b", parallel="tp=8", mbs=2)
    with pytest.raises(UserError, match="no experts"):
        build_preset("llama3-8b", parallel="ep=8")


def test_workload_list_names_every_preset():
    out = cli("workload", "list", check=True).stdout
    for name in PRESETS:
        assert name in out


def test_a_table2_preset_refuses_another_parallelism():
    """``phi-2-tp8-dp2 --parallel fsdp=8`` built phi-2-fsdp8 (micro-batch 8 -> 2) without a word (an
    audit, 2026-12-04): a Table 2 preset's name fixes its parallelism; the same one, written either
    way, is taken."""
    with pytest.raises(UserError, match="this preset is phi-2 with tp=8,dp=2"):
        build_preset("phi-2-tp8-dp2", parallel="fsdp=8")
    with pytest.raises(UserError, match="use the preset olmoe-1b-7b with --parallel ep=4"):
        build_preset("olmoe-1b-7b-ep8", parallel="ep=4")
    assert build_preset("phi-2-tp8-dp1", parallel="tp=8").name == build_preset("phi-2-tp8-dp1").name
    assert build_preset("phi-2-tp8-dp2", parallel="tp=8,dp=2").meta == build_preset("phi-2-tp8-dp2").meta
    assert build_preset("phi-2", parallel="fsdp=16").name == "phi-2-fsdp16"  # a model's own preset takes any
