"""The NCCL deployment path, tested on CPU with fakes of the torch classes."""

import inspect
import shutil
import sys
import types

import pytest

from lagom_tune.backends import nccl_tuner
from lagom_tune.knobs import Settings
from lagom_tune.plan.schema import CollectiveRule, Plan, load_plan
from lagom_tune.runtime import nccl
from lagom_tune.runtime.shim import OPTIONS_ARGUMENT, Shim, rank_reports

from conftest import cli

PLAN = Plan(
    backend="nccl", world_size=16, nodes=2, hardware={"gpu": "NVIDIA H100 80GB HBM3"}, groups={"dp": 16, "tp": 8},
    settings=Settings({"threads": 256, "buffsize": 2 << 20}),
    rules=(CollectiveRule("all_gather", "dp", 1 << 20, 1 << 28, {"algo": "ring", "proto": "simple", "channels": 2}),
           CollectiveRule("reduce_scatter", "dp", 1 << 20, 1 << 28, {"algo": "ring", "proto": "ll128", "channels": 4}),
           CollectiveRule("all_reduce", "tp", 1, 1 << 26, {"algo": "tree", "proto": "ll", "channels": 8})),
)


class FakeOptions:
    def __init__(self):
        self.config = types.SimpleNamespace(min_ctas=-1, max_ctas=-1)


def fake_c10d():
    calls = []
    mod = types.SimpleNamespace(ProcessGroupNCCL=types.SimpleNamespace(Options=FakeOptions), calls=calls)

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None):
        calls.append(("init", backend, world_size, pg_options))

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None):
        calls.append(("new_group", backend, len(ranks or []), pg_options))

    mod.init_process_group, mod.new_group, mod.get_world_size = init_process_group, new_group, lambda: 16
    return mod


def test_tuner_rules_have_one_line_per_rule():
    rules = nccl.tuner_rules(PLAN)
    lines = rules.text().splitlines()
    assert nccl.RULES_HEADER in lines
    assert lines[lines.index(nccl.RULES_HEADER) + 1:] == [
        "allgather 16 2 1048576 268435456 ring simple 2",  # the world communicator: 16 ranks on the plan's 2 nodes
        "reducescatter 16 2 1048576 268435456 ring ll128 4",
        "allreduce 8 * 1 67108864 tree ll 8"]  # 8 of 16 ranks: the plan does not say on how many nodes
    assert rules.not_deployable == ()


def test_all_to_all_rules_are_reported_not_deployable():
    import dataclasses

    plan = dataclasses.replace(PLAN, rules=PLAN.rules + (CollectiveRule("all_to_all", "dp", 0, 10, {"channels": 2}),))
    rules = nccl.tuner_rules(plan)
    assert len(rules.rules) == 3 and [r.op for r, _ in rules.not_deployable] == ["all_to_all"]


def test_communicator_bounds_cover_every_rule_of_the_role():
    cfgs = nccl.communicator_configs(PLAN)
    assert (cfgs["dp"].min_ctas, cfgs["dp"].max_ctas, cfgs["dp"].ranks) == (2, 4, 16)
    assert nccl.role_for(cfgs, 8).role == "tp" and nccl.role_for(cfgs, 3) is None
    # with the tuner plugin setting each call's channels, the communicator holds the largest rule's:
    # NCCL sets it up with max(min(topology, max_ctas), min_ctas) channels and no call runs on more,
    # so 2..4 on a topology of 3 would cut the 4-channel rule to 3
    per_call = nccl.communicator_configs(PLAN, per_call=True)
    assert (per_call["dp"].min_ctas, per_call["dp"].max_ctas) == (4, 4) and (per_call["tp"].min_ctas, per_call["tp"].max_ctas) == (8, 8)


