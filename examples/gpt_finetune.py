"""Train a GPT with SCAPE through PyTorch Lightning: ``Trainer(strategy="scape")``, here
``Trainer(strategy=lightning_scape.ScapeStrategy(sparsity=..., warmup_steps=...))``.

Offline, on 2 CPU processes, in a few minutes (on GPUs, the same command uses them)::

    python examples/gpt_finetune.py                                  # small GPT, tiny Shakespeare
    python examples/gpt_finetune.py --baseline                       # and dense DDP + AdamS, on the same plot
    python examples/gpt_finetune.py --sparsity 0                     # the dense baseline alone
    python examples/gpt_finetune.py --model smollm2-135m --max-steps 40 --batch-size 4 --val-batches 8
    python examples/gpt_finetune.py --model gpt2 --data my_notes.txt # any hub model, when online
    torchrun --nnodes 2 --nproc-per-node 2 ... examples/gpt_finetune.py --num-nodes 2   # on each of 2 machines

It validates (perplexity) before and after, then prints validation loss and perplexity, tokens/s,
the bytes each rank sent against what dense DDP would have sent, and writes ``summary.json`` and
a PNG of validation loss against steps and bytes sent (with ``--baseline``, both runs).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from torchmetrics.text import Perplexity

import lightning_scape  # registers Trainer(strategy="scape"); ScapeStrategy(...) picks the settings
from scape_core import AdamS

from common import (
    HelpFormatter,
    ProgressLines,
    TokenBlocks,
    add_training_args,
    check_training_args,
    conclude,
    cosine_decay,
    load_model_and_corpus,
    next_token_loss,
    planned_runs,
    report,
)


class CausalLM(pl.LightningModule):
    """Next-token cross-entropy for any Hugging Face causal LM; perplexity on validation."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, max_steps: int) -> None:
        super().__init__()
        self.model, self.lr, self.weight_decay, self.max_steps = model, lr, weight_decay, max_steps
        self.val_perplexity = Perplexity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = next_token_loss(self.model, *batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_perplexity.update(self(x).float(), y)

    def on_validation_epoch_end(self) -> None:
        perplexity = self.val_perplexity.compute()  # synchronized over ranks by torchmetrics
        self.val_perplexity.reset()
        self.log_dict({"val_loss": perplexity.log(), "val_ppl": perplexity}, prog_bar=True)

    def configure_optimizers(self):
        # ScapeStrategy turns this AdamS (or an AdamW / Adam) into ScapeAdamS; the scheduler follows it
        optimizer = AdamS(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=self.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_decay(self.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Recorder(pl.Callback):
    """Rank 0's loss curve, the time spent in training steps, SCAPE's bytes after warm-up and at each validation."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.train: list[tuple[int, float]] = []
        self.val: dict[int, tuple[float, float]] = {}  # step -> (validation loss, bytes sent so far)
        self.seconds = 0.0
        self.warmup_stats: dict[str, float] | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.seconds += time.perf_counter() - self._start
        self.train.append((trainer.global_step, float(outputs["loss"])))
        if trainer.global_step == self.warmup_steps:
            self.warmup_stats = scape_stats(trainer)

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            sent = (scape_stats(trainer) or {}).get("bytes_sent", 0.0)
            self.val[trainer.global_step] = (float(trainer.callback_metrics["val_loss"]), sent)


class Progress(pl.Callback):
    """Rank 0 prints where the run is every ``every`` seconds while stdout is not a terminal (a file, a
    pipe), where Lightning's progress bar is off."""

    def __init__(self, max_steps: int, every: float = 20.0) -> None:
        self.max_steps, self.lines = max_steps, ProgressLines(every=every)

    def say(self, trainer: pl.Trainer, text: str) -> None:
        if trainer.is_global_zero:
            self.lines.say(text)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.say(trainer, f"step {trainer.global_step} of {self.max_steps}, train loss {float(outputs['loss']):.3f}")

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.say(trainer, f"validating at step {trainer.global_step}: batch {batch_idx + 1}")


def scape_stats(trainer: pl.Trainer) -> dict[str, float] | None:
    """``ScapeState.stats()`` of the strategy, or ``None`` when the run does not use SCAPE."""
    state = getattr(trainer.strategy, "scape_state", None)
    return None if state is None else dict(state.stats())


def on_gpu(args: argparse.Namespace) -> bool:
    return args.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--devices", type=int, default=None,
                   help="processes: default every GPU on a machine with two or more, else 2 on the CPU (SCAPE needs "
                        "several processes to have something to exchange)")
    p.add_argument("--accelerator", default="auto", help="auto (GPUs when there are any), cpu, gpu...")
    p.add_argument("--num-nodes", type=int, default=1,
                   help="machines; above 1, start this script on each with torchrun (README, Multi-node)")
    add_training_args(p, out="runs/gpt_finetune")
    args = check_training_args(p, p.parse_args(argv))
    if args.devices is None and on_gpu(args) and torch.cuda.device_count() == 1 and args.accelerator == "auto":
        args.accelerator, args.devices = "cpu", 2
        print("one GPU here: SCAPE exchanges between processes, so this run trains 2 processes on the CPU; "
              "--accelerator gpu --devices 1 trains one process on the GPU, with SCAPE off", flush=True)
    if args.devices is None:
        args.devices = torch.cuda.device_count() if on_gpu(args) else 2
    elif args.devices < 1:
        p.error(f"--devices must be >= 1, got {args.devices}")
    if args.devices * args.num_nodes == 1:
        print("one process: SCAPE has nothing to exchange and is off (dense AdamS); --devices 2 or more to use it",
              flush=True)
    if args.num_nodes < 1:
        p.error(f"--num-nodes must be >= 1, got {args.num_nodes}")
    return args


def train(args: argparse.Namespace) -> dict:
    """One run (rank 0 returns its summary, the other ranks ``{}``)."""
    pl.seed_everything(args.seed, verbose=False)
    model, corpus = load_model_and_corpus(args.model, args.block_size, args.data)
    train = DataLoader(TokenBlocks(corpus.train, args.block_size), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    val = DataLoader(TokenBlocks(corpus.val, args.block_size), batch_size=args.batch_size)
    steps_per_epoch = len(train) // (args.devices * args.num_nodes)
    module = CausalLM(model, args.lr, args.weight_decay, args.max_steps)
    recorder = Recorder(args.warmup_steps)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        strategy=lightning_scape.ScapeStrategy(sparsity=args.sparsity, warmup_steps=args.warmup_steps,
                                                ramp_steps=args.ramp_steps, wire=args.wire),
        max_steps=args.max_steps, max_epochs=math.ceil(args.max_steps / max(steps_per_epoch, 1)),
        val_check_interval=args.val_every, check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches, num_sanity_val_steps=0, callbacks=[recorder, Progress(args.max_steps)],
        logger=pl.loggers.CSVLogger(args.out, name="logs"), log_every_n_steps=10, enable_checkpointing=False,
        enable_model_summary=False,  # the summary at the end says the model's size
        enable_progress_bar=sys.stdout.isatty(),  # in a log file, Progress's lines every 20 s instead
        precision="bf16-mixed" if on_gpu(args) and torch.cuda.is_bf16_supported() else "32-true",
    )
    before = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    trainer.fit(module, train, val)
    if trainer.global_step not in recorder.val:  # the last step was not validated yet (on every rank)
        trainer.validate(module, val, verbose=False)
    if not trainer.is_global_zero:
        return {}

    device = trainer.accelerator.__class__.__name__.replace("Accelerator", "").lower()
    val_curve = [(step, loss, sent) for step, (loss, sent) in sorted(recorder.val.items())]
    return report(args, how="with Lightning", model=model, source=corpus.source, world_size=trainer.world_size,
                  device=device, val_before=before, val_after=val_curve[-1][1],
                  seconds=recorder.seconds, train_curve=recorder.train, val_curve=val_curve,
                  stats=scape_stats(trainer), warmup_stats=recorder.warmup_stats)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    for name in ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("💡 Tip"))  # adverts
    for noise in (".*does not have many workers.*", ".*LeafSpec.*", ".*sync_dist=True.*",
                  ".*Using `DistributedSampler` with the dataloaders.*"):
        warnings.filterwarnings("ignore", noise)
    results = [train(run) for run in planned_runs(args)]  # --baseline: dense DDP + AdamS first
    if results[-1]:  # rank 0
        conclude(results, args.out)
    return results


if __name__ == "__main__":
    main()
