"""ScapeStrategy (Trainer) and ScapeFabricStrategy (Fabric) for the ``lightning`` package."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_scape.mixins import FabricStrategyMixin, TrainerStrategyMixin


class ScapeStrategy(TrainerStrategyMixin, DDPStrategy):
    """DDP with SCAPE sparse gradient communication for ``lightning.Trainer``.

    ``import lightning_scape`` registers it as ``strategy="scape"`` (and ``"scape_spawn"``, and
    ``"scape_sharded"``: ``shard_optimizer=True``, each rank keeps 1/W of the optimizer state):
    Lightning has no entry-point discovery for third-party strategies, so the import is what
    makes the name known. Construct it yourself to choose SCAPE's settings.

    What it changes versus ``DDPStrategy``: it registers :func:`scape_core.scape_hook` on every
    device (stock DDP registers comm hooks only on CUDA), converts the optimizer returned by
    ``configure_optimizers`` (AdamW, Adam or AdamS, with their parameter groups and
    hyperparameters) in place to :class:`scape_core.ScapeAdamS` (LR schedulers and references the
    module keeps follow), logs its start-of-run line on rank 0 at setup (the settings that differ
    from the defaults, where sparse steps begin and the target density is reached) and warns when
    ``max_steps`` (or the epochs' steps) end before the target density, writes every rank's
    SCAPE state into checkpoints under ``"scape"`` and resumes it with ``fit(ckpt_path=...)``
    (bit-for-bit at the same world size; a sharded optimizer is consolidated on rank 0 first, as
    ``ZeroRedundancyOptimizer``, so the checkpoint holds its whole state; a damaged local file is
    refused first, naming its damaged entry), and logs
    ``scape/bytes_sent``, ``scape/dense_bytes``, ``scape/compression`` and ``scape/skipped_steps``
    (cumulative, this rank), ``scape/step_compression`` (the last step's) and ``scape/skipped_streak``
    (consecutive skipped steps now), ``scape/step_seconds_dense`` and ``scape/step_seconds_sparse`` (the
    median step times, 0 until measured) to the loggers; the progress bar shows ``scape/compression`` as
    ``9.0x`` and ``scape/sent`` in MB. At the end of ``fit`` rank 0 logs one line on whether SCAPE paid:
    the sparse steps' time against the dense warm-up's (``ScapeState.summary``).
    ``accumulate_grad_batches`` and ``gradient_clip_val`` work as usual; precision ``32-true``,
    ``bf16-mixed`` and ``bf16-true`` are supported, ``16-mixed`` is refused (its loss scaler skips
    optimizer steps). One optimizer only.

    Args:
        config: a :class:`scape_core.ScapeConfig`; keyword fields below override it.
        **kwargs: any ``ScapeConfig`` field (``sparsity``, ``warmup_steps``, ``mask_delay``,
            ``mask_refresh``, ``error_feedback``, ``score``, ``update``, ``ramp_steps``, ``chunk_size``,
            ``shard_optimizer``, ``wire``, ``wire_block``, ``skip_streak_warning``, ``kernels``, ``selection``,
            ``replica_check_every``), any ``DDPStrategy`` argument (``start_method``, ``timeout``, ...)
            and any ``DistributedDataParallel`` argument (``find_unused_parameters``, ``static_graph``,
            ...). ``ddp_comm_hook`` and
            model averaging are refused: SCAPE is the communication hook.

    Example::

        import lightning as L
        import lightning_scape

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="scape")
        trainer = L.Trainer(devices=8, strategy=lightning_scape.ScapeStrategy(sparsity=0.9, warmup_steps=50))
        trainer.strategy.scape_state.stats()   # after fit: steps, bytes_sent, dense_bytes, compression, ...
    """


class ScapeFabricStrategy(FabricStrategyMixin, FabricDDPStrategy):
    """DDP with SCAPE sparse gradient communication for ``lightning.Fabric``.

    ``import lightning_scape`` registers it as ``Fabric(strategy="scape")`` (and ``"scape_spawn"``,
    ``"scape_sharded"``);
    the import is needed because Lightning has no entry-point discovery for strategies.
    ``fabric.setup(model, optimizer, scheduler=...)`` wraps the model in DDP with the SCAPE hook and
    returns ``optimizer`` (AdamW, Adam or AdamS) converted in place to :class:`scape_core.ScapeAdamS`
    (same groups and hyperparameters; a scheduler built on it follows, passed to ``setup`` or not).
    Accumulate with
    ``fabric.no_backward_sync(model)``; ``fabric.save`` / ``fabric.load`` of a state holding the
    optimizer also carry every rank's SCAPE state (key ``"scape"``). Counters are in
    ``fabric.strategy.scape_state.stats()``. One model and one optimizer per Fabric.
    Arguments as :class:`ScapeStrategy`, and ``max_steps``: the run's optimizer steps, if known
    (Fabric cannot know them); the start-of-run line, logged on rank 0 at ``setup``, then warns when
    they end before the target density.

    Example::

        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ScapeFabricStrategy(sparsity=0.9))
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        fabric.save("ckpt.pt", {"model": model, "optimizer": optimizer})
    """


def register() -> None:
    """Register ``"scape"`` / ``"scape_spawn"`` / ``"scape_sharded"`` with the Trainer's and Fabric's registries."""
    ScapeStrategy.register_strategies(StrategyRegistry)
    ScapeFabricStrategy.register_strategies(FABRIC_REGISTRY)
