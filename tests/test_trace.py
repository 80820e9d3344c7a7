"""Importing a workload from a torch.profiler trace of the example training on CPU."""

import json

import pytest

from lagom_tune.errors import UserError
from lagom_tune.workload.presets import build_preset
from lagom_tune.workload.spec import load_workload
from lagom_tune.workload.trace import import_trace

from conftest import BIN, ROOT, cli


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    base = tmp_path_factory.mktemp("trace")
    trace = base / "trace.json"
    import subprocess
    subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "train_gpt.py"),
                    "--steps", "1", "--warmup", "1", "--trace", str(trace)], check=True, capture_output=True)
    return trace


@pytest.mark.slow
def test_import_a_cpu_trace_of_the_example_training(traced, tmp_path):
    out = tmp_path / "imported.yaml"
    r = cli("workload", "import", traced, "--out", out, check=True)
    assert "groups cover" in r.stdout
    w = load_workload(out)
    # Every forward and backward GEMM of the model is found, with its shape.
    preset = build_preset("cpu-demo")  # the example script's default model
    expected = sorted(g.flops for grp in preset.groups for g in grp.compute)
    assert sorted(g.flops for grp in w.groups for g in grp.compute) == expected
    # The gradient all-reduces carry every parameter once.
    assert sum(c.nbytes for c in w.collectives() if c.op == "all_reduce") == 4 * preset.meta["parameters"]
    assert any(g.comm and g.compute for g in w.groups) or all(c.op == "all_reduce" for c in w.collectives())
    # Groups plus exposed time account for the traced step within 10%.
    step = w.meta["traced_step_ms"]
    assert abs(sum(w.meta["traced_group_ms"].values()) + w.exposed_ms - step) <= 0.1 * step
    # A workload file it wrote is its own kind: imported again, it is replaced (its mark is its first lines).
    cli("workload", "import", traced, "--out", out, check=True)
    # GEMMs and collectives are a large part of the demo model's step (about 85% on an idle
    # 2-core machine; less when the machine is loaded, as element-wise ops then stretch).
    assert sum(w.meta["traced_group_ms"].values()) >= 0.3 * step


def test_bad_traces(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(UserError, match="not a JSON Chrome trace"):
        import_trace(p)
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::add", "ts": 0, "dur": 1}]}))
    with pytest.raises(UserError, match="record_shapes"):
        import_trace(p)
    with pytest.raises(UserError, match="trace not found"):
        import_trace(tmp_path / "missing.json")
    p.write_text(json.dumps({"distributedInfo": {"world_size": 1}, "traceEvents": []}))
    with pytest.raises(UserError, match="one rank runs no collective"):
        import_trace(p)
    p.write_text(json.dumps({"distributedInfo": {"world_size": 10 ** 12}, "traceEvents": []}))
    with pytest.raises(UserError, match="not a number of ranks"):  # measured in full, then a MemoryError
        import_trace(p)


@pytest.mark.parametrize("element, dtype", [("c10::Half", "fp16"), ("c10::BFloat16", "bf16"), ("float", "fp32")])
def test_a_gemms_element_type_is_kept(tmp_path, element, dtype):
    """fp16 GEMMs were imported as bf16 (the type was read back from its size)."""
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"distributedInfo": {"world_size": 2}, "traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 10, "args": {"Input Dims": [[64, 32], [32, 16]], "Input type": [element, element]}},
        {"ph": "X", "name": "gloo:all_reduce", "ts": 2, "dur": 5, "args": {"Input Dims": [[64]], "Input type": ["float"]}}]}))
    (g,) = import_trace(p).gemms().values()
    assert (g.m, g.n, g.k, g.dtype) == (64, 16, 32, dtype)


def test_a_trace_with_no_collective_is_refused(tmp_path):
    """A single process's trace was written as a workload `profile` then refused ("has no collective")."""
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"distributedInfo": {"world_size": 2}, "traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 10, "args": {"Input Dims": [[64, 32], [32, 16]], "Input type": ["float"] * 2}}]}))
    with pytest.raises(UserError, match="1 GEMMs and no collective with a size"):
        import_trace(p)


