"""SCAPE in a plain PyTorch DDP loop: register ``scape_hook`` by hand, train with ``ScapeAdamS``.

    torchrun --standalone --nproc_per_node 2 examples/ddp_hook.py
    torchrun --standalone --nproc_per_node 2 examples/ddp_hook.py --max-steps 50 --sparsity 0.9
    torchrun --standalone --nproc_per_node 2 examples/ddp_hook.py --baseline   # and dense DDP + AdamS

Same data, model and options as ``gpt_finetune.py``; the SCAPE part is the four lines marked below.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from scape_core import ScapeAdamS, ScapeState, scape_hook

from common import (
    HelpFormatter,
    TokenBlocks,
    add_training_args,
    check_training_args,
    conclude,
    cosine_decay,
    count_parameters,
    describe_scape,
    evaluate,
    forever,
    load_model_and_corpus,
    next_token_loss,
    planned_runs,
    report,
)


def train(args: argparse.Namespace, device: torch.device) -> dict:
    """One run in the initialized process group (rank 0 returns its summary, the other ranks ``{}``)."""
    cuda, rank, world = device.type == "cuda", dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model, corpus = load_model_and_corpus(args.model, args.block_size, args.data)
    train_set, val_set = TokenBlocks(corpus.train, args.block_size), TokenBlocks(corpus.val, args.block_size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    val = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))

    ddp = DistributedDataParallel(model.to(device), device_ids=[device.index] if cuda else None,
                                  gradient_as_bucket_view=True)  # SCAPE reads and writes the buckets
    # --- SCAPE: a state, the hook, and the optimizer that pairs with it ---
    state = ScapeState(ddp, sparsity=args.sparsity, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps,
                       wire=args.wire, max_steps=args.max_steps)  # max_steps: warns if the run ends too soon
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    # ----------------------------------------------------------------------
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, cosine_decay(args.max_steps))

    before = evaluate(ddp.module, val, args.val_batches)
    if rank == 0:
        print(f"{args.model}: {count_parameters(model) / 1e6:.1f}M parameters, {world} ranks, "
              f"{describe_scape(args)}; val loss {before:.3f}")
    batches = forever(train)
    seconds, warmup_stats, train_curve, val_curve = 0.0, None, [], [(0, before, 0.0)]
    for step in range(1, args.max_steps + 1):
        x, y = (t.to(device) for t in next(batches))
        start = time.perf_counter()
        loss = next_token_loss(ddp, x, y)
        loss.backward()  # scape_hook stages each bucket into the step's one compact buffer, exchanged after the last
        opt.step()  # masked AdamS update, then the next mask is selected
        opt.zero_grad(set_to_none=True)
        schedule.step()
        seconds += time.perf_counter() - start
        train_curve.append((step, loss.item()))
        if step == args.warmup_steps:
            warmup_stats = state.stats()
        if step % args.val_every == 0 or step == args.max_steps:
            val_loss, stats = evaluate(ddp.module, val, args.val_batches), state.stats()
            val_curve.append((step, val_loss, stats["bytes_sent"]))
            if rank == 0:
                print(f"step {step:5d}  train loss {loss.item():.3f}  val loss {val_loss:.3f}  "
                      f"compression so far {stats['compression']:.1f}x", flush=True)
    state.log_summary()  # rank 0: whether SCAPE paid (its sparse steps against its dense warm-up)

    result = {}
    if rank == 0:
        result = report(args, how="via the DDP comm hook", model=model, source=corpus.source, world_size=world,
                        device=device.type, val_before=before, val_after=val_loss, seconds=seconds,
                        train_curve=train_curve, val_curve=val_curve, stats=state.stats(), warmup_stats=warmup_stats)
        print(f"  state.stats()     {state.stats()}")
    state.wait()  # no SCAPE collective in flight when the next run starts or the process group goes
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_training_args(p, out="runs/ddp_hook")
    args = check_training_args(p, p.parse_args(argv))
    if "LOCAL_RANK" not in os.environ:
        p.error("launch with torchrun, e.g. torchrun --standalone --nproc_per_node 2 examples/ddp_hook.py")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    results = [train(run, device) for run in planned_runs(args)]  # --baseline: dense DDP + AdamS first
    if dist.get_rank() == 0:
        conclude(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
