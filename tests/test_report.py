"""`lagom-tune report`: one self-contained HTML page, checked in headless Chromium when it is installed."""

import json
import shutil
import subprocess

import pytest

from conftest import cli


@pytest.fixture(scope="module")
def sim_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    cli("profile", "--backend", "sim", "--hardware", "a100-nvlink", "--workload", "olmoe-1b-7b-ep8", "--noise", "0.02",
        "--out", d / "run", "--repeats", "2", check=True)
    cli("search", d / "run", "--out", d / "plan.yaml", check=True)
    return d


def test_report_is_self_contained_and_labelled(sim_plan):
    out = sim_plan / "report.html"
    cli("report", sim_plan / "plan.yaml", "--out", out, check=True)
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "SIMULATED" in page
    assert page.count("data:image/png;base64,") == 3  # fit, slowdown, before/after timeline
    assert "http://" not in page and "https://" not in page  # nothing fetched when opened
    assert "Before / after" in page and "overlap_window" in page


def test_report_of_a_run_folder(sim_plan):
    out = sim_plan / "run.html"
    cli("report", sim_plan / "run", "--out", out, check=True)
    assert out.read_text().count("data:image/png;base64,") == 2


def test_report_renders_in_headless_chromium(sim_plan, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.skip("headless Chromium is not installed (bench/check_report.sh documents the check)")
    out = sim_plan / "report.html"
    cli("report", sim_plan / "plan.yaml", "--out", out, check=True)
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2000", f"--screenshot={shot}",
                    out.as_uri()], capture_output=True, timeout=90)
    assert shot.is_file() and shot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_report_needs_the_plans_run_folder(tmp_path):
    from test_plan import BASE

    plan = BASE.save(tmp_path / "p.yaml")
    r = cli("report", plan, "--out", tmp_path / "r.html")
    assert r.returncode == 2 and "run folder" in r.stderr and not (tmp_path / "r.html").exists()
    assert "the plan names no run folder (model.run)" in r.stderr, r.stderr  # was "its run folder . is not here"


def test_report_finds_the_run_folder_from_the_plans_folder(sim_plan, tmp_path):
    """A plan records its run folder relative to where search ran: `report runs/r/plan.yaml` from
    any other folder said the run folder "is not here", though it held the plan."""
    import yaml

    work = tmp_path / "work"
    shutil.copytree(sim_plan / "run", work / "runs" / "r")
    plan = yaml.safe_load((sim_plan / "plan.yaml").read_text())
    plan["model"]["run"] = "runs/r"  # as `search runs/r` from work/ writes it
    for where in (work / "plan.yaml", work / "runs" / "r" / "plan.yaml"):  # beside runs/, or in the run folder
        where.write_text(yaml.safe_dump(plan))
        cli("report", where, "--out", tmp_path / "r.html", check=True)  # run from the repository, not work/
    plan["workload"]["digest"] = "0" * 16  # a folder beside the plan that is not its run folder is not taken
    (work / "runs" / "r" / "plan.yaml").write_text(yaml.safe_dump(plan))
    r = cli("report", work / "runs" / "r" / "plan.yaml", "--out", tmp_path / "other.html")
    assert r.returncode == 2 and "holds another workload than the plan's" in r.stderr and not (tmp_path / "other.html").exists()


def test_report_refuses_a_run_folder_of_another_workload_and_keeps_its_pictures(sim_plan, tmp_path):
    """The folder the plan records (relative to where search ran, or absolute) was taken without
    the workload check the other places get: a fresh profile of another workload at that path gave
    a wrong before/after. And `report RUN --out RUN/fit.png` wrote HTML over the fit's picture."""
    import yaml

    plan = yaml.safe_load((sim_plan / "plan.yaml").read_text())
    assert (sim_plan / "run" / "meta.yaml").is_file() and plan["model"]["run"] == str(sim_plan / "run")
    plan["workload"]["digest"] = "0" * 16
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    r = cli("report", tmp_path / "plan.yaml", "--out", tmp_path / "r.html")
    assert r.returncode == 2 and "holds another workload" in r.stderr and not (tmp_path / "r.html").exists()
    picture = (sim_plan / "run" / "fit.png").read_bytes()
    r = cli("report", sim_plan / "run", "--out", sim_plan / "run" / "fit.png")
    assert r.returncode == 2 and (sim_plan / "run" / "fit.png").read_bytes() == picture


def test_report_of_a_plan_that_keeps_the_defaults_and_of_a_bad_model(sim_plan, tmp_path):
    """A plan that keeps the defaults sets nothing; its timeline is the defaults' (KeyError 'algo'
    once plans set nothing). A model.yaml that show and search refuse was shown as valid, or
    crashed the report (an empty file)."""
    import yaml

    kept = tmp_path / "kept.yaml"
    cli("search", sim_plan / "run", "--min-gain", "0.9", "--out", kept, check=True)
    assert yaml.safe_load(kept.read_text())["process"] == {}
    assert "the plan keeps the defaults:" in cli("show", kept, check=True).stdout  # search said why; show did not
    r = cli("report", kept, "--out", tmp_path / "kept.html", check=True)
    assert "(1.000×)" in (tmp_path / "kept.html").read_text(), r.stdout
    run = tmp_path / "run"
    shutil.copytree(sim_plan / "run", run)
    for text in ("", "family: foo\n"):
        (run / "model.yaml").write_text(text)
        r = cli("report", run, "--out", tmp_path / "bad.html")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "model" in r.stderr, r.stderr


