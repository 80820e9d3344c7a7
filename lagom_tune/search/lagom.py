"""Lagom's priority-based search (paper Algorithms 1-2, DESIGN.md §7).

Every variable starts at communication's minimum. Repeatedly, the unfinished variable with the
smallest priority ``H = (Y' - Y) / (x(s) - x(s'))`` (computation time added per unit of
communication time saved) steps towards more communication resources, by the relative
improvement of its last step ``lr = (x(s) - x(s')) / x(s')`` (the printed formula has the sign
flipped). A variable stops when its communication no longer gets faster or when communication
is hidden (``X' < Y'`` in each overlap group holding it). Each variable is stepped at most once per position of its domain, so the
search is linear in the number of variables.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from lagom_tune.knobs import Settings
from lagom_tune.search.evaluate import Evaluation, ModelEvaluator
from lagom_tune.search.result import SearchResult
from lagom_tune.search.space import Var, min_comm_assignment

INITIAL_PRIORITY = 0.01


def comm_of(var: Var, ev: Evaluation) -> float:
    """The communication time a variable controls: its collective's, its communicator's, or all.

    Args:
        var: the variable.
        ev: an evaluation.
    Returns:
        Seconds per iteration (inf for settings that cannot run together).
    """
    if not math.isfinite(ev.iteration_s):  # INFEASIBLE times nothing
        return math.inf
    if var.scope == "collective":
        return ev.comm_by_rule.get(var.target, 0.0)
    if var.scope == "communicator":
        return ev.comm_by_group.get(var.target, 0.0)
    return ev.comm_s


def next_value(var: Var, current, lr: float):
    """Step ``current`` up its comm-ordered domain by ``lr`` (relative), at least one position.

    Args:
        var: the variable.
        current: its value now.
        lr: the relative step (0.5: about 50% more resources for communication).
    Returns:
        The next value, or None at the top of the domain.
    """
    order = var.comm_order()
    i = order.index(current)
    if i + 1 >= len(order):
        return None
    step = 1
    if isinstance(current, (int, float)) and current and all(isinstance(o, (int, float)) for o in order):
        goal = current * (1 + lr) if var.knob.comm_direction > 0 else current / (1 + lr)
        while i + step + 1 < len(order) and abs(order[i + step + 1] - goal) < abs(order[i + step] - goal):
            step += 1
    return order[i + step]


def _priority_search(evaluate: ModelEvaluator, vars_: list[Var], fixed: dict[str, Any], trace: list) -> tuple[dict, Evaluation]:
    """Algorithms 1-2 over the resource variables, the categorical ones held at ``fixed``."""
    resources = [v for v in vars_ if not v.categorical]
    state = {**min_comm_assignment(resources), **fixed}
    ev = evaluate(Settings.from_assignment(state, vars_))
    best_state, best_ev = dict(state), ev
    priority = {v.key: INITIAL_PRIORITY for v in resources}
    lr = {v.key: 1.0 for v in resources}
    active = [v for v in resources if len(v.domain) > 1]
    while active:
        var = min(active, key=lambda v: priority[v.key])
        value = next_value(var, state[var.key], lr[var.key])
        if value is None:
            active.remove(var)
            continue
        cand = {**state, var.key: value}
        ev2 = evaluate(Settings.from_assignment(cand, vars_))
        x_old, x_new = comm_of(var, ev), comm_of(var, ev2)
        trace.append({"var": var.key, "value": value, "iteration_ms": ev2.iteration_s * 1e3})
        if ev2.iteration_s < best_ev.iteration_s:
            best_state, best_ev = dict(cand), ev2
        if x_new >= x_old:  # no longer faster: this variable is done
            active.remove(var)
            continue
        priority[var.key] = (ev2.compute_s - ev.compute_s) / (x_old - x_new)
        lr[var.key] = (x_old - x_new) / x_new if x_new > 0 else 1.0
        state, ev = cand, ev2
        if hidden(var, ev):  # its communication hidden behind computation: more resources cannot help it
            active.remove(var)
    return best_state, best_ev


def hidden(var: Var, ev: Evaluation) -> bool:
    """Whether the communication ``var`` controls is hidden, judged in the overlap groups that
    hold it: in each, the group ends when its computation does (no collective exposed). The
    paper's ``X' < Y'`` is not enough: a collective that waits for its gradients (a DDP bucket, an
    FSDP reduce-scatter) can end after the computation though it takes less time in all, and the
    search retired a bucket cap one step in with 7 ms exposed (the CPU demo's plan was lost).
    (Judged on the iteration's totals, a group of computation alone, a model's head or an
    optimizer step, hid every collective from the start.)

    Args:
        var: the variable.
        ev: an evaluation.
    Returns:
        True when every group holding its collectives has them hidden.
    """
    groups = [tl for g, tl in ev.timelines if any(var.covers(c) for c in g.comm)]
    return bool(groups) and all(tl.makespan <= tl.compute_time * (1 + 1e-9) for tl in groups)


POLISH_ROUNDS = 64  # a bound, not a budget: the polish ends when a round improves nothing


def _polish(evaluate: ModelEvaluator, vars_: list[Var], state: dict, ev: Evaluation,
            rounds: int = POLISH_ROUNDS) -> tuple[dict, Evaluation]:
    """Local refinement of the priority search's answer: each collective tries the other
    subspaces, and each resource variable its neighbouring values, while the iteration gets faster
    (four rounds at most until 2026-12-01: a variable the priority phase left far from its best
    could move only four positions)."""
    cats = [v for v in vars_ if v.categorical]
    for _ in range(rounds):
        improved = False
        for target in dict.fromkeys(v.target for v in cats):
            own = [v for v in cats if v.target == target]
            for combo in itertools.product(*(v.domain for v in own)):
                cand = {**state, **{v.key: x for v, x in zip(own, combo)}}
                ev2 = evaluate(Settings.from_assignment(cand, vars_))
                if ev2.iteration_s < ev.iteration_s * (1 - 1e-9):
                    state, ev, improved = cand, ev2, True
        for var in (v for v in vars_ if not v.categorical):
            order = var.comm_order()
            i = order.index(state[var.key])
            for j in (i - 1, i + 1):
                if 0 <= j < len(order):
                    cand = {**state, var.key: order[j]}
                    ev2 = evaluate(Settings.from_assignment(cand, vars_))
                    if ev2.iteration_s < ev.iteration_s * (1 - 1e-9):
                        state, ev, improved = cand, ev2, True
                        break
        if not improved:
            break
    return state, ev


def lagom_search(evaluate: ModelEvaluator, vars_: list[Var], *, top_subspaces: int = 2) -> SearchResult:
    """Priority search inside the (algorithm, protocol, ...) subspaces, as AutoCCL does (the
    ``top_subspaces`` best at the default resources), keeping the best; then a local polish (each
    collective's best subspace, neighbouring resource values).

    Args:
        evaluate: the evaluator.
        vars_: the decision variables.
        top_subspaces: how many categorical subspaces to search.
    Returns:
        The best settings found, evaluated; ``extra`` holds the search's trace.
    """
    t0, start = time.perf_counter(), evaluate.evaluations
    cats = [v for v in vars_ if v.categorical]
    knobs = list(dict.fromkeys(v.knob.name for v in cats))
    domains = {name: next(v.knob.domain for v in cats if v.knob.name == name) for name in knobs}
    subspaces = []
    for combo in itertools.product(*(domains[n] for n in knobs)):
        chosen = dict(zip(knobs, combo))
        fixed = {v.key: chosen[v.knob.name] if chosen[v.knob.name] in v.domain else v.default for v in cats}
        if fixed not in subspaces:
            subspaces.append(fixed)
    trace: list = []
    # Screen the subspaces at the default resources (one evaluation each) and run the priority
    # search only in the most promising ones; the polish still lets each collective switch.
    resources = [v for v in vars_ if not v.categorical]
    defaults = {v.key: v.default for v in resources}
    screened = [({**defaults, **f}, evaluate(Settings.from_assignment({**defaults, **f}, vars_))) for f in subspaces or [{}]]
    screened.sort(key=lambda se: se[1].iteration_s)
    # the best screened point (the defaults among them) is a candidate too: the search never ends
    # worse than a setting it evaluated
    best_state, best_ev = screened[0]
    for fixed in [{v.key: state[v.key] for v in cats} for state, _ in screened[:top_subspaces]]:
        state, ev = _priority_search(evaluate, vars_, fixed, trace)
        if ev.iteration_s < best_ev.iteration_s:
            best_state, best_ev = state, ev
    best_state, best_ev = _polish(evaluate, vars_, best_state, best_ev)
    return SearchResult("lagom", Settings.from_assignment(best_state, vars_), best_ev,
                        evaluate.evaluations - start, time.perf_counter() - t0, {"trace": trace, "subspaces": len(subspaces)})
