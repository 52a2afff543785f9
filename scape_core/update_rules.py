r"""The masked update rule: how a sparse step moves ``m`` and ``theta`` on the mask.

On a sparse step every rank holds the same synchronized sum ``s`` on the mask (the mean over
ranks of ``grad + residual``: the whole window of gradient since the coordinate's last
exchange), the same window lengths ``n``, the same ``m`` and the same rule statistics. A rule
maps those, entry by entry, to the step ``u`` (``theta -= lr * u``) and the new ``m`` and
statistics. It sees only replicated values, so parameters stay bit-identical on every rank.
The optimizer gathers the entries, applies decoupled weight decay to every coordinate, writes
the results back and leaves everything as it was on a skipped step: a rule is pure arithmetic.

Shipped rules:

- ``linear`` (default): :math:`u = s / d`, the whole window sum over a replicated AdamS-like
  scale :math:`d = \max(\sqrt{m^2 + c\,\mathrm{noise}}, |s/n|) + \epsilon`, where ``m`` is an EMA
  (:math:`\beta_1`, once per window) of window means :math:`s/n`, ``sq`` an EMA (:math:`\beta_2`)
  of :math:`s^2/n` (the first window taken as is), :math:`\mathrm{noise} = \max(sq - n m^2, 0)`
  and :math:`c = \beta_2 (1 - \beta_1)/(1 + \beta_1) + (1 - \beta_2)`, the noise share AdamS's
  own denominator keeps. :math:`d \ge |s/n|` bounds a window's move by ``n`` lr-sized steps.
- ``lazy`` (the contract's first reading): one AdamS step on ``s``:
  :math:`v = \beta_2 m^2 + (1-\beta_2) s^2`, :math:`m \leftarrow \beta_1 m + (1-\beta_1) s`,
  :math:`u = m / (\sqrt v + \epsilon)`. It normalises away the size of a window's sum and loses
  20-31% validation loss in ``docs/benchmarks.md``; kept as the documented alternative.

Other rules (the candidates measured in ``docs/benchmarks.md``) live in ``benchmarks/`` and
register themselves with :func:`register_update_rule`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class UpdateRule(Protocol):
    """What the core needs from a masked update rule.

    Attributes:
        name: the name ``ScapeConfig(update=...)`` selects it by.
        statistics: names of the extra fp32 values the rule keeps per coordinate (checkpointed
            with the optimizer, e.g. ``("sq",)``); the optimizer allocates them.
        uses_windows: whether :meth:`update` reads the window lengths ``n`` (otherwise it gets ones).
        default_score: the mask score ``ScapeConfig(score="auto")`` resolves to for this rule.
    """

    name: str
    statistics: tuple[str, ...]
    uses_windows: bool
    default_score: str

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Entries of one sparse step (1-D fp32) -> ``(u, new m, new statistics)``; inputs stay untouched."""
        ...


UPDATE_RULES: dict[str, UpdateRule] = {}


def register_update_rule(rule: UpdateRule) -> UpdateRule:
    """Make ``rule`` selectable as ``ScapeConfig(update=rule.name)``; returns it.

    Example:
        >>> class SignSGD:
        ...     name, statistics, uses_windows, default_score = "sign", (), False, "momentum"
        ...     def update(self, s, n, m, stats, *, beta1, beta2, eps):
        ...         return s.sign(), m, stats
        >>> _ = register_update_rule(SignSGD())
    """
    for attr, kind in (("name", str), ("statistics", tuple), ("uses_windows", bool), ("default_score", str)):
        if not isinstance(getattr(rule, attr, None), kind):
            raise TypeError(f"an update rule needs `{attr}` ({kind.__name__}); see scape_core.update_rules.UpdateRule")
    if not callable(getattr(rule, "update", None)):
        raise TypeError("an update rule needs an `update(s, n, m, stats, *, beta1, beta2, eps)` method")
    UPDATE_RULES[rule.name] = rule
    return rule


class LazyUpdate:
    """The contract's rule: one AdamS step per exchange on the synchronized value."""

    name = "lazy"
    statistics: tuple[str, ...] = ()
    uses_windows = False
    default_score = "momentum_residual"

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        v = torch.addcmul(m * m * beta2, s, s, value=1 - beta2)  # previous m, current value
        m = torch.lerp(m, s, 1 - beta1)
        return m / v.sqrt_().add_(eps), m, stats


class LinearUpdate:
    """The default rule: the whole window sum ``s`` over a replicated scale ``d`` (module docstring)."""

    name = "linear"
    statistics: tuple[str, ...] = ("sq",)
    uses_windows = True
    default_score = "age_momentum"

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        mean = s / n
        m = torch.lerp(m, mean, 1 - beta1)
        q = s * mean  # s^2 / n
        sq = stats["sq"]
        sq = torch.where(sq > 0, torch.lerp(sq, q, 1 - beta2), q)  # the first window: taken as is
        noise = torch.addcmul(sq, n * m, m, value=-1.0).clamp_(min=0)  # sq - n m^2
        c = beta2 * (1 - beta1) / (1 + beta1) + (1 - beta2)
        d = torch.maximum(torch.add(m * m, noise, alpha=c).sqrt_(), mean.abs_()).add_(eps)
        return s / d, m, {"sq": sq}


register_update_rule(LazyUpdate())
register_update_rule(LinearUpdate())
