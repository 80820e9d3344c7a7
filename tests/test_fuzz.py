"""Property-based fuzzing of every artifact loader: bad input is a UserError, never a crash."""

import copy
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagom_tune.errors import UserError
from lagom_tune.model.contention import model_from_dict
from lagom_tune.plan.schema import Plan
from lagom_tune.profile.store import RunFolder
from lagom_tune.workload.presets import build_preset
from lagom_tune.workload.spec import Workload

from conftest import ROOT, cli
from test_plan import BASE

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 40), st.floats(allow_nan=True), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def mutate(doc, data):
    """Replace one randomly chosen node of a valid document with an arbitrary value."""
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])

    doc = copy.deepcopy(doc)  # never mutate shared state between examples
    walk(doc, [])
    path = data.draw(st.sampled_from(paths[1:]))
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = data.draw(values)
    return doc


def only_user_errors(fn, *args):
    try:
        fn(*args)
    except UserError as e:
        assert "\n" not in str(e)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.data())
def test_plan_loader(data):
    only_user_errors(Plan.from_dict, mutate(BASE.to_dict(), data))


@pytest.mark.parametrize("value", [{"\n": False}, {"\n": None}])
def test_a_name_with_a_line_break_is_one_line_in_the_error(value):
    """Drawn by the fuzz test above: a role named "\\n" made a two-line error."""
    d = BASE.to_dict()
    d["target"]["groups"] = value
    with pytest.raises(UserError) as e:
        Plan.from_dict(d)
    assert "\n" not in str(e.value) and "\\n" in str(e.value)


@FUZZ
@given(st.data())
def test_workload_loader(data):
    only_user_errors(Workload.from_dict, mutate(build_preset("cpu-demo").to_dict(), data))


@FUZZ
@given(values)
def test_any_yaml_value_as_plan_or_workload(value):
    only_user_errors(Plan.from_dict, value)
    only_user_errors(Workload.from_dict, value)
    only_user_errors(model_from_dict, value)


MODELS = {name: yaml.safe_load((ROOT / path).read_text()) for name, path in (
    ("cpu", "tests/data/cpu-demo-model.yaml"),  # a gloo profile's fit (make demo, 2026-11-30)
    ("gpu", "bench/results/gpu_check-mpt-7b-tp8-dp1-run/model.yaml"),  # an H200's
)}


@FUZZ
@given(st.data(), st.sampled_from(sorted(MODELS)))
def test_model_loader(data, family):
    only_user_errors(model_from_dict, mutate(MODELS[family], data))


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_measurements_csv_loader(tmp_path_factory, text):
    run = RunFolder(tmp_path_factory.mktemp("run"))
    run.csv_path.write_text(text)
    only_user_errors(run.measurements)


