"""A SCAPE rank that exits straight after a backward (``--steps`` full steps first).

gloo finishes the hook's all-reduce, and frees it, on its own thread; before scape_core held
its collectives (``scape_core.inflight``), this exit aborted about every second run with
"terminate called without an active exception". Launched by ``test_reliability.py``.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, scape_hook

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), bucket_cap_mb=0.01)  # several buckets
state = ScapeState(model, sparsity=0.9, warmup_steps=1)
model.register_comm_hook(state, scape_hook)
opt = ScapeAdamS(model.parameters(), state, lr=1e-3)
for _ in range(args.steps):
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
model(torch.randn(8, 64)).sum().backward()  # and exit at once: no step, no wait(), no teardown