def test_shim_injects_options_into_process_groups(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d()
    shim.on_c10d(c10d)
    c10d.init_process_group("nccl", world_size=16, rank=0)
    c10d.new_group(ranks=list(range(8)), backend="nccl")
    c10d.new_group(ranks=[0, 1, 2], backend="nccl")  # no role of 3 ranks: left alone
    c10d.init_process_group("gloo", world_size=16)  # not NCCL: left alone
    (_, _, _, world_opts), (_, _, _, tp_opts), (_, _, _, none), (_, _, _, gloo) = c10d.calls
    assert (world_opts.config.min_ctas, world_opts.config.max_ctas) == (2, 4)
    assert (tp_opts.config.min_ctas, tp_opts.config.max_ctas) == (8, 8)
    assert none is None and gloo is None
    assert [r["setting"] for r in shim.records] == ["ctas[dp]", "ctas[tp]"]
    # the plan's rules deployed through the tuner plugin in this process: the largest rule's channels for the role
    plugin, rules = tmp_path / "libnccl-tuner.so", tmp_path / "x.rules"
    plugin.write_bytes(b"")
    rules.write_text("")
    monkeypatch.setenv(nccl_tuner.PLUGIN_ENV, str(plugin))
    monkeypatch.setenv(nccl_tuner.RULES_ENV, str(rules))
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d()
    shim.on_c10d(c10d)
    c10d.init_process_group("nccl", world_size=16, rank=0)
    (_, _, _, world_opts), = c10d.calls
    assert (world_opts.config.min_ctas, world_opts.config.max_ctas) == (4, 4)


def test_a_tuner_file_missing_on_this_node_is_named(tmp_path, monkeypatch):
    """`--print-env` on one host exports the plugin and rules from its cache: a node without them
    was told there was no C compiler when apply ran."""
    plugin, rules = tmp_path / "libnccl-tuner.so", tmp_path / "x.rules"
    rules.write_text("lagom-tune-tuner-rules 1\n")
    monkeypatch.setenv(nccl_tuner.PLUGIN_ENV, str(plugin))
    monkeypatch.setenv(nccl_tuner.RULES_ENV, str(rules))
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    shim.on_torch_nccl(None)
    (record,) = [r for r in shim.records if r["setting"] == "collective_rules"]
    assert not record["applied"] and f"{nccl_tuner.PLUGIN_ENV}={plugin}: no such file on this node" in record["how"]
    monkeypatch.delenv(nccl_tuner.PLUGIN_ENV)
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    shim.on_torch_nccl(None)
    assert "no tuner plugin in the environment" in shim.records[0]["how"]


def test_the_users_own_options_are_kept_and_bounded(tmp_path):
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d()
    shim.on_c10d(c10d)
    mine = FakeOptions()
    mine.is_high_priority_stream = True
    c10d.init_process_group(backend="nccl", world_size=16, pg_options=mine)
    assert c10d.calls[0][3] is mine and mine.config.max_ctas == 4 and mine.is_high_priority_stream
    # the same Options reused for a group of no role: it had kept the world role's bounds
    c10d.new_group(ranks=[0, 1, 2], backend="nccl", pg_options=mine)
    assert c10d.calls[1][3] is mine and (mine.config.min_ctas, mine.config.max_ctas) == (-1, -1)


def test_a_group_maker_without_pg_options_is_reported_not_applied(tmp_path, monkeypatch):
    """Set as an argument the call lacks, the bounds were dropped by the binding while the record
    said applied: a torch whose new_group takes no pg_options is named instead."""
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    c10d = fake_c10d()

    def new_group(ranks=None, timeout=None, backend=None):
        c10d.calls.append(("new_group", backend, len(ranks or []), None))

    c10d.new_group = new_group
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    shim.on_c10d(c10d)
    c10d.new_group(ranks=list(range(8)), backend="nccl")
    (record,) = shim.records
    assert record["setting"] == "ctas[tp]" and not record["applied"]
    assert "this torch's new_group takes no pg_options" in record["how"]
    assert shim.communicators[0].not_applied["ctas"] == "8..8: this torch's new_group takes no pg_options"


# The arguments the shim reads from each group maker's call (and pg_options, which it also sets),
# by name: one renamed in a torch release would be read as absent.
SHIM_READS = {"init_process_group": ("backend", "init_method", "rank", "world_size", OPTIONS_ARGUMENT),
              "new_group": ("ranks", "backend", "group_desc", OPTIONS_ARGUMENT),
              "split_group": ("parent_pg", "split_ranks", "group_desc", OPTIONS_ARGUMENT)}  # torch 2.5 and later


def test_this_torchs_group_makers_take_the_arguments_the_shim_reads():
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import DeviceMesh

    for name, reads in SHIM_READS.items():
        fn = getattr(distributed_c10d, name, None)
        if fn is None:
            assert name == "split_group", f"this torch has no {name}"
            continue
        missing = set(reads) - set(inspect.signature(fn).parameters)
        assert not missing, f"{name} takes no {sorted(missing)} in this torch"
    # and the mesh's own group maker, where it has one (2.6 and later): the dimension it makes a group for
    one = getattr(DeviceMesh, "_init_one_process_group", None)
    assert one is None or "dim_name" in inspect.signature(one).parameters


def test_environment_overrides_are_reported_not_hidden(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_MAX_CTAS", "32")
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), None)
    c10d = fake_c10d()
    shim.on_c10d(c10d)
    c10d.init_process_group("nccl", world_size=16)
    assert c10d.calls[0][3] is None
    (rec,) = shim.records
    assert not rec["applied"] and "NCCL_MAX_CTAS" in rec["how"]


