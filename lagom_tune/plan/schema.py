"""The plan file (DESIGN.md §8): typed, validated on load, written atomically.

Settings are recorded at the scope they deploy at: ``process`` (one value per rank process),
``communicators`` (per process group role, e.g. ``dp``) and ``collectives`` (rules matched by op,
communicator and size). The runtime shim reads nothing else.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagom_tune import __version__
from lagom_tune import validate as v
from lagom_tune.backends.registry import backend_info
from lagom_tune.errors import UserError
from lagom_tune.knobs import BackendChoices, KnobSpace, Settings
from lagom_tune.precision import ROUNDING_REL
from lagom_tune.workload.spec import MAX_RANKS, OPS, Collective, Workload
from lagom_tune.yaml_io import read_yaml, write_yaml

SCHEMA_VERSION = 1
KIND = "lagom-plan"
FILE_MARK = rf"\Aschema_version: \d+\r?\nkind: {KIND}$"  # a plan file's first two lines, as written (``search --out`` replaces only such a file)
# The fields a plan file may hold (what Plan.to_dict writes); any other is refused by name.
SECTIONS = ("schema_version", "kind", "tool", "target", "workload", "model", "search", "process", "communicators",
            "collectives", "backend_defaults", "predicted", "validated")
TARGET_FIELDS = ("backend", "simulated", "hardware", "world_size", "nodes", "groups", "group_ranks")
MATCH_FIELDS = ("op", "group", "min_bytes", "max_bytes")
PREDICTED_FIELDS = ("iteration_ms", "bound_ms", "simulated")  # what search writes (planning.build_plan)
VALIDATED_FIELDS = ("method", "simulated", "repeats", "iteration_ms", "spread_ms", "speedup", "interval", "ratios",
                    "same_settings")  # what --validate writes (search.replay.validate)
VALIDATED_REQUIRED = ("method", "repeats", "iteration_ms")  # ... and of it, what every replay writes
MAX_RULE_BYTES = v.MAX_INT  # a rule's byte bounds as the tuner plugin reads them (int64)


def knob_space_for(backend: str, fingerprint: dict[str, Any] | None = None) -> KnobSpace:
    """A backend's knob space on the profiled machine, or its widest (what any plan may hold;
    machine fit is checked by ``apply``). Imports no torch, numpy or pandas (the shim calls it).

    Args:
        backend: the backend's name.
        fingerprint: the run folder's fingerprint, or None for the widest space.
    Returns:
        The KnobSpace.
    Raises:
        UserError: for an unknown backend.
    """
    return backend_info(backend, "plan.target.backend: ").knob_space(fingerprint)


@dataclass(frozen=True)
class CollectiveRule:
    op: str
    group: str
    min_bytes: int
    max_bytes: int
    set: dict[str, Any]

    def matches(self, c: Collective) -> bool:
        """Whether the rule holds for ``c``: its op, its role (or any, ``*``), its size within the bounds."""
        return self.op == c.op and self.group in (c.group, "*") and self.min_bytes <= c.nbytes <= self.max_bytes


@dataclass(frozen=True)
class Plan:
    backend: str
    world_size: int
    hardware: dict[str, Any]
    settings: Settings
    rules: tuple[CollectiveRule, ...] = ()
    simulated: bool = False
    nodes: int = 1
    workload: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)
    validated: dict[str, Any] | None = None
    groups: dict[str, int] = field(default_factory=dict)  # communicator role -> ranks in it
    # Optional: role -> the exact global rank sets of its groups, for roles that neither their size
    # nor a DeviceMesh dimension's name identifies (e.g. Megatron-style new_group layouts).
    group_ranks: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    # Optional: what the predictions assume the backend runs collectives with when nothing is set,
    # where the profile saw it (NCCL's own algorithm and protocol); elsewhere the space's defaults.
    # Never deployed: the record `apply` holds NCCL's own choices against.
    backend_defaults: tuple[CollectiveRule, ...] = ()

    def backend_choices(self, workload: Workload) -> BackendChoices:
        """``backend_defaults`` for the collectives of ``workload`` (first match, as rules match).

        Args:
            workload: the workload (its collectives' ops, roles and sizes).
        Returns:
            The choices, by rule key.
        """
        out = {}
        for c in workload.collectives():
            seen = next((r.set for r in self.backend_defaults if r.matches(c)), None)
            if seen is not None:
                out[c.rule_key] = dict(seen)
        return BackendChoices(out)

    @property
    def space(self) -> KnobSpace:
        """The knob space the plan's values were chosen from: its backend's, bounded by the machine
        it was profiled on (``target.hardware``)."""
        return _plan_space(self.backend, self.hardware)

    def modelled_settings(self, workload: Workload, default: Settings) -> Settings:
        """The settings the plan runs ``workload`` with, as the model evaluates them: its own where
        it sets a knob, ``default`` where it leaves one to the backend (a plan that keeps the
        defaults sets nothing); a collective takes the first rule that matches it, as NCCL's
        tuner plugin does.

        Args:
            workload: the workload (its collectives' ops, roles and sizes).
            default: every knob at the backend's default (``search.space.default_assignment``).
        Returns:
            The Settings.
        """
        roles = set(default.communicators) | set(self.settings.communicators)
        rules = {}
        for c in workload.collectives():
            rule = next((r for r in self.rules if r.matches(c)), None)
            rules[c.rule_key] = {**default.collectives.get(c.rule_key, {}), **(rule.set if rule else {})}
        return Settings({**default.process, **self.settings.process},
                        {role: {**default.communicators.get(role, {}), **self.settings.communicators.get(role, {})} for role in roles},
                        {key: kv for key, kv in rules.items() if kv})

    @property
    def predicted_speedup(self) -> float | None:
        """The predicted speed-up, the default's predicted iteration time over the plan's (None for a
        plan without both predictions)."""
        times = self.predicted.get("iteration_ms", {})
        return times["default"] / times["plan"] if times.get("default") and times.get("plan") else None

    def refuse_if_simulated(self) -> None:
        """Raise UserError for a plan searched on a simulated cluster: a what-if result, which
        neither ``apply`` nor the runtime shim deploys."""
        if self.simulated:
            raise UserError("this plan was searched on a simulated cluster (a what-if result); profile the real machine to get one to apply")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "tool": {"name": "lagom-tune", "version": __version__},
            "target": {"backend": self.backend, "simulated": self.simulated, "hardware": dict(self.hardware),
                       "world_size": self.world_size, "nodes": self.nodes, "groups": dict(self.groups),
                       # written only when given, so plans without rank sets read as before
                       **({"group_ranks": {k: [list(s) for s in sets] for k, sets in self.group_ranks.items()}}
                          if self.group_ranks else {})},
            "workload": dict(self.workload),
            "model": dict(self.model),
            "search": dict(self.search),
            "process": dict(self.settings.process),
            "communicators": {k: dict(val) for k, val in self.settings.communicators.items()},
            "collectives": _rules_record(self.rules),
            # written only when observed, so plans without them read as before
            **({"backend_defaults": _rules_record(self.backend_defaults)} if self.backend_defaults else {}),
            "predicted": dict(self.predicted),
            "validated": self.validated,
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan atomically, once it reads back as the plan it is (a plan that `show` and
        `apply` would refuse is never written: the error names the field, as a loaded file's would).

        Args:
            path: the plan file.
        Returns:
            The path written.
        """
        d = self.to_dict()
        Plan.from_dict(d, str(path))
        return write_yaml(path, d)

    @classmethod
    def from_dict(cls, data: Any, path: str = "plan") -> "Plan":
        d = v.document(data, path, "plan file")
        kind = d.get("kind")
        if kind != KIND:
            raise UserError(f"{path}.kind: expected {KIND!r}, got {kind!r} (is this a plan file?)")
        v.schema_version(d, path, SCHEMA_VERSION)
        v.known_keys(d, SECTIONS, path)
        tool = v.known_keys(v.mapping(v.field(d, "tool", path, dict, {}), f"{path}.tool"), ("name", "version"), f"{path}.tool")
        for key in ("name", "version"):  # which lagom-tune wrote it, shown as it is
            v.field(tool, key, f"{path}.tool", str, None)
        target = v.known_keys(v.mapping(v.field(d, "target", path, dict), f"{path}.target"), TARGET_FIELDS, f"{path}.target")
        backend = v.field(target, "backend", f"{path}.target", str)
        info = backend_info(backend, f"{path}.target.backend: ")
        hardware = _hardware_record(v.field(target, "hardware", f"{path}.target", dict, {}), f"{path}.target.hardware")
        if "cluster" in hardware and not info.simulated:
            # a simulated plan relabelled: its knob values would be held to the simulated cluster's, and apply would run them
            raise UserError(f"{path}.target.hardware.cluster: {hardware['cluster']!r} is a simulated cluster, but the {backend} backend "
                            "measures real machines (a simulated plan relabelled?); search a profile of the real machine")
        try:
            space = _plan_space(backend, hardware)
        except UserError as e:  # a cluster no simulator has
            raise UserError(f"{path}.target.hardware: {e}") from None

        def knobs(values: Any, where: str, scope: str) -> dict[str, Any]:
            values = v.mapping(values, where)
            for name, value in values.items():
                if name not in space.names():
                    raise UserError(f"{where}.{name}: unknown knob; the {backend} backend has {', '.join(space.names())}")
                knob = space[name]
                if knob.scope != scope:
                    raise UserError(f"{where}.{name}: {name} deploys per {knob.scope}, not per {scope}")
                knob.check(value, f"{where}.{name}")
            return dict(values)

        # The three settings sections are required (empty when they set nothing): a file cut short
        # or a section misspelt must not read as a plan that sets nothing.
        process = knobs(v.field(d, "process", path, dict), f"{path}.process", "process")
        comms = {name: knobs(val, f"{path}.communicators.{name}", "communicator")
                 for name, val in v.named(v.field(d, "communicators", path, dict), f"{path}.communicators").items()}
        def collective_rules(section: str, absent: Any = ...) -> list[tuple[str, CollectiveRule]]:
            """The section's rules with their field paths (``absent``: what a missing section reads as; required)."""
            rules = []
            for i, r in enumerate(v.field(d, section, path, list, absent)):
                rp = f"{path}.{section}[{i}]"
                r = v.known_keys(v.mapping(r, rp), ("match", "set"), rp)
                m = v.known_keys(v.mapping(v.field(r, "match", rp, dict), f"{rp}.match"), MATCH_FIELDS, f"{rp}.match")
                rule = CollectiveRule(
                    op=v.one_of(v.field(m, "op", f"{rp}.match", str), OPS, f"{rp}.match.op"),
                    group=v.field(m, "group", f"{rp}.match", str, "*"),
                    min_bytes=v.field(m, "min_bytes", f"{rp}.match", int, 0, minimum=0, maximum=MAX_RULE_BYTES),
                    max_bytes=v.field(m, "max_bytes", f"{rp}.match", int, 1 << 62, minimum=0, maximum=MAX_RULE_BYTES),
                    set=knobs(v.field(r, "set", rp, dict), f"{rp}.set", "collective"),
                )
                if not rule.set:  # the tuner plugin refuses it, and with it every rule of the plan
                    raise UserError(f"{rp}.set: the rule sets nothing; remove it or set a knob")
                if rule.min_bytes > rule.max_bytes:
                    raise UserError(f"{rp}.match: min_bytes {rule.min_bytes} is above max_bytes {rule.max_bytes}; the rule matches nothing")
                for name, value in rule.set.items():  # e.g. NCCL's tree algorithm is all-reduce only
                    valid = space[name].domain_for({rule.op})
                    if value not in valid:
                        raise UserError(f"{rp}.set.{name}: {value!r} does not apply to {rule.op} (valid: {', '.join(map(str, valid))})")
                conflict = space.conflict(rule.set)
                if conflict:  # NCCL offers no such pair: the plugin's rule would be skipped
                    raise UserError(f"{rp}.set: {conflict}")
                rules.append((rp, rule))
            return rules

        deployed, observed = collective_rules("collectives"), collective_rules("backend_defaults", [])
        for section in (deployed, observed):
            _refuse_shadowed(section)
        placed = deployed + observed
        rules = [rule for _, rule in deployed]
        groups = v.named(v.field(target, "groups", f"{path}.target", dict, {}), f"{path}.target.groups")
        for role in groups:
            v.field(groups, role, f"{path}.target.groups", int, minimum=1, maximum=MAX_RANKS)
        world_size = v.field(target, "world_size", f"{path}.target", int, minimum=1, maximum=MAX_RANKS)
        for role, size in groups.items():
            if size > world_size:
                raise UserError(f"{path}.target.groups.{role}: {size} ranks, more than the world size {world_size}")
        # a role named by settings must be the target's: one it lacks (``groups: {}``) matched any communicator
        named = [(f"{path}.communicators.{c}", c) for c in comms] + \
                [(f"{rp}.match.group", r.group) for rp, r in placed if r.group != "*"]
        for where, role in named:
            if role not in groups:
                raise UserError(f"{where}: no role {role!r} in {path}.target.groups ({', '.join(map(str, groups)) or 'none'})")
        simulated = info.simulated_flag(target, f"{path}.target")
        nodes = v.field(target, "nodes", f"{path}.target", int, 1, minimum=1)
        if world_size % nodes:  # torchrun starts as many ranks on every node
            raise UserError(f"{path}.target.nodes: {nodes} nodes cannot hold {world_size} ranks evenly")
        group_ranks = _group_ranks(target, {str(k): int(val) for k, val in groups.items()}, world_size, f"{path}.target")
        for rp, rule in placed:  # NVLS runs within a node: NCCL would not run such a rule there
            # a rule for any group ("*") matches the world's communicator too
            ranks = world_size if rule.group == "*" else groups.get(rule.group)
            spans = nodes_of(world_size, nodes, ranks, group_ranks.get(rule.group, ()))
            whose = "the world's communicator, which it matches," if rule.group == "*" else f"role {rule.group}'s communicators"
            for name, value in rule.set.items():
                if spans and value not in space[name].domain_for({rule.op}, spans):
                    raise UserError(f"{rp}.set.{name}: {value!r} runs within one node, and {whose} span {spans} "
                                    f"of the plan's {nodes} nodes")
        validated = d.get("validated")
        if validated is not None:
            validated = _times_record(validated, f"{path}.validated", VALIDATED_FIELDS)
            for key in VALIDATED_REQUIRED:  # `validated: {speedup: 2}` was taken, its 2x in show --json
                v.field(validated, key, f"{path}.validated", object)
        predicted = _times_record(v.field(d, "predicted", path, dict, {}), f"{path}.predicted", PREDICTED_FIELDS)
        _check_times(predicted, validated, simulated, path)
        return cls(
            backend=backend,
            world_size=world_size,
            nodes=nodes,
            hardware=hardware,
            simulated=simulated,
            settings=Settings(process, comms, {}),
            rules=tuple(rules),
            workload=_workload_record(v.field(d, "workload", path, dict, {}), f"{path}.workload"),
            model=_model_record(v.field(d, "model", path, dict, {}), f"{path}.model"),
            search=_search_record(v.field(d, "search", path, dict, {}), f"{path}.search", space),
            predicted=predicted,
            validated=validated,
            groups={str(k): int(val) for k, val in groups.items()},
            group_ranks=group_ranks,
            backend_defaults=tuple(rule for _, rule in observed),
        )


def _refuse_shadowed(rules: list[tuple[str, CollectiveRule]]) -> None:
    """Refuse (UserError) a rule that an earlier one of its section shadows: the first rule that
    matches a collective is the one NCCL's tuner plugin and the model take, so a later rule of the
    same op whose group and sizes an earlier one covers never applies (search writes one rule per
    op, role and size band, none overlapping). A plan is loaded in every rank, and a traced workload
    gives thousands of rules: each is checked in O(log n), against the widest reach of the earlier
    rules of its op and group (or ``*``) that start at or below it (:class:`_ReachFrom`)."""
    starts: dict[tuple[str, str], list[int]] = {}
    for _, rule in rules:
        starts.setdefault((rule.op, rule.group), []).append(rule.min_bytes)
    buckets = {key: _ReachFrom(values) for key, values in starts.items()}
    for i, (rp, rule) in enumerate(rules):
        for key in {(rule.op, rule.group), (rule.op, "*")} & buckets.keys():
            earlier = buckets[key].widest(rule.min_bytes)
            if earlier is not None and earlier[0] >= rule.max_bytes:
                ep = rules[earlier[1]][0]
                raise UserError(f"{rp}: never applies: {ep.rpartition('.')[2]} before it matches every {rule.op} it "
                                "matches (the first matching rule is taken); remove one or narrow the earlier one")
        buckets[(rule.op, rule.group)].add(rule.min_bytes, rule.max_bytes, i)


class _ReachFrom:
    """Rules' byte ranges added one by one, asked for the widest ``max_bytes`` among those whose
    ``min_bytes`` is at most a size (a Fenwick tree of maxima over the starts given up front)."""

    def __init__(self, starts: list[int]) -> None:
        self.starts = sorted(set(starts))
        self.tree: list[tuple[int, int] | None] = [None] * (len(self.starts) + 1)

    def add(self, start: int, end: int, index: int) -> None:
        i = bisect.bisect_left(self.starts, start) + 1
        while i < len(self.tree):
            if self.tree[i] is None or end > self.tree[i][0]:
                self.tree[i] = (end, index)
            i += i & -i

    def widest(self, upto: int) -> tuple[int, int] | None:
        """(max_bytes, the rule's index) of the widest-reaching range starting at or below ``upto``, or None."""
        i, best = bisect.bisect_right(self.starts, upto), None
        while i > 0:
            if self.tree[i] is not None and (best is None or self.tree[i][0] > best[0]):
                best = self.tree[i]
            i -= i & -i
        return best


def _rules_record(rules: tuple[CollectiveRule, ...]) -> list[dict[str, Any]]:
    """Collective rules as a plan file holds them (``collectives``, ``backend_defaults``)."""
    return [{"match": {"op": r.op, "group": r.group, "min_bytes": r.min_bytes, "max_bytes": r.max_bytes}, "set": dict(r.set)}
            for r in rules]


HARDWARE_NAMES = ("device", "gpu", "cluster")  # the plan's hardware record: names (the GPU check in apply compares gpu) ...
HARDWARE_COUNTS = ("sms", "cores", "max_channels")  # ... counts ...
HARDWARE_OFFERS = ("nvls", "ll128")  # ... and what NCCL offered where it was profiled
MACHINE_BOUNDS = ("cluster", "max_channels", "cores") + HARDWARE_OFFERS  # what of it bounds the plan's knobs


def _plan_space(backend: str, hardware: dict[str, Any]) -> KnobSpace:
    """The knob space a plan's values are held to: its backend's, bounded by its ``hardware``."""
    return knob_space_for(backend, _machine(hardware))


def _machine(hardware: dict[str, Any]) -> dict[str, Any]:
    """What of the plan's (checked) ``hardware`` bounds its knob values: a simulated cluster's
    name, the channels the profiled GPUs offered and whether NCCL offered NVLS and LL128 there,
    the cores of a CPU. Older plans without them are held to what their profiles offered."""
    return {key: hardware[key] for key in MACHINE_BOUNDS if key in hardware}


def _hardware_record(d: Any, path: str) -> dict[str, Any]:
    """The plan's ``target.hardware`` (what ``planning.build_plan`` copies from the fingerprint), checked."""
    d = v.known_keys(v.mapping(d, path), HARDWARE_NAMES + HARDWARE_COUNTS + HARDWARE_OFFERS, path)
    for key in HARDWARE_NAMES:
        v.name(d, key, path, None)
    for key in HARDWARE_COUNTS:
        v.field(d, key, path, int, None, minimum=1)
    for key in HARDWARE_OFFERS:
        v.field(d, key, path, bool, None)
    return d


# The search options a plan records (what reproduces its search), as ``search`` takes them: (type,
# least[, most]) for validate.bounded_fields; a hand-edited record is checked against them
# (``min_gain: -1`` was shown as given).
SEARCH_OPTIONS = {"n_trials": (int, 1, 10 ** 6), "timeout": (float, 0.1), "seed": (int, 0, 2 ** 32 - 1), "study_name": (str,),
                  "multi_objective": (bool,), "min_gain": (float, 0.0, 1.0)}
MAX_ITERATION_MS = 1e8  # a predicted or replayed iteration, at most: about a day (1e30 was printed as a 31-digit time)
MAX_SPEEDUP = 1e6  # a replayed speed-up or round's ratio, at most (1e300 was taken, and `show` printed no replay at all)


def _search_record(d: Any, path: str, space: KnobSpace) -> dict[str, Any]:
    """The plan's ``search`` section (which optimizer, its effort, why it kept the defaults), checked
    as ``show`` and ``apply`` read it; the knobs it says it left to the backend are ``space``'s."""
    d = v.known_keys(v.mapping(d, path), ("optimizer", "evaluations", "seconds", "kept_default", "left_to_backend", "pareto", "options"),
                     path)
    v.one_line(d, "optimizer", path)
    options = v.known_keys(v.mapping(v.field(d, "options", path, dict, {}), f"{path}.options"), tuple(SEARCH_OPTIONS), f"{path}.options")
    v.bounded_fields(options, SEARCH_OPTIONS, f"{path}.options")
    v.field(d, "evaluations", path, int, None, minimum=0)
    v.field(d, "seconds", path, float, None, minimum=0.0)
    v.field(d, "kept_default", path, str, None)
    for i, name in enumerate(v.field(d, "left_to_backend", path, list, [])):
        if name not in space.names():
            raise UserError(f"{path}.left_to_backend[{i}]: expected one of the backend's knobs ({', '.join(space.names())}), got {name!r}")
    for i, point in enumerate(v.field(d, "pareto", path, list, [])):
        where = f"{path}.pareto[{i}]"
        point = v.known_keys(v.mapping(point, where), ("iteration_ms", "comm_sms"), where)
        v.field(point, "iteration_ms", where, float, minimum=v.POSITIVE)
        v.field(point, "comm_sms", where, int, minimum=0)
    return d


def _model_record(d: dict, path: str) -> dict[str, Any]:
    """The plan's ``model`` section (which fit it came from, and its held-out MAPE), checked."""
    d = v.known_keys(v.mapping(d, path), ("run", "family", "mape"), path)
    v.field(d, "run", path, str, "")
    v.one_line(d, "family", path)
    if "mape" not in d:
        return d
    return {**d, "mape": v.number_map(v.field(d, "mape", path, dict, {}), f"{path}.mape", minimum=0.0)}


def _workload_record(d: Any, path: str) -> dict[str, Any]:
    """The plan's ``workload`` section (the searched workload's name and digest), checked."""
    d = v.known_keys(v.mapping(d, path), ("name", "digest"), path)
    v.one_line(d, "name", path)
    v.one_line(d, "digest", path)
    return d


ROUNDING_RATIO = 0.001  # a speed-up written to 4 decimals from two recorded times: their ratio, within this (relative)


def _check_times(predicted: dict[str, Any], validated: dict[str, Any] | None, simulated: bool, path: str) -> None:
    """Refuse (UserError) times that contradict the plan or each other, which ``show`` and
    ``report`` would print as they are: predictions or a replay of a simulated plan said to be
    measured (or the other way round), a predicted time below the contention-free bound, a stored
    replay speed-up that is not the ratio of its replay times."""
    if predicted.get("simulated", simulated) != simulated:  # written by every search since the label was added
        raise UserError(f"{path}.predicted.simulated: {predicted['simulated']}, but the plan's target is "
                        f"{'a simulated cluster' if simulated else 'real hardware'}")
    bound = predicted.get("bound_ms")
    for name, ms in predicted.get("iteration_ms", {}).items():
        if bound is not None and ms < bound * (1 - ROUNDING_REL):
            raise UserError(f"{path}.predicted.iteration_ms.{name}: {ms} ms, below the contention-free bound {bound} ms "
                            "no setting can beat")
    if validated is None:
        return
    if validated.get("simulated", False) != simulated:
        said = "simulated" if validated.get("simulated", False) else "measured"
        raise UserError(f"{path}.validated.simulated: the replay is said to be {said}, but the plan's target is "
                        f"{'a simulated cluster' if simulated else 'real hardware'}")
    times, speedup, interval = validated.get("iteration_ms", {}), validated.get("speedup"), validated.get("interval")
    ratios = validated.get("ratios") or []
    if ratios and len(ratios) != validated.get("repeats", len(ratios)):
        raise UserError(f"{path}.validated.ratios: {len(ratios)} ratios for {validated['repeats']} repeats")
    # by hand, not comparison.ratio_interval: that imports numpy, and a plan loads in every rank without it
    geometric_mean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    if geometric_mean is not None and speedup is not None and abs(geometric_mean / speedup - 1) > ROUNDING_RATIO:
        raise UserError(f"{path}.validated.speedup: {speedup}, but the geometric mean of its rounds' ratios is {geometric_mean:.4f}")
    if speedup is not None and interval is not None:  # the geometric mean of the rounds' ratios lies in its interval
        if not interval[0] - ROUNDING_RATIO * speedup <= speedup <= interval[1] + ROUNDING_RATIO * speedup:
            raise UserError(f"{path}.validated.speedup: {speedup}, outside its interval {interval[0]}-{interval[1]}")
    elif speedup is not None and times.get("default") and times.get("plan"):
        # one round, or a plan written before 2026-12-07 (the ratio of the medians): the times' ratio
        ratio = times["default"] / times["plan"]
        if abs(speedup - ratio) > ROUNDING_RATIO * max(1.0, ratio):
            raise UserError(f"{path}.validated.speedup: {speedup}, but its replay times give "
                            f"{times['default']} / {times['plan']} = {ratio:.4f}")


def _ordered_pair(pair: Any, path: str, expected: str, least: float, most: float) -> None:
    """Refuse (UserError, naming ``path`` and ``expected``) anything but two numbers, least <= first <= second <= most."""
    ok = isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair)
    if not ok or not least <= pair[0] <= pair[1] <= most:  # NaN fails every comparison; a 400-digit int compares exactly
        raise UserError(f"{path}: expected {expected}, from {least:g} to {most:g}, got {_short(pair)}")


def _short(value: Any) -> str:
    """``value`` for a message, cut short (a 400-digit number filled the terminal)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _times_record(d: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The plan's ``predicted`` or ``validated`` section: iteration times by settings (ms), and the
    numbers beside them, checked as ``show`` reads them (a field other than ``allowed``, a
    misspelt ``intreval``, is refused rather than dropped)."""
    d = v.known_keys(v.mapping(d, path), allowed, path)
    v.field(d, "bound_ms", path, float, None, minimum=0.0, maximum=MAX_ITERATION_MS)
    # a speed-up is a ratio of two iteration times (each within 1e-9 .. MAX_ITERATION_MS ms); 0x was shown as "slower"
    v.field(d, "speedup", path, float, None, minimum=v.POSITIVE, maximum=MAX_SPEEDUP)
    v.field(d, "simulated", path, bool, False)
    v.field(d, "same_settings", path, bool, False)  # validated: both replays ran the defaults
    v.field(d, "method", path, str, "")  # validated: how the replays were measured
    v.field(d, "repeats", path, int, None, minimum=1)
    if d.get("interval") is not None:  # validated: the speedup's interval (comparison.ratio_interval)
        _ordered_pair(d["interval"], f"{path}.interval", "[low, high] speed-ups", v.POSITIVE, MAX_SPEEDUP)
    for i, ratio in enumerate(v.seq(v.field(d, "ratios", path, list, []), f"{path}.ratios")):  # validated: per round
        v.field({i: ratio}, i, f"{path}.ratios", float, minimum=v.POSITIVE, maximum=MAX_SPEEDUP)
    for name, spread in v.mapping(v.field(d, "spread_ms", path, dict, {}), f"{path}.spread_ms").items():
        _ordered_pair(spread, f"{path}.spread_ms.{name}", "[least, most] ms", 0.0, MAX_ITERATION_MS)
    if "iteration_ms" not in d:  # a plan written in code may have no predictions: loaded as it was saved
        return d
    # an iteration of no time (0) was shown as the plan's, below its own contention-free bound
    times = v.number_map(v.field(d, "iteration_ms", path, dict, {}), f"{path}.iteration_ms", minimum=v.POSITIVE, maximum=MAX_ITERATION_MS)
    missing = next((k for k in ("default", "plan") if k not in times), None)
    if missing:  # search writes both; `null` was refused while a deleted line was read as no prediction
        raise UserError(f"{path}.iteration_ms.{missing}: required field is missing (the {missing} settings' time)")
    return {**d, "iteration_ms": times}


def nodes_of(world_size: int, nodes: int, ranks: int | None, rank_sets: tuple[tuple[int, ...], ...] = ()) -> int | None:
    """The most nodes one communicator spans, where a plan says: its rank sets, else 1 on a one-node
    plan and every node for the world's communicator; None where only its size is known (a group
    of 2 in a tp8-dp2 job spans two nodes while a group of 8 stays in one).

    Args:
        world_size: the plan's ranks.
        nodes: the plan's nodes.
        ranks: the communicator's size, or None when unknown.
        rank_sets: its role's groups' global ranks (``target.group_ranks``), when the plan gives them.
    Returns:
        Nodes, or None.
    """
    if rank_sets:
        return max(len({r // (world_size // nodes) for r in ranks_}) for ranks_ in rank_sets)
    if nodes == 1 or ranks == world_size:
        return nodes
    return None


def _group_ranks(target: dict[str, Any], groups: dict[str, int], world_size: int, path: str
                 ) -> dict[str, tuple[tuple[int, ...], ...]]:
    """``target.group_ranks``: per role, its groups' global rank sets (each of the role's size,
    distinct ranks below the world size, no rank in two of them), validated; {} when absent."""
    raw = v.mapping(v.field(target, "group_ranks", path, dict, {}), f"{path}.group_ranks")
    out = {}
    for role, sets in raw.items():
        where = f"{path}.group_ranks.{role}"
        if role not in groups:
            raise UserError(f"{where}: no role {role!r} in {path}.groups")
        if not isinstance(sets, list) or not sets:
            raise UserError(f"{where}: expected a list of rank lists, e.g. [[0, 1], [2, 3]]")
        parsed, seen = [], {}
        for i, ranks in enumerate(sets):
            ok = isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
            if not ok or len(set(ranks)) != len(ranks) or any(r < 0 or r >= world_size for r in ranks):
                raise UserError(f"{where}[{i}]: expected distinct ranks from 0 to {world_size - 1}, got {ranks!r}")
            if len(ranks) != groups[role]:
                raise UserError(f"{where}[{i}]: {len(ranks)} ranks, but role {role} has {groups[role]}")
            twice = next((r for r in ranks if r in seen), None)
            if twice is not None:  # a rank joins one group of each role (one per mesh dimension)
                raise UserError(f"{where}[{i}]: rank {twice} is in {where}[{seen[twice]}] too; a role's groups are disjoint")
            seen.update((r, i) for r in ranks)
            parsed.append(tuple(sorted(ranks)))
        out[str(role)] = tuple(parsed)
    return out


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file.

    Args:
        path: the plan YAML.
    Returns:
        The Plan.
    Raises:
        UserError: naming the field, for anything the plan format does not allow.
    """
    return Plan.from_dict(read_yaml(path, "plan file"), str(path))
