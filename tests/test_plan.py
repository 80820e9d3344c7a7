import copy
import math
from dataclasses import replace

import pytest
import yaml

from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.plan.schema import CollectiveRule, Plan, load_plan
from lagom_tune.workload.presets import build_preset
from lagom_tune.render import replay_rows, replay_shortfall

from conftest import ROOT, RULES_PLAN

BASE = Plan(backend="gloo", world_size=2, hardware={"device": "cpu", "cores": 2}, groups={"dp": 2},
            settings=Settings({"threads": 1}, {"dp": {"bucket_cap_mb": 8}}),
            workload={"name": "cpu-demo", "digest": "sha256:0"},
            predicted={"iteration_ms": {"default": 10.0, "autoccl": 10.0, "plan": 9.0}, "bound_ms": 8.0})


def test_round_trip(tmp_path):
    path = BASE.save(tmp_path / "p.yaml")
    back = load_plan(path)
    assert back.to_dict() == BASE.to_dict()
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temp file


def test_a_plan_written_again_keeps_its_permissions_and_its_link(tmp_path):
    """An audit, 2026-12-07: a plan made 0600 by its owner was 0644 once search wrote it again, and
    a plan.yaml linked to a shared copy became a file of its own, the copy never updated."""
    private = BASE.save(tmp_path / "private.yaml")
    private.chmod(0o600)
    BASE.save(private)
    assert private.stat().st_mode & 0o777 == 0o600
    shared = BASE.save(tmp_path / "shared" / "plan.yaml")
    link = tmp_path / "plan.yaml"
    link.symlink_to(shared)
    replace(BASE, world_size=4, groups={"dp": 4}).save(link)
    assert link.is_symlink() and load_plan(shared).world_size == 4
    assert not list(tmp_path.glob("**/.*.tmp"))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(schema_version=7), "unknown version 7"),
    (lambda d: d.update(kind="lagom-workload"), "is this a plan file"),
    (lambda d: d["target"].update(backend="mpi"), "unknown backend"),
    (lambda d: d["process"].update(threads=3), r"process.threads: 3 is outside"),
    (lambda d: d["process"].update(threads=2.0), r"process.threads: 2.0 is outside"),  # was exported as OMP_NUM_THREADS=2.0
    (lambda d: d["process"].update(threads=True), r"process.threads: True is outside"),
    (lambda d: d["communicators"]["dp"].update(bucket_cap_mb="big"), "outside bucket_cap_mb"),
    (lambda d: d["process"].update(bucket_cap_mb=8), "deploys per communicator"),
    (lambda d: d["communicators"]["dp"].update(warp_speed=9), "communicators.dp.warp_speed: unknown knob"),
    (lambda d: d["target"].update(world_size=0), "world_size: must be >= 1"),
    # no roles: the runtime applied "dp"'s settings to every communicator
    (lambda d: d["target"].update(groups={}), r"communicators.dp: no role 'dp' in .*target.groups \(none\)"),
    # the tuner plugin refused each when NCCL loaded it, dropping every rule of the plan
    (lambda d: d.update(collectives=[{"match": {"op": "all_reduce"}, "set": {}}]), r"collectives\[0\].set: the rule sets nothing"),
    (lambda d: d.update(collectives=[{"match": {"op": "all_reduce", "max_bytes": 2 ** 64}, "set": {}}]),
     r"collectives\[0\].match.max_bytes: must be <= 9223372036854775807"),
    # the sections beside the settings, shown as they were (a plan of 0 ms below its bound)
    (lambda d: d["target"]["hardware"].update(cores=-1), r"target.hardware.cores: must be >= 1"),
    (lambda d: d["target"]["hardware"].update(gpu=[1]), r"target.hardware.gpu: expected str"),
    (lambda d: d["target"]["hardware"].update(sm=132), r"target.hardware.sm: unknown field \(did you mean 'sms'"),
    (lambda d: d["search"].update(evaluations=float("nan")), r"search.evaluations: expected int"),
    (lambda d: d["predicted"]["iteration_ms"].update(plan=0), r"predicted.iteration_ms.plan: must be >= 1e-09"),
    # hand-edited records show printed as given (an audit, 2026-12-04): a 31-digit time, a negative gain
    (lambda d: d["predicted"]["iteration_ms"].update(plan=1e30), r"predicted.iteration_ms.plan: must be <= 1"),
    (lambda d: d["predicted"]["iteration_ms"].pop("plan"), r"predicted.iteration_ms.plan: required field is missing"),
    (lambda d: d["search"].update(options={"min_gain": -1}), r"search.options.min_gain: must be >= 0"),
    (lambda d: d["search"].update(options={"min_gain": "abc"}), r"search.options.min_gain: expected float"),
    (lambda d: d["search"].update(options={"min_gain": 2.5}), r"search.options.min_gain: must be <= 1"),
    (lambda d: d["search"].update(options={"n_trial": 5}), r"search.options.n_trial: unknown field \(did you mean 'n_trials'"),
    (lambda d: d.update(tool={"name": [1]}), r"tool.name: expected str"),
    # YAML reads `2:` as a number: show crashed, apply ran with the setting never applied
    (lambda d: d.update(communicators={2: {"bucket_cap_mb": 8}}), r"communicators: key 2 is read as int, not a name"),
    (lambda d: d["target"].update(groups={2: 2}), r"target.groups: key 2 is read as int, not a name"),
    (lambda d: d.update(collectives=[{"match": {"op": "all_reduce"}, "set": {"threads": 1}}]), "deploys per process"),
    # an audit, 2026-12-07: a number past a float's range was an OverflowError (exit 1), a count of
    # 10^12 ranks or of 400 digits was taken, a misspelt or unknown record field dropped unread
    (lambda d: d["predicted"].update(bound_ms=10 ** 400), r"predicted.bound_ms: must be <= 1.*got a number of about 400 digits"),
    (lambda d: d["target"].update(world_size=10 ** 12), r"target.world_size: must be <= 1048576"),
    (lambda d: d["target"]["hardware"].update(cores=10 ** 400), r"hardware.cores: must be <= 9223372036854775807, got a number"),
    (lambda d: d["predicted"].update(bogus_ms=1), r"predicted.bogus_ms: unknown field"),
    (lambda d: d["search"].update(left_to_backend=["warp_drive"]), r"left_to_backend\[0\]: expected one of the backend's knobs"),
    # ... and names holding terminal escapes (ESC [2J cleared the screen) or line breaks were printed
    (lambda d: d["workload"].update(name="cpu\x1b[2J-demo"), r"workload.name: holds a control character \('\\x1b'\)"),
    (lambda d: d["target"]["hardware"].update(device="cpu\nfast"), r"hardware.device: expected one line without tabs"),
    (lambda d: d["workload"].update(name="cpu\tdemo"), r"workload.name: expected one line without tabs"),
])
def test_bad_plans_are_refused_with_the_field(mutate, message):
    d = copy.deepcopy(BASE.to_dict())
    mutate(d)
    with pytest.raises(UserError, match=message):
        Plan.from_dict(d)


