"""ScapeAdamS: AdamS that applies the masked update on sparse steps and schedules the next masks."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scape_core.adams import MOMENTUM, AdamS, adams_foreach, adams_reference, check_grad
from scape_core.masks import Mask
from scape_core.state import ScapeState
from scape_core.update_rules import UPDATE_RULES


class ScapeAdamS(AdamS):
    r"""The optimizer half of SCAPE; pair it with :func:`scape_hook` on the same :class:`ScapeState`.

    Dense steps (warm-up, ``sparsity=0``) are plain :class:`AdamS`. On a sparse step the hook
    has left, on the step's mask ``M``, the window sum :math:`s_j` (the mean over ranks of
    ``grad + residual``) in the gradient; with the default rule (``linear``, see
    :mod:`scape_core.update_rules`), per coordinate :math:`j`:

    .. math::
        j \in M:&\quad \theta_j \leftarrow (1-\eta\lambda)\,\theta_j - \eta\, s_j / d_j,
                 \quad m_j, sq_j \text{ updated from } s_j / n_j \text{ and } s_j^2 / n_j \\
        j \notin M:&\quad \theta_j \leftarrow (1-\eta\lambda)\,\theta_j \quad (m_j, sq_j \text{ unchanged})

    where :math:`n_j` is the number of steps since :math:`j` was last exchanged and
    :math:`d_j = \max(\sqrt{m_j^2 + c\,\mathrm{noise}_j}, |s_j / n_j|) + \epsilon`. Everything it
    reads is replicated, so parameters and ``m`` stay bit-identical on every rank. After the
    update it selects the masks of the next steps (``state.end_step``).

    ``m`` and the rule's statistics live in flat buffers (:mod:`scape_core.layout`);
    ``optimizer.state[p]`` holds each parameter's views of them (``"exp_avg"``, ``"sq"``), so
    ``state_dict()`` is keyed as torch's optimizers are. A sparse step costs a fixed number of
    kernels per parameter group and DDP bucket (multi-tensor kernels for the decay and the
    update, gathers on flat buffers for the mask), none per parameter, and never reads the
    device from the host. Parameter groups may differ in ``lr`` and ``weight_decay``; ``betas``
    and ``eps`` must be the same in every group (the masked update is one kernel over all of them).

    Example:
        >>> from scape_core import scape_hook
        >>> state = ScapeState(ddp, sparsity=0.99)
        >>> ddp.register_comm_hook(state, scape_hook)
        >>> opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)
        >>> sorted(opt.state[next(ddp.parameters())])
        ['exp_avg', 'sq', 'step']
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
        self.momentum_buffer = state.layout.zeros()  # m of every coordinate, (rows, chunk) fp32
        self.steps = torch.zeros(())  # optimizer steps taken, skipped ones included (on the CPU, as torch's Adam)
        self.statistics = {key: state.layout.zeros() for key in self.rule.statistics}
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
        state.optimizer = self

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but every trainable parameter must be one the state's DDP model synchronizes."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if id(p) in self.scape.names:
                self._names[p] = self.scape.names[id(p)]
                self._install_views(p)
            elif p.requires_grad:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not synchronized by the model of "
                                 "this ScapeState (added after DDP was built, or not part of the DDP model?)")

    def _install_views(self, p: Tensor) -> None:
        layout, name = self.scape.layout, self._names[p]
        self.state[p]["step"] = self.steps  # one counter shared by every parameter
        self.state[p][MOMENTUM] = layout.view(self.momentum_buffer, name).view_as(p)
        for key, buffer in self.statistics.items():
            self.state[p][key] = layout.view(buffer, name).view_as(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, with ``m`` and the rule's statistics copied into the flat fp32 buffers."""
        super().load_state_dict(state_dict)  # AdamS keeps the saved fp32 values
        for p in self._names:
            saved = dict(self.state[p])
            self._install_views(p)
            for key, view in self.state[p].items():
                if key in saved and saved[key] is not view:
                    view.copy_(saved[key])  # the step counter is shared: every parameter saved the same

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply the synchronized gradients (dense or masked), then schedule the next masks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, names = [], []
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p not in self._names:  # frozen at construction, trainable now: DDP never syncs it
                    raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has a gradient but is not "
                                       "synchronized by the DDP model; unfreeze before wrapping in DDP")
                check_grad(p)
                params.append(p)
                names.append(self._names[p])
            groups.append((group, params))
        mask, skip = self.scape.begin_step(names)
        self.steps += 1
        beta1, beta2, eps = self._shared_hyperparameters(groups)
        if mask is None:
            self._dense(groups, skip)
        else:
            self._sparse(groups, mask, skip, len(names) == len(self._names), beta1=beta1, beta2=beta2, eps=eps)
        self.scape.end_step(self.momentum_buffer, beta1, skip)
        return loss

    def _shared_hyperparameters(self, groups: list[tuple[dict[str, Any], list[Tensor]]]) -> tuple[float, float, float]:
        found = {(*g["betas"], g["eps"]) for g, params in groups if params} or {(*self.defaults["betas"],
                                                                                 self.defaults["eps"])}
        if len(found) > 1 and not self.scape.schedule.dense:
            raise ValueError(f"ScapeAdamS needs the same betas and eps in every parameter group (got (beta1, beta2, "
                             f"eps) = {sorted(found)}); lr and weight_decay may differ per group")
        return next(iter(found))

    def _dense(self, groups: list[tuple[dict[str, Any], list[Tensor]]], skip: Tensor) -> None:
        if bool(skip):  # a warm-up step may read the device: the sparse steps never do
            return
        for group, params in groups:
            beta1, beta2 = group["betas"]
            run = adams_reference if group["foreach"] is False else adams_foreach
            run(params, [p.grad for p in params], [self.state[p][MOMENTUM] for p in params], lr=group["lr"],
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _sparse(self, groups: list[tuple[dict[str, Any], list[Tensor]]], mask: Mask, skip: Tensor,
                all_have_grad: bool, **hp: float) -> None:
        """The masked update: a fixed number of kernels per group and bucket, decided on the device."""
        scape = self.scape
        entries = mask.flat(scape.layout)
        with_grad = [p for _, params in groups for p in params]
        s = scape.gather_gradients(with_grad, entries.numel())  # the window sums, read back from p.grad
        applied = ~skip if all_have_grad else scape.entries_with_grad(with_grad, entries, ~skip)
        n = scape.mark_exchanged(entries, applied)
        m_flat = self.momentum_buffer.view(-1)
        m = m_flat.index_select(0, entries)
        stats = {k: b.view(-1).index_select(0, entries) for k, b in self.statistics.items()}
        u, m_new, stats_new = self.rule.update(s, n if n is not None else torch.ones_like(s), m, stats, **hp)
        m_flat.index_copy_(0, entries, torch.where(applied, m_new, m))
        for key, value in stats_new.items():
            self.statistics[key].view(-1).index_copy_(0, entries, torch.where(applied, value, stats[key]))
        keep = (~skip).float()
        scape.scatter_update(u.masked_fill_(~applied, 0.0))  # the bucket buffers now hold u on the mask
        for group, params in groups:
            if not params:
                continue
            if group["weight_decay"]:  # every coordinate, every applied step (1 on a skipped one)
                torch._foreach_mul_(params, keep.mul(-group["lr"] * group["weight_decay"]).add_(1.0))
            deltas = [scape.bucket_views[self._names[p]] for p in params]
            torch._foreach_add_(params, deltas, alpha=-group["lr"])
        scape.restore_gradients(s)
        scape.return_unapplied(entries, applied)
