"""Applying a plan inside unmodified training processes."""


def install(plan_path: str, applied_dir: str | None = None):
    """Apply ``plan_path`` in this process (what the automatic shim does in every rank)."""
    from lagom_tune.runtime.shim import install as _install

    return _install(plan_path, applied_dir)


__all__ = ["install"]
