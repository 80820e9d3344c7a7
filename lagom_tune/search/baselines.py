"""Baselines: the backend's own defaults, AutoCCL-style tuning, and exhaustive enumeration."""

from __future__ import annotations

import itertools
import math
import time

from lagom_tune.errors import UserError
from lagom_tune.knobs import Settings
from lagom_tune.search.evaluate import ModelEvaluator
from lagom_tune.search.lagom import comm_of
from lagom_tune.search.result import SearchResult
from lagom_tune.search.space import Var, default_assignment, default_settings


def default_search(evaluate: ModelEvaluator, vars_: list[Var]) -> SearchResult:
    """What the job gets without lagom-tune (NCCL's or gloo's/torch's own choices).

    Args:
        evaluate: the evaluator (counts the evaluations).
        vars_: the decision variables.
    Returns:
        Every variable at its knob's default, evaluated.
    """
    t0, start = time.perf_counter(), evaluate.evaluations
    settings = default_settings(vars_)
    return SearchResult("default", settings, evaluate(settings), evaluate.evaluations - start, time.perf_counter() - t0)


def autoccl_search(evaluate: ModelEvaluator, vars_: list[Var], *, rounds: int = 2) -> SearchResult:
    """Coordinate descent on each variable's own communication time under interference.

    Like AutoCCL, it is blind to what communication's resources cost the computation beside it.

    Args:
        evaluate: the evaluator.
        vars_: the decision variables.
        rounds: passes over the variables (fewer when a pass changes nothing).
    Returns:
        The settings it settled on, evaluated.
    """
    t0, start = time.perf_counter(), evaluate.evaluations
    state = default_assignment(vars_)
    for _ in range(rounds):
        changed = False
        for var in vars_:
            def own_time(value, _var=var):
                return comm_of(_var, evaluate(Settings.from_assignment({**state, _var.key: value}, vars_)))

            best = min(var.domain, key=own_time)
            if best != state[var.key] and own_time(best) < own_time(state[var.key]):
                state[var.key], changed = best, True
        if not changed:
            break
    settings = Settings.from_assignment(state, vars_)
    return SearchResult("autoccl", settings, evaluate(settings), evaluate.evaluations - start, time.perf_counter() - t0)


def exhaustive_search(evaluate: ModelEvaluator, vars_: list[Var], *, max_points: int = 20000) -> SearchResult:
    """Every combination: ground truth for small spaces.

    Args:
        evaluate: the evaluator.
        vars_: the decision variables.
        max_points: the most combinations it agrees to evaluate.
    Returns:
        The fastest combination, evaluated.
    Raises:
        UserError: for a space larger than ``max_points``.
    """
    size = math.prod(len(v.domain) for v in vars_)
    if size > max_points:
        raise UserError(f"the space has {size} combinations; exhaustive search is limited to {max_points}")
    t0, start = time.perf_counter(), evaluate.evaluations
    best = None
    for values in itertools.product(*(v.domain for v in vars_)):
        settings = Settings.from_assignment({v.key: x for v, x in zip(vars_, values)}, vars_)
        ev = evaluate(settings)
        if best is None or ev.iteration_s < best[1].iteration_s:
            best = (settings, ev)
    return SearchResult("exhaustive", best[0], best[1], evaluate.evaluations - start, time.perf_counter() - t0)
