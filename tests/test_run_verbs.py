"""`fit`, `search --validate` and `profile` rerun on a real gloo run folder: the verbs that reuse what a profile measured."""

import shutil
import subprocess

import pytest
import yaml

from lagom_tune.model.contention import FIT_REVISION
from lagom_tune.model.fit import current_accuracy
from lagom_tune.profile.store import RunFolder

from conftest import BIN, cli


def test_fit_refits_a_run_folder_and_measures_nothing(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "model.yaml").unlink()
    before = (run / "measurements.csv").read_bytes()
    r = cli("fit", run, check=True)
    assert (run / "measurements.csv").read_bytes() == before  # nothing measured, nothing rewritten
    model = yaml.safe_load((run / "model.yaml").read_text())
    assert model["kind"] == "lagom-model" and model["accuracy"]["mape"] and "MAPE" in r.stdout
    assert "wrote" in r.stdout and str(run / "model.yaml") in r.stdout


def test_fit_refuses_what_is_not_a_run_folder(tmp_path):
    for target in (tmp_path / "nowhere", tmp_path):
        r = cli("fit", target)
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_unfinished_profile_is_fitted_for_a_look_but_never_searched(tiny_run, tmp_path):
    """`fit` on an interrupted profile once let `search` write a plan from its first points (no
    overlapped pair among them: a gain predicted without any contention measured)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    meta.update(complete=False, points_done=meta["points_total"] - 3)
    (run / "meta.yaml").write_text(yaml.safe_dump(meta))
    fitted = cli("fit", run, check=True)
    assert "did not finish" in fitted.stdout and (run / "model.yaml").is_file()
    r = cli("search", run, "--out", tmp_path / "plan.yaml")
    assert r.returncode == 2 and not (tmp_path / "plan.yaml").exists()
    assert f"the profile did not finish ({meta['points_done']} of {meta['points_total']} points)" in r.stderr and "Traceback" not in r.stderr


def test_search_validate_replays_default_and_plan_on_real_gloo_ranks(tiny_run, tmp_path):
    """`search --validate` on a gloo run measures both on 2 real ranks (it once failed with a NameError)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    plan = tmp_path / "plan.yaml"
    r = cli("search", run, "--out", plan, "--validate", 2, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    validated = yaml.safe_load(plan.read_text())["validated"]
    assert validated and "NameError" not in r.stderr, validated


def test_the_demo_verdict_follows_the_interval():
    from lagom_tune.comparison import ratio_interval, verdict

    g, low, high = ratio_interval([1.10, 1.12, 1.09, 1.11, 1.10])
    assert 1.08 < low <= g <= high < 1.12 and verdict(low, high, False) == "the plan is faster"
    _, low, high = ratio_interval([0.895, 1.451, 1.02, 0.97, 1.2])  # two demo runs once printed 0.895x and 1.451x
    assert low < 1.0 < high and verdict(low, high, False) == "no difference measurable on this machine"
    assert verdict(*ratio_interval([0.8, 0.82, 0.79])[1:], False) == "the plan is slower"
    assert verdict(0.9, 1.2, True).startswith("same settings")


def test_the_interval_holds_the_true_ratio_as_often_as_it_says():
    """The trial's default 4 rounds: a nominal 95% interval must hold the true ratio about 95% of
    the time (a percentile bootstrap over the rounds held it 79%), and be Student's t interval."""
    import math

    import numpy as np

    from lagom_tune.comparison import CI_LEVEL, ratio_interval, verdict

    rng = np.random.default_rng(7)
    held = [low <= 1.0 <= high for _, low, high in (ratio_interval(np.exp(rng.normal(0, 0.05, 4))) for _ in range(1000))]
    assert abs(np.mean(held) - CI_LEVEL) <= 0.02, np.mean(held)
    g, low, high = ratio_interval([1.0, math.exp(0.1)])  # mean 0.05, standard error 0.05, t(1 df) 12.706
    assert (math.log(g), math.log(low), math.log(high)) == pytest.approx((0.05, 0.05 - 0.6353, 0.05 + 0.6353), abs=1e-4)
    assert ratio_interval([1.3]) == (pytest.approx(1.3), 0.0, math.inf)  # one round: no interval
    assert verdict(*ratio_interval([1.3])[1:], False) == "no difference measurable on this machine"


def test_the_rounds_a_predicted_gain_needs_are_those_whose_interval_would_leave_1_out():
    """rounds_to_show(ratios, e): at the spread of ``ratios``, the fewest rounds whose interval,
    centred on ``e``, leaves 1 out; one round fewer, it holds 1."""
    import numpy as np

    from lagom_tune.comparison import ratio_interval, rounds_to_show

    ratios = [1.10, 0.95, 1.05, 0.98]
    spread = float(np.log(ratios).std(ddof=1))

    def rounds_of(n: int, effect: float) -> list[float]:  # n rounds at exactly this spread, centred on effect
        z = np.random.default_rng(n).normal(size=n)
        z = (z - z.mean()) / z.std(ddof=1)
        return list(np.exp(np.log(effect) + spread * z))

    for effect in (1.03, 1.077, 0.94):
        n = rounds_to_show(ratios, effect, 100)
        assert n is not None and n > 2, (effect, n)
        _, low, high = ratio_interval(rounds_of(n, effect))
        assert not low <= 1.0 <= high, (effect, n, low, high)
        _, low, high = ratio_interval(rounds_of(n - 1, effect))
        assert low <= 1.0 <= high, (effect, n, low, high)
    assert rounds_to_show(ratios, 1.005, 100) is None  # a 0.5% gain under ±6% noise: beyond 100 rounds


def test_compared_arms_take_turns_running_first():
    from lagom_tune.comparison import interleaved

    runs = list(interleaved(("default", "plan"), 4))
    assert [arm for _, arm in runs] == ["default", "plan", "plan", "default"] * 2
    assert [r for r, _ in runs] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_rounds_are_grouped_by_the_arm_that_ran_first():
    from lagom_tune.comparison import by_first_arm

    assert by_first_arm([1.0, 1.1, 1.2, 1.3, 1.4], ("default", "plan")) == {"default": (1.0, 1.2, 1.4), "plan": (1.1, 1.3)}
    assert by_first_arm([], ("default", "plan")) == {"default": (), "plan": ()}


def test_only_an_odd_count_of_two_arms_rounds_gets_a_note_and_it_counts_them_as_interleaved_runs_them():
    from lagom_tune.comparison import interleaved, order_note

    note = order_note(("default", "plan"), 5, "--validate")
    firsts = [arm for _, arm in interleaved(("default", "plan"), 5)][::2]
    assert note.startswith(f"--validate 5 is odd: the default runs first in {firsts.count('default')} rounds, "
                           f"the plan in {firsts.count('plan')};"), note
    assert [order_note(("default", "plan"), n, "--rounds") for n in (1, 2, 4)] == [None] * 3


def test_a_misspelled_search_option_is_an_error_not_a_no_op():
    from lagom_tune.errors import UserError
    from lagom_tune.search.run import check_options, option_names

    assert option_names("optuna") >= {"n_trials", "timeout", "seed", "storage"} and option_names("default") == frozenset()
    check_options(["lagom", "optuna"], {"n_trials": 5, "top_subspaces": 1})  # each goes to the optimizer that takes it
    import pytest

    with pytest.raises(UserError, match="n_trails"):
        check_options(["lagom", "optuna"], {"n_trails": 5})


def test_names_and_paths_in_brackets_are_shown_as_written(tmp_path):
    """Rich read "[...]" in a workload's names and in paths as markup: `search` wrote its plan, then
    ended with "internal error: MarkupError"; `report --out '[bold]r[/bold].html'` said it wrote r.html."""
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump({"kind": "lagom-workload", "name": "[/]w", "groups": [{
        "name": "[/x]g", "compute": [{"name": "[bold]mm[/bold]", "m": 256, "n": 256, "k": 256}],
        "comm": [{"name": "[/]ar", "op": "all_reduce", "nbytes": 1 << 20, "group": "[red]dp"}]}]}))
    r = cli("workload", "show", workload, check=True)
    assert "[/]w · group [/x]g" in r.stdout and "[bold]mm[/bold]" in r.stdout and "[red]dp" in r.stdout, r.stdout
    run, plan, page = tmp_path / "[b]run", tmp_path / "[bold]p[/bold].yaml", tmp_path / "[bold]r[/bold].html"
    cli("profile", "--backend", "sim", "--workload", workload, "--out", run, check=True)
    r = cli("search", run, "--min-gain", "0", "--out", plan, check=True)
    assert f"wrote {plan}" in " ".join(r.stdout.split()), r.stdout
    for target in (plan, run):
        r = cli("show", target, check=True)
        assert "[/]w" in r.stdout, r.stdout
    r = cli("report", plan, "--out", page, check=True)
    assert f"wrote {page}" in " ".join(r.stdout.split()) and page.is_file(), r.stdout