def _nccl_plan() -> dict:
    return yaml.safe_load(RULES_PLAN.read_text())


def _set_rule(d: dict, **match) -> None:
    d["collectives"][0]["match"].update(match)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: _set_rule(d, min_bytes=1 << 40, max_bytes=1 << 20), "min_bytes 1099511627776 is above max_bytes 1048576; the rule matches nothing"),
    (lambda d: (_set_rule(d, op="all_gather"), d["collectives"][0]["set"].update(algo="tree")), "'tree' does not apply to all_gather"),
    (lambda d: _set_rule(d, group="pp"), r"match.group: no role 'pp' in plan.target.groups \(tp, dp_replicate\)"),
    # a misspelt or missing section read as absent: nothing applied, nothing said (a file cut short too)
    (lambda d: d.update(communicator=d.pop("communicators")), r"plan.communicator: unknown field \(did you mean 'communicators'\?"),
    (lambda d: d.pop("collectives"), "plan.collectives: required field is missing"),
    (lambda d: d["target"].update(world=16), r"plan.target.world: unknown field \(did you mean 'world_size'\?"),
    (lambda d: _set_rule(d, max_byte=1), r"match.max_byte: unknown field \(did you mean 'max_bytes'\?"),
    (lambda d: d["communicators"].update(pp={}), "communicators.pp: no role 'pp'"),
    (lambda d: d["target"]["groups"].update(dp=32), "groups.dp: 32 ranks, more than the world size 16"),
    (lambda d: d["validated"].update(same_settings="no"), r"validated.same_settings: expected"),  # printed the caption
    (lambda d: d["target"].update(nodes=3), "target.nodes: 3 nodes cannot hold 16 ranks evenly"),  # 5 nodes of 2 ranks ran
    # channels beyond what the profiled GPUs offered (an A40 offers 32) reached the rules file
    (lambda d: (d["target"].update(backend="nccl"), d["target"]["hardware"].pop("cluster"), d["target"]["hardware"].update(max_channels=32)),
     r"collectives\[0\].set.channels: 64"),
    (lambda d: (d["target"]["hardware"].update(cluster="a40-pcie"), d["collectives"][0]["set"].update(proto="simple")),
     r"collectives\[0\].set.channels: 64"),
    # LL128 where NCCL does not offer it (an A40; GPUs over PCIe): the plugin could not deploy it
    (lambda d: d["target"]["hardware"].update(cluster="a40-nvlink"), r"collectives\[0\].set.proto: 'll128' is outside proto's domain"),
    (lambda d: (d["target"].update(backend="nccl"), d["target"]["hardware"].pop("cluster"), d["target"]["hardware"].update(ll128=False)),
     r"collectives\[0\].set.proto: 'll128' is outside"),
    (lambda d: d["target"]["hardware"].update(ll128="yes"), "hardware.ll128: expected bool"),
    (lambda d: d["target"]["hardware"].update(max_channels="many"), "hardware.max_channels: expected"),
    (lambda d: d["target"].update(simulated=False), "target.simulated: False, but the sim backend simulates"),  # apply ran it
    # ... and relabelled as a whole, every flag with it: apply ran settings searched on a simulator
    (lambda d: (d["target"].update(backend="nccl", simulated=False), d["predicted"].update(simulated=False),
                d["validated"].update(simulated=False, method="replay")),
     r"target.hardware.cluster: 'h100-nvlink' is a simulated cluster, but the nccl backend measures"),
    # shown as they were ("plan for [1]")
    (lambda d: d["workload"].update(name=[1]), "workload.name: expected str"),
    # misspelt records beside the settings were loaded as they were (kept_default unread: no caption)
    (lambda d: d["search"].update(kept_defualt="x"), r"search.kept_defualt: unknown field \(did you mean 'kept_default'\?"),
    (lambda d: d["workload"].update(a=1), r"workload.a: unknown field"),
    (lambda d: d["model"].update(mapes={}), r"model.mapes: unknown field \(did you mean 'mape'\?"),
    (lambda d: d["validated"].update(repeats="abc"), "validated.repeats: expected int"),
    # shown as "measured default (replay)" beside a method that said "simulated replay"
    (lambda d: d["validated"].update(simulated=False), "validated.simulated: the replay is said to be measured, but the plan's target is a simulated"),
    # show --json then carried "predicted": {"simulated": false} for a simulated plan's predictions
    (lambda d: d["predicted"].update(simulated=False), "predicted.simulated: False, but the plan's target is a simulated cluster"),
    # report printed the stored 3.5, show the ratio of the times
    (lambda d: d["validated"].update(speedup=3.5), r"validated.speedup: 3.5, but its replay times give"),
    # shown as a 58.8x speed-up, far below what no setting can beat
    (lambda d: d["predicted"]["iteration_ms"].update(plan=1.0), r"predicted.iteration_ms.plan: 1.0 ms, below the contention-free bound"),
    (lambda d: d["validated"].update(method=[1]), "validated.method: expected str"),
    (lambda d: d["validated"].update(spread_ms={"plan": 5}), r"validated.spread_ms.plan: expected \[least, most\]"),
    # the replay's speed-up is the geometric mean of its rounds' ratios, which lies in its interval
    (lambda d: d["validated"].update(speedup=1.05, interval=[1.1, 1.2]), r"validated.speedup: 1.05, outside its interval 1.1-1.2"),
    (lambda d: d["validated"].update(interval=[1.2, 1.1]), r"validated.interval: expected \[low, high\] speed-ups"),
    (lambda d: d["validated"].update(interval=[1.0, float("inf")]), r"validated.interval: expected \[low, high\] speed-ups"),
    # ... and the ratios it records are its rounds', one per repeat
    (lambda d: d["validated"].update(ratios=[1.0998, 1.0998]), r"validated.ratios: 2 ratios for 3 repeats"),
    (lambda d: d["validated"].update(ratios=[1.05, 1.05, 1.05]), r"validated.speedup: 1.0998, but the geometric mean of its rounds' ratios is 1.0500"),
    (lambda d: d["validated"].update(ratios=[1.1, 0, 1.1]), r"validated.ratios.1: must be >= "),
    (lambda d: d["validated"].update(ratios="1.1"), r"validated.ratios: expected list"),
    # an audit, 2026-12-07: each was taken, and shown or deployed
    (lambda d: d["validated"].update(spedup=1.0), r"validated.spedup: unknown field \(did you mean 'speedup'\?"),
    (lambda d: d.update(validated={"speedup": 2.0}), r"validated.method: required field is missing"),
    (lambda d: d["validated"].pop("iteration_ms"), r"validated.iteration_ms: required field is missing"),
    (lambda d: d["validated"].update(speedup=0.0, interval=[0.0, 0.0], ratios=None), r"validated.speedup: must be >= 1e-09"),
    (lambda d: d["validated"]["spread_ms"].update(plan=[1.0, 10 ** 400]), r"validated.spread_ms.plan: expected \[least, most\] ms"),
    # a second rule the first covers never applies (the first match is taken)
    (lambda d: d["collectives"].append(copy.deepcopy(d["collectives"][0])), r"collectives\[2\]: never applies: collectives\[0\] before it"),
    (lambda d: d["collectives"].insert(0, {"match": {"op": "all_reduce", "group": "*"}, "set": {"channels": 8}}),
     r"collectives\[1\]: never applies: collectives\[0\]"),
    (lambda d: d["target"]["hardware"].update(cluster="z100"), r"plan.target.hardware: cluster 'z100' .*is no simulated cluster"),
])
def test_plans_that_cannot_mean_what_they_say_are_refused(mutate, message):
    """Each was accepted by show and apply --dry-run: a rule that matches nothing, NCCL's tree on
    an all-gather, a setting for a role the target does not have, a role larger than the world."""
    d = _nccl_plan()
    Plan.from_dict(d)
    mutate(d)
    with pytest.raises(UserError, match=message):
        Plan.from_dict(d)


