"""The same strategies for the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages.

Imported by ``import lightning_scape`` when those packages are installed, so that
``pytorch_lightning.Trainer(strategy="scape")`` and ``lightning_fabric.Fabric(strategy="scape")``
work too. Use these classes (not :mod:`lightning_scape.strategy`'s) with those packages.
"""

from __future__ import annotations

from lightning_fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from lightning_scape import strategy
from lightning_scape.mixins import FabricStrategyMixin, TrainerStrategyMixin


class ScapeStrategy(TrainerStrategyMixin, DDPStrategy):
    __doc__ = strategy.ScapeStrategy.__doc__


class ScapeFabricStrategy(FabricStrategyMixin, FabricDDPStrategy):
    __doc__ = strategy.ScapeFabricStrategy.__doc__


def register() -> None:
    """Register ``"scape"`` / ``"scape_spawn"`` / ``"scape_sharded"`` with ``pytorch_lightning`` and
    ``lightning_fabric``."""
    ScapeStrategy.register_strategies(StrategyRegistry)
    ScapeFabricStrategy.register_strategies(FABRIC_REGISTRY)
