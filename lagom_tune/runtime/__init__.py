"""Applying a plan inside unmodified training processes.

``lagom_tune.runtime.install("plan.yaml")`` installs a plan in this process (``runtime.shim.install``).
The shim is loaded only when ``install`` is asked for: the step clock (``runtime.steps``), which
every process of both arms of a trial loads, must not load it.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "install":
        from lagom_tune.runtime.shim import install  # local: see the module docstring

        return install
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
