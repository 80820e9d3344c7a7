"""``evaluate(workload, settings) -> iteration time``: the one interface every optimizer uses.

Offline it plays each overlap group on the two-stream timeline with a fitted cost model.
Results are cached per settings, and every distinct evaluation is counted.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from lagom_tune.errors import UserError
from lagom_tune.knobs import KnobSpace, Settings
from lagom_tune.model.contention import CostModel
from lagom_tune.timeline import Timeline, simulate
from lagom_tune.workload.bucketing import bucket_group
from lagom_tune.workload.spec import OverlapGroup, Workload


@dataclass(frozen=True)
class Evaluation:
    iteration_s: float
    compute_s: float  # Y: computation time, contention included, per iteration
    comm_s: float  # X: communication time, contention included, per iteration
    bound_s: float  # contention-free bound of these settings: sum of max(sum y_alone, sum x_alone)
    comm_by_group: dict[str, float]  # communication seconds per communicator
    comm_by_collective: dict[str, float]
    comm_by_rule: dict[str, float]  # by Collective.rule_key: what a collective-scope variable controls
    timelines: tuple[tuple[OverlapGroup, Timeline], ...]


# Settings whose knob values cannot run together (NVLS with LL): never chosen, whichever optimizer asks
INFEASIBLE = Evaluation(math.inf, math.inf, math.inf, math.inf, {}, {}, {}, ())


class ModelEvaluator:
    """Predicts iteration time from a fitted model; counts distinct evaluations. With the knob
    space, settings it says cannot run together evaluate to :data:`INFEASIBLE`."""

    def __init__(self, workload: Workload, model: CostModel, space: KnobSpace | None = None):
        self.workload = workload
        self.model = model
        self.space = space
        self.evaluations = 0
        self._cache: dict[tuple, Evaluation] = {}
        # Per-group timelines, keyed by what the group's time depends on: a change to one
        # collective's settings replays only the groups that hold it.
        self._groups: dict[tuple, Timeline] = {}

    @property
    def identity(self) -> str:
        """What this evaluator predicts from, as a digest: the workload and the model's parameters
        (a stored study must be resumed against the same objective, not only the same space)."""
        blob = json.dumps([self.workload.digest, self.model.to_dict()], sort_keys=True, default=str)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __call__(self, settings: Settings) -> Evaluation:
        key = settings.key
        if key not in self._cache:
            self.evaluations += 1
            self._cache[key] = self._evaluate(settings)
        return self._cache[key]

    def _play(self, g: OverlapGroup, proc: dict, cfg: list[dict]) -> Timeline:
        model = self.model
        y = [model.compute_time(op, proc) for op in g.compute]
        x = [model.comm_time(c, s) for c, s in zip(g.comm, cfg)]
        cfg_of = {c.name: s for c, s in zip(g.comm, cfg)}

        def slowdowns(gemm, coll):
            s = cfg_of[coll.name]
            return model.compute_slowdown(gemm, coll, s), model.comm_slowdown(coll, gemm, s)

        try:
            return simulate(g.compute, y, g.comm, x, slowdowns)
        except ValueError as e:  # finite parameters can still overflow (a model.yaml edited to 1e308): not an internal error
            raise UserError(f"the cost model gives no usable time for {g.name} ({e}); was model.yaml edited? rerun "
                            "`lagom-tune fit` on the run folder") from None

    def _evaluate(self, settings: Settings) -> Evaluation:
        caps = {g: c["bucket_cap_mb"] for g, c in settings.communicators.items() if "bucket_cap_mb" in c}
        total = y_tot = x_tot = bound = 0.0
        by_group: dict[str, float] = {}
        by_coll: dict[str, float] = {}
        by_rule: dict[str, float] = {}
        timelines = []
        for group in self.workload.groups:
            g = bucket_group(group, caps) if caps else group
            proc = dict(settings.process)
            cfg = [settings.for_collective(c) for c in g.comm]
            if self.space is not None and any(self.space.conflict(s) for s in cfg):
                return INFEASIBLE
            key = (id(group), tuple(sorted(proc.items())), tuple((c, tuple(sorted(s.items()))) for c, s in zip(g.comm, cfg)))
            tl = self._groups.get(key)
            if tl is None:
                tl = self._groups[key] = self._play(g, proc, cfg)
            timelines.append((g, tl))
            total += g.repeat * tl.makespan
            y_tot += g.repeat * tl.compute_time
            x_tot += g.repeat * tl.comm_time
            bound += g.repeat * max(tl.y_alone, tl.x_alone)
            for span, coll in zip((s for s in tl.spans if s.stream == "comm"), g.comm):
                by_group[coll.group] = by_group.get(coll.group, 0.0) + g.repeat * span.duration
                by_coll[coll.name] = by_coll.get(coll.name, 0.0) + g.repeat * span.duration
                by_rule[coll.rule_key] = by_rule.get(coll.rule_key, 0.0) + g.repeat * span.duration
        exposed = self.workload.exposed_ms / 1e3
        if not math.isfinite(total + bound):  # each group's time was finite, their sum overflowed (a model.yaml edited to 1e308)
            raise UserError(f"the cost model gives no usable iteration time for {self.workload.name} (the groups' times sum "
                            "past the largest number); was model.yaml edited? rerun `lagom-tune fit` on the run folder")
        return Evaluation(total + exposed, y_tot, x_tot, bound + exposed, by_group, by_coll, by_rule, tuple(timelines))