@settings(max_examples=6, deadline=None)
@given(st.data())
def test_cli_refuses_fuzzed_plans_without_writing(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("cli")
    plan = d / "plan.yaml"
    plan.write_text(yaml.safe_dump(mutate(BASE.to_dict(), data)))
    before = sorted(os.listdir(d))
    r = cli("apply", plan, "--", "true")
    assert "Traceback" not in r.stderr
    if r.returncode == 2:
        assert len(r.stderr.strip().splitlines()) == 1
        assert sorted(os.listdir(d)) == before  # nothing written, nothing overwritten


def _cpu_trace() -> dict:
    """A small CPU trace in torch.profiler's form: two GEMMs, one beside a gloo all-reduce."""
    mm = lambda ts, dims: {"ph": "X", "name": "aten::mm", "ts": ts, "dur": 50, "args": {"Input Dims": dims, "Input type": ["float", "float"]}}
    return {"distributedInfo": {"world_size": 2}, "traceEvents": [
        mm(0, [[64, 32], [32, 16]]),
        {"ph": "X", "name": "gloo:all_reduce", "ts": 60, "dur": 80, "args": {"Input Dims": [[1024]], "Input type": ["float"]}},
        mm(70, [[128, 64], [64, 32]]),
    ]}


def test_the_fuzzed_trace_imports_whole_before_it_is_mutated(tmp_path):
    import json

    from lagom_tune.workload.trace import import_trace

    (tmp_path / "t.json").write_text(json.dumps(_cpu_trace()))
    w = import_trace(tmp_path / "t.json")
    assert sorted(g.shape_key for g in w.gemms().values()) == ["1x128x32x64:fp32", "1x64x16x32:fp32"]
    assert [(c.op, c.nbytes, c.ranks) for c in w.collectives()] == [("all_reduce", 4096, 2)]


@FUZZ
@given(st.data())
def test_trace_importer(tmp_path_factory, data):
    import json

    from lagom_tune.workload.trace import import_trace

    path = tmp_path_factory.mktemp("trace") / "t.json"
    path.write_text(json.dumps(mutate(_cpu_trace(), data)))
    try:
        w = import_trace(path)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert Workload.from_dict(w.to_dict()) == w  # what it builds is a workload its own loader accepts


def _ends_well_or_says_why(*args) -> None:
    """The CLI run in process ends well or with a user error (main() turns it into one line and
    exit 2), never an internal one."""
    from typer.testing import CliRunner

    from lagom_tune.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0 or isinstance(r.exception, UserError), (args, r.exception)


def _show_and_search(run_src, meta: dict, run, model: dict | None = None) -> None:
    """``show`` and ``search`` on a copy of ``run_src`` whose meta.yaml is ``meta`` (and model.yaml
    ``model``, when given)."""
    import shutil

    shutil.copytree(run_src, run)
    (run / "meta.yaml").write_text(yaml.safe_dump(meta))
    if model is not None:
        (run / "model.yaml").write_text(yaml.safe_dump(model))
    _ends_well_or_says_why("show", run)
    _ends_well_or_says_why("search", run, "--optimizer", "default", "--out", run / "plan.yaml")


@pytest.mark.parametrize("key, value", [("ranks", {}), ("cores", "two"), ("backend", [1]), (None, None), ("backend", "DELETE"),
                                        ("ranks", None), ("nodes", None)])
def test_run_metadata_edited_by_hand(tiny_run, tmp_path, key, value):
    """Each crashed show or search before the fingerprint was checked on load (None: the workload
    erased; a fingerprint without its backend: search's KeyError; ``ranks: null``: a TypeError;
    both found by the fuzz test below)."""
    meta = yaml.safe_load((tiny_run / "meta.yaml").read_text())
    if key is None:
        meta["workload"] = None
    elif value == "DELETE":
        del meta["fingerprint"][key]
    else:
        meta["fingerprint"][key] = value
    _show_and_search(tiny_run, meta, tmp_path / "run")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_show_and_search_on_a_fuzzed_run_folder(tiny_run, tmp_path_factory, data):
    meta = mutate(yaml.safe_load((tiny_run / "meta.yaml").read_text()), data)
    _show_and_search(tiny_run, meta, tmp_path_factory.mktemp("fuzzed") / "run")


@pytest.mark.parametrize("edit", [
    lambda m: m["accuracy"].update(mape=[]),  # show iterated it as a mapping
    lambda m: m["accuracy"]["mape"].update(gemm="12%"),
    lambda m: m["accuracy"].update(ranking={"shapes": [{"shape": "g", "spearman": "high"}]}),
])
def test_a_model_file_edited_by_hand(tiny_run, tmp_path, edit):
    model = yaml.safe_load((tiny_run / "model.yaml").read_text())
    edit(model)
    _show_and_search(tiny_run, yaml.safe_load((tiny_run / "meta.yaml").read_text()), tmp_path / "run", model)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_show_and_search_with_a_fuzzed_model_file(tiny_run, tmp_path_factory, data):
    model = mutate(yaml.safe_load((tiny_run / "model.yaml").read_text()), data)
    _show_and_search(tiny_run, yaml.safe_load((tiny_run / "meta.yaml").read_text()), tmp_path_factory.mktemp("fuzzed") / "run", model)


@pytest.mark.parametrize("edit", [
    lambda p: p["predicted"]["iteration_ms"].update(plan=[]),  # show formatted each as a number
    lambda p: p["predicted"].update(iteration_ms=None),
    lambda p: p["predicted"].update(bound_ms=None),
    lambda p: p["model"].update(mape=[]),
])
def test_a_plan_edited_by_hand_is_shown_or_refused(tmp_path, edit):
    plan = yaml.safe_load((ROOT / "plans" / "demo-cpu.yaml").read_text())
    edit(plan)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    _ends_well_or_says_why("show", tmp_path / "p.yaml")
    _ends_well_or_says_why("apply", tmp_path / "p.yaml", "--dry-run")


@FUZZ
@given(st.data())
def test_show_of_a_fuzzed_plan(tmp_path_factory, data):
    plan = mutate(yaml.safe_load((ROOT / "plans" / "demo-cpu.yaml").read_text()), data)
    path = tmp_path_factory.mktemp("plan") / "p.yaml"
    path.write_text(yaml.safe_dump(plan))
    _ends_well_or_says_why("show", path)


@pytest.mark.parametrize("key, value, said", [("ib_gbps", "400 Gb/s", "fingerprint.ib_gbps"), ("noise", 1e9, "fingerprint.noise"),
                                              ("nodes", 3, "fingerprint.nodes: 3 nodes cannot hold 2 ranks evenly")])
def test_a_fingerprint_number_edited_out_of_its_range_is_refused_on_read(tiny_run, tmp_path, key, value, said):
    """Each was read unchecked: `show` and `search` passed, then `search --validate` raised
    ValueError on the text, a noise of 1e9 overflowed, and search blamed the nodes on the plan it
    had not written (an audit, 2026-12-03)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    meta["fingerprint"][key] = value
    (run / "meta.yaml").write_text(yaml.safe_dump(meta))
    r = cli("show", run)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
