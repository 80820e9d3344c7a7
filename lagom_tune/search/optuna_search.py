"""Joint search over every variable with an Optuna study (TPE by default).

Seeded with the defaults and the Lagom result (``enqueue_trial``), resumable through an Optuna
storage (``sqlite:///study.db``) and ``load_if_exists``. The space is conditional where knob values
need others (NVLS runs Simple only): a variable whose feasible values are narrowed by those drawn
before it is drawn under a name of its own, ``key|value/value``, among those values only, so no
trial is spent on settings the backend cannot run (13-16% of TPE's trials on a Hopper TP+DP
workload drew NVLS beside LL or LL128 before 2026-12-04; Optuna's constraints did not lower it,
TPE already ranking them worst).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import optuna
import sqlalchemy.exc  # optuna's storage layer: a URL it cannot open raises these

from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.precision import ms_round
from lagom_tune.search.evaluate import ModelEvaluator
from lagom_tune.search.lagom import lagom_search
from lagom_tune.search.result import SearchResult
from lagom_tune.search.space import Var, default_assignment, feasible_domain, neighbours


OBJECTIVE_ATTR = "lagom_tune.objective"  # the study's user attribute: the evaluator's identity it was started with
SQLITE_URL = "sqlite:///"  # an Optuna storage URL naming a file: sqlite:///relative.db, sqlite:////absolute.db


def check_storage_apart(storage: str | None, out: Path) -> None:
    """Refuse an Optuna storage whose database is the file a verb is about to write (``--storage
    sqlite:///plan.yaml --out plan.yaml`` replaced the study with the plan).

    Args:
        storage: the Optuna storage URL, or None.
        out: the file to be written.
    Raises:
        UserError: when the storage's database is ``out``.
    """
    if storage and storage.startswith(SQLITE_URL) and Path(storage[len(SQLITE_URL):]).resolve() == out.resolve():
        raise UserError(f"--out {out} is the Optuna study's database (--storage {storage}); give the plan another file")


def comm_sms(settings: Settings) -> int:
    """SMs given to communication: the most channels any collective may hold at once.

    Args:
        settings: the settings.
    Returns:
        The channels (0 without a channels knob).
    """
    return max((int(s.get("channels", 0)) for s in settings.collectives.values()), default=0)


def optuna_search(evaluate: ModelEvaluator, vars_: list[Var], *, n_trials: int = 200, timeout: float | None = None,
                  seed: int = 0, storage: str | None = None, study_name: str | None = None, multi_objective: bool = False,
                  enqueue_lagom: bool = True,
                  on_trial: Callable[[int, int], None] | None = None) -> SearchResult:
    """TPE over every variable; with ``multi_objective``, NSGA-II over (iteration time, SMs given to
    communication), returning the fastest plan and the Pareto front in ``extra["pareto"]``.

    Args:
        evaluate: the evaluator.
        vars_: the decision variables.
        n_trials: the trial budget.
        timeout: the time budget in seconds (None: none).
        seed: the sampler's seed.
        storage: an Optuna storage URL (a resumable study), or None for memory.
        study_name: the study's name in ``storage``.
        multi_objective: trade iteration time against SMs for communication (GPU backends).
        enqueue_lagom: also try the Lagom search's result first (after the defaults).
        on_trial: called with (trials done, trial budget) after each trial.
    Returns:
        The fastest settings found, evaluated.
    Raises:
        UserError: for ``multi_objective`` without a channels knob, or a bad storage.
    """
    t0, start = time.perf_counter(), evaluate.evaluations
    # ERROR: a trial ended by Ctrl-C or SIGTERM is logged as failed with its traceback at WARNING,
    # before the interrupt reaches the CLI's one line
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if multi_objective and not any(v.knob.name == "channels" for v in vars_):
        raise UserError("--multi-objective trades iteration time against SMs for communication: it needs a GPU backend (sim or nccl)")
    try:
        if multi_objective:
            study = optuna.create_study(directions=["minimize", "minimize"], sampler=optuna.samplers.NSGAIISampler(seed=seed),
                                        storage=storage, study_name=study_name, load_if_exists=True)
        else:
            study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
                                        storage=storage, study_name=study_name, load_if_exists=True)
    except (ValueError, ImportError, optuna.exceptions.OptunaError, sqlalchemy.exc.SQLAlchemyError) as e:
        # an unknown URL scheme, a database that cannot be opened: one line, the first of the driver's message
        raise UserError(f"cannot open the Optuna storage {storage!r}: {str(e).splitlines()[0]}") from None
    _check_resumed(study, vars_, 2 if multi_objective else 1, study_name, evaluate.identity)
    if study.trials:  # resumed: a sampler seeded as the first session's drew its random trials again
        sampler = optuna.samplers.NSGAIISampler if multi_objective else optuna.samplers.TPESampler
        study.sampler = sampler(seed=seed + len(study.trials))
    seeded = None
    if not study.trials:  # a resumed study already holds its seeds
        study.set_user_attr(OBJECTIVE_ATTR, evaluate.identity)
        study.enqueue_trial(default_assignment(vars_))
        if enqueue_lagom:
            seeded = lagom_search(evaluate, vars_)
            study.enqueue_trial(_assignment_of(seeded.settings, vars_))

    near = neighbours(vars_, evaluate.workload.collectives())

    def objective(trial: optuna.Trial):
        assignment: dict = {}
        for v in vars_:
            domain = feasible_domain(v, assignment, near[v.key]) or v.domain
            assignment[v.key] = trial.suggest_categorical(_param_name(v, domain), list(domain))
        settings = Settings.from_assignment(assignment, vars_)
        seconds = evaluate(settings).iteration_s
        return (seconds, comm_sms(settings)) if multi_objective else seconds

    # n_trials is the study's budget: a resumed study (rerun the same command) finishes it rather than starting another
    done = _finished(study)
    finished = [done]  # counted as trials end (reading the study's trials after each was quadratic, a query each on sqlite)

    def progress(_study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        finished[0] += trial.state == optuna.trial.TrialState.COMPLETE
        on_trial(min(finished[0], n_trials), n_trials)

    callbacks = [progress] if on_trial else []
    if on_trial:
        on_trial(min(done, n_trials), n_trials)
    study.optimize(objective, n_trials=max(0, n_trials - done), timeout=timeout, callbacks=callbacks)
    extra: dict = {"trials": len(study.trials), "study": study.study_name}
    if multi_objective:
        front = sorted(study.best_trials, key=lambda t: t.values[0])
        points = {(ms_round(t.values[0] * 1e3), int(t.values[1])) for t in front}
        extra["pareto"] = [{"iteration_ms": ms, "comm_sms": sms} for ms, sms in sorted(points)]
        params = front[0].params
    else:
        params = study.best_params
    best = Settings.from_assignment({v.key: _value_of(params, v) for v in vars_}, vars_)
    if seeded is not None and not multi_objective and seeded.evaluation.iteration_s < evaluate(best).iteration_s:
        best = seeded.settings  # a budget too small to reach its own seed (--n-trials 1) returned the defaults, slower
    # the answer stands on every trial of the study: a resumed one's earlier sessions' count too (a
    # study resumed to 30 trials was recorded as 15 evaluations, this session's)
    return SearchResult("optuna", best, evaluate(best), evaluate.evaluations - start + done, time.perf_counter() - t0, extra)


def _param_name(v: Var, domain: tuple) -> str:
    """The Optuna parameter ``v`` is drawn as: its key over its whole domain, ``key|a/b`` over a
    narrower one (an Optuna parameter keeps one set of choices)."""
    return v.key if domain == v.domain else f"{v.key}|{'/'.join(map(str, domain))}"


def _value_of(params: dict, v: Var) -> Any:
    """``v``'s value in a trial's parameters, under whichever name it was drawn."""
    if v.key in params:
        return params[v.key]
    return next(value for name, value in params.items() if name.startswith(v.key + "|"))


def _check_resumed(study: optuna.Study, vars_: list[Var], objectives: int, name: str | None, identity: str) -> None:
    """Refuse to resume a study that searched something else: another objective count, other knobs
    or domains (another run's search space), which Optuna fails on mid-search, or another workload
    or model (``identity``: its trials' times are not this search's, and its best would win)."""
    recorded = study.user_attrs.get(OBJECTIVE_ATTR)
    if study.trials and recorded != identity:  # one an earlier version stored records none: refused, its objective unknown
        raise UserError(f"the Optuna study {name!r} searched another run's or workload's model ({recorded or 'not recorded'}, "
                        f"this search {identity}): give another --study-name")
    if len(study.directions) != objectives:
        raise UserError(f"the Optuna study {name!r} has {len(study.directions)} objective(s), this search {objectives} "
                        "(--multi-objective differs): give another --study-name")
    domains = {v.key: tuple(v.domain) for v in vars_}
    for trial in study.trials:
        for param, dist in trial.distributions.items():
            key, narrowed = param.partition("|")[::2]
            choices = tuple(getattr(dist, "choices", ()))
            if key not in domains or (choices != domains[key] if not narrowed else not set(choices) <= set(domains[key])):
                raise UserError(f"the Optuna study {name!r} searched another space ({param}: {getattr(dist, 'choices', dist)}), "
                                "another run's or workload's: give another --study-name")


def _finished(study: "optuna.Study") -> int:
    """Trials of ``study`` that ran to the end (an interrupted one failed: it is run again)."""
    return sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False))


def _assignment_of(settings: Settings, vars_: list[Var]) -> dict:
    out = {}
    for v in vars_:
        if v.scope == "process":
            out[v.key] = settings.process[v.knob.name]
        elif v.scope == "communicator":
            out[v.key] = settings.communicators[v.target][v.knob.name]
        else:
            out[v.key] = settings.collectives[v.target][v.knob.name]
    return out
