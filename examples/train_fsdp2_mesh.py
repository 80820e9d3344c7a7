"""A small MLP trained with FSDP2 and tensor parallelism on a DeviceMesh. It knows nothing about lagom-tune.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2_mesh.py --tp 2 --steps 5
    lagom-tune apply plan.yaml -- torchrun --standalone --nproc-per-node 4 examples/train_fsdp2_mesh.py --tp 2
    lagom-tune apply plan.yaml -- torchrun --standalone --nproc-per-node 4 examples/train_fsdp2_mesh.py --replicate 2 --tp 1

The mesh's dimensions are named as torchtitan names them (``dp_shard`` x ``tp``; with
``--replicate N``, HSDP: ``dp_replicate`` x ``dp_shard`` x ``tp``), so a plan whose communicator
roles carry those names reaches each dimension's groups. Runs on CPU with gloo (or on
GPUs with NCCL, ``--device cuda``). ``--metrics FILE`` (rank 0) records the median step time and
every process group this rank is in, with its ranks and mesh dimension.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

try:  # FSDP2; torch < 2.6 has it under _composable
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import fully_shard


class Block(nn.Module):
    """A residual MLP block: the up projection splits by columns over ``tp``, the down one by rows."""

    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, d: int, ffn: int, layers: int, classes: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, ffn) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(args, mesh) -> nn.Module:
    """The model, tensor-parallel over ``mesh["tp"]`` and sharded (FSDP2) over ``mesh["dp_shard"]``,
    replicated over ``mesh["dp_replicate"]`` where the mesh has it (HSDP)."""
    torch.manual_seed(0)  # every rank starts from the same weights
    model = Model(args.hidden, args.ffn, args.layers, args.classes).to(args.device)
    if mesh["tp"].size() > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # FSDP2 runs HSDP when given a 2-D (replicate, shard) mesh
    data = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in mesh.mesh_dim_names else mesh["dp_shard"]
    for block in model.blocks:
        fully_shard(block, mesh=data)
    fully_shard(model, mesh=data)
    return model


def groups_of_this_rank(mesh) -> list[dict]:
    """Each process group this rank is in: the world group and one per mesh dimension."""
    out = [{"group": "world", "ranks": dist.get_process_group_ranks(dist.group.WORLD)}]
    for name in mesh.mesh_dim_names:
        group = mesh.get_group(name)
        out.append({"group": name, "ranks": dist.get_process_group_ranks(group)})
    return out


def gloo_averages(group) -> bool:
    """Whether this torch's gloo reduces with ``ReduceOp.AVG``: FSDP2's HSDP all-reduce averages fp32
    gradients with it, and torch 2.7's gloo refuses it ("Cannot use ReduceOp.AVG with Gloo", raised
    on every rank alike, so none waits on another); 2.8 and later average."""
    try:
        dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.AVG, group=group)
    except RuntimeError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; the rest of the ranks shard (FSDP2)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP: replicas of the sharded group (dp_replicate); 1: plain FSDP2")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="samples per data-parallel rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--metrics", help="rank 0 writes its median step time and its process groups here (JSON)")
    args = p.parse_args()

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        # binding the device makes DeviceMesh split its groups from the world's (ncclCommSplit)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    if args.tp < 1 or args.replicate < 1 or world % (args.tp * args.replicate):
        raise SystemExit(f"--tp {args.tp} x --replicate {args.replicate} does not divide the world size {world}")
    shard = world // (args.tp * args.replicate)
    if args.replicate > 1:
        mesh = init_device_mesh(args.device, (args.replicate, shard, args.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        if args.device == "cpu" and not gloo_averages(mesh.get_group("dp_replicate")):  # said now, not as a traceback mid-step
            raise SystemExit(1 if dist.get_rank() else f"torch {torch.__version__}'s gloo cannot average (ReduceOp.AVG), which "
                             "FSDP2's HSDP all-reduce uses: run without --replicate, on torch 2.8 or later, or on GPUs (--device cuda)")
    else:
        mesh = init_device_mesh(args.device, (shard, args.tp), mesh_dim_names=("dp_shard", "tp"))
    model = build(args, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Each data-parallel rank draws its own batch; the ranks of one tp group share it.
    data_rank = mesh["dp_shard"].get_local_rank() + shard * (mesh["dp_replicate"].get_local_rank() if args.replicate > 1 else 0)
    gen = torch.Generator().manual_seed(1234 + data_rank)
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.hidden, generator=gen).to(args.device)
        y = torch.randint(0, args.classes, (args.batch,), generator=gen).to(args.device)
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)

    if dist.get_rank() == 0:
        ms = statistics.median(times) * 1e3
        print(f"median step {ms:.2f} ms over {args.steps} steps, mesh {tuple(mesh.shape)} ({', '.join(mesh.mesh_dim_names)}), "
              f"loss {loss.item():.4f}")
        if args.metrics:
            with open(args.metrics, "w") as f:
                json.dump({"median_step_ms": ms, "mesh": list(mesh.shape), "dims": list(mesh.mesh_dim_names),
                           "groups": groups_of_this_rank(mesh), "loss": loss.item()}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
