"""NVLS (NVLink SHARP) in the knob space: an all-reduce algorithm within one NVSwitch node, Simple
only, and NCCL's own default there; every layer asks the knob space, none names a cluster."""

import copy
import math

import pytest

from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.backends.nccl_knobs import knob_space_from_fingerprint, nccl_knob_space
from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.plan.schema import Plan
from lagom_tune.search.baselines import autoccl_search, default_search
from lagom_tune.search.evaluate import INFEASIBLE, ModelEvaluator
from lagom_tune.search.space import default_assignment, variables
from lagom_tune.workload.presets import build_preset

HOPPER = knob_space_from_fingerprint({"cluster": "h100-nvlink"})


def test_nvls_is_an_all_reduce_algorithm_within_one_node_on_nvswitch_hoppers_only():
    algo = HOPPER["algo"]
    assert "nvls" in algo.domain_for({"all_reduce"}, nodes=1)
    assert "nvls" not in algo.domain_for({"all_reduce"}, nodes=2)  # NVLS_TREE across nodes is not offered
    assert "nvls" not in algo.domain_for({"all_gather"}, nodes=1)
    assert "nvls" not in knob_space_from_fingerprint({"cluster": "a100-nvlink"})["algo"].domain
    # a nccl fingerprint that does not say NCCL offered NVLS (profiles before 2026-12-03) offers none; the widest space holds it
    assert "nvls" not in knob_space_from_fingerprint({"max_channels": 32, "default_channels": 16})["algo"].domain
    assert "nvls" in knob_space_from_fingerprint({})["algo"].domain


def test_nccl_default_is_nvls_for_an_all_reduce_within_a_node_and_ring_elsewhere():
    assert HOPPER.defaults("all_reduce")["algo"] == "nvls"
    assert HOPPER.defaults("all_reduce", nodes=2)["algo"] == "ring"
    assert HOPPER.defaults("all_gather")["algo"] == "ring"
    assert HOPPER.defaults()["algo"] == "ring"  # the process-wide default names no op
    assert nccl_knob_space().defaults("all_reduce")["algo"] == "ring"


def test_nvls_runs_only_with_the_simple_protocol():
    assert HOPPER.conflict({"algo": "nvls", "proto": "simple"}) is None
    assert "simple" in HOPPER.conflict({"algo": "nvls", "proto": "ll128"})
    assert HOPPER.conflict({"algo": "ring", "proto": "ll"}) is None


def test_variables_default_to_what_nccl_takes_for_the_collectives_they_cover():
    """mpt-7b tp8-dp2: the tensor-parallel all-reduce (8 ranks, one node) defaults to NVLS, the
    data-parallel one (2 ranks, one a node) to the ring and may not take NVLS."""
    w = build_preset("mpt-7b-tp8-dp2")
    algo = {v.target: v for v in variables(w, HOPPER) if v.knob.name == "algo"}
    by_role = {c.group: algo[c.rule_key] for c in w.collectives() if c.op == "all_reduce"}
    assert by_role["tp"].default == "nvls" and "nvls" in by_role["tp"].domain
    assert by_role["dp_replicate"].default == "ring" and "nvls" not in by_role["dp_replicate"].domain
    assert default_assignment(list(algo.values()))[by_role["tp"].key] == "nvls"


class _Flat:
    """A cost model that times every collective 1 ms alone and GEMMs 1 ms: any feasible setting
    is as fast as any other, so only feasibility decides."""

    def compute_time(self, op, proc):
        return 1e-3

    def comm_time(self, coll, s):
        return 1e-3 / (2 if s["proto"] == "ll" else 1)  # LL looks fastest: the trap

    def compute_slowdown(self, gemm, coll, s):
        return 1.0

    def comm_slowdown(self, coll, gemm, s):
        return 1.0

    def to_dict(self):
        return {}


