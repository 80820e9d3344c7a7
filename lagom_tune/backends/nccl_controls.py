"""How lagom-tune tells NCCL a setting, the same way when profiling and when deploying a plan.

NCCL's own names for the collectives (``NCCL_ALGO``'s per-op syntax, the tuner plugin's rules),
the per-communicator CTA bounds set through ``ProcessGroupNCCL.Options``, and the environment
variables that would silently override those bounds. The nccl backend's sweep pins a
communicator's channels with them; the runtime (``runtime/nccl.py``) deploys a plan's with them.
Pure logic: tested on CPU with fakes of the torch classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Plan op -> NCCL's collective name (as NCCL_ALGO's per-op syntax and the plugin's rules spell it).
TUNER_COLL = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
              "broadcast": "broadcast", "all_to_all": "alltoall"}
# Set, these override every communicator's own CTA config.
OVERRIDING_ENV = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
# Set, these narrow what NCCL offers its tuner: a rule asking for anything else is skipped.
RESTRICTING_ENV = ("NCCL_ALGO", "NCCL_PROTO")
# A net plugin (aws-ofi-nccl) may ship a tuner, which NCCL takes only when NCCL_TUNER_PLUGIN names none.
NET_PLUGIN_ENV = "NCCL_NET_PLUGIN"


@dataclass(frozen=True)
class CommunicatorConfig:
    """A role's per-communicator NCCL settings: CTA bounds (``ncclConfig_t`` min/max CTAs)."""

    role: str
    ranks: int
    min_ctas: int
    max_ctas: int


def build_options(options_cls: Any, cfg: CommunicatorConfig, existing: Any = None) -> Any:
    """A ``ProcessGroupNCCL.Options`` with the role's CTA bounds (on the user's own, if given).

    Args:
        options_cls: ``ProcessGroupNCCL.Options`` (or a fake of it).
        cfg: the bounds.
        existing: the Options the user passed, updated in place; None for new ones.
    Returns:
        The Options.
    """
    opts = existing if existing is not None else options_cls()
    opts.config.min_ctas = cfg.min_ctas
    opts.config.max_ctas = cfg.max_ctas
    return opts


def overriding_env(env: Mapping[str, str]) -> list[str]:
    """Environment variables that silently override every communicator's own CTA config.

    Args:
        env: an environment (``os.environ``).
    Returns:
        The names of those set in it, in ``OVERRIDING_ENV`` order.
    """
    return [k for k in OVERRIDING_ENV if env.get(k)]
