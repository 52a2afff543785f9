"""SCAPE with Hugging Face Accelerate: ``ScapePlugin().prepare(accelerator, ...)`` instead of ``accelerator.prepare``.

Two processes (CPU here: without a GPU the script asks Accelerate for CPU processes; on a GPU
machine set ``--num_processes`` to the GPUs)::

    accelerate-scape launch --multi_gpu --num_processes 2 examples/accelerate_gpt.py
    accelerate-scape config --sparsity 0.9 --warmup_steps 30      # once: writes scape_config.yaml
    accelerate-scape launch --multi_gpu --num_processes 2 --sparsity 0.95 examples/accelerate_gpt.py
    torchrun --standalone --nproc_per_node 2 examples/accelerate_gpt.py   # works too

SCAPE's settings come from ``--sparsity`` / ``--warmup-steps`` given to this script, else from
``accelerate-scape launch`` flags, ``SCAPE_*`` variables or ``scape_config.yaml``, else the defaults.
Same data, model and other options as ``gpt_finetune.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from accelerate_scape import ScapePlugin
from common import (HelpFormatter, TokenBlocks, add_training_args, check_training_args, cosine_decay,
                    count_parameters, evaluate, forever, load_model_and_corpus, next_token_loss, report)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_training_args(p, out="runs/accelerate_gpt")
    p.set_defaults(sparsity=None, warmup_steps=None, ramp_steps=None)  # unset: Accelerate-side settings decide
    args = check_training_args(p, p.parse_args(argv))

    cuda = torch.cuda.is_available()
    # cpu=True lets torchrun / `launch --multi_gpu` start several CPU processes (gloo) on a machine without GPUs
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda and torch.cuda.is_bf16_supported() else "no")
    set_seed(args.seed)
    model, corpus = load_model_and_corpus(args.model, args.block_size, args.data)
    train = DataLoader(TokenBlocks(corpus.train, args.block_size), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    val = DataLoader(TokenBlocks(corpus.val, args.block_size), batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    # a prepared scheduler takes one step per process at each optimizer step (Accelerate's convention)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_decay(args.max_steps * accelerator.num_processes))

    # --- SCAPE: the plugin prepares everything and turns AdamW into ScapeAdamS ---
    given = dict(sparsity=args.sparsity, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps, wire=args.wire)
    scape = ScapePlugin(**{k: v for k, v in given.items() if v is not None})
    model, optimizer, train, val, scheduler = scape.prepare(accelerator, model, optimizer, train, val, scheduler)
    # ---------------------------------------------------------------------------
    args.sparsity, args.warmup_steps, args.ramp_steps, args.wire = (
        scape.config.sparsity, scape.config.warmup_steps, scape.config.ramp_steps, scape.config.wire)  # as resolved

    if not scape.active:
        accelerator.print("one process: SCAPE has nothing to communicate. Launch several, e.g. "
                          "accelerate-scape launch --multi_gpu --num_processes 2 examples/accelerate_gpt.py")
    unwrapped = accelerator.unwrap_model(model)
    before = evaluate(unwrapped, val, args.val_batches)
    accelerator.print(f"{args.model}: {count_parameters(unwrapped) / 1e6:.1f}M parameters, "
                      f"{accelerator.num_processes} processes; val loss {before:.3f}")
    batches = forever(train)
    seconds, warmup_stats, train_curve, val_curve = 0.0, None, [], [(0, before)]
    bar = tqdm(range(1, args.max_steps + 1), disable=not accelerator.is_main_process, desc="training")
    for step in bar:
        x, y = next(batches)
        start = time.perf_counter()
        with accelerator.autocast():
            loss = next_token_loss(model, x, y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
        train_curve.append((step, loss.item()))
        if step == args.warmup_steps:
            warmup_stats = scape.stats()
        if step % args.val_every == 0 or step == args.max_steps:
            val_loss = evaluate(unwrapped, val, args.val_batches)
            val_curve.append((step, val_loss))
            bar.set_postfix(loss=f"{loss.item():.3f}", val_loss=f"{val_loss:.3f}",
                            compression=f"{scape.stats().get('compression', 1.0):.1f}x")

    if accelerator.is_main_process:
        bar.close()
        report(args, how="with Accelerate", model=unwrapped, source=corpus.source, device=accelerator.device.type,
               world_size=accelerator.num_processes, val_before=before, val_after=val_loss, seconds=seconds,
               train_curve=train_curve, val_curve=val_curve, stats=scape.stats() or None, warmup_stats=warmup_stats)
    accelerator.end_training()


if __name__ == "__main__":
    main()
