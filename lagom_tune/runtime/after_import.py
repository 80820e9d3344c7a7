"""Run a callback right after a module is first imported: how the runtime acts inside the user's
processes without importing torch itself (the shim's appliers, the trial's step clock)."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callbacks[name](module)`` right after ``name`` is first imported."""

    def __init__(self, callbacks: dict[str, Callable[[Any], None]]):
        self.callbacks = callbacks

    def find_spec(self, name, path, target=None):
        callback = self.callbacks.get(name)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        self.callbacks.pop(name)
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                callback(module)

            def __getattr__(self, attr):  # the rest is the real loader's: importlib.resources, pkgutil.get_data ...
                return getattr(real, attr)

        spec.loader = Loader()
        return spec


def when_imported(callbacks: dict[str, Callable[[Any], None]]) -> None:
    """Run each ``callbacks[name](module)`` once ``name`` is imported: now for a module already
    loaded, else right after its first import.

    Args:
        callbacks: module name -> callback, run in this order for modules already loaded.
    """
    pending = dict(callbacks)
    for name, callback in callbacks.items():
        if name in sys.modules:
            callback(sys.modules[name])
            pending.pop(name)
    if pending:
        sys.meta_path.insert(0, AfterImport(pending))
