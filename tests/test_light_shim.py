"""The runtime shim starts light: loading and checking a plan, in every Python process `apply`
starts, imports no torch, numpy or pandas; torch is touched only when the user's code imports it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lagom_tune.runtime.launch import SITE_DIR

from conftest import ROOT
from test_plan import BASE

HEAVY = ("torch", "numpy", "pandas")

NCCL_PLAN = textwrap.dedent("""\
    schema_version: 1
    kind: lagom-plan
    target: {backend: nccl, world_size: 2, groups: {dp: 2}}
    process: {threads: 256, buffsize: 2097152}
    communicators: {}
    collectives:
      - match: {op: all_reduce, group: dp, min_bytes: 0, max_bytes: 1048576}
        set: {algo: ring, proto: simple, channels: 4}
""")

# What a process started by `apply` does before the user's code runs: sitecustomize installs the
# shim from LAGOM_TUNE_PLAN. The probe then reports what is loaded, with the shim's hooks in place.
PROBE = textwrap.dedent("""\
    import json, sys
    from lagom_tune.backends.registry import backend_names
    from lagom_tune.plan.schema import knob_space_for
    for name in backend_names():  # every backend's widest knob space, as a plan check loads it
        knob_space_for(name)
    print(json.dumps({
        "shim": "lagom_tune.runtime.shim" in sys.modules,
        "hooked": any(type(f).__name__ == "AfterImport" for f in sys.meta_path),
        "heavy": sorted(m for m in %r if m in sys.modules),
    }))
""" % (HEAVY,))


def _probe(plan, extra: str = "", **env_vars: str) -> tuple[dict, str]:
    env = {**os.environ, **env_vars, "LAGOM_TUNE_PLAN": str(plan), "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(ROOT)])}
    env.pop("LAGOM_TUNE_APPLIED_DIR", None)
    proc = subprocess.run([sys.executable, "-c", PROBE + extra], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[0]), proc.stderr


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_loading_a_plan_imports_no_torch_numpy_or_pandas(backend, tmp_path):
    plan = BASE.save(tmp_path / "gloo.yaml")  # a gloo plan that sets threads and DDP's buckets
    if backend == "nccl":
        plan = tmp_path / "nccl.yaml"
        plan.write_text(NCCL_PLAN)
    out, err = _probe(plan)
    assert "NOT applied" not in err, err
    assert out == {"shim": True, "hooked": True, "heavy": []}


def test_torch_is_patched_when_the_user_imports_it(tmp_path):
    """The other half of starting light: the gloo plan's threads still reach torch, on import."""
    out, err = _probe(BASE.save(tmp_path / "gloo.yaml"), "import torch\n", RANK="0")  # a rank logs what it applied
    assert out["heavy"] == []  # printed before the user's import
    assert "] applied threads=1" in err and "torch.set_num_threads" in err


def test_a_hooked_module_keeps_its_loaders_resources(tmp_path):
    """Under the shim torch's loader was a bare Loader: importlib.resources listed nothing in torch,
    pkgutil.get_data returned None, and is_package / get_filename raised AttributeError."""
    probe = textwrap.dedent("""\
        import importlib.resources, pkgutil, torch
        assert any(p.name == "version.py" for p in importlib.resources.files("torch").iterdir())
        assert pkgutil.get_data("torch", "version.py") and torch.__loader__.is_package("torch")
        assert torch.__loader__.get_filename("torch").endswith("__init__.py")
    """)
    _probe(BASE.save(tmp_path / "gloo.yaml"), probe)


def test_a_simulated_plan_is_not_applied_in_a_rank():
    """A what-if plan named by hand in LAGOM_TUNE_PLAN (apply and --print-env refuse it first):
    the user's program still runs, and says the plan was not applied and why."""
    out, err = _probe(ROOT / "plans" / "sim-h100-nvlink-mpt-7b-tp8-dp2.yaml")
    assert "plan NOT applied" in err and "simulated cluster" in err
    assert out["hooked"] is False


def test_the_plans_threads_stand_when_the_script_sets_its_own(tmp_path):
    """A script's own torch.set_num_threads came after the plan's and won, while apply reported the
    plan's count applied: the plan's count stands in the rank, and the record says what it replaced;
    a process forked from the rank (a DataLoader worker sets one thread) keeps its own."""
    script = textwrap.dedent("""\
        import os, torch
        torch.set_num_threads(2)
        seen = {"rank": torch.get_num_threads()}
        r, w = os.pipe()
        if os.fork() == 0:
            torch.set_num_threads(3)
            os.write(w, str(torch.get_num_threads()).encode())
            os._exit(0)
        os.wait()
        seen["forked"] = int(os.read(r, 8))
        print(json.dumps(seen))
    """)
    env = {**os.environ, "RANK": "0", "LAGOM_TUNE_PLAN": str(BASE.save(tmp_path / "gloo.yaml")),
           "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(ROOT)])}
    env.pop("LAGOM_TUNE_APPLIED_DIR", None)
    proc = subprocess.run([sys.executable, "-c", "import json\n" + script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"rank": 1, "forked": 3}  # BASE's plan: one thread
    assert "] applied threads=1 (torch.set_num_threads, replacing the script's torch.set_num_threads(2))" in proc.stderr


# What each start-up must not load: the shim in a trial's step clock (both arms load the clock), and
# the measuring side (a backend's base, the workload presets) in either.
NOT_AT_START = ("lagom_tune.runtime.shim", "lagom_tune.backends.base", "lagom_tune.workload.presets")


@pytest.mark.parametrize("started", ["step clock", "shim"])
def test_a_process_loads_only_what_its_start_up_needs(started, tmp_path):
    """Every process of a trial, the default arm's too, loaded the whole shim with the step clock
    (``lagom_tune.runtime`` imported it), and the shim loaded the presets through ``lagom_tune.backends``:
    about 150 ms and 90 ms a process on this VM, 2026-12-07."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(ROOT)])}
    for name in ("LAGOM_TUNE_PLAN", "LAGOM_TUNE_STEPS_DIR", "LAGOM_TUNE_APPLIED_DIR"):
        env.pop(name, None)
    env.update({"LAGOM_TUNE_STEPS_DIR": str(tmp_path)} if started == "step clock" else {"LAGOM_TUNE_PLAN": str(BASE.save(tmp_path / "p.yaml"))})
    # the step clock writes JSON: YAML (12 of its 31 ms, 2026-12-07) is the shim's, which reads a plan
    not_loaded = NOT_AT_START + (("yaml",) if started == "step clock" else ())
    probe = f"import json, sys; print(json.dumps(sorted(m for m in {not_loaded + ('lagom_tune.runtime.steps',)!r} if m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "NOT" not in proc.stderr, proc.stderr
    expected = ["lagom_tune.runtime.steps"] if started == "step clock" else ["lagom_tune.runtime.shim"]
    assert json.loads(proc.stdout) == expected


def test_install_is_still_lagom_tune_runtime_install():
    """README: a plan can be installed by hand with ``lagom_tune.runtime.install("plan.yaml")``."""
    import lagom_tune.runtime
    from lagom_tune.runtime.shim import install

    assert lagom_tune.runtime.install is install
