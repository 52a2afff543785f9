"""SCAPE with FSDP2 for ``lightning.Trainer`` and ``Fabric``: shard inside a node, SCAPE across nodes ("custom HSDP").

Lightning's ``ModelParallelStrategy`` builds a ``("data_parallel", "tensor_parallel")`` mesh of
shape ``(nodes, devices per node)`` and hands it to ``configure_model``. That shape is HSDP's, but
not its meaning: ranks of one tensor-parallel group read the same batches, and FSDP there shards
on ``"data_parallel"``, across nodes. :class:`ScapeModelParallelStrategy` keeps the shape and
names the dimensions for what they are, ``("replicate", "shard")``: ``configure_model`` shards
with ``fully_shard(..., mesh=self.device_mesh["shard"])`` (inside a node), every rank reads its
own batches, and SCAPE (:class:`scape_core.fsdp.ScapeFSDPState`) exchanges the gradients across
``"replicate"``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.mixins import ScapeBase, check_precision, scape_config
from scape_core import ScapeConfig
from scape_core.config import check_max_steps
from scape_core.convert import to_scape_adams
from scape_core.fsdp import ScapeFSDPState, check_fsdp_config, fsdp_rank_state, load_fsdp_checkpoint

MESH_DIMS = ("replicate", "shard")
# Lightning names no public way to these (its folder checkpoints' metadata file, its test for one,
# what it treats as stateful): private, pinned by tests/test_private_names.py
PRIVATE_LIGHTNING = (_is_sharded_checkpoint, _METADATA_FILENAME, _Stateful)


class ScapeFSDPMixin(ScapeBase):
    """What both FSDP2 strategies (Trainer's and Fabric's) change versus Lightning's
    ``ModelParallelStrategy``: SCAPE's config, the ``("replicate", "shard")`` mesh, a sampler over
    every rank, the state's collectives finished at teardown."""

    def __init__(self, *args: Any, config: ScapeConfig | None = None, replicate_size: Literal["auto"] | int = "auto",
                 shard_size: Literal["auto"] | int = "auto", process_group_backend: str | None = None,
                 timeout: Any = default_pg_timeout, **kwargs: Any) -> None:
        self.scape_config = scape_config(config, kwargs)
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown argument(s) {sorted(kwargs)}: expected ScapeConfig "
                            "fields, replicate_size, shard_size, process_group_backend or timeout")
        check_fsdp_config(self.scape_config)
        super().__init__(*args, data_parallel_size=replicate_size, tensor_parallel_size=shard_size,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.scape_state: ScapeFSDPState | None = None

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  # resolves the sizes, checks their product
        from torch.distributed.device_mesh import init_device_mesh
        self._device_mesh = init_device_mesh(self.root_device.type, tuple(self.device_mesh.shape),  # type: ignore
                                             mesh_dim_names=MESH_DIMS)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # type: ignore  # both dims data-parallel

    def _attach_scape(self, model: Module) -> ScapeFSDPState:
        self.scape_state = ScapeFSDPState(model, self.device_mesh.get_group(MESH_DIMS[0]),  # type: ignore
                                          config=self.scape_config)
        return self.scape_state


class ScapeModelParallelStrategy(ScapeFSDPMixin, ModelParallelStrategy):
    """FSDP2 inside each node and SCAPE's sparse exchange across nodes, for ``lightning.Trainer``.

    ``import lightning_scape`` registers it as ``strategy="scape_fsdp"``. The LightningModule
    shards itself in ``configure_model`` as Lightning expects, on the inner dimension of
    ``self.device_mesh`` (``("replicate", "shard")``, shape ``(num_nodes, devices)`` unless
    ``replicate_size`` / ``shard_size`` say otherwise)::

        def configure_model(self):
            for block in self.model.layers:
                fully_shard(block, mesh=self.device_mesh["shard"])
            fully_shard(self.model, mesh=self.device_mesh["shard"])

    What it changes versus ``ModelParallelStrategy``: the mesh's names and meaning (every rank
    reads its own batches: the sampler spans the world); after ``configure_model`` it builds a
    :class:`~scape_core.fsdp.ScapeFSDPState` over ``"replicate"`` and converts the optimizer of
    ``configure_optimizers`` (AdamW, Adam or AdamS) in place to
    :class:`~scape_core.fsdp.ScapeFSDPAdamS` (LR schedulers follow); ``accumulate_grad_batches``
    syncs once per optimizer step (``set_requires_gradient_sync``); it logs ``scape/*`` as
    :class:`~lightning_scape.ScapeStrategy`; checkpoints are Lightning's distributed ones (a folder,
    DCP) with each rank's optimizer and SCAPE state as its own entry, and ``fit(ckpt_path=...)``
    resumes bit-for-bit at the same mesh. ``save_distributed_checkpoint=False`` (one gathered
    file) is refused: SCAPE's residuals differ per rank. One optimizer; precision ``32-true``,
    ``bf16-mixed``, ``bf16-true``.

    Args:
        config: a :class:`scape_core.ScapeConfig`; keyword fields override it.
        replicate_size: ranks holding the same shard (default: the number of nodes).
        shard_size: ranks sharing one model (default: the devices per node).
        **kwargs: any ``ScapeConfig`` field; ``process_group_backend``, ``timeout``.

    Example::

        trainer = L.Trainer(num_nodes=2, devices=8, strategy=ScapeModelParallelStrategy(sparsity=0.99))
        trainer.strategy.scape_state.stats()   # after fit: steps, bytes_sent, dense_bytes, compression, ...
    """

    def __init__(self, config: ScapeConfig | None = None, *, save_distributed_checkpoint: bool = True,
                 **kwargs: Any) -> None:
        if not save_distributed_checkpoint:
            raise ValueError("save_distributed_checkpoint=False is not supported with SCAPE: each rank's residual and "
                             "masks are its own, so the checkpoint is a DCP folder with one entry per rank")
        super().__init__(config=config, **kwargs)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.lightning_module._device_mesh = self._device_mesh  # what configure_model reads

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == "fit":
            check_precision(self.precision_plugin)
        super().setup(trainer)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # after configure_model and the materialization: the shards exist
        if len(self.optimizers) != 1:
            raise ValueError(f"SCAPE trains with exactly one optimizer, got {len(self.optimizers)}")
        self._attach_scape(self.model)
        self.optimizers = [self._convert_optimizers(self.optimizers)]  # in place: schedulers follow
        self._announce(trainer)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation: no FSDP reduction (hence no SCAPE exchange) until the step's last backward."""
        from torch.distributed.fsdp import FSDPModule
        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_stats()
        return output

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's entry (:func:`scape_core.fsdp.fsdp_rank_state`): Lightning saves it with DCP."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return fsdp_rank_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            raise ValueError(f"{path} is not a distributed checkpoint folder: SCAPE's FSDP2 strategy resumes from "
                             "the folders it saves (trainer.save_checkpoint / ModelCheckpoint)")
        optimizer = self.optimizers[0] if self.optimizers else None  # none outside fit: the weights only
        load_fsdp_checkpoint(path, self.model, optimizer, model_key="state_dict", optimizer_key="optimizer_0")
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)  # loops, schedulers, callbacks


