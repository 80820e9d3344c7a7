"""The backend registry: one record per backend, in the spirit of torch.distributed's
``Backend.register_backend``. The rest of lagom-tune asks a backend's record what it can do
(its knob space, its model family, what the runtime shim deploys for it, whether it is
simulated), never its name.

Importing this module imports nothing heavy: a record names its backend class and its knob-space
function by import path, loaded on first use. The runtime shim loads a plan (and so a knob space)
in every Python process ``apply`` starts, before the user's code has imported torch.

Adding a backend: write its module (the Backend class) and a torch-free knob-space function, then
add one ``register_backend(BackendInfo(...))`` at the bottom of this file.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lagom_tune import validate as v
from lagom_tune.errors import UserError

if TYPE_CHECKING:  # types only: base.py imports this module, and knob spaces load lazily
    from lagom_tune.backends.base import Backend, BackendOptions, KnobSpace

# What the runtime shim (and `apply`) deploys for a backend's plans: the values of ``BackendInfo.deploys``.
THREAD_COUNT = "thread count"  # torch.set_num_threads + OMP_NUM_THREADS per rank, checked against the cores
DDP_BUCKET_CAP = "ddp bucket cap"  # DistributedDataParallel(bucket_cap_mb=...)
CHUNKED_ALL_REDUCE = "chunked all-reduce"  # DDP comm hook and dist.all_reduce wrapper, in chunks
NCCL_ENVIRONMENT = "nccl environment"  # NCCL_NTHREADS / NCCL_BUFFSIZE, checked in each rank
NCCL_COMMUNICATOR_OPTIONS = "nccl communicator options"  # ProcessGroupNCCL.Options CTA bounds per role
NCCL_TUNER_RULES = "nccl tuner rules"  # per-collective rules through lagom-tune's NCCL tuner plugin
CAPABILITIES = (THREAD_COUNT, DDP_BUCKET_CAP, CHUNKED_ALL_REDUCE, NCCL_ENVIRONMENT, NCCL_COMMUNICATOR_OPTIONS,
                NCCL_TUNER_RULES)


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask (a Slurm job's or a container's share
    of the node), not the host's count, which ``os.cpu_count`` gives."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def max_threads_per_rank(cores: int, ranks_per_node: int) -> int:
    """The most intra-op threads (:data:`THREAD_COUNT`) a rank may take: ranks on one node never
    share out more threads than it has cores (oversubscribed OpenMP threads spin for cores other
    ranks hold: on 2 cores, 2 ranks of 2 threads timed one GEMM anywhere from 1.3 to 13 ms), and a
    rank always has one.

    Args:
        cores: the node's CPU cores.
        ranks_per_node: ranks started on it.
    Returns:
        At least 1.
    """
    return max(1, cores // max(1, ranks_per_node))

# Model families (model.yaml's ``family``; model/contention.py's FAMILIES reads them).
CPU_FAMILY = "cpu-pairwise"
GPU_FAMILY = "lagom-gpu"


def _load(path: str) -> Any:
    """The object at ``"package.module:attribute"``, importing its module."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class BackendInfo:
    """Everything lagom-tune needs to know about one backend, without importing it.

    Attributes:
        name: what ``--backend`` and a plan's ``target.backend`` say.
        factory: ``"module:Class"`` of the Backend, built with ``BackendOptions`` (imported on first use).
        knob_space_from: ``"module:function"`` taking a fingerprint dict (``{}``: the widest space any
            plan may hold) and returning the KnobSpace; its module must import no torch, numpy or pandas.
        model_family: the cost-model family ``fit`` fits to its profiles (``CPU_FAMILY`` or ``GPU_FAMILY``).
        deploys: what the runtime deploys for its plans (values from ``CAPABILITIES``).
        simulated: its numbers come from a simulator, never a measurement; ``apply`` refuses its plans.
        needs_cuda: ``apply`` checks for a CUDA GPU, the same model as the plan's.
        replays_locally: ``search --validate`` can replay its plans on this machine (False: only on
            the cluster that was profiled).
        summary: one line for ``--backend``'s help.
        setup: the fingerprint's fields that make two measurements comparable (the machine, its
            software, the simulated physics); a profile resumes only where they all match.
        ops: the collectives it measures (None: every op a workload may hold); ``profile``
            refuses a workload with others before measuring.
        instruments: ops of its measurement rows that no workload holds, with settings of their
            own (the single-GPU probe's copy kernel, :data:`PROBE_OP`).
        options: the ``profile`` options of its own it reads (``BackendOptions`` fields, and
            ``extra`` keys); the others are refused when given, as it would ignore them.
    """

    name: str
    factory: str
    knob_space_from: str
    model_family: str
    deploys: frozenset[str] = frozenset()
    simulated: bool = False
    needs_cuda: bool = False
    replays_locally: bool = True
    summary: str = ""
    setup: tuple[str, ...] = ()
    ops: frozenset[str] | None = None  # the collectives it measures (None: every op a workload may hold)
    instruments: frozenset[str] = frozenset()  # ops it measures that no workload holds (the GPU probe's copy kernel)
    options: frozenset[str] = frozenset()

    def check_options(self, given: set[str]) -> None:
        """Refuse backend options this backend would ignore (``--noise 0.1`` on real gloo ranks).

        Args:
            given: the backend options the user gave (names as in :attr:`options`).
        Raises:
            UserError: naming the first, and the backends that take it.
        """
        for name in sorted(given - self.options):
            able = [n for n in backend_names() if name in backend_info(n).options]
            raise UserError(f"--{name.replace('_', '-')} applies to the {' or '.join(able)} backend, not {self.name}, "
                            "which would ignore it")

    def check_ops(self, ops: set[str]) -> None:
        """Refuse collectives this backend does not measure (it would time them as another op).

        Args:
            ops: the workload's collective ops.
        Raises:
            UserError: naming them and the backends that measure them.
        """
        missing = sorted(ops - self.ops) if self.ops is not None else []
        if missing:
            able = [n for n in backend_names() if backend_info(n).ops is None or ops <= backend_info(n).ops]
            raise UserError(f"the {self.name} backend measures {', '.join(sorted(self.ops or ()))} only, not the workload's "
                            f"{', '.join(missing)}; profile it with --backend {' or '.join(able)}")

    def simulated_flag(self, d: dict[str, Any], path: str) -> bool:
        """A file's ``simulated`` field (absent: this backend's), refused unless it says what this
        backend is: a flag edited to false dropped every SIMULATED label and let apply run a
        what-if plan.

        Args:
            d: the mapping that holds the field (a run's meta.yaml, a plan's target).
            path: its field path, for the error.
        Returns:
            Whether this backend simulates.
        """
        if v.field(d, "simulated", path, bool, self.simulated) != self.simulated:
            raise UserError(f"{path}.simulated: {d['simulated']}, but the {self.name} backend "
                            f"{'simulates' if self.simulated else 'measures'}")
        return self.simulated

    def setup_change(self, before: dict[str, Any], now: dict[str, Any]) -> str | None:
        """What differs between two fingerprints in :attr:`setup`, or None.

        Args:
            before: the fingerprint a run folder was started with.
            now: this process's.
        Returns:
            ``"field: before -> now"`` for each differing field, joined, or None when none differs.
        """
        changed = [f"{k}: {before.get(k)} -> {now.get(k)}" for k in self.setup if before.get(k) != now.get(k)]
        return "; ".join(changed) or None

    def __post_init__(self) -> None:
        unknown = set(self.deploys) - set(CAPABILITIES)
        if unknown or self.model_family not in (CPU_FAMILY, GPU_FAMILY):
            raise ValueError(f"backend {self.name}: unknown capabilities {sorted(unknown)} or model family {self.model_family!r}")

    def create(self, options: "BackendOptions") -> "Backend":
        """Build the backend (this imports its module, e.g. torch for gloo).

        Args:
            options: ranks, hardware, nodes, seed, ... (each backend reads what it needs).
        Returns:
            The Backend.
        """
        return _load(self.factory)(options)

    def knob_space(self, fingerprint: dict[str, Any] | None = None) -> "KnobSpace":
        """The backend's knobs on the profiled machine, or its widest (what any plan may hold).

        Args:
            fingerprint: the run folder's fingerprint; None or {} for the widest space.
        Returns:
            The KnobSpace (loading it imports no torch, numpy or pandas).
        """
        return _load(self.knob_space_from)(fingerprint or {})

    def deploys_capability(self, capability: str) -> bool:
        """Whether the runtime deploys ``capability`` (one of ``CAPABILITIES``) for this backend's plans."""
        return capability in self.deploys

    @property
    def gpu_model(self) -> bool:
        """Whether ``fit`` fits the GPU family (it needs the device's SMs and HBM bandwidth)."""
        return self.model_family == GPU_FAMILY

    @property
    def deploys_nccl_options(self) -> bool:
        """Whether plans carry per-communicator ProcessGroupNCCL.Options (CTA bounds)."""
        return NCCL_COMMUNICATOR_OPTIONS in self.deploys

    @property
    def deploys_tuner_rules(self) -> bool:
        """Whether per-collective rules reach NCCL through the tuner plugin."""
        return NCCL_TUNER_RULES in self.deploys


