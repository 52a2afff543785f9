"""A SCAPE checkpoint resumed without SCAPE: torch's Adam / AdamW given AdamS's optimizer state.

AdamS keeps ``exp_avg`` and no ``exp_avg_sq``; torch's Adam fails on such a state with a bare
``KeyError: 'exp_avg_sq'`` at its first step. SCAPE's own load paths (``load_checkpoint``)
refuse it before anything is loaded (:func:`refuse_adam_with_scape_state`). A stock path
(``Trainer(strategy="ddp")`` with ``ckpt_path``, ``AdamW.load_state_dict``) never calls SCAPE,
and torch offers no load hook on an optimizer SCAPE never sees, so importing ``scape_core``
also registers one global step pre-hook (:data:`STEP_GUARD`) that turns that ``KeyError`` into
the explanation. It inspects only Adam / AdamW, stops at the first parameter with state, and
raises nowhere torch would not.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from scape_core.adams import MOMENTUM

TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def scape_state_in_adam(name: str) -> str:
    """What to tell a user whose ``name`` (Adam / AdamW) holds optimizer state saved by SCAPE's AdamS."""
    return (f"this {name} was loaded with optimizer state saved by SCAPE's AdamS ('exp_avg' without "
            "'exp_avg_sq'): the checkpoint is a SCAPE checkpoint. Resume it with SCAPE, as it was trained: Lightning "
            "Trainer(strategy='scape') or Fabric(strategy='scape') after `import lightning_scape`, Accelerate "
            "ScapePlugin().prepare(...), transformers accelerate_scape.trainer.ScapeTrainer(...).train("
            "resume_from_checkpoint=...), plain DDP scape_core.load_checkpoint. To continue without SCAPE, load only "
            "the model weights (Lightning: model.load_state_dict(torch.load(path)['state_dict']), no ckpt_path) and "
            "start a new optimizer.")


def _adams_entries(entries: Mapping[Any, Any]) -> bool:
    """Whether per-parameter optimizer state ``entries`` are AdamS's (momentum, no second moment)."""
    for held in entries.values():
        if held:
            return MOMENTUM in held and "exp_avg_sq" not in held
    return False


def refuse_adam_with_scape_state(optimizer: torch.optim.Optimizer, saved_state: Mapping[Any, Any]) -> None:
    """Raise ``ValueError`` if ``saved_state`` (an optimizer state dict's ``"state"``) is AdamS's and
    ``optimizer`` is torch's Adam / AdamW (a load path calls it before loading anything).

    Example:
        >>> adamw = torch.optim.AdamW(nn.Linear(2, 2).parameters())
        >>> refuse_adam_with_scape_state(adamw, {0: {"exp_avg": torch.zeros(2)}})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: this AdamW was loaded with optimizer state saved by SCAPE's AdamS ...
    """
    if isinstance(optimizer, TORCH_ADAMS) and _adams_entries(saved_state):
        raise ValueError(scape_state_in_adam(type(optimizer).__name__))


def _step_guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of every optimizer: an Adam/AdamW holding AdamS state fails here, saying why."""
    if isinstance(optimizer, TORCH_ADAMS) and _adams_entries(optimizer.state):
        raise RuntimeError(scape_state_in_adam(type(optimizer).__name__))


STEP_GUARD = register_optimizer_step_pre_hook(_step_guard)