def test_a_gloo_replay_runs_the_plans_chunks_and_threads():
    """`search --validate` on gloo replayed every all-reduce whole and every rank at one thread,
    whatever the plan said, and recorded the speedup of settings it never ran (an auditor's fake
    dist counted the calls)."""
    from lagom_tune.backends.base import Point
    from lagom_tune.backends.gloo_timing import iteration_rows, point_threads
    from lagom_tune.knobs import Settings, settings_items
    from lagom_tune.workload.presets import build_preset

    class Work:
        def wait(self):
            return None

    class FakeDist:
        def __init__(self):
            self.sizes = []

        def barrier(self):
            return None

        def all_reduce(self, buf, async_op=False, **kw):
            self.sizes.append(buf.numel() * buf.element_size())
            return Work()

        def broadcast(self, buf, src):
            return None

    w = build_preset("cpu-demo")
    calls = {}
    for chunk in (0, 1 << 18):
        settings = Settings({"threads": 2}, {"dp_replicate": {"bucket_cap_mb": 25, "chunk_bytes": chunk}})
        point = Point("iteration", settings_items(settings), ranks=2, workload=w)
        assert point_threads(point) == 2
        fake = FakeDist()
        iteration_rows(point, 1, fake)
        calls[chunk] = fake.sizes
    assert sum(calls[0]) == sum(calls[1 << 18]) and len(calls[1 << 18]) > len(calls[0])
    assert max(calls[1 << 18]) <= 1 << 18