def test_settings_nccl_cannot_run_are_infeasible_and_never_chosen():
    """AutoCCL's coordinate descent took NVLS on one variable and LL on another, each judged
    alone: a plan NCCL cannot run (its predicted time was written as inf)."""
    w = build_preset("mpt-7b-tp8-dp2")
    vars_ = variables(w, HOPPER)
    ev = ModelEvaluator(w, _Flat(), HOPPER)
    tp = next(c for c in w.collectives() if c.group == "tp")
    bad = {**default_assignment(vars_), f"collective:{tp.rule_key}:proto": "ll"}
    assert ev(Settings.from_assignment(bad, vars_)) is INFEASIBLE
    for search in (default_search, autoccl_search):
        got = search(ModelEvaluator(w, _Flat(), HOPPER), vars_)
        assert math.isfinite(got.evaluation.iteration_s)
        assert all(HOPPER.conflict(got.settings.for_collective(c)) is None for c in w.collectives())


def test_a_plan_rule_of_nvls_with_ll_is_refused():
    d = {"schema_version": 1, "kind": "lagom-plan", "target": {"backend": "sim", "world_size": 16, "groups": {"tp": 8},
                                                               "hardware": {"cluster": "h100-nvlink"}},
         "process": {}, "communicators": {},
         "collectives": [{"match": {"op": "all_reduce", "group": "tp"}, "set": {"algo": "nvls", "proto": "simple", "channels": 8}}]}
    Plan.from_dict(copy.deepcopy(d))
    d["collectives"][0]["set"]["proto"] = "ll"
    with pytest.raises(UserError, match=r"collectives\[0\].set: algo nvls runs only with proto simple, not ll"):
        Plan.from_dict(d)


def test_the_simulated_profile_measures_nvls_within_a_node_alone_and_beside_gemms():
    backend = get_backend("sim", BackendOptions(hardware="h100-nvlink"))
    points = backend.plan_points(build_preset("mpt-7b-tp8-dp2"))
    nvls = [p for p in points if dict(p.config).get("algo") == "nvls"]
    assert {p.kind for p in nvls} == {"collective", "overlap"}
    assert all(p.op == "all_reduce" and p.ranks == 8 and dict(p.config)["proto"] == "simple" for p in nvls)
    assert all(dict(p.config)["nodes"] == 1 for p in nvls)


def test_the_nccl_backend_offers_nvls_where_nccl_would():
    """Every rank's GPU supports multicast, a node holds several, and NCCL_NVLS_ENABLE leaves it on."""
    from lagom_tune.backends.nccl import multicast_supported, nvls_offered

    assert nvls_offered([True] * 8, 8, {})
    assert nvls_offered([True] * 8, 8, {"NCCL_NVLS_ENABLE": "1"})
    assert not nvls_offered([True] * 8, 8, {"NCCL_NVLS_ENABLE": "0"})
    assert not nvls_offered([True] * 7 + [False], 8, {})
    assert not nvls_offered([True], 1, {})  # one GPU a node: nothing to reduce through the switch
    assert multicast_supported(0) in (True, False)  # no driver here: False, not an exception


def test_the_nccl_sweep_measures_nvls_within_a_node_and_names_it_to_nccl():
    from lagom_tune.backends.nccl_sweep import plan_collective_points, worker_env

    space = knob_space_from_fingerprint({"max_channels": 32, "default_channels": 16, "nvls": True})
    assert space.defaults("all_reduce")["algo"] == "nvls"
    points = plan_collective_points(build_preset("mpt-7b-tp8-dp2"), space, world=16, gpus_per_node=8)
    nvls = [p for p in points if dict(p.config).get("algo") == "nvls"]
    assert {p.kind for p in nvls} == {"collective", "overlap"}
    assert all(p.ranks == 8 and dict(p.config)["nodes"] == 1 and dict(p.config)["proto"] == "simple" for p in nvls)
    overlap_algos = {dict(p.config)["algo"] for p in points if p.kind == "overlap" and p.ranks == 8}
    assert overlap_algos == {"ring", "nvls"}  # the ring's contention and the default's
    env, _ = worker_env({"algo": "nvls", "proto": "simple"}, {"all_reduce"}, (2, 28, 9), {})
    assert env["NCCL_ALGO"] == "allreduce:NVLS" and env["NCCL_PROTO"] == "allreduce:Simple"


