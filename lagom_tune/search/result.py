"""What every optimizer returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from lagom_tune.knobs import Settings
from lagom_tune.search.evaluate import Evaluation


@dataclass(frozen=True)
class SearchResult:
    optimizer: str
    settings: Settings
    evaluation: Evaluation
    evaluations: int
    seconds: float
    extra: dict = field(default_factory=dict)