def test_garbled_yaml_is_a_user_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("schema_version: 1\nkind: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_plan(p)
    p.write_text(yaml.safe_dump(["a", "list"]))
    with pytest.raises(UserError, match="not a plan file: its top level is a list, not a YAML mapping"):
        load_plan(p)
    p.write_text(BASE.save(tmp_path / "ok.yaml").read_text().replace("process: {threads: 1}", "process: {threads: 1, threads: 4}"))
    with pytest.raises(UserError, match=r"key 'threads' is given twice in one mapping \(line \d+\)"):  # PyYAML kept the last
        load_plan(p)
    p.write_text("schema_version: 1\nkind: lagom-plan\ntarget: {world_size: 1" + "0" * 5000 + "}\n")
    with pytest.raises(UserError, match=r"a value cannot be read \(Exceeds the limit \(4300 digits\)"):  # was exit 1
        load_plan(p)
    p.write_text("[" * 5000 + "]" * 5000)
    # was RecursionError, exit 1; PyYAML before 6.0.2 reads the whole list, which is no plan either
    with pytest.raises(UserError, match="nested too deeply|exceeded maximum nesting depth|top level is a list"):
        load_plan(p)


def test_a_communicator_the_search_left_at_the_defaults_gets_no_rule():
    """A plan pinned ring/simple/16 channels on every collective it had settings for, those of
    communicators the search never changed too, overriding what NCCL picks for them (NVLS, tree,
    LL). Within a changed communicator every collective keeps its rule: the role's CTA bounds
    come from its rules' channels."""
    from lagom_tune.backends.nccl_knobs import nccl_knob_space
    from lagom_tune.planning import collective_rules
    from lagom_tune.search.result import SearchResult
    from lagom_tune.search.run import SearchOutcome
    from lagom_tune.search.space import default_assignment, variables
    from lagom_tune.workload.presets import build_preset

    def rules(preset: str, op: str):
        w = build_preset(preset)
        vars_ = variables(w, nccl_knob_space())
        defaults = default_assignment(vars_)
        key = next(c.rule_key for c in w.collectives() if c.op == op)
        result = lambda a: SearchResult("lagom", Settings.from_assignment(a, vars_), None, 1, 0.0)  # noqa: E731
        changed = SearchOutcome(result({**defaults, f"collective:{key}:channels": 4}), result(defaults), result(defaults), 0.0)
        assert collective_rules(w, SearchOutcome(result(defaults), result(defaults), result(defaults), 0.0)) == ()
        return [(r.op, r.group, r.set["algo"], r.set["channels"]) for r in collective_rules(w, changed)]

    # the tensor-parallel all-reduce changed: the data-parallel one is left to NCCL
    assert rules("phi-2-tp8-dp2", "all_reduce") == [("all_reduce", "tp", "ring", 4)]
    # the all-gather changed: the reduce-scatter on the same communicator keeps its rule
    assert rules("phi-2-fsdp16", "all_gather") == [("all_gather", "dp_shard", "ring", 4), ("reduce_scatter", "dp_shard", "ring", 16)]


def test_a_rule_matches_its_collective_within_a_tolerance_short_of_the_next_size():
    """Rules were exact-size: a job whose model differs from the preset by a norm or FSDP2's row
    padding (a few KB of a layer) matched none of them. Each rule now holds its size within 10%,
    never reaching the midpoint to the next size of the op on any role, so another dtype (x2) or
    a neighbouring collective still matches no rule of the wrong size."""
    from lagom_tune.planning import SIZE_TOLERANCE, size_bands

    bands = size_bands([1000, 2000, 2100, 1000, 50_000])
    assert bands[1000] == (910, 1100) and bands[50_000] == (45455, 55000)
    assert bands[2000][1] < bands[2100][0] and bands[2000][1] == math.isqrt(2000 * 2100)  # midpoint, not +10%
    ordered = sorted(bands.items())
    assert all(lo <= n <= hi for n, (lo, hi) in ordered) and all(a[1][1] < b[1][0] for a, b in zip(ordered, ordered[1:]))
    w = build_preset("phi-2-fsdp16")
    (rs,) = [c for c in w.collectives() if c.op == "reduce_scatter"]
    lo, hi = size_bands([c.nbytes for c in w.collectives() if c.op == "reduce_scatter"])[rs.nbytes]
    rule = CollectiveRule("reduce_scatter", "dp_shard", lo, hi, {"channels": 4})
    one_norm_fewer = replace(rs, nbytes=rs.nbytes - 2 * 2560 * 2)  # HF's Phi-2 has one LayerNorm a layer
    assert rule.matches(one_norm_fewer) and not rule.matches(replace(rs, nbytes=2 * rs.nbytes))  # fp32: another size
    assert hi == math.floor(rs.nbytes * (1 + SIZE_TOLERANCE))


def test_a_cluster_the_simulator_does_not_have_is_named_not_blamed_on_the_rows():
    """meta.yaml's cluster edited to one the simulator lacks: fit and show blamed 5,040 NVLS rows
    ("nvls, not one of the sim backend's ring, tree"), the knob space read as another machine's."""
    from lagom_tune.plan.schema import knob_space_for

    with pytest.raises(UserError, match=r"cluster 'h900-nvlink' \(a run folder's meta.yaml, a plan's target.hardware\) is no simulated cluster"):
        knob_space_for("sim", {"cluster": "h900-nvlink"})
    assert "nvls" in knob_space_for("sim", {"cluster": "h200-nvlink"})["algo"].domain


def test_a_process_knob_the_search_left_at_the_default_is_not_pinned():
    """A plan that changed NCCL_BUFFSIZE also exported NCCL_NTHREADS=512, the default the search left
    alone, pinning LL128's 640 threads to 512 (an audit, 2026-12-04): a plan sets the process and
    communicator knobs the search changed, and leaves the rest to NCCL."""
    from lagom_tune.planning import changed_settings

    default = Settings({"threads": 512, "buffsize": 4 << 20}, {"dp_replicate": {"bucket_cap_mb": 25, "chunk_bytes": 0}},
                       {"k": {"channels": 16}})
    chosen = Settings({"threads": 512, "buffsize": 8 << 20}, {"dp_replicate": {"bucket_cap_mb": 25, "chunk_bytes": 1 << 20}},
                      {"k": {"channels": 4}})
    plan = changed_settings(chosen, default)
    assert plan.process == {"buffsize": 8 << 20}
    assert plan.communicators == {"dp_replicate": {"chunk_bytes": 1 << 20}}
    assert plan.collectives == chosen.collectives  # rules are made per role, by collective_rules
    assert changed_settings(Settings({"threads": 512}, {"dp_replicate": {"bucket_cap_mb": 25}}), default) == Settings()


def test_a_replay_that_does_not_bear_the_prediction_out_is_said():
    """A plan predicted 1.061x faster replayed 0.999x on the noiseless simulator and was written and
    shown with no remark (an audit, 2026-12-04); a replay near the prediction says nothing."""
    plan = load_plan(ROOT / "plans" / "sim-a40-nvlink-phi-2-tp8-dp2.yaml")  # predicted 1.074x, replayed 1.077x
    assert replay_shortfall(plan) == "" and "warning" not in replay_rows(plan)[1]
    flat = replace(plan, validated={**plan.validated, "iteration_ms": {"default": 700.0, "plan": 700.7}, "speedup": 0.999})
    said = replay_shortfall(flat)
    predicted = plan.predicted["iteration_ms"]["default"] / plan.predicted["iteration_ms"]["plan"]
    assert predicted > 1.05 and f"ran the plan 0.999× the defaults' speed where the model predicted {predicted:.3f}×" in said, said
    assert said in replay_rows(flat)[1]
    half = replace(plan, validated={**plan.validated, "iteration_ms": {"default": 700.0, "plan": 671.0}, "speedup": 1.0432})
    assert replay_shortfall(half) == ""  # 4.3% of a predicted 8.1%: more than half of it


def test_a_replay_says_what_its_rounds_can_tell():
    """The replay's speed-up is read with its interval, as trial reads its rounds; one round has none."""
    plan = load_plan(ROOT / "plans" / "sim-a40-nvlink-phi-2-tp8-dp2.yaml")  # 3 rounds, 1.0772, [1.0148, 1.1434]
    assert replay_rows(plan)[1] == ("replayed speed-up 1.077× (geometric mean of the 3 rounds' ratios), 95% interval "
                                    "1.015–1.143×: the plan is faster\n"
                                    "per round, default / plan: default first 1.048 1.089 · plan first 1.095")
    assert replay_rows(plan)[0][-1] == ("simulated plan (replay)", "703.757", "1.077×")
    one = {k: val for k, val in plan.validated.items() if k not in ("interval", "ratios")}
    assert "from one round: no interval (--validate 2 or more gives one)" in replay_rows(replace(plan, validated={**one, "repeats": 1}))[1]
    assert replay_rows(replace(plan, validated=one))[1] == ""  # written before the replay recorded its interval


def test_a_replay_that_cannot_tell_shows_its_rounds_and_the_repeats_the_prediction_would_need():
    """As trial does: the rounds' ratios, the default first in every other one, and after how many
    repeats the plan's predicted speed-up would show at their spread (``comparison.rounds_to_show``)."""
    from lagom_tune.comparison import ratio_interval, rounds_to_show

    plan = load_plan(ROOT / "plans" / "sim-a40-nvlink-phi-2-tp8-dp2.yaml")
    ratios = [1.06, 0.97, 1.09]
    speedup, low, high = ratio_interval(ratios)
    validated = {**plan.validated, "speedup": round(speedup, 4), "interval": [round(low, 4), round(high, 4)], "ratios": ratios}
    caption = replay_rows(replace(plan, validated=validated))[1].splitlines()
    needed = rounds_to_show(ratios, plan.predicted_speedup, 100)
    assert needed is not None and needed > 3
    assert caption[-2:] == ["per round, default / plan: default first 1.060 1.090 · plan first 0.970",
                           f"the interval holds 1: at this spread between rounds the plan's predicted {plan.predicted_speedup:.3f}× "
                           f"would show after about {needed} rounds (--validate {needed}), a smaller true difference after more"], caption
    no_rounds = {k: val for k, val in validated.items() if k != "ratios"}  # written before the rounds were recorded
    assert replay_rows(replace(plan, validated=no_rounds))[1].splitlines()[-1:] == [
        "the interval holds 1: more rounds (--validate) narrow it, if the difference is there to find"]


# Each example plan in plans/ and the preset it was made from (README: the recipe).
EXAMPLE_PLANS = {
    "demo-cpu.yaml": ("cpu-demo", None),
    "sim-a40-nvlink-phi-2-fsdp16.yaml": ("phi-2-fsdp16", None),
    "sim-a40-nvlink-phi-2-tp8-dp2.yaml": ("phi-2-tp8-dp2", None),
    "sim-h100-nvlink-mpt-7b-tp8-dp2.yaml": ("mpt-7b-tp8-dp2", None),
    "sim-h100-nvlink-llama3-8b-fsdp2-tp8.yaml": ("llama3-8b", "fsdp=2,tp=8"),
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_PLANS))
def test_every_example_plan_loads_and_holds_the_workload_its_preset_builds_today(name):
    """A preset changed since an example plan was written leaves the plan describing another job:
    plans/ (and README's plan format, copied from one) held tensor-parallel plans written before
    the presets ran each Domino phase twice a layer, a rule for a gradient all-reduce no collective
    matched and an iteration predicted at half its time (an auditor's check). The digest says so;
    a plan of a preset with its own --parallel (the 2-D one) is rebuilt with it."""
    assert {p.name for p in (ROOT / "plans").glob("*.yaml")} == set(EXAMPLE_PLANS)
    plan = load_plan(ROOT / "plans" / name)
    preset, parallel = EXAMPLE_PLANS[name]
    w = build_preset(preset, parallel=parallel)
    assert plan.workload == {"name": w.name, "digest": w.digest}
    assert plan.simulated == (plan.backend == "sim") and set(plan.groups) == {c.group for c in w.collectives()}


