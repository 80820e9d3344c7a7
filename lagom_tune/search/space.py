"""Decision variables: each knob at each place it can be deployed (``knobs.Settings`` holds their values).

A knob deployable only per process or per communicator is one variable for everything that
shares it, so no optimizer can propose a setting the runtime could not apply (DESIGN.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lagom_tune.knobs import BackendChoices, Knob, KnobSpace, Settings
from lagom_tune.measurements import CHOICE_KNOBS
from lagom_tune.workload.spec import Collective, Workload

__all__ = ["Var", "default_assignment", "default_settings", "feasible_domain", "min_comm_assignment", "neighbours", "observed_defaults",
           "variables"]



@dataclass(frozen=True)
class Var:
    scope: str  # "process" | "communicator" | "collective"
    target: str  # "" for process, the communicator's or the collective's name otherwise
    knob: Knob
    domain: tuple = ()  # the knob's values valid for every collective this variable covers
    default: Any = None  # what the backend takes for them (``Knob.default_for``; None: the knob's default)

    def __post_init__(self) -> None:
        if not self.domain:
            object.__setattr__(self, "domain", self.knob.domain)
        if self.default is None:
            object.__setattr__(self, "default", self.knob.default)

    @property
    def categorical(self) -> bool:
        """No resource order (algorithm, protocol): searched as subspaces, not stepped."""
        return self.knob.comm_direction == 0

    def comm_order(self) -> tuple:
        return self.knob.comm_order(self.domain)

    @property
    def key(self) -> str:
        return f"{self.scope}:{self.target}:{self.knob.name}" if self.target else f"{self.scope}:{self.knob.name}"

    def covers(self, coll: Collective) -> bool:
        """Does this variable's value apply to ``coll``?"""
        if self.knob.ops and coll.op not in self.knob.ops:
            return False
        return self.scope == "process" or (self.scope == "communicator" and coll.group == self.target) or (
            self.scope == "collective" and coll.rule_key == self.target)


def variables(workload: Workload, space: KnobSpace, chosen: BackendChoices = BackendChoices()) -> list[Var]:
    """Every variable that touches at least one collective of ``workload``.

    Args:
        workload: the workload (its collectives' ops, communicators and rule keys).
        space: the backend's knobs.
        chosen: what the backend was seen running collectives with when nothing is set: a
            collective-scope variable's default there (where the space holds it, :func:`observed_defaults`).
    Returns:
        One variable per knob and place it deploys at, in knob order.
    """
    colls = workload.collectives()
    out: list[Var] = []
    for k in space.knobs:
        relevant = [c for c in colls if not k.ops or c.op in k.ops]
        if not relevant:
            continue
        if k.scope == "process":
            out.append(_var("process", "", k, relevant))
        elif k.scope == "communicator":
            for g in dict.fromkeys(c.group for c in relevant):
                out.append(_var("communicator", g, k, [c for c in relevant if c.group == g]))
        else:
            for key in dict.fromkeys(c.rule_key for c in relevant):  # one variable per deployable rule
                covered = [c for c in relevant if c.rule_key == key]
                out.append(_var("collective", key, k, covered, observed_defaults(space, chosen, covered[0]).get(k.name)))
    return out


def observed_defaults(space: KnobSpace, chosen: BackendChoices, coll: Collective) -> Mapping[str, Any]:
    """What the backend was seen running ``coll`` with when nothing is set, where the space holds
    it (``KnobSpace.usable``): NCCL's own choice of an algorithm the model has no term for (PAT,
    NVLS-tree, CollNet) leaves the collective at the space's defaults, protocol and channels
    included; a channel count the space does not offer is taken as the nearest it does.

    Args:
        space: the backend's knobs.
        chosen: the observed choices.
        coll: one collective.
    Returns:
        Knob name -> value; empty when nothing usable was observed.
    """
    return space.usable(chosen.for_collective(coll), coll.op, coll.nodes, CHOICE_KNOBS)


def _var(scope: str, target: str, knob: Knob, covered: list[Collective], observed: Any = None) -> Var:
    """The variable for ``knob`` at one place: the values, and the default, that suit every
    collective it covers (``observed``: the value the backend was seen choosing for them)."""
    ops, nodes = {c.op for c in covered}, max(c.nodes for c in covered)
    ops_default = ops if scope == "collective" else set()  # a process or communicator value is NCCL's one default
    default = observed if observed is not None else knob.default_for(ops_default, nodes)
    return Var(scope, target, knob, knob.domain_for(ops, nodes), default)


def neighbours(vars_: list[Var], colls: list[Collective]) -> dict[str, list[Var]]:
    """For each variable, the others that set a knob of at least one collective it sets too:
    those whose values it must be able to run with (``Knob.needs``).

    Args:
        vars_: the variables (``variables``).
        colls: the workload's collectives.
    Returns:
        Variable key -> its neighbours, in ``vars_`` order.
    """
    covered = {v.key: {c.name for c in colls if v.covers(c)} for v in vars_}
    return {v.key: [w for w in vars_ if w is not v and covered[v.key] & covered[w.key]] for v in vars_}


def feasible_domain(v: Var, assigned: Mapping[str, Any], near: list[Var]) -> tuple:
    """``v``'s values that run with the values already assigned to its neighbours: a neighbour's
    value may need ``v``'s knob at some values (NVLS needs Simple), and a value of ``v`` may need
    the neighbour's knob at some (Simple is free, NVLS is not beside LL).

    Args:
        v: the variable to be given a value.
        assigned: variable key -> value, for the variables given one so far.
        near: ``v``'s neighbours (:func:`neighbours`).
    Returns:
        The feasible values in domain order (all of them when nothing assigned constrains ``v``;
        none when nothing can run, which evaluates as infeasible).
    """
    # the pairing rule is KnobSpace.conflict's, asked of each pair of knobs
    pairs = [(KnobSpace((v.knob, w.knob)), w.knob.name, assigned[w.key]) for w in near if w.key in assigned and w.knob is not v.knob]
    return tuple(x for x in v.domain if all(pair.conflict({v.knob.name: x, name: value}) is None for pair, name, value in pairs))


def default_assignment(vars_: list[Var]) -> dict[str, Any]:
    """Every variable at its default (what the backend takes for the collectives it covers).

    Args:
        vars_: the variables (``variables``).
    Returns:
        Variable key -> value.
    """
    return {v.key: v.default for v in vars_}


def default_settings(vars_: list[Var]) -> Settings:
    """What a job runs with when nothing is set: every variable at its default.

    Args:
        vars_: the variables (``variables``).
    Returns:
        The Settings.
    """
    return Settings.from_assignment(default_assignment(vars_), vars_)


def min_comm_assignment(vars_: list[Var]) -> dict[str, Any]:
    """Every knob at communication's minimum: where the Lagom search starts.

    Args:
        vars_: the variables (``variables``); categorical ones stay at their default.
    Returns:
        Variable key -> value.
    """
    return {v.key: (v.default if v.categorical else v.comm_order()[0]) for v in vars_}
