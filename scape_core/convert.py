"""Turn a user's AdamW / Adam / AdamS into AdamS or ScapeAdamS, in place (the same object trains).

Shared by the Lightning and Accelerate adapters: one set of conversion rules for both.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from scape_core.adams import AdamS
from scape_core.fsdp import ScapeFSDPAdamS, ScapeFSDPState
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


def to_scape_adams(optimizer: Optimizer, state: ScapeState | ScapeFSDPState) -> ScapeAdamS | ScapeFSDPAdamS:
    """Turn ``optimizer`` (AdamW, Adam or AdamS, not yet stepped) into a :class:`ScapeAdamS` on ``state``, in place.

    On a :class:`~scape_core.fsdp.ScapeFSDPState` (FSDP2) it becomes a
    :class:`~scape_core.fsdp.ScapeFSDPAdamS`, by the same rules.

    The same groups and hyperparameters; the object is the same too, and that is the point.
    Everything that holds the optimizer the user built keeps driving the one that trains: an LR
    scheduler built on it before or after the conversion, Accelerate's scheduler preparation,
    gradient-clipping helpers, step hooks, the user's own variables. (Building a new optimizer
    left each of them on an object that no longer trained: a scheduler then changed the lr of
    nothing, silently, and no adapter can find every such reference to rebind or refuse it.)
    See :func:`convert_in_place` for what changes on the object. A ``ScapeAdamS`` already bound
    to ``state`` is returned as is.

    Example:
        >>> state = ScapeState(ddp, sparsity=0.9)
        >>> opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, 100)
        >>> to_scape_adams(opt, state) is opt and type(opt) is ScapeAdamS
        True
    """
    cls = ScapeFSDPAdamS if isinstance(state, ScapeFSDPState) else ScapeAdamS
    if isinstance(optimizer, (ScapeAdamS, ScapeFSDPAdamS)):
        if optimizer.scape is not state:
            raise ValueError("this ScapeAdamS is bound to another ScapeState; pass a plain AdamW/Adam/AdamS "
                             "and let SCAPE convert it")
        return optimizer
    if state.optimizer is not None:
        adams_param_groups(optimizer)  # an unsupported optimizer says so first
        raise ValueError("this ScapeState already has its optimizer: SCAPE supports exactly one optimizer")
    return convert_in_place(optimizer, cls, state)


def to_adams(optimizer: Optimizer) -> AdamS:
    """Turn ``optimizer`` (AdamW, Adam or AdamS) into a plain :class:`AdamS`, in place (as :func:`to_scape_adams`).

    Example:
        >>> opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> to_adams(opt) is opt, type(opt).__name__
        (True, 'AdamS')
    """
    return convert_in_place(optimizer, AdamS)


def convert_in_place(optimizer: Optimizer, cls: type[AdamS], *args: Any) -> Any:
    """Make ``optimizer`` an instance of ``cls`` (AdamS or a subclass) built by ``cls(groups, *args, **defaults)``.

    What changes: the class (``type(opt)`` is ``cls``, ``isinstance(opt, AdamW)`` no longer holds),
    the defaults, and the Adam-only group keys (``amsgrad``, ``fused``, ...), dropped. What stays:
    the object, its ``param_groups`` list, each group dict (``lr``, ``initial_lr``, user keys),
    its ``state`` mapping, its step and state-dict hooks, and other attributes set on it. An LR
    scheduler's wrapper of ``step`` is rebuilt around the new class's ``step``. If ``cls`` refuses
    the groups, the optimizer is left exactly as it was.

    Example:
        >>> opt = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> convert_in_place(opt, AdamS) is opt, opt.param_groups[0]["lr"]
        (True, 0.001)
    """
    groups, defaults = adams_param_groups(optimizer)  # refuses what AdamS cannot run, before any change
    step = vars(optimizer).get("step")
    if step is not None and not hasattr(step, "_wrapped_by_lr_sched"):
        raise ValueError(f"{type(optimizer).__name__}.step was replaced on this object ({step!r}); SCAPE converts "
                         "the optimizer in place and cannot keep that wrapper: convert it before patching step")
    before = (type(optimizer), dict(vars(optimizer)), [dict(g) for g in optimizer.param_groups])
    group_list, state_map = optimizer.param_groups, optimizer.state
    try:
        for group, converted in zip(group_list, groups):
            group.clear()
            group.update(converted)
        optimizer.__class__ = cls
        cls.__init__(optimizer, list(group_list), *args, **defaults)
    except BaseException:
        optimizer.__class__ = before[0]
        vars(optimizer).clear()
        vars(optimizer).update(before[1])
        for group, old in zip(group_list, before[2]):
            group.clear()
            group.update(old)
        raise
    # the containers others may hold (wrappers copy them) stay the same objects
    group_list[:] = optimizer.param_groups
    optimizer.param_groups = group_list
    if type(state_map) is type(optimizer.state):
        state_map.update(optimizer.state)
        optimizer.state = state_map
    for name, value in before[1].items():
        if name.endswith("_hooks") or (name not in vars(optimizer) and name != "step"):
            setattr(optimizer, name, value)  # the user's hooks and attributes
    if step is not None:
        _track_step_called(optimizer)
    return optimizer


def _track_step_called(optimizer: Optimizer) -> None:
    """Wrap ``optimizer.step`` as torch's LR schedulers do when they are built on an optimizer.

    A scheduler built before the conversion wrapped the old class's ``step``; without a new
    wrapper its ``step()`` would run the old algorithm, or warn that ``optimizer.step()`` was
    never called.
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
