"""GPU backend: real GEMMs and real NCCL collectives, timed with CUDA events.

Launch it the way a training job is launched::

    torchrun --nnodes N --nproc-per-node G -m lagom_tune profile --backend nccl --out RUN ...

Every rank runs the same command; rank 0 owns the run folder and tells the others what is left to
measure, so all ranks agree on the sweep (and a resumed profile skips the same points everywhere).
Each rank measures through worker processes, a fresh one per NCCL environment (NCCL reads
``NCCL_ALGO``/``NCCL_PROTO``/``NCCL_NTHREADS``/``NCCL_BUFFSIZE`` once); workers of one batch join the
job's rendezvous store under a prefix of their own. Rows travel worker → parent → rank 0, which
keeps the slowest rank's time per repeat.

Without torchrun (one process, one GPU) the backend profiles the compute side: the workload's
GEMMs alone and beside the contention probe (``backends/probe.py``) over channels and buffer
sizes. Such a profile fits the GEMM model but not NCCL's, and says so.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import platform
import queue
import re
import subprocess
import tempfile
import time
import uuid
from typing import Any, Iterator

from lagom_tune.backends.base import BackendOptions, Point, RegisteredBackend, RowSink, reduce_ranks
from lagom_tune.backends.gpu_timing import OPERANDS
from lagom_tune.backends.nccl_knobs import NVLS, ll128_offered, nccl_knob_space
from lagom_tune.backends.nccl_sweep import OBSERVING, batches, plan_collective_points, plan_probe_points, worker_env
from lagom_tune.backends.nccl_worker import WorkerSpec, worker_main
from lagom_tune.backends.parent_watch import start_shielded
from lagom_tune.backends.rank_exchange import RankExchange
from lagom_tune.backends.tuner_build import ensure_plugin
from lagom_tune.errors import RunError, UserError
from lagom_tune.workload.spec import Workload

STANDIN_ENV = "LAGOM_NCCL_STANDIN"  # "cpu": gloo and CPU in the workers; tests of the orchestration only
STANDIN_SMS = 16
MODES = {"multi": "multi-gpu", "probe": "single-gpu-probe"}


class Coordinator:
    """The parent processes of a torchrun job (or one process without torchrun)."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        env = os.environ
        self.world = int(env.get("WORLD_SIZE", "1"))
        self.rank = int(env.get("RANK", "0"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.gpus_per_node = int(env.get("LOCAL_WORLD_SIZE", str(self.world)))
        self.dist = dist
        # Longer than a worker's own limit, so a rank whose worker failed waits for the others to
        # report theirs instead of timing out first.
        timeout = datetime.timedelta(seconds=3 * timeout_s)
        if self.world > 1:
            if not dist.is_initialized():
                # The rendezvous (and, where torchrun's agent does not, the hosting of its store); the
                # group itself runs no collective (rank_exchange.py says why).
                dist.init_process_group("gloo", timeout=timeout)
                # Whatever ends the process (an error included), leave the group before the
                # interpreter tears down: a live gloo group there aborts the process.
                atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
            self.store_host, self.store_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            self._store = None
            # one job's keys apart from another's (an elastic restart is another job)
            job = f"lagom/exchange/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
            self.exchange = RankExchange(dist.PrefixStore(job, dist.TCPStore(self.store_host, self.store_port, is_master=False,
                                                                             wait_for_workers=False, timeout=timeout)),
                                         self.rank, self.world)
        else:  # workers still need a store to meet at
            self._store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            self.store_host, self.store_port = "127.0.0.1", self._store.port

    @property
    def nodes(self) -> int:
        return max(1, self.world // max(1, self.gpus_per_node))

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        return value if self.world == 1 else self.exchange.share(value)

    def finish(self) -> None:
        """Leave together: a rank that exits while a peer still holds the connection can bring
        that peer down (gloo raises on a closed socket)."""
        if self.world > 1 and self.dist.is_initialized():
            self.exchange.barrier()
            self.dist.destroy_process_group()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        return [value] if self.world == 1 else self.exchange.all_gather(value)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (cuda.h, CUDA 12.1+): what NCCL asks before it offers NVLS
CU_MULTICAST_SUPPORTED = 132


def multicast_supported(local_rank: int) -> bool:
    """Whether this rank's GPU can join an NVLink multicast object (an NVSwitch node with its
    fabric manager), asked of the CUDA driver as NCCL asks it; False when the driver cannot say.

    Args:
        local_rank: the rank's GPU on its node (a CUDA ordinal among the visible devices).
    Returns:
        The driver's answer.
    """
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        ok = (cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), local_rank) == 0
              and cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_MULTICAST_SUPPORTED, dev) == 0)
    except (OSError, AttributeError):  # no driver library, or one too old to export the calls
        return False
    return ok and value.value == 1


