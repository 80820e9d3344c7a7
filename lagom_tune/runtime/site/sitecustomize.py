"""Loaded by every Python process that `lagom-tune apply` or `trial` starts (this folder is put first on PYTHONPATH)."""

import os
import sys


def _lagom_tune_shim() -> None:
    if not os.environ.get("LAGOM_TUNE_PLAN"):
        return
    try:
        # local: keeps every Python process light; only those started under a plan load the shim
        from lagom_tune.runtime.shim import install_from_env

        install_from_env()
    except Exception as e:  # never break the user's program: say what could not be applied
        sys.stderr.write(f"[lagom-tune] plan NOT applied in pid {os.getpid()}: {type(e).__name__}: {e}\n")


def _chain_next_sitecustomize() -> None:
    """Run the sitecustomize this one shadows, if any, so user environments keep working."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec and spec.loader and os.path.abspath(spec.origin or "") != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _lagom_tune_step_clock() -> None:
    if not os.environ.get("LAGOM_TUNE_STEPS_DIR"):
        return
    try:
        # local, as above: only processes of a `lagom-tune trial` run time their optimizer steps
        from lagom_tune.runtime.steps import install_step_clock

        install_step_clock(os.environ["LAGOM_TUNE_STEPS_DIR"])
    except Exception as e:  # never break the user's program
        sys.stderr.write(f"[lagom-tune] step times NOT recorded in pid {os.getpid()}: {type(e).__name__}: {e}\n")


_lagom_tune_shim()
_lagom_tune_step_clock()
_chain_next_sitecustomize()
