"""Train a GPT with SCAPE through ``transformers.Trainer``: ``accelerate_scape.trainer.ScapeTrainer``
instead of ``Trainer``.

Offline, on 2 CPU processes (without a launcher the script starts them itself, with torchrun)::

    python examples/hf_trainer.py                                        # small GPT, tiny Shakespeare
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py      # the same
    accelerate-scape launch --multi_gpu --num_processes 2 --sparsity 0.95 examples/hf_trainer.py

The same data, model and options as ``gpt_finetune.py``, with the Trainer's own optimizer
(AdamW, betas (0.9, 0.95), no weight decay on biases and LayerNorms) and a cosine schedule to a
tenth. SCAPE's settings: this script's ``--sparsity`` / ``--warmup-steps`` / ``--ramp-steps`` /
``--wire``, else ``accelerate-scape launch`` flags, ``SCAPE_*`` or ``scape_config.yaml``, else
``gpt_finetune.py``'s defaults. ``--save-every N`` writes Trainer checkpoints (with every rank's
SCAPE state); ``--resume`` continues from the last one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import PrinterCallback, ProgressCallback, TrainerCallback, TrainingArguments, set_seed
from transformers.utils import logging as hf_logging

from accelerate_scape.trainer import ScapeTrainer

from common import (
    HelpFormatter,
    TokenBlocks,
    add_training_args,
    check_training_args,
    conclude,
    count_parameters,
    evaluate,
    launcher_scape_settings,
    load_model_and_corpus,
    report,
)


class Sequences(Dataset):
    """``TokenBlocks`` as the dicts a Trainer feeds to the model."""

    def __init__(self, blocks: TokenBlocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.blocks[i]
        return {"input_ids": x, "labels": y}  # labels are the next tokens already


def next_token_loss(outputs, labels: torch.Tensor, num_items_in_batch: torch.Tensor | None = None) -> torch.Tensor:
    """The examples' loss (``common.next_token_loss``) for labels already shifted, as the Trainer wants it:
    summed over this rank's tokens and divided by every rank's count (the Trainer then undoes DDP's mean)."""
    total = torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else labels.numel())


class Recorder(TrainerCallback):
    """Rank 0's loss curve, the time spent in training steps, validation, SCAPE's bytes after warm-up."""

    def __init__(self, trainer_args: argparse.Namespace, val: DataLoader) -> None:
        self.args, self.val = trainer_args, val
        self.train: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float, float]] = []  # (step, val loss, bytes this rank had sent)
        self.seconds = 0.0
        self.warmup_stats: dict[str, float] | None = None
        self.trainer: ScapeTrainer | None = None

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.seconds += time.perf_counter() - self._start
        step = state.global_step
        if step == self.args.warmup_steps:
            self.warmup_stats = self.trainer.scape.stats()
        if step % self.args.val_every == 0 or step == self.args.max_steps:
            loss = evaluate(model, self.val, self.args.val_batches)  # every rank
            self.val_curve.append((step, loss, self.trainer.scape.stats().get("bytes_sent", 0.0)))

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if "loss" not in logs:
            return
        self.train.append((state.global_step, logs["loss"]))
        if self.val_curve and self.val_curve[-1][0] == state.global_step and state.is_world_process_zero:
            print(f"step {state.global_step:5d}  train loss {logs['loss']:.3f}  val loss {self.val_curve[-1][1]:.3f}"
                  f"  compression so far {logs.get('scape/compression', 1.0):.1f}x", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="processes, when the script starts them itself")
    p.add_argument("--save-every", type=int, default=0, help="Trainer checkpoint every N steps (0: none)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    add_training_args(p, out="runs/hf_trainer")
    args = check_training_args(p, p.parse_args(argv), fill_scape=False)  # unset: the launcher's settings decide
    if args.baseline:
        p.error("--baseline: this example trains the SCAPE run only; gpt_finetune.py --baseline trains both")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:  # no launcher: start the processes with torchrun
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", "--nproc-per-node", str(args.devices), __file__, *(sys.argv[1:] if argv is None
                                                                                      else argv)])
        return
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", ".*all_gather_into_tensor.*")  # the Trainer's loss gather, every log
    cuda = torch.cuda.is_available()
    set_seed(args.seed)
    model, corpus = load_model_and_corpus(args.model, args.block_size, args.data)
    val_set = TokenBlocks(corpus.val, args.block_size)
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), max_steps=args.max_steps, seed=args.seed,
        per_device_train_batch_size=args.batch_size, dataloader_drop_last=True, learning_rate=args.lr,
        adam_beta2=0.95, weight_decay=args.weight_decay, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0, logging_steps=1, report_to="none",
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500,
        use_cpu=not cuda, bf16=cuda and torch.cuda.is_bf16_supported(), ddp_find_unused_parameters=False,
    )
    rank, world = training.process_index, training.world_size  # (starts the process group)
    val = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))
    recorder = Recorder(args, val)
    # --- SCAPE: ScapeTrainer instead of Trainer; the rest is the Trainer as usual ---
    trainer = ScapeTrainer(model=model, args=training, train_dataset=Sequences(TokenBlocks(corpus.train,
                                                                                             args.block_size)),
                           compute_loss_func=next_token_loss, callbacks=[recorder],
                           scape=launcher_scape_settings(args))
    # ---------------------------------------------------------------------------------
    recorder.trainer = trainer
    for printer in (ProgressCallback, PrinterCallback):  # the recorder prints a line per validation instead
        trainer.remove_callback(printer)
    config = trainer.scape.config
    args.sparsity, args.warmup_steps, args.ramp_steps, args.wire = (config.sparsity, config.warmup_steps,
                                                                    config.ramp_steps, config.wire)  # as resolved
    before = evaluate(model, val, args.val_batches)
    if rank == 0:
        print(f"{args.model}: {count_parameters(model) / 1e6:.1f}M parameters, {world} processes; "
              f"val loss {before:.3f}", flush=True)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if rank == 0:
        result = report(args, how="with transformers.Trainer", model=model, source=corpus.source, world_size=world,
                        device="cuda" if cuda else "cpu", val_before=before, val_after=recorder.val_curve[-1][1],
                        seconds=recorder.seconds, train_curve=recorder.train,
                        val_curve=[(0, before, 0.0), *recorder.val_curve], stats=trainer.scape.stats() or None,
                        warmup_stats=recorder.warmup_stats)
        conclude([result], args.out)  # the loss curve
    if trainer.scape.active:
        trainer.scape.state.wait()  # no SCAPE collective in flight when the process group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
