"""NCCL's own choices, observed: from a profile's ``default`` rows (the collectives timed with
nothing set, whose algorithm and protocol the tuner plugin saw NCCL choose) to the search's
defaults, the plan's ``backend_defaults`` and what `apply` holds NCCL's choices against.

The simulated NCCL's own choices (``test_sim_nccl_choice.py``) are blanked here: these tests put
the rows a GPU profile writes in a simulated run folder, to follow them through the layers above
the backend."""

import shutil

import pandas as pd
import pytest
import yaml

from lagom_tune.backends.nccl_knobs import nccl_knob_space
from lagom_tune.errors import UserError
from lagom_tune.knobs import BackendChoices
from lagom_tune.plan.schema import Plan, load_plan
from lagom_tune.profile.summary import backend_choices
from lagom_tune.search.space import default_assignment, observed_defaults, variables
from lagom_tune.workload.presets import build_preset

from conftest import cli

WORKLOAD = "phi-2-fsdp8"  # an all-gather and a reduce-scatter of 150 MiB within one NVSwitch node


def default_rows(workload, chosen: dict, repeats: int = 2) -> pd.DataFrame:
    """The rows the nccl backend writes for the workload's collectives timed with nothing set;
    ``chosen``: (op, nbytes) -> (algorithm, protocol[, channels]) NCCL was seen choosing (absent: not seen)."""
    rows = []
    for op, nbytes, ranks, nodes in sorted({(c.op, c.nbytes, c.ranks, c.nodes) for c in workload.collectives()}):
        algo, proto, channels = (*chosen.get((op, nbytes), (None, None)), None)[:3]
        for rep in range(repeats):
            rows.append({"point": f"default|{op}:{nbytes}:{ranks}|nodes={nodes}", "kind": "default", "backend": "sim",
                         "simulated": True, "op": op, "nbytes": nbytes, "ranks": ranks, "nodes": nodes, "time_us": 100.0,
                         "repeat": rep, "chosen_algo": algo, "chosen_proto": proto, "chosen_channels": channels})
    return pd.DataFrame(rows)


def test_the_profile_s_default_rows_give_the_backend_s_choices_by_collective():
    w = build_preset("phi-2-tp8-dp2")
    tp, dp = (next(c for c in w.collectives() if c.group == g) for g in ("tp", "dp_replicate"))
    chosen = backend_choices(default_rows(w, {("all_reduce", tp.nbytes): ("ring", "ll128")}), w)
    assert chosen.by_rule == {tp.rule_key: {"algo": "ring", "proto": "ll128"}}  # the dp all-reduce: not seen, none
    assert chosen.for_collective(dp) == {}
    # with the channels NCCL's log gave (read back from the CSV as a float column)
    rows = default_rows(w, {("all_reduce", tp.nbytes): ("ring", "ll128", 24)})
    assert backend_choices(rows, w).by_rule == {tp.rule_key: {"algo": "ring", "proto": "ll128", "channels": 24}}
    assert backend_choices(rows.astype({"chosen_channels": float}), w).by_rule[tp.rule_key]["channels"] == 24
    assert backend_choices(default_rows(w, {("all_reduce", tp.nbytes): (None, None, 24)}), w) == BackendChoices()  # channels alone: no choice
    assert backend_choices(pd.DataFrame({"kind": ["gemm"], "time_us": [1.0]}), w) == BackendChoices()  # no such rows