def nvls_offered(multicast: list[bool], gpus_per_node: int, env: dict[str, str]) -> bool:
    """Whether NCCL will offer NVLS on this job, so the profile measures it and the defaults are
    it: every rank's GPU supports multicast, a node holds more than one of them, and
    ``NCCL_NVLS_ENABLE`` does not turn it off (NCCL's default enables it where supported).

    Args:
        multicast: :func:`multicast_supported` of every rank.
        gpus_per_node: ranks a node holds.
        env: the environment the job runs with.
    Returns:
        The answer.
    """
    return bool(multicast) and all(multicast) and gpus_per_node > 1 and env.get("NCCL_NVLS_ENABLE", "").strip() != "0"


def _nccl_version(torch) -> tuple[int, ...] | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - torch built without NCCL
        return None
    # (2, 28, 9) or, for an NCCL built with a suffix, (2, 28, 9, '+cuda13.0')
    return tuple(int(x) for x in v[:3]) if isinstance(v, tuple) else None


def _measured_copy_bandwidth(torch, device) -> float:
    """Device memory bandwidth in GB/s, measured: a 1 GiB device-to-device copy reads and writes."""
    n = (1 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    stream = torch.cuda.current_stream(device)  # the copy's: the current device's would time nothing on local rank > 0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src)
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / best / 1e9


def local_facts(standin: bool, local_rank: int) -> dict[str, Any]:
    """What this rank's GPU, driver and libraries are.

    Args:
        standin: the CPU stand-in of the tests (fixed, made-up facts).
        local_rank: the rank's GPU on its node.
    Returns:
        GPU name, SMs, memory, measured HBM bandwidth, driver, CUDA, NCCL and torch versions, host.
    """
    import torch

    if standin:
        return {"gpu": "cpu stand-in (test only)", "sms": STANDIN_SMS, "hbm_GBps": 10.0, "hbm_method": "assumed (stand-in)",
                "l2_MiB": None, "gemm_operands": "one pair (stand-in)",
                "driver": None, "cuda": None, "nccl": None, "torch": str(torch.__version__), "host": platform.node()}
    device = torch.device("cuda", local_rank)
    props = torch.cuda.get_device_properties(device)
    nccl = _nccl_version(torch)
    return {
        "gpu": props.name, "sms": props.multi_processor_count, "memory_GiB": round(props.total_memory / (1 << 30), 1),
        "hbm_GBps": round(_measured_copy_bandwidth(torch, device), 1), "hbm_method": "measured: 1 GiB device-to-device copy, best of 5",
        "l2_MiB": round(props.L2_cache_size / (1 << 20), 1), "gemm_operands": OPERANDS,
        "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(local_rank)]) or None,
        "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if nccl else None, "torch": str(torch.__version__),
        "host": platform.node(),
    }


class NcclBackend(RegisteredBackend):
    """Ranks of a torchrun job (or one process and GPU); ``name`` and ``simulated`` come from the registry record."""

    def __init__(self, options: BackendOptions):
        import torch
        import torch.distributed as dist

        self.standin = os.environ.get(STANDIN_ENV) == "cpu"
        if not self.standin and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise UserError("--backend nccl needs CUDA GPUs and a torch built with NCCL (none here); "
                            "use --backend gloo for CPUs or --backend sim for a simulated cluster")
        self.options = options
        self.coord = Coordinator(options.timeout_s)
        self.writer = self.coord.rank == 0
        self.mode = "multi" if self.coord.world > 1 else "probe"
        self._facts: dict[str, Any] | None = None
        self.token = self.coord.share(uuid.uuid4().hex[:12])
        nccl = _nccl_version(torch) if not self.standin else None
        self.nccl_version = nccl
        # NCCL allows 64 channels since 2.25 (32 before); at most half the SMs leaves the GEMM
        # beside a collective something to run on.
        sms = STANDIN_SMS if self.standin else torch.cuda.get_device_properties(self.coord.local_rank).multi_processor_count
        multicast = False if self.standin or self.mode != "multi" else multicast_supported(self.coord.local_rank)
        nvls = nvls_offered(self.coord.all_gather(multicast), self.coord.gpus_per_node, dict(os.environ))
        self.topology = _topology(self.standin)
        if self.standin:  # its made-up GPUs offer every protocol, so the tests cover them all
            ll128 = True
        else:
            capability = tuple(torch.cuda.get_device_capability(self.coord.local_rank))
            linked = nvlink_between_gpus(self.topology)
            ranks = self.coord.all_gather((capability, linked))
            ll128 = ll128_offered([tuple(c) for c, _ in ranks], all(n for _, n in ranks))
        self.knob_space = nccl_knob_space(min(64 if nccl is None or nccl >= (2, 25) else 32, sms // 2), nvls=nvls, ll128=ll128)

    def share(self, value: Any) -> Any:
        return self.coord.share(value)

    def fingerprint(self) -> dict[str, Any]:
        if self._facts is None:
            facts = self.coord.all_gather(local_facts(self.standin, self.coord.local_rank))
            gpus = sorted({f["gpu"] for f in facts})
            if len(gpus) > 1:
                raise UserError(f"the ranks have different GPUs ({', '.join(gpus)}); profile one kind at a time")
            first = facts[0]
            c = self.coord
            self._facts = {
                "backend": self.name, "simulated": self.simulated, "mode": MODES[self.mode],
                "device": first["gpu"], "gpu": first["gpu"], "sms": first["sms"],
                "hbm_GBps": min(f["hbm_GBps"] for f in facts), "hbm_method": first["hbm_method"],
                "l2_MiB": first["l2_MiB"], "gemm_operands": first["gemm_operands"],
                "memory_GiB": first.get("memory_GiB"),
                "rank_memory_GiB": min((f["memory_GiB"] for f in facts if f.get("memory_GiB")), default=None),
                "driver": first["driver"], "cuda": first["cuda"], "nccl": first["nccl"],
                "torch": first["torch"], "ranks": c.world, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                "hosts": sorted({f["host"] for f in facts}), "host": first["host"],
                "topology": self.topology, "max_channels": self.knob_space["channels"].domain[-1],
                "default_channels": self.knob_space["channels"].default,
                "nvls": NVLS in self.knob_space["algo"].domain, "ll128": "ll128" in self.knob_space["proto"].domain,
                **({"standin": "cpu and gloo in place of GPUs and NCCL: a test of the orchestration, not a GPU measurement"}
                   if self.standin else {}),
            }
        return self._facts

    def plan_points(self, workload: Workload) -> list[Point]:
        c = self.coord
        if self.mode == "probe":
            return plan_probe_points(workload, self.knob_space, int(self.fingerprint()["sms"]))
        return plan_collective_points(workload, self.knob_space, c.world, c.gpus_per_node)

    def measure(self, points: list[Point], repeats: int, sink: RowSink) -> None:
        if any(p.kind == "iteration" for p in points):
            raise UserError("the nccl backend does not replay whole iterations; measure a plan with `lagom-tune apply`")
        jobs: tuple = ()
        said: set[str] = set()  # the user's variables a batch set aside, each said once
        for i, batch in enumerate(batches(points)):
            observing = batch.process == OBSERVING
            with tempfile.TemporaryDirectory(prefix="lagom-nccl-log-") if observing else contextlib.nullcontext() as log_dir:
                env, removed = worker_env(dict(batch.process), batch.ops, self.nccl_version, os.environ,
                                          self._observer() if observing else None, log_dir)
                if self.writer and set(removed) - said:
                    print(f"lagom-tune: the profile sets these itself and ignores yours: {', '.join(k for k in removed if k not in said)}"
                          + (" (while it times the collectives with nothing set)" if observing else ""))
                    said.update(removed)
                spec = WorkerSpec(self.coord.rank, self.coord.world, self.coord.local_rank, self.coord.gpus_per_node,
                                  self.coord.store_host, self.coord.store_port, f"lagom/{self.token}/{i}/", batch.points,
                                  repeats, self.options.timeout_s, self.standin, jobs)
                jobs = self._run_batch(spec, env, sink)
        self.coord.finish()

    def _observer(self) -> str | None:
        """The tuner plugin that observes NCCL's own choices (built with ``cc`` once per machine),
        or None, said once, where it cannot be built: NCCL's log then says them alone."""
        if self.standin:  # gloo makes no choice to observe
            return None
        build = ensure_plugin()
        if not build.ok and self.writer:
            print(f"lagom-tune: NCCL's own algorithm and protocol are read from its log alone (the tuner plugin: {build.reason})")
        return str(build.path) if build.ok else None

    def _run_batch(self, spec: WorkerSpec, env: dict[str, str], sink: RowSink) -> tuple:
        """Measure one batch in a worker of its own; returns the overlapped jobs it knows (for the next)."""
        import torch

        ctx = torch.multiprocessing.get_context("spawn")
        results = ctx.Queue()
        with _environ(env):  # a spawned process starts with the parent's environment of the moment
            proc = ctx.Process(target=worker_main, args=(spec, results, os.getpid()), daemon=True)
            start_shielded(proc)
        try:
            for i, point in enumerate(spec.points):
                mine = _next_rows(proc, results, i, spec, len(spec.points))
                everyone = self.coord.all_gather(mine)
                failed = [(r, m[1]) for r, m in enumerate(everyone) if m[0] == "error"]
                if failed:
                    r, why = failed[0]
                    raise RunError(f"rank {r}: {why}", hint="rerun the same command to resume from the last completed point")
                if self.writer:
                    sink(point, reduce_ranks(point, [m[1] for m in everyone]))
            return _await_done(proc, results, spec.timeout_s)
        except BaseException:  # a stop or a failure: nothing the worker measures now has a reader
            proc.terminate()
            raise
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _next_rows(proc, results, i: int, spec: WorkerSpec, total: int) -> tuple:
    """This rank's rows for point ``i``, or ("error", why) if its worker failed or went quiet."""
    deadline = time.monotonic() + spec.timeout_s
    while time.monotonic() < deadline:
        try:
            msg = results.get(timeout=0.5)
        except queue.Empty:
            if not proc.is_alive():
                return ("error", f"worker died (exit code {proc.exitcode}) at point {i + 1} of {total} of its batch")
            continue
        if msg[0] == "error":
            return ("error", msg[1])
        if msg[0] == "rows" and msg[1] == i:
            return ("rows", msg[2])
    proc.kill()
    return ("error", f"worker made no progress for {spec.timeout_s:.0f} s at point {i + 1} of {total} of its batch")


def _await_done(proc, results, timeout_s: float) -> tuple:
    """The worker's overlapped jobs, once it has finished its last point."""
    try:
        msg = results.get(timeout=timeout_s)
    except queue.Empty:
        raise RunError("a worker did not finish after its last point", hint="rerun to resume") from None
    if msg[0] == "error":
        raise RunError(f"worker failed while finishing: {msg[1]}")
    return msg[1]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain_text(text: str) -> str:
    """``text`` without terminal escape codes (nvidia-smi underlines its headers even into a pipe).

    Args:
        text: a command's output.
    Returns:
        The text without ANSI escapes.
    """
    return ANSI_ESCAPE.sub("", text)


def _topology(standin: bool) -> str | None:
    """``nvidia-smi topo -m``: how this node's GPUs are linked (NVLink, PCIe switch, ...)."""
    return None if standin else (plain_text(_run(["nvidia-smi", "topo", "-m"])) or None)


GPU_NAME, NVLINKS = re.compile(r"GPU\d+"), re.compile(r"NV\d+")


def nvlink_between_gpus(topology: str | None) -> bool:
    """Whether every pair of a node's GPUs is linked by NVLink, read from ``nvidia-smi topo -m``.

    Args:
        topology: its output (tab-separated: a header of columns, then a row per GPU whose
            cells say how it reaches each column: ``X`` itself, ``NV<n>`` n NVLinks, ``PIX``,
            ``PXB``, ``PHB``, ``NODE`` or ``SYS`` a PCIe path), or None where it did not run.
    Returns:
        True when the matrix shows two GPUs or more and NVLink between every pair; False
        otherwise, unknown included (so nothing NCCL may refuse is offered).
    """
    lines = [line for line in (topology or "").splitlines() if line.strip()]
    if not lines:
        return False
    columns = [cell.strip() for cell in lines[0].strip().split("\t")]
    gpus = [c for c in columns if GPU_NAME.fullmatch(c)]
    if len(gpus) < 2 or columns[:len(gpus)] != gpus:
        return False
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split("\t")]
        if GPU_NAME.fullmatch(cells[0]):
            rows[cells[0]] = cells[1:1 + len(gpus)]
    if set(rows) != set(gpus):
        return False
    return all(len(cells) == len(gpus) and all(NVLINKS.fullmatch(cell) for peer, cell in zip(gpus, cells) if peer != gpu)
               for gpu, cells in rows.items())
