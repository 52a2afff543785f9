"""ScapeTrainer: ``transformers.Trainer`` (and its subclasses: TRL's SFTTrainer, ...) with SCAPE.

    from accelerate_scape.trainer import ScapeTrainer      # needs transformers: pip install -e ".[transformers]"
    trainer = ScapeTrainer(model=model, args=args, train_dataset=data, scape=dict(sparsity=0.99))
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=True)

    class ScapeSFTTrainer(ScapeTrainerMixin, SFTTrainer): pass   # any other Trainer subclass

It lives with the Accelerate adapter because the Trainer runs on Accelerate: what SCAPE does to
the objects the Trainer prepared is :meth:`accelerate_scape.ScapePlugin.attach`. Not imported by
``import accelerate_scape`` (transformers is optional).

Why a subclass and not a ``TrainerCallback``: a callback is handed the unwrapped model, never
the DDP module the comm hook goes on (``Trainer.model_wrapped``); on resume the Trainer loads
the optimizer state before any callback runs, into the optimizer SCAPE must convert first, and
no callback learns which checkpoint it resumed; and user callbacks' ``on_log`` runs after the
``report_to`` integrations', too late to add keys to what they report. The subclass overrides
the Trainer's own checkpoint steps and ``log``; everything SCAPE does to the Accelerate objects
the Trainer prepared is :meth:`accelerate_scape.ScapePlugin.attach`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping

import torch
from transformers import Trainer, TrainerCallback

from accelerate_scape.plugin import ScapePlugin
from scape_core.checkpoint import verify_folder
from scape_core.state import scape_metrics

SCAPE_STATE_NAME = "scape_state.pt"  # in each checkpoint-<step> folder, next to optimizer.pt
_OVERRIDDEN = ("_load_from_checkpoint", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler", "log")
_missing = [name for name in _OVERRIDDEN if not callable(getattr(Trainer, name, None))]
if _missing:
    import transformers

    raise ImportError(f"accelerate_scape.trainer overrides Trainer.{', Trainer.'.join(_missing)}, which transformers "
                      f"{transformers.__version__} does not have")


class ScapeTrainerMixin:
    """SCAPE in a ``transformers.Trainer`` subclass: put it first, ``class S(ScapeTrainerMixin, SFTTrainer): pass``.

    Settings resolve as in the other adapters: ``scape`` here > ``SCAPE_*`` environment
    (``accelerate-scape launch`` exports them) > ``scape_config.yaml`` > ``ScapeConfig``
    defaults, so ``accelerate-scape launch`` and ``torchrun`` both work. At the start of
    training the optimizer the Trainer built (AdamW by default, two parameter groups) becomes
    :class:`~scape_core.ScapeAdamS` in place (its LR scheduler follows) and the SCAPE hook goes
    on the DDP model; on one process SCAPE is inactive and the optimizer becomes AdamS.
    ``trainer.scape`` is the :class:`~accelerate_scape.ScapePlugin` that does it:
    ``trainer.scape.stats()``, ``trainer.scape.state``.

    Checkpoints: every rank reaches ``_save_optimizer_and_scheduler`` (the Trainer writes
    ``optimizer.pt`` there from rank 0); every rank's SCAPE state is gathered there and rank 0
    writes it to ``scape_state.pt`` in the checkpoint folder. ``train(resume_from_checkpoint=...)``
    converts the optimizer before the Trainer loads its state and restores each rank's residual:
    bit-for-bit at the same world size, on every wire (no value depends on DDP's buckets:
    ``docs/reliability.md``, "Exact resume"). A
    damaged torch file in the checkpoint folder (``scape_state.pt``, ``optimizer.pt``, ...) is
    refused, naming it, before the weights load (:func:`scape_core.checkpoint.verify_folder`).

    Logging: at the start of training rank 0 logs SCAPE's start-of-run line (the settings that
    differ from the defaults, where sparse steps begin and the target density is reached) and warns
    when ``max_steps`` (the Trainer's total optimizer steps) ends before the target density. Each
    training log (every ``logging_steps``) carries ``scape/compression``, ``scape/bytes_sent``,
    ``scape/dense_bytes``, ``scape/skipped_steps`` (rank 0's, since the run began),
    ``scape/step_compression`` (the last step's) and ``scape/skipped_streak`` (consecutive skipped
    steps now), ``scape/step_seconds_dense`` and ``scape/step_seconds_sparse`` (the median step times,
    0 until measured), so they reach ``report_to`` and ``trainer.state.log_history``. At the end of
    ``train`` rank 0 logs one line on whether SCAPE paid (``ScapeState.summary``).

    DDP: ``ddp_find_unused_parameters`` left at ``None`` becomes ``False`` (the Trainer's own default
    is ``True`` for a ``PreTrainedModel``, which makes DDP search the graph every step and warn that
    it found nothing); set it to ``True`` for a model with parameters some steps leave unused.

    Refused: DeepSpeed and FSDP (SCAPE replaces DDP's all-reduce), ``fp16=True`` (its loss
    scaler skips steps behind SCAPE's back: use ``bf16=True``), optimizers other than AdamW,
    Adam and AdamS.

    Args:
        scape: ``ScapeConfig`` fields (``sparsity``, ``warmup_steps``, ``ramp_steps``, ``wire``, ...).
        scape_config_file: a ``scape_config.yaml`` to read instead of the default one.
        *args, **kwargs: the Trainer's own.

    Example:
        >>> from accelerate_scape.trainer import ScapeTrainer                       # doctest: +SKIP
        >>> trainer = ScapeTrainer(model=model, args=TrainingArguments("out", save_steps=100),
        ...                        train_dataset=data, scape=dict(sparsity=0.99))  # doctest: +SKIP
        >>> trainer.train(resume_from_checkpoint=True)                            # doctest: +SKIP
    """

    def __init__(self, *args: Any, scape: Mapping[str, Any] | None = None,
                 scape_config_file: str | os.PathLike | None = None, **kwargs: Any) -> None:
        self.scape = ScapePlugin(config_file=scape_config_file, log_every=0, **dict(scape or {}))
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("SCAPE replaces DDP's gradient all-reduce; this Trainer uses DeepSpeed / FSDP, which "
                             "shard gradients themselves. Train without them to use SCAPE.")
        ddp = self.accelerator.ddp_handler
        if ddp is not None:
            ddp.gradient_as_bucket_view = True  # SCAPE reads and writes the gradients in DDP's buckets
            if self.args.ddp_find_unused_parameters is None:  # not chosen: no graph search at every step
                ddp.find_unused_parameters = False
        self.add_callback(_AttachAtTrainBegin(self))

    def attach_scape(self) -> None:
        """Hook the DDP model and convert the optimizer, once they are prepared (before the first step)."""
        if self.scape.accelerator is None:
            total = self.state.max_steps  # the Trainer's optimizer steps (0 before train() computed them)
            self.scape.attach(self.accelerator, self.model_wrapped, self.optimizer, max_steps=total or None)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, *args: Any, **kwargs: Any) -> None:
        # the first load of a resume (the weights): every torch file of the folder is checked first
        verify_folder(resume_from_checkpoint)
        super()._load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self.attach_scape()  # the checkpoint's optimizer state goes into the converted optimizer
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SCAPE_STATE_NAME)
        if os.path.isfile(path):
            self.scape.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        elif self.scape.active:
            warnings.warn(f"{checkpoint} has no {SCAPE_STATE_NAME} (saved without SCAPE, or save_only_model): SCAPE "
                          "starts fresh, with its dense warm-up", stacklevel=2)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.scape.optimizer is not None:  # every rank is here: the collectives are safe
            if self.scape.active:  # sharded: rank 0's optimizer.pt then holds every shard
                self.scape.optimizer.consolidate_state_dict(to=0)
            full = self.scape.state_dict()
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                torch.save(full, os.path.join(output_dir, SCAPE_STATE_NAME))
        super()._save_optimizer_and_scheduler(output_dir)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output = super().train(*args, **kwargs)  # type: ignore[misc]
        self.scape.log_summary()  # rank 0: whether SCAPE paid (sparse steps against the dense warm-up)
        return output

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.scape.active and "loss" in logs:  # the training logs, not evaluation or the final metrics
            logs.update(scape_metrics(self.scape.stats()))
        super().log(logs, *args, **kwargs)


class ScapeTrainer(ScapeTrainerMixin, Trainer):
    """``transformers.Trainer`` with SCAPE: ``ScapeTrainer(..., scape=dict(sparsity=0.99))``; see
    :class:`ScapeTrainerMixin`."""


class _AttachAtTrainBegin(TrainerCallback):
    """The first point after the Trainer wrapped the model in DDP when it does not resume a checkpoint."""

    def __init__(self, trainer: ScapeTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.attach_scape()
