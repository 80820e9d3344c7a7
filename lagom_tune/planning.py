"""The search verb's workflow, from a profiled run folder to a plan: read the folder, search its
fitted model, write down the chosen settings with predictions and provenance, and (``--validate``)
measure them. It composes the layers (profile, model, search, plan), so it sits above them all,
beside the CLI that calls it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from lagom_tune.comparison import ARMS, order_note
from lagom_tune.errors import UserError
from lagom_tune.knobs import BackendChoices, KnobSpace, Settings
from lagom_tune.model.contention import CostModel, fit_revision_note, load_model, stale_reason
from lagom_tune.plan.schema import (HARDWARE_COUNTS, HARDWARE_NAMES, HARDWARE_OFFERS, MAX_ITERATION_MS, MAX_RULE_BYTES,
                                    SEARCH_OPTIONS, CollectiveRule, Plan, knob_space_for)
from lagom_tune.precision import ms_round, ms_text
from lagom_tune.profile.store import open_run
from lagom_tune.profile.summary import backend_choices
from lagom_tune.search.replay import validate
from lagom_tune.search.run import SearchOutcome, option_names, search
from lagom_tune.search.space import observed_defaults
from lagom_tune.workload.spec import Workload


@dataclass(frozen=True)
class SearchInputs:
    """What a search reads from a profiled run folder, and nothing else."""

    run_dir: Path
    meta: dict[str, Any]
    workload: Workload
    model: CostModel
    accuracy: dict[str, Any]
    space: KnobSpace
    chosen: BackendChoices = BackendChoices()  # what the backend ran the collectives with when nothing was set
    notes: tuple[str, ...] = ()  # what the user should know of the model before trusting the search's figures

    @property
    def simulated(self) -> bool:
        """Whether the folder was profiled on a simulator."""
        return bool(self.meta.get("simulated", False))


def load_search_inputs(run_dir: str | Path) -> SearchInputs:
    """Read a profiled run folder for a search.

    Args:
        run_dir: a run folder whose profile finished, with its ``model.yaml``.
    Returns:
        Its workload, fingerprint, fitted model and accuracy, and the knob space on its machine.
    Raises:
        UserError: for an unfinished profile, a folder without a model, or one no plan can be based on (the nccl
            backend's CPU stand-in, a single-GPU probe profile).
    """
    run = open_run(run_dir)
    meta = run.read_meta()
    df, health = run.read()
    unfinished = run.unfinished(health)
    if unfinished:  # a model fitted to part of a profile (`fit` allows it) is no basis for a plan
        raise UserError(f"{run.path}: {unfinished}; rerun `lagom-tune profile` to resume")
    if not run.model_path.is_file():
        raise UserError(f"{run.path} has no model.yaml: rerun `lagom-tune fit {run.path}`")
    model, accuracy = load_model(run.model_path, run.fitted_as(meta))
    stale = stale_reason(accuracy, df, run.path)
    if stale:
        raise UserError(f"{run.path}: {stale}")
    fp = meta["fingerprint"]
    if fp.get("standin"):
        raise UserError(f"{run.path} was measured by the CPU stand-in for GPUs (a test of the nccl backend's plumbing): "
                        "it is no basis for a plan")
    if fp.get("mode") == "single-gpu-probe":
        raise UserError(f"{run.path} is a single-GPU profile (GEMMs beside the contention probe): it fits the compute side "
                        "only; profile with torchrun on the GPUs the job uses to search for NCCL settings")
    workload = run.workload()
    revision = fit_revision_note(accuracy, run.path)
    return SearchInputs(run.path, meta, workload, model, accuracy, knob_space_for(fp["backend"], fp), backend_choices(df, workload),
                        (revision,) if revision else ())


# A rule matches its collective's size within this share either way: the job's model need not be
# the preset's to the byte (FSDP2 pads each parameter's rows to a multiple of the ranks; a model
# may hold one norm a layer where the preset counts two), while another dtype (x2) or micro-batch
# is another collective. Never past the midpoint to the next size of the op (see size_bands).
SIZE_TOLERANCE = 0.10


def size_bands(sizes: Iterable[int]) -> dict[int, tuple[int, int]]:
    """The byte range a rule for each of ``sizes`` (one op's collectives) matches: within
    ``SIZE_TOLERANCE`` of the size, and short of the geometric midpoint to each neighbouring size,
    so no two bands overlap and each size stays in its own.

    Args:
        sizes: the op's collective sizes, any order, repeats allowed.
    Returns:
        size -> (min_bytes, max_bytes).
    """
    ordered = sorted(set(sizes))
    bands = {}
    for i, n in enumerate(ordered):
        lo, hi = math.ceil(n / (1 + SIZE_TOLERANCE)), math.floor(n * (1 + SIZE_TOLERANCE))
        if i:
            lo = max(lo, math.isqrt(ordered[i - 1] * n) + 1)
        if i + 1 < len(ordered):
            hi = min(hi, math.isqrt(n * ordered[i + 1]))
        bands[n] = (min(lo, n), min(max(hi, n), MAX_RULE_BYTES))
    return bands


def collective_rules(workload: Workload, outcome: SearchOutcome) -> tuple[CollectiveRule, ...]:
    """One rule per collective of each communicator role where the search changed a
    collective-scope setting, matching its size within ``SIZE_TOLERANCE`` (:func:`size_bands`).

    A role whose collectives all stay at the defaults gets no rule, as a plan that keeps every
    default sets nothing: NCCL then makes its own choice for them (NVLS, tree, LL for small sizes),
    which pinning the model's defaults would override. A role with one changed collective keeps a
    rule for each (the role's CTA bounds, ``runtime.nccl.communicator_configs``, come from its
    rules' channels and would hold a collective left to NCCL to the others' channels).

    Args:
        workload: the searched workload.
        outcome: the search's outcome (its chosen settings and the defaults).
    Returns:
        The plan's rules, in the workload's collective order.
    """
    chosen, default = outcome.chosen.settings.collectives, outcome.default.settings.collectives
    changed = {c.group for c in workload.collectives() if chosen.get(c.rule_key) != default.get(c.rule_key)}
    # bands per op over every role: NCCL's tuner tells communicators apart by size only
    bands = {op: size_bands(c.nbytes for c in workload.collectives() if c.op == op) for op in {c.op for c in workload.collectives()}}
    rules = {}
    for c in workload.collectives():
        s = chosen.get(c.rule_key)
        if s and c.group in changed:
            rules[c.rule_key] = CollectiveRule(c.op, c.group, *bands[c.op][c.nbytes], dict(s))
    return tuple(rules.values())


def observed_rules(inputs: SearchInputs) -> tuple[CollectiveRule, ...]:
    """What the search took the backend to run each collective with when nothing is set, where
    the profile saw it (``search.space.observed_defaults``): the plan's ``backend_defaults``, one
    exact-size entry per collective, which `apply` holds NCCL's own choices against.

    Args:
        inputs: what the search read (workload, knob space, observed choices).
    Returns:
        The entries, in the workload's collective order.
    """
    out = {}
    for c in inputs.workload.collectives():
        seen = observed_defaults(inputs.space, inputs.chosen, c)
        if seen:
            out[c.rule_key] = CollectiveRule(c.op, c.group, c.nbytes, c.nbytes, dict(seen))
    return tuple(out.values())


def changed_settings(chosen: Settings, default: Settings) -> Settings:
    """``chosen``'s process and communicator settings where they differ from ``default``'s (its
    collectives' as they are: :func:`collective_rules` leaves out the roles it did not change). A
    knob the search left at the default is left to NCCL, as a plan that keeps every default leaves
    them all: a pinned ``NCCL_NTHREADS=512`` overrides NCCL's own 256 on a ring it rates no faster
    than a PCIe Gen3 link (an audit, 2026-12-04).

    Args:
        chosen: the settings the search chose.
        default: every knob at the backend's default.
    Returns:
        The Settings a plan sets.
    """
    def changed(mine: dict, theirs: dict) -> dict:
        return {k: v for k, v in mine.items() if theirs.get(k) != v}

    communicators = {role: changed(s, default.communicators.get(role, {})) for role, s in chosen.communicators.items()}
    return Settings(changed(chosen.process, default.process), {role: s for role, s in communicators.items() if s},
                    chosen.collectives)


def plan_hardware(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """What a plan records of the machine it was made for: names, counts and what NCCL offered
    there (NVLS, LL128), which ``apply`` checks and its knob values are held to.

    Args:
        fingerprint: the run folder's fingerprint.
    Returns:
        The plan's ``target.hardware``.
    """
    return {k: fingerprint[k] for k in HARDWARE_NAMES + HARDWARE_COUNTS + HARDWARE_OFFERS if k in fingerprint}


def build_plan(inputs: SearchInputs, outcome: SearchOutcome) -> Plan:
    """The plan for a search's outcome: settings, target, predictions and provenance.

    Args:
        inputs: what the search read (workload, fingerprint, model family and accuracy).
        outcome: the chosen settings and the default and AutoCCL baselines.
    Returns:
        The Plan (not validated).
    """
    workload, meta, chosen = inputs.workload, inputs.meta, outcome.chosen
    fp = meta["fingerprint"]
    # A plan that keeps the defaults sets nothing: the search's defaults are the backend's choices
    # as the model knows them (NCCL's: ring, simple, 16 channels), and pinning those would override
    # what the backend really picks (NVLS, tree, more channels), which "the defaults" means.
    keeps_defaults = chosen.settings.key == outcome.default.settings.key
    return Plan(
        backend=fp["backend"],
        simulated=inputs.simulated,
        world_size=int(fp.get("ranks", workload.world_size)),
        nodes=int(fp.get("nodes", 1)),
        hardware=plan_hardware(fp),
        groups={c.group: c.ranks for c in workload.collectives()},
        settings=Settings() if keeps_defaults else changed_settings(chosen.settings, outcome.default.settings),
        rules=() if keeps_defaults else collective_rules(workload, outcome),
        backend_defaults=observed_rules(inputs),
        workload={"name": workload.name, "digest": workload.digest},
        model={"run": str(inputs.run_dir), "family": inputs.model.family, "mape": inputs.accuracy.get("mape", {})},
        search={"optimizer": chosen.optimizer, "evaluations": chosen.evaluations, "seconds": round(chosen.seconds, 4),
                **({k: chosen.extra[k] for k in ("kept_default", "left_to_backend") if k in chosen.extra}),
                **({"pareto": chosen.extra["pareto"]} if "pareto" in chosen.extra else {})},
        predicted={
            "iteration_ms": {
                "default": ms_round(outcome.default.evaluation.iteration_s * 1e3),
                "autoccl": ms_round(outcome.autoccl.evaluation.iteration_s * 1e3),
                "plan": ms_round(chosen.evaluation.iteration_s * 1e3),
            },
            "bound_ms": ms_round(outcome.bound_s * 1e3),
            "simulated": inputs.simulated,
        },
    )


RECORDED_OPTIONS = tuple(SEARCH_OPTIONS)  # into the plan's search record


def _check_recordable(workload: Workload, outcome: SearchOutcome) -> None:
    """Refuse (UserError) a workload whose predicted iteration is longer than a plan records
    (``plan.schema.MAX_ITERATION_MS``), naming the workload rather than the plan's field (an audit,
    2026-12-04: 60 groups repeated 10^6 times passed ``profile`` and failed in the written plan)."""
    slowest = max(r.evaluation.iteration_s for r in (outcome.default, outcome.autoccl, outcome.chosen)) * 1e3
    if slowest > MAX_ITERATION_MS:
        raise UserError(f"workload {workload.name!r}: its iteration is predicted at {ms_text(slowest)} ms ({slowest / 3.6e6:.1f} h), "
                        f"longer than a plan records ({ms_text(MAX_ITERATION_MS)} ms, about a day): lower its groups' repeat "
                        "or its exposed_ms (`search --compare` prints the predictions without a plan)")


def plan_from_run(run_dir: str | Path, optimizer: str, validate_repeats: int = 0, on_note: Callable[[str], None] | None = None,
                  **options: Any) -> tuple[Plan, SearchOutcome]:
    """Read a profiled run folder (workload, fingerprint, fitted model), search it, make the plan.

    Args:
        run_dir: the run folder.
        optimizer: an optimizer's name (``run.OPTIMIZERS``).
        validate_repeats: if not 0, replay the default settings and the plan on the profiling
            backend this many times each, interleaved, and record the times in the plan.
        on_note: called with each of :attr:`SearchInputs.notes` before the search starts, and
            with what an odd ``validate_repeats`` leaves unbalanced.
        **options: ``min_gain`` and the optimizers' options (``run.search``).
    Returns:
        The plan and the search's outcome.
    """
    inputs = load_search_inputs(run_dir)
    if on_note:
        for line in [*inputs.notes, order_note(ARMS, validate_repeats, "--validate")]:
            if line:
                on_note(line)
    outcome = search(inputs.workload, inputs.model, inputs.space, optimizer, chosen=inputs.chosen, **options)
    _check_recordable(inputs.workload, outcome)
    plan = build_plan(inputs, outcome)
    # what reproduces the search: its options of the optimizer that ran (a seed, a trial budget), and min_gain
    taken = option_names(optimizer) | {"min_gain"}
    recorded = {k: val for k, val in options.items() if k in taken and k in RECORDED_OPTIONS and val is not None}
    if recorded:
        plan = replace(plan, search={**plan.search, "options": recorded})
    if validate_repeats:
        arms = dict(zip(ARMS, (outcome.default.settings, outcome.chosen.settings)))
        measured = validate(inputs.workload, inputs.meta["fingerprint"], arms, validate_repeats)
        plan = replace(plan, validated=measured)
    return plan, outcome
