"""Run an optimizer (or all of them) over a run folder's fitted model."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from lagom_tune.errors import UserError
from lagom_tune.knobs import BackendChoices, KnobSpace, Settings
from lagom_tune.model.contention import CostModel
from lagom_tune.search import TIE_TOLERANCE
from lagom_tune.search.baselines import autoccl_search, default_search, exhaustive_search
from lagom_tune.search.evaluate import ModelEvaluator
from lagom_tune.search.lagom import lagom_search
from lagom_tune.search.optuna_search import check_storage_apart, optuna_search
from lagom_tune.search.result import SearchResult
from lagom_tune.search.space import variables
from lagom_tune.workload.spec import Workload

__all__ = ["OPTIMIZERS", "check_options", "check_storage_apart", "compare", "deployed", "leave_ties_to_the_backend", "option_names",
           "run_optimizer", "search", "taken_options"]

# Every optimizer has one lifecycle: ``fn(evaluator, variables, **its keyword-only options)`` returns
# a SearchResult. Its options are its keyword-only parameters, typed and documented there.
OPTIMIZERS: dict[str, Callable[..., SearchResult]] = {
    "lagom": lagom_search,
    "optuna": optuna_search,
    "autoccl": autoccl_search,
    "default": default_search,
    "exhaustive": exhaustive_search,
}


def option_names(name: str) -> frozenset[str]:
    """The options optimizer ``name`` takes (its keyword-only parameters).

    Args:
        name: an optimizer's name.
    Returns:
        The option names.
    Raises:
        UserError: for an unknown optimizer.
    """
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    params = inspect.signature(OPTIMIZERS[name]).parameters.values()
    return frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def run_optimizer(name: str, evaluate: ModelEvaluator, vars_: list, options: Mapping[str, Any]) -> SearchResult:
    """Run optimizer ``name`` with the options meant for it (the others are other optimizers').

    Args:
        name: an optimizer's name.
        evaluate: a fresh evaluator.
        vars_: the decision variables.
        options: options of any optimizer.
    Returns:
        The optimizer's result.
    """
    mine = option_names(name)
    return OPTIMIZERS[name](evaluate, vars_, **{k: v for k, v in options.items() if k in mine})


def taken_options(names: list[str], options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` some optimizer in ``names`` takes: for a command line that offers every
    optimizer's flags (with defaults) whichever optimizer runs.

    Args:
        names: the optimizers that will run.
        options: every flag's value.
    Returns:
        The options one of them takes.
    """
    known = frozenset().union(*(option_names(n) for n in names))
    return {k: v for k, v in options.items() if k in known}


def check_options(names: list[str], options: Mapping[str, Any]) -> None:
    """Refuse an option none of the optimizers ``names`` takes (a misspelling, not a no-op).

    Args:
        names: the optimizers that will run.
        options: the options given.
    Raises:
        UserError: naming the unknown options and the known ones.
    """
    known = frozenset().union(*(option_names(n) for n in names))
    unknown = sorted(set(options) - known)
    if unknown:
        raise UserError(f"unknown search option(s) {', '.join(unknown)} for {', '.join(names)}; they take {', '.join(sorted(known)) or 'none'}")


@dataclass(frozen=True)
class SearchOutcome:
    chosen: SearchResult
    default: SearchResult
    autoccl: SearchResult
    bound_s: float


def search(workload: Workload, model: CostModel, space: KnobSpace, optimizer: str, min_gain: float = 0.0,
           chosen: BackendChoices = BackendChoices(), **options: Any) -> SearchOutcome:
    """Run ``optimizer`` plus the default and AutoCCL baselines the plan is compared against.

    Each runs on its own evaluator, so its evaluation count is its own. The plan keeps the
    defaults unless the optimizer's settings are predicted faster by more than ``min_gain``
    (a fraction): a gain smaller than the model's error is a coin flip, not a plan.

    Args:
        workload: the workload.
        model: the fitted cost model.
        space: the knobs on the profiled machine.
        optimizer: an optimizer's name (``OPTIMIZERS``).
        min_gain: the predicted gain below which the defaults are kept.
        chosen: what the backend was seen running collectives with when nothing is set (the
            defaults there, ``space.variables``).
        **options: the optimizers' options (each gets its own).
    Returns:
        The chosen settings and both baselines, and the contention-free bound.
    Raises:
        UserError: for an unknown optimizer or option.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    vars_ = variables(workload, space, chosen)
    names = list(dict.fromkeys(["default", "autoccl", optimizer]))
    check_options(names, options)
    results = {name: run_optimizer(name, ModelEvaluator(workload, model, space), vars_, options) for name in names}
    bound = min(r.evaluation.bound_s for r in results.values())
    chosen = deployed(results[optimizer], results["default"], ModelEvaluator(workload, model, space), min_gain)
    return SearchOutcome(chosen, results["default"], results["autoccl"], bound)


def deployed(best: SearchResult, default: SearchResult, evaluate: ModelEvaluator, min_gain: float) -> SearchResult:
    """What a plan deploys of an optimizer's ``best``: its wide knobs that gain too little left to
    the backend (:func:`leave_ties_to_the_backend`), and then the defaults unless it is still
    predicted faster than them by more than ``min_gain``.

    Args:
        best: the optimizer's result.
        default: the default optimizer's result (every knob at the backend's default).
        evaluate: an evaluator of the same workload and model.
        min_gain: the predicted gain (a fraction) below which the defaults are kept.
    Returns:
        The result to deploy; ``extra["kept_default"]`` says why when it is the defaults.
    """
    if best.settings.key == default.settings.key:
        return best
    chosen = leave_ties_to_the_backend(best, default.settings, evaluate)
    gain = default.evaluation.iteration_s / chosen.evaluation.iteration_s - 1
    if gain > min_gain:
        return chosen
    # as many decimals as keep the gain below the threshold it missed ("2.0% faster, not more than 2%" was 1.98%)
    places = next((d for d in range(1, 5) if round(gain * 100, d) < min_gain * 100), 4)
    why = (f"{best.optimizer}'s best was predicted slower than the defaults" if gain < 0 else
           f"{best.optimizer}'s best was predicted {gain:.{places}%} faster, not more than --min-gain {min_gain * 100:g}%")
    return replace(chosen, settings=default.settings, evaluation=default.evaluation, extra={**chosen.extra, "kept_default": why})


def leave_ties_to_the_backend(chosen: SearchResult, default: Settings, evaluate: ModelEvaluator) -> SearchResult:
    """``chosen`` with each process- and communicator-wide knob put back to ``default``'s value
    (left to the backend) wherever the predicted iteration stays within :data:`TIE_TOLERANCE` of
    ``chosen``'s; one knob at a time, process knobs first, in name order.

    Args:
        chosen: an optimizer's best settings.
        default: every knob at the backend's default.
        evaluate: an evaluator of the same workload and model.
    Returns:
        The result with those knobs at their defaults, its evaluation, its evaluation count
        including these, and ``extra["left_to_backend"]`` naming them (absent when none).
    """
    limit = chosen.evaluation.iteration_s * (1 + TIE_TOLERANCE)
    settings, evaluation, left = chosen.settings, chosen.evaluation, []
    knobs = [("process", None, k) for k in sorted(settings.process)] + [
        ("communicator", role, k) for role in sorted(settings.communicators) for k in sorted(settings.communicators[role])]
    for scope, role, name in knobs:
        if scope == "process":
            if name not in default.process or settings.process[name] == default.process[name]:
                continue
            trial = replace(settings, process={**settings.process, name: default.process[name]})
        else:
            want = default.communicators.get(role, {}).get(name, default.process.get(name))
            if want is None or settings.communicators[role][name] == want:
                continue
            trial = replace(settings, communicators={**settings.communicators, role: {**settings.communicators[role], name: want}})
        ev = evaluate(trial)
        if ev.iteration_s <= limit:
            settings, evaluation = trial, ev
            left.append(name if scope == "process" else f"{name}@{role}")
    if not left:
        return chosen
    return replace(chosen, settings=settings, evaluation=evaluation, evaluations=chosen.evaluations + evaluate.evaluations,
                   extra={**chosen.extra, "left_to_backend": left})


def compare(workload: Workload, model: CostModel, space: KnobSpace, names: list[str] | None = None,
            chosen: BackendChoices = BackendChoices(), **options: Any) -> tuple[list[SearchResult], dict[str, str]]:
    """Every optimizer side by side, each on a fresh evaluator.

    Args:
        workload: the workload.
        model: the fitted cost model.
        space: the knobs on the profiled machine.
        names: the optimizers (default: all; exhaustive is left out when the space is too large).
        chosen: what the backend was seen running collectives with when nothing is set.
        **options: the optimizers' options.
    Returns:
        One result per optimizer that ran, in order; and why each left out was (exhaustive over a
        space too large), which ``--compare`` says rather than dropping its row silently.
    """
    vars_ = variables(workload, space, chosen)
    names = names or list(OPTIMIZERS)
    check_options(names, options)
    out, skipped = [], {}
    for name in names:
        try:
            out.append(run_optimizer(name, ModelEvaluator(workload, model, space), vars_, options))
        except UserError as e:
            if name != "exhaustive":
                raise
            skipped[name] = str(e)
    return out, skipped
