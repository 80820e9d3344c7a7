"""``lagom-tune trial``: your training run with its default settings and with the plan, in
interleaved rounds, each run timed by its own optimizer steps; the plan's speed-up, measured.

Both arms run the same command with the step clock in every Python process
(``runtime/steps.py``); the plan's arm runs it as ``apply`` does. A run's step time is its slowest
rank's mean step after the warm-up steps. The rounds are read as the geometric mean of the
per-round default / plan ratios with a Student-t interval (``comparison``). Every run is added to
the trial record (``trial.json`` beside the plan) as soon as it ends, so an interrupted trial
keeps the rounds it finished.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from lagom_tune import validate as v
from lagom_tune.artifact_io import atomic_write_text, check_writable, holds_match, keep_aside
from lagom_tune.comparison import ARMS, CI_LEVEL, interleaved, order_note, ratio_interval, rounds_to_show, verdict
from lagom_tune.errors import RunError, UserError
from lagom_tune.plan.schema import Plan
from lagom_tune.precision import ms_round
from lagom_tune.runtime.launch import apply, check_command, check_fit, files_among, record_path, run_command, site_pythonpath
from lagom_tune.runtime.shim import LOG_ENV, LOG_FAILURES, check_no_plan_in_effect
from lagom_tune.runtime.steps import STEPS_ENV, read_steps, step_seconds

MIN_ROUNDS = 2  # one round's ratio has no interval (comparison.ratio_interval)
MAX_ROUNDS = 100
KIND = "lagom-trial"
SCHEMA_VERSION = 1
FILE_MARK = r'\A\{\s*"kind": "lagom-trial"'  # how a trial record begins (the only file --out may replace)


@dataclass(frozen=True)
class TrialRun:
    """One run of the command.

    Attributes:
        round: the round, from 1.
        arm: ``default`` or ``plan``.
        step_ms: the slowest rank's mean step time after the warm-up.
        steps: optimizer steps that rank made.
        ranks: processes that stepped an optimizer.
    """

    round: int
    arm: str
    step_ms: float
    steps: int
    ranks: int

    @classmethod
    def of(cls, round: int, arm: str, steps: dict[str, list[float]], warmup: int, where: str) -> TrialRun:
        """A run from its processes' step times (:func:`timed_run`; :func:`slowest_step_ms`)."""
        ms, slowest = slowest_step_ms(steps, warmup, where)
        return cls(round, arm, ms, len(steps[slowest]), len(steps))


def slowest_step_ms(steps: dict[str, list[float]], warmup: int, where: str) -> tuple[float, str]:
    """A run's step time: its slowest rank's mean step after ``warmup`` steps.

    Args:
        steps: each rank's step end times (:func:`timed_run`).
        warmup: steps left out before the timing starts.
        where: the run, for the error ("round 1, default run").
    Returns:
        The milliseconds (as ``precision.ms_round`` keeps them) and that rank.
    Raises:
        UserError: no process stepped an optimizer, or too few steps to time.
    """
    if not steps:
        raise UserError(f"{where}: no process stepped an optimizer; `trial` times a run by torch.optim's step hook, "
                        "so the command must train with a torch.optim optimizer in Python processes it starts")
    timed = {rank: step_seconds(times, warmup) for rank, times in steps.items()}
    slowest = max(timed, key=timed.get)
    return ms_round(timed[slowest] * 1e3), slowest


@dataclass(frozen=True)
class TrialReading:
    """What the rounds say.

    Attributes:
        step_ms: each arm's median step time over its runs.
        spread_ms: each arm's fastest and slowest run.
        speedup: the geometric mean of the per-round default / plan ratios.
        low, high: its interval at ``comparison.CI_LEVEL`` (0 and infinity from one round).
        verdict: the plain reading (``comparison.verdict``).
        rounds_to_show: where the interval holds 1 and the plan predicted a speed-up, the rounds
            after which that speed-up would show at this spread (``comparison.rounds_to_show``;
            None otherwise, or beyond :data:`MAX_ROUNDS`).
        ratios: each round's default / plan ratio, by the arm that ran first in it (``default``,
            ``plan``), in round order: what the interval is read from, and where a run's place in
            its round shows if it matters (one group's ratios all above the other's).
    """

    step_ms: dict[str, float]
    spread_ms: dict[str, tuple[float, float]]
    speedup: float
    low: float
    high: float
    verdict: str
    rounds_to_show: int | None = None
    ratios: dict[str, tuple[float, ...]] = field(default_factory=dict)