_REGISTRY: dict[str, BackendInfo] = {}


def register_backend(info: BackendInfo) -> BackendInfo:
    """Add a backend to the registry.

    Args:
        info: its record; its name must be new.
    Returns:
        The record (so a module can keep it).
    """
    if info.name in _REGISTRY:
        raise ValueError(f"backend {info.name!r} is already registered")
    _REGISTRY[info.name] = info
    return info


def backend_names() -> list[str]:
    """Every registered backend's name, sorted.

    Returns:
        The names.
    """
    return sorted(_REGISTRY)


def backend_info(name: str, where: str = "") -> BackendInfo:
    """The record of the backend called ``name``.

    Args:
        name: a backend name, as ``--backend`` or a plan's ``target.backend`` gives it.
        where: prefix for the error, e.g. ``"plan.target.backend: "``.
    Returns:
        Its BackendInfo.
    Raises:
        UserError: one line naming the backends there are, for an unknown name.
    """
    info = _REGISTRY.get(name)
    if info is None:
        raise UserError(f"{where}unknown backend {name!r}; available: {', '.join(backend_names())}")
    return info


def record_of(cls: type) -> BackendInfo:
    """The record whose factory is ``cls`` (or the nearest of its base classes that has one).

    Args:
        cls: a Backend class.
    Returns:
        Its BackendInfo: the one source of its ``name`` and ``simulated``.
    Raises:
        LookupError: for a class no record names.
    """
    for klass in cls.__mro__:
        path = f"{klass.__module__}:{klass.__qualname__}"
        for info in _REGISTRY.values():
            if info.factory == path:
                return info
    raise LookupError(f"no registered backend is made by {cls.__module__}.{cls.__qualname__}")


