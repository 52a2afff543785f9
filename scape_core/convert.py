"""Turn a user's AdamW / Adam / AdamS into AdamS or ScapeAdamS; rebind their LR schedulers.

Shared by the Lightning and Accelerate adapters: one set of conversion rules for both.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Iterable

import torch
from torch.optim import Optimizer

from scape_core.adams import AdamS
from scape_core.optimizer import ScapeAdamS
from scape_core.state import ScapeState

CONVERTIBLE = (torch.optim.AdamW, torch.optim.Adam, AdamS)
SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, scape_core.AdamS, or a ScapeAdamS built on the same ScapeState"
_REFUSED_FLAGS = ("amsgrad", "maximize", "differentiable")  # change what Adam computes: AdamS has none
_DROPPED_FLAGS = ("capturable", "fused", "decoupled_weight_decay")  # how torch runs Adam: meaningless for AdamS


def adams_param_groups(optimizer: Optimizer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Parameter groups and defaults of ``optimizer`` (AdamW, Adam or AdamS) for an AdamS.

    Keeps every group key (``lr``, ``betas``, ``eps``, ``weight_decay``, ``foreach``,
    ``initial_lr`` of a scheduler, user tags) except Adam-only flags. Adam's ``weight_decay``
    (an L2 penalty) becomes AdamS's decoupled one, with a warning.

    Example:
        >>> opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3, weight_decay=0.1)
        >>> groups, defaults = adams_param_groups(opt)
        >>> AdamS(groups, **defaults).param_groups[0]["weight_decay"]
        0.1
    """
    name = type(optimizer).__name__
    if type(optimizer) not in CONVERTIBLE:  # exact type: a subclass may change the update we would drop
        raise TypeError(f"SCAPE trains with AdamS: got optimizer {name}; supported: {SUPPORTED} "
                        "(AdamW/Adam/AdamS are converted to ScapeAdamS with the same groups and hyperparameters)")
    if optimizer.state:
        raise ValueError(f"the {name} already holds state (it stepped or loaded a state dict): convert it "
                         "before its first step and load checkpoints into the converted optimizer")
    for i, group in enumerate(optimizer.param_groups):
        for flag in _REFUSED_FLAGS:
            if group.get(flag):
                raise ValueError(f"{name} param_groups[{i}] sets {flag}=True, which AdamS does not implement")
        coupled = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if coupled and group["weight_decay"]:
            warnings.warn(f"Adam's weight_decay={group['weight_decay']} (an L2 term) becomes AdamS's decoupled "
                          "weight decay (as AdamW); AdamW values are usually larger", stacklevel=3)
    groups = [{k: v for k, v in g.items() if k not in _REFUSED_FLAGS + _DROPPED_FLAGS} for g in optimizer.param_groups]
    d = optimizer.defaults
    defaults = dict(lr=d["lr"], betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"],
                    foreach=d.get("foreach"))
    return groups, defaults


def to_scape_adams(optimizer: Optimizer, state: ScapeState) -> ScapeAdamS:
    """The :class:`ScapeAdamS` equivalent of ``optimizer``: same parameter groups and hyperparameters.

    A ``ScapeAdamS`` already bound to ``state`` is returned as is.

    Example:
        >>> state = ScapeState(ddp, sparsity=0.9)
        >>> opt = to_scape_adams(torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1), state)
        >>> type(opt).__name__, opt.param_groups[0]["weight_decay"]
        ('ScapeAdamS', 0.1)
    """
    if isinstance(optimizer, ScapeAdamS):
        if optimizer.scape is not state:
            raise ValueError("this ScapeAdamS is bound to another ScapeState; pass a plain AdamW/Adam/AdamS "
                             "and let SCAPE convert it")
        return optimizer
    groups, defaults = adams_param_groups(optimizer)
    if state.optimizer is not None:
        raise ValueError("this ScapeState already has its optimizer: SCAPE supports exactly one optimizer")
    return ScapeAdamS(groups, state, **defaults)


def rebind_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> None:
    """Point every scheduler (and the children of SequentialLR / ChainedScheduler) at ``new``.

    Example:
        >>> old = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.5)
        >>> new = to_scape_adams(old, ScapeState(ddp, sparsity=0.9))
        >>> rebind_schedulers([scheduler], old, new)
        >>> scheduler.optimizer is new
        True
    """
    if new is old:
        return
    hit = False
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            hit = True
        rebind_schedulers(getattr(scheduler, "_schedulers", ()), old, new)
    if hit and not hasattr(new.step, "_wrapped_by_lr_sched"):
        _track_step_called(new)


def _track_step_called(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers do when they are built on an optimizer.

    Without it a rebound scheduler's first ``step()`` warns that ``optimizer.step()`` was replaced.
    """
    ref = weakref.ref(optimizer)  # no cycle optimizer -> wrapper -> optimizer
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper
