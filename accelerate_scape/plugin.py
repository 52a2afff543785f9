"""ScapePlugin: SCAPE in a Hugging Face Accelerate training script, in two lines."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accelerate_scape.settings import Settings, resolve_settings
from scape_core import AdamS, ScapeAdamS, ScapeState, gather_state_dict, scape_hook
from scape_core.checkpoint import verify_folder
from scape_core.config import check_max_steps
from scape_core.convert import adams_param_groups, to_adams, to_scape_adams
from scape_core.model import unwrap_compiled

_NOT_DDP = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)
_INACTIVE = {"scape_active": False}  # what a single-process run checkpoints
ALONE = ("SCAPE: inactive: this process is one of WORLD_SIZE={world} launched, but its Accelerator runs alone "
         "(distributed_type {kind}), so each process trains by itself, without SCAPE. On a machine without GPUs "
         "Accelerate joins CPU processes only with ACCELERATE_USE_CPU=1 in the environment (or Accelerator(cpu=True))")


class ScapePlugin:
    """SCAPE sparse gradient communication for an :class:`accelerate.Accelerator`.

    Settings resolve, per field, as: keyword arguments here > ``SCAPE_*`` environment variables
    (``accelerate-scape launch`` exports them) > ``scape_config.yaml`` next to Accelerate's
    config (``accelerate-scape config`` writes it) > ``ScapeConfig`` defaults.

    :meth:`prepare` replaces ``accelerator.prepare``: it prepares everything, converts the
    optimizer (AdamW, Adam or AdamS) in place to :class:`~scape_core.ScapeAdamS` with the same
    parameter groups and hyperparameters (so LR schedulers built on it, before or after, and
    any reference the script keeps drive the optimizer that trains), registers the SCAPE
    hook on the DDP model (also under ``torch.compile``) and registers this plugin with
    ``accelerator.register_for_checkpointing``, so ``save_state`` / ``load_state`` keep every
    rank's SCAPE state (residuals, masks, step) and resume bit-for-bit. ``load_state`` first checks
    every torch file of the folder against its CRC-32s (:func:`scape_core.checkpoint.verify_folder`)
    and refuses a damaged one, naming it, before anything is loaded.

    Works with ``accelerator.accumulate`` (DDP ``no_sync``), ``accelerator.clip_grad_norm_`` and
    bf16 mixed precision. fp16 (a GradScaler) is refused. Communication stats go to
    ``accelerator.log`` every ``log_every`` optimizer steps when trackers are set (keys
    ``scape/bytes_sent``, ``scape/compression``, ..., at ``step`` = SCAPE optimizer steps), or
    call :meth:`log` yourself (``scape/compression`` since the run began, ``scape/step_compression``
    the last step's). A step that SCAPE skips (a non-finite gradient on any rank) shows as
    ``accelerator.optimizer_step_was_skipped`` and does not advance the LR scheduler.

    Single process: SCAPE is inactive (nothing to communicate); the optimizer is still converted,
    to plain :class:`~scape_core.AdamS`, so a 1-process debug run uses the same update rule as
    SCAPE's dense steps. Its checkpoints resume in a multi-process run (SCAPE starts with its
    warm-up) and vice versa (SCAPE state ignored, with a warning).

    At :meth:`prepare` rank 0 logs SCAPE's start-of-run line (the settings that differ from the
    defaults, with where each came from; where sparse steps begin and the target density is reached)
    and warns when ``max_steps`` ends before the target density.

    Args:
        config_file: a ``scape_config.yaml`` to read instead of the default one (must exist).
        log_every: optimizer steps between automatic ``accelerator.log`` calls; ``0`` turns it off.
        max_steps: the run's optimizer steps, if known (Accelerate cannot know them): the
            start-of-run line then warns when they end before the target density.
        **settings: ``ScapeConfig`` fields (``sparsity``, ``warmup_steps``, ``mask_delay``,
            ``mask_refresh``, ``error_feedback``, ``score``, ``update``, ``ramp_steps``, ``chunk_size``,
            ``shard_optimizer``, ``wire``, ``wire_block``, ``skip_streak_warning``, ``kernels``, ``selection``,
            ``replica_check_every``): the highest precedence. With ``shard_optimizer=True``,
            ``save_state`` writes the whole optimizer state (every rank gathers its shard) and
            ``load_state`` gives each rank its part, at any world size.

    Example:
        >>> accelerator = Accelerator(mixed_precision="bf16")     # doctest: +SKIP
        >>> scape = ScapePlugin()                                  # doctest: +SKIP
        >>> model, optimizer, loader, scheduler = scape.prepare(   # doctest: +SKIP
        ...     accelerator, model, optimizer, loader, scheduler)
    """

    def __init__(self, *, config_file: str | os.PathLike | None = None, log_every: int = 10,
                 max_steps: int | None = None, **settings: Any) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
            raise ValueError(f"log_every must be an int >= 0, got {log_every!r}")
        self.settings: Settings = resolve_settings(settings, config_file=config_file)
        self.config = self.settings.config
        self.log_every = log_every
        self.max_steps = check_max_steps(max_steps)
        self.accelerator: Accelerator | None = None
        self.state: ScapeState | None = None  # None while inactive (single process) or before prepare
        self.optimizer: AdamS | None = None  # the converted optimizer inside the AcceleratedOptimizer
        self._prepared_optimizer: AcceleratedOptimizer | None = None
        self._skipped = 0

    @property
    def active(self) -> bool:
        """Whether SCAPE communicates (prepared on more than one process)."""
        return self.state is not None

    # ----- preparation ----------------------------------------------------------------
    def prepare(self, accelerator: Accelerator, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """``accelerator.prepare(*args)`` with SCAPE: returns the prepared objects in the same order.

        ``args`` must hold exactly one model and one optimizer (AdamW, Adam or AdamS, not yet
        prepared or stepped), converted in place (see :func:`scape_core.convert.to_scape_adams`).
        """
        if self.accelerator is not None:
            raise RuntimeError("ScapePlugin.prepare was already called: one plugin serves one model and optimizer")
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        if len(placement) != len(args):
            raise ValueError(f"device_placement has {len(placement)} entries for {len(args)} objects")
        model_at = _index_of_one(args, nn.Module, "model")
        opt_at = _index_of_one(args, torch.optim.Optimizer, "optimizer")
        multi = accelerator.num_processes > 1
        _check_accelerator(accelerator, multi)
        optimizer = args[opt_at]
        original = type(optimizer).__name__
        _check_optimizer(optimizer)  # before the model is wrapped
        args = list(args)

        if not multi:
            converted = to_adams(optimizer)  # in place: the user's references and schedulers follow
            out = _as_list(accelerator.prepare(*args, device_placement=_placement(placement)), len(args))
        else:
            model = accelerator.prepare(args[model_at], device_placement=_placement([placement[model_at]]))
            converted = self._hook(model, optimizer)
            rest = [i for i in range(len(args)) if i != model_at]
            prepared = _as_list(accelerator.prepare(*[args[i] for i in rest],
                                                    device_placement=_placement([placement[i] for i in rest])),
                                len(rest))
            out = [None] * len(args)
            out[model_at] = model
            for i, obj in zip(rest, prepared):
                out[i] = obj
        self._start(accelerator, converted, out[opt_at], original)
        return tuple(out) if len(out) > 1 else out[0]

    def attach(self, accelerator: Accelerator, model: nn.Module, optimizer: AcceleratedOptimizer, *,
               max_steps: int | None = None) -> AdamS:
        """SCAPE on a model and optimizer that ``accelerator.prepare`` already prepared; returns the optimizer.

        For frameworks that call ``accelerator.prepare`` themselves (``transformers.Trainer``:
        use :class:`accelerate_scape.trainer.ScapeTrainer`, which calls this): registers the hook on
        the prepared DDP ``model`` and converts the optimizer inside ``optimizer`` in place, as
        :meth:`prepare` does, before its first step. A scheduler already built on it follows.
        ``max_steps``: the run's optimizer steps as the framework knows them (else the plugin's).

        Example:
            >>> model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))  # doctest: +SKIP
            >>> ScapePlugin(sparsity=0.9).attach(accelerator, model, optimizer)                         # doctest: +SKIP
            ScapeAdamS (...)
        """
        if self.accelerator is not None:
            raise RuntimeError("this ScapePlugin is already attached: one plugin serves one model and optimizer")
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise TypeError(f"attach takes the optimizer accelerator.prepare returned, got {type(optimizer).__name__}")
        multi = accelerator.num_processes > 1
        _check_accelerator(accelerator, multi)
        inner = optimizer.optimizer
        original = type(inner).__name__
        adams_param_groups(inner)  # refuses what SCAPE cannot train, before anything changes
        converted = self._hook(model, inner) if multi else to_adams(inner)
        if max_steps is not None:
            self.max_steps = check_max_steps(max_steps)
        self._start(accelerator, converted, optimizer, original)
        return converted

    def _hook(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> ScapeAdamS:
        """The state on the prepared DDP model, its hook, and the optimizer converted onto it."""
        ddp = find_ddp(model)
        self.state = ScapeState(ddp, config=self.config)
        try:
            ddp.register_comm_hook(self.state, scape_hook)
        except RuntimeError as e:
            raise RuntimeError("could not register the SCAPE hook on the DDP model (does "
                               "DistributedDataParallelKwargs set a comm_hook? remove it)") from e
        return to_scape_adams(optimizer, self.state)  # in place, as above

    def _start(self, accelerator: Accelerator, converted: AdamS, prepared: AcceleratedOptimizer, original: str) -> None:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if self.state is None and launched > 1:  # several processes, each alone: almost always a mistake
            if os.environ.get("RANK", "0") == "0":
                warnings.warn(ALONE.format(world=launched, kind=accelerator.distributed_type), stacklevel=3)
        elif self.state is None:
            accelerator.print(f"SCAPE: inactive (single process), training densely with AdamS "
                              f"(converted from {original})")
        else:
            accelerator.print(f"SCAPE: active on {accelerator.num_processes} processes, {original} -> ScapeAdamS")
            self.state.announce(self.max_steps, sources=self.settings.sources)
        self.accelerator = accelerator
        self.optimizer = converted
        self._prepared_optimizer = prepared
        converted.register_step_post_hook(self._after_step)
        accelerator.register_for_checkpointing(self)
        # load_state runs it before it loads anything: a damaged file is refused with the run unchanged
        accelerator.register_load_state_pre_hook(lambda models, input_dir: verify_folder(input_dir))

    # ----- reporting ------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """This rank's communication so far (``ScapeState.stats()``); empty while inactive."""
        return self.state.stats() if self.state is not None else {}

    def log_summary(self) -> None:
        """Say on the main process whether SCAPE paid in this run (``ScapeState.log_summary``: the sparse
        steps' time against the dense warm-up's, the bytes sent against dense DDP's); nothing while inactive.

        Example:
            >>> scape.log_summary()  # doctest: +SKIP
            SCAPE: sparse steps 0.41 s against 1.20 s for the dense warm-up: 2.9x faster; 308 MB sent instead of ...
        """
        if self.state is not None:
            self.state.log_summary()

    def log(self, step: int | None = None) -> dict[str, float]:
        """Send :meth:`stats` to ``accelerator.log`` as ``scape/<name>``; returns what was logged.

        ``step`` defaults to the number of SCAPE optimizer steps. Does nothing while inactive.
        """
        if self.accelerator is None:
            raise RuntimeError("call ScapePlugin.prepare before ScapePlugin.log")
        if self.state is None:
            return {}
        values = {f"scape/{k}": v for k, v in self.state.stats().items()}
        self.accelerator.log(values, step=self.state.step if step is None else step)
        return values

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.state is None:
            return
        # Accelerate reads this for optimizer_step_was_skipped and to hold the LR scheduler back; the
        # verdict is on the device: one host read per step (as torch's GradScaler does)
        now = self.state.skipped_steps
        skipped, self._skipped = now > self._skipped, now
        self.state.check_streak()  # the device was just read: a long skip streak warns here
        self._prepared_optimizer._is_overflow = skipped
        if self.log_every and self.accelerator.trackers and self.state.step % self.log_every == 0:
            self.log()

    # ----- checkpoints (called by accelerator.save_state / load_state on every rank) ----
    def state_dict(self) -> dict[str, Any]:
        """Every rank's SCAPE state in one object (collective: Accelerate calls it on all ranks)."""
        return gather_state_dict(self.state) if self.state is not None else dict(_INACTIVE)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: each rank takes its own residual back."""
        saved_inactive = state.get("scape_active") is False
        if self.state is None:
            if not saved_inactive:
                warnings.warn("the checkpoint holds SCAPE state from a multi-process run; this single-process "
                              "run is inactive and ignores it", stacklevel=2)
            return
        if saved_inactive:
            warnings.warn("the checkpoint comes from a single-process run (SCAPE inactive): SCAPE starts "
                          "fresh, with its dense warm-up", stacklevel=2)
            return
        self.state.load_state_dict(state)
        self._skipped = self.state.skipped_steps


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, AcceleratedOptimizer):
        raise ValueError("pass the optimizer to scape.prepare instead of accelerator.prepare "
                         "(got an AcceleratedOptimizer)")
    adams_param_groups(optimizer)


def find_ddp(model: nn.Module) -> DistributedDataParallel:
    """The DDP module of a prepared model: ``model`` itself or inside ``torch.compile``'s wrapper."""
    found = unwrap_compiled(model)
    if not isinstance(found, DistributedDataParallel):
        raise RuntimeError(f"SCAPE found no DistributedDataParallel in the prepared model "
                           f"({type(model).__name__}): does the model have trainable parameters?")
    return found


def _check_accelerator(accelerator: Accelerator, multi: bool) -> None:
    if accelerator.distributed_type in _NOT_DDP:
        raise ValueError(f"SCAPE runs on DDP data parallelism; this Accelerator uses {accelerator.distributed_type}. "
                         "Launch without DeepSpeed / FSDP / Megatron-LM / XLA.")
    if multi and (accelerator.mixed_precision == "fp16" or accelerator.scaler is not None):
        raise ValueError("SCAPE does not support mixed_precision='fp16': its GradScaler skips optimizer steps "
                         "behind SCAPE's back and scales the gradients SCAPE keeps in residuals. "
                         "Use mixed_precision='bf16' (or 'no').")


def _index_of_one(args: tuple[Any, ...], kind: type, what: str) -> int:
    found = [i for i, a in enumerate(args) if isinstance(a, kind)]
    if len(found) != 1:
        raise ValueError(f"scape.prepare takes exactly one {what}, got {len(found)}; "
                         f"prepare any other with accelerator.prepare")
    return found[0]


def _placement(placement: list[bool | None]) -> list[bool | None] | None:
    return None if all(p is None for p in placement) else placement


def _as_list(result: Any, n: int) -> list[Any]:
    return [result] if n == 1 else list(result)
