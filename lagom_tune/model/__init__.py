"""Cost models: how long GEMMs and collectives take, alone and beside each other."""

from lagom_tune.model.contention import CostModel, load_model

__all__ = ["CostModel", "load_model"]