def test_a_gain_smaller_than_the_models_window_error_is_said_until_it_is_measured():
    """A plan 11% faster by a model whose held-out overlapped windows are 18% off (gloo on a shared
    2-core VM) may be the model's error: search and show say so and how to measure it; a gain above
    the error, a plan with no gain, or one replayed says nothing."""
    from lagom_tune.render import gain_caution, plan_summary

    noisy = replace(BASE, model={"mape": {"overlap_window": 0.182}})
    said = gain_caution(noisy)
    assert "predicted 11.1% faster, less than its model's held-out error on overlapped windows (18.2%)" in said
    assert "`lagom-tune trial PLAN -- CMD`" in said and said in plan_summary(noisy)
    assert "--validate" in gain_caution(replace(noisy, simulated=True))
    assert gain_caution(replace(BASE, model={"mape": {"overlap_window": 0.02}})) is None
    assert gain_caution(BASE) is None  # no error recorded
    assert gain_caution(replace(noisy, predicted={**BASE.predicted, "iteration_ms": {"default": 9.0, "autoccl": 9.0, "plan": 9.0}})) is None
    replayed = load_plan(ROOT / "plans" / "sim-a40-nvlink-phi-2-tp8-dp2.yaml")
    assert replayed.validated and gain_caution(replace(replayed, model={**replayed.model, "mape": {"overlap_window": 0.5}})) is None


def test_a_shadowed_rule_is_found_as_a_pairwise_check_finds_it():
    """The check runs in every rank on plans of thousands of rules (a traced workload), so it keeps
    the widest earlier reach per op and group rather than comparing every pair; on random rule
    lists it refuses the same first rule the pairwise definition does."""
    import random

    from lagom_tune.plan.schema import _refuse_shadowed

    rng = random.Random(0)
    for _ in range(3000):
        rules = []
        for i in range(rng.randint(1, 8)):
            lo = rng.randint(0, 20)
            rule = CollectiveRule(rng.choice(["all_gather", "all_reduce"]), rng.choice(["dp", "tp", "*"]), lo, lo + rng.randint(0, 20),
                                  {"channels": 8})
            rules.append((f"plan.collectives[{i}]", rule))
        pairwise = next((rp for i, (rp, r) in enumerate(rules)
                         if any(e.op == r.op and e.group in (r.group, "*") and e.min_bytes <= r.min_bytes <= r.max_bytes <= e.max_bytes
                                for _, e in rules[:i])), None)
        try:
            _refuse_shadowed(rules)
            refused = None
        except UserError as e:
            refused = str(e).split(": never applies")[0]
        assert refused == pairwise, rules
