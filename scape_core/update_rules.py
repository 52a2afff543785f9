"""The masked update rule: how a sparse step moves m and theta. One pluggable piece.

On a sparse step every rank holds the same synchronized gradient ``g`` (the mean of
``grad + residual`` over ranks on the mask, zero elsewhere), the same mask and the same
momentum ``m``. A rule turns those into new ``m`` and ``theta``. Whatever it does must depend
only on replicated values, so parameters stay bit-identical on every rank.

Which rule keeps dense quality at equal bytes is the project's main open question; the
convergence benchmark swaps rules by name through ``ScapeConfig(update=...)`` and
``docs/benchmarks.md`` ("Convergence and the masked update rule") has every rule's numbers.
Measured so far (99%, 800 steps, 3 seeds, val loss vs dense AdamS): ``lazy`` +31%, ``linear``
+17% (+9% with a sparsity ramp and the replicated ``|m| (n - 1)`` score); ``dense``,
``catchup``, ``catchup_sqrt``, ``predict`` and ``linear_per_step`` lose to ``linear``;
``linear_noise`` equals it. Dense steps (warm-up, ``sparsity=0``) always run plain AdamS.
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


# ----- candidates searched by benchmarks/convergence.py (docs/benchmarks.md has their numbers) -----
# A coordinate selected once per n steps arrives with the sum of n steps of mean gradient. The
# lazy rule normalises that sum away (about one lr-sized step per selection); these rules give
# it back its mass. Each keeps, per coordinate, the step it was last synchronized at (replicated:
# every rank sees the same masks), so the window length n is known without communication.


def window(state: dict[str, Any], mask: Tensor) -> Tensor:
    """Steps since each masked coordinate was last synchronized (>= 1), as fp32; marks them synced now.

    The residual of a coordinate holds exactly that many steps of gradient (skipped non-finite
    steps aside: they add gradient without counting), so ``grad / window`` is the window's mean
    gradient. Before the first sparse step every coordinate was synchronized by the dense warm-up.

    Example:
        >>> state = {"step": 10, MOMENTUM: torch.zeros(4)}   # first sparse step
        >>> window(state, torch.tensor([1, 2])).tolist()
        [1.0, 1.0]
        >>> state["step"] = 13
        >>> window(state, torch.tensor([2, 3])).tolist()
        [3.0, 4.0]
    """
    if "synced_at" not in state:
        state["synced_at"] = torch.full_like(state[MOMENTUM], state["step"] - 1, dtype=torch.int32)
    synced_at = _flat(state["synced_at"])
    n = (state["step"] - synced_at.index_select(0, mask)).clamp_(min=1).float()
    synced_at.index_fill_(0, mask, state["step"])
    return n


def _add(p: Tensor, mask: Tensor, step: Tensor) -> None:
    flat = _flat(p)
    if p.dtype == torch.float32:
        flat.index_add_(0, mask, step)
    else:
        flat.index_copy_(0, mask, flat.index_select(0, mask).float().add_(step).to(p.dtype))


class CatchUpUpdate:
    """Replay: a selected coordinate gets one AdamS step per step of its window, on the window mean.

    With ``n`` steps since its last sync and ``gbar = grad / n``, AdamS runs ``n`` times on
    ``gbar`` (exactly for the first ``replay`` steps; after that m has converged to gbar and
    the last step repeats). A consistent gradient moves the coordinate as far as dense AdamS
    would; ``power < 1`` scales the total by ``n ** (power - 1)`` (0.5: a random walk's reach).
    """

    replay = 16
    tracks_windows = True  # keeps ``synced_at`` in the optimizer state (see :func:`window`)

    def __init__(self, name: str = "catchup", power: float = 1.0) -> None:
        self.name, self.power = name, power

    def apply(self, p: Tensor, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> None:
        b1, b2, eps = hp["beta1"], hp["beta2"], hp["eps"]
        decay(p, hp["lr"], hp["weight_decay"])
        if not mask.numel():
            return
        n = window(state, mask)
        m_all = _flat(state[MOMENTUM])
        g = _flat(grad).index_select(0, mask).float() / n
        m = m_all.index_select(0, mask)
        total, step = torch.zeros_like(g), torch.zeros_like(g)
        for i in range(min(int(n.max()), self.replay)):
            live = n > i
            v = b2 * m * m + (1 - b2) * g * g
            m_next = b1 * m + (1 - b1) * g
            step = torch.where(live, m_next / (v.sqrt() + eps), step)
            total += torch.where(live, step, 0.0)
            m = torch.where(live, m_next, m)
        total += (n - self.replay).clamp_(min=0) * step
        if self.power != 1.0:
            total *= n.pow(self.power - 1)
        m_all.index_copy_(0, mask, m)
        _add(p, mask, total.mul_(-hp["lr"]))


class LinearUpdate:
    """Error feedback kept linear: ``theta -= lr * grad / d``, the whole synchronized sum applied.

    ``d`` approximates AdamS's denominator ``sqrt(mu^2 + c sigma^2)`` per coordinate from replicated
    statistics of the windows: ``m`` is an EMA (``beta1`` per selection) of the window means
    ``gbar = grad / n`` (estimates mu), ``sq`` an EMA (``beta2`` per selection) of ``grad^2 / n``
    (estimates ``n mu^2 + sigma^2``), and ``c = beta2 (1 - beta1) / (1 + beta1) + (1 - beta2)`` is
    the noise share AdamS's own denominator keeps. ``d >= |gbar|`` bounds a step by ``n * lr``,
    the farthest dense AdamS could go in the window. Costs one more fp32 buffer (``sq``).
    """

    tracks_windows = True

    def __init__(self, name: str = "linear", per_step: bool = False, noise_ema: bool = False) -> None:
        # candidates (docs/benchmarks.md): per_step: the EMAs decay by beta ** n over a window of
        # n steps, not by beta once per selection; noise_ema: ``sq`` holds an EMA of each window's
        # noise estimate ``s^2 / n - n m^2`` (consistent when n changes between windows)
        self.name, self.per_step, self.noise_ema = name, per_step, noise_ema

    def apply(self, p: Tensor, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> None:
        decay(p, hp["lr"], hp["weight_decay"])
        if mask.numel():
            s, d, _ = self.window_step(state, grad, mask, **hp)
            _add(p, mask, s.div_(d).mul_(-hp["lr"]))

    def window_step(self, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> tuple[Tensor, Tensor, Tensor]:
        """Updates ``m`` and ``sq`` on the mask; returns the window sums, their ``d`` and the new ``m``."""
        b1, b2 = hp["beta1"], hp["beta2"]
        n = window(state, mask)
        if "sq" not in state:
            state["sq"] = torch.zeros_like(state[MOMENTUM])
        m_all, sq_all = _flat(state[MOMENTUM]), _flat(state["sq"])
        s = _flat(grad).index_select(0, mask).float()
        gbar = s / n
        m = m_all.index_select(0, mask)
        if self.per_step:
            w1, w2 = b1 ** n, b2 ** n
            m.mul_(w1).add_(gbar * (1 - w1))
        else:
            w1, w2 = b1, b2
            m.mul_(b1).add_(gbar, alpha=1 - b1)
        sq = sq_all.index_select(0, mask)
        q = s * s / n
        if self.noise_ema:
            q = (q - n * m * m).clamp_(min=0)
        sq = torch.where(sq > 0, w2 * sq + (1 - w2) * q, q)  # first window: take it as is
        noise = sq if self.noise_ema else (sq - n * m * m).clamp_(min=0)
        c = b2 * (1 - b1) / (1 + b1) + (1 - b2)
        d = torch.maximum((m * m + c * noise).sqrt_(), gbar.abs()).add_(hp["eps"])
        m_all.index_copy_(0, mask, m)
        sq_all.index_copy_(0, mask, sq)
        return s, d, m


class PredictiveUpdate(LinearUpdate):
    """Linear, and between syncs every coordinate keeps moving at its expected rate ``lr * m / d``.

    The sync replaces the window's predicted moves by the window's actual sum, so over a window
    a coordinate still moves ``lr * grad / d`` in total (as :class:`LinearUpdate`), but the
    expected part arrives step by step instead of all at once at the next sync, and the
    gradients of the window are taken where the coordinate is heading. ``|m / d| <= 1``: no
    coordinate predicts faster than dense AdamS moves. Costs two more fp32 buffers.
    """

    def apply(self, p: Tensor, state: dict[str, Any], grad: Tensor, mask: Tensor, **hp: float) -> None:
        lr = hp["lr"]
        decay(p, lr, hp["weight_decay"])
        if "rate" not in state:  # no prediction before a coordinate's first sparse sync
            state["rate"] = torch.zeros_like(state[MOMENTUM])
            state["lr_at_sync"] = torch.zeros_like(state[MOMENTUM])
            state["lr_sum"] = 0.0
        rate, lr_at_sync = _flat(state["rate"]), _flat(state["lr_at_sync"])
        state["lr_sum"] += lr
        step = rate * -lr  # predicted move of every coordinate
        if mask.numel():
            s, d, m = self.window_step(state, grad, mask, **hp)
            # moves predicted since the last sync (this step's is not applied to the mask)
            predicted = (state["lr_sum"] - lr - lr_at_sync.index_select(0, mask)) * rate.index_select(0, mask)
            step.index_copy_(0, mask, predicted - lr * s / d)  # undo the window's predictions, apply its sum
            rate.index_copy_(0, mask, m / d)
            lr_at_sync.index_fill_(0, mask, state["lr_sum"])
        if p.dtype == torch.float32:
            _flat(p).add_(step)
        else:
            p.copy_(p.float().add_(step.view_as(p)).to(p.dtype))


register_update_rule(CatchUpUpdate())
register_update_rule(CatchUpUpdate("catchup_sqrt", power=0.5))
register_update_rule(LinearUpdate())
register_update_rule(LinearUpdate("linear_per_step", per_step=True))
register_update_rule(LinearUpdate("linear_noise", noise_ema=True))
register_update_rule(PredictiveUpdate("predict"))
