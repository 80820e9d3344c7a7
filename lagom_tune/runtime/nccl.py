"""What `apply` deploys for NCCL: tuner-plugin rules, per-communicator Options, environment checks.

All of it is pure logic over the plan, so it is tested on CPU with fakes of the torch classes.
The plugin itself is ``lagom_tuner.c`` beside this file (built by ``tuner_build.py``); the rules
file format below is the one its parser reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lagom_tune.plan.schema import CollectiveRule, Plan

# Plan op -> NCCL's collective name (as NCCL_ALGO's per-op syntax and the plugin's rules spell it).
TUNER_COLL = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
              "broadcast": "broadcast", "all_to_all": "alltoall"}
# NCCL runs all-to-all as grouped send/recv, which its tuner is never asked about.
NOT_TUNABLE = {"all_to_all": "NCCL runs all-to-all as send/recv, which no tuner plugin sees"}
OVERRIDING_ENV = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")

# The contract with lagom_tuner.c: keep these in step with its RULES_ENV, RULES_MAGIC and PLUGIN_NAME.
RULES_ENV = "LAGOM_TUNE_TUNER_RULES"
RULES_HEADER = "lagom-tune-tuner-rules 1"
PLUGIN_NAME = "lagom-tune"
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
    if plan.nodes == 1:
        return 1
    if ranks is not None and ranks == plan.world_size:
        return plan.nodes
    return None


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


@dataclass(frozen=True)
class CommunicatorConfig:
    role: str
    ranks: int
    min_ctas: int
    max_ctas: int


def communicator_configs(plan: Plan) -> dict[str, CommunicatorConfig]:
    """CTA bounds per communicator role, derived from its rules' channels so NCCL's own channel
    choice can never fall outside what the tuner asks for."""
    out = {}
    for role, ranks in plan.groups.items():
        channels = [int(r.set["channels"]) for r in plan.rules if r.group == role and "channels" in r.set]
        if channels:
            out[role] = CommunicatorConfig(role, int(ranks), min(channels), max(channels))
    return out


def role_for(configs: Mapping[str, CommunicatorConfig], group_size: int) -> CommunicatorConfig | None:
    """The role a process group plays, matched by its size; None when no role or several match."""
    matches = [c for c in configs.values() if c.ranks == group_size]
    return matches[0] if len(matches) == 1 else None


def build_options(options_cls: Any, cfg: CommunicatorConfig, existing: Any = None) -> Any:
    """A ``ProcessGroupNCCL.Options`` with the role's CTA bounds (on the user's own, if given)."""
    opts = existing if existing is not None else options_cls()
    opts.config.min_ctas = cfg.min_ctas
    opts.config.max_ctas = cfg.max_ctas
    return opts


def overriding_env(env: Mapping[str, str]) -> list[str]:
    """Environment variables that silently override every communicator's own CTA config."""
    return [k for k in OVERRIDING_ENV if env.get(k)]
