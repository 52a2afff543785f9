"""SCAPE with Hugging Face Accelerate: ``ScapePlugin().prepare(accelerator, ...)`` instead of ``accelerator.prepare``.

Two processes (CPU here: without a GPU the script asks Accelerate for CPU processes; on a GPU
machine set ``--num_processes`` to the GPUs)::

    accelerate-scape launch --multi_gpu --num_processes 2 examples/accelerate_gpt.py
    accelerate-scape config --sparsity 0.9 --warmup_steps 30      # once: writes scape_config.yaml
    accelerate-scape launch --multi_gpu --num_processes 2 --sparsity 0.95 examples/accelerate_gpt.py
    torchrun --standalone --nproc_per_node 2 examples/accelerate_gpt.py   # works too

SCAPE's settings come from ``--sparsity`` / ``--warmup-steps`` / ``--ramp-steps`` / ``--wire`` given
to this script, else from ``accelerate-scape launch`` flags, ``SCAPE_*`` variables or
``scape_config.yaml``, else the examples' defaults (0.99, 30, 90, auto: as ``gpt_finetune.py``).
Same data, model and options as ``gpt_finetune.py`` (``--baseline`` too).
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

from common import (
    SCAPE_DEFAULTS,
    HelpFormatter,
    ProgressLines,
    TokenBlocks,
    add_training_args,
    check_training_args,
    conclude,
    cosine_decay,
    count_parameters,
    evaluate,
    forever,
    launcher_scape_settings,
    load_model_and_corpus,
    next_token_loss,
    planned_runs,
    report,
)


def train(args: argparse.Namespace, accelerator: Accelerator) -> dict:
    """One run (the main process returns its summary, the others ``{}``)."""
    set_seed(args.seed)
    model, corpus = load_model_and_corpus(args.model, args.block_size, args.data)
    train = DataLoader(TokenBlocks(corpus.train, args.block_size), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    val = DataLoader(TokenBlocks(corpus.val, args.block_size), batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    # a prepared scheduler takes one step per process at each optimizer step (Accelerate's convention)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_decay(args.max_steps * accelerator.num_processes))

    # --- SCAPE: the plugin prepares everything and turns AdamW into ScapeAdamS ---
    scape = ScapePlugin(max_steps=args.max_steps, **launcher_scape_settings(args))  # max_steps: for its warning
    model, optimizer, train, val, scheduler = scape.prepare(accelerator, model, optimizer, train, val, scheduler)
    # ---------------------------------------------------------------------------
    for name in SCAPE_DEFAULTS:  # as resolved, for the summary
        setattr(args, name, getattr(scape.config, name))

    if not scape.active:
        accelerator.print("one process: SCAPE has nothing to communicate. Launch several, e.g. "
                          "accelerate-scape launch --multi_gpu --num_processes 2 examples/accelerate_gpt.py")
    unwrapped = accelerator.unwrap_model(model)
    before = evaluate(unwrapped, val, args.val_batches)
    accelerator.print(f"{args.model}: {count_parameters(unwrapped) / 1e6:.1f}M parameters, "
                      f"{accelerator.num_processes} processes; val loss {before:.3f}")
    batches = forever(train)
    seconds, warmup_stats, train_curve, val_curve = 0.0, None, [], [(0, before, 0.0)]
    progress = ProgressLines(main=accelerator.is_main_process)  # a log file gets lines, not a bar's returns
    bar = tqdm(range(1, args.max_steps + 1), disable=not accelerator.is_main_process or progress.enabled,
               desc="training")
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
        progress.say(f"step {step} of {args.max_steps}, train loss {loss.item():.3f}")
        if step == args.warmup_steps:
            warmup_stats = scape.stats()
        if step % args.val_every == 0 or step == args.max_steps:
            val_loss, stats = evaluate(unwrapped, val, args.val_batches), scape.stats()
            val_curve.append((step, val_loss, stats.get("bytes_sent", 0.0)))
            bar.set_postfix(loss=f"{loss.item():.3f}", val_loss=f"{val_loss:.3f}",
                            compression=f"{stats.get('compression', 1.0):.1f}x")
    bar.close()
    scape.log_summary()  # the main process: whether SCAPE paid (its sparse steps against its dense warm-up)
    if not accelerator.is_main_process:
        return {}
    return report(args, how="with Accelerate", model=unwrapped, source=corpus.source, device=accelerator.device.type,
                  world_size=accelerator.num_processes, val_before=before, val_after=val_loss, seconds=seconds,
                  train_curve=train_curve, val_curve=val_curve, stats=scape.stats() or None, warmup_stats=warmup_stats)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_training_args(p, out="runs/accelerate_gpt")
    args = check_training_args(p, p.parse_args(argv), fill_scape=False)  # unset: Accelerate-side settings decide

    cuda = torch.cuda.is_available()
    # cpu=True lets torchrun / `launch --multi_gpu` start several CPU processes (gloo) on a machine without GPUs
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda and torch.cuda.is_bf16_supported() else "no")
    results = [train(run, accelerator) for run in planned_runs(args)]  # --baseline: dense DDP + AdamS first
    if accelerator.is_main_process:
        conclude(results, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