def test_a_collective_s_defaults_are_what_nccl_was_seen_running_where_the_space_holds_it():
    w = build_preset("phi-2-tp8-dp2")
    space = nccl_knob_space(64, 16, nvls=True)
    c = next(c for c in w.collectives() if c.group == "tp")  # within a node

    def defaults(seen: dict) -> dict:
        values = default_assignment(variables(w, space, BackendChoices({c.rule_key: seen})))
        return {k.rsplit(":", 1)[1]: v for k, v in values.items() if k.startswith(f"collective:{c.rule_key}:")}

    assert defaults({})["algo"] == "nvls" and defaults({})["proto"] == "simple"  # the space's: NVLS within the node
    assert defaults({"algo": "ring", "proto": "ll128"}) == {"algo": "ring", "proto": "ll128", "channels": 16}
    assert defaults({"algo": "ring", "proto": "ll128", "channels": 24}) == {"algo": "ring", "proto": "ll128", "channels": 24}
    # a channel count the space does not offer (NCCL drops a small collective's one at a time): the nearest it does
    assert defaults({"algo": "ring", "proto": "ll", "channels": 3}) == {"algo": "ring", "proto": "ll", "channels": 4}
    assert defaults({"algo": "ring", "proto": "ll", "channels": 20})["channels"] == 24
    assert defaults({"algo": "ring", "proto": "ll", "channels": 6})["channels"] == 8  # 8/6 < 6/4
    assert defaults({"algo": "nvls_tree", "proto": "simple", "channels": 24})["channels"] == 16  # nor with a choice not held
    # NCCL chose what the model has no term for (NVLS-tree), or a pair NCCL never runs: the space's defaults, both knobs
    for seen in ({"algo": "nvls_tree", "proto": "simple"}, {"algo": "nvls", "proto": "ll"}):
        assert observed_defaults(space, BackendChoices({c.rule_key: seen}), c) == {}
        assert defaults(seen)["algo"] == "nvls" and defaults(seen)["proto"] == "simple"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A simulated profile of the workload whose collectives timed with nothing set have their
    choice blanked (a GPU profile where neither the plugin nor NCCL's log saw it), and a copy whose
    rows say NCCL ran its all-gather at ring/LL128 on 24 channels (what a GPU profile observes; its
    reduce-scatter not seen), each refitted."""
    base = tmp_path_factory.mktemp("defaults")
    plain = base / "plain"
    cli("profile", "--backend", "sim", "--hardware", "h100-nvlink", "--workload", WORKLOAD, "--out", plain, "--repeats", 2,
        check=True)
    measured = pd.read_csv(plain / "measurements.csv")
    own = measured["kind"] == "default"
    assert own.any() and measured.loc[own, "chosen_proto"].notna().all()  # what the simulated NCCL chose: blanked
    measured.loc[own, ["chosen_algo", "chosen_proto", "chosen_channels"]] = None
    measured.to_csv(plain / "measurements.csv", index=False)
    cli("fit", plain, check=True)
    seen = base / "seen"
    shutil.copytree(plain, seen)
    w = build_preset(WORKLOAD)
    gather = next(c for c in w.collectives() if c.op == "all_gather")
    rows = default_rows(w, {("all_gather", gather.nbytes): ("ring", "ll128", 24)})
    pd.concat([measured[~own], rows], ignore_index=True).to_csv(seen / "measurements.csv", index=False)
    cli("fit", seen, check=True)
    return plain, seen, gather


def test_the_plan_predicts_the_defaults_nccl_was_seen_running_and_records_them(runs, tmp_path):
    plain, seen, gather = runs
    for run in (plain, seen):
        cli("search", run, "--out", tmp_path / f"{run.name}.yaml", check=True)
    before, after = load_plan(tmp_path / "plain.yaml"), load_plan(tmp_path / "seen.yaml")
    assert before.backend_defaults == ()
    assert {(r.op, r.min_bytes, r.max_bytes, tuple(sorted(r.set.items()))) for r in after.backend_defaults} == \
        {("all_gather", gather.nbytes, gather.nbytes, (("algo", "ring"), ("channels", 24), ("proto", "ll128")))}
    # the baseline is another one: the all-gathers at ring/LL128 on 24 channels, not the space's ring/Simple on 16
    assert after.predicted["iteration_ms"]["default"] != before.predicted["iteration_ms"]["default"]
    # the plan file holds them and reads back; `report` recomputes the same default prediction from them
    doc = yaml.safe_load((tmp_path / "seen.yaml").read_text())
    assert doc["backend_defaults"][0]["set"] == {"algo": "ring", "proto": "ll128", "channels": 24}
    assert Plan.from_dict(doc) == after
    report = cli("report", tmp_path / "seen.yaml", "--out", tmp_path / "report.html")
    assert report.returncode == 0, report.stderr
    shown = cli("show", tmp_path / "seen.yaml", check=True).stdout
    assert f"all_gather on dp_shard, {gather.nbytes} B: ring/ll128 on 24 channels" in " ".join(shown.split()), shown


def test_the_fit_scores_the_default_baseline_on_the_collectives_timed_with_nothing_set(runs):
    """Predicted at NCCL's observed choice and the space's other defaults, the one seen all-gather
    (the rows say 100 us) is scored apart from the fitted points, which leave it out."""
    from lagom_tune.model.fit import DEFAULT_ACCURACY, nothing_set_points
    from lagom_tune.plan.schema import knob_space_for

    plain, seen, gather = runs
    acc = {run.name: yaml.safe_load((run / "model.yaml").read_text())["accuracy"] for run in (plain, seen)}
    assert DEFAULT_ACCURACY not in acc["plain"]["mape"] and acc["seen"]["scored"][DEFAULT_ACCURACY] == 1
    assert acc["seen"]["scored"]["collective"] == acc["plain"]["scored"]["collective"]  # not fitted, not held out
    space = knob_space_for("sim", yaml.safe_load((seen / "meta.yaml").read_text())["fingerprint"])
    (point,) = nothing_set_points(pd.read_csv(seen / "measurements.csv"), space).to_dict("records")
    assert (point["kind"], point["op"], point["algo"], point["proto"], point["channels"], point["time_us"]) == \
        ("collective", "all_gather", "ring", "ll128", 24, 100.0)  # the channels NCCL ran, not the space's 16


def test_show_lists_the_collectives_timed_with_nothing_set_with_the_choice_seen(runs):
    import json

    plain, seen, gather = runs
    table = json.loads(cli("show", seen, "--collectives", "--json", check=True).stdout)
    own = [(r["op"], r["size_B"], r["algo"], r["proto"], r["channels"]) for r in table if r["own"]]
    assert sorted(own) == [("all_gather", gather.nbytes, "ring", "ll128", 24), ("reduce_scatter", gather.nbytes, "?", "?", None)]
    plain_own = [r for r in json.loads(cli("show", plain, "--collectives", "--json", check=True).stdout) if r.get("own")]
    assert plain_own and {(r["algo"], r["proto"]) for r in plain_own} == {("?", "?")}
    from lagom_tune.profile.summary import collective_summary
    from lagom_tune.render import own_choice_lines

    lines = own_choice_lines(collective_summary(pd.read_csv(seen / "measurements.csv")))  # what profile prints
    assert [line.split(" B on")[0] + " " + line.rsplit(", ", 1)[1] for line in lines] == \
        [f"nothing set: all_gather of {gather.nbytes} ring/ll128 on 24 channels",
         f"nothing set: reduce_scatter of {gather.nbytes} its choice not observed"]


def test_backend_defaults_are_checked_like_rules(runs, tmp_path):
    plain, seen, gather = runs
    cli("search", seen, "--out", tmp_path / "seen.yaml", check=True)
    doc = yaml.safe_load((tmp_path / "seen.yaml").read_text())
    bad = dict(doc, backend_defaults=[{**doc["backend_defaults"][0], "set": {"algo": "tree", "proto": "ll"}}])
    with pytest.raises(UserError, match=r"backend_defaults\[0\]\.set\.algo: 'tree' does not apply to all_gather"):
        Plan.from_dict(bad)
    stray = dict(doc, backend_defaults=[{**doc["backend_defaults"][0], "match": {**doc["backend_defaults"][0]["match"], "group": "pp"}}])
    with pytest.raises(UserError, match=r"backend_defaults\[0\]\.match\.group: no role 'pp'"):
        Plan.from_dict(stray)