def read_trial(runs: list[TrialRun], same_settings: bool, predicted: float | None = None) -> TrialReading:
    """Read the rounds that ran both arms.

    Args:
        runs: the trial's runs, in the order they ran.
        same_settings: whether the plan keeps the defaults (both arms run the same settings).
        predicted: the plan's predicted speed-up (``Plan.predicted_speedup``), if it has one.
    Returns:
        The reading.
    Raises:
        UserError: no round ran both arms.
    """
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:  # in the order they ran: a round's first arm is the one that ran first
        by_round.setdefault(r.round, {})[r.arm] = r.step_ms
    # (the arm that ran first, default / plan) of each round that ran both, in round order
    rounds = [(next(iter(arms)), arms["default"] / arms["plan"]) for _, arms in sorted(by_round.items()) if len(arms) == len(ARMS)]
    ratios = [ratio for _, ratio in rounds]
    if not ratios:
        raise UserError("no round ran both the defaults and the plan: nothing to compare")
    times = {arm: [r.step_ms for r in runs if r.arm == arm] for arm in ARMS}
    speedup, low, high = ratio_interval(ratios)
    unresolved = not same_settings and low <= 1.0 <= high
    return TrialReading({arm: statistics.median(t) for arm, t in times.items()}, {arm: (min(t), max(t)) for arm, t in times.items()},
                        speedup, low, high, verdict(low, high, same_settings),
                        rounds_to_show(ratios, predicted, MAX_ROUNDS) if unresolved else None,
                        {arm: tuple(ratio for first, ratio in rounds if first == arm) for arm in ARMS})



