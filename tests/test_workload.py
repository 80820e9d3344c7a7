import importlib.util
import os
import re

import pytest

from lagom_tune.errors import UserError
from lagom_tune.workload.bucketing import DDP_DEFAULT_CAP_MB, FIRST_BUCKET_BYTES, bucket_collectives
from lagom_tune.workload.presets import CPU_DEMO_ARCH, build_preset, resolve_workload
from lagom_tune.workload.spec import Collective, Workload, load_workload

from conftest import ROOT, cli


def _example_model(arch):
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.GPT(arch.vocab, arch.hidden, arch.heads, arch.ffn, arch.layers, arch.max_seq)


def test_cpu_demo_preset_matches_the_example_model():
    w = build_preset("cpu-demo")
    model = _example_model(CPU_DEMO_ARCH)
    params = sum(p.numel() for p in model.parameters())
    assert w.meta["parameters"] == params
    # Gradient all-reduces carry every parameter once, in fp32 bytes.
    assert sum(c.nbytes for c in w.collectives()) == 4 * params


def test_demo_gemm_shapes_are_derived_from_the_architecture():
    w = build_preset("cpu-demo", seq=64, mbs=2)
    fwd = {g.name: g for g in w.groups[0].compute}
    t = 64 * 2
    assert (fwd["L0.qkv"].m, fwd["L0.qkv"].n, fwd["L0.qkv"].k) == (t, 3 * 256, 256)
    assert (fwd["L0.mlp.down"].m, fwd["L0.mlp.down"].n, fwd["L0.mlp.down"].k) == (t, 256, 1024)
    assert fwd["L0.scores"].batch == 2 * 4 and (fwd["L0.scores"].m, fwd["L0.scores"].n) == (64, 64)
    bwd = {g.name: g for g in w.groups[1].compute}
    assert (bwd["L0.mlp.up.wgrad"].m, bwd["L0.mlp.up.wgrad"].n, bwd["L0.mlp.up.wgrad"].k) == (1024, 256, t)
    # Each gradient all-reduce waits for the GEMM that produced it.
    for c in w.groups[1].comm[:-1]:
        assert w.groups[1].compute[c.after].name.endswith(".wgrad")


def test_yaml_round_trip(tmp_path):
    w = build_preset("cpu-demo")
    w.save(tmp_path / "w.yaml")
    back = load_workload(tmp_path / "w.yaml")
    assert back == w and back.digest == w.digest


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["groups"][1]["comm"][0].update(op="allreduce"), "groups[1].comm[0].op"),
    (lambda d: d["groups"][0]["compute"][2].update(m=-1), "groups[0].compute[2].m"),
    (lambda d: d["groups"][1]["comm"][3].update(after=10_000), "groups[1].comm[3].after"),
    (lambda d: d.update(schema_version=9), "schema_version"),
    (lambda d: d["groups"][1]["comm"][0].update(ranks=1), "groups[1].comm[0].ranks: must be >= 2"),
    (lambda d: d["groups"][0].pop("name"), "groups[0].name"),
    (lambda d: d.update(exposed_ms=float("nan")), "exposed_ms: expected a finite number"),  # NaN passes every comparison
    (lambda d: d.update(exposed_ms=float("inf")), "exposed_ms: expected a finite number"),
    # each was accepted and measured or searched as something else than the user wrote
    (lambda d: d["groups"][0]["compute"][0].update(dtyp="bf16"), "groups[0].compute[0].dtyp: unknown field (did you mean 'dtype'?"),
    (lambda d: d["groups"][1]["comm"][0].update(rank=8), "groups[1].comm[0].rank: unknown field (did you mean 'ranks'?"),
    (lambda d: d["groups"][1].update(repeats=40), "groups[1].repeats: unknown field (did you mean 'repeat'?"),
    (lambda d: d["groups"][1]["comm"][1].update(name="grad.head"), "groups[1].comm[1].name: 'grad.head' is also comm[0]'s"),
    (lambda d: d.update(kind="lagom-plan"), "workload.kind: expected 'lagom-workload', got 'lagom-plan'"),
    # each reached a plan: a 30-digit iteration time, a role named ''
    (lambda d: d["groups"][0].update(repeat=10 ** 30), "groups[0].repeat: must be <= 1000000"),
    (lambda d: d.update(exposed_ms=1e308), "exposed_ms: must be <= 10000000.0"),
    (lambda d: d["groups"][1]["comm"][0].update(group=""), "groups[1].comm[0].group: expected a name, got ''"),
    (lambda d: d["groups"][0]["compute"][0].update(name=" "), "groups[0].compute[0].name: expected a name, got ' '"),
    (lambda d: d["groups"][1].update(name=d["groups"][0]["name"]), "groups[1].name: 'forward' is also groups[0]'s"),  # tables and timelines name groups: two could not be told apart
    (lambda d: d["groups"][1]["comm"][2].update(ranks=4), "groups[1].comm[2].ranks: communicator 'dp_replicate' has 2 ranks in workload.groups[1].comm[0], 4 here"),
    # one communicator over one node here and two there: the simulator timed one over NVLink, the other over InfiniBand
    (lambda d: d["groups"][1]["comm"][2].update(nodes=2), "groups[1].comm[2].nodes: communicator 'dp_replicate' spans 1 node(s) in workload.groups[1].comm[0], 2 here"),
    (lambda d: d["groups"][1]["comm"][0].update(ranks=10 ** 12), "groups[1].comm[0].ranks: 1000000000000 ranks, more than 1048576"),
    (lambda d: d["groups"][1]["comm"][0].update(nodes=3), "groups[1].comm[0].nodes: 3 nodes for 2 ranks"),
])
def test_bad_workloads_name_the_field(mutate, message):
    d = build_preset("cpu-demo").to_dict()
    mutate(d)
    with pytest.raises(UserError, match=re.escape(message)):
        Workload.from_dict(d)


