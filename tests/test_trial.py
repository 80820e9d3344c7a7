"""`lagom-tune trial`: the user's command with the defaults and with the plan, interleaved, timed by
the step clock (torch.optim's step hook in every process; the script unchanged)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lagom_tune.errors import UserError
from lagom_tune.runtime.launch import site_pythonpath
from lagom_tune.runtime.steps import STEPS_ENV, read_steps, step_seconds
from lagom_tune.runtime.trial import ARMS, TrialRun, read_trial

from conftest import ROOT, cli
from test_plan import BASE

# A training loop that never heard of lagom-tune: two optimizers (the second stepped every other
# iteration), a step that takes STEP_S, or FAST_S where OMP_NUM_THREADS is 1 (which BASE's
# threads=1 sets under the plan), and an exit status from FAIL_WITH_THREADS when given.
SCRIPT = textwrap.dedent("""\
    import os, sys, time, torch
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads == os.environ.get("FAIL_WITH_THREADS", "never"):
        sys.exit(3)
    if threads == os.environ.get("HANG_WITH_THREADS", "never"):
        time.sleep(120)
    m = torch.nn.Linear(4, 4)
    first, second = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.Adam(m.parameters())
    for i in range(int(os.environ.get("STEPS", "10"))):
        first.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        time.sleep(0.02 if threads == "1" else 0.05)
        first.step()
        if i % 2:
            second.step()
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "LAGOM_TUNE_PLAN")}
    return {**env, **extra}


