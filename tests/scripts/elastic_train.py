"""A torchrun job that checkpoints every few steps and resumes from the last checkpoint.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/elastic_train.py OUT [--fail-at N]

With ``--fail-at N`` rank 1 kills itself once, at step N (a marker file prevents a second death);
torchrun restarts every worker, which resume from the last checkpoint. Each rank finally writes
a hash of its parameters, momenta and residuals to OUT/rank{r}.txt.
"""

import argparse
import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, load_checkpoint, save_checkpoint, scape_hook


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def init_after_restart(backend: str) -> None:
    """init_process_group that survives torchrun restarts.

    torch 2.13's env:// init under torchrun reuses the previous attempt's store keys, so gloo
    connects to the dead workers' old ports after a restart ("connectFullMesh failed"). Keying
    the store by the restart count gives every attempt its own rendezvous.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--fail-at", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_after_restart("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    ddp = DDP(model)
    state = ScapeState(ddp, sparsity=0.9, warmup_steps=3)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)
    ckpt = args.out / "ckpt.pt"
    start = 0
    if ckpt.exists():
        start = load_checkpoint(ckpt, state, model=model, optimizer=opt)["step"]
        print(f"rank {rank}: resumed at step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
    for step in range(start, args.steps):
        if step == args.fail_at and rank == 1 and not (args.out / "died").exists():
            (args.out / "died").touch()
            os._exit(1)  # a crash, not an exception: no cleanup
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        (ddp(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            save_checkpoint(ckpt, state, model=model, optimizer=opt, step=step + 1)
    moments = [opt.state[p]["exp_avg"] for p in model.parameters()]
    residuals = [state.residuals[n] for n in sorted(state.residuals)]
    (args.out / f"rank{rank}.txt").write_text(
        f"{digest(model.parameters())} {digest(moments)} {digest(residuals)} {state.step}\n")
    state.wait()  # the next mask's all-gather is still in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
