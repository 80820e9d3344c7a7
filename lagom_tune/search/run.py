"""Run an optimizer (or all of them) over a run folder's fitted model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from lagom_tune.backends.base import KnobSpace
from lagom_tune.errors import UserError
from lagom_tune.model.contention import CostModel
from lagom_tune.search.baselines import autoccl_search, default_search, exhaustive_search
from lagom_tune.search.evaluate import ModelEvaluator
from lagom_tune.search.lagom import lagom_search
from lagom_tune.search.optuna_search import optuna_search
from lagom_tune.search.result import SearchResult
from lagom_tune.search.space import variables
from lagom_tune.workload.spec import Workload

OPTIMIZERS: dict[str, Callable[..., SearchResult]] = {
    "lagom": lagom_search,
    "optuna": optuna_search,
    "autoccl": autoccl_search,
    "default": default_search,
    "exhaustive": exhaustive_search,
}


@dataclass(frozen=True)
class SearchOutcome:
    chosen: SearchResult
    default: SearchResult
    autoccl: SearchResult
    bound_s: float


def search(workload: Workload, model: CostModel, space: KnobSpace, optimizer: str, min_gain: float = 0.0,
           **options: Any) -> SearchOutcome:
    """Run ``optimizer`` plus the default and AutoCCL baselines the plan is compared against.

    Each runs on its own evaluator, so its evaluation count is its own. The plan keeps the
    defaults unless the optimizer's settings are predicted faster by more than ``min_gain``
    (a fraction): a gain smaller than the model's error is a coin flip, not a plan.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    vars_ = variables(workload, space)
    results = {name: OPTIMIZERS[name](ModelEvaluator(workload, model), vars_, **options)
               for name in dict.fromkeys(["default", "autoccl", optimizer])}
    bound = min(r.evaluation.bound_s for r in results.values())
    chosen, default = results[optimizer], results["default"]
    gain = default.evaluation.iteration_s / chosen.evaluation.iteration_s - 1
    if gain <= min_gain and chosen.settings.key != default.settings.key:
        why = (f"{optimizer}'s best was predicted slower than the defaults" if gain < 0 else
               f"{optimizer}'s best was predicted {gain:.1%} faster, not more than --min-gain {min_gain:.1%}")
        chosen = replace(chosen, settings=default.settings, evaluation=default.evaluation,
                         extra={**chosen.extra, "kept_default": why})
    return SearchOutcome(chosen, default, results["autoccl"], bound)


def compare(workload: Workload, model: CostModel, space: KnobSpace, names: list[str] | None = None, **options: Any) -> list[SearchResult]:
    """Every optimizer side by side, each on a fresh evaluator."""
    vars_ = variables(workload, space)
    out = []
    for name in names or list(OPTIMIZERS):
        try:
            out.append(OPTIMIZERS[name](ModelEvaluator(workload, model), vars_, **options))
        except UserError:
            if name != "exhaustive":
                raise
    return out
