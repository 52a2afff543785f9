"""scape_core: SCAPE sparse gradient communication for PyTorch DDP (torch only).

    from scape_core import AdamS, ScapeAdamS, ScapeConfig, ScapeState, scape_hook
    state = ScapeState(ddp, sparsity=0.99)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)
"""

from scape_core.adams import AdamS
from scape_core.checkpoint import gather_state_dict, load_checkpoint, save_checkpoint
from scape_core.config import ScapeConfig
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
    "gather_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "UPDATE_RULES",
    "UpdateRule",
    "register_update_rule",
]
__version__ = "0.1.0"