class ScapeFabricModelParallelStrategy(ScapeFSDPMixin, FabricModelParallelStrategy):
    """FSDP2 inside each node and SCAPE across nodes, for ``lightning.Fabric``.

    As :class:`ScapeModelParallelStrategy`, with Fabric's ``parallelize_fn(module, device_mesh)``
    (the mesh is ``("replicate", "shard")``; shard on ``device_mesh["shard"]``). Set up the module
    first, then build the optimizer on its sharded parameters and set it up (converted in place
    to :class:`~scape_core.fsdp.ScapeFSDPAdamS`). ``fabric.no_backward_sync`` accumulates;
    ``fabric.save`` / ``fabric.load`` write and read a DCP folder with each rank's optimizer and
    SCAPE state as its own entry (the rest of the state in ``meta.pt``), resuming bit-for-bit at
    the same mesh. One model and one optimizer. ``max_steps``: as
    :class:`~lightning_scape.ScapeFabricStrategy`'s.

    Example::

        fabric = L.Fabric(num_nodes=2, devices=8, strategy=ScapeFabricModelParallelStrategy(shard, sparsity=0.99))
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
        fabric.save("ckpt/step_1000", {"model": model, "optimizer": optimizer, "step": 1000})
    """

    def __init__(self, parallelize_fn: Callable[[Module, Any], Module], config: ScapeConfig | None = None, *,
                 max_steps: int | None = None, **kwargs: Any) -> None:
        self.scape_max_steps = check_max_steps(max_steps)
        super().__init__(parallelize_fn, config=config, **kwargs)

    def setup_module(self, module: Module) -> Module:
        check_precision(self.precision)
        if self.scape_state is not None:
            raise RuntimeError(f"{type(self).__name__} trains one model per Fabric")
        module = super().setup_module(module)  # parallelize_fn on the (replicate, shard) mesh
        self._attach_scape(module).announce(self.scape_max_steps)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.scape_state is None:
            raise RuntimeError("set up the module first (fabric.setup_module), then build the optimizer on its "
                               "sharded parameters and set it up (fabric.setup_optimizers)")
        return to_scape_adams(super().setup_optimizer(optimizer), self.scape_state)

    def _split(self, state: dict[str, Any]) -> tuple[str, Module, str | None, Optimizer | None]:
        modules = [(k, v) for k, v in state.items() if isinstance(v, Module)]
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
        if len(modules) != 1 or len(optimizers) > 1:
            raise ValueError(f"{type(self).__name__} saves and loads one model and at most one optimizer, got "
                             f"{len(modules)} and {len(optimizers)}")
        (model_key, model), (optimizer_key, optimizer) = modules[0], (optimizers or [(None, None)])[0]
        return model_key, model, optimizer_key, optimizer

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        import torch.distributed.checkpoint as dcp
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint supports neither storage_options nor filter")
        path = Path(self.broadcast(path))
        model_key, model, optimizer_key, optimizer = self._split(state)
        entries = {model_key: model.state_dict()}
        if optimizer is not None:
            entries[optimizer_key] = fsdp_rank_state(optimizer)
        metadata = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
                    if k not in (model_key, optimizer_key)}
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(entries, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(metadata, path / _METADATA_FILENAME)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}.load_checkpoint needs state={{'model': model, ...}}")
        path = Path(self.broadcast(path))
        model_key, model, optimizer_key, optimizer = self._split(state)
        load_fsdp_checkpoint(path, model, optimizer, model_key=model_key, optimizer_key=optimizer_key)
        metadata = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        for key in [k for k in state if k not in (model_key, optimizer_key)]:
            if key not in metadata:
                if strict:
                    raise KeyError(f"{path} has no {key!r} entry")
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(metadata.pop(key))
            else:
                state[key] = metadata.pop(key)
        return metadata


def register() -> None:
    """Register ``"scape_fsdp"`` with the Trainer's registry (Fabric's strategy needs its ``parallelize_fn``)."""
    StrategyRegistry.register("scape_fsdp", ScapeModelParallelStrategy, override=True,
                              description="SCAPE across nodes, FSDP2 inside each node")