@dataclass(frozen=True)
class TrialRecord:
    """A trial as ``trial.json`` holds it (written after every run; ``reading`` is added once the
    rounds are done and is read again from the runs on load, never taken from the file).

    Attributes:
        plan: the plan file's absolute path.
        command: the command, as a shell would read it.
        date, host: when and where it ran.
        rounds: rounds asked for.
        warmup: steps left out of each run's timing.
        same_settings: whether the plan keeps the defaults.
        predicted: the plan's predicted speed-up when the trial began (``Plan.predicted_speedup``).
        runs: the runs finished, in the order they ran.
    """

    plan: str
    command: str
    date: str
    host: str
    rounds: int
    warmup: int
    same_settings: bool
    predicted: float | None = None
    runs: tuple[TrialRun, ...] = ()

    @property
    def planned_runs(self) -> int:
        """Runs of every round, every arm."""
        return self.rounds * len(ARMS)

    @property
    def complete(self) -> bool:
        """Whether every run of every round was recorded."""
        return len(self.runs) == self.planned_runs

    def reading(self) -> TrialReading:
        """What the runs say (:func:`read_trial`)."""
        return read_trial(list(self.runs), self.same_settings, self.predicted)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": KIND, "schema_version": SCHEMA_VERSION, **asdict(self), "runs": [asdict(r) for r in self.runs]}
        if self.complete:
            d["reading"] = {**asdict(self.reading()), "ci_level": CI_LEVEL}
        return d

    def save(self, path: Path) -> None:
        """Write the record atomically (a trial stopped midway leaves the last whole one)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str) -> TrialRecord:
        """A loaded ``trial.json``, checked field by field.

        Args:
            d: the loaded file.
            path: the file, for errors.
        Returns:
            The record.
        Raises:
            UserError: naming the first field that is not what ``trial`` writes.
        """
        v.known_keys(v.document(d, path, "trial record"), ("kind", "schema_version", *RECORD_FIELDS, "reading"), path)
        v.one_of(d.get("kind"), (KIND,), f"{path}.kind")
        v.schema_version(d, path, SCHEMA_VERSION)
        rounds = v.field(d, "rounds", path, int, minimum=1, maximum=MAX_ROUNDS)
        warmup = v.field(d, "warmup", path, int, minimum=0)
        runs: list[TrialRun] = []
        for i, run in enumerate(v.seq(v.field(d, "runs", path, list), f"{path}.runs")):
            where = f"{path}.runs[{i}]"
            run = v.known_keys(v.mapping(run, where), RUN_FIELDS, where)
            runs.append(TrialRun(v.field(run, "round", where, int, minimum=1, maximum=rounds), v.one_of(run.get("arm"), ARMS, f"{where}.arm"),
                                 v.field(run, "step_ms", where, float, minimum=v.POSITIVE),
                                 v.field(run, "steps", where, int, minimum=warmup + 2),  # fewer times no step (step_seconds)
                                 v.field(run, "ranks", where, int, minimum=1)))
            if any((r.round, r.arm) == (runs[-1].round, runs[-1].arm) for r in runs[:-1]):
                raise UserError(f"{where}: round {runs[-1].round}'s {runs[-1].arm} run is recorded twice")
        return cls(v.field(d, "plan", path, str), v.field(d, "command", path, str), v.field(d, "date", path, str),
                   v.field(d, "host", path, str), rounds, warmup, v.field(d, "same_settings", path, bool),
                   v.field(d, "predicted", path, float, None, minimum=v.POSITIVE), tuple(runs))


RECORD_FIELDS = tuple(f.name for f in fields(TrialRecord))
RUN_FIELDS = tuple(f.name for f in fields(TrialRun))


def sets_nothing(plan: Plan) -> bool:
    """Whether the plan keeps every default (so both arms of a trial run the same settings).

    Args:
        plan: the plan.
    Returns:
        True when it sets no process, communicator or collective setting.
    """
    return not (plan.settings.process or plan.settings.communicators or plan.rules)


def timed_run(cmd: list[str], plan: Plan | None = None, plan_path: Path | None = None,
              on_warning: Callable[[str], None] | None = None,
              quiet: bool = False) -> tuple[int, dict[str, list[float]], KeyboardInterrupt | None]:
    """Run ``cmd`` once with the step clock in every Python process: under the plan as ``apply``
    runs it, or with nothing set (the defaults) when ``plan`` is None.

    Args:
        cmd: the command.
        plan, plan_path: the plan and its file, or None.
        on_warning: called with each line on what of the plan will not reach the command.
        quiet: the ranks log only what they could not apply (``shim.LOG_FAILURES``; a plan run after
            the first logs what the first did), unless the environment asks otherwise.
    Returns:
        The command's exit status, each rank's step end times (``steps.read_steps``), and the stop
        signal passed on to the command while it ran, if one was (``launch.run_command``).
    """
    with tempfile.TemporaryDirectory(prefix="lagom-steps-") as folder:
        if plan is not None:
            quieted = {LOG_ENV: LOG_FAILURES} if quiet and LOG_ENV not in os.environ else {}
            result = apply(plan, plan_path, cmd, on_warning=on_warning, extra_env={STEPS_ENV: folder, **quieted})
            code, stop = result.exit_code, result.stop
        else:
            code, _, stop = run_command(cmd, {**os.environ, "PYTHONPATH": site_pythonpath(os.environ), STEPS_ENV: folder})
        return code, read_steps(folder), stop


def run_trial(plan: Plan, plan_path: Path, cmd: list[str], rounds: int, warmup: int, out: Path | None = None,
              on_run: Callable[[TrialRun], None] | None = None, on_warning: Callable[[str], None] | None = None,
              on_note: Callable[[str], None] | None = None) -> tuple[TrialRecord, Path]:
    """Run ``cmd`` ``rounds`` times with the defaults and with the plan, interleaved, each round in
    the reverse order of the one before; record every run as it ends.

    Args:
        plan, plan_path: the plan and its file.
        cmd: the training command (e.g. torchrun and its arguments), unchanged.
        rounds: rounds (:data:`MIN_ROUNDS` to :data:`MAX_ROUNDS`; an even number runs each arm first equally often).
        warmup: optimizer steps of each run left out before the timing starts.
        out: the trial record (default: ``trial.json`` beside the plan; ``launch.record_path``).
        on_run: called with each run once it is recorded.
        on_warning: called once with each line on what of the plan will not reach the command.
        on_note: called with each check made against the machine before the first run.
    Returns:
        The record (``reading()`` says what its runs show) and where it was written.
    Raises:
        UserError: bad arguments, a plan that does not fit the machine, a run in which no process
            stepped an optimizer (or too few steps to time).
        RunError: a run that failed (its exit status said); the runs before it stay recorded.
        KeyboardInterrupt: a stop signal (passed on to the command, which then ended); so do they.
    """
    if not MIN_ROUNDS <= rounds <= MAX_ROUNDS:
        raise UserError(f"--rounds: expected {MIN_ROUNDS} to {MAX_ROUNDS} (one round's ratio has no interval), got {rounds}")
    if warmup < 0:
        raise UserError(f"--warmup: expected at least 0 steps, got {warmup}")
    if not cmd:
        raise UserError("nothing to run: give the command after `--`, e.g. `lagom-tune trial plan.yaml -- torchrun ...`")
    check_no_plan_in_effect(os.environ, "trial")  # the default arm would run it too
    plan.refuse_if_simulated()
    check_command(cmd[0])
    out = check_writable(out or record_path(plan, plan_path, "trial"), "trial record", [plan_path, *files_among(cmd)],
                         replaces=FILE_MARK)
    notes = check_fit(plan, cmd, dict(os.environ))  # before the first run, not at the plan's first turn
    kept = keep_aside(out) if holds_match(out, FILE_MARK) else None  # an earlier trial's record: kept, not replaced
    if kept:
        notes.append(f"{out} held an earlier trial's record: kept as {kept.name}")
    unbalanced = order_note(ARMS, rounds, "--rounds")
    if unbalanced:
        notes.append(unbalanced)
    for note in notes:
        if on_note:
            on_note(note)
    warned: set[str] = set()

    def warn_once(line: str) -> None:
        if line not in warned and on_warning:
            warned.add(line)
            on_warning(line)

    record = TrialRecord(str(plan_path.resolve()), shlex.join(cmd), datetime.date.today().isoformat(), platform.node(), rounds,
                         warmup, sets_nothing(plan), plan.predicted_speedup)
    for r, arm in interleaved(ARMS, rounds):
        said = any(run.arm == "plan" for run in record.runs)  # its ranks said what they applied the first time
        code, steps, stop = timed_run(cmd, plan if arm == "plan" else None, plan_path, warn_once, quiet=said)
        where = f"round {r + 1}, {arm} run"
        if stop is not None:  # the command had it too: the trial ends with the runs it finished recorded
            raise stop
        if code != 0:
            raise RunError(f"{where}: the command exited with status {code}",
                           f"{len(record.runs)} earlier run(s) are in {out}" if record.runs else "")
        record = replace(record, runs=record.runs + (TrialRun.of(r + 1, arm, steps, warmup, where),))
        record.save(out)
        if on_run:
            on_run(record.runs[-1])
    return record, out

