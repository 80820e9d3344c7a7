"""Bad input: one line on stderr, exit code 2, no traceback, nothing written."""

import json
import re

import pandas as pd
import pytest
import yaml

from conftest import ROOT, cli


def assert_one_line_error(r, fragment):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_missing_plan(tmp_path):
    assert_one_line_error(cli("apply", tmp_path / "nope.yaml", "--", "true"), "plan file not found")


def test_garbled_plan(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("kind: lagom-plan\nschema_version: 1\ntarget: {backend: gloo\n")
    assert_one_line_error(cli("apply", p, "--", "true"), "not valid YAML")


def test_a_text_file_given_for_a_plan_or_workload_says_it_is_not_one(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    for argv in (("report", notes), ("apply", notes, "--", "true")):
        assert_one_line_error(cli(*argv), "not a plan file: its top level is a str, not a YAML mapping")
    assert_one_line_error(cli("show", notes), "not a plan, workload, trial record or run folder (its top level is a str, not a YAML mapping)")
    (tmp_path / "other.json").write_text('{"name": "x"}')
    assert_one_line_error(cli("show", tmp_path / "other.json"), "not a plan, workload, trial record or run folder (it has no `kind` field)")
    assert_one_line_error(cli("profile", "--workload", notes, "--out", tmp_path / "run"), "not a workload file: its top level is a str")


def test_plan_with_value_outside_the_domain(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("kind: lagom-plan\nschema_version: 1\ntarget: {backend: gloo, world_size: 2}\nprocess: {threads: 3}\n")
    assert_one_line_error(cli("apply", p, "--", "true"), "process.threads: 3 is outside")


def test_unknown_workload(tmp_path):
    assert_one_line_error(cli("profile", "--workload", "gpt-17", "--out", tmp_path / "run"), "unknown workload 'gpt-17'")
    assert not (tmp_path / "run").exists()


def test_bad_workload_file(tmp_path):
    w = tmp_path / "w.yaml"
    w.write_text("schema_version: 1\nname: x\ngroups: [{name: g, compute: [{name: a, m: 1, n: 1}]}]\n")
    assert_one_line_error(cli("profile", "--workload", w, "--out", tmp_path / "run"), "groups[0].compute[0].k: required")


@pytest.mark.parametrize("args, fragment", [
    (["profile", "--bogus"], "No such option"),
    (["search"], "Missing argument"),
    (["profile", "--ranks", "two", "--out", "x"], "Invalid value for '--ranks'"),
    (["profile", "--ranks", "100000", "--out", "x"], "--ranks 100000 exceeds the"),
    (["search", "not-a-run-folder", "--out", "p.yaml"], "run folder not found"),
    (["show", "missing.yaml"], "file not found"),
    (["show", "phi2"], "file not found: phi2, nor a preset (see `lagom-tune workload list`)"),  # `workload show phi2` said so; show did not
    (["show", "/dev/null"], "/dev/null is not a regular file"),  # was "file not found"
    (["profile", "--workload", "", "--out", "x"], "--workload is empty"),  # was ". is a folder"
    # empty values took the defaults silently; --ib-gbps was accepted and recorded as nothing on one node
    (["profile", "--backend", "sim", "--hardware", "", "--out", "x"], "unknown --hardware ''"),
    (["workload", "show", "llama3-8b", "--parallel", ""], "--parallel '': expected"),
    (["profile", "--backend", "sim", "--workload", "olmoe-1b-7b", "--ib-gbps", "100", "--out", "x"], "fit one node of 8 GPUs"),
    # named a flag never passed when a run's fingerprint held it (search --validate; an audit, 2026-12-04)
    (["profile", "--backend", "sim", "--workload", "phi-2-fsdp16", "--ib-gbps", "7", "--out", "x"],
     "ib_gbps 7 (--ib-gbps, or a run's fingerprint.ib_gbps): the simulated InfiniBand rates are 100, 400 Gb/s"),
    # an empty path was the current folder: `profile --out ""` profiled into it (an audit, 2026-12-04)
    (["profile", "--backend", "sim", "--workload", "phi-2-fsdp16", "--out", ""], "'--out' / '-o': '' is empty"),
    (["search", "runs/x", "--out", ""], "'--out' / '-o': '' is empty"),
    (["fit", ""], "'' is empty: give a file or folder"),
    (["report", "plans/demo-cpu.yaml", "--out", " "], "' ' is empty"),
    (["apply", "plans/demo-cpu.yaml", "--applied", "", "--", "true"], "'--applied': '' is empty"),
    # --reduce-dtype where the workload reduces no gradients would be ignored: refused, as --seq is for a file
    (["workload", "show", "phi-2", "--reduce-dtype", "fp8"], "--reduce-dtype 'fp8': expected one of fp32, bf16, fp16"),
    (["workload", "show", "olmoe-1b-7b", "--reduce-dtype", "fp32"], "ep=8 reduces no gradients across ranks"),
    (["workload", "show", "phi-2", "--parallel", "tp=8", "--reduce-dtype", "fp32"], "tp=8 reduces no gradients"),
    (["workload", "show", "cpu-demo", "--reduce-dtype", "bf16"], "--reduce-dtype applies to model presets"),
    # 2-D and 3-D (fsdp with tp, and dp) are presets; a dimension of one rank is refused
    (["workload", "show", "llama3-8b", "--parallel", "fsdp=2,tp=4,dp=1,dp=2"], "dp= is given twice"),
    (["workload", "show", "llama3-8b", "--parallel", "fsdp=1,tp=8"], "fsdp=1 runs no collective"),
    (["workload", "show", "olmoe-1b-7b", "--parallel", "fsdp=2,tp=4"], "MoE model: use --parallel ep=N"),
    (["profile", "--workload", "mine.yaml", "--reduce-dtype", "fp32", "--out", "x"],
     "--reduce-dtype applies to presets"),
])
def test_bad_flags_and_arguments(args, fragment):
    assert_one_line_error(cli(*args), fragment)


def test_one_rank_is_refused_with_the_bound():
    """Its help said x>=1; typer words the bound its own way (0.18: "1 is not in the range x>=2")."""
    r = cli("profile", "--ranks", "1", "--out", "x")
    assert_one_line_error(r, "'--ranks'")
    assert re.search(r"greater than or equal to 2|x>=2", r.stderr), r.stderr


def test_help_on_every_verb():
    for verb in ("profile", "search", "apply", "show", "workload"):
        r = cli(verb, "--help")
        assert r.returncode == 0 and "Usage" in r.stdout


def test_a_zero_or_narrow_terminal_width_still_prints_every_cell_whole():
    """COLUMNS=0 printed nothing at all (warnings included) and exited 0; at 80 columns cells ended
    in "…" (``buffsize=8…``, ``1x10240x2560x…``): a narrow table folds its cells instead."""
    from lagom_tune.workload.presets import PRESETS

    shown = cli("workload", "list", env={"COLUMNS": "0"}, check=True).stdout
    assert "workload presets" in shown and "…" not in shown
    names = "".join(line.split("│")[1].strip() for line in shown.splitlines() if line.startswith("│"))  # folded pieces rejoined
    assert all(name in names for name in PRESETS), names


def test_lines_printed_to_a_pipe_are_never_hard_wrapped():
    """A log reader greps whole lines: a long path must not split a message (seen on a GPU host)."""
    import subprocess
    import sys

    long = "x" * 300
    out = subprocess.run([sys.executable, "-c", f"from lagom_tune.render import console; console.print('wrote {long}: groups cover 1 ms')"],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("\n") == 1 and "groups cover" in out


def test_a_plan_left_in_the_shell_is_refused_where_lagom_tune_measures(tiny_run, tmp_path):
    """After `eval "$(lagom-tune apply plan.yaml --print-env)"` every Python process loads the plan,
    lagom-tune's own ranks too: a `search --validate` replay of the "default" ran the plan's
    chunked all-reduce, and nothing said so."""
    env = {"LAGOM_TUNE_PLAN": str(tmp_path / "p.yaml")}
    assert_one_line_error(cli("profile", "--out", tmp_path / "run", env=env), "unset LAGOM_TUNE_PLAN")
    assert_one_line_error(cli("search", tiny_run, "--validate", "2", "--out", tmp_path / "p2.yaml", env=env),
                          "the plan would apply to search --validate's own measurements")
    assert not (tmp_path / "run").exists() and not (tmp_path / "p2.yaml").exists()
    cli("search", tiny_run, "--out", tmp_path / "p3.yaml", env=env, check=True)  # measuring nothing: nothing to refuse


def test_small_things_a_new_user_meets(tmp_path):
    """--version; --verbose after the verb; workload list --json; a folder given as a plan."""
    import json

    from lagom_tune import __version__

    assert cli("--version", check=True).stdout.strip() == f"lagom-tune {__version__}"
    late = cli("show", tmp_path / "nowhere", "--verbose")
    assert late.returncode == 2 and "Traceback" in late.stderr  # asked for, after the subcommand
    assert "Traceback" not in cli("show", tmp_path / "nowhere").stderr
    names = [w["name"] for w in json.loads(cli("workload", "list", "--json", check=True).stdout)]
    assert "cpu-demo" in names and "llama3-8b" in names
    folder = cli("apply", tmp_path, "--", "true")
    assert folder.returncode == 2 and "is a folder, not a plan file" in folder.stderr
    passthrough = cli("apply", tmp_path / "nowhere.yaml", "--", "echo", "-v")  # the user's -v is theirs
    assert passthrough.returncode == 2 and "Traceback" not in passthrough.stderr


def test_a_collective_the_backend_does_not_measure_is_refused_before_measuring(tmp_path):
    """gloo times every collective as an all-reduce: an FSDP-style all-gather workload was
    measured whole, then the fit failed ("no fit for all_reduce") and wrote model.yaml anyway."""
    w = tmp_path / "w.yaml"
    w.write_text("schema_version: 1\nname: ag\ngroups:\n- name: g\n  compute: [{name: a, m: 64, n: 64, k: 64}]\n"
                 "  comm: [{name: c, op: all_gather, nbytes: 65536, ranks: 2}]\n")
    r = cli("profile", "--backend", "gloo", "--workload", w, "--out", tmp_path / "run")
    assert_one_line_error(r, "the gloo backend measures all_reduce only, not the workload's all_gather")
    assert "--backend nccl or sim" in r.stderr and not (tmp_path / "run").exists()


def test_a_file_whose_aliases_expand_without_bound_is_refused(tmp_path):
    """A "billion laughs" in a workload's free-form meta ran `show --json` out of memory (an auditor's file)."""
    levels = ["  l0: &l0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    w = tmp_path / "w.yaml"
    w.write_text("schema_version: 1\nname: bomb\nmeta:\n" + "\n".join(levels) + "\ngroups:\n- name: g\n"
                 "  compute: [{name: a, m: 64, n: 64, k: 64}]\n  comm: [{name: c, op: all_reduce, nbytes: 65536, ranks: 2}]\n")
    assert_one_line_error(cli("show", w, "--json"), "its aliases expand to more than 5,000,000 nodes")
    merged = tmp_path / "m.yaml"  # an anchor and a merge, as YAML allows: read as written
    merged.write_text("schema_version: 1\nname: merged\ngroups:\n- name: g\n  compute: [&a {name: a, m: 64, n: 64, k: 64}]\n"
                      "  comm: [{name: c, op: all_reduce, nbytes: 65536, ranks: 2}]\n- name: h\n  compute: [{<<: *a, name: b}]\n")
    assert cli("show", merged).returncode == 0


def test_a_workload_of_other_ranks_than_gloo_spawns_is_refused_before_measuring(tmp_path):
    """gloo measured a 4-rank workload's all-reduce between 2 processes and `search` wrote a plan
    that `show` and `apply` refused ("4 ranks, more than the world size 2"; an auditor's trace)."""
    w = tmp_path / "w.yaml"
    w.write_text("schema_version: 1\nname: four\ngroups:\n- name: g\n  compute: [{name: a, m: 64, n: 64, k: 64}]\n"
                 "  comm: [{name: c, op: all_reduce, nbytes: 65536, ranks: 4}]\n")
    r = cli("profile", "--backend", "gloo", "--workload", w, "--out", tmp_path / "run")
    assert_one_line_error(r, "its collectives span 4 ranks, but the gloo backend would measure them between 2; profile with --ranks 4")
    assert not (tmp_path / "run").exists()


def test_a_fit_that_cannot_predict_its_points_writes_no_model_and_prints_only_the_error(tiny_run, tmp_path):
    import shutil

    import pandas as pd

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "model.yaml").unlink()
    df = pd.read_csv(run / "measurements.csv")
    coll = df["kind"] == "collective"  # as gloo labelled them (op and key): no all-reduce curve for the pairs
    df.loc[coll, "op"] = "all_gather"
    df.loc[coll, "point"] = df.loc[coll, "point"].str.replace("|all_reduce:", "|all_gather:", regex=False)
    df.to_csv(run / "measurements.csv", index=False)
    meta = yaml.safe_load((run / "meta.yaml").read_text())  # ... in a workload that holds an all-gather (else refused on read)
    comm = next(g["comm"] for g in meta["workload"]["groups"] if g["comm"])
    comm.append({**comm[0], "name": "gather", "op": "all_gather"})
    from lagom_tune.workload.spec import Workload
    meta["workload_digest"] = Workload.from_dict(meta["workload"]).digest  # as profiled (an edited workload is refused)
    (run / "meta.yaml").write_text(yaml.safe_dump(meta))
    r = cli("fit", run)
    assert_one_line_error(r, "the model has no fit for all_reduce")
    assert r.stdout == ""  # its progress bar leaves no stale "0/?" line (nor a blank one) before the error
    assert not (run / "model.yaml").exists()


@pytest.mark.parametrize("argv, said", [
    (["profile", "--backend", "gloo", "--noise", "0.1", "--out", "{tmp}/run"], "--noise applies to the sim backend, not gloo"),
    (["profile", "--backend", "gloo", "--hardware", "h100-nvlink", "--out", "{tmp}/run"], "--hardware applies to the sim backend"),
    (["profile", "--backend", "sim", "--workload", "llama3-8b-fsdp8", "--ranks", "64", "--out", "{tmp}/run"],
     "--ranks applies to the gloo backend, not sim"),  # meta.yaml said 8 ranks (cpu-demo's --ranks is its world: taken)
    (["profile", "--backend", "sim", "--timeout", "5", "--out", "{tmp}/run"], "--timeout applies to the gloo or nccl backend, not sim"),
    (["workload", "show", "{tmp}/w.yaml", "--seq", "7"], "--seq applies to presets; {tmp}/w.yaml is a workload file"),
    (["profile", "--backend", "sim", "--workload", "{tmp}/w.yaml", "--parallel", "fsdp=2", "--out", "{tmp}/run"],
     "--parallel applies to presets"),
    (["workload", "show", "llama3-8b-fsdp8", "--parallel", "fsdp=8,fsdp=4"], "fsdp= is given twice"),
    (["show", "plans/demo-cpu.yaml", "--collectives"], "--collectives applies to a run folder"),
    (["show", "plans/demo-cpu.yaml", "--remeasured"], "--remeasured applies to a run folder"),
    (["show", "plans/demo-cpu.yaml", "--heldout"], "--heldout applies to a run folder"),
    (["show", "bench/results/gpu_check-mpt-7b-tp8-dp1-run", "--remeasured", "--collectives"], "give one"),
    (["show", "bench/results/gpu_check-mpt-7b-tp8-dp1-run", "--heldout", "--collectives"], "--collectives and --heldout each list"),
])
def test_an_option_that_would_be_ignored_is_refused(tmp_path, argv, said):
    """Each ran (a real gloo profile with --noise 0.1, a file's shapes unchanged), the option
    silently ignored, as search already refuses an optimizer's flags another would ignore."""
    from lagom_tune.workload.presets import build_preset

    build_preset("cpu-demo").save(tmp_path / "w.yaml")
    r = cli(*[a.format(tmp=tmp_path) for a in argv])
    assert_one_line_error(r, said.format(tmp=tmp_path))
    assert not (tmp_path / "run").exists()


def test_a_csv_that_lost_points_or_a_model_fitted_to_other_rows_is_no_basis_for_a_plan(tiny_run, tmp_path):
    """A CSV cut at a line boundary (a finished profile, meta.yaml complete) was searched with
    no word; so was the model a resumed profile's interrupted refit left, fitted to the partial one."""
    import shutil

    cut, stale = tmp_path / "cut", tmp_path / "stale"
    shutil.copytree(tiny_run, cut)
    lines = (cut / "measurements.csv").read_text().splitlines(keepends=True)
    (cut / "measurements.csv").write_text("".join(lines[: len(lines) // 2]))
    assert_one_line_error(cli("search", cut, "--out", tmp_path / "p.yaml"), "points the profile measured; rerun `lagom-tune profile`")
    assert "points the profile measured; rerun the same profile command" in " ".join(cli("show", cut, check=True).stdout.split())
    shutil.copytree(tiny_run, stale)
    doc = yaml.safe_load((stale / "model.yaml").read_text())
    doc["accuracy"]["rows"] -= 7
    (stale / "model.yaml").write_text(yaml.safe_dump(doc))
    assert_one_line_error(cli("search", stale, "--out", tmp_path / "p.yaml"), "model.yaml was fitted to")
    assert "rerun `lagom-tune fit" in " ".join(cli("show", stale, check=True).stdout.split())
    assert not (tmp_path / "p.yaml").exists()
    # as many rows, measured again since the fit (a resume re-measured points cut from the CSV): searched as current
    again = tmp_path / "again"
    shutil.copytree(tiny_run, again)
    df = pd.read_csv(again / "measurements.csv")
    df.loc[5, "time_us"] *= 1.01
    df.to_csv(again / "measurements.csv", index=False)
    assert_one_line_error(cli("search", again, "--out", tmp_path / "p.yaml"), "model.yaml was fitted to other measurement rows")
    assert "fitted to other measurement rows" in " ".join(cli("show", again, check=True).stdout.split())


@pytest.mark.parametrize("recorded, said", [("absent", "an older lagom-tune (before fit revisions were recorded)"), (0, None),
                                             ("two", None), ("newer", "a newer lagom-tune (fit revision")])
def test_a_model_another_revision_of_the_fit_made_is_named_with_how_to_refit(tiny_run, tmp_path, recorded, said):
    """The committed H200 tables held a fit from before the roll-off curve, and nothing said so: a
    model.yaml records the fit's revision, and show, report and search name a model another
    revision made (search still searches it: its rows are current), with the command that refits it.
    A revision that is not a whole number of at least 1 is refused."""
    import shutil

    from lagom_tune.model.contention import FIT_REVISION

    assert yaml.safe_load((tiny_run / "model.yaml").read_text())["accuracy"]["fit_revision"] == FIT_REVISION
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    doc = yaml.safe_load((run / "model.yaml").read_text())
    if recorded == "absent":  # every model.yaml fitted before 2026-12-06
        del doc["accuracy"]["fit_revision"]
    else:
        doc["accuracy"]["fit_revision"] = FIT_REVISION + 1 if recorded == "newer" else recorded
    (run / "model.yaml").write_text(yaml.safe_dump(doc))
    if said is None:
        assert_one_line_error(cli("show", run), "fit_revision")
        assert_one_line_error(cli("search", run, "--out", tmp_path / "p.yaml"), "fit_revision")
        return
    refit = f"`lagom-tune fit {run}` refits it"
    assert said in " ".join(cli("show", run, check=True).stdout.split())
    report = tmp_path / "r.html"
    cli("report", run, "--out", report, check=True)
    assert said in " ".join(report.read_text().split())
    searched = cli("search", run, "--json", "--out", tmp_path / "p.yaml", check=True)
    assert json.loads(searched.stdout)["plan"] == str(tmp_path / "p.yaml")  # the warning stays off --json's stdout
    assert said in " ".join(searched.stderr.split()) and refit in " ".join(searched.stderr.split())
    # refitted, nothing is said
    cli("fit", run, check=True)
    assert said not in cli("show", run, check=True).stdout and said not in cli("search", run, "--out", tmp_path / "q.yaml", check=True).stderr


def test_an_output_that_holds_something_else_is_never_replaced(tiny_run, tmp_path):
    """search --out, report --out and workload import --out replaced any file: another run's
    meta.yaml (that profile was lost), a user's notes. A file of their own kind is still rewritten."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_run, other)
    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    meta = (other / "meta.yaml").read_text()
    assert_one_line_error(cli("search", tiny_run, "--out", other / "meta.yaml"), "exists and is not a plan lagom-tune wrote")
    assert_one_line_error(cli("report", tiny_run, "--out", notes), "exists and is not a report lagom-tune wrote")
    (tmp_path / "t.json").write_text("{}")
    assert_one_line_error(cli("workload", "import", tmp_path / "t.json", "--out", notes), "exists and is not a workload lagom-tune wrote")
    assert (other / "meta.yaml").read_text() == meta and notes.read_text() == "precious\n"
    # notes that quote a plan further down (README's plan format) were taken for one and replaced
    readme = tmp_path / "README.md"
    readme.write_text("# notes\n" + "text\n" * 300 + "```yaml\nschema_version: 1\nkind: lagom-plan\n```\n")
    assert_one_line_error(cli("search", tiny_run, "--out", readme), "exists and is not a plan lagom-tune wrote")
    # ... and within the first KiB, under a line of prose (an audit, 2026-12-04): a mark is the file's start
    short = tmp_path / "short.md"
    short.write_text("my plan from Tuesday:\n\nschema_version: 1\nkind: lagom-plan\n")
    assert_one_line_error(cli("search", tiny_run, "--out", short), "exists and is not a plan lagom-tune wrote")
    short.write_text("the trace's workload:\nschema_version: 1\nkind: lagom-workload\n")
    assert_one_line_error(cli("workload", "import", tmp_path / "t.json", "--out", short), "exists and is not a workload lagom-tune wrote")
    assert short.read_text().startswith("the trace's workload:")
    # the Optuna study's own database as the plan: the study was replaced by the plan
    db = tmp_path / "same.db"
    assert_one_line_error(cli("search", tiny_run, "--optimizer", "optuna", "--storage", f"sqlite:///{db}", "--study-name", "s", "--out", db),
                          "is the Optuna study's database")
    assert readme.read_text().startswith("# notes") and not db.exists()
    (tmp_path / "p.yaml").write_text("")  # as `mktemp` leaves it
    for _ in range(2):  # the second run replaces the first's plan and report
        cli("search", tiny_run, "--out", tmp_path / "p.yaml", check=True)
        cli("report", tiny_run, "--out", tmp_path / "r.html", check=True)


GPU_RUN = "bench/results/gpu_check-mpt-7b-tp8-dp1-run"


@pytest.mark.parametrize("verb", [["search", "--out", "p.yaml"], ["show"], ["report", "-o", "r.html"]])
@pytest.mark.parametrize("source, edit, said", [
    # a GPU model in a gloo run: search crashed with KeyError 'algo' (gloo's knob space has no algorithm)
    ("tiny", lambda run, doc: yaml.safe_load((ROOT / GPU_RUN / "model.yaml").read_text()),
     "model.yaml.family: lagom-gpu, but its run's profiles say cpu-pairwise"),
    # show dropped the (simulated) tags of a sim run whose model said false
    ("tiny", lambda run, doc: {**doc, "simulated": True}, "model.yaml.simulated: True, but its run's profiles say False"),
    # an H100's model in an A40 run: a plan for the A40 carried the H100's predictions
    ("gpu", lambda run, doc: {**doc, "device": {**doc["device"], "sms": 84}}, "model.yaml.device.sms: 84, but its run's profiles say 132"),
])
def test_a_model_that_is_not_its_runs_is_refused(tiny_run, tmp_path, verb, source, edit, said):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run if source == "tiny" else ROOT / GPU_RUN, run)
    doc = yaml.safe_load((run / "model.yaml").read_text())
    (run / "model.yaml").write_text(yaml.safe_dump(edit(run, doc)))
    r = cli(verb[0], run, *verb[1:])
    assert_one_line_error(r, said)


@pytest.mark.parametrize("argv, resumes", [(["profile", "--out", "r"], True), (["search", "r", "--out", "p.yaml"], False),
                                           (["search", "r", "--storage=sqlite:///s.db"], True), (["fit", "r"], False)])
def test_an_interrupt_says_rerun_to_resume_only_where_the_verb_resumes(argv, resumes, capsys):
    """Every interrupted verb said "rerun the same command to resume"; only a profile, and a search
    whose Optuna study is stored, do."""
    from lagom_tune.cli import _interrupted
    with pytest.raises(SystemExit) as e:
        _interrupted(KeyboardInterrupt(), argv)
    assert e.value.code == 130 and ("to resume" in capsys.readouterr().err) == resumes


def test_an_interrupt_while_the_cli_loads_is_one_line(monkeypatch, capsys):
    """Ctrl-C in the first half second (torch and pandas loading) printed a 30-line traceback (an
    audit, 2026-12-03): the entry point imports the CLI inside its handler."""
    import builtins

    import lagom_tune.__main__ as entry

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "lagom_tune.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as e:
        entry.run()
    assert e.value.code == 130 and capsys.readouterr().err == "lagom-tune: interrupted\n"


def test_a_run_file_that_is_no_file_is_refused_before_any_work(tiny_run, tmp_path):
    """A folder named model.yaml (or fit.png) was found only after the whole profile was measured
    ("internal error: IsADirectoryError"); a measurements.csv linked to /dev/full was read until the
    OOM killer came."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "model.yaml").unlink()
    (run / "model.yaml").mkdir()
    for argv in (("fit", run), ("show", run), ("profile", "--workload", tiny_run.parent / "tiny.yaml", "--ranks", 2,
                                                          "--repeats", 3, "--out", run)):
        assert_one_line_error(cli(*argv), f"{run / 'model.yaml'} is not a regular file")
    (run / "model.yaml").rmdir()
    (run / "measurements.csv").unlink()
    (run / "measurements.csv").symlink_to("/dev/full")
    assert_one_line_error(cli("show", run), "measurements.csv is not a regular file")


def test_a_failing_disk_is_one_line_not_an_internal_error(tiny_run, monkeypatch, capsys):
    """ENOSPC, or a file made read-only while a command ran, ended in "internal error: OSError"."""
    import errno

    from lagom_tune import cli as cli_module
    from lagom_tune.model import fit

    def full(run, progress=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(run.path / "model.yaml"))

    monkeypatch.setattr(fit, "fit_run", full)
    with pytest.raises(SystemExit) as stop:
        cli_module.main(["fit", str(tiny_run)])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.strip() == f"lagom-tune: failed: No space left on device: {tiny_run / 'model.yaml'}", err


def test_an_interrupt_while_the_measurements_parse_is_an_interrupt_not_a_corrupt_file(tiny_run, tmp_path, monkeypatch, capsys):
    """Ctrl-C while pandas parsed measurements.csv read as "not a valid measurements CSV" (exit 2;
    an audit, 2026-12-04): its C parser reports the KeyboardInterrupt raised in its read callback
    as a ParserError. The signal really arrives here, through the CLI's own handler; the parser is
    stood in for by one that does what pandas does with it."""
    import os
    import signal

    from lagom_tune import cli
    from lagom_tune.profile import store

    def parse_interrupted(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)  # let the handler run
        except KeyboardInterrupt:
            raise pd.errors.ParserError("Error tokenizing data. C error: Calling read(nbytes) on source failed.") from None
        raise AssertionError("SIGINT did not interrupt")

    monkeypatch.setattr(store.pd, "read_csv", parse_interrupted)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(["search", str(tiny_run), "--out", str(tmp_path / "p.yaml")])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "not a valid measurements CSV" not in err, err


def test_a_misspelt_meta_yaml_field_is_named(tiny_run, tmp_path):
    """meta.yaml took any field (``repeat: 5`` read as absent) where plans and models name it (an
    audit, 2026-12-04)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    meta = yaml.safe_load((run / "meta.yaml").read_text())
    (run / "meta.yaml").write_text(yaml.safe_dump({**meta, "repeat": meta["repeats"]}))
    assert_one_line_error(cli("show", run), "meta.yaml.repeat: unknown field (did you mean 'repeats'?")


def test_a_row_of_another_label_is_named_as_written(tiny_run, tmp_path):
    """A row's ``simulated`` edited in a measured run was named ``np.True_`` (an audit, 2026-12-04)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    df = pd.read_csv(run / "measurements.csv", low_memory=False)
    df.loc[df.index[0], "simulated"] = True
    df.to_csv(run / "measurements.csv", index=False)
    r = cli("show", run)
    assert_one_line_error(r, "simulated of point")
    assert "is True, but the run's is False" in r.stderr and "np." not in r.stderr, r.stderr


def test_a_workload_too_long_for_a_plan_is_named_not_the_plans_field(tmp_path):
    """A workload whose iteration is predicted past what a plan records (about a day) passed
    `profile` and then failed on `<out>.predicted.iteration_ms.default`, a field of a file the user
    never wrote (an audit, 2026-12-04). The workload is named, and --compare still prints."""
    wl = tmp_path / "long.yaml"
    wl.write_text("name: long\ngroups:\n- name: layer\n  repeat: 1000000\n  compute:\n"
                  "  - {name: g, m: 65536, n: 65536, k: 16384, dtype: bf16}\n  - {name: h, m: 8192, n: 8192, k: 8192, dtype: bf16}\n"
                  "  comm:\n  - {name: ar, op: all_reduce, nbytes: 100000000, ranks: 8}\n")
    cli("profile", "--backend", "sim", "--workload", wl, "--out", tmp_path / "run", check=True)
    assert_one_line_error(cli("search", tmp_path / "run", "--out", tmp_path / "p.yaml"), "workload 'long': its iteration is predicted at")
    assert not (tmp_path / "p.yaml").exists()
    assert cli("search", tmp_path / "run", "--compare").returncode == 0
