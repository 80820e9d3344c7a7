"""What `apply` deploys for NCCL: tuner-plugin rules, per-communicator CTA bounds, communicator roles.

All of it is pure logic over the plan, tested on CPU with fakes of the torch classes. The plugin
itself is ``backends/lagom_tuner.c`` (built by ``backends/tuner_build.py``, its counts read by
``backends/nccl_tuner.py``); the rules file format below is the one its parser reads.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from lagom_tune.backends.nccl_controls import TUNER_COLL, CommunicatorConfig
from lagom_tune.backends.nccl_knobs import channels_for_call
from lagom_tune.backends.nccl_log import NcclCall
from lagom_tune.backends.nccl_tuner import PLUGIN_NAME, NcclChoice, TunerCounts
from lagom_tune.plan.schema import CollectiveRule, Plan, nodes_of

# NCCL runs all-to-all as grouped send/recv, which its tuner is never asked about.
NOT_TUNABLE = {"all_to_all": "NCCL runs all-to-all as send/recv, which no tuner plugin sees"}

# The rules file's first line (lagom_tuner.c's RULES_MAGIC and RULES_VERSION) and its "any" field.
RULES_HEADER = "lagom-tune-tuner-rules 1"
ANY = "*"


@dataclass(frozen=True)
class TunerRule:
    """One line of the plugin's rules file: which calls it matches and what it sets.

    ``n_ranks``/``n_nodes`` are None when the rule holds for any communicator size; ``algo``,
    ``proto`` and ``channels`` are None when NCCL keeps its own choice.
    """

    op: str
    role: str
    n_ranks: int | None
    n_nodes: int | None
    min_bytes: int
    max_bytes: int
    algo: str | None
    proto: str | None
    channels: int | None

    def line(self) -> str:
        """The rule as the plugin reads it (eight blank-separated fields)."""
        def field(x: Any) -> str:
            return ANY if x is None else str(x)

        return " ".join(field(x) for x in (TUNER_COLL[self.op], self.n_ranks, self.n_nodes, self.min_bytes,
                                           self.max_bytes, self.algo, self.proto, self.channels))


@dataclass(frozen=True)
class TunerRules:
    """A plan's collective rules split into what the plugin deploys and what it cannot."""

    rules: tuple[TunerRule, ...]
    not_deployable: tuple[tuple[CollectiveRule, str], ...]  # (rule, why)

    def text(self) -> str:
        """The rules file ``apply`` writes (``RULES_ENV`` names it for the plugin)."""
        lines = [f"# written by lagom-tune apply; read by its NCCL tuner plugin ({PLUGIN_NAME})",
                 "# coll nRanks nNodes minBytes maxBytes algo proto channels   (* = any / NCCL's choice)",
                 RULES_HEADER]
        return "\n".join(lines + [r.line() for r in self.rules]) + "\n"


def rule_reach(rules: TunerRules, counts: TunerCounts) -> list[tuple[str, str, bool, str]]:
    """What reached NCCL in a process, as records: one for the rules as a whole, one more for each
    rule that no call matched or whose algorithm or protocol NCCL did not offer.

    Args:
        rules: the plan's tuner rules (the file the plugin read).
        counts: the plugin's counts in this process.
    Returns:
        (setting, value, applied, how) tuples, for ``Shim.record``.
    """
    problems = []
    for rule, applied, skipped in zip(rules.rules, counts.applied, counts.skipped):
        value = " ".join(str(x) for x in (rule.algo or "*", rule.proto or "*", rule.channels or "*"))
        setting = f"rule[{rule.op} {rule.role} {rule.min_bytes}..{rule.max_bytes} B]"
        if not applied and not skipped:
            problems.append((setting, value, False, "no NCCL call matched it in this process (no collective of that op and size "
                        "on that communicator asked NCCL's tuner: another workload than the plan's, or a role this rank is not in)"
                        + tuner_sizes_seen(rule, counts.nccl_choices)))
        elif skipped:
            problems.append((setting, value, False, f"algorithm/protocol skipped on {skipped} of {applied + skipped} calls: NCCL did not "
                        "offer it for them (channels still set)"))
    total, reached = sum(counts.applied) + sum(counts.skipped), sum(counts.applied)
    left = sum(counts.unmatched.values())
    return [("collective_rules_reached", f"{reached} of {total} matched calls", bool(total) and not problems,
             f"NCCL's tuner calls in this process: {total} matched a rule, {reached} got all of it; "
             f"{left} matched none (NCCL's own choice)"), *problems]


