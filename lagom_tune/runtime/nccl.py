"""What the shim deploys for NCCL: a tuner-plugin CSV, per-communicator Options, environment checks.

All of it is pure logic over the plan, so it is tested on CPU with fakes of the torch classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lagom_tune.plan.schema import Plan

# NCCL tuner plugin names (ext-tuner example CSV): collective, algorithm, protocol.
TUNER_COLL = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
              "broadcast": "broadcast", "all_to_all": "alltoall"}
TUNER_HEADER = "# collective,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks"
OVERRIDING_ENV = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")


def tuner_csv(plan: Plan) -> str:
    """The plan's per-collective rules as an NCCL tuner-plugin CSV (``NCCL_TUNER_CONFIG_FILE``)."""
    groups = plan.groups
    lines = [TUNER_HEADER]
    for r in plan.rules:
        if r.op not in TUNER_COLL:
            continue
        ranks = groups.get(r.group, -1)
        nodes = max(1, ranks // 8) if ranks > 0 else -1
        lines.append(",".join(str(x) for x in (
            TUNER_COLL[r.op], r.min_bytes, r.max_bytes, r.set.get("algo", -1), r.set.get("proto", -1),
            r.set.get("channels", -1), nodes, ranks)))
    return "\n".join(lines) + "\n"


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
