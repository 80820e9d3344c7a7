"""Turn a search outcome into a plan, with predictions and provenance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lagom_tune.plan.schema import CollectiveRule, Plan
from lagom_tune.search.run import SearchOutcome
from lagom_tune.workload.spec import Workload


def collective_rules(workload: Workload, outcome: SearchOutcome) -> tuple[CollectiveRule, ...]:
    """One exact-size rule per collective that carries collective-scope settings."""
    rules = {}
    for c in workload.collectives():
        s = outcome.chosen.settings.collectives.get(c.rule_key)
        if s:
            rules[c.rule_key] = CollectiveRule(c.op, c.group, c.nbytes, c.nbytes, dict(s))
    return tuple(rules.values())


def build_plan(workload: Workload, run_dir: Path, meta: dict[str, Any], accuracy: dict[str, Any], family: str,
               outcome: SearchOutcome) -> Plan:
    fp = meta["fingerprint"]
    chosen = outcome.chosen
    hardware = {k: fp[k] for k in ("device", "cores", "gpu", "sms", "cluster") if k in fp}
    return Plan(
        backend=fp["backend"],
        simulated=bool(meta.get("simulated", False)),
        world_size=int(fp.get("ranks", workload.world_size)),
        nodes=int(fp.get("nodes", 1)),
        hardware=hardware,
        groups={c.group: c.ranks for c in workload.collectives()},
        settings=chosen.settings,
        rules=collective_rules(workload, outcome),
        workload={"name": workload.name, "digest": workload.digest},
        model={"run": str(run_dir), "family": family, "mape": accuracy.get("mape", {})},
        search={"optimizer": chosen.optimizer, "evaluations": chosen.evaluations, "seconds": round(chosen.seconds, 4),
                **({"kept_default": chosen.extra["kept_default"]} if "kept_default" in chosen.extra else {}),
                **({"pareto": chosen.extra["pareto"]} if "pareto" in chosen.extra else {})},
        predicted={
            "iteration_ms": {
                "default": round(outcome.default.evaluation.iteration_s * 1e3, 3),
                "autoccl": round(outcome.autoccl.evaluation.iteration_s * 1e3, 3),
                "plan": round(chosen.evaluation.iteration_s * 1e3, 3),
            },
            "bound_ms": round(outcome.bound_s * 1e3, 3),
            "simulated": bool(meta.get("simulated", False)),
        },
    )


@dataclass(frozen=True)
class SearchInputs:
    """What a search reads from a profiled run folder, and nothing else."""

    run_dir: Path
    meta: dict[str, Any]
    workload: Workload
    model: Any  # CostModel
    accuracy: dict[str, Any]
    space: Any  # KnobSpace

    @property
    def simulated(self) -> bool:
        return bool(self.meta.get("simulated", False))


def load_search_inputs(run_dir: str | Path) -> SearchInputs:
    from lagom_tune.errors import UserError
    from lagom_tune.model.contention import load_model
    from lagom_tune.plan.schema import knob_space_for
    from lagom_tune.profile.store import open_run

    run = open_run(run_dir)
    meta = run.read_meta()
    if not run.model_path.is_file():
        raise UserError(f"{run.path} has no model.yaml: the profile did not finish; rerun `lagom-tune profile` to resume")
    model, accuracy = load_model(run.model_path)
    fp = meta["fingerprint"]
    if fp.get("standin"):
        raise UserError(f"{run.path} was measured by the CPU stand-in for GPUs (a test of the nccl backend's plumbing): "
                        "it is no basis for a plan")
    if fp.get("mode") == "single-gpu-probe":
        raise UserError(f"{run.path} is a single-GPU profile (GEMMs beside the contention probe): it fits the compute side "
                        "only; profile with torchrun on the GPUs the job uses to search for NCCL settings")
    return SearchInputs(run.path, meta, run.workload(), model, accuracy, knob_space_for(fp["backend"], fp))


def plan_from_run(run_dir: str | Path, optimizer: str, validate_repeats: int = 0, **options: Any) -> tuple[Plan, SearchOutcome]:
    """Read a profiled run folder (workload, fingerprint, fitted model) and search it."""
    from lagom_tune.search.run import search

    inputs = load_search_inputs(run_dir)
    workload, meta = inputs.workload, inputs.meta
    outcome = search(workload, inputs.model, inputs.space, optimizer, **options)
    plan = build_plan(workload, inputs.run_dir, meta, inputs.accuracy, inputs.model.family, outcome)
    if validate_repeats:
        from dataclasses import replace

        from lagom_tune.plan.validate import validate

        measured = validate(workload, meta["fingerprint"], {"default": outcome.default.settings, "plan": outcome.chosen.settings},
                            validate_repeats)
        plan = replace(plan, validated=measured)
    return plan, outcome
