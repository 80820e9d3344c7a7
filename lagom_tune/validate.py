"""Field-path-aware checks for turning loaded YAML/JSON into typed artifacts.

Every artifact loader (workload, plan, run folder) goes through these, so a bad file is reported
as ``plan.collectives[2].set.chunk_bytes: expected an integer, got 'x'`` and never as a traceback.
"""

from __future__ import annotations

from typing import Any

from lagom_tune.errors import UserError


def mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a mapping, got {type(value).__name__}")
    return value


def seq(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise UserError(f"{path}: expected a list, got {type(value).__name__}")
    return value


def field(d: dict, key: str, path: str, kind: type | tuple, default: Any = ..., *, minimum: float | None = None) -> Any:
    """Return ``d[key]`` checked against ``kind`` (bool is never accepted as a number)."""
    if key not in d or d[key] is None:
        if default is ...:
            raise UserError(f"{path}.{key}: required field is missing")
        return default
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise UserError(f"{path}.{key}: expected {names}, got {value!r}")
    if minimum is not None and value < minimum:
        raise UserError(f"{path}.{key}: must be >= {minimum}, got {value!r}")
    return value


def one_of(value: Any, choices, path: str) -> Any:
    if value not in choices:
        raise UserError(f"{path}: {value!r} is not one of {', '.join(map(str, choices))}")
    return value