# A gradient reduction NCCL is called with at another size than the rule's by this factor is the
# same reduction in another dtype (bf16 profiled, fp32 reduced: torchtitan's FSDP2 default).
DTYPE_RATIOS = (2, 4)
GRADIENT_REDUCTIONS = ("reduce_scatter", "all_reduce")
SIZES_SHOWN = 3  # a DDP job all-reduces dozens of sizes: the nearest to the rule's


def tuner_sizes_seen(rule: TunerRule, choices: tuple[NcclChoice, ...]) -> str:
    """:func:`sizes_seen` from NCCL's own choices in a process (one per size bucket), or '' when
    NCCL handed the plugin no cost tables (then nothing was counted)."""
    if not choices:
        return ""
    sizes: Counter[tuple[int, int]] = Counter()
    for c in choices:
        if c.op == rule.op:
            sizes[c.min_bytes, c.max_bytes] += c.calls
    return sizes_seen(rule, sizes, "NCCL's tuner saw")


def sizes_seen(rule: TunerRule, sizes: Mapping[tuple[int, int], int], who: str) -> str:
    """For a rule no call matched: the sizes of the rule's op NCCL was called with (the nearest
    few), and, where one is the rule's size in another dtype, the likely cause.

    Args:
        rule: the rule no call matched.
        sizes: (smallest, largest) bytes -> calls, of every call of the rule's op, counted as the
            rule counts them (a size bucket of the tuner's, or one logged size twice).
        who: what saw them ("NCCL's tuner saw", "NCCL's log has").
    Returns:
        A clause to append to the explanation.
    """
    if not sizes:
        return f"; {who} no {rule.op} call at all"
    middle = math.sqrt(max(rule.min_bytes, 1) * max(rule.max_bytes, 1))
    nearest = sorted(sizes, key=lambda r: abs(math.log(max(r[0] + r[1], 2) / 2 / middle)))[:SIZES_SHOWN]
    seen = ", ".join((f"{lo}..{hi}" if lo != hi else str(lo)) + f" B x{sizes[lo, hi]}" for lo, hi in sorted(nearest))
    more = f" (+{len(sizes) - len(nearest)} other sizes)" if len(sizes) > len(nearest) else ""
    scales = [*DTYPE_RATIOS, *(1 / r for r in DTYPE_RATIOS)]
    other_dtype = rule.op in GRADIENT_REDUCTIONS and any(
        lo <= rule.max_bytes * f and rule.min_bytes * f <= hi for lo, hi in sizes for f in scales)
    hint = (": one is the rule's size in another dtype, as when a job reduces its gradients in fp32 (torchtitan) and was "
            "profiled in bf16; profile with the job's --reduce-dtype") if other_dtype else ""
    return f"; {who} {rule.op} calls of {seen}{more}{hint}"


def assumed_default(plan: Plan, choice: NcclChoice) -> tuple[str, str] | None:
    """The algorithm and protocol the plan's predictions assume NCCL runs the calls of ``choice``
    with when nothing is set: what its profile saw NCCL choose for a collective of that op and size
    (``backend_defaults``), else its knob space's defaults for the op and span.

    Args:
        plan: the plan.
        choice: NCCL's own choice for some calls (their op, size bucket and span).
    Returns:
        (algorithm, protocol), or None where the plan assumes several for that op and size bucket
        (collectives of several roles in one bucket) or models no default (reduce).
    """
    seen = {(r.set["algo"], r.set["proto"]) for r in plan.backend_defaults
            if r.op == choice.op and choice.min_bytes <= r.min_bytes <= choice.max_bytes and {"algo", "proto"} <= set(r.set)}
    if seen:
        return seen.pop() if len(seen) == 1 else None
    if choice.op not in TUNER_COLL:  # not reduce: no workload of ours has one
        return None
    d = plan.space.defaults(choice.op, 2 if choice.across_nodes else 1)
    return d["algo"], d["proto"]