def _span(name, ts, dur, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": args}


def test_a_gemm_beside_two_windows_is_one_gemm_and_collectives_are_sized_as_nccl_tests(tmp_path):
    """A GEMM running across two back-to-back all-reduces was put in both groups (the workload held
    4 GEMMs where the trace ran 3); a gloo all-gather was sized by this rank's shard, and an NCCL
    kernel, which has no input type, at 4 bytes an element, its all-gather by its input."""
    mm = lambda i: _span("aten::mm", 100 * i, 100, **{"Input Dims": [[256, 256], [256, 256]], "Input type": ["float", "float"]})
    events = [mm(0), mm(1), mm(2),
              _span("gloo:all_reduce", 10, 130, **{"Input Dims": [[1000]], "Input type": ["float"]}),
              _span("gloo:all_reduce", 145, 130, **{"Input Dims": [[1000]], "Input type": ["float"]}),
              _span("gloo:all_gather", 400, 50, **{"Input Dims": [[250]], "Input type": ["float"]})]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"distributedInfo": {"world_size": 4}, "traceEvents": events}))
    w = import_trace(p)
    assert sum(len(g.compute) for g in w.groups) == 3
    assert {c.op: c.nbytes for c in w.collectives()} == {"all_reduce": 4000, "all_gather": 4000}  # the output: 4 shards
    kernels = [_span("ncclDevKernel_AllGather_RING_LL", 0, 50, **{"dtype": "BFloat16", "In msg nelems": 1 << 20,
                                                                   "Out msg nelems": 1 << 23, "Group size": 8}),
               _span("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 60, 50, **{"dtype": "BFloat16", "In msg nelems": 1 << 23,
                                                                                 "Out msg nelems": 1 << 20, "Group size": 8})]
    kernels += [_span("aten::mm", 0, 5, **{"Input Dims": [[256, 256], [256, 256]], "Input type": ["c10::BFloat16"] * 2, "External id": 1}),
                _span("sm90_xmma_gemm_bf16", 10, 80, **{"External id": 1})]
    for k in kernels:
        k["cat"] = "kernel" if k["name"] != "aten::mm" else "cpu_op"
    p.write_text(json.dumps({"distributedInfo": {"world_size": 8}, "traceEvents": kernels}))
    assert {c.op: c.nbytes for c in import_trace(p).collectives()} == {"all_gather": 16 << 20, "reduce_scatter": 16 << 20}
    # NCCL runs all-to-all as a SendRecv kernel: known by the op torch recorded on it (it was dropped),
    # and a point-to-point send/recv is not a collective
    sendrecv = [_span("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 120, 40,
                      **{"Collective name": "all_to_allv", "dtype": "BFloat16", "In msg nelems": 50331648, "Group size": 8}),
                _span("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 170, 10,
                      **{"Collective name": "send", "dtype": "BFloat16", "In msg nelems": 1024, "Group size": 2})]
    for k in sendrecv:
        k["cat"] = "kernel"
    p.write_text(json.dumps({"distributedInfo": {"world_size": 8}, "traceEvents": kernels + sendrecv}))
    assert {c.op: c.nbytes for c in import_trace(p).collectives()} == {
        "all_gather": 16 << 20, "reduce_scatter": 16 << 20, "all_to_all": 100_663_296}


def test_collectives_keep_the_communicator_torch_recorded(tmp_path):
    """Every collective was imported as role ``dp`` over the whole world: a 2-D mesh's
    tensor-parallel all-reduce (8 of 16 ranks) became a 16-rank ``dp`` one, so the model timed it
    on the wrong communicator and the plan's rule named a role no group at run time plays."""
    def kernel(name, ts, nelems, group, desc, members=None, out=None):
        args = {"dtype": "BFloat16", "In msg nelems": nelems, "Group size": group, "Process Group Description": desc,
                **({"Out msg nelems": out} if out else {}), **({"Process Group Ranks": members} if members else {})}
        return {**_span(name, ts, 40, **args), "cat": "kernel"}

    events = [kernel("ncclDevKernel_AllGather_RING_LL", 0, 1 << 20, 2, "mesh_dp_shard", "[0, 8]", out=1 << 21),  # across nodes
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 50, 1 << 22, 8, "mesh_tp", list(range(8))),
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 100, 1 << 20, 16, "default_pg"),  # no ranks: consecutive
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 150, 1 << 18, 4, "my_subgroup", "[0, 1, 2, ...]"),  # cut short
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 200, 1 << 18, 1, "mesh_cp"),  # one rank: moves nothing
              # only the group's name: its description and ranks from the trace's pg_config
              {**_span("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 250, 40, **{"dtype": "BFloat16", "In msg nelems": 1 << 10,
                                                                              "Group size": 2, "Process Group Name": "7"}),
               "cat": "kernel"}]
    events += [{**_span("aten::mm", 0, 5, **{"Input Dims": [[256, 256], [256, 256]], "Input type": ["c10::BFloat16"] * 2,
                                            "External id": 1}), "cat": "cpu_op"},
               {**_span("sm90_xmma_gemm_bf16", 10, 200, **{"External id": 1}), "cat": "kernel"}]
    p = tmp_path / "t.json"
    config = [{"pg_name": "7", "pg_desc": "mesh_ep", "pg_size": 2, "ranks": [3, 11]}, "not a group"]
    p.write_text(json.dumps({"distributedInfo": {"world_size": 16, "pg_config": config}, "traceEvents": events}))
    w = import_trace(p)
    got = [(c.op, c.group, c.ranks, c.nodes, c.nbytes) for c in w.collectives()]
    assert got == [("all_gather", "dp_shard", 2, 2, 4 << 20), ("all_reduce", "tp", 8, 1, 8 << 20),
                   ("all_reduce", "dp", 16, 2, 2 << 20), ("all_reduce", "group4", 4, 1, 512 << 10),
                   ("all_reduce", "ep", 2, 2, 2 << 10)]
    assert w.meta["nodes_guessed"] == ["dp", "group4"] and w.meta["gpus_per_node"] == 8
    # four ranks a node: the tensor-parallel group spans two
    assert {c.group: c.nodes for c in import_trace(p, gpus_per_node=4).collectives()}["tp"] == 2
    with pytest.raises(UserError, match="--gpus-per-node 0"):
        import_trace(p, gpus_per_node=0)


def test_collectives_inside_one_gemm_are_one_group(tmp_path):
    """Four all-reduces inside one 1 ms GEMM, with gaps between them, were four groups, three with
    no computation, replayed one after another: 1.45 ms of groups for 1.0 traced (an auditor's trace)."""
    events = [_span("aten::mm", 0, 1000, **{"Input Dims": [[512, 512], [512, 512]], "Input type": ["float", "float"]})]
    events += [_span("gloo:all_reduce", 50 + 220 * i, 150, **{"Input Dims": [[1000]], "Input type": ["float"]}) for i in range(4)]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"distributedInfo": {"world_size": 2}, "traceEvents": events}))
    w = import_trace(p)
    assert [(len(g.compute), len(g.comm)) for g in w.groups] == [(1, 4)]
    assert w.meta["traced_group_ms"] == {"overlap.0": 1.0}
