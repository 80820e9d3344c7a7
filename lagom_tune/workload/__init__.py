"""Workloads: which computations overlap which collectives, and how often per iteration."""

from lagom_tune.workload.presets import resolve_workload
from lagom_tune.workload.spec import Collective, Gemm, OverlapGroup, Workload, load_workload

__all__ = ["Collective", "Gemm", "OverlapGroup", "Workload", "load_workload", "resolve_workload"]
