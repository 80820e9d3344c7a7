"""Plans: the chosen settings at their scopes, with predictions and provenance."""

from lagom_tune.plan.schema import Plan, load_plan

__all__ = ["Plan", "load_plan"]