def defaults_record(plan: Plan, choices: tuple[NcclChoice, ...]) -> tuple[str, Any, bool, str] | None:
    """NCCL's own choices in a process held against the algorithm and protocol the plan's
    predictions of NCCL's defaults assume (:func:`assumed_default`), as a record: where they
    differ, the predicted speed-up over the defaults, and the prediction for calls no rule
    matches, rest on another algorithm or protocol than NCCL runs.

    Args:
        plan: the plan.
        choices: NCCL's own choices (``TunerCounts.nccl_choices``).
    Returns:
        (setting, value, held, how), or None where NCCL handed the plugin no cost table.
    """
    if not choices:
        return None
    differ = []
    for c in choices:
        assumed = assumed_default(plan, c)
        if assumed is not None and assumed != (c.algo, c.proto):
            differ.append(f"{c.describe()}, modelled {'/'.join(assumed)}")
    how = (f"NCCL's own choice (the cheapest entry of the cost table it handed the tuner, before any rule) for each of "
           f"{sum(c.calls for c in choices)} calls")
    how += (f": it differs from what the plan's predictions of NCCL's defaults assume for {'; '.join(differ)}. The predicted "
            "speed-up over the defaults, and the prediction for calls no rule matches, rest on another algorithm/protocol "
            "than NCCL runs there; `lagom-tune trial` measures the real one") if differ else \
        " is the algorithm/protocol the plan's predictions of NCCL's defaults assume (channels not compared)"
    return "nccl_defaults_as_modelled", [c.describe() for c in choices], not differ, how


def communicator_nodes(plan: Plan, ranks: int | None) -> int | None:
    """The nodes a communicator of ``ranks`` spans, where the plan says so unambiguously.

    Args:
        plan: the plan (its world size and node count).
        ranks: the communicator's size, or None when unknown.
    Returns:
        1 on a one-node plan, the plan's node count for the world communicator, else None: a
        group of 2 in a tp8-dp2 job spans two nodes while a group of 8 stays in one, and the plan
        does not record the layout, so the rule then matches on nRanks alone.
    """
    return nodes_of(plan.world_size, plan.nodes, ranks)


def tuner_rules(plan: Plan) -> TunerRules:
    """The plan's per-collective rules as the plugin's rules, in the plan's order (first match wins).

    Args:
        plan: any plan; rules of ops NCCL's tuner never sees are returned as not deployable.
    Returns:
        The deployable rules and, for the others, the reason.
    """
    rules, skipped = [], []
    for r in plan.rules:
        if r.op in NOT_TUNABLE or r.op not in TUNER_COLL:
            skipped.append((r, NOT_TUNABLE.get(r.op, f"unknown collective {r.op}")))
            continue
        ranks = plan.groups.get(r.group)  # "*" or an unnamed role: any communicator
        rules.append(TunerRule(
            op=r.op, role=r.group, n_ranks=ranks, n_nodes=communicator_nodes(plan, ranks),
            min_bytes=int(r.min_bytes), max_bytes=int(r.max_bytes), algo=r.set.get("algo"), proto=r.set.get("proto"),
            channels=int(r.set["channels"]) if r.set.get("channels") is not None else None))
    return TunerRules(tuple(rules), tuple(skipped))


# The DeviceMesh dimension names torchtitan uses (and the flattened dimensions it builds). A role
# named so is identified by the mesh dimension that made its groups, so two such roles may share a
# size; any other role must be told apart by its size or by rank sets the plan gives.
MESH_DIM_NAMES = frozenset({"pp", "dp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "dp_shard_cp", "dp_cp",
                            "dp_shard_mod_ep", "dp_shard_in_ep", "efsdp"})


@dataclass(frozen=True)
class Role:
    """A communicator role of the plan: its name, its size, and the exact rank sets it names (if any)."""

    name: str
    size: int
    rank_sets: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class GroupIdentity:
    """What identifies a process group when it is made: its global ranks (sorted) and, when a
    DeviceMesh made it, the mesh dimension's name."""

    ranks: tuple[int, ...]
    mesh_dim: str | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class RoleMatch:
    """The role a group plays (None when no role or several match) and what identified it."""

    role: str | None
    by: str = ""  # "mesh dim", "rank set", "size" or "" (no match)
    ambiguous: tuple[str, ...] = ()  # the roles that matched equally well, when more than one did
    reason: str = ""  # why a group that names a role is still not given it

    def describe(self, group: GroupIdentity) -> str:
        """One line on the match, for the per-rank log."""
        if self.role is not None:
            return f"role {self.role} (by {self.by})"
        if self.reason:
            return f"no role: {self.reason}"
        if self.ambiguous:
            return (f"no role: {', '.join(self.ambiguous)} all match a group of {group.size} ranks "
                    f"{list(group.ranks)} that no mesh dimension or rank set names")
        return f"no role (no plan role has {group.size} ranks)"


