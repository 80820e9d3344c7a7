"""DDP models as real scripts build them, knowing nothing of lagom-tune: over one dimension of a 2-D
DeviceMesh (``device_mesh=``, as torchtitan's DDP and ``replicate`` do), one whose script registers
its own comm hook, one with sparse gradients, and a plain one. One training step each; reports each
model's bucket cap and comm hook."""

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
own = DDP(torch.nn.Linear(64, 64), device_mesh=mesh["dp"])
own.register_comm_hook(None, default_hooks.fp16_compress_hook)
sparse = DDP(torch.nn.Embedding(32, 8, sparse=True), device_mesh=mesh["dp"])
plain = DDP(torch.nn.Linear(64, 64), device_mesh=mesh["dp"])
own(torch.randn(4, 64)).sum().backward()
sparse(torch.tensor([1, 2, 3])).sum().backward()
plain(torch.randn(4, 64)).sum().backward()
with open(f"{out}.rank{rank}", "w") as f:
    json.dump({"caps": [m.bucket_bytes_cap for m in (own, sparse, plain)],
               "hooks": [m._get_ddp_logging_data().get("comm_hook", "") for m in (own, sparse, plain)]}, f)
dist.destroy_process_group()
