"""Masked update rules that lost in ``docs/benchmarks.md``, kept selectable for the convergence benchmark.

Importing this module registers them (``ScapeConfig(update=...)``); the core ships only
``linear`` and ``lazy``. Every rule here follows :class:`scape_core.update_rules.UpdateRule`:
pure arithmetic on a sparse step's entries. Two earlier candidates are gone with the old
per-parameter interface, their numbers stay in the docs: ``dense`` (AdamS on the sparse
gradient everywhere: worst of all) and ``predict`` (``linear`` plus a predicted move of every
coordinate between exchanges: +18%); they touched every coordinate, not only the mask's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scape_core.update_rules import LinearUpdate, register_update_rule


class CatchUpUpdate:
    """Replay: a selected coordinate gets one AdamS step per step of its window, on the window mean.

    With ``n`` steps since its last exchange and ``gbar = s / n``, AdamS runs ``n`` times on
    ``gbar`` (exactly for the first ``replay`` steps; then m has converged and the last step
    repeats). ``power < 1`` scales the total by ``n ** (power - 1)`` (0.5: a random walk's reach).
    """

    replay = 16
    statistics: tuple[str, ...] = ()
    uses_windows = True
    default_score = "age_momentum"

    def __init__(self, name: str = "catchup", power: float = 1.0) -> None:
        self.name, self.power = name, power

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        g = s / n
        total, step = torch.zeros_like(g), torch.zeros_like(g)
        longest = int(n.max()) if n.numel() else 0  # benchmark code: reads the device once per step
        for i in range(min(longest, self.replay)):
            live = n > i
            v = beta2 * m * m + (1 - beta2) * g * g
            m_next = beta1 * m + (1 - beta1) * g
            step = torch.where(live, m_next / (v.sqrt() + eps), step)
            total += torch.where(live, step, 0.0)
            m = torch.where(live, m_next, m)
        total += (n - self.replay).clamp(min=0) * step
        if self.power != 1.0:
            total *= n.pow(self.power - 1)
        return total, m, stats


class LinearVariant(LinearUpdate):
    """``linear`` with one change: ``per_step`` decays the EMAs by ``beta ** n`` over a window of
    ``n`` steps (not ``beta`` once per window); ``noise_ema`` keeps in ``sq`` an EMA of each
    window's noise estimate ``s^2 / n - n m^2``; ``keep_d`` also stores each coordinate's last
    ``d`` (the simulator's ``gain`` and ``pending`` scores read it)."""

    def __init__(self, name: str, per_step: bool = False, noise_ema: bool = False, keep_d: bool = False) -> None:
        self.name, self.per_step, self.noise_ema = name, per_step, noise_ema
        self.statistics = ("sq", "d") if keep_d else ("sq",)

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        gbar = s / n
        w1, w2 = (beta1 ** n, beta2 ** n) if self.per_step else (beta1, beta2)
        m = w1 * m + (1 - w1) * gbar
        q = s * s / n
        if self.noise_ema:
            q = (q - n * m * m).clamp(min=0)
        sq = stats["sq"]
        sq = torch.where(sq > 0, w2 * sq + (1 - w2) * q, q)
        noise = sq if self.noise_ema else (sq - n * m * m).clamp(min=0)
        c = beta2 * (1 - beta1) / (1 + beta1) + (1 - beta2)
        d = torch.maximum((m * m + c * noise).sqrt(), gbar.abs()) + eps
        out = {"sq": sq, "d": d} if "d" in self.statistics else {"sq": sq}
        return s / d, m, out


register_update_rule(CatchUpUpdate())
register_update_rule(CatchUpUpdate("catchup_sqrt", power=0.5))
register_update_rule(LinearVariant("linear_per_step", per_step=True))
register_update_rule(LinearVariant("linear_noise", noise_ema=True))
register_update_rule(LinearVariant("linear_keep_d", keep_d=True))