def test_dry_run_shows_options_environment_and_tuner_plugin(tmp_path):
    plan = PLAN.save(tmp_path / "nccl.yaml")
    assert load_plan(plan).to_dict() == PLAN.to_dict()
    r = cli("apply", plan, "--dry-run", "--", "torchrun", "--nnodes", "2", "--nproc-per-node", "8", "train.py",
            env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    out = r.stdout + r.stderr
    assert "NCCL_NTHREADS=256" in out and "NCCL_BUFFSIZE=2097152" in out
    assert "allgather 16 2 1048576 268435456 ring simple 2" in out
    if shutil.which("cc"):
        assert f"NCCL_TUNER_PLUGIN={tmp_path / 'cache'}/lagom-tune/" in out and f"{nccl_tuner.RULES_ENV}=" in out
        # the plugin sets each call's channels: the communicator is set up with the role's largest rule's
        assert "config.min_ctas=4, config.max_ctas=4" in out
    else:
        assert "no C compiler found" in out and "config.min_ctas=2, config.max_ctas=4" in out  # bounds are all there is


def test_an_nccl_plan_is_refused_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    plan = PLAN.save(tmp_path / "nccl.yaml")
    r = cli("apply", plan, "--", "true")
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr


ONE_RANK = """
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://STORE", rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
dist.destroy_process_group()
print("one rank ok")
"""


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU and NCCL")
def test_apply_reaches_a_real_nccl_communicator(tmp_path):
    """NCCL's own log (INIT, TUNING, ENV) shows the plan's process settings, CTA bounds and our tuner
    plugin loaded by name and reading the plan's rules, on a one-rank communicator."""
    import json
    import re

    import torch

    from lagom_tune.backends.tuner_build import LIBRARY_NAME

    plan = Plan(backend="nccl", world_size=1, nodes=1, hardware={"gpu": torch.cuda.get_device_name()}, groups={"world": 1},
                settings=Settings({"threads": 256, "buffsize": 2 << 20}),
                rules=(CollectiveRule("all_reduce", "world", 1, 1 << 30, {"algo": "ring", "proto": "simple", "channels": 2}),))
    path = plan.save(tmp_path / "one.yaml")
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK.replace("STORE", str(tmp_path / "store")))
    applied = tmp_path / "applied.json"
    r = cli("apply", path, "--applied", applied, "--", sys.executable, script,
            env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,TUNING,ENV", "XDG_CACHE_HOME": str(tmp_path / "cache")},
            timeout=240)
    log = r.stdout + r.stderr
    assert r.returncode == 0 and "one rank ok" in log, log[-3000:]
    evidence = [line for line in log.splitlines()
                if re.search(r"NCCL_NTHREADS|NCCL_BUFFSIZE|coll channels|CTA|TUNER|[Tt]uner|lagom-tune tuner", line)]
    print("\n".join(evidence))  # shown with -rP: the NCCL lines the check rests on
    assert any("NCCL_NTHREADS set by environment to 256" in line for line in evidence), log[-3000:]
    assert any("NCCL_BUFFSIZE set by environment to 2097152" in line for line in evidence), log[-3000:]
    channels = [int(m.group(1)) for m in re.finditer(r"(\d+) coll channels", log)]
    assert channels and max(channels) <= 2, evidence  # max_ctas = 2 from the plan's one rule
    # NCCL names the tuner it loaded: "TUNER/Plugin: Using lagom-tune (v5)" (2.28-2.29; vN is the
    # newest symbol that NCCL knows) and "Successfully loaded external tuner plugin <path>" (2.23+).
    loaded = [line for line in evidence if re.search(r"TUNER/Plugin: Using (tuner plugin:? )?lagom-tune\b", line)
              or ("Successfully loaded external tuner plugin" in line and LIBRARY_NAME in line)]
    assert loaded, evidence
    # Our plugin's own INFO lines (NCCL_TUNING) show it read the plan's rules in NCCL's process.
    assert any("lagom-tune tuner: 1 of 1 rules from" in line and "(nRanks 1, nNodes 1)" in line for line in evidence), evidence
    # NCCL may run a one-rank all-reduce without asking the tuner; when it asks, the rule applies.
    verdicts = [line for line in evidence if "lagom-tune tuner: rule at line" in line]
    assert all(line.rstrip().endswith("applied") for line in verdicts), verdicts
    record = json.loads(applied.read_text())
    records = [rec for rank in record["ranks"].values() for rec in rank["records"]]
    assert any(rec["setting"] == "ctas[world]" and rec["applied"] for rec in records), record
    assert any(rec["setting"] == "collective_rules" and rec["applied"] for rec in records), record
    # the plugin's counts, read by the rank's shim at exit (one rank: NCCL may never ask the tuner)
    assert any(rec["setting"] == "collective_rules_reached" for rec in records), record
    # NCCL's own choice for each call it asked about: a one-rank cost table holds ring/simple alone
    own = [line for rec in records if rec["setting"] == "nccl_defaults_as_modelled" for line in rec["value"]]
    assert all(re.fullmatch(r"all_reduce \d+\.\.\d+ B within a node: ring/simple x\d+", line) for line in own), own


