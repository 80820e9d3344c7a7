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
        {"ph": "X", "name": "aten::mm", "ts": 0, "dur": 10, "args": {"Input Dims": [[64, 32], [32, 16]], "Input type": [element, element]}}]}))
    (g,) = import_trace(p).gemms().values()
    assert (g.m, g.n, g.k, g.dtype) == (64, 16, 32, dtype)
