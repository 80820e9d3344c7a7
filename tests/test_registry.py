"""The backend registry: one record per backend, and the rest of the code asks the record."""

import pytest

from lagom_tune.backends.base import BackendOptions, get_backend
from lagom_tune.backends.registry import (
    CAPABILITIES, GPU_FAMILY, THREAD_COUNT, BackendInfo, backend_help, backend_info, backend_names, record_of,
    register_backend,
)
from lagom_tune.errors import UserError
from lagom_tune.model.contention import FAMILIES
from lagom_tune.plan.schema import knob_space_for


def test_every_backend_has_a_record():
    assert backend_names() == ["gloo", "nccl", "sim"]
    for name in backend_names():
        info = backend_info(name)
        assert info.model_family in FAMILIES and set(info.deploys) <= set(CAPABILITIES)
        assert knob_space_for(name).names()  # the widest space loads from the record
    assert backend_info("sim").simulated and not backend_info("gloo").simulated
    assert backend_info("nccl").model_family == GPU_FAMILY and backend_info("nccl").deploys_nccl_options
    assert backend_info("gloo").deploys_capability(THREAD_COUNT) and not backend_info("gloo").deploys_tuner_rules


def test_an_unknown_backend_is_one_line_naming_the_others():
    with pytest.raises(UserError, match=r"^unknown backend 'mpi'; available: gloo, nccl, sim$"):
        get_backend("mpi", BackendOptions())
    with pytest.raises(UserError, match=r"^plan.target.backend: unknown backend 'mpi'; available: gloo, nccl, sim$"):
        knob_space_for("mpi")


def test_a_record_is_checked_and_a_name_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_backend(backend_info("gloo"))
    with pytest.raises(ValueError, match="unknown capabilities"):
        BackendInfo("x", "m:C", "m:f", GPU_FAMILY, frozenset({"telepathy"}))


def test_the_cli_help_comes_from_the_records():
    assert backend_help() == ("gloo (real CPU ranks), nccl (GPUs; launch with torchrun, or one process for the "
                              "single-GPU contention probe) or sim (a SIMULATED GPU cluster, for what-if questions).")


def test_usable_cores_are_the_affinity_mask(monkeypatch):
    """A Slurm job or container given 2 CPUs of a 128-core host: 2 cores, and threads to match."""
    import os

    from lagom_tune.backends.gloo_knobs import gloo_knob_space
    from lagom_tune.backends.registry import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    assert usable_cores() == 2
    assert gloo_knob_space(ranks=2)["threads"].domain == (1,)


def test_gloo_refuses_more_ranks_than_cores(monkeypatch):
    """Each rank needs a core: 64 ranks on 2 cores once ran 80 s into a profile before the
    kernel killed one for memory."""
    import os

    import pytest

    from lagom_tune.backends.base import BackendOptions
    from lagom_tune.backends.gloo import GlooBackend
    from lagom_tune.errors import UserError

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    assert GlooBackend(BackendOptions(ranks=2)).options.ranks == 2
    with pytest.raises(UserError, match="--ranks 3 exceeds the 2 CPU cores"):
        GlooBackend(BackendOptions(ranks=3))


def test_knob_spaces_follow_the_fingerprint():
    assert knob_space_for("gloo", {"cores": 2})["threads"].domain == (1, 2)
    # the profile's ranks share the cores: no thread count that oversubscribes them
    assert knob_space_for("gloo", {"cores": 2, "ranks": 2})["threads"].domain == (1,)
    assert knob_space_for("gloo", {"cores": 16, "ranks": 2})["threads"].domain == (1, 2, 4, 8)
    assert knob_space_for("sim", {"cluster": "a40-pcie"})["channels"].domain[-1] == 32
    assert knob_space_for("nccl", {"max_channels": 32, "default_channels": 8})["channels"].default == 8


def test_a_backend_class_reads_its_name_and_simulated_from_its_record():
    from lagom_tune.backends.gloo import GlooBackend
    from lagom_tune.backends.nccl import NcclBackend

    for cls in (GlooBackend, NcclBackend):
        info = record_of(cls)
        assert info.factory.endswith(f":{cls.__name__}")
        assert "name" not in vars(cls) and "simulated" not in vars(cls)  # the record is the one source
    backend = get_backend("gloo", BackendOptions(ranks=2))
    assert (backend.name, backend.simulated) == ("gloo", False) and backend.fingerprint()["backend"] == "gloo"
    sim = get_backend("sim", BackendOptions())
    assert (sim.name, sim.simulated) == (backend_info("sim").name, backend_info("sim").simulated)
    with pytest.raises(LookupError):
        record_of(BackendInfo)



def test_the_setup_a_profile_resumes_on_names_fingerprint_fields():
    """A misspelt field would compare None with None and let any setup resume."""
    from lagom_tune.workload.presets import build_preset

    for name, options in (("gloo", BackendOptions(ranks=2)), ("sim", BackendOptions(hardware="a40-pcie"))):
        b = get_backend(name, options)
        b.plan_points(build_preset("cpu-demo"))
        fp = b.fingerprint()
        assert set(backend_info(name).setup) <= set(fp), name
        assert backend_info(name).setup_change(fp, dict(fp)) is None
    gloo = backend_info("gloo")
    assert gloo.setup_change({"host": "a", "cores": 2}, {"host": "b", "cores": 2}) == "host: a -> b"
