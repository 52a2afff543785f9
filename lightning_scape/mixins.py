"""What SCAPE adds to Lightning's DDP strategies, written once for the Trainer and once for Fabric.

The mixins only override Lightning hooks and call ``super()``; the concrete classes in
:mod:`lightning_scape.strategy` (``lightning``) and :mod:`lightning_scape.standalone`
(``pytorch_lightning`` / ``lightning_fabric``) put them in front of each package's ``DDPStrategy``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from typing import Any, Callable

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from scape_core import ScapeAdamS, ScapeConfig, ScapeState, gather_state_dict, scape_hook
from scape_core.checkpoint import verify_file
from scape_core.config import check_max_steps
from scape_core.convert import to_scape_adams
from scape_core.state import scape_metrics

CHECKPOINT_KEY = "scape"  # checkpoint entry holding every rank's SCAPE state (gather_state_dict)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
# registered name -> constructor arguments: start methods as "ddp" / "ddp_spawn"; "scape_sharded" shards
# the optimizer state (ScapeConfig.shard_optimizer)
NAMES = {"scape": {"start_method": "popen"}, "scape_spawn": {"start_method": "spawn"},
         "scape_sharded": {"start_method": "popen", "shard_optimizer": True}}
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ScapeConfig))
_FOREIGN_HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def check_precision(plugin: Any) -> None:
    """Refuse precision plugins SCAPE cannot train with, saying what to use instead."""
    precision = getattr(plugin, "precision", None)
    if getattr(plugin, "scaler", None) is not None or precision == "16-mixed":
        raise ValueError(
            "SCAPE does not support precision='16-mixed': its gradient scaler skips optimizer.step() when "
            "gradients overflow, which SCAPE's mask schedule cannot survive, and the residuals would be kept "
            "in scaled units. Use precision='bf16-mixed' (or '32-true')."
        )
    if precision not in PRECISIONS:
        raise ValueError(f"SCAPE supports precision {PRECISIONS}, got {precision!r} ({type(plugin).__name__})")


def scape_config(config: ScapeConfig | None, kwargs: dict[str, Any]) -> ScapeConfig:
    """``config`` (or the defaults) with the :class:`ScapeConfig` fields popped from ``kwargs`` applied.

    Example:
        >>> kwargs = {"sparsity": 0.9, "timeout": None}
        >>> scape_config(None, kwargs).sparsity, kwargs
        (0.9, {'timeout': None})
    """
    if config is not None and not isinstance(config, ScapeConfig):
        raise TypeError(f"config must be a ScapeConfig, got {type(config).__name__}")
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
    return (config or ScapeConfig()).replace(**fields)


def progress_bar_text(stats: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows of SCAPE, formatted (the loggers get :func:`scape_metrics`' raw numbers).

    Example:
        >>> progress_bar_text({"compression": 9.04, "bytes_sent": 308.4e6})
        {'scape/compression': '9.0x', 'scape/sent': '308.4 MB'}
    """
    return {"scape/compression": f"{stats['compression']:.1f}x", "scape/sent": f"{stats['bytes_sent'] / 1e6:,.1f} MB"}


class ScapeBase:
    """What every SCAPE strategy does with its state, DDP's and FSDP2's (:mod:`lightning_scape.fsdp`):
    the optimizer converted in place, the stats logged after a step, the start-of-run line, the line
    on whether SCAPE paid at the end of ``fit``, the collectives finished at teardown."""

    scape_config: ScapeConfig
    scape_state: Any

    def _convert_optimizers(self, optimizers: list[Optimizer]) -> Any:
        if len(optimizers) != 1:
            raise ValueError(f"SCAPE trains with exactly one optimizer, got {len(optimizers)}")
        if self.scape_state is None:
            raise RuntimeError("set up the model before its optimizer: SCAPE binds the optimizer to the model's state")
        return to_scape_adams(optimizers[0], self.scape_state)

    def _announce(self, trainer: Any) -> None:
        """The start-of-run line on rank 0, and its warning when the run ends before the target density."""
        total = trainer.estimated_stepping_batches  # max_steps, or epochs x batches / accumulation
        self.scape_state.announce(int(total) if math.isfinite(total) else None)

    def _log_stats(self) -> None:
        stats = self.scape_state.stats()
        module = self.lightning_module  # type: ignore[attr-defined]
        module.log_dict(scape_metrics(stats), on_step=True, on_epoch=False)
        # the bar takes text as it is (self.log takes numbers only, which bars print as 1753920.000)
        module.trainer.progress_bar_metrics.update(progress_bar_text(stats))

    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        if self.scape_state is not None:  # rank 0: sparse steps against the dense warm-up, bytes against dense
            self.scape_state.log_summary()

    def teardown(self) -> None:
        if self.scape_state is not None:
            self.scape_state.wait()  # no SCAPE collective left in flight when the process group goes
        super().teardown()  # type: ignore[misc]


