"""scape_core: SCAPE sparse gradient communication for PyTorch DDP and FSDP2 (torch only).

    from scape_core import AdamS, ScapeAdamS, ScapeConfig, ScapeState, scape_hook
    state = ScapeState(ddp, sparsity=0.99)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)

    # FSDP2 inside each node, SCAPE across nodes (a (replicate, shard) DeviceMesh):
    model, opt = scape_fsdp(model, mesh, sparsity=0.99, lr=3e-4, shard_modules=model.layers)
"""

from scape_core.adams import AdamS
from scape_core.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint
from scape_core.config import ScapeConfig
from scape_core.fsdp import ScapeFSDPAdamS, ScapeFSDPState, load_fsdp_checkpoint, save_fsdp_checkpoint, scape_fsdp
from scape_core.hook import scape_hook
from scape_core.optimizer import ScapeAdamS
from scape_core.state import ScapeState
from scape_core.update_rules import UPDATE_RULES, UpdateRule, register_update_rule

__all__ = [
    "AdamS",
    "ScapeAdamS",
    "ScapeConfig",
    "ScapeState",
    "scape_hook",
    "scape_fsdp",
    "ScapeFSDPState",
    "ScapeFSDPAdamS",
    "save_fsdp_checkpoint",
    "load_fsdp_checkpoint",
    "gather_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "UPDATE_RULES",
    "UpdateRule",
    "register_update_rule",
]
__version__ = "0.1.0"
