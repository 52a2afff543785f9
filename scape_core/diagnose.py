"""What happened when gradients reach ``ScapeAdamS.step()`` unsynchronized: each cause, its fix.

``ScapeAdamS.step()`` only sees that ``scape_hook`` did not synchronize some gradients. The
causes differ (no hook registered, a hook registered with another ``ScapeState``, ``step()``
twice for one backward, a forward around DDP, every forward under ``no_sync()``, a parameter
unused in the forward without ``find_unused_parameters=True``) and so do their fixes.
:class:`DDPWatch` keeps what it takes to tell them apart: one forward pre-hook on the DDP module
and one gradient's identity per step; no per-parameter work.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from scape_core.model import unwrap_compiled

_steps = [0]  # optimizer steps taken in this process (every optimizer's)
_stepped_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # each optimizer's last step, in _steps


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _steps[0] += 1
    _stepped_at[optimizer] = _steps[0]


STEP_COUNTER = register_optimizer_step_post_hook(_count_step)  # tells another model's step from a skipped one


def registered_states(ddp: nn.Module) -> list[Any] | None:
    """The states of the comm hooks registered on ``ddp`` (``None`` if torch does not say)."""
    hooks = getattr(ddp, "_comm_hooks", None)  # DistributedDataParallel records (hook, state) pairs
    return None if hooks is None else [state for _, state in hooks]


class DDPWatch:
    """What the DDP model did since the last ``ScapeAdamS.step()``, for :meth:`explain`.

    Built by ``ScapeState``; refuses a second ``ScapeState`` on a model whose ``scape_hook``
    is registered with another one.

    Example:
        >>> from scape_core import ScapeState
        >>> state = ScapeState(ddp, sparsity=0.9)                # builds its DDPWatch
        >>> "register_comm_hook" in state.watch.explain(["weight"])   # no hook registered yet
        True
    """

    def __init__(self, model: nn.Module, state: Any) -> None:
        ddp = unwrap_compiled(model)
        others = [s for s in registered_states(ddp) or [] if isinstance(s, type(state))]
        if others:
            raise ValueError("this DistributedDataParallel model already has scape_hook registered with another "
                             "ScapeState: a model has one ScapeState. Use that one (ScapeAdamS, checkpoints, stats)")
        self._ddp = weakref.ref(ddp)
        self._state = weakref.ref(state)
        self.forwards = 0  # grad-enabled forwards through the DDP model since the last step
        self.synced_forwards = 0  # those of them outside no_sync()
        self.fed_by_graph = 0  # those of them whose input carried a gradient history (another model's output)
        self._steps_at_start = _steps[0]  # the process's optimizer steps when the current step began
        self._last_grad: tuple[str, weakref.ref, int] | None = None  # one gradient as the last step saw it
        # eager even under torch.compile: a traced counter would be a guard, recompiling every step
        ddp.register_forward_pre_hook(torch.compiler.disable(self._on_forward))

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.forwards += 1
            synced = bool(module.require_backward_grad_sync)
            self.synced_forwards += synced
            self.fed_by_graph += synced and any(isinstance(a, Tensor) and a.grad_fn is not None for a in args)

    def stepped(self, names_with_grad: list[str]) -> None:
        """Called by each optimizer step that went through (and by a skipped one, with no names): start
        watching the next one."""
        self.forwards = self.synced_forwards = self.fed_by_graph = 0
        self._steps_at_start = _steps[0]
        self._last_grad = None
        if names_with_grad:
            name = names_with_grad[0]
            grad = self._state().params[name].grad
            self._last_grad = (name, weakref.ref(grad), grad._version)

    def _same_gradients(self) -> bool:
        """Whether the gradients are the very ones the last step applied (no backward since)."""
        if self._last_grad is None:
            return False
        name, ref, version = self._last_grad
        grad = self._state().params[name].grad
        return grad is not None and grad is ref() and grad._version == version

    def other_steps(self) -> int:
        """Steps of optimizers other than this state's since its current step began."""
        own = self._state().optimizer if self._state() is not None else None
        mine = own is not None and _stepped_at.get(own, 0) > self._steps_at_start  # its step ends after stepped()
        return _steps[0] - self._steps_at_start - mine

    def through_another_model(self) -> bool:
        """Whether gradients synchronized since the last step came from another model's loss flowing back
        through this one (a GAN's G through D): a synchronized forward took another model's output with its
        gradient history, and another optimizer has stepped since."""
        return self.fed_by_graph > 0 and self.other_steps() > 0

    def unapplied(self, name: str) -> str:
        """Why ``name``'s gradients were synchronized again before this state's optimizer applied them, and the fix."""
        if self.through_another_model():
            return (f"scape_hook synchronized {name!r} a second time before ScapeAdamS.step(): a backward went through "
                    "this model from another model's output (e.g. a GAN: G's loss flowing back through D) and "
                    "another optimizer stepped, not this model's. Run that pass through this model under its "
                    "no_sync() (`with d.no_sync(): g_loss = loss_fn(d(g(z)))`), or freeze its parameters for it "
                    "(requires_grad_(False)): SCAPE would otherwise add the other loss's gradient to this model's "
                    "residual")
        return (f"scape_hook synchronized the same gradients twice without ScapeAdamS.step() in between (e.g. "
                f"{name!r}): each synchronized backward must be followed by ScapeAdamS.step(). To skip a step (e.g. "
                "on a gradient-norm spike), call opt.zero_grad() instead of opt.step(), on every rank. To accumulate "
                "gradients over micro-batches, run all but the last backward under ddp.no_sync()")

    def explain(self, missing: list[str]) -> str:
        """Why the gradients of ``missing`` reached the optimizer unsynchronized, and the fix."""
        ddp, state = self._ddp(), self._state()
        states = registered_states(ddp) if ddp is not None else None
        if states is not None and not any(s is state for s in states):
            if any(isinstance(s, type(state)) for s in states):
                return ("scape_hook is registered on this DDP model with another ScapeState than this optimizer's: "
                        "build ScapeAdamS on the ScapeState passed to ddp.register_comm_hook (one per model)")
            return ("ScapeAdamS.step() found gradients that scape_hook never synchronized: register it with "
                    "ddp.register_comm_hook(state, scape_hook) before the first backward")
        if self.forwards == 0:
            if self._same_gradients():
                return ("ScapeAdamS.step() was called again with no backward since the last step: the gradients "
                        "are the ones that step already applied. Call step() once per backward (then zero_grad())")
            return ("gradients were computed without a forward through the DistributedDataParallel model (e.g. "
                    "ddp.module(x), or the model before wrapping), so DDP did not synchronize them: call the DDP "
                    "model itself, ddp(x)")
        if self.synced_forwards == 0:
            return ("every forward since the last step ran under ddp.no_sync() (gradient accumulation), so nothing "
                    "was synchronized: run the last micro-batch's forward and backward outside no_sync() before step()")
        unused = [n for n, p in state.params.items() if p.grad is None]
        if unused and not ddp.find_unused_parameters:
            return (f"DDP did not synchronize the gradients of {missing[:3]}: parameter(s) {unused[:5]} received no "
                    "gradient in this backward (not used in the forward), and DistributedDataParallel synchronizes a "
                    "bucket only once every parameter in it has one. Pass find_unused_parameters=True to "
                    "DistributedDataParallel (ScapeStrategy(find_unused_parameters=True) in Lightning), or make "
                    "every parameter take part in the loss")
        return (f"gradients of {missing[:3]} were not synchronized by scape_hook this step (their backward did not "
                "go through the DDP model's forward of this step?)")