def plan_roles(plan: Plan) -> tuple[Role, ...]:
    """The plan's communicator roles, with the rank sets it gives for them.

    Args:
        plan: any plan (``groups`` gives each role's size, ``group_ranks`` optional rank sets).
    Returns:
        One Role per entry of ``plan.groups``, in the plan's order.
    """
    sets = getattr(plan, "group_ranks", {}) or {}
    return tuple(Role(name, int(size), tuple(tuple(sorted(s)) for s in sets.get(name, ()))) for name, size in plan.groups.items())


def match_role(roles: tuple[Role, ...], group: GroupIdentity) -> RoleMatch:
    """The role a process group plays: by its mesh dimension's name, else its exact rank set, else
    its size when one role alone has it.

    Args:
        roles: the plan's roles (``plan_roles``).
        group: the group's ranks and mesh dimension.
    Returns:
        The match; ``ambiguous`` names the roles when several fit at the deciding step.
    """
    if group.mesh_dim is not None:
        for r in roles:
            if r.name == group.mesh_dim:
                if r.size == group.size:
                    return RoleMatch(r.name, "mesh dim")
                # The dimension is the role's, but not of the layout the plan was made for: its
                # settings were chosen for another size, and no other role is this dimension's.
                return RoleMatch(None, reason=f"mesh dim {r.name} has {group.size} ranks, the plan's role {r.name} "
                                              f"has {r.size} (another layout than the plan's)")
    by_set = [r.name for r in roles if group.ranks in r.rank_sets]
    if len(by_set) == 1:
        return RoleMatch(by_set[0], "rank set")
    if by_set:
        return RoleMatch(None, "", tuple(by_set))
    # A role that lists its rank sets is identified by them: a group outside them is not that role.
    by_size = [r.name for r in roles if r.size == group.size and not r.rank_sets]
    if len(by_size) == 1:
        return RoleMatch(by_size[0], "size")
    return RoleMatch(None, "", tuple(by_size) if by_size else ())


def ambiguous_roles(plan: Plan) -> list[tuple[str, ...]]:
    """Sets of roles the runtime could not tell apart, whatever the training script does.

    A role is told apart by a mesh dimension's name (a name in ``MESH_DIM_NAMES``), by the rank sets
    the plan gives for it, or by its size; two roles of one size without rank sets are ambiguous
    unless both are named for mesh dimensions, and so are two roles that list the same rank set.

    Args:
        plan: any plan.
    Returns:
        Each ambiguous set of role names (sorted); empty when every role can be identified.
    """
    roles = plan_roles(plan)
    out: list[tuple[str, ...]] = []
    by_size: dict[int, list[Role]] = {}
    for r in roles:
        if not r.rank_sets:
            by_size.setdefault(r.size, []).append(r)
    for same in by_size.values():
        if len(same) > 1 and any(r.name not in MESH_DIM_NAMES for r in same):
            out.append(tuple(sorted(r.name for r in same)))
    owners: dict[tuple[int, ...], list[str]] = {}
    for r in roles:
        for s in r.rank_sets:
            owners.setdefault(s, []).append(r.name)
    out += [tuple(sorted(set(names))) for names in owners.values() if len(set(names)) > 1]
    return list(dict.fromkeys(out))


def communicator_configs(plan: Plan, per_call: bool = False) -> dict[str, CommunicatorConfig]:
    """CTA bounds per communicator role, derived from its rules' channels.

    NCCL sets a communicator up with ``max(min(its topology's channels, max_ctas), min_ctas)``
    channels (``ncclTopoPostset``, src/graph/connect.cc: it duplicates channels up to ``min_ctas``)
    and runs no collective on more than that (``scheduleCollTasksToPlan`` caps a call's channels,
    the tuner's included). So where the tuner plugin sets each call's channels (``per_call``),
    ``min_ctas`` is the role's largest rule: bounds of min..max over its rules would let a
    topology of fewer channels cut the larger rules down, with the plugin still saying it applied
    them. Without the plugin, bounds are all there is: min..max over the role's rules (exact where
    they all ask for one count).

    Args:
        plan: any plan.
        per_call: whether the tuner plugin deploys the plan's rules in this job.
    Returns:
        Role name -> its bounds, for the roles that have a rule setting channels.
    """
    out = {}
    for role, ranks in plan.groups.items():
        channels = [int(r.set["channels"]) for r in plan.rules if r.group == role and "channels" in r.set]
        if channels:
            out[role] = CommunicatorConfig(role, int(ranks), max(channels) if per_call else min(channels), max(channels))
    return out


