"""ScapeAdamS: AdamS that applies the masked update on sparse steps and schedules the next masks."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scape_core.adams import MOMENTUM, AdamS, adams_foreach, adams_reference
from scape_core.state import ScapeState
from scape_core.update_rules import UPDATE_RULES


class ScapeAdamS(AdamS):
    r"""The optimizer half of SCAPE; pair it with :func:`scape_hook` on the same :class:`ScapeState`.

    Dense steps (warm-up, ``sparsity=0``) are plain :class:`AdamS`. On a sparse step the
    gradient holds the mean of ``grad + residual`` over ranks on the step's mask ``M``; the
    update rule (``ScapeConfig.update``, default ``"lazy"``) applies, per coordinate :math:`j`:

    .. math::
        j \in M:&\quad v_j = \beta_2 m_j^2 + (1-\beta_2) g_j^2,\;
                 m_j \leftarrow \beta_1 m_j + (1-\beta_1) g_j,\;
                 \theta_j \leftarrow (1-\eta\lambda)\theta_j - \eta\, m_j / (\sqrt{v_j} + \epsilon) \\
        j \notin M:&\quad \theta_j \leftarrow (1-\eta\lambda)\theta_j \quad (m_j \text{ unchanged})

    Everything it reads is replicated, so parameters and ``m`` stay bit-identical on every rank.
    After the update it scores and selects the next mask (``state.end_step``).

    Example:
        >>> from scape_core import scape_hook
        >>> state = ScapeState(ddp, sparsity=0.99)
        >>> ddp.register_comm_hook(state, scape_hook)
        >>> opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        state: ScapeState,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
    ) -> None:
        if not isinstance(state, ScapeState):
            raise TypeError(f"state must be the ScapeState registered with scape_hook, got {type(state).__name__}")
        self.scape = state
        self.rule = UPDATE_RULES[state.config.update]
        self._names: dict[Tensor, str] = {}  # filled by add_param_group
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
        state.optimizer = self

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but every trainable parameter must be one the state's DDP model synchronizes."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if id(p) in self.scape.names:
                self._names[p] = self.scape.names[id(p)]
            elif p.requires_grad:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not synchronized by the model of "
                                 "this ScapeState (added after DDP was built, or not part of the DDP model?)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply the synchronized gradients (dense or masked), then schedule the next masks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grad = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p not in self._names:  # frozen at construction, trainable now: DDP never syncs it
                        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has a gradient but is not "
                                           "synchronized by the DDP model; unfreeze before wrapping in DDP")
                    with_grad.append(self._names[p])
        mask, skip = self.scape.begin_step(with_grad)
        if not skip:
            for group in self.param_groups:
                self._update(group, mask)
        self.scape.end_step(
            {n: self.state[p][MOMENTUM] for p, n in self._names.items() if MOMENTUM in self.state[p]},
            {n: g["betas"][0] for g in self.param_groups for p in g["params"] if p in self._names
             for n in [self._names[p]]},
            applied=set() if skip else set(with_grad),
            synced_at={n: self.state[p]["synced_at"] for p, n in self._names.items() if "synced_at" in self.state[p]},
        )
        return loss

    def _update(self, group: dict[str, Any], mask: dict[str, Tensor] | None) -> None:
        params, grads, momenta = self._grads(group)
        beta1, beta2 = group["betas"]
        hp = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        if mask is None:
            (adams_reference if group["foreach"] is False else adams_foreach)(params, grads, momenta, **hp)
            return
        for p, g in zip(params, grads):
            self.rule.apply(p, self.state[p], g, mask[self._names[p]], **hp)
