"""SCAPE's arithmetic, transcribed from the contract (docs/algorithm.md) in float64.

Nothing here imports ``scape_core``: these functions state what one optimizer step must do, so
the tests can hold the core to them. Coordinates are flat float64 tensors; ``j`` in a mask is a
flat index into its parameter.

One step of W ranks (``step``): rank r forms ``a_r = g_r + e_r``. A dense step applies AdamS to
the mean of ``a_r``; a sparse step exchanges the mean of ``a_r`` on the mask ``M`` (the window's
synchronized sum ``s``), keeps the rest in ``e_r`` and applies the masked update rule. Decoupled
weight decay touches every coordinate on every applied step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

RAMP = (0.25, 0.0625, 0.015625)  # the contract's ramp: 25%, 6.25%, 1.5625% density


def adams(theta: Tensor, m: Tensor, g: Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float) -> tuple[Tensor, Tensor]:
    """AdamS: ``v`` from the PREVIOUS momentum and the current gradient, no bias correction."""
    v = beta2 * m * m + (1 - beta2) * g * g
    m = beta1 * m + (1 - beta1) * g
    return (1 - lr * weight_decay) * theta - lr * m / (v.sqrt() + eps), m


def lazy(s: Tensor, n: Tensor, m: Tensor, sq: Tensor | None, *, beta1: float, beta2: float,
         eps: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """The contract's first rule on the mask: one AdamS step on the synchronized value."""
    v = beta2 * m * m + (1 - beta2) * s * s
    m = beta1 * m + (1 - beta1) * s
    return m / (v.sqrt() + eps), m, sq


