"""``ddp.join()`` with SCAPE: a rank out of data takes the same SCAPE step as the others.

Under torch's join (uneven inputs), a rank that has run out of batches shadows the others'
collectives: for each of their synchronized backwards, DDP's join hook runs the comm hook on
zero-filled buckets (this rank contributes zero gradient). SCAPE's state is replicated (the step,
the masks, ``m``, the rule's statistics, the windows, the parameters), and the others apply an
optimizer step after each backward, which may itself run collectives (the replica guard's check,
the sharded mode's gathers). So the joined rank must take that step too, on the same synchronized
means, at the same point of the collectives' order: right after DDP's shadow of the backward.

:func:`extend_join_hook` makes ``ddp.join()`` (and ``Join([ddp])``) use :class:`ScapeJoinHook`,
DDP's own join hook followed by that step. Its post-hook, after DDP broadcasts the final
parameters from the last joiner, compares the ranks' replicated state once (the replica guard).
The joined rank's residual takes part as every rank's does (it sends its unsent gradient on the
mask, adding zero gradient), and every step divides by the world size as DDP's default
``divide_by_initial_world_size=True`` does.

``find_unused_parameters=True`` is refused inside a join at the first step, on every rank: the
joined rank cannot know which parameters the others left without a gradient (DDP's used-map
all-reduce is not waited for), and a SCAPE step that differs there breaks the replicas.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.join import JoinHook

from scape_core.buckets import Buckets, StepRecord

UNUSED_IN_JOIN = ("SCAPE does not support ddp.join() with find_unused_parameters=True: a rank that ran out of data "
                  "takes the others' SCAPE step on the synchronized means, and cannot know which parameters they "
                  "left without a gradient. Give every rank the same number of batches (e.g. "
                  "DistributedSampler(drop_last=True), or cut each rank's loader to the smallest length) and drop "
                  "ddp.join(), or build DDP without find_unused_parameters")


class Joinable(Protocol):
    """What a joined rank's step reads of a SCAPE state (``ScapeState`` is one)."""

    params: dict[str, Tensor]  # the parameters by name
    buckets: Buckets  # their gradients' views in DDP's buckets
    record: StepRecord  # this step's, which says whether the others synchronized
    optimizer: torch.optim.Optimizer | None  # the ScapeAdamS built on the state

    def check_replicas(self) -> None: ...


class ScapeJoinHook(JoinHook):
    """DDP's join hook, then the joined rank's SCAPE step (see the module docstring).

    Example:
        >>> state = ScapeState(ddp, sparsity=0.99)                # doctest: +SKIP
        >>> with ddp.join():                                      # doctest: +SKIP
        ...     for x, y in loader:                               # fewer batches on some rank
        ...         loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, ddp_hook: JoinHook, state: Joinable) -> None:
        self.ddp_hook = ddp_hook
        self._state = weakref.ref(state)

    def main_hook(self) -> None:
        """DDP's shadow of the others' forward and backward, then the same SCAPE step if they synchronized."""
        self.ddp_hook.main_hook()
        state = self._state()
        if state is not None and state.record.synced:
            shadow_step(state)

    def post_hook(self, is_last_joiner: bool) -> None:
        """DDP's broadcast of the final model, then one comparison of the ranks' replicated state."""
        self.ddp_hook.post_hook(is_last_joiner)
        state = self._state()
        if state is not None:
            state.check_replicas()


def shadow_step(state: Joinable) -> None:
    """The optimizer step of a joined rank: the synchronized means DDP's shadow left in its zero-filled
    buckets (``state.buckets.views``) stand in for ``p.grad`` for the step, which is the others'."""
    opt = state.optimizer
    if opt is None:
        raise RuntimeError("ddp.join() with SCAPE needs the ScapeAdamS built on this ScapeState: a rank out of data "
                           "takes the others' optimizer step")
    before = {name: p.grad for name, p in state.params.items()}
    try:
        for name, p in state.params.items():
            p.grad = state.buckets.views[name]
        opt.step()
    finally:
        for name, p in state.params.items():
            p.grad = before[name]


def extend_join_hook(ddp: nn.parallel.DistributedDataParallel, state: Joinable) -> None:
    """Make ``ddp.join()`` build :class:`ScapeJoinHook` around DDP's own join hook (on this instance)."""
    ddp_join_hook: Callable[..., JoinHook] = ddp.join_hook
    ref = weakref.ref(state)

    def join_hook(**kwargs: Any) -> JoinHook:
        found = ref()
        return ddp_join_hook(**kwargs) if found is None else ScapeJoinHook(ddp_join_hook(**kwargs), found)

    ddp.join_hook = join_hook  # type: ignore[method-assign]


def in_join(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp`` has been put in a join context (torch leaves it set after the block ends)."""
    config = getattr(ddp, "_join_config", None)
    return bool(config is not None and config.enable)

