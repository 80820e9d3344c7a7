"""Backends measure GEMMs and collectives; the rest of lagom-tune never asks which one it has,
only what its registry record says it can do (``registry.py``).

Import from the module that holds a name (``backends.base``, ``backends.registry``): this package
imports nothing, so the runtime shim, which needs ``chunking`` and the NCCL controls in every rank,
does not load the measuring side (``base`` and the workload presets) at start-up.
"""