def test_report_refuses_a_plan_its_runs_model_no_longer_predicts(sim_plan, tmp_path):
    """show printed the plan's recorded 4.37 -> 3.85 ms while report re-predicted 4.39 -> 3.96 ms
    from a model refitted since (or from a plan whose settings were edited), with no word."""
    import yaml

    plan = yaml.safe_load((sim_plan / "plan.yaml").read_text())
    plan["model"]["run"] = str(sim_plan / "run")
    plan["predicted"]["iteration_ms"]["default"] = round(plan["predicted"]["iteration_ms"]["default"] * 1.05, 3)
    edited = tmp_path / "plan.yaml"
    edited.write_text(yaml.safe_dump(plan, sort_keys=False))
    r = cli("report", edited, "--out", tmp_path / "r.html")
    assert r.returncode == 2 and "the plan's predictions are not what its run's model gives it now (default" in r.stderr, r.stderr
    assert not (tmp_path / "r.html").exists()


def test_show_rechecks_a_plans_predictions_against_its_runs_model(sim_plan, tmp_path):
    """show printed a hand-edited plan's recorded predictions as if they held (report refused the
    same plan): it now re-predicts the plan with its run's model, warns where they differ, and says
    when the run folder is not there to recheck them."""
    import yaml

    fresh = cli("show", sim_plan / "plan.yaml", check=True).stdout
    assert "predictions rechecked: the plan's run's model still gives them" in fresh, fresh
    plan = yaml.safe_load((sim_plan / "plan.yaml").read_text())
    plan["model"]["run"] = str(sim_plan / "run")
    plan["predicted"]["iteration_ms"]["plan"] = round(plan["predicted"]["iteration_ms"]["plan"] * 1.05, 3)
    edited = tmp_path / "plan.yaml"
    edited.write_text(yaml.safe_dump(plan, sort_keys=False))
    r = cli("show", edited, check=True)
    assert "warning: the predictions above are not what the plan's run's model gives it now (plan" in r.stdout, r.stdout
    assert "edited since `lagom-tune search` wrote it; search again" in r.stdout, r.stdout
    # --json carried the plan alone, the recheck nowhere: a script read the edited predictions as good
    shown = json.loads(cli("show", edited, "--json", check=True).stdout)
    check, recorded = shown["predictions_check"], plan["predicted"]["iteration_ms"]
    assert shown["plan"]["predicted"]["iteration_ms"] == recorded and check["rechecked"] and not check["held"]
    assert list(check["drift"]) == ["plan"] and check["drift"]["plan"]["recorded_ms"] == recorded["plan"]
    assert check["iteration_ms_now"]["plan"] == check["drift"]["plan"]["now_ms"]
    assert json.loads(cli("show", sim_plan / "plan.yaml", "--json", check=True).stdout)["predictions_check"]["held"]
    plan["model"]["run"] = str(tmp_path / "gone")
    edited.write_text(yaml.safe_dump(plan, sort_keys=False))
    r = cli("show", edited, check=True)
    assert "not rechecked:" in r.stdout and "gone is not here" in r.stdout and "warning" not in r.stdout, r.stdout
    assert r.stdout.count("\n") > 5  # the plan itself is still printed
    check = json.loads(cli("show", edited, "--json", check=True).stdout)["predictions_check"]
    assert not check["rechecked"] and "gone is not here" in check["why"]
    # a name the file system cannot look up (over 255 bytes) was an OSError, exit 1 (an audit, 2026-12-07)
    plan["model"]["run"] = str(tmp_path / ("x" * 300))
    edited.write_text(yaml.safe_dump(plan, sort_keys=False))
    check = json.loads(cli("show", edited, "--json", check=True).stdout)["predictions_check"]
    assert not check["rechecked"] and f"{'x' * 300} is not here" in check["why"]


def test_a_replay_that_falls_short_is_said_in_words_not_console_markup(sim_plan, tmp_path):
    """The report printed the console's "[yellow]warning[/]" as text under its Validation table."""
    import yaml

    plan = tmp_path / "plan.yaml"
    cli("search", sim_plan / "run", "--min-gain", "0", "--out", plan, check=True)
    d = yaml.safe_load(plan.read_text())
    predicted = d["predicted"]["iteration_ms"]
    assert predicted["default"] / predicted["plan"] > 1.0, predicted  # a gain for the replay to fall short of
    base = predicted["default"]
    d["validated"] = {"method": "simulated replay", "simulated": True, "repeats": 2, "iteration_ms": {"default": base, "plan": base},
                      "spread_ms": {"default": [base, base], "plan": [base, base]}, "speedup": 1.0, "interval": [0.99, 1.01]}
    plan.write_text(yaml.safe_dump(d))
    out = tmp_path / "report.html"
    cli("report", plan, "--out", out, check=True)
    page = out.read_text()
    assert "warning the simulated replay ran the plan 1.000×" in page and "[yellow]" not in page and "[/]" not in page
    assert "95% interval 0.990–1.010×: no difference measurable on this machine" in page
    assert "<br>replayed speed-up 1.000×" in page  # each of the caption's lines its own, not run together


def test_a_plan_for_another_backend_than_its_run_is_named_as_such(sim_plan):
    """A plan edited to another backend than its run was profiled on: report said "the model was not
    fitted for threads=512 (fitted: [1])" (an audit, 2026-12-07); now it names the two backends."""
    from dataclasses import replace

    from lagom_tune.errors import UserError
    from lagom_tune.plan.schema import load_plan
    from lagom_tune.plan_check import predict_plan
    from lagom_tune.profile.store import open_run

    plan = replace(load_plan(sim_plan / "plan.yaml"), backend="nccl")
    with pytest.raises(UserError, match=r"the plan is for the nccl backend, but its run folder .* was profiled on sim"):
        predict_plan(plan, open_run(sim_plan / "run"))
