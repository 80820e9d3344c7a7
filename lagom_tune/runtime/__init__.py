"""Applying a plan inside unmodified training processes."""

from lagom_tune.runtime.shim import install

__all__ = ["install"]
