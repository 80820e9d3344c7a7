"""Decision variables: each knob at each place it can be deployed, and settings built from them.

A knob deployable only per process or per communicator is one variable for everything that
shares it, so no optimizer can propose a setting the runtime could not apply (DESIGN.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from lagom_tune.backends.base import Knob, KnobSpace
from lagom_tune.workload.spec import Collective, Workload


@dataclass(frozen=True)
class Var:
    scope: str  # "process" | "communicator" | "collective"
    target: str  # "" for process, the communicator's or the collective's name otherwise
    knob: Knob
    domain: tuple = ()  # the knob's values valid for every collective this variable covers

    def __post_init__(self) -> None:
        if not self.domain:
            object.__setattr__(self, "domain", self.knob.domain)

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


def variables(workload: Workload, space: KnobSpace) -> list[Var]:
    """Every variable that touches at least one collective of ``workload``."""
    colls = workload.collectives()
    out: list[Var] = []
    for k in space.knobs:
        relevant = [c for c in colls if not k.ops or c.op in k.ops]
        if not relevant:
            continue
        if k.scope == "process":
            out.append(Var("process", "", k, k.domain_for({c.op for c in relevant})))
        elif k.scope == "communicator":
            for g in dict.fromkeys(c.group for c in relevant):
                out.append(Var("communicator", g, k, k.domain_for({c.op for c in relevant if c.group == g})))
        else:
            for key in dict.fromkeys(c.rule_key for c in relevant):  # one variable per deployable rule
                out.append(Var("collective", key, k, k.domain_for({c.op for c in relevant if c.rule_key == key})))
    return out


@dataclass(frozen=True)
class Settings:
    """Knob values at their scopes: what a plan deploys."""

    process: Mapping[str, Any] = field(default_factory=dict)
    communicators: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    collectives: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def for_collective(self, coll: Collective) -> dict[str, Any]:
        return {**self.process, **self.communicators.get(coll.group, {}), **self.collectives.get(coll.rule_key, {})}

    @property
    def key(self) -> tuple:
        """Hashable identity (evaluation cache key); flat, since it is computed per evaluation."""
        nested = lambda m: tuple(sorted((k, tuple(sorted(v.items()))) for k, v in m.items()))  # noqa: E731
        return tuple(sorted(self.process.items())), nested(self.communicators), nested(self.collectives)

    @classmethod
    def from_assignment(cls, assignment: Mapping[str, Any], vars_: list[Var]) -> "Settings":
        process: dict[str, Any] = {}
        comms: dict[str, dict[str, Any]] = {}
        colls: dict[str, dict[str, Any]] = {}
        for var in vars_:
            value = assignment[var.key]
            if var.scope == "process":
                process[var.knob.name] = value
            elif var.scope == "communicator":
                comms.setdefault(var.target, {})[var.knob.name] = value
            else:
                colls.setdefault(var.target, {})[var.knob.name] = value
        return cls(process, comms, colls)


def default_assignment(vars_: list[Var]) -> dict[str, Any]:
    return {v.key: v.knob.default for v in vars_}


def min_comm_assignment(vars_: list[Var]) -> dict[str, Any]:
    """Every knob at communication's minimum: where the Lagom search starts."""
    return {v.key: (v.knob.default if v.categorical else v.comm_order()[0]) for v in vars_}


def settings_items(s: Settings) -> tuple[tuple[str, Any], ...]:
    """Flat ``(scope.target.knob, value)`` pairs: settings as a measurement point's config."""
    items = [(f"process..{k}", v) for k, v in sorted(s.process.items())]
    items += [(f"communicator.{g}.{k}", v) for g, kv in sorted(s.communicators.items()) for k, v in sorted(kv.items())]
    items += [(f"collective.{c}.{k}", v) for c, kv in sorted(s.collectives.items()) for k, v in sorted(kv.items())]
    return tuple(items)


def settings_from_items(items) -> Settings:
    out: dict[str, dict] = {"process": {}, "communicator": {}, "collective": {}}
    for name, value in items:
        scope, rest = name.split(".", 1)
        target, knob = rest.rsplit(".", 1)
        if scope == "process":
            out["process"][knob] = value
        else:
            out[scope].setdefault(target, {})[knob] = value
    return Settings(out["process"], out["communicator"], out["collective"])
