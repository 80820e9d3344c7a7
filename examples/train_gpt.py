"""A small GPT-style model trained with DDP on synthetic tokens. It knows nothing about lagom-tune.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 10
    lagom-tune apply plans/demo-cpu.yaml -- torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

Prints the median step time; ``--metrics FILE`` (rank 0) also records it with the DDP bucket cap
and thread count that were in effect, so a run's settings can be checked from outside.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, ffn: int, layers: int, max_seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-seq", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--metrics", help="rank 0 writes its median step time and settings here (JSON)")
    p.add_argument("--trace", help="rank 0 records its last step with torch.profiler to this Chrome trace (JSON)")
    args = p.parse_args()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT(args.vocab, args.hidden, args.heads, args.ffn, args.layers, args.max_seq))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times = []
    total = args.warmup + args.steps
    for step in range(total):
        tokens = torch.randint(args.vocab, (args.mbs, args.seq + 1), generator=gen)
        tracing = args.trace and rank == 0 and step == total - 1
        if tracing:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            prof.__enter__()
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        if tracing:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(args.trace)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        if step >= args.warmup:
            times.append(elapsed.item())
    median_ms = statistics.median(times) * 1e3
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"median step {median_ms:.2f} ms over {len(times)} steps (loss {loss.item():.3f}, {params} parameters)")
        if args.metrics:
            report = {"median_step_ms": median_ms, "step_ms": [t * 1e3 for t in times], "parameters": params,
                      "bucket_cap_bytes": model.bucket_bytes_cap, "threads": torch.get_num_threads(),
                      "world_size": dist.get_world_size()}
            with open(args.metrics, "w") as f:
                json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
