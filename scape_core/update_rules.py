"""The masked update rule: how a sparse step moves m and theta. One pluggable piece.

On a sparse step every rank holds the same synchronized gradient ``g`` (the mean of
``grad + residual`` over ranks on the mask, zero elsewhere), the same mask and the same
momentum ``m``. A rule turns those into new ``m`` and ``theta``. Whatever it does must depend
only on replicated values, so parameters stay bit-identical on every rank.

Which rule keeps dense quality at equal bytes is the project's main open question
(``docs/benchmarks.md``); the convergence benchmark swaps rules by name through
``ScapeConfig(update=...)``. Dense steps (warm-up, ``sparsity=0``) always run plain AdamS.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from scape_core.adams import MOMENTUM


class UpdateRule(Protocol):
    """Update ``p`` and its optimizer ``state`` (holding ``exp_avg``) on a sparse step.

    ``grad`` has ``p``'s shape and is zero off ``mask`` (sorted flat indices); ``hp`` holds
    ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``. Decoupled weight decay is the
    rule's to apply. Rules may keep extra entries in ``state`` (they are checkpointed with it).
    """

    name: str

    def apply(self, p: Tensor, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> None: ...


UPDATE_RULES: dict[str, UpdateRule] = {}


def register_update_rule(rule: UpdateRule) -> UpdateRule:
    """Make ``rule`` selectable as ``ScapeConfig(update=rule.name)``; returns it.

    Example:
        >>> class Frozen:
        ...     name = "frozen"
        ...     def apply(self, p, state, grad, mask, **hp): pass
        >>> _ = register_update_rule(Frozen())
    """
    if not isinstance(getattr(rule, "name", None), str) or not callable(getattr(rule, "apply", None)):
        raise TypeError("an update rule needs a str `name` and an `apply(p, state, grad, mask, **hp)` method")
    UPDATE_RULES[rule.name] = rule
    return rule


def _flat(t: Tensor) -> Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def decay(p: Tensor, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay on every coordinate (selected or not)."""
    if weight_decay:
        p.mul_(1 - lr * weight_decay)


class LazyUpdate:
    """The contract's rule: full AdamS on the mask; m and theta frozen elsewhere (but decay)."""

    name = "lazy"

    def apply(self, p: Tensor, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> None:
        m = _flat(state[MOMENTUM])
        decay(p, hp["lr"], hp["weight_decay"])
        if not mask.numel():
            return
        g = _flat(grad).index_select(0, mask).float()
        m_sel = m.index_select(0, mask)
        v = hp["beta2"] * m_sel * m_sel + (1 - hp["beta2"]) * g * g
        m_sel.mul_(hp["beta1"]).add_(g, alpha=1 - hp["beta1"])
        m.index_copy_(0, mask, m_sel)
        step = m_sel.div_(v.sqrt_().add_(hp["eps"])).mul_(-hp["lr"])
        flat = _flat(p)
        if p.dtype == torch.float32:
            flat.index_add_(0, mask, step)
        else:  # low-precision parameter: do the sum in fp32
            flat.index_copy_(0, mask, flat.index_select(0, mask).float().add_(step).to(p.dtype))


class DenseContinuation:
    """Dense AdamS on the synchronized gradient, zero off the mask (m decays there, theta coasts)."""

    name = "dense"

    def apply(self, p: Tensor, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> None:
        from scape_core.adams import adams_reference

        adams_reference([p], [grad], [state[MOMENTUM]], lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"],
                        eps=hp["eps"], weight_decay=hp["weight_decay"])


register_update_rule(LazyUpdate())
register_update_rule(DenseContinuation())