class ScapeStrategyMixin(ScapeBase):
    """The SCAPE config (any :class:`ScapeConfig` field as a keyword) and the state built at setup."""

    def __init__(self, config: ScapeConfig | None = None, **kwargs: Any) -> None:
        self.scape_config = scape_config(config, kwargs)
        for name in _FOREIGN_HOOK_ARGS:
            if kwargs.get(name) is not None:
                raise TypeError(f"{type(self).__name__} registers SCAPE's communication hook itself; "
                                f"{name} is not supported")
        known = set(inspect.signature(super().__init__).parameters)
        known |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown argument(s) {unknown}: expected ScapeConfig "
                            f"fields {sorted(_CONFIG_FIELDS)}, strategy or DistributedDataParallel arguments")
        # p.grad as views of DDP's buckets: SCAPE's optimizer reads and writes the buckets, so it
        # then skips copying every gradient back into them (and DDP keeps one copy, not two)
        kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**kwargs)
        self.scape_state: ScapeState | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, init in NAMES.items():
            what = ", ".join(f"{k}={v!r}" for k, v in init.items())
            strategy_registry.register(name, cls, description=f"SCAPE sparse DDP, {what}", override=True, **init)

    def _attach_scape(self, ddp: DistributedDataParallel) -> ScapeState:
        """Register the SCAPE hook on ``ddp`` whatever the device (Lightning only does so on CUDA)."""
        state = ScapeState(ddp, config=self.scape_config)  # communicates over the DDP model's process group
        ddp.register_comm_hook(state, scape_hook)
        return state

    @staticmethod
    def _verify(path: Any) -> None:
        """A damaged local checkpoint file is refused before Lightning loads anything from it."""
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):  # remote or folder: nothing to check
            verify_file(path)

    def _check_hook_ran(self) -> None:
        counters = self.scape_state.comm.counters
        if counters["steps"] and not counters["hook_calls"]:
            raise RuntimeError("the SCAPE communication hook never ran: gradients reached the optimizer without "
                               "going through the DistributedDataParallel model's backward")


class TrainerStrategyMixin(ScapeStrategyMixin):
    """Trainer side: overrides ``DDPStrategy`` hooks (setup, hook registration, optimizers, checkpoints)."""

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == "fit":  # validate/test/predict do not communicate gradients
            check_precision(self.precision_plugin)
        super().setup(trainer)

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model in DDP (Lightning's own hook registration is CUDA-only)
        self.scape_state = self._attach_scape(self.model)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        self.optimizers = [self._convert_optimizers(self.optimizers)]  # in place: its schedulers follow
        self._announce(trainer)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._check_hook_ran()
        self._log_stats()
        return output

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Runs on every rank (only rank 0 writes), so the collective gather is safe here.
        if "optimizer_states" in checkpoint and self.scape_state is not None:
            checkpoint = {**checkpoint, CHECKPOINT_KEY: gather_state_dict(self.scape_state)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._verify(checkpoint_path)  # before the weights, the optimizer or SCAPE's state are restored
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if CHECKPOINT_KEY not in checkpoint:
            raise KeyError(f"the checkpoint has no {CHECKPOINT_KEY!r} entry (saved without SCAPE?): it cannot resume "
                           "a SCAPE run; load its weights only (e.g. LightningModule.load_state_dict) and start anew")
        self.scape_state.load_state_dict(checkpoint[CHECKPOINT_KEY])
        super().load_optimizer_state_dict(checkpoint)


class FabricStrategyMixin(ScapeStrategyMixin):
    """Fabric side: overrides ``DDPStrategy`` hooks (module/optimizer setup, step, save/load).
    ``max_steps``: the run's optimizer steps, if known (Fabric cannot know them): the start-of-run
    line then warns when they end before the target density."""

    def __init__(self, config: ScapeConfig | None = None, *, max_steps: int | None = None, **kwargs: Any) -> None:
        self.scape_max_steps = check_max_steps(max_steps)
        super().__init__(config, **kwargs)

    def setup_module(self, module: Module) -> DistributedDataParallel:
        check_precision(self.precision)
        if self.scape_state is not None:
            raise RuntimeError(f"{type(self).__name__} trains one model per Fabric; this one already set up a "
                               "model (use a separate Fabric for another)")
        ddp = super().setup_module(module)
        self.scape_state = self._attach_scape(ddp)
        self.scape_state.announce(self.scape_max_steps)
        return ddp

    def setup_optimizer(self, optimizer: Optimizer) -> ScapeAdamS:
        return self._convert_optimizers([super().setup_optimizer(optimizer)])

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"SCAPE trains with exactly one optimizer, got {len(optimizers)}")
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self._check_hook_ran()
        return output

    def _holds_scape_optimizer(self, state: Any) -> bool:
        return (isinstance(state, dict) and self.scape_state is not None
                and any(obj is self.scape_state.optimizer for obj in state.values()))

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if self._holds_scape_optimizer(state):  # fabric.save runs on every rank: the gather is safe
            if CHECKPOINT_KEY in state:
                raise ValueError(f"the state to save already has a {CHECKPOINT_KEY!r} key, which SCAPE uses")
            state = {**state, CHECKPOINT_KEY: gather_state_dict(self.scape_state)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self._verify(path)
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if self._holds_scape_optimizer(state):
            if CHECKPOINT_KEY not in remainder:
                raise KeyError(f"{path} has no {CHECKPOINT_KEY!r} entry (saved without SCAPE?): the optimizer was "
                               "loaded, but SCAPE's residuals and masks cannot be")
            self.scape_state.load_state_dict(remainder.pop(CHECKPOINT_KEY))
        return remainder