def test_a_plan_rule_of_nvls_for_a_role_that_spans_nodes_is_refused():
    """NVLS runs within one node: a rule for a role the plan shows spanning two (the world's, or
    rank sets across nodes) is refused; a role known only by its size is left to the plugin, which
    keeps NCCL's pick where NCCL offers no NVLS."""
    def plan(group: str, **target) -> dict:
        return {"schema_version": 1, "kind": "lagom-plan",
                "target": {"backend": "sim", "world_size": 16, "nodes": 2, "groups": {"world": 16, "tp": 8},
                           "hardware": {"cluster": "h100-nvlink"}, **target},
                "process": {}, "communicators": {},
                "collectives": [{"match": {"op": "all_reduce", "group": group}, "set": {"algo": "nvls", "proto": "simple"}}]}

    with pytest.raises(UserError, match=r"collectives\[0\].set.algo: 'nvls' runs within one node, and role world's "
                                        r"communicators span 2 of the plan's 2 nodes"):
        Plan.from_dict(plan("world"))
    # a rule for any group matches the world's communicator too (an audit, 2026-12-07: it was deployed)
    with pytest.raises(UserError, match=r"and the world's communicator, which it matches, span 2 of the plan's 2 nodes"):
        Plan.from_dict(plan("*"))
    Plan.from_dict(plan("tp"))  # by size alone: 8 ranks may be one node's
    Plan.from_dict(plan("tp", group_ranks={"tp": [list(range(8)), list(range(8, 16))]}))
    with pytest.raises(UserError, match="role tp's communicators span 2"):
        Plan.from_dict(plan("tp", group_ranks={"tp": [list(range(0, 16, 2)), list(range(1, 16, 2))]}))


class _Recording(ModelEvaluator):
    """An evaluator that keeps every distinct evaluation's time."""

    def __init__(self, *args):
        super().__init__(*args)
        self.times: list[float] = []

    def _evaluate(self, settings):
        ev = super()._evaluate(settings)
        self.times.append(ev.iteration_s)
        return ev


def test_optuna_never_draws_settings_nccl_cannot_run(tmp_path):
    """TPE drew NVLS beside LL or LL128 in 13-16% of its trials (each an infinite time, a trial
    spent); the space is now conditional: a protocol drawn after NVLS is drawn among Simple only,
    and a study stored so resumes."""
    from lagom_tune.search.optuna_search import optuna_search

    w = build_preset("mpt-7b-tp8-dp2")
    vars_ = variables(w, HOPPER)
    ev = _Recording(w, _Flat(), HOPPER)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    got = optuna_search(ev, vars_, n_trials=60, seed=0, storage=storage, study_name="s", enqueue_lagom=False)
    assert len(ev.times) > 20 and all(math.isfinite(t) for t in ev.times), ev.times
    assert all(HOPPER.conflict(got.settings.for_collective(c)) is None for c in w.collectives())
    again = optuna_search(_Recording(w, _Flat(), HOPPER), vars_, n_trials=80, seed=0, storage=storage, study_name="s",
                          enqueue_lagom=False)
    assert again.extra["trials"] == 80 and math.isfinite(again.evaluation.iteration_s)


def test_a_plan_made_on_nvswitch_hoppers_keeps_its_nvls_rule():
    """A plan records what NCCL offered where it was profiled: its NVLS rule was read back against
    the channel bounds alone, where NVLS is not offered, and the plan could not be written."""
    from lagom_tune.planning import plan_hardware

    fingerprint = {"backend": "nccl", "gpu": "NVIDIA H200", "device": "NVIDIA H200", "sms": 132, "max_channels": 64,
                   "default_channels": 16, "nvls": True, "ll128": True, "ranks": 8, "nodes": 1, "driver": "580"}
    d = {"schema_version": 1, "kind": "lagom-plan",
         "target": {"backend": "nccl", "world_size": 8, "groups": {"tp": 8}, "hardware": plan_hardware(fingerprint)},
         "process": {}, "communicators": {},
         "collectives": [{"match": {"op": "all_reduce", "group": "tp"}, "set": {"algo": "nvls", "proto": "simple", "channels": 16}}]}
    plan = Plan.from_dict(copy.deepcopy(d))
    assert plan.hardware == {"gpu": "NVIDIA H200", "device": "NVIDIA H200", "sms": 132, "max_channels": 64,
                             "nvls": True, "ll128": True}
    Plan.from_dict(plan.to_dict())
    d["target"]["hardware"]["nvls"] = False  # profiled where NCCL offered none
    with pytest.raises(UserError, match=r"set.algo: 'nvls' is outside algo's domain"):
        Plan.from_dict(d)