def role_for(configs: Mapping[str, CommunicatorConfig], group_size: int) -> CommunicatorConfig | None:
    """The configured role a group of ``group_size`` ranks plays, by size alone (what the tuner
    plugin sees inside NCCL); None when no role or several match. The shim identifies groups with
    ``match_role`` instead, which also uses mesh dimensions and rank sets.

    Args:
        configs: CTA bounds by role (``communicator_configs``).
        group_size: the group's ranks.
    Returns:
        The role's bounds, or None.
    """
    matches = [c for c in configs.values() if c.ranks == group_size]
    return matches[0] if len(matches) == 1 else None


PER_RANK_SIZE = ("all_gather", "reduce_scatter")  # NCCL's log counts these per rank; a rule, all ranks' bytes


def rule_bytes(rule: TunerRule, logged: int) -> int:
    """A logged call's size as the rule's byte range counts it (NCCL's nBytes): an all-gather's or
    reduce-scatter's logged bytes are one rank's, times the rule's role size.

    Args:
        rule: the plan rule the call is held against.
        logged: the bytes NCCL's log gives the call.
    Returns:
        The call's bytes as the rule counts them.
    """
    return logged * ((rule.n_ranks or 1) if rule.op in PER_RANK_SIZE else 1)


@dataclass(frozen=True)
class RanCheck:
    """What NCCL's log says it ran the calls of one size a plan rule matches with."""

    rule: TunerRule
    nbytes: int  # as logged (an all-gather's or reduce-scatter's: one rank's)
    algo: str
    proto: str
    channels: int
    calls: int

    @property
    def as_planned(self) -> bool:
        """Whether NCCL ran what the rule sets (the values it leaves to NCCL aside): its channels,
        or fewer for a call too small to give each of them ``MIN_TRAFFIC_PER_CHANNEL``."""
        want = self.rule.channels
        fewest = channels_for_call(self.rule.op, rule_bytes(self.rule, self.nbytes), self.proto, want) if want else 0
        channels_ok = want is None or fewest <= self.channels <= want
        return channels_ok and all(w is None or w == got for w, got in ((self.rule.algo, self.algo), (self.rule.proto, self.proto)))

    def describe(self) -> str:
        """One line: the rule, what NCCL ran calls of this size with, how many."""
        wanted = "/".join(str(x or "any") for x in (self.rule.algo, self.rule.proto)) + \
            (f" on {self.rule.channels} channels" if self.rule.channels else "")
        return (f"{self.rule.op} on {self.rule.role} {self.rule.min_bytes}..{self.rule.max_bytes} B: the plan {wanted}, "
                f"NCCL ran {self.algo}/{self.proto} on {self.channels} channels x{self.calls} ({self.nbytes} B logged)")


@dataclass(frozen=True)
class RanReport:
    """NCCL's log held against a plan's rules (:func:`nccl_ran`)."""

    checks: tuple[RanCheck, ...]  # per (rule, size, what NCCL ran), in rule order
    unmatched: int  # logged calls no rule matched (NCCL's own choice)
    missed: tuple[tuple[TunerRule, str], ...]  # rules no logged call matched, each with the sizes of its op the log has


def nccl_ran(plan: Plan, calls: list[NcclCall]) -> RanReport:
    """What NCCL ran the calls of each of the plan's rules with, from NCCL's own log
    (``backends.nccl_log``: a communicator's rank 0 logs each call under ``NCCL_DEBUG=INFO`` and
    ``NCCL_DEBUG_SUBSYS=TUNING``), matched as the plugin matches them: the first rule of the call's
    op whose byte range holds it (an all-gather's or reduce-scatter's logged bytes are one rank's,
    times the rule's role size). The log does not name the communicator, so a call of one size on
    two roles is held against the first rule.

    Args:
        plan: the plan.
        calls: the logged calls.
    Returns:
        The checks, the calls no rule matched, and the rules no call matched.
    """
    rules = tuner_rules(plan).rules
    seen: Counter[tuple] = Counter()
    unmatched = 0
    for c in calls:
        i = next((i for i, r in enumerate(rules) if r.op == c.op and r.min_bytes <= rule_bytes(r, c.nbytes) <= r.max_bytes), None)
        if i is None:
            unmatched += 1
        else:
            seen[i, c.nbytes, c.algo, c.proto, c.channels] += 1
    matched = {key[0] for key in seen}
    missed = [(r, sizes_seen(r, Counter((rule_bytes(r, c.nbytes),) * 2 for c in calls if c.op == r.op), "NCCL's log has"))
              for i, r in enumerate(rules) if i not in matched]
    return RanReport(tuple(RanCheck(rules[i], *rest, n) for (i, *rest), n in sorted(seen.items())), unmatched, tuple(missed))
