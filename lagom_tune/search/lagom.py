"""Lagom's priority-based search (paper Algorithms 1-2, DESIGN.md §7).

Every variable starts at communication's minimum. Repeatedly, the unfinished variable with the
smallest priority ``H = (Y' - Y) / (x(s) - x(s'))`` (computation time added per unit of
communication time saved) steps towards more communication resources, by the relative
improvement of its last step ``lr = (x(s) - x(s')) / x(s')`` (the printed formula has the sign
flipped). A variable stops when its communication no longer gets faster or when communication
is hidden (``X' < Y'``). Each variable is stepped at most once per position of its domain, so the
search is linear in the number of variables.
"""

from __future__ import annotations

import time

from lagom_tune.search.evaluate import Evaluation, ModelEvaluator
from lagom_tune.search.result import SearchResult
from lagom_tune.search.space import Settings, Var, min_comm_assignment

INITIAL_PRIORITY = 0.01


def comm_of(var: Var, ev: Evaluation) -> float:
    """The communication time a variable controls: its collective's, its communicator's, or all."""
    if var.scope == "collective":
        return ev.comm_by_collective.get(var.target, 0.0)
    if var.scope == "communicator":
        return ev.comm_by_group.get(var.target, 0.0)
    return ev.comm_s


def next_value(var: Var, current, lr: float):
    """Step ``current`` up its comm-ordered domain by ``lr`` (relative), at least one position."""
    order = var.knob.comm_order()
    i = order.index(current)
    if i + 1 >= len(order):
        return None
    step = 1
    if isinstance(current, (int, float)) and current and all(isinstance(o, (int, float)) for o in order):
        goal = current * (1 + lr) if var.knob.comm_direction > 0 else current / (1 + lr)
        while i + step + 1 < len(order) and abs(order[i + step + 1] - goal) < abs(order[i + step] - goal):
            step += 1
    return order[i + step]


def lagom_search(evaluate: ModelEvaluator, vars_: list[Var], **_) -> SearchResult:
    t0 = time.perf_counter()
    start = evaluate.evaluations
    state = min_comm_assignment(vars_)
    ev = evaluate(Settings.from_assignment(state, vars_))
    best_state, best_ev = dict(state), ev
    priority = {v.key: INITIAL_PRIORITY for v in vars_}
    lr = {v.key: 1.0 for v in vars_}
    active = [v for v in vars_ if len(v.knob.domain) > 1]
    trace = []
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
        if ev.comm_s < ev.compute_s:  # communication hidden: more resources cannot help it
            active.remove(var)
    return SearchResult("lagom", Settings.from_assignment(best_state, vars_), best_ev,
                        evaluate.evaluations - start, time.perf_counter() - t0, {"trace": trace})
