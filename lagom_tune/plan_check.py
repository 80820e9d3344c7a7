"""A plan's recorded predictions against what its run's model gives its settings now.

`search` writes the default's and the plan's predicted iteration times into the plan. A model
refitted since (a new profile in the same folder) or a plan edited by hand makes them stale;
`report` refuses such a plan and `show` says so beside them. Like ``planning``, this composes
the layers below it (profile, model, search, plan), without the optimizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagom_tune.errors import UserError
from lagom_tune.model.contention import load_model
from lagom_tune.plan.schema import Plan, knob_space_for
from lagom_tune.precision import ROUNDING_REL, ms_text
from lagom_tune.profile.store import RunFolder, open_run
from lagom_tune.search.evaluate import Evaluation, ModelEvaluator
from lagom_tune.search.space import default_settings, variables

STALE_REASON = "the model was refitted or the plan edited since `lagom-tune search` wrote it"


def plan_run_folder(plan: Plan, path: Path) -> Path:
    """The run folder a plan was searched from: as the plan records it (relative to where search
    ran), else the same path from the plan's folder, else the plan's own folder (where README's
    layout puts it); the first that holds the plan's workload (a folder of the same name here may
    hold another profile).

    Args:
        plan: the plan.
        path: the plan's file.
    Returns:
        The run folder.
    Raises:
        UserError: none of them holds the plan's profile (the message says which was found).
    """
    recorded = Path(plan.model.get("run", ""))
    digest = plan.workload.get("digest")
    other = None
    for candidate in (recorded, path.parent / recorded, path.parent):
        if not _holds_run(candidate):
            continue
        if digest is None or open_run(candidate).workload().digest == digest:  # a plan written in code records none
            return candidate
        other = other or candidate
    if other is not None:
        raise UserError(f"{path}: {other} holds another workload than the plan's (digest {digest}): not the profile "
                        "the plan was searched from")
    if not plan.model.get("run"):
        raise UserError(f"{path}: the plan names no run folder (model.run) and none is beside it")
    raise UserError(f"{path}: its run folder {recorded} is not here (nor beside the plan)")


def _holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run's ``meta.yaml`` (a path the file system cannot even look up,
    a name over 255 bytes, holds none: ``show`` stopped on the OSError)."""
    try:
        return (folder / "meta.yaml").is_file()
    except OSError:
        return False


@dataclass(frozen=True)
class PlanPredictions:
    """The default's and the plan's evaluations as the run's model gives them now, and the
    recorded iteration times (ms) that differ from them: name -> (recorded, now)."""

    default: Evaluation
    plan: Evaluation
    drift: dict[str, tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The recheck for ``show --json``: the iteration times the model gives now and the
        recorded ones that differ (``held`` false where any does)."""
        return {"rechecked": True, "held": not self.drift,
                "iteration_ms_now": {"default": self.default.iteration_s * 1e3, "plan": self.plan.iteration_s * 1e3},
                "drift": {name: {"recorded_ms": was, "now_ms": now} for name, (was, now) in self.drift.items()}}

    @staticmethod
    def record(check: "PlanPredictions | str") -> dict[str, Any]:
        """A recheck (:meth:`to_dict`) or why there is none (``rechecked`` false, ``why``), for ``show --json``."""
        return check.to_dict() if isinstance(check, PlanPredictions) else {"rechecked": False, "why": check}

    def drift_text(self) -> str:
        """The differing predictions in one phrase (empty when none differ)."""
        return ", ".join(f"{name} {ms_text(was)} ms, now {ms_text(now)} ms" for name, (was, now) in self.drift.items())


def predict_plan(plan: Plan, run: RunFolder) -> PlanPredictions:
    """Re-predict a plan's default and chosen settings with its run's model.

    Args:
        plan: the plan.
        run: the run folder it was searched from (``plan_run_folder``).
    Returns:
        The evaluations, and the recorded predictions they contradict.
    Raises:
        UserError: the run's model cannot be read (missing, garbled, or stale for its measurements).
    """
    meta = run.read_meta()
    profiled_on = meta["fingerprint"]["backend"]
    if profiled_on != plan.backend:  # an edited plan; its knobs then failed the model's own check, in its words
        raise UserError(f"the plan is for the {plan.backend} backend, but its run folder {run.path} was profiled on {profiled_on} "
                        "(edited?)")
    model, _ = load_model(run.model_path, run.fitted_as(meta))
    workload = run.workload()
    vars_ = variables(workload, knob_space_for(plan.backend, meta.get("fingerprint", {})), plan.backend_choices(workload))
    default = default_settings(vars_)
    evaluate = ModelEvaluator(workload, model)
    d, p = evaluate(default), evaluate(plan.modelled_settings(workload, default))
    recorded = plan.predicted.get("iteration_ms", {})
    now = {"default": d.iteration_s * 1e3, "plan": p.iteration_s * 1e3}
    drift = {name: (recorded[name], ms) for name, ms in now.items()
             if name in recorded and not math.isclose(recorded[name], ms, rel_tol=ROUNDING_REL)}
    return PlanPredictions(d, p, drift)