def test_a_process_that_joins_a_group_itself_is_recorded_as_a_rank(tmp_path, monkeypatch):
    """No torchrun (a plain script, mpirun): init_process_group(rank=...) makes the process a rank,
    so applied.json records it (seen empty on the H200 before)."""
    for var in ("RANK", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS"):
        monkeypatch.delenv(var, raising=False)
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), str(tmp_path))
    c10d = fake_c10d()
    shim.on_c10d(c10d)
    c10d.init_process_group("nccl", world_size=16, rank=3)
    (rec,) = rank_reports(tmp_path)["3"]["records"]
    assert rec["setting"] == "ctas[dp]" and rec["applied"]
    # ... or gives both in init_method's URL: the world was recorded as a group of 0 ranks (no role),
    # and the process as "pid..." (a second report per rank at exit)
    url = tmp_path / "url"
    url.mkdir()
    shim = Shim(PLAN, str(tmp_path / "p.yaml"), str(url))
    c10d = fake_c10d()
    shim.on_c10d(c10d)
    c10d.init_process_group("nccl", init_method="tcp://127.0.0.1:29500?rank=5&world_size=16")
    (rec,) = rank_reports(url)["5"]["records"]
    assert rec["setting"] == "ctas[dp]" and rec["applied"]


NCCL_LOG = """\
h:1:2 [0] NCCL INFO AllReduce: 4 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..0}
h:1:2 [0] NCCL INFO AllGather: 65536 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..1}
h:1:2 [0] NCCL INFO AllGather: 65536 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..1}
h:1:2 [0] NCCL INFO ReduceScatter: 1048576 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..2}
h:1:2 [0] NCCL INFO AllReduce: 4194304 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..7}
"""


