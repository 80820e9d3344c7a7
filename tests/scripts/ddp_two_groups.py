"""A script with two DDP models: one over every rank, one over a group of this rank alone (a
group no role of a two-rank plan has). It reports each model's bucket cap."""

import datetime
import json
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # every rank makes every group
world = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
own = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64), process_group=alone)
with open(f"{out}.rank{rank}", "w") as f:
    json.dump({"world": world.bucket_bytes_cap, "own": own.bucket_bytes_cap}, f)
dist.destroy_process_group()
