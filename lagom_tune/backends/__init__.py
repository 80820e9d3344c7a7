"""Backends measure GEMMs and collectives; the rest of lagom-tune never asks which one it has,
only what its registry record says it can do (``registry.py``)."""

from lagom_tune.backends.base import Backend, Point, get_backend
from lagom_tune.backends.registry import BackendInfo, backend_info, register_backend
from lagom_tune.knobs import Knob, KnobSpace

__all__ = ["Backend", "BackendInfo", "Knob", "KnobSpace", "Point", "backend_info", "get_backend", "register_backend"]