def backend_help() -> str:
    """``--backend``'s help: every backend's one-line summary.

    Returns:
        One sentence: ``"gloo (real CPU ranks), nccl (...) or sim (...)."``.
    """
    parts = [f"{info.name} ({info.summary})" if info.summary else info.name for info in _REGISTRY.values()]
    return ", ".join(parts[:-1]) + (" or " if len(parts) > 1 else "") + parts[-1] + "."


# -- the backends, one registration each -----------------------------------------------------------

SIM_OPTIONS = frozenset({"hardware", "nodes", "ib_gbps", "noise", "seed"})  # what a simulated cluster is
PROBE_OP = "probe"  # the op of the single-GPU probe's rows: a copy kernel of 1-64 blocks beside each GEMM

register_backend(BackendInfo(
    "gloo", "lagom_tune.backends.gloo:GlooBackend", "lagom_tune.backends.gloo_knobs:knob_space_from_fingerprint",
    CPU_FAMILY, frozenset({THREAD_COUNT, DDP_BUCKET_CAP, CHUNKED_ALL_REDUCE}), summary="real CPU ranks",
    setup=("host", "device", "processor", "cores", "ranks", "torch"), ops=frozenset({"all_reduce"}), options=frozenset({"ranks", "timeout"})))
register_backend(BackendInfo(
    "nccl", "lagom_tune.backends.nccl:NcclBackend", "lagom_tune.backends.nccl_knobs:knob_space_from_fingerprint",
    GPU_FAMILY, frozenset({NCCL_ENVIRONMENT, NCCL_COMMUNICATOR_OPTIONS, NCCL_TUNER_RULES}), needs_cuda=True,
    replays_locally=False, instruments=frozenset({PROBE_OP}),
    summary="GPUs; launch with torchrun, or one process for the single-GPU contention probe",
    # not the hosts: a resumed job may land on other nodes of the same kind; not hbm_GBps: it is measured
    setup=("mode", "gpu", "sms", "ranks", "nodes", "gpus_per_node", "driver", "cuda", "nccl", "torch", "max_channels", "nvls", "ll128", "standin"),
    options=frozenset({"timeout"})))
register_backend(BackendInfo(
    "sim", "lagom_tune.backends.sim:SimBackend", "lagom_tune.backends.nccl_knobs:knob_space_from_fingerprint",
    GPU_FAMILY, frozenset({NCCL_ENVIRONMENT, NCCL_COMMUNICATOR_OPTIONS, NCCL_TUNER_RULES}), simulated=True,
    summary="a SIMULATED GPU cluster, for what-if questions",
    setup=("cluster", "nodes", "gpus_per_node", "ib_gbps", "noise", "seed"), options=SIM_OPTIONS))
