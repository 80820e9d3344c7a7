"""A plain script with DDP and a direct all_reduce: it reports what ran, knowing nothing of lagom-tune."""

import datetime
import json
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 1024))
(model(torch.randn(4, 256) * (rank + 1)).sum()).backward()
grads = torch.cat([p.grad.view(-1) for p in model.parameters()])
everyone = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, grads)
big = torch.full((600_000,), float(rank + 1))  # 2.4 MB: above a 1 MiB chunk
dist.all_reduce(big)
with open(f"{out}.rank{rank}", "w") as f:
    json.dump({"comm_hook": model._get_ddp_logging_data().get("comm_hook"),
               "grads_equal": all(torch.equal(everyone[0], g) for g in everyone),
               "all_reduce_ok": bool(torch.all(big == 3.0))}, f)
dist.destroy_process_group()