def test_report_without_out_writes_report_html_here(tiny_run, tmp_path):
    """`--out`'s default passed through the empty-path check as a Path and `report RUN` ended in an
    internal error (2026-12-04, before it was committed): the default is report.html in the
    current folder."""
    r = subprocess.run([str(BIN / "lagom-tune"), "report", str(tiny_run)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "report.html").is_file(), r.stderr


def test_a_rerun_of_a_finished_profile_measures_nothing_and_keeps_a_current_model(tiny_run, tmp_path):
    """The same command again on a finished folder: nothing left to measure, and model.yaml, this
    revision's fit of exactly these rows, is kept as it is; a model another revision made is refitted."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    again = ("profile", "--workload", tiny_run.parent / "tiny.yaml", "--backend", "gloo", "--ranks", 2, "--out", run, "--repeats", 3)
    rows, model = (run / "measurements.csv").read_bytes(), (run / "model.yaml").read_bytes()
    r = cli(*again, check=True)
    assert "not refitted" in r.stdout and "MAPE" in r.stdout, r.stdout
    assert (run / "measurements.csv").read_bytes() == rows and (run / "model.yaml").read_bytes() == model
    doc = yaml.safe_load(model)
    doc["accuracy"]["fit_revision"] = 0
    (run / "model.yaml").write_text(yaml.safe_dump(doc))
    r = cli(*again, check=True)
    assert "not refitted" not in r.stdout and yaml.safe_load((run / "model.yaml").read_text())["accuracy"]["fit_revision"] == FIT_REVISION


def test_a_model_is_current_only_for_this_fit_of_these_rows(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    folder = RunFolder(run)
    assert current_accuracy(folder)["fit_revision"] == FIT_REVISION
    doc = yaml.safe_load((run / "model.yaml").read_text())
    for key, other in (("rows_digest", "0123abcd"), ("fit_revision", FIT_REVISION + 1)):  # other rows; another fit
        (run / "model.yaml").write_text(yaml.safe_dump({**doc, "accuracy": {**doc["accuracy"], key: other}}))
        assert current_accuracy(folder) is None, key
    (run / "model.yaml").write_text("kind: [")  # unreadable: a refit writes a good one
    assert current_accuracy(folder) is None
    (run / "model.yaml").unlink()
    assert current_accuracy(folder) is None
