"""The runtime shim: applies a plan inside a rank without any change to the training script.

It imports nothing heavy at start-up. Settings are applied when the module they concern is
imported (a post-import hook on ``torch`` and on DDP's module), so processes that never use
torch (launchers, tools) pay nothing. Each rank logs every setting it applied and every one it
could not apply, with the reason, to stderr and to ``rank-N.json`` in the applied folder.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import inspect
import json
import os
import sys
from typing import Any, Callable

from lagom_tune.artifact_io import atomic_write_text
from lagom_tune.plan.schema import Plan, load_plan

DDP_MODULE = "torch.nn.parallel.distributed"
C10D_MODULE = "torch.distributed.distributed_c10d"
DDP_ROLE = "dp"  # the plan communicator whose settings DDP's gradient reduction takes


class _AfterImport(importlib.abc.MetaPathFinder):
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

        spec.loader = Loader()
        return spec


class Shim:
    """One process's appliers, and its record of what was applied and what could not be, and why."""

    def __init__(self, plan: Plan, plan_path: str, applied_dir: str | None):
        self.plan = plan
        self.plan_path = plan_path
        self.applied_dir = applied_dir
        self.records: list[dict[str, Any]] = []
        self.logged = 0
        self.built_ddp = False
        self.joined_rank: int | None = None  # the rank this process gave init_process_group itself
        self.pending = {}
        for knob in ("bucket_cap_mb", "chunk_bytes"):
            if plan.settings.communicators.get(DDP_ROLE, {}).get(knob):
                self.pending[knob] = "no DistributedDataParallel model was built in this process"

    @property
    def rank(self) -> str:
        if "RANK" in os.environ:
            return os.environ["RANK"]
        if self.joined_rank is not None and self.joined_rank >= 0:
            return str(self.joined_rank)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
        return f"pid{os.getpid()}"

    @property
    def is_rank(self) -> bool:
        """A training rank (launched by torchrun, joined a process group itself, or built a DDP model),
        not a launcher or helper."""
        return "RANK" in os.environ or self.joined_rank is not None or self.built_ddp

    def record(self, setting: str, value: Any, applied: bool, how: str) -> None:
        self.records.append({"setting": setting, "value": value, "applied": applied, "how": how})
        self.pending.pop(setting, None)
        self.flush()

    def flush(self) -> None:
        """Log new records to stderr and rewrite this rank's file (silent outside ranks)."""
        if not self.is_rank:
            return
        for r in self.records[self.logged:]:
            verb = "applied" if r["applied"] else "NOT applied"
            sys.stderr.write(f"[lagom-tune rank {self.rank}] {verb} {r['setting']}={r['value']} ({r['how']})\n")
        self.logged = len(self.records)
        if not self.applied_dir:
            return
        out = {"rank": self.rank, "pid": os.getpid(), "plan": self.plan_path, "records": self.records}
        atomic_write_text(os.path.join(self.applied_dir, f"rank-{self.rank}.json"), json.dumps(out, indent=1))

    def at_exit(self) -> None:
        if self.is_rank:
            for setting, why in list(self.pending.items()):
                self.record(setting, self.plan.settings.communicators.get(DDP_ROLE, {}).get(setting), False, why)

    # -- appliers ------------------------------------------------------------------------------

    def on_torch(self, torch) -> None:
        threads = self.plan.settings.process.get("threads")
        if threads is not None:
            torch.set_num_threads(int(threads))
            self.record("threads", int(threads), torch.get_num_threads() == int(threads), "torch.set_num_threads")

    def on_ddp(self, module) -> None:
        role = self.plan.settings.communicators.get(DDP_ROLE, {})
        cap, chunk = role.get("bucket_cap_mb"), int(role.get("chunk_bytes") or 0)
        if cap is None and not chunk:
            return
        ddp = module.DistributedDataParallel
        original = ddp.__init__
        signature = inspect.signature(original)
        shim = self

        def __init__(self, *args, **kwargs):
            bound = signature.bind_partial(self, *args, **kwargs)
            previous = bound.arguments.get("bucket_cap_mb")
            if cap is not None:
                bound.arguments["bucket_cap_mb"] = cap
            original(*bound.args, **bound.kwargs)
            shim.built_ddp = True
            if cap is not None:
                in_effect = getattr(self, "bucket_bytes_cap", None)
                how = "DistributedDataParallel(bucket_cap_mb=...)" + (f", replacing the script's {previous}" if previous is not None else "")
                shim.record("bucket_cap_mb", cap, in_effect == int(cap * 1024 * 1024), how)
            if chunk:
                try:
                    self.register_comm_hook(self.process_group, chunked_allreduce_hook(chunk))
                    shim.record("chunk_bytes", chunk, True, "DDP comm hook: each bucket all-reduced in chunks, all in flight")
                except RuntimeError as e:  # the script registered its own hook first
                    shim.record("chunk_bytes", chunk, False, f"DDP comm hook not registered: {e}")

        __init__.__wrapped__ = original
        ddp.__init__ = __init__


    def on_c10d_gloo(self, c10d) -> None:
        """Chunk synchronous ``all_reduce`` calls on the plan's communicator (its size matches)."""
        chunk = int(self.plan.settings.communicators.get(DDP_ROLE, {}).get("chunk_bytes") or 0)
        size = self.plan.groups.get(DDP_ROLE, self.plan.world_size)
        if not chunk:
            return
        original = c10d.all_reduce

        def all_reduce(tensor, op=c10d.ReduceOp.SUM, group=None, async_op=False):
            if (async_op or not tensor.is_contiguous() or tensor.numel() * tensor.element_size() <= chunk
                    or c10d.get_world_size(group) != size):
                return original(tensor, op=op, group=group, async_op=async_op)
            from lagom_tune.backends.gloo import chunked_all_reduce

            for work in chunked_all_reduce(original, tensor, chunk, op=op, group=group):
                work.wait()
            return None

        all_reduce.__wrapped__ = original
        c10d.all_reduce = all_reduce
        self.record("chunk_bytes[all_reduce]", chunk, True,
                    f"dist.all_reduce wrapper: synchronous calls above {chunk} B on groups of {size} ranks, in chunks")

    # -- NCCL plans: environment, tuner rules, per-communicator Options ------------------------

    def on_torch_nccl(self, torch) -> None:
        from lagom_tune.runtime.nccl import RULES_ENV

        if self.plan.rules:
            plugin, rules = os.environ.get("NCCL_TUNER_PLUGIN"), os.environ.get(RULES_ENV)
            ok = bool(plugin and rules) and os.path.isfile(plugin) and os.path.isfile(rules)
            self.record("collective_rules", len(self.plan.rules), ok,
                        f"NCCL_TUNER_PLUGIN={plugin} reads {RULES_ENV}={rules}" if ok else
                        "no tuner plugin in the environment (no C compiler when `apply` ran, or not run under "
                        "`lagom-tune apply`): only per-communicator CTA bounds apply")
        for name, value in self.plan.settings.process.items():
            var = {"threads": "NCCL_NTHREADS", "buffsize": "NCCL_BUFFSIZE"}.get(name)
            if var:
                self.record(name, value, os.environ.get(var) == str(value), f"{var} in the environment")

    def on_c10d(self, c10d) -> None:
        from lagom_tune.runtime import nccl

        configs = nccl.communicator_configs(self.plan)
        if not configs:
            return
        overridden = nccl.overriding_env(os.environ)
        shim = self

        def options_for(size: int, existing: Any):
            cfg = nccl.role_for(configs, size)
            if cfg is None:
                return existing
            if overridden:
                shim.record(f"ctas[{cfg.role}]", f"{cfg.min_ctas}..{cfg.max_ctas}", False,
                            f"{', '.join(overridden)} in the environment silently override every communicator's config")
                return existing
            opts = nccl.build_options(c10d.ProcessGroupNCCL.Options, cfg, existing)
            shim.record(f"ctas[{cfg.role}]", f"{cfg.min_ctas}..{cfg.max_ctas}", True,
                        f"ProcessGroupNCCL.Options for a group of {size} ranks")
            return opts

        def wrap(fn, size_of, joins: bool = False):
            signature = inspect.signature(fn)

            def wrapper(*args, **kwargs):
                bound = signature.bind_partial(*args, **kwargs)
                if joins:  # a process started without torchrun (mpirun, a plain script) is a rank too
                    shim.joined_rank = int(bound.arguments.get("rank", -1) if bound.arguments.get("rank") is not None else -1)
                backend = str(bound.arguments.get("backend") or "")
                if "nccl" in backend or (not backend and _cuda_available()):
                    bound.arguments["pg_options"] = options_for(size_of(bound.arguments), bound.arguments.get("pg_options"))
                return fn(*bound.args, **bound.kwargs)

            wrapper.__wrapped__ = fn
            return wrapper

        world = lambda a: int(a.get("world_size") if a.get("world_size", -1) != -1 else os.environ.get("WORLD_SIZE", 0) or 0)
        c10d.init_process_group = wrap(c10d.init_process_group, world, joins=True)
        c10d.new_group = wrap(c10d.new_group, lambda a: len(a["ranks"]) if a.get("ranks") else int(c10d.get_world_size()))


