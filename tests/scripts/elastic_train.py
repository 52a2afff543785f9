"""A torchrun job that checkpoints every few steps and resumes from the last checkpoint.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/elastic_train.py OUT [--fail-at N]

With ``--fail-at N`` rank 1 kills itself once, at step N (a marker file prevents a second death);
torchrun restarts every worker, which resume from the last checkpoint. Each rank finally writes
a hash of its parameters, momenta and residuals to OUT/rank{r}.txt, its parameters to
OUT/rank{r}.pt, and where it ran (node, network namespace, the launcher's variables) to
OUT/rank{r}.json. ``--step-seconds`` slows the steps down so that a harness can kill a node or cut
its link mid-training (benchmarks/multinode.py); ``--timeout`` bounds every collective.
"""

import argparse
import datetime
import hashlib
import json
import os
import time
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


def init_after_restart(backend: str, timeout: float | None = None) -> None:
    """init_process_group that survives torchrun restarts.

    By default torch 2.13's torchrun shares its agent's TCPStore with the workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``), and env:// init after a restart reuses the previous
    attempt's keys, so gloo connects to the dead workers' old ports ("connectFullMesh failed").
    Keying the store by the restart count gives every attempt its own rendezvous on one node.
    Across nodes the counts can differ (an agent restarting its workers because another node
    re-joined does not count a restart), so multi-node jobs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
    every rendezvous round then gets a fresh store on worker rank 0, and plain env:// init is right.
    """
    limit = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **limit)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, **limit)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **limit)


def where() -> dict:
    """This worker's place in the job, as its launcher told it, and its network namespace."""
    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
             "GLOO_SOCKET_IFNAME")
    return {**{n: os.environ.get(n) for n in names}, "netns": os.readlink("/proc/self/ns/net")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--fail-at", type=int, default=-1)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step")
    ap.add_argument("--timeout", type=float, default=None, help="seconds any collective may take")
    ap.add_argument("--find-unused-parameters", action="store_true",
                    help="DDP keeps its first bucket layout (no rebuild): exact resume at 3+ ranks")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_after_restart("gloo", args.timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    ddp = DDP(model, find_unused_parameters=args.find_unused_parameters)
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
        time.sleep(args.step_seconds)
    moments = [opt.state[p]["exp_avg"] for p in model.parameters()]
    residuals = [state.residuals[n] for n in sorted(state.residuals)]
    (args.out / f"rank{rank}.txt").write_text(
        f"{digest(model.parameters())} {digest(moments)} {digest(residuals)} {state.step}\n")
    (args.out / f"rank{rank}.json").write_text(json.dumps(where()))
    torch.save([p.detach() for p in model.parameters()], args.out / f"rank{rank}.pt")
    state.wait()  # no SCAPE collective in flight when the process group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
