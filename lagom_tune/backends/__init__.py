"""Backends measure GEMMs and collectives; the rest of lagom-tune never asks which one it has."""

from lagom_tune.backends.base import Backend, Knob, KnobSpace, Point, get_backend

__all__ = ["Backend", "Knob", "KnobSpace", "Point", "get_backend"]