def test_the_step_clock_times_an_unchanged_script_by_its_most_stepped_optimizer(script, tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    env = clean_env(PYTHONPATH=site_pythonpath({}), **{STEPS_ENV: str(steps), "RANK": "3"})
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    times = read_steps(steps)
    assert list(times) == ["3"] and len(times["3"]) == 10  # SGD's 10 steps, not Adam's 5
    assert 0.045 <= step_seconds(times["3"], 2) < 0.2  # the loop's 50 ms a step, whatever the machine adds


def test_the_step_clock_is_off_without_its_variable(script, tmp_path):
    env = clean_env(PYTHONPATH=site_pythonpath({}), TMPDIR=str(tmp_path))
    env.pop(STEPS_ENV, None)
    subprocess.run([sys.executable, str(script)], env={**env, "STEPS": "2"}, check=True, timeout=120, cwd=tmp_path)
    assert not list(tmp_path.rglob("steps-*.json"))


def test_a_rank_is_read_from_its_longest_attempt_and_broken_files_are_skipped(tmp_path):
    (tmp_path / "steps-0.11.json").write_text(json.dumps({"rank": "0", "pid": 11, "times": [0, 1, 2]}))
    (tmp_path / "steps-0.12.json").write_text(json.dumps({"rank": "0", "pid": 12, "times": [0, 1, 2, 3, 4]}))
    (tmp_path / "steps-1.13.json").write_text('{"rank": "1", "times": [0, 1')  # cut short: not ours to read
    assert read_steps(tmp_path) == {"0": [0, 1, 2, 3, 4]}


def test_a_step_time_needs_two_steps_after_the_warmup():
    assert step_seconds([0.0, 1.0, 3.0, 6.0], 1) == pytest.approx(2.5)  # steps 3 and 4 took 2 s and 3 s
    with pytest.raises(UserError, match=r"3 optimizer step\(s\) seen, too few to time any after --warmup 2: run at least 4"):
        step_seconds([0.0, 1.0, 2.0], 2)


def test_the_rounds_are_read_as_paired_ratios_with_an_interval():
    runs = [TrialRun(1, "default", 110.0, 10, 2), TrialRun(1, "plan", 100.0, 10, 2),
            TrialRun(2, "plan", 101.0, 10, 2), TrialRun(2, "default", 112.0, 10, 2),
            TrialRun(3, "default", 109.0, 10, 2)]  # round 3 never ran the plan: left out of the ratios
    reading = read_trial(runs, same_settings=False)
    assert reading.speedup == pytest.approx(((110 / 100) * (112 / 101)) ** 0.5)
    assert reading.ratios == {"default": (pytest.approx(1.1),), "plan": (pytest.approx(112 / 101),)}  # by the arm run first
    assert 1.0 < reading.low <= reading.speedup <= reading.high and reading.verdict == "the plan is faster"
    assert reading.step_ms == {"default": 110.0, "plan": 100.5} and reading.spread_ms["default"] == (109.0, 112.0)
    assert read_trial(runs, same_settings=True).verdict.startswith("same settings")
    with pytest.raises(UserError, match="no round ran both"):
        read_trial(runs[:1], False)


def test_a_trial_that_cannot_tell_says_how_many_rounds_the_predicted_gain_would_need():
    """An interval that holds 1 now says, at the spread the rounds showed, after how many rounds
    the plan's predicted speed-up would show (it said only that more rounds narrow it)."""
    from lagom_tune.render import trial_summary
    from lagom_tune.runtime.trial import TrialRecord

    ms = [(110.0, 100.0), (95.0, 100.0), (105.0, 100.0), (98.0, 100.0)]  # per-round ratios 1.10, 0.95, 1.05, 0.98
    runs = tuple(TrialRun(i + 1, arm, t, 10, 2) for i, pair in enumerate(ms) for arm, t in zip(("default", "plan"), pair))
    record = TrialRecord("p.yaml", "cmd", "2026-12-07", "h", 4, 2, False, 1.03, runs)
    assert record.reading().rounds_to_show == 22  # comparison.rounds_to_show([1.10, 0.95, 1.05, 0.98], 1.03, 100)
    lines = [x for x in trial_summary(record) if isinstance(x, str)]
    assert any("the plan's predicted 1.030× would show after about 22 rounds (--rounds 22)" in line for line in lines), lines
    assert TrialRecord.from_dict(record.to_dict(), "t.json") == record  # the prediction is kept in the record
    tiny = TrialRecord("p.yaml", "cmd", "2026-12-07", "h", 4, 2, False, 1.005, runs)
    assert any("would not show within 100 rounds" in line for line in map(str, trial_summary(tiny))), trial_summary(tiny)
    old = {k: val for k, val in record.to_dict().items() if k not in ("predicted", "reading")}  # written before 2026-12-07
    assert TrialRecord.from_dict(old, "t.json").reading().rounds_to_show is None
    assert any("more rounds (--rounds) narrow it" in line for line in map(str, trial_summary(TrialRecord.from_dict(old, "t.json"))))


def test_a_trial_shows_its_rounds_by_the_arm_that_ran_first():
    """The per-round ratios the interval is read from, in two groups: a run's place in its round,
    if it matters, shows as one group above the other."""
    from lagom_tune.render import trial_summary
    from lagom_tune.runtime.trial import TrialRecord

    ms = [(110.0, 100.0), (100.0, 104.0), (108.0, 100.0)]  # the plan second in rounds 1 and 3, first in 2
    runs = tuple(TrialRun(i + 1, arm, t, 10, 2) for i, pair in enumerate(ms)
                 for arm, t in (zip(ARMS, pair) if i % 2 == 0 else reversed(list(zip(ARMS, pair)))))
    lines = [x for x in trial_summary(TrialRecord("p.yaml", "cmd", "2026-12-07", "h", 3, 2, False, runs=runs)) if isinstance(x, str)]
    assert "per round, default / plan: default first 1.100 1.080 · plan first 0.962" in lines, lines


def test_an_odd_number_of_rounds_is_said_to_favour_one_order(script, tmp_path):
    r = cli("trial", BASE.save(tmp_path / "plan.yaml"), "--rounds", 3, "--", sys.executable, "-c", "pass", env=clean_env())
    assert r.returncode == 2 and "--rounds 3 is odd: the default runs first in 2 rounds, the plan in 1" in r.stderr, r.stderr


def test_a_trial_stopped_after_one_round_says_it_has_no_interval():
    """One round's ratio has no interval: shown as such, never as a measured speed-up."""
    from lagom_tune.render import trial_summary
    from lagom_tune.runtime.trial import TrialRecord

    runs = (TrialRun(1, "default", 110.0, 10, 2), TrialRun(1, "plan", 100.0, 10, 2))
    lines = [x for x in trial_summary(TrialRecord("p.yaml", "cmd", "2026-12-07", "h", 4, 2, False, runs=runs)) if isinstance(x, str)]
    assert "1.100×, no interval from one round: [bold]no difference measurable on this machine[/]" in lines[0], lines
    assert any("stopped after 2 of 8 runs" in line for line in lines), lines


def test_trial_measures_the_plan_against_the_defaults_and_records_every_run(script, tmp_path):
    plan = BASE.save(tmp_path / "plan.yaml")  # threads=1: OMP_NUM_THREADS=1 under the plan, a 20 ms step
    # RANK as torchrun sets it: the shim reports for ranks
    r = cli("trial", plan, "--rounds", 2, "--warmup", 2, "--", sys.executable, script, env=clean_env(RANK="0"), timeout=600)
    assert r.returncode == 0, r.stderr
    record = json.loads((tmp_path / "trial.json").read_text())
    assert [(run["round"], run["arm"]) for run in record["runs"]] == [(1, "default"), (1, "plan"), (2, "plan"), (2, "default")]
    assert record["kind"] == "lagom-trial" and record["warmup"] == 2 and not record["same_settings"]
    assert all(run["ranks"] == 1 and run["steps"] == 10 for run in record["runs"])
    assert record["reading"]["speedup"] > 1.5 and record["reading"]["verdict"] == "the plan is faster", record
    assert "the plan is faster" in r.stderr and "round 2/2 default" in r.stderr
    assert r.stderr.count("[lagom-tune rank 0] applied threads=1") == 1, r.stderr  # the first plan run says it; the next is quiet
    # the plan's runs are apply's: the rank's record of what it applied, as apply writes it
    assert "threads" in json.dumps(json.loads((tmp_path / "applied.json").read_text())["ranks"]["0"]["records"])
    shown = cli("show", tmp_path / "trial.json", check=True).stdout  # the record read back, its reading made again
    assert "the plan is faster" in shown and f"{record['reading']['speedup']:.3f}×" in shown
    assert json.loads(cli("show", tmp_path / "trial.json", "--json", check=True).stdout) == record


@pytest.mark.parametrize("edit, said", [
    (lambda d: d["runs"][0].update(step_ms=-1.0), r"runs\[0\].step_ms: must be >= "),
    (lambda d: d["runs"][1].update(arm="tuned"), r"runs\[1\].arm: 'tuned' is not one of default, plan"),
    (lambda d: d.update(schema_version=9), "unknown version 9"),
    (lambda d: d.update(wamrup=2), "did you mean 'warmup'"),
    (lambda d: d.update(runs=d["runs"][:1]), "no round ran both the defaults and the plan"),
    (lambda d: d["runs"][1].update(round=2), r"runs\[1\].round: must be <= 1"),  # a 1-round trial
    (lambda d: d["runs"].append(dict(d["runs"][0])), r"runs\[2\]: round 1's default run is recorded twice"),
    (lambda d: d["runs"][0].update(steps=3), r"runs\[0\].steps: must be >= 4"),  # warm-up 2: no step timed in 3
])
def test_a_trial_record_that_trial_did_not_write_is_refused_by_show(tmp_path, edit, said):
    from lagom_tune.runtime.trial import TrialRecord

    record = TrialRecord("/p.yaml", "python t.py", "2026-12-05", "vm", 1, 2, False, runs=
                         (TrialRun(1, "default", 110.0, 10, 1), TrialRun(1, "plan", 100.0, 10, 1)))
    d = record.to_dict()
    assert TrialRecord.from_dict(json.loads(json.dumps(d)), "t.json") == record
    edit(d)
    path = tmp_path / "trial.json"
    path.write_text(json.dumps(d))
    r = cli("show", path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and __import__("re").search(said, r.stderr), r.stderr


def test_a_failing_run_stops_the_trial_and_keeps_the_runs_before_it(script, tmp_path):
    plan = BASE.save(tmp_path / "plan.yaml")
    r = cli("trial", plan, "--rounds", 2, "--warmup", 1, "--", sys.executable, script, env=clean_env(FAIL_WITH_THREADS="1"))
    assert r.returncode == 1 and "round 1, plan run: the command exited with status 3" in r.stderr, r.stderr
    assert "1 earlier run(s) are in" in r.stderr and "Traceback" not in r.stderr
    assert [run["arm"] for run in json.loads((tmp_path / "trial.json").read_text())["runs"]] == ["default"]
    # a rerun keeps the earlier record under a name of its own (it replaced a whole trial's record
    # with its one run: an audit, 2026-12-07)
    first = (tmp_path / "trial.json").read_text()
    r = cli("trial", plan, "--rounds", 2, "--warmup", 1, "--", sys.executable, script, env=clean_env(FAIL_WITH_THREADS="1"))
    kept = [p for p in tmp_path.glob("trial.*.json")]
    assert len(kept) == 1 and kept[0].read_text() == first, kept
    assert f"held an earlier trial's record: kept as {kept[0].name}" in r.stdout + r.stderr, r.stderr


def test_a_stop_signal_ends_the_trial_and_its_command_keeping_the_runs_before_it(script, tmp_path):
    import signal
    import time

    from conftest import BIN

    plan = BASE.save(tmp_path / "plan.yaml")
    proc = subprocess.Popen([str(BIN / "lagom-tune"), "trial", str(plan), "--warmup", "1", "--", sys.executable, str(script)],
                            env=clean_env(HANG_WITH_THREADS="1"), stderr=subprocess.PIPE, text=True, cwd=ROOT)
    record = tmp_path / "trial.json"
    deadline = time.monotonic() + 120
    while not record.exists() and time.monotonic() < deadline:  # the default's run is recorded; the plan's hangs
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM" in err, err
    assert [run["arm"] for run in json.loads(record.read_text())["runs"]] == ["default"]


@pytest.mark.parametrize("args, said", [
    (["--", sys.executable, "-c", "pass"], "round 1, default run: no process stepped an optimizer"),
    (["--warmup", "20", "--", sys.executable, "SCRIPT"], r"10 optimizer step\(s\) seen, too few to time any after --warmup 20"),
    (["--rounds", "0", "--", sys.executable, "SCRIPT"], "--rounds"),
    (["--rounds", "1", "--", sys.executable, "SCRIPT"], "--rounds"),
    ([], "nothing to run"),
    (["--out", "--", sys.executable, "SCRIPT"], "--out took it as its path"),
    (["--out", "NOTES", "--", sys.executable, "SCRIPT"], "exists and is not a trial record lagom-tune wrote"),
])
def test_bad_trials_are_refused_in_one_line(script, tmp_path, args, said):
    plan = BASE.save(tmp_path / "plan.yaml")
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    args = [str(script) if a == "SCRIPT" else str(notes) if a == "NOTES" else a for a in args]
    r = cli("trial", plan, *args, env=clean_env())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) >= 1 and __import__("re").search(said, r.stderr), r.stderr
    assert notes.read_text() == '{"mine": 1}'


def test_a_simulated_plan_is_never_trialled(script, tmp_path):
    r = cli("trial", ROOT / "plans" / "sim-h100-nvlink-mpt-7b-tp8-dp2.yaml", "--out", tmp_path / "t.json", "--",
            sys.executable, script, env=clean_env())
    assert r.returncode == 2 and "simulated cluster" in r.stderr, r.stderr
    assert not (tmp_path / "t.json").exists()


# On a GPU: each step's GEMMs timed by CUDA events in the script itself, the loss read back every
# step (as training scripts log it); the clock's mean step must agree with the events' mean.
GPU_SCRIPT = textwrap.dedent("""\
    import json, sys, torch
    a = torch.randn(8192, 8192, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([a], lr=1e-6)
    spans = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = (a @ a @ a).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        end.record()
        loss.item()
        spans.append(start.elapsed_time(end))
    json.dump(spans, open(sys.argv[1], "w"))
""")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (the clock's CPU side is tested above)")
def test_on_a_gpu_the_step_clock_reads_the_gpus_step_time(tmp_path):
    script, spans, steps = tmp_path / "gpu.py", tmp_path / "spans.json", tmp_path / "steps"
    script.write_text(GPU_SCRIPT)
    steps.mkdir()
    env = clean_env(PYTHONPATH=site_pythonpath({}), **{STEPS_ENV: str(steps)})
    subprocess.run([sys.executable, str(script), str(spans)], env=env, check=True, timeout=300)
    (times,) = read_steps(steps).values()
    gpu_ms = sum(json.loads(spans.read_text())[6:]) / 19  # the steps the clock times after --warmup 5
    assert step_seconds(times, 5) * 1e3 == pytest.approx(gpu_ms, rel=0.15)