def linear(s: Tensor, n: Tensor, m: Tensor, sq: Tensor | None, *, beta1: float, beta2: float,
           eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The ``linear`` rule on the mask: the whole window sum ``s`` over a replicated scale ``d``.

    ``m``: EMA (beta1, once per window) of window means ``s / n``; ``sq``: EMA (beta2) of
    ``s^2 / n``, the first window taken as is; ``noise = max(sq - n m^2, 0)``;
    ``c = beta2 (1 - beta1) / (1 + beta1) + (1 - beta2)``; ``d = max(sqrt(m^2 + c noise), |s / n|) + eps``.
    Returns the step ``s / d`` (``theta -= lr * step``) and the new ``m``, ``sq``.
    """
    mean = s / n
    m = beta1 * m + (1 - beta1) * mean
    q = s * s / n
    sq = q if sq is None else torch.where(sq > 0, beta2 * sq + (1 - beta2) * q, q)
    noise = (sq - n * m * m).clamp(min=0)
    c = beta2 * (1 - beta1) / (1 + beta1) + (1 - beta2)
    d = torch.maximum((m * m + c * noise).sqrt(), mean.abs()) + eps
    return s / d, m, sq


RULES = {"lazy": lazy, "linear": linear}


def density_at(step: int, *, sparsity: float, warmup_steps: int, ramp_steps: int) -> float:
    """Density of the mask used at ``step`` (a sparse step): the ramp's stage, then ``1 - sparsity``."""
    density = 1.0 - sparsity
    stages = [d for d in RAMP if d > density]
    if ramp_steps:
        stage = (step - warmup_steps) * 3 // ramp_steps
        if 0 <= stage < len(stages):
            return stages[stage]
    return density


def topk_count(size: int, density: float) -> int:
    """Coordinates a group of ``size`` exchanges: ``ceil(density * size)`` (float noise aside)."""
    return min(size, math.ceil(density * size - 1e-9))


def max_window(chunk: int, density: float, setting: int = 0) -> int:
    """The longest window before a coordinate is overdue: ``setting``, or (0) eight mean windows of a
    row of ``chunk`` at ``density``, ``8 * ceil(chunk / k)``."""
    return setting or 8 * math.ceil(chunk / topk_count(chunk, density))


def age_momentum_score(m: Tensor, last_sync: Tensor, target: int, limit: int | None = None) -> Tensor:
    """``|m| (n - 1)``, ``n = target - last_sync`` the window the coordinate will have at ``target``; a
    window past ``limit`` is overdue: its ``|m|`` reads as ``2^100`` (above every other, the longest first)."""
    n = (target - last_sync).double()
    weight = m.abs().double()
    if limit is not None:
        weight = torch.where(n > limit, 2.0 ** 100, weight)
    return weight * (n - 1)


def momentum_residual_score(m: Tensor, residual: Tensor, beta1: float) -> Tensor:
    """The contract's first score: ``|beta1 m + (1 - beta1) e_r|`` (reads rank r's residual)."""
    return (beta1 * m + (1 - beta1) * residual).abs()


def topk_violation(score: Tensor, picked: Tensor, k: int, excluded: Tensor | None) -> float:
    """How far ``picked`` is from being the ``k`` best of ``score``, excluded coordinates last.

    0 when every pick scores at least as high as every coordinate left out (ties allowed), the
    count is ``k`` and no excluded coordinate was taken while a free one was left; otherwise the
    largest relative shortfall (a wrong count or an avoidable excluded pick is ``inf``).
    """
    if picked.numel() != k or picked.unique().numel() != k:
        return math.inf
    free = torch.ones(score.numel(), dtype=torch.bool)
    if excluded is not None:
        free[excluded] = False
    taken = torch.zeros_like(free)
    taken[picked] = True
    if int(free.sum()) >= k:  # only free coordinates, the best of them
        if (taken & ~free).any():
            return math.inf
        inside, outside = taken, free & ~taken
    else:  # every free coordinate, then the best of the excluded ones
        if (free & ~taken).any():
            return math.inf
        inside, outside = taken & ~free, ~free & ~taken
    if not inside.any() or not outside.any():
        return 0.0
    gap = float(score[outside].max() - score[inside].min())
    return max(0.0, gap / max(float(score[outside].max().abs()), 1e-30))


def group_bounds(size: int, k: int) -> list[tuple[int, int]]:
    """``selection="groups"``: ``k`` contiguous groups of a row of ``size``, the first ``size % k`` one
    coordinate wider (written out, not the core's arithmetic)."""
    bounds, lo = [], 0
    for i in range(k):
        width = size // k + (1 if i < size % k else 0)
        bounds.append((lo, lo + width))
        lo += width
    assert lo == size
    return bounds


def groups_violation(score: Tensor, picked: Tensor, k: int, excluded: Tensor | None) -> float:
    """How far ``picked`` is from one best pick per group of ``score`` (float64), excluded coordinates
    taken only where a group has nothing else: 0 when each pick scores at least every other
    candidate of its group (ties allowed); ``inf`` for a wrong count, two picks in a group or an
    avoidable excluded pick; else the largest relative shortfall."""
    if picked.numel() != k:
        return math.inf
    free = torch.ones(score.numel(), dtype=torch.bool)
    if excluded is not None:
        free[excluded] = False
    worst = 0.0
    for lo, hi in group_bounds(score.numel(), k):
        inside = picked[(picked >= lo) & (picked < hi)]
        if inside.numel() != 1:
            return math.inf
        candidates = torch.arange(lo, hi)
        if free[lo:hi].any():
            if not free[inside].all():
                return math.inf
            candidates = candidates[free[lo:hi]]
        best = float(score[candidates].double().max())
        gap = best - float(score[inside].double().max())
        worst = max(worst, gap / max(abs(best), 1e-30))
    return worst


def step(before: list[dict], grads: list[dict[str, Tensor]], mask: dict[str, Tensor] | None, *, rule: str,
         lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
         error_feedback: bool = True, wire: torch.dtype | None = None,
         exchanged: dict[str, Tensor] | None = None) -> list[dict]:
    """One SCAPE step of every rank; ``before[r]`` as ``tests.probe.snapshot`` returns it.

    ``wire``: the dtype values travel in (``None``: exact). Rank r sends ``a_r`` (``a_r[M]`` on
    a sparse step) rounded to it and keeps the rounding in its residual; the mean is the
    rounded sum of the rounded ``sent_r / W``. ``exchanged``: on a sparse step, the mean an
    encoded wire delivered on the mask (checked against :func:`encoded_exchange`); each rank's
    residual there is then ``a_r - s``, whose mean is what conservation requires (how the rounding
    splits among ranks is the wire's). Returns each rank's expected state after the step.
    """
    world = len(before)
    t = before[0]["step"]
    hp = dict(beta1=beta1, beta2=beta2, eps=eps)
    after = [{"step": t + 1, "param": {}, "m": {}, "sq": {}, "last_sync": {}, "residual": {}} for _ in range(world)]
    for name, theta in before[0]["param"].items():
        a = [before[r]["residual"][name] + grads[r][name].double() for r in range(world)]
        mean = sum(a) / world if wire is None else _wire_mean([x.to(wire).double() for x in a], wire)
        m = before[0]["m"][name]
        if mask is None:  # dense: AdamS on the mean, residuals emptied
            theta, m = adams(theta, m, mean, lr=lr, weight_decay=weight_decay, **hp)
            for r in range(world):
                after[r]["param"][name], after[r]["m"][name] = theta, m
                after[r]["residual"][name] = torch.zeros_like(theta)
            continue
        idx = mask[name]
        sent = [a_r[idx] if wire is None else a_r[idx].to(wire).double() for a_r in a]
        s = sum(sent) / world if wire is None else _wire_mean(sent, wire)
        if exchanged is not None:  # an encoded wire: the delivered mean is given, each rank keeps a_r - s
            s = exchanged[name]
            sent = [s] * world
        last = before[0]["last_sync"].get(name)
        last = torch.full_like(theta, t - 1, dtype=torch.int64) if last is None else last.clone()
        n = (t - last[idx]).double()
        sq_all = before[0]["sq"].get(name)
        sq = None if sq_all is None else sq_all[idx]
        delta, m_new, sq_new = RULES[rule](s, n, m[idx], sq, **hp)
        theta = (1 - lr * weight_decay) * theta  # every coordinate, selected or not
        theta[idx] -= lr * delta
        m = m.clone()
        m[idx] = m_new
        last[idx] = t
        if sq_new is not None:
            sq_all = torch.zeros_like(theta) if sq_all is None else sq_all.clone()
            sq_all[idx] = sq_new
        for r in range(world):
            after[r]["param"][name], after[r]["m"][name] = theta, m
            after[r]["last_sync"][name] = last
            if sq_all is not None:
                after[r]["sq"][name] = sq_all
            e = a[r].clone() if error_feedback else torch.zeros_like(theta)
            e[idx] = a[r][idx] - sent[r] if error_feedback else 0.0
            after[r]["residual"][name] = e
    return after


def _wire_mean(sent: list[Tensor], wire: torch.dtype) -> Tensor:
    """The all-reduced mean of values that travel in ``wire``: each ``sent_r / W`` rounded, then their sum."""
    total = sum(x.div(len(sent)).to(wire).double() for x in sent)
    return total.to(wire).double()


QMAX = {"int8": 127, "int4": 7}  # integer wires: values round to qmax steps of max|x| / qmax per block


def encoded_exchange(a: list[Tensor], owner: Tensor, block: Tensor, wire: str) -> tuple[Tensor, Tensor, Tensor]:
    """What an encoded wire may deliver for one bucket's compact buffer (``scape_core/wire.py``'s contract).

    ``a[r]``: rank r's ``a_r`` at the buffer's positions (float64); ``owner[i]``: the rank that
    reduces position ``i``; ``block[i]``: its scale block. Rank r sends each value rounded to its
    block's grid (step ``max|a_r| / qmax`` over the block; bf16: 8 significant bits), so within
    half a step; the owner rounds the mean of what was sent to its block's grid again. Returns
    the exact mean, the bound on ``|applied - mean|``, and per rank the bound on what it keeps
    on the mask (its own rounding, plus ``W`` times the second rounding where it is the owner).
    """
    world = len(a)
    x = torch.stack(a)  # (W, E)
    mean = x.mean(0)
    if wire == "bfloat16":
        half1 = x.abs() * 2.0 ** -8
    else:
        peak = torch.zeros(world, int(block.max()) + 1, dtype=x.dtype).scatter_reduce(1, block.expand(world, -1),
                                                                                     x.abs(), "amax")
        half1 = peak[:, block] / QMAX[wire] / 2
    off1 = half1.sum(0) / world  # how far the mean of what was sent may be from the mean
    reach = mean.abs() + off1
    if wire == "bfloat16":
        half2 = reach * 2.0 ** -8
    else:
        top = torch.zeros(int(block.max()) + 1, dtype=x.dtype).scatter_reduce(0, block, reach, "amax")
        half2 = top[block] / QMAX[wire] / 2
    keep = half1 + world * half2 * (owner[None, :] == torch.arange(world)[:, None])
    return mean, off1 + half2, keep