def test_unknown_workload_name():
    with pytest.raises(UserError, match="unknown workload"):
        resolve_workload("gpt-17")


def test_bucketing_follows_ddp_rules():
    mib = 1 << 20
    comm = tuple(Collective(f"g{i}", "all_reduce", mib // 2, after=i) for i in range(8))
    # DDP's defaults: the first bucket closes at 1 MiB, later ones at 25 MiB; each waits for its last tensor
    buckets = bucket_collectives(comm, DDP_DEFAULT_CAP_MB, "dp")
    assert [b.nbytes for b in buckets] == [FIRST_BUCKET_BYTES, 3 * mib] and [b.after for b in buckets] == [1, 7]
    # a cap given: the first bucket is sized as the rest
    buckets = bucket_collectives(comm, 2, "dp")
    assert [b.nbytes for b in buckets] == [2 * mib, 2 * mib] and [b.after for b in buckets] == [3, 7]
    assert sum(b.nbytes for b in buckets) == sum(c.nbytes for c in comm)


DDP_BUCKETS = """
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
cap = None if sys.argv[1] == "none" else float(sys.argv[1])
m = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(6)]), **({} if cap is None else {"bucket_cap_mb": cap}))
for _ in range(3):
    m(torch.randn(4, 256)).sum().backward()
print(json.dumps([int(x) for x in str(m._get_ddp_logging_data()["rebuilt_bucket_sizes"]).split(", ")]))
"""


@pytest.mark.parametrize("cap", [None, 2])
def test_bucketing_matches_the_buckets_real_ddp_builds(tmp_path, cap):
    """Six 256 KiB gradients under the installed torch's DDP (one gloo rank): its rebuilt buckets
    are the model's (DDP given a cap sizes its first bucket as the rest; an auditor found the model
    closing it at 1 MiB whatever the cap, two buckets where DDP built one)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "ddp.py"
    script.write_text(DDP_BUCKETS)
    out = subprocess.run([sys.executable, script, "none" if cap is None else str(cap), f"file://{tmp_path / 'store'}"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert out.returncode == 0, out.stderr[-2000:]
    real = json.loads(out.stdout.strip().splitlines()[-1])
    grads = tuple(Collective(f"w{i}", "all_reduce", 256 * 256 * 4, after=i) for i in range(6))
    modelled = [b.nbytes for b in bucket_collectives(grads, DDP_DEFAULT_CAP_MB if cap is None else cap, "dp")]
    assert modelled == real, (modelled, real)


def test_an_exponent_yaml_reads_as_text_says_how_to_write_it():
    """`nbytes: 1e9` is a string to YAML 1.1: "expected int, got '1e9'" left the user guessing."""
    d = build_preset("cpu-demo").to_dict()
    d["groups"][1]["comm"][0]["nbytes"] = "1e9"
    with pytest.raises(UserError, match=r"got '1e9' \(YAML 1.1 reads this as text: write the exponent with a dot and a sign, 1.0e\+9"):
        Workload.from_dict(d)


def test_show_summarises_a_workload_of_many_groups(tmp_path):
    """An imported trace of 30,000 groups printed 30,000 tables (48 s, unreadable): beyond a dozen
    groups, one table of each distinct shape and collective, with the groups it is in and its runs."""
    from lagom_tune import render
    from lagom_tune.workload.spec import Gemm, OverlapGroup

    gemm, ar = Gemm("g", 64, 64, 64), Collective("ar", "all_reduce", 4096)
    groups = tuple(OverlapGroup(f"g{i}", (gemm, Gemm("h", 128, 64, 64)) if i == 0 else (gemm,), (ar,), repeat=2) for i in range(500))
    w = Workload("many", groups)
    (table,) = render.workload_tables(w)
    assert "500 groups, summarised" in str(table.title) and table.row_count == 3
    rows = list(zip(*(col.cells for col in table.columns)))
    assert ("compute", "64×64×64 fp32", "0.001", "500", "1000") in rows and ("compute", "128×64×64 fp32", "0.001", "1", "2") in rows
    assert ("comm", "all_reduce on dp (2 ranks)", "4.00 KiB", "500", "1000") in rows
    w.save(tmp_path / "many.yaml")
    r = cli("workload", "show", tmp_path / "many.yaml", check=True)
    assert "500 groups, summarised" in r.stdout and r.stdout.count("┏") == 1
    sizes = Workload("sizes", tuple(OverlapGroup(f"g{i}", (gemm,), (Collective("ar", "all_reduce", (1 << 20) + i),)) for i in range(13)))
    (table,) = render.workload_tables(sizes)  # all print as 1.00 MiB; they are 13 collectives
    assert table.row_count == 14
    small = render.workload_tables(Workload("few", groups[:3]))
    assert len(small) == 3  # a dozen groups or fewer: a table each, in stream order


def test_show_takes_a_hand_written_workload_without_kind(tmp_path):
    """`workload show` and `profile` take a workload file without `kind:` (it is optional), but
    `show` said "not a plan, workload or run folder (kind: None)"."""
    path = tmp_path / "w.yaml"
    path.write_text("name: hand\ngroups: [{name: g, compute: [{name: mm, m: 64, n: 64, k: 64}], "
                    "comm: [{name: ar, op: all_reduce, nbytes: 4096}]}]\n")
    r = cli("show", path, check=True)
    assert "hand · group g" in r.stdout, r.stdout


def test_a_date_in_a_workloads_meta_is_shown_as_json(tmp_path):
    """YAML reads ``created: 2024-05-01`` as a date, which `show --json` and `workload show
    --json` could not encode: an internal error (an audit, 2026-12-03)."""
    w = tmp_path / "w.yaml"
    w.write_text("name: dated\nmeta: {created: 2024-05-01}\ngroups:\n- name: a\n  compute: [{name: g, m: 64, n: 64, k: 64, dtype: bf16}]\n"
                 "  comm: [{name: c, op: all_reduce, nbytes: 1024, ranks: 2}]\n")
    for args in (("show", w, "--json"), ("workload", "show", w, "--json")):
        r = cli(*args)
        assert r.returncode == 0 and '"created": "2024-05-01"' in r.stdout, (args, r.stderr)


def test_cpu_demo_given_two_world_sizes_is_refused():
    """`--ranks 2 --parallel ddp=4` profiled ddp=4 and dropped --ranks without a word (an audit, 2026-12-03)."""
    with pytest.raises(UserError, match="--ranks 2 and --parallel ddp=4 give cpu-demo two world sizes"):
        resolve_workload("cpu-demo", parallel="ddp=4", ranks=2)
    assert resolve_workload("cpu-demo", parallel="ddp=4", ranks=4).world_size == resolve_workload("cpu-demo", parallel="ddp=4").world_size == 4
