"""Lightning adapter for SCAPE: one import, one argument.

    import lightning as L
    import lightning_scape                      # registers strategy="scape" with Trainer and Fabric
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="scape")
    trainer = L.Trainer(strategy=lightning_scape.ScapeStrategy(sparsity=0.9, warmup_steps=50))
    fabric = L.Fabric(strategy="scape")
    trainer = L.Trainer(strategy="scape_sharded")  # each rank keeps 1/W of the optimizer state
    trainer = L.Trainer(num_nodes=2, devices=8, strategy="scape_fsdp")  # FSDP2 in a node, SCAPE across nodes

Lightning has no entry-point discovery for third-party strategies: the import is what registers
the names. It registers them with ``lightning`` (required) and, when installed, with the
standalone ``pytorch_lightning`` / ``lightning_fabric`` packages (classes in
:mod:`lightning_scape.standalone`).
"""

import importlib.util

from lightning_scape import fsdp
from lightning_scape.fsdp import ScapeFabricModelParallelStrategy, ScapeModelParallelStrategy
from lightning_scape.strategy import ScapeFabricStrategy, ScapeStrategy, register
from scape_core.convert import to_scape_adams

register()
fsdp.register()
if importlib.util.find_spec("pytorch_lightning") and importlib.util.find_spec("lightning_fabric"):
    from lightning_scape import standalone

    standalone.register()

__all__ = ["ScapeStrategy", "ScapeFabricStrategy", "ScapeModelParallelStrategy",
           "ScapeFabricModelParallelStrategy", "to_scape_adams"]
