"""Knobs and settings: the types every layer shares, at the bottom of the package.

A ``Knob`` is one tunable setting of a backend and a ``KnobSpace`` all of them; ``Settings`` are
knob values at the scopes they deploy at (what a plan holds, what a measurement point replays).
This module imports nothing from the rest of lagom-tune but ``errors``, and nothing heavy: the
runtime shim loads a plan's knob space in every rank of a user's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

from lagom_tune.errors import UserError

SCOPES = ("collective", "communicator", "process")


@dataclass(frozen=True)
class Knob:
    """One tunable setting: its domain, default, and the scope at which it can be deployed.

    ``comm_direction`` is +1 when a larger value gives communication more of the machine (NCCL
    channels, chunk size) and -1 when it gives computation more (CPU threads per rank); the
    Lagom search starts every knob at communication's minimum and steps towards its maximum.
    ``ops`` limits the knob to some collective ops (empty: all). A value may suit only some ops
    (``only_for``), only communicators within one node (``within_node``), only some values of
    another knob (``needs``), and be NCCL's own default for some ops where it is valid
    (``default_where``: NVLS for all-reduce on an NVSwitch node).
    """

    name: str
    scope: str
    domain: tuple
    default: Any
    comm_direction: int = 1
    ops: tuple[str, ...] = ()
    mechanism: str = ""
    description: str = ""
    only_for: tuple[tuple[Any, tuple[str, ...]], ...] = ()  # (value, ops it is valid for)
    env: str = ""  # process-scope knobs deployed through an environment variable
    within_node: tuple[Any, ...] = ()  # values valid only for a communicator within one node
    default_where: tuple[tuple[Any, tuple[str, ...]], ...] = ()  # (value, ops it is the default for where valid)
    needs: tuple[tuple[Any, str, tuple], ...] = ()  # (value, another knob, that knob's values it runs with)

    def __post_init__(self) -> None:
        assert self.scope in SCOPES and self.default in self.domain, self
        assert all(v in self.domain for v, _ in self.default_where + self.only_for), self

    def comm_order(self, domain: tuple | None = None) -> tuple:
        """The domain ordered from least to most resources for communication.

        Args:
            domain: a subset of the knob's domain (default: all of it).
        Returns:
            Its values, communication's minimum first.
        """
        return tuple(sorted(domain or self.domain, reverse=self.comm_direction < 0))

    def domain_for(self, ops: set[str], nodes: int = 1) -> tuple:
        """Values valid for every op in ``ops`` (e.g. NCCL's tree algorithm is all-reduce only) on
        a communicator spanning ``nodes`` nodes (NVLS runs within one).

        Args:
            ops: collective ops (``Collective.op``) the value must suit.
            nodes: the most nodes a communicator it applies to spans.
        Returns:
            The valid values, in domain order.
        """
        limits = dict(self.only_for)
        return tuple(x for x in self.domain if (x not in limits or ops <= set(limits[x]))
                     and (nodes <= 1 or x not in self.within_node))

    def default_for(self, ops: set[str], nodes: int = 1) -> Any:
        """The value the backend itself takes for ``ops`` on ``nodes`` nodes: a ``default_where``
        value where every op is one it is the default for and it is valid, else ``default``.

        Args:
            ops: collective ops the value applies to (empty: a process-wide default).
            nodes: the most nodes a communicator it applies to spans.
        Returns:
            The default.
        """
        valid = self.domain_for(ops, nodes)
        return next((v for v, vops in self.default_where if ops and ops <= set(vops) and v in valid), self.default)

    def check(self, value: Any, path: str) -> Any:
        """``value`` if it is in the domain.

        Args:
            value: a value read from a file.
            path: where it was read, for the error.
        Returns:
            The value.
        Raises:
            UserError: one line naming the domain, for a value outside it.
        """
        # by type too: 2.0 and True equal 2 and 1, but deploy as OMP_NUM_THREADS=2.0 and =True
        if not any(type(value) is type(d) and value == d for d in self.domain):
            raise UserError(f"{path}: {value!r} is outside {self.name}'s domain {list(self.domain)}")
        return value


@dataclass(frozen=True)
class KnobSpace:
    """A backend's knobs, in a fixed order."""

    knobs: tuple[Knob, ...]

    def __getitem__(self, name: str) -> Knob:
        for k in self.knobs:
            if k.name == name:
                return k
        raise UserError(f"unknown knob {name!r}; this backend has {', '.join(self.names())}")

    def names(self) -> list[str]:
        """Every knob's name, in order."""
        return [k.name for k in self.knobs]

    def at_scope(self, scope: str) -> list[Knob]:
        """The knobs that deploy at ``scope`` (one of ``SCOPES``)."""
        return [k for k in self.knobs if k.scope == scope]

    def defaults(self, op: str | None = None, nodes: int = 1) -> dict[str, Any]:
        """Knob name -> its default, process-wide, or what the backend takes for ``op`` on
        ``nodes`` nodes (:meth:`Knob.default_for`).

        Args:
            op: a collective op, or None for the process-wide defaults.
            nodes: the nodes its communicator spans.
        Returns:
            The defaults.
        """
        return {k.name: k.default_for({op} if op else set(), nodes) for k in self.knobs}

    def conflict(self, values: Mapping[str, Any]) -> str | None:
        """Why one collective's knob values cannot run together (NVLS runs the Simple protocol
        only), or None when they can.

        Args:
            values: knob name -> value, as one collective runs (``Settings.for_collective``).
        Returns:
            A short reason, or None.
        """
        for k in self.knobs:
            for value, other, allowed in k.needs:
                if values.get(k.name) == value and other in values and values[other] not in allowed:
                    return f"{k.name} {value} runs only with {other} {'/'.join(map(str, allowed))}, not {values[other]}"
        return None

    def usable(self, seen: Mapping[str, Any], op: str, nodes: int, whole: Sequence[str]) -> dict[str, Any]:
        """What of the values a backend was seen running one collective with this space can predict
        it at: the values that make its choice (``whole``: an algorithm and its protocol) all or
        none; each other value (its channels) where the space has that knob, as the offered value
        nearest it (by ratio, the smaller on a tie: NCCL drops a small collective's channels one
        at a time, to counts such as 3 the space does not offer).

        Args:
            seen: knob name -> value observed.
            op: the collective's op.
            nodes: the nodes its communicator spans.
            whole: the knobs observed as one choice.
        Returns:
            Knob name -> value; empty when the choice itself is not held (an algorithm the space
            has no term for, a pair that cannot run together).
        """
        def offered(k: str) -> tuple:
            return self[k].domain_for({op}, nodes) if k in self.names() else ()

        choice = {k: val for k, val in seen.items() if k in whole}
        if len(choice) != len(whole) or not all(val in offered(k) for k, val in choice.items()) or self.conflict(choice):
            return {}
        rest = {k: nearest(offered(k), val) for k, val in seen.items() if k not in whole}
        return {**choice, **{k: val for k, val in rest.items() if val is not None}}


def nearest(domain: Sequence[Any], value: Any) -> Any:
    """The value of ``domain`` nearest ``value``: itself if offered; for positive numbers the
    nearest by ratio (the smaller on a tie); else None.

    Args:
        domain: the offered values.
        value: an observed value.
    Returns:
        The offered value, or None when a value not offered has no nearest (not a positive number).
    """
    if value in domain:
        return value
    numbers = [x for x in domain if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0]
    if not numbers or not isinstance(value, (int, float)) or value <= 0:
        return None
    return min(sorted(numbers), key=lambda x: max(x, value) / min(x, value))


class CollectiveSite(Protocol):
    """Where a collective runs, as settings see it (a ``workload.spec.Collective`` is one)."""

    group: str  # its communicator role
    rule_key: str  # the collective-scope rule that matches it


class Placement(Protocol):
    """A decision variable's place (a ``search.space.Var`` is one)."""

    key: str
    scope: str
    target: str
    knob: Knob


@dataclass(frozen=True)
class Settings:
    """Knob values at their scopes: what a plan deploys."""

    process: Mapping[str, Any] = field(default_factory=dict)
    communicators: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    collectives: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def for_collective(self, coll: CollectiveSite) -> dict[str, Any]:
        """The knob values one collective runs with.

        Args:
            coll: the collective (its communicator and its rule key).
        Returns:
            Knob name -> value: process values, overridden by its communicator's, then its rule's.
        """
        return {**self.process, **self.communicators.get(coll.group, {}), **self.collectives.get(coll.rule_key, {})}

    @property
    def key(self) -> tuple:
        """Hashable identity (evaluation cache key); flat, since it is computed per evaluation."""
        nested = lambda m: tuple(sorted((k, tuple(sorted(v.items()))) for k, v in m.items()))  # noqa: E731
        return tuple(sorted(self.process.items())), nested(self.communicators), nested(self.collectives)

    @classmethod
    def from_assignment(cls, assignment: Mapping[str, Any], vars_: Iterable[Placement]) -> "Settings":
        """Settings from one value per decision variable.

        Args:
            assignment: variable key -> value.
            vars_: the variables (``search.space.variables``), each placing its knob at a scope.
        Returns:
            The Settings.
        """
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


@dataclass(frozen=True)
class BackendChoices:
    """What the backend itself runs collectives with when nothing is set, where that was observed
    (NCCL's own algorithm and protocol, seen by the tuner plugin while the profile timed each
    collective with nothing set): collective rule key (``Collective.rule_key``) -> knob -> value.
    A collective it does not hold takes the knob space's defaults (``Knob.default_for``)."""

    by_rule: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def for_collective(self, coll: CollectiveSite) -> Mapping[str, Any]:
        """The values the backend was seen choosing for ``coll``; empty when none was observed.

        Args:
            coll: the collective (its rule key).
        Returns:
            Knob name -> value.
        """
        return self.by_rule.get(coll.rule_key, {})


def settings_items(s: Settings) -> tuple[tuple[str, Any], ...]:
    """Flat ``(scope.target.knob, value)`` pairs: settings as a measurement point's config.

    Args:
        s: the settings.
    Returns:
        The pairs, sorted within each scope (``settings_from_items`` reads them back).
    """
    items = [(f"process..{k}", v) for k, v in sorted(s.process.items())]
    items += [(f"communicator.{g}.{k}", v) for g, kv in sorted(s.communicators.items()) for k, v in sorted(kv.items())]
    items += [(f"collective.{c}.{k}", v) for c, kv in sorted(s.collectives.items()) for k, v in sorted(kv.items())]
    return tuple(items)


def settings_from_items(items: Iterable[tuple[str, Any]]) -> Settings:
    """The settings that ``settings_items`` flattened.

    Args:
        items: ``(scope.target.knob, value)`` pairs (a measurement point's config).
    Returns:
        The Settings.
    """
    out: dict[str, dict] = {"process": {}, "communicator": {}, "collective": {}}
    for name, value in items:
        scope, rest = name.split(".", 1)
        target, knob = rest.rsplit(".", 1)
        if scope == "process":
            out["process"][knob] = value
        else:
            out[scope].setdefault(target, {})[knob] = value
    return Settings(out["process"], out["communicator"], out["collective"])