def chunked_allreduce_hook(chunk_bytes: int):
    """A DDP comm hook that averages each gradient bucket in chunks of ``chunk_bytes``."""

    def hook(process_group, bucket):
        import torch
        import torch.distributed as dist

        from lagom_tune.backends.gloo import chunked_all_reduce

        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        futures = [w.get_future() for w in chunked_all_reduce(dist.all_reduce, buf, chunk_bytes, group=group)]
        return torch.futures.collect_all(futures).then(lambda _: buf)

    return hook


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def install(plan_path: str, applied_dir: str | None = None) -> Shim:
    """Install the plan's settings in this process; returns the shim (its ``records`` say what happened)."""
    plan = load_plan(plan_path)
    shim = Shim(plan, plan_path, applied_dir)
    if plan.backend == "nccl":
        hooks = {"torch": shim.on_torch_nccl, C10D_MODULE: shim.on_c10d}
    else:
        hooks = {"torch": shim.on_torch, DDP_MODULE: shim.on_ddp, C10D_MODULE: shim.on_c10d_gloo}
    for name, hook in list(hooks.items()):
        if name in sys.modules:  # already imported (an explicit install() late in a script)
            hook(sys.modules[name])
            hooks.pop(name)
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))
    atexit.register(shim.at_exit)
    return shim


def install_from_env() -> Shim:
    return install(os.environ["LAGOM_TUNE_PLAN"], os.environ.get("LAGOM_TUNE_APPLIED_DIR"))