def test_what_nccl_ran_each_rules_calls_with_is_held_against_the_rule():
    """NCCL's log (a communicator's rank 0, NCCL_DEBUG_SUBSYS=TUNING) against the plan's rules: an
    all-gather's logged bytes are one rank's (65536 x 16 ranks is in the rule's range); the
    reduce-scatter ran on 3 channels where its rule asks for 4 (a communicator set up with fewer)."""
    from lagom_tune.backends.nccl_log import calls

    report = nccl.nccl_ran(PLAN, calls(NCCL_LOG + "h:1:2 [0] NCCL INFO Broadcast: 8 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}\n"))
    checks, unmatched = report.checks, report.unmatched
    assert [(c.rule.op, c.nbytes, c.algo, c.proto, c.channels, c.calls, c.as_planned) for c in checks] == [
        ("all_gather", 65536, "ring", "simple", 2, 2, True), ("reduce_scatter", 1048576, "ring", "ll128", 3, 1, False),
        # the barrier's 4 bytes ran on one channel: too small to give the rule's 8 channels NCCL's minimum traffic each, as planned
        ("all_reduce", 4, "tree", "ll", 1, 1, True), ("all_reduce", 4194304, "tree", "ll", 8, 1, True)]
    assert unmatched == 1  # the broadcast: no rule
    assert "the plan ring/ll128 on 4 channels, NCCL ran ring/ll128 on 3 channels x1" in checks[1].describe()
    assert report.missed == ()  # every rule had calls


def test_show_names_a_rule_no_logged_call_matched_and_the_sizes_nccl_was_called_with(tmp_path):
    """A plan profiled with bf16 gradients against a job that reduces them in fp32 (torchtitan):
    its exact-size reduce-scatter rule matched no logged call and `show --nccl-log` said nothing
    of it. It now names the rule, the reduce-scatter sizes the log has (one rank's bytes times the
    role's 8 ranks, as the rule counts them) and the dtype."""
    bf16 = 157_352_960
    plan = Plan(backend="nccl", world_size=8, nodes=1, hardware={"gpu": "NVIDIA H100 80GB HBM3"}, groups={"dp_shard": 8},
                settings=Settings({}), rules=(CollectiveRule("reduce_scatter", "dp_shard", bf16, bf16, {"channels": 4}),
                                              CollectiveRule("all_gather", "dp_shard", bf16, bf16, {"channels": 4})))
    path = plan.save(tmp_path / "fsdp.yaml")
    log = tmp_path / "nccl.log"
    per_rank = 2 * bf16 // 8  # fp32: twice the bytes, one rank's share logged
    log.write_text(f"h:1:2 [0] NCCL INFO AllGather: {bf16 // 8} Bytes -> Algo RING proto SIMPLE channel{{Lo..Hi}}={{0..3}}\n"
                   + f"h:1:2 [0] NCCL INFO ReduceScatter: {per_rank} Bytes -> Algo RING proto SIMPLE channel{{Lo..Hi}}={{0..7}}\n" * 2)
    out = cli("show", path, "--nccl-log", log, check=True).stdout
    assert "as planned: all_gather on dp_shard" in out
    line = next(x for x in out.splitlines() if x.startswith("no logged call matched:"))
    assert f"reduce_scatter on dp_shard {bf16}..{bf16} B; NCCL's log has reduce_scatter calls of {2 * bf16} B x2" in line
    assert "another dtype" in line and "--reduce-dtype" in line and "2 logged call(s) matched no rule" in out


def test_show_holds_nccls_log_against_the_plan(tmp_path):
    plan = PLAN.save(tmp_path / "nccl.yaml")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "nccl.gpu01.4242.log").write_text(NCCL_LOG)
    out = cli("show", plan, "--nccl-log", logs, check=True).stdout
    assert "not as planned: reduce_scatter on dp 1048576..268435456 B: the plan ring/ll128 on 4 channels, NCCL ran" in out
    assert "as planned: all_gather on dp" in out and "matched no rule" not in out
    for args, said in (([logs / "gone"], "--nccl-log"), ([tmp_path / "nccl.yaml"], "no collective call in")):
        r = cli("show", plan, *[x for a in args for x in ("--nccl-log", a)])
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
