"""Workloads: which computations overlap which collectives, and how often per iteration.

Import from the module that holds a name (``workload.spec``, ``workload.presets``): this package
imports nothing, so a module that needs only the spec does not build the presets.
"""
