"""AdamS (arXiv 2505.16363): Adam whose denominator is rebuilt each step from the momentum."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scape_core.config import check_optimizer_args
from scape_core.kernels import Kernels

MOMENTUM = "exp_avg"  # optimizer-state key of m, named as in torch's Adam


def adams_reference(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamS step, one tensor at a time: the readable path the fast one is tested against."""
    for p, g, m in zip(params, grads, momenta):
        g32 = g.float()
        v = beta2 * m * m + (1 - beta2) * g32 * g32  # previous momentum, current gradient
        m.mul_(beta1).add_(g32, alpha=1 - beta1)
        wide = p.to(torch.promote_types(p.dtype, torch.float32))  # fp32 math, fp64 kept fp64
        p.copy_(wide * (1 - lr * weight_decay) - lr * m / (v.sqrt() + eps))


def adams_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The same step as :func:`adams_reference` with multi-tensor (foreach) kernels."""
    if not params:
        return
    g32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    low = [i for i, p in enumerate(params) if p.element_size() < 4]  # bf16, fp16: fp32 math, stored back
    p32 = [p.float() if i in low else p for i, p in enumerate(params)]  # fp32 and fp64 in place
    denom = torch._foreach_mul(momenta, momenta)
    torch._foreach_mul_(denom, beta2)
    torch._foreach_addcmul_(denom, g32, g32, value=1 - beta2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_lerp_(momenta, g32, 1 - beta1)  # m = beta1 m + (1 - beta1) g
    if weight_decay:
        torch._foreach_mul_(p32, 1 - lr * weight_decay)
    torch._foreach_addcdiv_(p32, momenta, denom, value=-lr)
    for i in low:  # fp32 math, stored back in the parameter's own dtype
        params[i].copy_(p32[i])


def adams_pass(params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], lr: Tensor, decay: Tensor,
               beta1: float, beta2: float, eps: float) -> None:
    """One AdamS step per tensor (``decay = 1 - lr * weight_decay``): ``m`` and ``theta`` in one loop each."""
    for p, g, m in zip(params, grads, momenta):
        g32 = g.float()
        v = beta2 * m * m + (1 - beta2) * g32 * g32  # previous m, current gradient
        m.lerp_(g32, 1 - beta1)
        p.copy_(p.float() * decay - lr * m / (v.sqrt() + eps))


def adams_compiled(kernels: Kernels, params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], *, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """:func:`adams_foreach` as :func:`adams_pass` compiled: one fused loop per tensor."""
    if params:
        cpu = torch.device("cpu")
        # one compiled copy per set of shapes and dtypes (e.g. per parameter group): dynamo keeps at most 8
        # graphs per copy, so layer-wise learning rates over many groups would exhaust a single one
        key = tuple((tuple(p.shape), p.dtype, g.dtype) for p, g in zip(params, grads))
        kernels.get("AdamS", adams_pass, hash(key))(params, grads, momenta, kernels.scalar("lr", lr, cpu),
                                                    kernels.scalar("decay", 1 - lr * weight_decay, cpu), beta1, beta2,
                                                    eps)


class AdamS(torch.optim.Optimizer):
    r"""AdamS: the second moment is rebuilt every step, so the only state is the momentum.

    .. math::
        v_t &= \beta_2 m_{t-1}^2 + (1 - \beta_2) g_t^2 \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
        \theta_t &= (1 - \eta\lambda)\,\theta_{t-1} - \eta\, m_t / (\sqrt{v_t} + \epsilon)

    No bias correction; weight decay is decoupled (as AdamW); ``m`` is kept in fp32 whatever the
    parameter dtype. Hyperparameters are AdamW's, so AdamW settings carry over.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (``>= 0``).
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the root, outside it.
        weight_decay: decoupled weight decay.
        foreach: use multi-tensor kernels (default: yes); ``False`` runs the reference path.
        kernels: ``"eager"`` (default) or ``"compiled"``: the step as one ``torch.compile``'d loop
            per tensor, reading parameter, gradient and ``m`` once and writing parameter and
            ``m`` once (:mod:`scape_core.kernels`; compiles at the first step).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamS(model.parameters(), lr=1e-3, weight_decay=0.1)
        >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        kernels: str = "eager",
    ) -> None:
        check_optimizer_args(lr, betas, eps, weight_decay)
        self.kernels = Kernels(kernels)
        defaults = dict(**_as_floats(lr, betas, eps, weight_decay), foreach=foreach)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, with the group's settings checked first: a refused group is not added."""
        given = {k: param_group.get(k, self.defaults[k]) for k in ("lr", "betas", "eps", "weight_decay")}
        check_optimizer_args(given["lr"], given["betas"], given["eps"], given["weight_decay"])
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        g.update(_as_floats(g["lr"], g["betas"], g["eps"], g["weight_decay"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but ``m`` stays fp32 (torch would cast it to a bf16 parameter's dtype)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entries in saved.items():
            for key, value in entries.items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    p = params[index]
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    def step_function(self, group: dict[str, Any]) -> Callable[..., None]:
        """The AdamS step for ``group``: the reference (``foreach=False``), foreach, or the compiled pass."""
        if group["foreach"] is False:
            return adams_reference
        return functools.partial(adams_compiled, self.kernels) if self.kernels.compiled else adams_foreach

    def momentum(self, p: Tensor) -> Tensor:
        """The fp32 momentum buffer of ``p``, created (zeros) on first use."""
        state = self.state[p]
        if MOMENTUM not in state:
            state["step"] = 0
            state[MOMENTUM] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state[MOMENTUM]

    def _grads(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        params, grads, momenta = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            check_grad(p)
            params.append(p)
            grads.append(p.grad)
            momenta.append(self.momentum(p))
            self.state[p]["step"] += 1
        return params, grads, momenta

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamS step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, momenta = self._grads(group)
            run = self.step_function(group)
            beta1, beta2 = group["betas"]
            run(params, grads, momenta, lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"])
        return loss


def _as_floats(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> dict[str, Any]:
    """Hyperparameters as Python floats (numpy scalars and ints accepted): one type in kernels and checkpoints."""
    return dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                weight_decay=float(weight_decay))


def check_grad(p: Tensor) -> None:
    """Reject gradients AdamS cannot use, naming the problem."""
    g = p.grad
    if g.is_sparse:
        raise TypeError(
            "AdamS does not support sparse gradients (e.g. nn.Embedding(sparse=True)); "
            "use a dense embedding"
        )
    if not g.is_floating_point():
        raise TypeError(f"AdamS needs floating-point gradients, got dtype {g.dtype}")
