"""A plain DDP script that has never heard of lagom-tune: it reports what DDP is using. Like a
DataLoader worker or a tool, a helper Python process it starts inherits its RANK."""

import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

out, exit_code = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
model(torch.randn(4, 64)).sum().backward()
subprocess.run([sys.executable, "-c", "import torch"], check=True)
with open(f"{out}.rank{dist.get_rank()}", "w") as f:
    json.dump({"bucket_bytes_cap": model.bucket_bytes_cap, "threads": torch.get_num_threads(),
               "omp": os.environ.get("OMP_NUM_THREADS")}, f)
dist.destroy_process_group()
sys.exit(exit_code)
